"""``python -m torchdi``: benchmark and check the backends on this machine.

    python -m torchdi bench [--quick] [--backends autograd,func,compile,...] [--markdown FILE] [--plot FILE.png]
    python -m torchdi check [--backends ...] [--operators ...] [--full]
    python -m torchdi cache {info,clear}

Progress goes to stderr, tables to stdout. Exit status: 0 when every row is correct, 1 when
some result is wrong (or a backend raised), 2 on a usage error (unknown backend or operator,
missing matplotlib for ``--plot``).
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torchdi
from torchdi.backends import unavailable_reason
from torchdi.cache import store_for
from torchdi.runners import engine_for
from torchdi.testing import OPERATORS, benchmark_scenarios, default_scenarios
from torchdi.testing.benchmark import benchmark_differentiation, format_markdown, format_table, plot
from torchdi.testing.compare import run_differentiation_tests

#: CLI name -> backend. ``compile`` is torch.compile with inductor, ``compile-aot`` with aot_eager.
BACKENDS: dict[str, Callable[[], Any]] = {
    "autograd": lambda: torchdi.AutoAutograd(),
    "func": lambda: torchdi.AutoFunc(),
    "compile": lambda: torchdi.AutoCompile(),
    "compile-aot": lambda: torchdi.AutoCompile(compiler="aot_eager"),
    "finitediff": lambda: torchdi.AutoFiniteDiff(),
    "xla": lambda: torchdi.AutoXLA(),
}
COMPILED = {"compile", "compile-aot", "xla"}
FINITE = {"finitediff"}
#: Compositions ``check --backends`` also accepts (not run by default): pairs that torch.compile
#: cannot differentiate show as unsupported (UnsupportedOperatorError at preparation).
COMBINATIONS: dict[str, Callable[[], Any]] = {
    "compile-autograd": lambda: torchdi.AutoCompile(inner=torchdi.AutoAutograd(), fullgraph=False, compiler="aot_eager"),
    "so-autograd-compile": lambda: torchdi.SecondOrder(torchdi.AutoAutograd(), torchdi.AutoCompile(compiler="aot_eager")),
    "so-func-compile": lambda: torchdi.SecondOrder(torchdi.AutoFunc(), torchdi.AutoCompile(compiler="aot_eager")),
    "so-finitediff-compile": lambda: torchdi.SecondOrder(torchdi.AutoFiniteDiff(), torchdi.AutoCompile(compiler="aot_eager")),
}
#: Backends ``bench`` and ``check`` run when named (never by default: each AOTInductor program
#: takes seconds to compile).
OPT_IN: dict[str, Callable[[], Any]] = {
    "compile-aoti": lambda: torchdi.AutoCompile(compiler="aot_inductor"),
}
COMPILED |= set(COMBINATIONS) | set(OPT_IN)
FINITE |= {"so-finitediff-compile"}


class UsageError(Exception):
    """A bad command line: reported with the valid choices, exit status 2."""


def _err(*parts: Any) -> None:
    print(*parts, file=sys.stderr, flush=True)


def backend_problem(backend: Any) -> str | None:
    """Why ``backend`` cannot run here (package, device, or engine missing), else ``None``."""
    try:
        reason = unavailable_reason(backend)
        if reason is None:
            engine_for(backend)
    except ImportError as error:
        return f"its engine cannot be imported ({error})"
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return reason


def _split(values: Sequence[str] | None) -> list[str]:
    names: list[str] = []
    for value in values or ():
        names += [v.strip() for v in value.split(",") if v.strip()]
    return names


def select_backends(
    requested: Sequence[str] | None, extra: dict[str, Callable[[], Any]] | None = None
) -> tuple[dict[str, Any], list[str]]:
    """``({name: backend}, notes)``: the requested backends (default: every available one).

    ``extra`` names more backends that may be requested (never chosen by default).
    Raises ``UsageError`` naming the valid backends for an unknown name.
    """
    known = {**BACKENDS, **(extra or {})}
    names = _split(requested)
    unknown = [n for n in names if n not in known and n != "all"]
    if unknown:
        raise UsageError(
            f"unknown backend{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
            f"valid backends: {', '.join(known)} (or all)"
        )
    explicit = bool(names) and "all" not in names
    chosen = list(dict.fromkeys(names)) if explicit else list(BACKENDS)
    selected: dict[str, Any] = {}
    notes = []
    for name in chosen:
        backend = known[name]()
        problem = backend_problem(backend)
        if problem is None:
            selected[name] = backend
        else:
            notes.append(f"backend {name} unavailable here, skipped: {problem}")
    return selected, notes


def select_operators(requested: Sequence[str] | None) -> list[str] | None:
    names = _split(requested)
    if not names:
        return None
    unknown = [n for n in names if n not in OPERATORS]
    if unknown:
        raise UsageError(
            f"unknown operator{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
            f"valid operators: {', '.join(OPERATORS)}"
        )
    return names


# --------------------------------------------------------------------------------------------
# bench


def _benchmark_main(name: str) -> Callable[..., Any] | None:
    """``main`` of ``benchmarks/<name>.py`` in a source checkout, when the file exists."""
    path = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location(f"torchdi_benchmarks_{name}", path)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look the module up there
    spec.loader.exec_module(module)
    return getattr(module, "main", None)


def has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def bench_skip(quick: bool) -> Callable[[str, Any, Any], str | None]:
    """Which (backend, scenario) pairs the bench leaves out, and why."""

    del quick  # every compiled backend runs every scenario, --quick included (about 12 compilations)

    def skip(label: str, backend: Any, scenario: Any) -> str | None:
        if label in FINITE and "large" in scenario.tags:
            return "finite differences cost O(numel(x)) evaluations of f here"
        return None

    return skip


def run_bench(args: argparse.Namespace) -> int:
    if args.suite != "differentiation":
        module = args.suite.replace("-", "_")
        main = _benchmark_main(module)
        if main is None:
            raise UsageError(f"benchmarks/{module}.py (with a main()) is not in this checkout")
        # Its own options: python benchmarks/compile_overhead.py --help
        forwarded = ["--markdown", args.markdown] if args.markdown else []  # the docs include it
        result = main(forwarded) if inspect.signature(main).parameters else main()
        return int(result or 0)
    if args.plot and not has_matplotlib():
        raise UsageError("--plot needs matplotlib: pip install 'torchdi[bench]' (or pip install matplotlib)")
    backends, notes = select_backends(args.backends, OPT_IN)
    operators = select_operators(args.operators)
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    scenarios = benchmark_scenarios(quick=args.quick)
    if operators is not None:
        scenarios = [s for s in scenarios if s.op in operators]
    if args.scenarios:
        wanted = _split(args.scenarios)
        scenarios = [s for s in scenarios if any(w in s.name for w in wanted)]
    for note in notes:
        _err(f"note: {note}")
    if not backends:
        _err("no backend left to run")
        return 2
    if not scenarios:
        _err("no benchmark scenario matches --operators/--scenarios")
        return 2
    _err(f"torchdi bench{' --quick' if args.quick else ''}: backends {', '.join(backends)}; "
         f"{len(scenarios)} scenarios (progress below, table on stdout)")
    start = time.perf_counter()
    rows = benchmark_differentiation(
        backends,
        scenarios,
        quick=args.quick,
        skip=bench_skip(args.quick),
        progress=lambda line: _err(f"  {line}"),
        rounds=args.rounds,
    )
    elapsed = time.perf_counter() - start
    print(format_table(rows))
    print(f"\n({elapsed:.0f} s; {len(rows)} rows)")
    if args.markdown:
        title = f"`python -m torchdi bench{' --quick' if args.quick else ''}`"
        Path(args.markdown).write_text(format_markdown(rows, title))
        _err(f"markdown table written to {args.markdown}")
    if args.plot:
        plot(rows, args.plot)
        _err(f"plot written to {args.plot}")
    bad = [r for r in rows if r.status in ("FAIL", "error")]
    if bad:
        _err(f"{len(bad)} row(s) incorrect or failed: see the notes under the table")
        return 1
    return 0


# --------------------------------------------------------------------------------------------
# check


def check_tolerances(label: str) -> dict[str, tuple[float | None, float | None]]:
    """Tolerances per dtype name for ``check`` (finite differences get loose ones)."""
    if label in FINITE:
        return {"float32": (5e-2, 2e-1), "float64": (1e-5, 1e-6)}
    return {"float32": (None, None), "float64": (None, None)}


def run_check(args: argparse.Namespace) -> int:
    import torch

    backends, notes = select_backends(args.backends, {**COMBINATIONS, **OPT_IN})
    operators = select_operators(args.operators)
    for note in notes:
        _err(f"note: {note}")
    if not backends:
        _err("no backend left to run")
        return 2
    ops = operators or list(OPERATORS)
    # status per (operator, backend): ok / FAIL / unsupported
    cells: dict[tuple[str, str], set[str]] = {}
    failures = []
    start = time.perf_counter()
    for label, backend in backends.items():
        compact = label in COMPILED and not args.full
        tolerances = check_tolerances(label)
        for dtype in (torch.float32, torch.float64):
            if compact and dtype == torch.float64:
                continue
            scenarios = default_scenarios(operators=ops, dtypes=(dtype,), compact=compact)
            rtol, atol = tolerances[str(dtype).replace("torch.", "")]
            _err(f"check {label} ({dtype}): {len(scenarios)} scenarios" + (" (compact: one per operator)" if compact else ""))

            def progress(done: int, total: int, record: Any, label: str = label) -> None:
                if record.status == "fail" or done == total or done % 20 == 0:
                    _err(f"  {label}: {done}/{total}" + (f"  FAIL {record.scenario.label}" if record.status == "fail" else ""))

            records = run_differentiation_tests({label: backend}, scenarios, rtol=rtol, atol=atol, progress=progress)
            for record in records:
                cells.setdefault((record.operator, label), set()).add(record.status)
                if record.status == "fail":
                    failures.append(record)
    elapsed = time.perf_counter() - start
    print(format_matrix(ops, list(backends), cells))
    print(
        "\nok: every scenario of the operator matched AutoAutograd, with inputs intact and no recompilation; "
        "unsupported: UnsupportedOperatorError."
    )
    compiled = [name for name in backends if name in COMPILED]
    if compiled and not args.full:
        print(f"{', '.join(compiled)}: one float32 scenario per operator (one compilation each); --full runs them all.")
    for note in notes:
        print(note)
    if failures:
        print("\nfailures:")
        for record in failures:
            print(f"  - {record}")
    print(f"\n({elapsed:.0f} s)")
    return 1 if failures else 0


def format_matrix(operators: Sequence[str], backends: Sequence[str], cells: dict[tuple[str, str], set[str]]) -> str:
    """The operator x backend support matrix: ok / FAIL / unsupported / - (nothing run)."""

    def cell(op: str, backend: str) -> str:
        statuses = cells.get((op, backend), set())
        if "fail" in statuses:
            return "FAIL"
        if "ok" in statuses:
            return "ok" if "unsupported" not in statuses else "partial"
        if "unsupported" in statuses:
            return "unsupported"
        if "unavailable" in statuses:
            return "unavailable"
        return "-"

    header = ["operator", *backends]
    body = [[op, *(cell(op, b) for b in backends)] for op in operators]
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in body)])


# --------------------------------------------------------------------------------------------
# cache


def run_cache(args: argparse.Namespace) -> int:
    """``cache info``: where the persisted preparations live and how much they hold; ``cache
    clear``: remove them."""
    store = store_for()
    if store is None:
        print("torchdi cache: off (TORCHDI_CACHE_DIR is set to the empty string)")
        return 0
    if args.action == "clear":
        removed = store.clear()
        print(f"torchdi cache: removed {removed} entr{'y' if removed == 1 else 'ies'} from {store.directory}")
        return 0
    info = store.info()
    kinds = ", ".join(f"{kind}: {count}" for kind, count in sorted(info.by_kind.items())) or "none"
    print(f"directory: {info.directory}")
    print(f"entries:   {info.entries} ({kinds})")
    print(f"size:      {info.bytes / 2**20:.1f} MiB of {info.max_bytes / 2**20:.0f} MiB (TORCHDI_CACHE_MAX_BYTES)")
    return 0


# --------------------------------------------------------------------------------------------
# entry point


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m torchdi",
        description="torchdi: one differentiation interface for PyTorch. Benchmark and check the backends here.",
        epilog=f"backends: {', '.join(BACKENDS)} (default: every available one)",
    )
    commands = parser.add_subparsers(dest="command", metavar="{bench,check,cache}")
    bench = commands.add_parser(
        "bench",
        help="time every backend on the benchmark scenarios, against eager autograd",
        description="Time backends on the benchmark scenarios; prints backend, scenario, operator, "
        "prep time, call time, ratio to autograd, compilations and correctness.",
    )
    bench.add_argument("--quick", action="store_true", help="5 short interleaved rounds instead of 15 (under 3 min on 2 cores)")
    bench.add_argument("--backends", action="append", metavar="NAMES", help=f"comma-separated: {', '.join(BACKENDS)} (default: all available), or {', '.join(OPT_IN)} (named only)")
    bench.add_argument("--operators", action="append", metavar="NAMES", help="keep only scenarios of these operators")
    bench.add_argument("--markdown", metavar="FILE", help="also write the table as markdown")
    bench.add_argument("--plot", metavar="FILE.png", help="also draw a bar chart (needs matplotlib: the bench extra)")
    bench.add_argument("--suite", choices=["differentiation", "compile-overhead", "raw-overhead", "sparse", "xla-overhead", "training", "cold-start"],
                       default="differentiation",
                       help="compile-overhead / raw-overhead / sparse / xla-overhead / training / cold-start run benchmarks/<name>.py "
                       "(source checkout; xla-overhead in .venv-xla)")
    bench.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    bench.add_argument("--scenarios", action="append", help=argparse.SUPPRESS)
    bench.add_argument("--rounds", type=int, default=None, help=argparse.SUPPRESS)
    check = commands.add_parser(
        "check",
        help="run test_differentiation for every backend; print the operator x backend support matrix",
        description="Run torchdi.testing.test_differentiation on the default scenarios for each "
        "available backend and print which operators work (ok / FAIL / unsupported).",
    )
    check.add_argument(
        "--backends",
        action="append",
        metavar="NAMES",
        help=f"comma-separated: {', '.join(BACKENDS)} (default: all available), or {', '.join(OPT_IN)}, "
        f"or compositions {', '.join(COMBINATIONS)}",
    )
    check.add_argument("--operators", action="append", metavar="NAMES", help="check only these operators")
    check.add_argument("--full", action="store_true", help="all default scenarios for compiled backends too (slow: one compilation each)")
    cache = commands.add_parser(
        "cache",
        help="show or clear the persisted preparations (TORCHDI_CACHE_DIR)",
        description="The on-disk cache of preparations (sparsity patterns, colourings, compiled artifacts): "
        "TORCHDI_CACHE_DIR, else $XDG_CACHE_HOME/torchdi (~/.cache/torchdi); TORCHDI_CACHE_DIR= turns it off.",
    )
    cache.add_argument("action", choices=["info", "clear"], help="info: directory, entries, size; clear: remove every entry")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # torch's own deprecation chatter (inductor internals) would drown the progress lines.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        if args.command == "bench":
            return run_bench(args)
        if args.command == "cache":
            return run_cache(args)
        return run_check(args)
    except UsageError as error:
        _err(f"python -m torchdi {args.command}: error: {error}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
