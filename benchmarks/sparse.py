"""Sparse jacobians and hessians: ``AutoSparse`` against the dense prepared call and against asdex.

Per problem: the colours torchdi and asdex use, sparsity detection (torchdi's ``TracerSparsity``
with the numerical check of its pattern, ``prep.detection_seconds``, against
``asdex.jacobian_sparsity``/``hessian_sparsity``, in turn per repeat, medians of 7; torchdi's
on-disk cache is off, so every preparation detects afresh as asdex does), the colouring left
after detection (``prep.coloring_seconds``: the check already coloured a jacobian's columns and
rows with the default colouring, which the preparation reuses), the prepared sparse call
(``AutoSparse(AutoCompile())``), asdex's jitted call on the same function written in
``jax.numpy`` (float32 both, same input), their ratio, and the dense prepared call on the same
``AutoCompile`` (medians of interleaved repeats in one process, one thread, after one untimed
call). Problems: asdex's own benchmark problems (heat equation N=200, its small ConvNet, a
Rosenbrock hessian N=200) and the 2-D Brusselator N=8..64, then torchdi-only ones. Every sparse
result is checked against the dense one and against asdex's (``ok``). The asdex columns read
``n/a`` when ``jax``/``asdex`` are not importable (``pip install 'torchdi[asdex]'``). The last rows
time the colouring alone: a 10^5 x 10^5 banded pattern (5 non-zeros per row) per vertex order,
a 10^5 tridiagonal hessian (star, acyclic), an n=1e4 arrowhead jacobian (bidirectional) and a
dense 300 x 300 hessian.

Run: ``python benchmarks/sparse.py [--quick] [--compiler inductor] [--threads 1] [--readme]
[--only TEXT]`` or ``python -m torchdi bench --suite sparse`` (quick). JAX runs on the same number
of threads (``XLA_FLAGS``). The asdex columns need an environment with jax and asdex beside torch,
e.g. ``python3 -m venv /tmp/venv-asdex && /tmp/venv-asdex/bin/pip install torch==2.13.0 jax==0.10.2
jaxlib==0.10.2 asdex==0.5.1 numpy scipy && /tmp/venv-asdex/bin/pip install --no-deps -e .``. ``--readme`` writes the table between the
``<!-- torchdi-sparse:start -->`` and ``<!-- torchdi-sparse:end -->`` markers of README.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
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
from torchdi.sparsity.coloring import (
    GreedyColoring,
    acyclic_coloring,
    bidirectional_coloring,
    column_coloring,
    star_coloring,
)
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
HAS_ASDEX = importlib.util.find_spec("jax") is not None and importlib.util.find_spec("asdex") is not None


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


def median_seconds(call: Callable[[], Any], repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ----------------------------------------------------------------------------------------------
# The problems, in torch and in jax.numpy (asdex's benchmark problems, written anew)


def heat_equation(u: torch.Tensor) -> torch.Tensor:
    """The right-hand side of the 1-D heat equation with Dirichlet boundaries (tridiagonal)."""
    return torch.cat([-2 * u[0:1] + u[1:2], u[:-2] - 2 * u[1:-1] + u[2:], u[-2:-1] - 2 * u[-1:]])


def heat_equation_jax(u: Any) -> Any:
    import jax.numpy as jnp

    return jnp.concatenate([-2 * u[0:1] + u[1:2], u[:-2] - 2 * u[1:-1] + u[2:], u[-2:-1] - 2 * u[-1:]])


_CONV = [  # (out channels, in channels, kernel) of three 1-D convolutions, "same" padding, ReLU after each
    (8, 1, 5),
    (4, 8, 3),
    (2, 4, 3),
]
_rng = np.random.default_rng(0)
_CONV_WEIGHTS = [
    ((_rng.standard_normal(shape) / np.sqrt(shape[1] * shape[2])).astype(np.float32), (_rng.standard_normal(shape[0]) * 0.1).astype(np.float32))
    for shape in _CONV
]
_CONV_TORCH = [(torch.from_numpy(w), torch.from_numpy(b)) for w, b in _CONV_WEIGHTS]


def convnet(x: torch.Tensor) -> torch.Tensor:
    """A small 1-D ConvNet as in asdex's benchmarks: (N,) -> (N, 2) flattened."""
    h = x.reshape(1, 1, -1)
    for w, b in _CONV_TORCH:
        h = torch.relu(torch.nn.functional.conv1d(h, w, b, padding=w.shape[2] // 2))
    return h[0].T.reshape(-1)


def convnet_jax(x: Any) -> Any:
    import jax
    import jax.numpy as jnp

    h = x.reshape(1, 1, -1)
    for w, b in _CONV_WEIGHTS:
        pad = w.shape[2] // 2
        h = jax.lax.conv_general_dilated(h, jnp.asarray(w), (1,), [(pad, pad)], dimension_numbers=("NCH", "OIH", "NCH"))
        h = jax.nn.relu(h + jnp.asarray(b)[None, :, None])
    return h[0].T.reshape(-1)


def rosenbrock_jax(x: Any) -> Any:
    return (100 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2).sum()


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


class Asdex:
    """asdex on the jax twin of a problem: detection time, colours, the jitted prepared call."""

    def __init__(self, op: str, f: Callable[..., Any], x: torch.Tensor) -> None:
        import asdex  # type: ignore[import-not-found]
        import jax
        import jax.numpy as jnp

        jax.config.update("jax_platforms", "cpu")
        self.u = jnp.asarray(x.numpy())
        detect = asdex.jacobian_sparsity if op == "jacobian" else asdex.hessian_sparsity
        self.detect = lambda: detect(f, self.u)
        sparsity = self.detect()
        coloring = (asdex.jacobian_coloring_from_sparsity if op == "jacobian" else asdex.hessian_coloring_from_sparsity)(sparsity)
        self.ncolors = int(coloring.num_colors)
        self.call = jax.jit((asdex.jacobian if op == "jacobian" else asdex.hessian)(f, self.u))
        self.block = jax.block_until_ready
        self.block(self.call(self.u))

    def __call__(self) -> Any:
        return self.block(self.call(self.u))

    def dense(self) -> torch.Tensor:
        return torch.from_numpy(np.array(self.call(self.u).todense()))


def interleaved_detection(torchdi_seconds: Callable[[], float], asdex: Asdex | None, repeats: int) -> dict[str, float]:
    """Median seconds of torchdi's detection (as the prep reports it) and asdex's, in turn per repeat."""
    times: dict[str, list[float]] = {"torchdi": [], "asdex": []}
    for _ in range(repeats):
        times["torchdi"].append(torchdi_seconds())
        if asdex is not None:
            start = time.perf_counter()
            asdex.detect()
            times["asdex"].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items() if t}


def fmt(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.0f} us"


def scenarios(quick: bool) -> list[tuple[str, str, Callable[..., Any], Callable[..., Any] | None, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=g)

    sizes = (8, 16, 32) if quick else (8, 16, 32, 64)
    cases: list[tuple[str, str, Callable[..., Any], Callable[..., Any] | None, torch.Tensor]] = [
        ("jacobian", "heat equation N=200", heat_equation, heat_equation_jax, rand(200)),
        ("jacobian", "asdex's ConvNet N=200", convnet, convnet_jax, rand(200)),
        ("hessian", "Rosenbrock N=200", chained_rosenbrock, rosenbrock_jax, 1 + 0.1 * rand(200)),
    ]
    cases += [("jacobian", f"Brusselator N={n}", brusselator, brusselator_jax, 1 + 0.1 * rand(n, n, 2)) for n in sizes]
    cases += [
        ("jacobian", "banded linear n=1000", banded_linear(1000, 2, torch.float32), None, rand(1000)),
        ("jacobian", "diff(x)^2 n=2000", diff_square, None, rand(2000)),
        ("jacobian", "sparse conv 4x32x32", sparse_conv, None, rand(1, 4, 32, 32)),
        ("hessian", "chained Rosenbrock n=1e5", chained_rosenbrock, None, 1 + 0.1 * rand(100_000)),
    ]
    return cases


def close(got: torch.Tensor | None, want: torch.Tensor) -> bool:
    assert got is not None
    return torch.allclose(got, want.reshape(got.shape), rtol=1e-4, atol=1e-4 * max(float(want.abs().max()), 1.0))


def run(quick: bool, compiler: str, progress: Callable[[str], None], only: list[str] | None = None) -> list[dict[str, str]]:
    dense_backend = torchdi.AutoCompile(compiler=compiler)
    sparse_backend = torchdi.AutoSparse(dense_backend)
    repeats = 7 if quick else 21
    # The first trace in a process pays make_fx's imports and warm-up (seconds): not per function.
    torchdi.prepare_jacobian(diff_square, torchdi.AutoSparse(torchdi.AutoFunc()), torch.ones(3))
    rows = []
    for op, name, f, f_jax, x in scenarios(quick):
        if only and not any(part in name for part in only):
            continue
        progress(f"{op}: {name}")
        prepare = torchdi.prepare_jacobian if op == "jacobian" else torchdi.prepare_hessian
        call = torchdi.jacobian if op == "jacobian" else torchdi.hessian
        # The whole detection a preparation pays: the trace and the numerical check of its pattern
        # (on AutoFunc, the eager backend AutoCompile's check runs on), interleaved with asdex's.
        eager = torchdi.AutoSparse(torchdi.AutoFunc())
        asdex = None
        if HAS_ASDEX and f_jax is not None:
            try:
                asdex = Asdex(op, f_jax, x)
            except Exception as error:  # an asdex API this script does not know
                progress(f"  asdex: {type(error).__name__}: {error}")
        detections = interleaved_detection(lambda: prepare(f, eager, x).detection_seconds, asdex, 3 if quick else 7)  # noqa: B023
        detect_s = detections["torchdi"]
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
        if asdex is not None:
            contenders["asdex"] = asdex
        times = interleaved(contenders, repeats, 20.0)  # the closures above run within this iteration
        got = call(f, sparse_backend, x, prep=prep).to_dense() if dense_prep is not None or asdex is not None else None
        checks = []
        if dense_prep is not None:
            checks.append(close(got, call(f, dense_backend, x, prep=dense_prep)))
        if asdex is not None:
            checks.append(close(got, asdex.dense()))
        correct = "-" if not checks else ("ok" if all(checks) else "FAIL")
        na = "n/a" if f_jax is not None else "-"
        rows.append({
            "operator": op,
            "problem": name,
            "size": f"{m} x {n}",
            "colours": str(prep.ncolors),
            "asdex colours": str(asdex.ncolors) if asdex else na,
            "mode": prep.sparse_mode,
            "detect": fmt(detect_s),
            "asdex detect": fmt(detections["asdex"]) if asdex else na,
            "colour": fmt(prep.coloring_seconds),
            "sparse prep": fmt(sparse_prep_s),
            "sparse call": fmt(times["sparse"]),
            "asdex call": fmt(times["asdex"]) if "asdex" in times else na,
            "vs asdex": f"{times['sparse'] / times['asdex']:.1f}x" if "asdex" in times else na,
            "dense call": fmt(times["dense"]) if "dense" in times else "-",
            "speed-up": f"{times['dense'] / times['sparse']:.0f}x" if "dense" in times else "-",
            "compiles": str(prep.num_compilations),
            "correct": correct,
        })
    rows += colouring_rows(progress, only)
    return rows


def fresh(pattern: IndexSets) -> IndexSets:
    return IndexSets(pattern.indptr, pattern.indices, pattern.ncols)


def colouring_rows(progress: Callable[[str], None], only: list[str] | None = None) -> list[dict[str, str]]:
    """Colouring alone, on closed-form patterns (medians of 3, wall time)."""
    n = 100_000
    i = np.repeat(np.arange(n), 5)
    j = i + np.tile(np.arange(-2, 3), n)
    keep = (j >= 0) & (j < n)
    banded = IndexSets.from_pairs(i[keep], j[keep], n, n)
    i3 = np.repeat(np.arange(n), 3)
    j3 = i3 + np.tile(np.arange(-1, 2), n)
    keep3 = (j3 >= 0) & (j3 < n)
    tridiagonal = IndexSets.from_pairs(i3[keep3], j3[keep3], n, n)
    a = 10_000
    arrow = IndexSets.from_pairs(
        np.concatenate([np.zeros(a), np.arange(a), np.arange(1, a)]), np.concatenate([np.arange(a), np.arange(a), np.zeros(a - 1)]), a, a
    )
    cases: list[tuple[str, str, IndexSets, Callable[[], int]]] = []
    for order in ("natural", "largest_first", "smallest_last", "incidence_degree", "dynamic_largest_first", "random"):
        # A fresh pattern object per call: column colourings are memoized per pattern object.
        cases.append((f"banded 1e5 (5 per row), {order}", "columns", banded, lambda o=order: int(column_coloring(fresh(banded), GreedyColoring(o)).max()) + 1))  # type: ignore[misc]
    cases += [
        ("tridiagonal hessian 1e5, star", "star", tridiagonal, lambda: int(star_coloring(tridiagonal, GreedyColoring()).max()) + 1),
        ("tridiagonal hessian 1e5, acyclic", "substitution", tridiagonal, lambda: int(acyclic_coloring(tridiagonal, GreedyColoring()).max()) + 1),
        ("arrowhead jacobian 1e4, bidirectional", "mixed", arrow, lambda: sum(int(c.max()) + 1 for c in bidirectional_coloring(fresh(arrow), GreedyColoring()))),
        ("dense hessian 300, star", "star", IndexSets.full(300, 300), lambda: int(star_coloring(IndexSets.full(300, 300), GreedyColoring()).max()) + 1),
    ]
    rows = []
    for name, mode, pattern, colour in cases:
        if only and not any(part in name for part in only):
            continue
        progress(f"colouring {name}")
        count = colour()
        seconds = median_seconds(colour)
        row = dict.fromkeys(("operator", "problem", "size", "colours", "asdex colours", "mode", "detect", "asdex detect", "colour", "sparse prep", "sparse call", "asdex call", "vs asdex", "dense call", "speed-up", "compiles", "correct"), "-")
        row.update({"operator": "colouring", "problem": name, "size": f"{pattern.nrows} x {pattern.ncols}", "colours": str(count), "mode": mode, "colour": fmt(seconds)})
        rows.append(row)
    return rows


def asdex_version() -> str:
    if not HAS_ASDEX:
        return "not installed (n/a)"
    from importlib.metadata import version

    return f"asdex {version('asdex')}, jax {version('jax')} (jitted, CPU)"


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
    parser.add_argument("--markdown", default=None, help="also write the table to this file")
    parser.add_argument("--only", action="append", default=None, metavar="TEXT",
                        help="run only the problems whose name contains TEXT (repeatable; not with --readme)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.readme and args.only:
        parser.error("--readme writes the whole table: drop --only")
    # Every preparation detects and colours afresh, as asdex does: torchdi's on-disk cache
    # (TORCHDI_CACHE_DIR) would otherwise serve the second detection of a problem from disk.
    os.environ["TORCHDI_CACHE_DIR"] = ""
    # XLA's CPU client runs on as many threads as torch does (before jax is imported): its own
    # pool of one thread per core made asdex's medians swing 10-50x on a shared machine.
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_cpu_multi_thread_eigen={'true' if args.threads > 1 else 'false'}"
        f" intra_op_parallelism_threads={args.threads}"
    ).strip()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state")
    rows = run(args.quick, args.compiler, progress=lambda m: print(m, file=sys.stderr, flush=True), only=args.only)
    header = (
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), AutoCompile(compiler={args.compiler!r}) "
        f"as the dense backend; float32; medians of interleaved repeats; asdex: {asdex_version()}"
    )
    table = markdown(rows)
    print(header)
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(f"{header}\n\n{table}\n")
    failed = any(row["correct"] == "FAIL" for row in rows)
    if args.readme and not failed:
        readme = ROOT / "README.md"
        readme.write_text(splice(readme.read_text(), f"{header}\n\n{table}"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
