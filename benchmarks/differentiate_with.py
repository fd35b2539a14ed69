"""What ``DifferentiateWith`` costs and buys in a training step (forward + ``backward()``).

    .venv/bin/python benchmarks/differentiate_with.py [--rounds 15] [--compiler inductor] [--threads 1] [--clock cpu]

1. Overhead, on a small piece (a 64x64 tanh layer on a batch of 32): plain eager autograd through
   the piece; the ``torch.autograd.Function`` a user would write by hand for "forward without a
   graph, backward by re-running the piece under autograd" (what ``DifferentiateWith`` does with
   ``AutoAutograd``); and ``DifferentiateWith`` with ``AutoAutograd`` and ``AutoFunc``.
2. A compiled piece: a bandwidth-bound elementwise chain on 2**20 floats, eager vs
   ``DifferentiateWith(piece, AutoCompile(compiler=...))`` (the backward compiled, the forward eager).

Interleaved rounds, median per step; ratios are to eager autograd in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import torchdi as td


def _per_call(fn: Callable[[], Any], clock: Callable[[], float], min_time: float = 0.02) -> Callable[[], float]:
    for _ in range(5):
        fn()
    start = clock()
    fn()
    number = max(1, int(min_time / max(clock() - start, 1e-7)))

    def measure() -> float:
        start = clock()
        for _ in range(number):
            fn()
        return (clock() - start) / number

    return measure


class _HandWritten(torch.autograd.Function):
    """The by-hand baseline: value without a graph, backward re-runs the piece under autograd."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.w = w
        return torch.tanh(x @ w)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, None]:
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x_ = x.detach().requires_grad_()
            (dx,) = torch.autograd.grad(torch.tanh(x_ @ ctx.w), x_, dy)
        return dx, None


def step(piece: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> Callable[[], Any]:
    def run() -> Any:
        x.grad = None
        piece(x).square().mean().backward()
        return x.grad

    return run


def cases(compiler: str) -> dict[str, dict[str, Callable[[], Any]]]:
    w = torch.randn(64, 64) / 8
    x = torch.randn(32, 64, requires_grad=True)

    def layer(h: torch.Tensor, w_: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h @ w_)

    with_autograd = td.DifferentiateWith(layer, td.AutoAutograd())
    with_func = td.DifferentiateWith(layer, td.AutoFunc())

    def chain(h: torch.Tensor) -> torch.Tensor:
        return (torch.sigmoid(h) * torch.tanh(h * 0.5) + torch.exp(-h * h)).sin()

    big = torch.randn(2**20, requires_grad=True)
    compiled = td.DifferentiateWith(chain, td.AutoCompile(compiler=compiler))
    return {
        "tanh layer 32x64x64 step": {
            "eager autograd": step(lambda h: layer(h, w), x),
            "hand-written Function": step(lambda h: _HandWritten.apply(h, w), x),
            "DifferentiateWith AutoAutograd": step(lambda h: with_autograd(h, td.Constant(w)), x),
            "DifferentiateWith AutoFunc": step(lambda h: with_func(h, td.Constant(w)), x),
        },
        "elementwise chain 2**20 step": {
            "eager autograd": step(chain, big),
            f"DifferentiateWith AutoCompile({compiler})": step(compiled, big),
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--compiler", default="inductor")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: stable medians on a shared machine)")
    parser.add_argument(
        "--clock", choices=["cpu", "wall"], default="cpu",
        help="cpu: this process's CPU time, steady when other jobs share the cores (with one thread it is the "
        "wall time of an idle machine); wall: time.perf_counter",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(f"{'scenario':<30} {'implementation':<36} {'median per step (' + args.clock + ')':>22} {'vs eager':>9}")
    for scenario, impls in cases(args.compiler).items():
        measures = {name: _per_call(fn, clock) for name, fn in impls.items()}
        samples: dict[str, list[float]] = {name: [] for name in impls}
        for r in range(args.rounds):
            names = list(measures)
            for name in names[r % len(names):] + names[: r % len(names)]:
                samples[name].append(measures[name]())
        eager = statistics.median(samples["eager autograd"])
        for name, values in samples.items():
            median = statistics.median(values)
            print(f"{scenario:<30} {name:<36} {median * 1e6:>19.1f} us {median / eager:>8.2f}x")
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
