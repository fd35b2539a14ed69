"""Where a prepared ``AutoSparse(AutoCompile())`` call spends its time, layer by layer.

Times, for one problem of ``benchmarks/sparse.py``, the prepared operator call and the layers
under it, each alone (thread CPU time per call, median of ``--repeats`` batches of ``--calls``
calls, one thread): dynamo's guard check of the one compiled program, its transformed bytecode
(AOTAutograd's and inductor's wrappers and the kernel), the compiled runner (both), the sparse
runner (plus the CSR tensor), the CSR constructor alone, and the whole operator call. The layers
are reached through torchdi's private attributes: a measuring tool, not an API.

With ``--whole``, only the whole prepared call of every problem named by ``--only`` (repeatable),
in ``--rounds`` rounds of ~5 ms batches interleaved across the problems, process CPU time: what
to compare between two checkouts run one after the other.

For a forward-mode jacobian it also times, for scale, what needs no torchdi: ``torch.compile`` of
the compressed jacobian written by hand with the same colours (``vmap`` of ``jvp``, a gather, the
CSR tensor), ``torch.compile(f)`` alone and ``f`` run eagerly.

``--compiler aot_inductor`` breaks down ``AutoSparse(AutoCompile(compiler="aot_inductor"))``
instead (and, with ``--whole``, ``--compiler`` given twice times both in the same rounds).

Run: ``OMP_NUM_THREADS=1 PYTHONPATH=$PWD python benchmarks/sparse_breakdown.py [--only heat]
[--compiler aot_inductor] [--whole --only heat --only "Rosenbrock N=200" --rounds 31]``.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from sparse import scenarios  # type: ignore[import-not-found]

import torchdi
from torchdi.sparsity import decompression


def per_call_us(call: Callable[[], Any], calls: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        for _ in range(calls):
            call()
        times.append((time.thread_time() - start) / calls * 1e6)
    return statistics.median(times)


def prepared_call(op: str, f: Callable[..., Any], x: torch.Tensor, backend: Any) -> tuple[Any, Callable[[], Any]]:
    prep = (torchdi.prepare_jacobian if op == "jacobian" else torchdi.prepare_hessian)(f, backend, x)
    operator = torchdi.jacobian if op == "jacobian" else torchdi.hessian
    return prep, lambda: operator(f, backend, x, prep=prep)


def whole_calls(found: list[Any], rounds: int, compilers: list[str]) -> None:
    """The whole prepared call of each problem (and compiler), interleaved: medians and quartiles of the rounds."""
    calls = {}
    for compiler in compilers:
        backend = torchdi.AutoSparse(torchdi.AutoCompile(compiler=compiler))
        for op, name, f, _, x in found:
            _, call = prepared_call(op, f, x, backend)
            per = per_call_us(call, 50, 3)
            calls[name if len(compilers) == 1 else f"{name} [{compiler}]"] = (call, max(1, int(5000 / per)))
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, (call, batch) in calls.items():
            start = time.process_time()
            for _ in range(batch):
                call()
            times[name].append((time.process_time() - start) / batch * 1e6)
    print(f"whole prepared calls, {rounds} rounds; load average {os.getloadavg()}")
    for name, values in times.items():
        low, _, high = statistics.quantiles(values, n=4)
        print(f"  {name}: median {statistics.median(values):.1f} us (quartiles {low:.1f}-{high:.1f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", default=None, metavar="TEXT", help="a part of the problem's name")
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--whole", action="store_true")
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--compiler", action="append", default=None, metavar="NAME", help="AutoCompile's compiler (default inductor)")
    args = parser.parse_args()
    compilers = args.compiler or ["inductor"]
    torch.set_num_threads(1)
    wanted = args.only or ["heat"]
    found = [case for case in scenarios(quick=True) if any(part in case[1] for part in wanted)]
    if not found:
        raise SystemExit(f"no problem named like {wanted!r}")
    if args.whole:
        whole_calls(found, args.rounds, compilers)
        return
    op, name, f, _, x = found[0]
    backend = torchdi.AutoSparse(torchdi.AutoCompile(compiler=compilers[0]))
    prep, call = prepared_call(op, f, x, backend)
    runner = prep.runner
    fused = runner.fused
    if fused is None or not fused.fast_path:
        raise SystemExit("this preparation has no one-program fast path to break down")
    seeds, cache = runner.fused_seeds, fused._cache
    frame_locals = {"x": x, "tangents": seeds, "contexts": ()}
    print(f"{op} {name}, AutoCompile(compiler={compilers[0]!r}); load average {os.getloadavg()}")
    print(f"  whole operator call: {per_call_us(call, args.calls, args.repeats):.1f} us")
    grad_mode = torch.is_grad_enabled()
    torch.set_grad_enabled(False)  # as the operator runs the program (the guards check the grad mode)
    try:
        check, transformed = cache.entries[0]
        if not check(frame_locals):
            raise SystemExit("the program's guards do not pass outside the operator call")
        *_, values, crow, col = transformed(x, seeds, ())
        layers = {
            "dynamo guard check": lambda: check(frame_locals),
            "transformed bytecode (wrappers + kernel)": lambda: transformed(x, seeds, ()),
            "compiled runner": lambda: fused(x, seeds, ()),
            "what f reads (torchdi.reads check)": runner.reads.changed if runner.reads is not None else (lambda: None),
            "sparse runner (+ CSR tensor)": lambda: runner.checked_call(x, None, ()),
            "CSR tensor alone": lambda: decompression.csr(crow, col, values, runner.shape),
        }
        for label, call in layers.items():
            print(f"  {label}: {per_call_us(call, args.calls, args.repeats):.1f} us")
    finally:
        torch.set_grad_enabled(grad_mode)
    if op == "jacobian" and prep.sparse_mode == "forward":
        # The floor: what a PyTorch user would write by hand with the same colours, and f alone.
        print("  for scale (no torchdi):")
        floors = {
            "torch.compile of the hand-written compressed jacobian + CSR": hand_written(f, x, prep),
            "torch.compile(f) alone (no derivative)": functools.partial(torch.compile(f, fullgraph=True), x),
            "f run eagerly": functools.partial(f, x),
        }
        for label, call in floors.items():
            call()
            print(f"    {label}: {per_call_us(call, args.calls, args.repeats):.1f} us")


def hand_written(f: Callable[..., Any], x: torch.Tensor, prep: Any) -> Callable[[], Any]:
    """``torch.compile`` of the forward-mode compressed jacobian a user would write with the
    preparation's colours (``vmap`` of ``jvp`` over the seeds, then a gather), and its CSR tensor;
    checked against torchdi's result."""
    pattern = prep.sparsity_pattern
    crow, col, colors, ncolors = pattern.crow_indices(), pattern.col_indices(), prep.colors, int(prep.ncolors)
    rows = torch.repeat_interleave(torch.arange(pattern.shape[0]), crow.diff())
    seeds = torch.nn.functional.one_hot(colors, ncolors).T.to(x.dtype).reshape(ncolors, *x.shape).contiguous()

    def compressed(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y, columns = torch.func.vmap(lambda t: torch.func.jvp(f, (x,), (t,)), out_dims=(None, 0))(seeds)
        return y, columns.reshape(ncolors, -1)[colors[col], rows], crow.clone(), col.clone()

    program = torch.compile(compressed, fullgraph=True)

    def call() -> tuple[torch.Tensor, torch.Tensor]:
        y, values, crow_, col_ = program(x)
        return y, torch.sparse_csr_tensor(crow_, col_, values, tuple(pattern.shape))

    expected = torchdi.jacobian(f, prep.backend, x, prep=prep).to_dense()
    torch.testing.assert_close(call()[1].to_dense(), expected)
    return call


if __name__ == "__main__":
    main()
