"""Non-scalar hessians and same-point HVPs: torchdi against torch.func, measured in one run.

Rows (medians of interleaved repeats, one thread, ratios against the reference in the same run):

- ``hessian of a vector f``: the torch.func tutorial's predictor ``tanh(W x + b)`` (16 outputs),
  ``td.hessian`` on AutoFunc and AutoCompile against ``torch.func.hessian``.
- ``200 HVPs at one point``: ``prepare_hvp_same_point`` against the ordinary ``prepare_hvp`` on
  AutoFunc and AutoCompile (a new tangent per call, the same x).

Usage::

    OMP_NUM_THREADS=1 python benchmarks/operators_general.py [--compiler inductor] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import torchdi as td


def _median_times(calls: dict[str, Callable[[], object]], repeats: int, inner: int) -> dict[str, float]:
    """Median seconds per call of each entry, repeats interleaved so drifts hit all alike."""
    for call in calls.values():  # warm up
        call()
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            for _ in range(inner):
                call()
            samples[name].append((time.perf_counter() - start) / inner)
    return {name: statistics.median(s) for name, s in samples.items()}


def hessian_rows(compiler: str, repeats: int) -> list[str]:
    torch.manual_seed(0)
    d = 16
    weight, bias, x = torch.randn(d, d), torch.randn(d), torch.randn(d)

    def predict(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight, bias).tanh()

    reference = torch.func.hessian(predict)
    func, compiled = td.AutoFunc(), td.AutoCompile(compiler=compiler)
    contexts = (td.Constant(weight), td.Constant(bias))
    prep_func = td.prepare_hessian(predict, func, x, *contexts)
    prep_compiled = td.prepare_hessian(predict, compiled, x, *contexts)
    expected = reference(x, weight, bias)
    torch.testing.assert_close(td.hessian(predict, func, x, *contexts, prep=prep_func), expected)
    torch.testing.assert_close(td.hessian(predict, compiled, x, *contexts, prep=prep_compiled), expected, atol=1e-5, rtol=1e-5)
    times = _median_times(
        {
            "torch.func.hessian": lambda: reference(x, weight, bias),
            "AutoFunc": lambda: td.hessian(predict, func, x, *contexts, prep=prep_func),
            "AutoCompile": lambda: td.hessian(predict, compiled, x, *contexts, prep=prep_compiled),
        },
        repeats,
        inner=20,
    )
    base = times["torch.func.hessian"]
    return [
        f"| hessian of tanh(W x + b), 16x16x16 | {name} | {t * 1e6:.0f} us | {t / base:.2f}x torch.func.hessian |"
        for name, t in times.items()
    ]


def same_point_rows(compiler: str, repeats: int, count: int = 200) -> list[str]:
    torch.manual_seed(0)
    n, batch, width = 64, 512, 16
    a = torch.randn(batch, n) / n**0.5  # a batch of data; x: the weights of one tanh layer

    def f(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return (torch.tanh(a @ x) ** 2).mean() + (x**4).sum() / x.numel()

    x = torch.randn(n, width)
    tangents = [(torch.randn(n, width),) for _ in range(count)]
    rows = []
    for backend in (td.AutoFunc(), td.AutoCompile(compiler=compiler)):
        prep = td.prepare_hvp(f, backend, x, tangents[0], td.Constant(a))
        same = td.prepare_hvp_same_point(f, backend, x, tangents[0], td.Constant(a))
        for tx in tangents[:3]:
            torch.testing.assert_close(
                td.hvp(f, backend, x, tx, td.Constant(a), prep=same)[0],
                td.hvp(f, backend, x, tx, td.Constant(a), prep=prep)[0],
                atol=1e-5,
                rtol=1e-5,
            )

        def ordinary(backend: td.Backend = backend, prep: td.Prep = prep) -> None:
            for tx in tangents:
                td.hvp(f, backend, x, tx, td.Constant(a), prep=prep)

        def same_point(backend: td.Backend = backend, same: td.Prep = same) -> None:
            for tx in tangents:
                td.hvp(f, backend, x, tx, td.Constant(a), prep=same)

        times = _median_times({"prepare_hvp": ordinary, "prepare_hvp_same_point": same_point}, repeats, inner=1)
        name = type(backend).__name__
        speedup = times["prepare_hvp"] / times["prepare_hvp_same_point"]
        rows.append(
            f"| {count} HVPs at one point, tanh layer {n}x{width}, batch {batch} | {name} | {times['prepare_hvp'] * 1e3:.1f} ms -> "
            f"{times['prepare_hvp_same_point'] * 1e3:.1f} ms | {speedup:.2f}x faster with the same-point prep |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compiler", default="inductor")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--only", choices=["hessian", "same-point"], default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| case | backend | time | ratio |")
    print("|---|---|---|---|")
    if args.only in (None, "hessian"):
        for row in hessian_rows(args.compiler, args.repeats):
            print(row, flush=True)
    if args.only in (None, "same-point") and hasattr(td, "prepare_hvp_same_point"):
        for row in same_point_rows(args.compiler, args.repeats):
            print(row, flush=True)


if __name__ == "__main__":
    main()
