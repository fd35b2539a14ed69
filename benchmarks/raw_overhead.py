"""The interface's own cost: a prepared torchdi call vs the raw torch call it wraps.

    .venv/bin/python benchmarks/raw_overhead.py [--rounds 15]
    python -m torchdi bench --suite raw-overhead

On the overhead-bound scenarios (``mlp-small`` value_and_gradient, ``hvp-1000``), times
``torchdi.value_and_gradient(..., prep=prep)`` / ``torchdi.hvp(..., prep=prep)`` on
``AutoAutograd`` and ``AutoFunc`` against hand-written ``torch.autograd.grad`` and
``torch.func`` code computing the same thing, in interleaved rounds (median of each). The
difference is what torchdi adds per call: the strict signature check, context unwrapping and
tangent batching.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.func import grad, grad_and_value, jvp

import torchdi
from torchdi.testing import benchmark_scenarios


def _per_call(fn: Callable[[], Any], min_time: float = 0.02) -> Callable[[], float]:
    for _ in range(5):
        fn()
    start = time.perf_counter()
    fn()
    number = max(1, int(min_time / max(time.perf_counter() - start, 1e-7)))

    def measure() -> float:
        start = time.perf_counter()
        for _ in range(number):
            fn()
        return (time.perf_counter() - start) / number

    return measure


def cases() -> dict[str, dict[str, Callable[[], Any]]]:
    by_name = {s.name: s for s in benchmark_scenarios()}
    mlp, hv = by_name["mlp-small"], by_name["hvp-1000"]
    w, (inputs, targets) = mlp.x, (c.value for c in mlp.contexts)
    f = mlp.f
    ctx = mlp.contexts
    preps = {b: torchdi.prepare_gradient(f, b, w, *ctx) for b in (torchdi.AutoAutograd(), torchdi.AutoFunc())}

    def raw_autograd_gradient() -> Any:
        with torch.enable_grad():
            w_ = w.detach().requires_grad_()
            y = f(w_, inputs, targets)
            (g,) = torch.autograd.grad(y, w_)
        return y.detach(), g

    def raw_func_gradient() -> Any:
        g, y = grad_and_value(lambda w_: f(w_, inputs, targets))(w)
        return y, g

    x, (t,) = hv.x, hv.tangents
    g_ = hv.f
    hvp_preps = {b: torchdi.prepare_hvp(g_, b, x, (t,)) for b in (torchdi.AutoAutograd(), torchdi.AutoFunc())}

    def raw_autograd_hvp() -> Any:
        with torch.enable_grad():
            x_ = x.detach().requires_grad_()
            (gx,) = torch.autograd.grad(g_(x_), x_, create_graph=True)
            (h,) = torch.autograd.grad(gx, x_, t)
        return h

    def raw_func_hvp() -> Any:
        return jvp(grad(g_), (x,), (t,))[1]

    a, fn = torchdi.AutoAutograd(), torchdi.AutoFunc()
    return {
        "mlp-small value_and_gradient": {
            "torch.autograd.grad": raw_autograd_gradient,
            "torchdi AutoAutograd": lambda: torchdi.value_and_gradient(f, a, w, *ctx, prep=preps[a]),
            "torch.func.grad_and_value": raw_func_gradient,
            "torchdi AutoFunc": lambda: torchdi.value_and_gradient(f, fn, w, *ctx, prep=preps[fn]),
        },
        "hvp-1000 hvp": {
            "torch.autograd.grad x2": raw_autograd_hvp,
            "torchdi AutoAutograd": lambda: torchdi.hvp(g_, a, x, (t,), prep=hvp_preps[a]),
            "torch.func jvp(grad)": raw_func_hvp,
            "torchdi AutoFunc": lambda: torchdi.hvp(g_, fn, x, (t,), prep=hvp_preps[fn]),
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--markdown", metavar="FILE", help="also write the table as markdown (the docs include it)")
    args = parser.parse_args(argv)
    print(f"{'scenario':<30} {'implementation':<28} {'median per call':>16}")
    rows = []
    for scenario, impls in cases().items():
        measures = {name: _per_call(fn) for name, fn in impls.items()}
        samples: dict[str, list[float]] = {name: [] for name in impls}
        for r in range(args.rounds):
            names = list(measures)
            for name in names[r % len(names):] + names[: r % len(names)]:
                samples[name].append(measures[name]())
        for name, values in samples.items():
            rows.append((scenario, name, statistics.median(values) * 1e6))
            print(f"{scenario:<30} {name:<28} {rows[-1][2]:>13.1f} us")
        print()
    if args.markdown:
        lines = [
            "### `benchmarks/raw_overhead.py`",
            "",
            f"torch {torch.__version__}, torch threads: {torch.get_num_threads()}; medians of {args.rounds} interleaved rounds.",
            "",
            "| scenario | implementation | median per call |",
            "|---|---|---:|",
            *[f"| {scenario} | {name} | {us:.1f} us |" for scenario, name, us in rows],
        ]
        with open(args.markdown, "w") as file:
            file.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
