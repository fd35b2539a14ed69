"""Sparse jacobians and hessians: ``AutoSparse`` against the dense prepared call on the same backend.

Per scenario and size: detection time (``TracerSparsity``), colouring time, number of colours,
the prepared sparse call and the prepared dense call on the same dense backend (medians of
interleaved repeats in one process, after one untimed call), their ratio, and asdex (JAX) on the
same function when ``jax`` and ``asdex`` are importable. Every sparse result is checked against
the dense one (``ok``); a dense matrix too big to allocate is left out (``-``). The last rows time
the colouring alone on a 10^5 x 10^5 banded pattern (5 non-zeros per row), per vertex order
(wall time, and in parentheses the process's CPU time, which a busy shared machine inflates less).

Run: ``python benchmarks/sparse.py [--quick] [--compiler inductor] [--threads 1] [--readme]`` or
``python -m torchdi bench --suite sparse`` (quick). ``--readme`` writes the table between the
``<!-- torchdi-sparse:start -->`` and ``<!-- torchdi-sparse:end -->`` markers of README.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

import torchdi
from torchdi.sparsity.coloring import GreedyColoring, column_coloring
from torchdi.sparsity.index_sets import IndexSets
from torchdi.testing.sparse_scenarios import (
    banded_linear,
    brusselator,
    chained_rosenbrock,
    diff_square,
    sparse_conv,
)

ROOT = Path(__file__).resolve().parent.parent
START, END = "<!-- torchdi-sparse:start -->", "<!-- torchdi-sparse:end -->"
# Dense matrices above this many entries are not computed (memory and time on a small machine).
MAX_DENSE = 2048 * 2048


def interleaved(calls: dict[str, Callable[[], Any]], repeats: int, budget_s: float) -> dict[str, float]:
    """Median seconds per call of each contender, timed in turn within each repeat."""
    for call in calls.values():
        call()  # untimed
    times: dict[str, list[float]] = {name: [] for name in calls}
    deadline = time.perf_counter() + budget_s
    for i in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
        if i >= 2 and time.perf_counter() > deadline:
            break
    return {name: statistics.median(t) for name, t in times.items()}


def brusselator_jax(u: Any) -> Any:
    import jax.numpy as jnp

    n = u.shape[0]
    a, b, alpha = 3.4, 1.0, 10.0 * (n - 1) ** 2
    grid = jnp.linspace(0, 1, n)
    gx, gy = jnp.meshgrid(grid, grid, indexing="ij")
    forcing = (((gx - 0.3) ** 2 + (gy - 0.6) ** 2) <= 0.01) * 5.0
    lap = jnp.roll(u, 1, 0) + jnp.roll(u, -1, 0) + jnp.roll(u, 1, 1) + jnp.roll(u, -1, 1) - 4 * u
    u1, u2 = u[..., 0], u[..., 1]
    du1 = alpha * lap[..., 0] + b + u1**2 * u2 - (a + 1) * u1 + forcing
    du2 = alpha * lap[..., 1] + a * u1 - u1**2 * u2
    return jnp.stack([du1, du2], axis=-1)


def brusselator_asdex(x: torch.Tensor, repeats: int) -> str:
    if importlib.util.find_spec("jax") is None or importlib.util.find_spec("asdex") is None:
        return "n/a"
    try:
        import asdex  # type: ignore[import-not-found]
        import jax
        import jax.numpy as jnp

        jax.config.update("jax_platforms", "cpu")
        u = jnp.asarray(x.numpy())
        try:  # asdex 0.5: a sample input; later releases: input_shape=
            prepared = asdex.jacobian(brusselator_jax, u)
        except TypeError:
            prepared = asdex.jacobian(brusselator_jax, input_shape=u.shape)
        jac = jax.jit(prepared)
        jac(u).block_until_ready()
        seconds = interleaved({"asdex": lambda: jac(u).block_until_ready()}, repeats, 5.0)["asdex"]
        return fmt(seconds)
    except Exception as error:  # an asdex API this script does not know
        return f"error: {type(error).__name__}"


def fmt(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.0f} us"


def scenarios(quick: bool) -> list[tuple[str, str, Callable[..., Any], torch.Tensor]]:
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=g)

    sizes = (8, 16, 32) if quick else (8, 16, 32, 64)
    cases = [("jacobian", f"brusselator N={n}", brusselator, 1 + 0.1 * rand(n, n, 2)) for n in sizes]
    cases += [
        ("jacobian", "banded linear n=1000", banded_linear(1000, 2, torch.float32), rand(1000)),
        ("jacobian", "diff(x)^2 n=2000", diff_square, rand(2000)),
        ("jacobian", "sparse conv 4x32x32", sparse_conv, rand(1, 4, 32, 32)),
        ("hessian", "chained Rosenbrock n=1000", chained_rosenbrock, 1 + 0.1 * rand(1000)),
        ("hessian", "chained Rosenbrock n=1e5", chained_rosenbrock, 1 + 0.1 * rand(100_000)),
    ]
    return cases


def run(quick: bool, compiler: str, progress: Callable[[str], None]) -> list[dict[str, str]]:
    dense_backend = torchdi.AutoCompile(compiler=compiler)
    sparse_backend = torchdi.AutoSparse(dense_backend)
    repeats = 7 if quick else 15
    # The first trace in a process pays make_fx's imports and warm-up (seconds): not per function.
    torchdi.prepare_jacobian(diff_square, torchdi.AutoSparse(torchdi.AutoFunc()), torch.ones(3))
    rows = []
    for op, name, f, x in scenarios(quick):
        progress(f"{op}: {name}")
        prepare = torchdi.prepare_jacobian if op == "jacobian" else torchdi.prepare_hessian
        call = torchdi.jacobian if op == "jacobian" else torchdi.hessian
        start = time.perf_counter()
        prep = prepare(f, sparse_backend, x)
        sparse_prep_s = time.perf_counter() - start
        m = prep.sparsity_pattern.shape[0]
        n = x.numel()
        contenders: dict[str, Callable[[], Any]] = {"sparse": lambda: call(f, sparse_backend, x, prep=prep)}  # noqa: B023
        dense_prep = None
        if m * n <= MAX_DENSE:
            dense_prep = prepare(f, dense_backend, x)
            contenders["dense"] = lambda: call(f, dense_backend, x, prep=dense_prep)  # noqa: B023
        times = interleaved(contenders, repeats, 20.0)  # the closures above run within this iteration
        correct = "-"
        if dense_prep is not None:
            got = call(f, sparse_backend, x, prep=prep).to_dense()
            want = call(f, dense_backend, x, prep=dense_prep).reshape(got.shape)
            correct = "ok" if torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())) else "FAIL"
        asdex = brusselator_asdex(x, repeats) if name.startswith("brusselator") else "n/a"
        rows.append({
            "operator": op,
            "scenario": name,
            "size": f"{m} x {n}",
            "detect": fmt(prep.detection_seconds),
            "colour": fmt(prep.coloring_seconds),
            "colours": str(prep.ncolors),
            "mode": prep.sparse_mode,
            "sparse prep": fmt(sparse_prep_s),
            "sparse call": fmt(times["sparse"]),
            "dense call": fmt(times["dense"]) if "dense" in times else "-",
            "speed-up": f"{times['dense'] / times['sparse']:.0f}x" if "dense" in times else "-",
            "asdex": asdex,
            "compiles": str(prep.num_compilations),
            "correct": correct,
        })
    n = 100_000
    i = np.repeat(np.arange(n), 5)
    j = i + np.tile(np.arange(-2, 3), n)
    keep = (j >= 0) & (j < n)
    banded = IndexSets.from_pairs(i[keep], j[keep], n, n)
    for order in ("natural", "largest_first", "smallest_last", "random"):
        progress(f"colouring 1e5 banded, {order}")
        seconds, cpu_seconds, colors = [], [], None
        for _ in range(3):
            start, cpu_start = time.perf_counter(), time.process_time()
            colors = column_coloring(banded, GreedyColoring(order))
            seconds.append(time.perf_counter() - start)
            cpu_seconds.append(time.process_time() - cpu_start)
        assert colors is not None
        rows.append({
            "operator": "colouring", "scenario": f"banded 1e5, {order}", "size": f"{n} x {n}", "detect": "-",
            "colour": f"{fmt(statistics.median(seconds))} ({fmt(statistics.median(cpu_seconds))} CPU)", "colours": str(int(colors.max()) + 1), "mode": "columns",
            "sparse prep": "-", "sparse call": "-", "dense call": "-", "speed-up": "-", "asdex": "n/a",
            "compiles": "-", "correct": "-",
        })
    return rows


def markdown(rows: list[dict[str, str]]) -> str:
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(row[c] for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def splice(readme: str, block: str) -> str:
    if START not in readme or END not in readme:
        raise SystemExit(f"README.md has no {START} ... {END} markers")
    head, rest = readme.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{block.strip()}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="Brusselator up to N=32 and fewer repeats")
    parser.add_argument("--compiler", default="inductor", help="AutoCompile's compiler (default inductor)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: stable medians on a shared machine)")
    parser.add_argument("--readme", action="store_true", help="write the table into README.md between the markers")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state")
    rows = run(args.quick, args.compiler, progress=lambda m: print(m, file=sys.stderr, flush=True))
    header = (
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), AutoCompile(compiler={args.compiler!r}) "
        f"as the dense backend; medians of interleaved repeats; asdex: {'importable' if importlib.util.find_spec('asdex') else 'not installed'}"
    )
    table = markdown(rows)
    print(header)
    print(table)
    failed = any(row["correct"] == "FAIL" for row in rows)
    if args.readme and not failed:
        readme = ROOT / "README.md"
        readme.write_text(splice(readme.read_text(), f"{header}\n\n{table}"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
