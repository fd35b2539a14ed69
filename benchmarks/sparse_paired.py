"""Paired per-round ratios of the prepared ``AutoSparse(AutoCompile())`` call against asdex's jitted call.

``benchmarks/sparse.py`` reports medians of each contender; on a shared machine asdex's own median
can move several-fold between runs, so a single ratio of medians misleads. This script times both
(and the dense prepared call where it fits) in many rounds, alternating which goes first, each
round a batch of calls, and reports the median of the per-round ratios with its quartiles and
extremes. Needs jax and asdex beside torch (see ``benchmarks/sparse.py``).

With ``--compiler`` given more than once (``--compiler inductor --compiler aot_inductor``), each
``AutoCompile(compiler=...)`` is a contender of its own, paired with asdex in the same rounds.

Run: ``OMP_NUM_THREADS=1 PYTHONPATH=$PWD python benchmarks/sparse_paired.py [--rounds 41]
[--only TEXT] [--compiler NAME ...]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault(
    "XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
)

import torch
from sparse import MAX_DENSE, Asdex, scenarios  # type: ignore[import-not-found]

import torchdi


def batch_seconds(
    call: Callable[[], Any], calls: int, clock: Callable[[], float] = time.perf_counter
) -> float:
    start = clock()
    for _ in range(calls):
        call()
    return (clock() - start) / calls


def batch_both(call: Callable[[], Any], calls: int) -> tuple[float, float]:
    """Wall seconds and process CPU seconds (all threads) per call over one batch."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        call()
    return (time.perf_counter() - wall) / calls, (time.process_time() - cpu) / calls


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4)
    return q[0], statistics.median(values), q[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--only", action="append", default=None, metavar="TEXT")
    parser.add_argument("--compiler", action="append", default=None, metavar="NAME", help="AutoCompile's compiler (repeatable; default inductor)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    compilers = args.compiler or ["inductor"]
    backend = torchdi.AutoCompile(compiler=compilers[0])
    print(f"load average at start: {os.getloadavg()}")
    for op, name, f, f_jax, x in scenarios(quick=True):
        if f_jax is None or (args.only and not any(part in name for part in args.only)):
            continue
        prepare = torchdi.prepare_jacobian if op == "jacobian" else torchdi.prepare_hessian
        call = torchdi.jacobian if op == "jacobian" else torchdi.hessian
        contenders: dict[str, Callable[[], Any]] = {}
        for compiler in compilers:
            sparse = torchdi.AutoSparse(torchdi.AutoCompile(compiler=compiler))
            prep = prepare(f, sparse, x)
            contenders[compiler] = lambda sparse=sparse, prep=prep: call(f, sparse, x, prep=prep)  # noqa: B023
        asdex = Asdex(op, f_jax, x)
        contenders["asdex"] = asdex
        if prep.sparsity_pattern.shape[0] * x.numel() <= MAX_DENSE and "Brusselator" in name:
            dense_prep = prepare(f, backend, x)
            contenders["dense"] = lambda: call(f, backend, x, prep=dense_prep)  # noqa: B023
        per_call = {key: batch_seconds(c, 3) for key, c in contenders.items()}
        calls = {
            key: max(1, int(2e-3 / max(s, 1e-7))) for key, s in per_call.items()
        }  # ~2 ms batches
        times: dict[str, list[float]] = {key: [] for key in contenders}
        cpu: dict[str, list[float]] = {key: [] for key in contenders}
        for r in range(args.rounds):
            order = list(contenders) if r % 2 == 0 else list(reversed(contenders))
            for key in order:
                wall, used = batch_both(contenders[key], calls[key])
                times[key].append(wall)
                cpu[key].append(used)
        line = f"{op} {name}: colours {prep.ncolors}/{asdex.ncolors}; asdex {statistics.median(times['asdex']) * 1e6:.0f} us"
        for compiler in compilers:
            ratios = [s / a for s, a in zip(times[compiler], times["asdex"])]
            lo, med, hi = quartiles(ratios)
            cpu_lo, cpu_med, cpu_hi = quartiles([s / a for s, a in zip(cpu[compiler], cpu["asdex"])])
            line += (
                f"; sparse[{compiler}] {statistics.median(times[compiler]) * 1e6:.0f} us, paired ratio median {med:.2f}x "
                f"(quartiles {lo:.2f}-{hi:.2f}, range {min(ratios):.2f}-{max(ratios):.2f}, {args.rounds} rounds), "
                f"process CPU time {statistics.median(cpu[compiler]) * 1e6:.0f} us against asdex's "
                f"{statistics.median(cpu['asdex']) * 1e6:.0f} us, paired ratio median {cpu_med:.2f}x (quartiles {cpu_lo:.2f}-{cpu_hi:.2f})"
            )
        if "dense" in times:
            speedups = [d / s for d, s in zip(times["dense"], times[compilers[0]])]
            lo, med, hi = quartiles(speedups)
            line += f"; dense {statistics.median(times['dense']) * 1e3:.2f} ms, paired speed-up median {med:.0f}x (quartiles {lo:.0f}-{hi:.0f})"
        print(line, flush=True)
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
