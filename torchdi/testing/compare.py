"""``test_differentiation``: check backends against the reference on scenarios.

For each (backend, scenario) pair: prepare at the scenario's second point, run at its own
point (rule 1: a ``Prep`` serves new values), compare with the expected result, check that
``x``, the tangents and the ``Constant`` values are bit-identical afterwards (rule 5), run once
more at the second point and check that ``prep.num_compilations`` did not grow (rule 2), and
check that the ``Prep`` keeps no reference to the user's tensors (rule 4).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.utils.weak as torch_weak
from torch.utils import _pytree as pytree

from torchdi.backends import unavailable_reason
from torchdi.contexts import Constant, Context
from torchdi.errors import BackendUnavailableError, UnsupportedOperatorError
from torchdi.families import as_plain_tuple
from torchdi.testing.scenarios import (
    Scenario,
    call_operator,
    clone_tree,
    default_scenarios,
    prepare_operator_for,
)

__all__ = [
    "TestRecord",
    "backend_label",
    "compare_results",
    "default_tolerances",
    "normalize_backends",
    "run_differentiation_tests",
    "test_differentiation",
]

def backend_label(backend: Any) -> str:
    """How reports name a backend: its ``repr`` (``AutoFunc(chunk_size=None, mode=None)``)."""
    return repr(backend)


def normalize_backends(backends: Any) -> list[tuple[str, Any]]:
    """``[(label, backend), ...]`` from one backend, a sequence of them, or a ``{label: backend}`` mapping."""
    if isinstance(backends, Mapping):
        return [(str(label), backend) for label, backend in backends.items()]
    if isinstance(backends, (list, tuple)):
        return [(backend_label(b), b) for b in backends]
    return [(backend_label(backends), backends)]


def default_tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """``(rtol, atol)`` for comparing an AD backend with the reference in ``dtype``."""
    if dtype == torch.float64 or dtype == torch.complex128:
        return 1e-7, 1e-9
    if dtype in (torch.float16, torch.bfloat16):
        return 1e-2, 1e-2
    return 1e-4, 1e-5


def _path(keypath: Any) -> str:
    text = pytree.keystr(keypath)
    return text or "result"


def compare_results(result: Any, expected: Any, *, rtol: float, atol: float) -> str | None:
    """``None`` when ``result`` matches ``expected`` leaf by leaf, else what differs.

    Structures must be equal (tuple vs tensor, dict keys); each tensor must have the expected
    shape and dtype and satisfy ``|result - expected| <= atol + rtol * |expected|`` (NaNs equal).
    """
    got_leaves, got_spec = pytree.tree_flatten_with_path(as_plain_tuple(result))
    exp_leaves, exp_spec = pytree.tree_flatten_with_path(as_plain_tuple(expected))
    if got_spec != exp_spec:
        return f"structure differs: got {_structure(result)}, expected {_structure(expected)}"
    problems = []
    for (path, got), (_, exp) in zip(got_leaves, exp_leaves):
        where = _path(path)
        if not isinstance(exp, torch.Tensor):
            if got != exp:
                problems.append(f"{where}: got {got!r}, expected {exp!r}")
            continue
        if not isinstance(got, torch.Tensor):
            problems.append(f"{where}: got {type(got).__name__}, expected a tensor")
            continue
        if got.layout != torch.strided and exp.layout == torch.strided and got.numel() == exp.numel():
            got = got.to_dense().reshape(exp.shape)  # AutoSparse's CSR (flattened) against a dense reference
        if got.shape != exp.shape:
            problems.append(f"{where}: shape {tuple(got.shape)}, expected {tuple(exp.shape)}")
            continue
        if got.dtype != exp.dtype:
            problems.append(f"{where}: dtype {got.dtype}, expected {exp.dtype}")
            continue
        g = got.detach().cpu().to(torch.float64) if not got.is_complex() else got.detach().cpu()
        e = exp.detach().cpu().to(torch.float64) if not exp.is_complex() else exp.detach().cpu()
        close = torch.isclose(g, e, rtol=rtol, atol=atol, equal_nan=True)
        if not bool(close.all()):
            error = (g - e).abs().nan_to_num(nan=math.inf)
            index = int(error.argmax()) if error.numel() else 0
            position = tuple(int(i) for i in np.unravel_index(index, tuple(e.shape))) if e.dim() else ()
            problems.append(
                f"{where}: {int((~close).sum())} of {e.numel()} entries differ, max abs error "
                f"{float(error.max()):.3g} at {position}: got {g.flatten()[index].item():.6g}, "
                f"expected {e.flatten()[index].item():.6g} (rtol={rtol:g}, atol={atol:g})"
            )
    return "; ".join(problems) if problems else None


def _structure(tree: Any) -> str:
    if isinstance(tree, torch.Tensor):
        return f"Tensor{tuple(tree.shape)}"
    if isinstance(tree, dict):
        return "{" + ", ".join(f"{k!r}: {_structure(v)}" for k, v in tree.items()) + "}"
    if isinstance(tree, (list, tuple)):
        inner = ", ".join(_structure(v) for v in tree)
        return f"[{inner}]" if isinstance(tree, list) else f"({inner}{',' if len(tree) == 1 else ''})"
    return type(tree).__name__


def _bit_identical(a: Any, b: Any) -> bool:
    a_leaves, a_spec = pytree.tree_flatten(as_plain_tuple(a))
    b_leaves, b_spec = pytree.tree_flatten(as_plain_tuple(b))
    if a_spec != b_spec:
        return False
    for x, y in zip(a_leaves, b_leaves):
        if isinstance(x, torch.Tensor):
            if not isinstance(y, torch.Tensor) or x.shape != y.shape or x.dtype != y.dtype:
                return False
            if x.dtype.is_floating_point or x.dtype.is_complex:
                same = (x == y) | (torch.isnan(x) & torch.isnan(y))
                if not bool(same.all()):
                    return False
            elif not torch.equal(x, y):
                return False
        elif isinstance(x, np.ndarray):
            if not (isinstance(y, np.ndarray) and np.array_equal(x, y, equal_nan=x.dtype.kind in "fc")):
                return False
        elif x is not y and x != y:
            return False
    return True


def _protected(x: Any, tangents: Any, contexts: Sequence[Context[Any]]) -> list[tuple[str, Any]]:
    """What rule 5 says must stay bit-identical: ``x``, the tangents and each ``Constant``."""
    items = [("x", x)]
    if tangents is not None:
        items.append(("tangents", tangents))
    items += [(f"context {i + 1} (Constant)", c.value) for i, c in enumerate(contexts) if isinstance(c, Constant)]
    return items


def _snapshot(items: list[tuple[str, Any]]) -> list[tuple[str, Any, Any]]:
    return [(name, value, clone_tree(value)) for name, value in items]


def _modified(snapshot: list[tuple[str, Any, Any]], when: str) -> list[str]:
    return [
        f"input {name} was modified by {when} (rule 5: inputs are never modified)"
        for name, value, copy in snapshot
        if not _bit_identical(value, copy)
    ]


def _tensor_refs(*trees: Any) -> list[Any]:
    refs = []
    for tree in trees:
        for leaf in pytree.tree_leaves(tree):
            if isinstance(leaf, torch.Tensor):
                refs.append(torch_weak.WeakIdRef(leaf))
    return refs


def _describe_error(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(error).__name__}: {first[:300]}"


@dataclass
class TestRecord:
    """The outcome of one (backend, scenario) pair.

    Attributes:
        backend_name: the backend's label.
        backend: the backend.
        scenario: the scenario.
        status: ``"ok"``, ``"fail"``, ``"unsupported"`` (``UnsupportedOperatorError``) or
            ``"unavailable"`` (the backend cannot run here).
        problems: what went wrong (empty when ``ok``).
        num_compilations: ``prep.num_compilations`` after the calls.
    """

    __test__ = False

    backend_name: str
    backend: Any
    scenario: Scenario
    status: str
    problems: tuple[str, ...] = ()
    num_compilations: int = 0

    @property
    def operator(self) -> str:
        return self.scenario.op

    def __str__(self) -> str:
        head = f"{self.backend_name} | {self.scenario.label}: {self.status}"
        return head + "".join(f"\n      {p}" for p in self.problems)


def _check_pair(name: str, backend: Any, scenario: Scenario, rtol: float | None, atol: float | None) -> TestRecord:
    def record(status: str, problems: Iterable[str] = (), compilations: int = 0) -> TestRecord:
        return TestRecord(name, backend, scenario, status, tuple(problems), compilations)

    reason = unavailable_reason(backend)
    if reason is not None:
        return record("unavailable", [reason])
    default_rtol, default_atol = default_tolerances(scenario.dtype)
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol
    try:
        expected = scenario.reference()
    except Exception as error:
        return record("fail", [f"the reference (AutoAutograd) failed on this scenario: {_describe_error(error)}"])

    problems: list[str] = []
    x2, t2, c2 = scenario.second_point()
    guarded = _snapshot(_protected(x2, t2, c2))
    try:
        prep = prepare_operator_for(scenario.op, scenario.f, backend, x2, t2, c2)
    except UnsupportedOperatorError as error:
        return record("unsupported", [_describe_error(error)])
    except BackendUnavailableError as error:
        return record("unavailable", [_describe_error(error)])
    except Exception as error:
        return record("fail", [f"preparation raised {_describe_error(error)}", *_modified(guarded, "preparation")])
    problems += _modified(guarded, "preparation")
    compilations = prep.num_compilations

    # Run at another point than the one prepared at.
    x, t, c = scenario.fresh_inputs()
    here = _snapshot(_protected(x, t, c))
    try:
        result = call_operator(scenario.op, scenario.f, backend, x, t, c, prep=prep)
    except Exception as error:
        problems.append(f"the prepared call raised {_describe_error(error)}")
        problems += _modified(here, "the call")
        return record("fail", problems, prep.num_compilations)
    problems += _modified(here, "the call")
    mismatch = compare_results(result, expected, rtol=rtol, atol=atol)
    if mismatch:
        problems.append(f"wrong result: {mismatch}")
    del result

    # Back at the preparation point: values changed twice, nothing may have been recompiled.
    x2b, t2b, c2b = scenario.second_point()
    try:
        call_operator(scenario.op, scenario.f, backend, x2b, t2b, c2b, prep=prep)
    except Exception as error:
        problems.append(f"the second prepared call raised {_describe_error(error)}")
    if prep.num_compilations > compilations:
        problems.append(
            f"num_compilations grew from {compilations} to {prep.num_compilations} over calls that "
            "changed only values (rule 2: reuse never recompiles)"
        )

    # Rule 4: the Prep holds no reference to the tensors it was prepared with.
    refs = _tensor_refs(x2, t2, *(ctx.value for ctx in c2))
    del x2, t2, c2, guarded
    if not problems:
        alive = sum(ref() is not None for ref in refs)
        if alive:
            problems.append(f"the Prep keeps {alive} of the user's tensors alive (rule 4: no reference to inputs)")
    status = "fail" if problems else "ok"
    return record(status, problems, prep.num_compilations)


def run_differentiation_tests(
    backends: Any,
    scenarios: Sequence[Scenario] | None = None,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    progress: Any = None,
) -> list[TestRecord]:
    """What ``test_differentiation`` checks, returned as records instead of raising.

    ``progress``, when given, is called as ``progress(done, total, record)`` after each pair.
    """
    pairs = normalize_backends(backends)
    scenarios = default_scenarios() if scenarios is None else list(scenarios)
    total = len(pairs) * len(scenarios)
    records = []
    for name, backend in pairs:
        for scenario in scenarios:
            rec = _check_pair(name, backend, scenario, rtol, atol)
            records.append(rec)
            if progress is not None:
                progress(len(records), total, rec)
    return records


def test_differentiation(
    backends: Any,
    scenarios: Sequence[Scenario] | None = None,
    *,
    rtol: float | None = None,
    atol: float | None = None,
) -> list[TestRecord]:
    """Check ``backends`` on ``scenarios`` (default: ``default_scenarios()``) against the reference.

    For each (backend, scenario) pair, prepares at one point and runs at another (rule 1),
    compares with the expected result, checks that ``x``, the tangents and the ``Constant``
    values are bit-identical afterwards (rule 5), that ``prep.num_compilations`` does not grow
    over calls that change only values (rule 2), and that the ``Prep`` keeps none of the
    user's tensors alive (rule 4).

    Args:
        backends: a backend, a sequence of backends, or a ``{label: backend}`` mapping.
            Unavailable backends are skipped.
        scenarios: the scenarios (``torchdi.testing.Scenario``); ``None`` runs the defaults.
        rtol, atol: tolerances of the comparison (``|got - expected| <= atol + rtol * |expected|``);
            ``None`` picks them per dtype (float32: 1e-4, 1e-5; float64: 1e-7, 1e-9). Finite
            differences need looser ones (e.g. ``rtol=1e-2, atol=1e-3``).

    Returns:
        The records of every pair (``status`` ``"ok"``, ``"unsupported"`` or ``"unavailable"``).

    Raises:
        AssertionError: listing every failing (backend, scenario, operator), with what failed.

    Example (the body of a test in a user's pytest suite)::

        >>> from torchdi.testing import Scenario, test_differentiation
        >>> def my_loss(w, data):
        ...     return ((data @ w).tanh() ** 2).mean()
        >>> w = torch.randn(3, dtype=torch.float64)
        >>> data = torchdi.Constant(torch.randn(8, 3, dtype=torch.float64))
        >>> scenarios = [
        ...     Scenario("gradient", my_loss, w, (data,)),
        ...     Scenario("hvp", my_loss, w, (data,), tangents=(torch.randn(3, dtype=torch.float64),)),
        ... ]
        >>> records = test_differentiation([torchdi.AutoFunc(), torchdi.AutoFiniteDiff()], scenarios,
        ...                                rtol=1e-4, atol=1e-6)
        >>> [(r.operator, r.status) for r in records]  # AutoFunc's two, then AutoFiniteDiff's
        [('gradient', 'ok'), ('hvp', 'ok'), ('gradient', 'ok'), ('hvp', 'ok')]
    """
    records = run_differentiation_tests(backends, scenarios, rtol=rtol, atol=atol)
    failures = [r for r in records if r.status == "fail"]
    if failures:
        lines = [f"test_differentiation: {len(failures)} of {len(records)} (backend, scenario) pairs failed:"]
        lines += [f"  - {r}" for r in failures]
        raise AssertionError("\n".join(lines))
    return records


# Users import it into their test modules, where pytest would collect it as a test by its name.
test_differentiation.__test__ = False  # type: ignore[attr-defined]
