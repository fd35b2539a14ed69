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

SHIFT = 1


def rolled(x: torch.Tensor) -> torch.Tensor:
    return x * x.roll(SHIFT)


def rolled_sum(x: torch.Tensor) -> torch.Tensor:
    return (x * x.roll(SHIFT) * x).sum()


@pytest.fixture(autouse=True)
def _restore_globals():
    global SHIFT
    yield
    SHIFT = 1


def _dense(t: torch.Tensor) -> torch.Tensor:
    return t.to_dense() if t.layout != torch.strided else t


@pytest.mark.parametrize("family", ["jacobian", "hessian"])
@pytest.mark.parametrize("variant_first", [True, False], ids=["variant-then-change", "change-then-variant"])
def test_a_strict_false_sparse_variant_sees_a_global_change(family, variant_first):
    """A strict=False AutoSparse preparation serves another dtype of x with a variant that keeps
    its pattern and colouring, and watches what f reads from then on. A variant made after SHIFT
    changed (and before any call re-traced the preparation's pattern) took the old pattern and
    recorded the new SHIFT as its own: a silently wrong matrix on every later call (before). It
    reuses the preparation's pattern only while that is current now, else it traces its own."""
    global SHIFT
    f, reference = (rolled, torch.func.jacrev(rolled)) if family == "jacobian" else (rolled_sum, torch.func.hessian(rolled_sum))
    prepare, operator = (td.prepare_jacobian, td.jacobian) if family == "jacobian" else (td.prepare_hessian, td.hessian)
    backend = td.AutoSparse(td.AutoFunc())
    x = torch.linspace(-1.0, 1.0, 6, dtype=torch.float64)
    prep = prepare(f, backend, x, strict=False)
    if variant_first:
        torch.testing.assert_close(_dense(operator(f, backend, x.float(), prep=prep)), reference(x.float()))
    SHIFT = 2
    for _ in range(2):
        torch.testing.assert_close(_dense(operator(f, backend, x.float(), prep=prep)), reference(x.float()))
        torch.testing.assert_close(_dense(operator(f, backend, x, prep=prep)), reference(x))
    assert len(prep.variants) == 1


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


# --- AutoSparse and static context values -----------------------------------------------------


def rolled_by(x: torch.Tensor, k: int) -> torch.Tensor:
    return x * x.roll(k)


def rolled_by_sum(x: torch.Tensor, k: int) -> torch.Tensor:
    return (x * x.roll(k) * x).sum()


@pytest.mark.parametrize(
    "dense, family, strict",
    [(td.AutoFunc(), family, strict) for family in ("jacobian", "hessian") for strict in (True, False)]
    + [(td.AutoAutograd(), "jacobian", True), (ACE, "jacobian", False)],
    ids=lambda v: v if isinstance(v, str) else (f"strict={v}" if isinstance(v, bool) else type(v).__name__),
)
def test_a_sparse_pattern_follows_a_static_context_value(dense, family, strict):
    """The tracer bakes an int context into the pattern (x.roll(k) with Constant(k)); the strict
    check lets its value change on eager dense backends, and strict=False on all. The pattern was
    kept (before: a silently wrong matrix, also on AutoCompile, whose dynamo recompiled while the
    colouring stayed); it is traced again now, and a strict=False variant for another dtype of x
    made with another k than its preparation's pattern was traced with traces its own."""
    f, reference = (rolled_by, torch.func.jacrev) if family == "jacobian" else (rolled_by_sum, torch.func.hessian)
    prepare, operator = (td.prepare_jacobian, td.jacobian) if family == "jacobian" else (td.prepare_hessian, td.hessian)
    backend = td.AutoSparse(dense)
    x = torch.linspace(-1.0, 1.0, 6, dtype=torch.float64)
    prep = prepare(f, backend, x, td.Constant(1), strict=strict)
    for k in (2, 1, 3):
        torch.testing.assert_close(_dense(operator(f, backend, x, td.Constant(k), prep=prep)), reference(lambda x, k=k: f(x, k))(x))
    if not strict:
        for k in (2, 3):
            want = reference(lambda x, k=k: f(x, k))(x.float())
            torch.testing.assert_close(_dense(operator(f, backend, x.float(), td.Constant(k), prep=prep)), want)


def test_sparse_variants_of_equal_patterns_keep_their_own_records_and_free_them():
    """Variants are built through the engine cache, which is keyed by backend value: two preps
    whose patterns and colours are equal must not share one variant's record of what f reads
    (else a change to the second f is not seen), and the cache must keep nothing of f alive."""
    import gc
    import weakref

    def make(shift: list[int]):
        weights = torch.ones((), dtype=torch.float64)  # (0-d: x keeps its dtype)

        def f(x: torch.Tensor) -> torch.Tensor:
            return weights * x * x.roll(shift[0])

        return f, weakref.ref(weights)

    first_shift, second_shift = [1], [1]
    first, _ = make(first_shift)
    second, alive = make(second_shift)
    backend = td.AutoSparse(td.AutoFunc())
    x = torch.linspace(-1.0, 1.0, 6, dtype=torch.float64)
    preps = [td.prepare_jacobian(f, backend, x, strict=False) for f in (first, second)]
    for f, prep in zip((first, second), preps):
        td.jacobian(f, backend, x.float(), prep=prep)  # each makes its float32 variant
    second_shift[0] = 2
    torch.testing.assert_close(td.jacobian(second, backend, x.float(), prep=preps[1]).to_dense(), torch.func.jacrev(second)(x.float()))
    torch.testing.assert_close(td.jacobian(first, backend, x.float(), prep=preps[0]).to_dense(), torch.func.jacrev(first)(x.float()))
    del preps, second, f, prep
    gc.collect()
    assert alive() is None
