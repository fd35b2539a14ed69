"""Tests of torchdi.testing itself: scenarios, test_differentiation, benchmark_differentiation.

Test-only engines (a backend returning a perturbed gradient, one that "recompiles" on every
call, one whose Prep keeps the user's x alive) are installed by monkeypatching
``torchdi.runners``' engine cache for one otherwise unused backend value.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils import _pytree as pytree

import torchdi
import torchdi.runners
from torchdi.testing import (
    OPERATORS,
    Scenario,
    benchmark_differentiation,
    benchmark_scenarios,
    default_scenarios,
    format_table,
    run_differentiation_tests,
)
from torchdi.testing import (
    test_differentiation as check_backends,  # not collected by pytest under this name
)
from torchdi.testing.benchmark import format_markdown, relative_error
from torchdi.testing.compare import compare_results

# A backend value no other test uses: the test-only engines below take its place.
ODD = torchdi.AutoFunc(chunk_size=3)


@pytest.fixture(scope="module")
def float64_scenarios() -> list[Scenario]:
    return default_scenarios(dtypes=(torch.float64,))


def install_engine(monkeypatch: pytest.MonkeyPatch, make: Any) -> None:
    """Make ``ODD`` run the engine ``make(real_func_engine)``."""
    # Engines are cached per backend value: ODD's entry is the test engine until the test ends.
    monkeypatch.setitem(torchdi.runners._ENGINES, ODD, make(torchdi.runners.engine_for(torchdi.AutoFunc())))


class WrappingEngine:
    """Delegates to a real engine; ``wrap(family, runner)`` may replace a runner."""

    keeps_static = False

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.native = inner.native

    def wrap(self, family: str, runner: Any) -> Any:
        return runner

    def build(self, family: str, f: Any, spec: Any) -> Any:
        runner = self.inner.build(family, f, spec)
        return None if runner is None else self.wrap(family, runner)


class PerturbedGradient(WrappingEngine):
    """Returns a gradient that is 1% off."""

    def wrap(self, family: str, runner: Any) -> Any:
        if family != "gradient":
            return runner

        def run(x: Any, tangents: Any, contexts: Any) -> Any:
            y, g = runner(x, tangents, contexts)
            return y, pytree.tree_map(lambda t: t * 1.01 + 1e-3, g)

        return run


class RecompilesEveryCall(WrappingEngine):
    """Pretends to compile at preparation and again at each call."""

    def wrap(self, family: str, runner: Any) -> Any:
        def run(x: Any, tangents: Any, contexts: Any) -> Any:
            run.num_compilations += 1  # type: ignore[attr-defined]
            return runner(x, tangents, contexts)

        run.num_compilations = 1  # type: ignore[attr-defined]
        return run


class KeepsX(WrappingEngine):
    """A runner whose warm-up keeps the user's x (rule 4 violated)."""

    def wrap(self, family: str, runner: Any) -> Any:
        kept = []

        def run(x: Any, tangents: Any, contexts: Any) -> Any:
            return runner(x, tangents, contexts)

        def warm_up(x: Any, tangents: Any, contexts: Any) -> None:
            kept.append(x)

        run.warm_up = warm_up  # type: ignore[attr-defined]
        return run


# --------------------------------------------------------------------------------------------
# Scenarios


def test_default_scenarios_cover_every_operator_kind_context_and_dtype() -> None:
    scenarios = default_scenarios()
    assert {s.op for s in scenarios} == set(OPERATORS)
    assert {s.dtype for s in scenarios} == {torch.float32, torch.float64}
    context_kinds = {tuple(type(c).__name__ for c in s.contexts) for s in scenarios}
    assert {(), ("Constant",), ("Cache",)} <= context_kinds
    names = " ".join(s.name for s in scenarios)
    for kind in ("scalar_to_scalar", "vector_to_scalar", "vector_to_vector", "matrix_to_matrix", "pytree_to_scalar"):
        assert kind in names
    assert any(isinstance(s.x, dict) for s in scenarios)
    assert any(isinstance(s.x, torch.Tensor) and s.x.dim() == 2 for s in scenarios)
    # Every tangent operator is exercised with one and with several tangents.
    counts = {len(s.tangents) for s in scenarios if s.tangents is not None}
    assert counts == {1, 2}
    assert len({s.label for s in scenarios}) == len(scenarios)


def test_default_scenarios_filters() -> None:
    compact = default_scenarios(compact=True, dtypes=(torch.float32,))
    assert sorted(s.op for s in compact) == sorted(OPERATORS)
    only = default_scenarios(operators=["hvp"], contexts=("constant+cache",))
    assert only and all(s.op == "hvp" and len(s.contexts) == 2 for s in only)
    with pytest.raises(ValueError, match="valid operators"):
        default_scenarios(operators=["gradiant"])


def test_scenario_reference_second_point_and_validation() -> None:
    s = Scenario("gradient", lambda x, c: (c * x**2).sum(), torch.ones(3), (torchdi.Constant(2.0),))
    torch.testing.assert_close(s.reference(), torch.full((3,), 4.0))
    x2, tangents2, contexts2 = s.second_point()
    assert x2.shape == s.x.shape and x2.dtype == s.x.dtype and not torch.equal(x2, s.x)
    assert tangents2 is None and isinstance(contexts2[0], torchdi.Constant) and contexts2[0].value != 2.0
    assert torch.equal(s.second_point()[0], x2)  # deterministic
    assert "Constant" in s.name

    p = Scenario("pullback", torch.sin, torch.zeros(2))  # one cotangent picked for us
    assert p.tangents is not None and len(p.tangents) == 1 and p.tangents[0].shape == (2,)
    with pytest.raises(ValueError, match="valid operators"):
        Scenario("grad", torch.sin, torch.zeros(2))
    with pytest.raises(ValueError, match="takes no tangents"):
        Scenario("gradient", torch.sum, torch.zeros(2), tangents=(torch.zeros(2),))
    with pytest.raises(TypeError, match="Constant"):
        Scenario("gradient", torch.sum, torch.zeros(2), (torch.ones(2),))


def test_compare_results_reports_structure_shape_dtype_and_values() -> None:
    a = (torch.ones(2), {"w": torch.zeros(3)})
    assert compare_results(a, a, rtol=0, atol=0) is None
    assert "structure" in (compare_results(a, torch.ones(2), rtol=0, atol=0) or "")
    assert "dtype" in (compare_results(torch.ones(2), torch.ones(2, dtype=torch.float64), rtol=0, atol=0) or "")
    message = compare_results(torch.tensor([1.0, 2.5]), torch.tensor([1.0, 2.0]), rtol=1e-3, atol=0) or ""
    assert "1 of 2 entries differ" in message and "(1,)" in message


# --------------------------------------------------------------------------------------------
# test_differentiation


def test_eager_backends_pass_the_default_scenarios() -> None:
    records = check_backends([torchdi.AutoAutograd(), torchdi.AutoFunc()])
    assert len(records) == 2 * len(default_scenarios())
    assert all(r.status == "ok" for r in records)


def test_finite_differences_pass_with_loose_tolerances(float64_scenarios: list[Scenario]) -> None:
    check_backends(torchdi.AutoFiniteDiff(), float64_scenarios, rtol=1e-5, atol=1e-6)
    check_backends(torchdi.AutoFiniteDiff(), default_scenarios(dtypes=(torch.float32,)), rtol=5e-2, atol=2e-1)


def test_wrong_backend_fails_and_names_every_pair(monkeypatch: pytest.MonkeyPatch, float64_scenarios: list[Scenario]) -> None:
    install_engine(monkeypatch, PerturbedGradient)
    with pytest.raises(AssertionError) as info:
        check_backends({"good": torchdi.AutoFunc(), "perturbed": ODD}, float64_scenarios)
    message = str(info.value)
    wrong = [s for s in float64_scenarios if OPERATORS[s.op].family == "gradient"]
    assert f"{len(wrong)} of {2 * len(float64_scenarios)} (backend, scenario) pairs failed" in message
    for s in wrong:
        assert f"perturbed | {s.label}: fail" in message
    assert "good |" not in message
    assert "hvp:" not in message  # the hvp runner is AutoFunc's own, untouched
    assert "wrong result" in message and "max abs error" in message


def test_function_that_mutates_its_input_is_caught() -> None:
    def mutates_x(x: torch.Tensor) -> torch.Tensor:
        x.mul_(1.5)
        return (x**2).sum()

    def mutates_constant(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        c.add_(1.0)
        return (x * c).sum()

    scenarios = [
        Scenario("gradient", mutates_x, torch.ones(3, dtype=torch.float64), result=torch.full((3,), 4.5, dtype=torch.float64)),
        Scenario("gradient", mutates_constant, torch.ones(3), (torchdi.Constant(torch.ones(3)),), result=torch.full((3,), 2.0)),
    ]
    with pytest.raises(AssertionError) as info:
        check_backends(torchdi.AutoFiniteDiff(), scenarios, rtol=1e-3, atol=1e-3)
    message = str(info.value)
    assert "2 of 2" in message
    # Preparation itself refuses writes into x and into a Constant, naming the argument.
    assert "f wrote in place into x." in message
    assert "f wrote in place into context 1 (Constant)." in message


def test_recompiling_prep_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    install_engine(monkeypatch, RecompilesEveryCall)
    scenarios = default_scenarios(operators=["gradient", "jacobian"], dtypes=(torch.float64,), contexts=("none",))
    records = run_differentiation_tests(ODD, scenarios)
    assert [r.status for r in records] == ["fail"] * len(scenarios)
    assert all("num_compilations grew from 1 to 3" in " ".join(r.problems) for r in records)
    with pytest.raises(AssertionError, match="rule 2"):
        check_backends(ODD, scenarios)


def test_prep_keeping_the_users_x_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    install_engine(monkeypatch, KeepsX)
    scenarios = default_scenarios(operators=["gradient"], dtypes=(torch.float64,), contexts=("none",))
    with pytest.raises(AssertionError, match="rule 4"):
        check_backends(ODD, scenarios)


def test_explicit_wrong_result_fails_and_exceptions_are_reported() -> None:
    wrong = Scenario("gradient", lambda x: (x**2).sum(), torch.ones(2), result=torch.zeros(2), name="wrong-result")
    right = Scenario("jacobian", lambda x: x * 2, torch.ones(2), result=2 * torch.eye(2), name="right-result")

    def broken(x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("broken on purpose")

    raising = Scenario("gradient", broken, torch.ones(2), result=torch.ones(2), name="broken")
    with pytest.raises(AssertionError) as info:
        check_backends(torchdi.AutoFunc(), [wrong, right, raising])
    message = str(info.value)
    assert "2 of 3" in message and "wrong-result" in message and "right-result" not in message
    assert "gradient: broken" in message and "preparation raised RuntimeError: broken on purpose" in message


def test_unsupported_pairs_and_unavailable_backends_are_not_failures() -> None:
    scenarios = default_scenarios(operators=["hvp"], dtypes=(torch.float64,), contexts=("none",))
    records = check_backends(torchdi.SecondOrder(torchdi.AutoFunc(), torchdi.AutoAutograd()), scenarios)
    assert {r.status for r in records} == {"unsupported"}
    if not torchdi.check_available(torchdi.AutoXLA()):
        records = check_backends(torchdi.AutoXLA(), scenarios)
        assert {r.status for r in records} == {"unavailable"}
        assert "torch_xla" in records[0].problems[0]


# --------------------------------------------------------------------------------------------
# benchmark_differentiation


def tiny_bench_scenarios() -> list[Scenario]:
    return [
        Scenario("value_and_gradient", lambda x: (x.sin() ** 2).sum(), torch.linspace(0, 1, 50), name="tiny-gradient"),
        Scenario("hvp", lambda x: (x**4).sum(), torch.linspace(0, 1, 10), tangents=(torch.ones(10),), name="tiny-hvp", tags={"large"}),
    ]


def test_benchmark_rows_ratio_and_correctness() -> None:
    rows = benchmark_differentiation(
        {"func": torchdi.AutoFunc(), "fd": torchdi.AutoFiniteDiff()},
        tiny_bench_scenarios(),
        rounds=2,
        min_time=1e-4,
        skip=lambda label, backend, scenario: "too big" if label == "fd" and "large" in scenario.tags else None,
    )
    # autograd is added as the baseline
    assert [(r.backend, r.scenario) for r in rows] == [
        ("autograd", "tiny-gradient"), ("func", "tiny-gradient"), ("fd", "tiny-gradient"),
        ("autograd", "tiny-hvp"), ("func", "tiny-hvp"), ("fd", "tiny-hvp"),
    ]
    measured = [r for r in rows if r.status != "skipped"]
    assert all(r.status == "ok" and r.correct for r in measured)
    assert all(r.call_time and r.call_time > 0 and r.prep_time is not None and r.rounds == 2 for r in measured)
    assert all(r.ratio == 1.0 for r in measured if r.backend == "autograd")
    assert rows[-1].status == "skipped" and rows[-1].note == "too big"
    table = format_table(rows)
    for column in ("backend", "scenario", "operator", "prep", "call", "vs autograd", "compilations", "correct"):
        assert column in table.splitlines()[0]
    assert "not run (skipped: too big): fd on tiny-hvp" in table
    markdown = format_markdown(rows, "title")
    assert "| backend | scenario |" in markdown and "| func | tiny-gradient | value_and_gradient |" in markdown


def test_benchmark_marks_a_wrong_backend_and_a_recompiling_one(monkeypatch: pytest.MonkeyPatch) -> None:
    install_engine(monkeypatch, PerturbedGradient)
    rows = benchmark_differentiation({"odd": ODD}, tiny_bench_scenarios()[:1], rounds=1, min_time=1e-4)
    odd = rows[1]
    assert odd.backend == "odd" and odd.status == "FAIL" and odd.correct is False and "relative error" in odd.note
    assert "FAIL: odd on tiny-gradient" in format_table(rows)

    install_engine(monkeypatch, RecompilesEveryCall)
    rows = benchmark_differentiation({"odd": ODD}, tiny_bench_scenarios()[:1], rounds=1, min_time=1e-4)
    assert rows[1].status == "FAIL" and "recompiled during timing" in rows[1].note


def test_relative_error() -> None:
    assert relative_error(torch.ones(2), torch.ones(2)) == 0.0
    assert relative_error((torch.ones(2),), torch.ones(2)) == float("inf")
    assert relative_error(torch.tensor([1.0, 2.2]), torch.tensor([1.0, 2.0])) == pytest.approx(0.1)


def test_benchmark_scenarios_are_well_formed() -> None:
    scenarios = benchmark_scenarios(quick=True)
    names = {s.name for s in scenarios}
    assert {"mlp-small", "rosenbrock-1e6", "mlp-dict", "jacobian-100", "hessian-1000", "hvp-1000"} == names
    by_name = {s.name: s for s in scenarios}
    assert by_name["rosenbrock-1e6"].x.numel() == 1_000_000
    assert isinstance(by_name["mlp-dict"].x, dict)
    assert by_name["jacobian-100"].x.shape == (100,) and by_name["hessian-1000"].x.shape == (1000,)
    assert all(s.dtype == torch.float32 for s in scenarios)


def test_test_differentiation_is_not_collected_when_imported_into_a_test_module(pytester):
    pytester.makepyfile(
        """
        import torch
        import torchdi as td
        from torchdi.testing import Scenario, test_differentiation

        def test_mine():
            test_differentiation([td.AutoFunc()], [Scenario("gradient", lambda x: (x**2).sum(), torch.randn(3))])
        """
    )
    result = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
