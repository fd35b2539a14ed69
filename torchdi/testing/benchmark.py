"""``benchmark_differentiation``: time backends on scenarios, against eager autograd in the same run.

Method: each backend prepares once (timed: the preparation time, compilation included), runs
twice to warm up, then all backends of a scenario are timed in *interleaved* rounds (round
``r`` times every backend once, starting with a different one each round) so that noise from a
shared machine hits them alike. Each round times enough back-to-back calls to last
``min_time``; the reported call time is the median over rounds. The ratio divides by
``AutoAutograd``'s median on the same scenario in the same run. Correctness compares each
result with ``AutoAutograd`` computed in float64 (or the scenario's ``result``).
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

import torchdi
from torchdi.backends import AutoFiniteDiff, SecondOrder, unavailable_reason
from torchdi.errors import UnsupportedOperatorError
from torchdi.families import as_plain_tuple
from torchdi.testing.compare import _describe_error, normalize_backends
from torchdi.testing.scenarios import (
    Scenario,
    benchmark_scenarios,
    call_operator,
    prepare_operator_for,
)

__all__ = [
    "BenchmarkRow",
    "benchmark_differentiation",
    "format_markdown",
    "format_table",
    "format_time",
    "relative_error",
]


@dataclass
class BenchmarkRow:
    """One (backend, scenario) measurement. Times are in seconds.

    Attributes:
        backend, scenario, operator: what was measured.
        prep_time: ``prepare_*`` (compilation included).
        call_time: median time of a prepared call.
        unprepared_time: one call without ``prep=`` (preparing on the spot); ``None`` for
            compiled backends, where it is the preparation time plus a call.
        compilations: ``prep.num_compilations`` at the end.
        ratio: ``call_time`` divided by ``AutoAutograd``'s in the same run (below 1: faster).
        correct: whether the result matched the reference (``None``: not checked).
        error: the largest error relative to the largest reference entry, per leaf.
        status: ``"ok"``, ``"FAIL"`` (wrong result or recompilation), ``"error"`` (raised),
            ``"unsupported"``, ``"unavailable"`` or ``"skipped"``.
        note: why a row failed or was skipped.
    """

    backend: str
    scenario: str
    operator: str
    prep_time: float | None = None
    call_time: float | None = None
    unprepared_time: float | None = None
    compilations: int = 0
    ratio: float | None = None
    correct: bool | None = None
    error: float | None = None
    status: str = "ok"
    note: str = ""
    rounds: int = 0
    calls_per_round: int = 0

    @property
    def measured(self) -> bool:
        return self.call_time is not None


# --------------------------------------------------------------------------------------------
# Correctness


def relative_error(result: Any, expected: Any) -> float:
    """The largest ``max|result - expected| / max|expected|`` over the leaves (inf on a mismatch of
    structure, shape or NaNs)."""
    got_leaves, got_spec = pytree.tree_flatten(as_plain_tuple(result))
    exp_leaves, exp_spec = pytree.tree_flatten(as_plain_tuple(expected))
    if got_spec != exp_spec:
        return math.inf
    worst = 0.0
    for got, exp in zip(got_leaves, exp_leaves):
        if not (isinstance(got, torch.Tensor) and isinstance(exp, torch.Tensor)) or got.shape != exp.shape:
            return math.inf
        g = got.detach().cpu().to(torch.float64)
        e = exp.detach().cpu().to(torch.float64)
        if g.numel() == 0:
            continue
        if bool(torch.isnan(g).any()) or bool(torch.isnan(e).any()):
            return math.inf
        scale = max(float(e.abs().max()), 1e-30)
        worst = max(worst, float((g - e).abs().max()) / scale)
    return worst


def _tolerance(backend: Any, dtype: torch.dtype) -> float:
    finite = isinstance(backend, AutoFiniteDiff) or (
        isinstance(backend, SecondOrder) and AutoFiniteDiff in (type(backend.outer), type(backend.inner))
    )
    if dtype == torch.float64:
        return 1e-4 if finite else 1e-9
    return 5e-2 if finite else 1e-3


def _to_float64(tree: Any) -> Any:
    def cast(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            return leaf.detach().to(torch.float64)
        return leaf

    return pytree.tree_map(cast, tree)


def _high_precision_reference(scenario: Scenario) -> Any:
    """The scenario's result, or ``AutoAutograd`` in float64 cast back (float32 fallback)."""
    if scenario.result is not None:
        return scenario.result
    x, tangents, contexts = scenario.fresh_inputs()
    if scenario.dtype == torch.float32:
        try:
            contexts64 = tuple(type(c)(_to_float64(c.value)) for c in contexts)
            result64 = call_operator(
                scenario.op, scenario.f, torchdi.AutoAutograd(), _to_float64(x), _to_float64(tangents), contexts64
            )
            return pytree.tree_map(
                lambda leaf: leaf.to(torch.float32) if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() else leaf,
                result64,
            )
        except Exception:
            pass
    return scenario.reference()


# --------------------------------------------------------------------------------------------
# Timing


def _sync(result: Any) -> None:
    for leaf in pytree.tree_leaves(result):
        if isinstance(leaf, torch.Tensor) and leaf.device.type == "cuda":
            torch.cuda.synchronize(leaf.device)
            return


@dataclass
class _Entry:
    row: BenchmarkRow
    backend: Any
    prep: Any = None
    inputs: Any = None
    samples: list[float] | None = None
    spent: float = 0.0
    first_compilations: int = 0

    def call(self, scenario: Scenario) -> Any:
        x, tangents, contexts = self.inputs
        return call_operator(scenario.op, scenario.f, self.backend, x, tangents, contexts, prep=self.prep)


def _time_calls(entry: _Entry, scenario: Scenario, number: int) -> float:
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter()
        for _ in range(number):
            result = entry.call(scenario)
        _sync(result)
        elapsed = time.perf_counter() - start
    finally:
        if gc_was_enabled:
            gc.enable()
    entry.spent += elapsed
    return elapsed / number


def benchmark_differentiation(
    backends: Any,
    scenarios: Sequence[Scenario] | None = None,
    *,
    quick: bool = False,
    rounds: int | None = None,
    min_time: float | None = None,
    max_time: float | None = None,
    warmup_time: float | None = None,
    check: bool = True,
    skip: Callable[[str, Any, Scenario], str | None] | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[BenchmarkRow]:
    """Time ``backends`` on ``scenarios`` (default: ``benchmark_scenarios()``).

    ``AutoAutograd()`` is always measured (added under the label ``"autograd"`` when absent):
    every row's ``ratio`` divides by its median on the same scenario, measured in the same
    interleaved rounds.

    Args:
        backends: a backend, a sequence of backends, or a ``{label: backend}`` mapping.
        scenarios: what to time.
        quick: fewer, shorter rounds (5 rounds of at least 20 ms; 15 of 50 ms otherwise).
        rounds, min_time, max_time, warmup_time: override the number of interleaved rounds,
            the least time of one round's back-to-back calls, the time after which a slow
            backend stops being timed (at least 3 rounds are kept), and how long each backend
            warms up (at least two calls).
        check: compare each result with the reference (``correct`` column).
        skip: ``skip(label, backend, scenario)`` returns a reason to skip the pair, or ``None``.
        progress: called with a line of text as the benchmark proceeds (e.g. print to stderr).

    Returns:
        One ``BenchmarkRow`` per (scenario, backend), scenario by scenario.
    """
    pairs = normalize_backends(backends)
    if not any(isinstance(b, torchdi.AutoAutograd) for _, b in pairs):
        pairs.insert(0, ("autograd", torchdi.AutoAutograd()))
    scenarios = benchmark_scenarios(quick=quick) if scenarios is None else list(scenarios)
    rounds = rounds if rounds is not None else (5 if quick else 15)
    min_time = min_time if min_time is not None else (0.02 if quick else 0.05)
    max_time = max_time if max_time is not None else (1.5 if quick else 8.0)
    warmup_time = warmup_time if warmup_time is not None else (0.1 if quick else 0.3)
    say = progress or (lambda line: None)
    rows: list[BenchmarkRow] = []
    for index, scenario in enumerate(scenarios):
        prefix = f"[{index + 1}/{len(scenarios)}] {scenario.name} {scenario.op}"
        rows += _benchmark_scenario(scenario, pairs, rounds, min_time, max_time, warmup_time, check, skip, say, prefix)
    return rows


def _benchmark_scenario(
    scenario: Scenario,
    pairs: list[tuple[str, Any]],
    rounds: int,
    min_time: float,
    max_time: float,
    warmup_time: float,
    check: bool,
    skip: Callable[[str, Any, Scenario], str | None] | None,
    say: Callable[[str], None],
    prefix: str,
) -> list[BenchmarkRow]:
    reference = None
    if check:
        say(f"{prefix}: reference (AutoAutograd, float64)")
        try:
            reference = _high_precision_reference(scenario)
        except Exception as error:
            say(f"{prefix}: the reference failed: {_describe_error(error)}")
    entries: list[_Entry] = []
    for label, backend in pairs:
        row = BenchmarkRow(label, scenario.name, scenario.op)
        entry = _Entry(row, backend)
        entries.append(entry)
        reason = skip(label, backend, scenario) if skip is not None else None
        if reason is not None:
            row.status, row.note = "skipped", reason
            continue
        reason = unavailable_reason(backend)
        if reason is not None:
            row.status, row.note = "unavailable", reason
            continue
        say(f"{prefix}: {label}: preparing")
        entry.inputs = scenario.fresh_inputs()
        x, tangents, contexts = entry.inputs
        try:
            start = time.perf_counter()
            entry.prep = prepare_operator_for(scenario.op, scenario.f, backend, x, tangents, contexts)
            row.prep_time = time.perf_counter() - start
            entry.first_compilations = entry.prep.num_compilations
            result = entry.call(scenario)  # warm-up 1, and the result checked
            _sync(result)
        except UnsupportedOperatorError as error:
            row.status, row.note, entry.prep = "unsupported", _describe_error(error), None
            continue
        except Exception as error:
            row.status, row.note, entry.prep = "error", _describe_error(error), None
            say(f"{prefix}: {label}: {row.note}")
            continue
        if reference is not None:
            row.error = relative_error(result, reference)
            row.correct = row.error <= _tolerance(backend, scenario.dtype)
            if not row.correct:
                row.status = "FAIL"
                row.note = f"result differs from the reference: max relative error {row.error:.3g}"
        del result
        # Warm up for a while (first calls of torch.func and of fresh kernels are slow), then
        # calibrate how many back-to-back calls one round needs to last min_time.
        warm_start = time.perf_counter()
        estimates = [_time_calls(entry, scenario, 1)]
        while len(estimates) < 50 and time.perf_counter() - warm_start < warmup_time:
            estimates.append(_time_calls(entry, scenario, 1))
        estimate = statistics.median(estimates[-5:])
        row.calls_per_round = max(1, min(10_000, math.ceil(min_time / max(estimate, 1e-7))))
        entry.samples = []
        entry.spent = 0.0

    active = [e for e in entries if e.samples is not None]
    say(f"{prefix}: timing {len(active)} backend(s), {rounds} interleaved rounds")
    for r in range(rounds):
        order = active[r % len(active):] + active[: r % len(active)] if active else []
        for entry in order:
            assert entry.samples is not None
            if len(entry.samples) >= 3 and entry.spent > max_time:
                continue
            entry.samples.append(_time_calls(entry, scenario, entry.row.calls_per_round))

    for entry in active:
        row = entry.row
        assert entry.samples is not None
        row.call_time = statistics.median(entry.samples)
        row.rounds = len(entry.samples)
        row.compilations = entry.prep.num_compilations
        if row.compilations > entry.first_compilations:
            row.status = "FAIL"
            row.note = (row.note + "; " if row.note else "") + (
                f"recompiled during timing ({entry.first_compilations} -> {row.compilations} compilations)"
            )
        if row.compilations == 0:
            x, tangents, contexts = entry.inputs
            samples: list[float] = []
            while len(samples) < 5 and (len(samples) < 3 or sum(samples) < max_time / 2):
                start = time.perf_counter()
                _sync(call_operator(scenario.op, scenario.f, entry.backend, x, tangents, contexts))
                samples.append(time.perf_counter() - start)
            row.unprepared_time = statistics.median(samples)
        entry.prep = entry.inputs = None
    baseline = next(
        (e.row.call_time for e in entries if isinstance(e.backend, torchdi.AutoAutograd) and e.row.call_time),
        None,
    )
    for entry in active:
        if baseline and entry.row.call_time is not None:
            entry.row.ratio = entry.row.call_time / baseline
        say(
            f"{prefix}: {entry.row.backend}: {format_time(entry.row.call_time)} per call"
            + (f" ({entry.row.ratio:.2f}x autograd)" if entry.row.ratio else "")
        )
    return [e.row for e in entries]


# --------------------------------------------------------------------------------------------
# Reports


def format_time(seconds: float | None) -> str:
    """``1.23 ms``-style rendering (``-`` for ``None``)."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            value = seconds / scale
            return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
    return f"{seconds * 1e9:.0f} ns"


COLUMNS = ("backend", "scenario", "operator", "prep", "call", "unprepared", "vs autograd", "compilations", "correct")


def _cells(row: BenchmarkRow) -> tuple[str, ...]:
    if not row.measured:
        status = row.status if row.status != "error" else "ERROR"
        return (row.backend, row.scenario, row.operator, "-", "-", "-", "-", "-", status)
    if row.correct is None:
        correct = "?" if row.status == "ok" else row.status
    else:
        correct = "ok" if row.status == "ok" else "FAIL"
    unprepared = format_time(row.unprepared_time) if row.unprepared_time is not None else "~prep"
    ratio = f"{row.ratio:.2f}x" if row.ratio is not None else "-"
    return (
        row.backend,
        row.scenario,
        row.operator,
        format_time(row.prep_time),
        format_time(row.call_time),
        unprepared,
        ratio,
        str(row.compilations),
        correct,
    )


LEGEND = (
    "prep: prepare_* (compilation included); call: median prepared call over interleaved rounds; "
    "unprepared: one call without prep= (~prep: compiled backends prepare on the spot); "
    "vs autograd: call time / AutoAutograd's in the same run (below 1x is faster); "
    "correct: result vs AutoAutograd in float64."
)


def _shown(rows: Sequence[BenchmarkRow]) -> list[BenchmarkRow]:
    return [r for r in rows if r.status not in ("skipped", "unavailable")]


def format_table(rows: Sequence[BenchmarkRow]) -> str:
    """A plain-text table of the rows (skipped and unavailable pairs summarized below it)."""
    body = [_cells(r) for r in _shown(rows)]
    widths = [max(len(h), *(len(c[i]) for c in body)) if body else len(h) for i, h in enumerate(COLUMNS)]
    numeric = {3, 4, 5, 6, 7}

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    out = [line(COLUMNS), line(["-" * w for w in widths])]
    previous = None
    for row, cells in zip(_shown(rows), body):
        if previous is not None and (row.scenario, row.operator) != previous:
            out.append("")
        previous = (row.scenario, row.operator)
        out.append(line(cells))
    out += _footnotes(rows)
    return "\n".join(out)


def _footnotes(rows: Sequence[BenchmarkRow]) -> list[str]:
    notes = []
    hidden = [r for r in rows if r.status in ("skipped", "unavailable")]
    if hidden:
        by_reason: dict[str, list[str]] = {}
        for r in hidden:
            by_reason.setdefault(f"{r.status}: {r.note}", []).append(f"{r.backend} on {r.scenario}")
        notes.append("")
        notes += [f"not run ({reason}): {', '.join(pairs)}" for reason, pairs in by_reason.items()]
    failing = [r for r in rows if r.status in ("FAIL", "error")]
    if failing:
        notes.append("")
        notes += [f"{r.status}: {r.backend} on {r.scenario} {r.operator}: {r.note}" for r in failing]
    return notes


def format_markdown(rows: Sequence[BenchmarkRow], title: str | None = None) -> str:
    """The rows as a GitHub markdown table, with the legend and the machine it ran on."""
    out = []
    if title:
        out += [f"### {title}", ""]
    out.append("| " + " | ".join(COLUMNS) + " |")
    out.append("|" + "|".join("---:" if i in {3, 4, 5, 6, 7} else "---" for i in range(len(COLUMNS))) + "|")
    out += ["| " + " | ".join(_cells(r)) + " |" for r in _shown(rows)]
    out += ["", LEGEND, "", machine_description()]
    notes = [n for n in _footnotes(rows) if n]
    if notes:
        out += ["", *(f"- {n}" for n in notes)]
    return "\n".join(out) + "\n"


def machine_description() -> str:
    import os
    import platform

    threads = torch.get_num_threads()
    return (
        f"Measured with torch {torch.__version__} on {platform.machine()} ({os.cpu_count()} CPU cores, "
        f"torch threads: {threads}), Python {platform.python_version()}, float32."
    )


def plot(rows: Sequence[BenchmarkRow], path: str) -> None:
    """A bar chart of call time per (scenario, operator) and backend, log scale, to ``path``.

    Raises ``ImportError`` when matplotlib is missing (``pip install 'torchdi[bench]'``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r for r in rows if r.measured]
    groups = list(dict.fromkeys((r.scenario, r.operator) for r in measured))
    backends = list(dict.fromkeys(r.backend for r in measured))
    width = 0.8 / max(1, len(backends))
    fig, ax = plt.subplots(figsize=(max(7.0, 1.3 * len(groups) + 2), 4.8))
    for j, backend in enumerate(backends):
        xs, heights = [], []
        for i, group in enumerate(groups):
            row = next((r for r in measured if (r.scenario, r.operator) == group and r.backend == backend), None)
            if row is not None and row.call_time is not None:
                xs.append(i + (j - (len(backends) - 1) / 2) * width)
                heights.append(row.call_time * 1e3)
        ax.bar(xs, heights, width=width, label=backend)
    ax.set_yscale("log")
    ax.set_ylabel("time per prepared call (ms, log scale)")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{s}\n{o}" for s, o in groups], fontsize=8)
    ax.set_title("torchdi: prepared call time per backend (lower is faster)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", which="both", alpha=0.3)
    fig.text(0.01, 0.01, machine_description(), fontsize=6, alpha=0.7)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
