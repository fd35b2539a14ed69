"""What a cold ``prepare_gradient`` on ``AutoCompile`` costs next to raw ``torch.compile``.

Each contender runs in a fresh process with an empty inductor cache and one compile thread, and
is timed by the CPU time of that process and of the C++ compilers it runs (what other jobs on a
shared machine cannot inflate), and by the wall clock:

- ``torchdi``: ``prepare_gradient`` (the traced graph compiled with and without the value), then
  one ``gradient`` and one ``value_and_gradient`` call;
- ``torchdi-one-program``: the same with the value-free copy's fast path off (one program serves
  both calls, as before issue 27);
- ``raw-grad``: ``torch.compile(torch.func.grad(f))`` and its first call;
- ``raw-grad+gv``: that and ``torch.compile(torch.func.grad_and_value(f))``, what a loop calling
  both would compile.

Run: ``python benchmarks/cold_prepare.py [--rounds 2] [--scenarios rosenbrock,mlp]``.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any

CONTENDERS = ("torchdi", "torchdi-one-program", "raw-grad", "raw-grad+gv")
SCENARIOS = ("rosenbrock", "mlp")


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _problem(scenario: str) -> tuple[Any, Any, tuple[Any, ...]]:
    import torch

    g = torch.Generator().manual_seed(0)
    if scenario == "rosenbrock":

        def rosenbrock(x: Any) -> Any:
            return (100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2).sum()

        return rosenbrock, torch.rand(1_000_000, generator=g), ()

    def mlp(x: Any, w1: Any, b1: Any, w2: Any) -> Any:
        return (w2 @ torch.tanh(w1 @ x + b1)).sum()

    weights = (torch.randn(64, 32, generator=g), torch.randn(64, generator=g), torch.randn(1, 64, generator=g))
    return mlp, torch.randn(32, generator=g), weights


def child(scenario: str, contender: str) -> None:
    """One measurement (in its own process): prints ``wall cpu`` seconds."""
    import torch

    import torchdi as td
    from torchdi.engines import _dynamo

    torch.set_num_threads(1)
    f, x, contexts = _problem(scenario)
    start, cpu = time.perf_counter(), _cpu_seconds()
    if contender.startswith("torchdi"):
        if contender == "torchdi-one-program":
            _dynamo._GRAPH_COPY = None  # the fast path off: one program serves both calls
        backend = td.AutoCompile()
        wrapped = tuple(td.Constant(c) for c in contexts)
        prep = td.prepare_gradient(f, backend, x, *wrapped)
        td.gradient(f, backend, x, *wrapped, prep=prep)
        td.value_and_gradient(f, backend, x, *wrapped, prep=prep)
        assert prep.num_compilations == 1
    else:
        torch.compile(torch.func.grad(f), fullgraph=True)(x, *contexts)
        if contender == "raw-grad+gv":
            torch.compile(torch.func.grad_and_value(f), fullgraph=True)(x, *contexts)
    print(f"{time.perf_counter() - start:.2f} {_cpu_seconds() - cpu:.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(*args.child)
        return 0
    rows: dict[tuple[str, str], list[str]] = {}
    for _ in range(args.rounds):  # interleaved: every contender once per round
        for scenario in args.scenarios.split(","):
            for contender in CONTENDERS:
                with tempfile.TemporaryDirectory() as cache:
                    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TORCHDI_CACHE_DIR": "",
                           "TORCHINDUCTOR_COMPILE_THREADS": "1", "OMP_NUM_THREADS": "1"}
                    out = subprocess.run([sys.executable, __file__, "--child", scenario, contender], env=env,
                                         capture_output=True, text=True, check=True).stdout.split()
                wall, cpu = out[-2:]
                rows.setdefault((scenario, contender), []).append(f"{cpu} ({wall})")
                print(f"{scenario} {contender}: cpu {cpu} s, wall {wall} s", file=sys.stderr, flush=True)
    print("| scenario | " + " | ".join(CONTENDERS) + " |")
    print("|---|" + "---:|" * len(CONTENDERS))
    for scenario in args.scenarios.split(","):
        print(f"| {scenario} | " + " | ".join(" / ".join(rows[(scenario, c)]) for c in CONTENDERS) + " |")
    print("(CPU seconds of the process and its C++ compilers, wall seconds in brackets, one column entry per round)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
