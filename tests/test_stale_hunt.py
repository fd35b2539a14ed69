"""Prepared fast paths after something ``f`` reads changed: never a stale result.

Regression tests for holes found by sweeps that prepare, change a global, a closure cell, a
module attribute or a closed-over tensor, call again and compare with plain ``torch.func``.
Compiled coverage uses ``AutoCompile(compiler="aot_eager")``.
"""

from __future__ import annotations

import pytest
import torch

import torchdi as td

pytestmark = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")


# --- compositions whose compiled parts compiled on the first call, uncounted --------------------

ACE = td.AutoCompile(compiler="aot_eager")


def _sines(x: torch.Tensor) -> torch.Tensor:
    return (x.sin() ** 2 * x.roll(1)).sum()


def _curve(t: torch.Tensor) -> torch.Tensor:
    return torch.stack([t.sin() * t, t**3])


_COMPOSED = {
    "hessian": (td.prepare_hessian, lambda f, b, x, p: td.hessian(f, b, x, prep=p), lambda x: torch.func.hessian(_sines)(x)),
    "second_derivative": (
        td.prepare_second_derivative,
        lambda f, b, x, p: td.second_derivative(f, b, x, prep=p),
        lambda t: torch.func.jacfwd(torch.func.jacfwd(_curve))(t),
    ),
    "hvp": (
        lambda f, b, x, strict=True: td.prepare_hvp(f, b, x, (torch.ones_like(x),)),
        lambda f, b, x, p: td.hvp(f, b, x, (torch.ones_like(x),), prep=p)[0],
        lambda x: torch.func.hessian(_sines)(x) @ torch.ones_like(x),
    ),
}


@pytest.mark.parametrize(
    "backend, family",
    [
        (td.SecondOrder(ACE, td.AutoFunc()), "hessian"),
        (td.SecondOrder(ACE, td.AutoFunc()), "second_derivative"),
        (td.SecondOrder(td.AutoFiniteDiff(), ACE), "hvp"),
        (td.SecondOrder(td.AutoFiniteDiff(), ACE), "hessian"),
    ],
    ids=["compile-over-func-hessian", "compile-over-func-second_derivative", "fd-over-compile-hvp", "fd-over-compile-hessian"],
)
def test_a_composed_second_order_operator_compiles_at_preparation_and_counts_it(backend, family):
    """Rule 2: prepare_* compiles everything and num_compilations says so. The generic hessian,
    second derivative and finite differences over a compiled gradient nest compiled runners in a
    composition that is not one program; those compiled on the first call after preparation and
    num_compilations said 0 (before)."""
    counters = torch._dynamo.utils.counters
    prepare, operator, reference = _COMPOSED[family]
    f = _curve if family == "second_derivative" else _sines
    x = torch.tensor(0.7, dtype=torch.float64) if family == "second_derivative" else torch.linspace(-1.0, 1.0, 4, dtype=torch.float64)
    prep = prepare(f, backend, x)
    assert prep.num_compilations >= 1
    compiled = prep.num_compilations
    graphs = counters["stats"]["unique_graphs"]
    for point in (x, x * 2 - 0.3):
        tol = {"rtol": 1e-5, "atol": 1e-5} if isinstance(backend.outer, td.AutoFiniteDiff) else {}
        torch.testing.assert_close(operator(f, backend, point, prep), reference(point), **tol)
    assert counters["stats"]["unique_graphs"] == graphs  # nothing compiled after preparation
    assert prep.num_compilations == compiled


WEIGHT = 2.0


def _weighted(x: torch.Tensor) -> torch.Tensor:
    return WEIGHT * (x.sin() ** 2 * x.roll(1)).sum()


@pytest.mark.parametrize("family", ["hvp", "hessian"])
def test_compiled_over_compiled_second_order_is_one_program_under_its_guards(family):
    """SecondOrder(AutoCompile(), AutoCompile()) (a pair the README says works) failed at
    preparation with dynamo's "does not know how to trace method replace of class code": the inner
    compiled gradient tried to compile itself inside the outer program's trace. It is traced into
    the outer program now: right results, compiled at preparation, and a changed global is seen."""
    global WEIGHT
    backend = td.SecondOrder(ACE, ACE)
    x = torch.linspace(-1.0, 1.0, 4, dtype=torch.float64)
    t = torch.linspace(0.5, -0.5, 4, dtype=torch.float64)
    if family == "hvp":
        prep = td.prepare_hvp(_weighted, backend, x, (t,))
        run = lambda point: td.hvp(_weighted, backend, point, (t,), prep=prep)[0]  # noqa: E731
        reference = lambda point: torch.func.hessian(_weighted)(point) @ t  # noqa: E731
    else:
        prep = td.prepare_hessian(_weighted, backend, x)
        run = lambda point: td.hessian(_weighted, backend, point, prep=prep)  # noqa: E731
        reference = torch.func.hessian(_weighted)
    compiled = prep.num_compilations
    assert compiled >= 1
    try:
        for point in (x, x * 2 - 0.3):
            torch.testing.assert_close(run(point), reference(point))
        assert prep.num_compilations == compiled
        WEIGHT = 5.0
        torch.testing.assert_close(run(x), reference(x))
        assert prep.num_compilations > compiled  # the outer program's guard on WEIGHT failed
    finally:
        WEIGHT = 2.0
