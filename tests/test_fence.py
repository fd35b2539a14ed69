"""Every private torch internal torchdi uses is fenced in ``torchdi/engines/_dynamo.py`` with a
public fallback: a torch that lacks one is slower, never wrong.

Each test removes one internal (the probe's result set to "missing", as on a torch that moved
it) and checks on ``AutoCompile(compiler="aot_eager")`` and ``DifferentiateWith`` that results,
rule 2 (no compilation after preparation), rule 7 (a changed global or closure recompiles, never
stale, counted like raw ``torch.compile``) and rule 9 (a dropped prep frees ``f``) still hold, and
that one warning names the fast path that is off.
"""

from __future__ import annotations

import gc
import logging
import weakref

import pytest
import torch

import torchdi as td
from torchdi.engines import _dynamo

REFERENCE = td.AutoAutograd()
BACKEND = td.AutoCompile(compiler="aot_eager")

# fast path -> (probe in _dynamo, the value it has on a torch without the internal)
DYNAMO_HOOKS = {
    "guard_lookup": ("_CACHE_ENTRY_LIST", None),
    "release": ("_RELEASE", None),
    "compiler_wrappers": ("_COMPILER_WRAPPERS", None),
    "tensorify_reset": ("_TENSORIFY_STATE", None),
}
AUTOGRAD_HOOKS = {
    "function_apply": ("_FUNCTION_APPLY", None),
    "transforms_active": ("_TRANSFORMS_ACTIVE", None),
    "forward_ad_level": ("_FORWARD_AD_LEVEL", False),
    "set_grad_enabled": ("_SET_GRAD_ENABLED", None),
}


def test_every_fast_path_has_a_fence_test():
    persisted = {"artifact_scope", "compile_cache_counts"}  # fenced in tests/test_persist.py
    assert set(DYNAMO_HOOKS) | set(AUTOGRAD_HOOKS) | {"dynamo_config"} | persisted == set(_dynamo.FAST_PATHS)


@pytest.fixture
def without(monkeypatch):
    """``without(name)``: this process's torch lacks the internal behind fast path ``name``."""

    def remove(name):
        attribute, missing = {**DYNAMO_HOOKS, **AUTOGRAD_HOOKS}[name]
        monkeypatch.setattr(_dynamo, attribute, missing)

    monkeypatch.setattr(_dynamo, "_warned", set())
    return remove


SCALE = 2.0


def uses_global(x, c, k):
    # (no Python arithmetic on k: torch 2.9 would specialize it, see test_compile_soundness)
    return (torch.sin(x) * c).sum() * k * SCALE


def _closure():
    k = 2.0

    def f(x):
        return k * (x**3).sum()

    def change():
        nonlocal k
        k = 5.0

    return f, change


def _warnings_naming(caplog, name):
    return [r for r in caplog.records if r.name == "torchdi" and f"({name}:" in r.getMessage()]


@pytest.mark.parametrize("name", sorted(DYNAMO_HOOKS))
def test_compiled_backend_without_an_internal(name, without, caplog, monkeypatch):
    global SCALE
    without(name)
    monkeypatch.setitem(globals(), "SCALE", 2.0)
    x, c = torch.linspace(-1.0, 1.0, 5), torch.rand(5)
    with caplog.at_level(logging.WARNING, logger="torchdi"):
        prep = td.prepare_gradient(uses_global, BACKEND, x, td.Constant(c), td.Constant(1.5))
        prepared = prep.num_compilations
        for k in (1.5, 0.5, -2.0):  # new values of x, of a tensor and of a float context
            x2, c2 = torch.randn(5), torch.rand(5)
            want = td.value_and_gradient(uses_global, REFERENCE, x2, td.Constant(c2), td.Constant(k))
            got = td.value_and_gradient(uses_global, BACKEND, x2, td.Constant(c2), td.Constant(k), prep=prep)
            torch.testing.assert_close(got, want)
            torch.testing.assert_close(td.gradient(uses_global, BACKEND, x2, td.Constant(c2), td.Constant(k), prep=prep), want[1])
        steady = prep.num_compilations
        assert steady == prepared  # rule 2: nothing compiles after preparation
        # rule 7: a changed global recompiles once (as raw torch.compile does), never stale
        SCALE = 3.0
        want = td.gradient(uses_global, REFERENCE, x, td.Constant(c), td.Constant(1.5))
        torch.testing.assert_close(td.gradient(uses_global, BACKEND, x, td.Constant(c), td.Constant(1.5), prep=prep), want)
        torch.testing.assert_close(td.gradient(uses_global, BACKEND, x, td.Constant(c), td.Constant(1.5), prep=prep), want)
        assert prep.num_compilations == steady + 1
        # a closure cell
        f, change = _closure()
        prep = td.prepare_gradient(f, BACKEND, x)
        td.gradient(f, BACKEND, x, prep=prep)
        before = prep.num_compilations
        change()
        torch.testing.assert_close(td.gradient(f, BACKEND, x, prep=prep), 15.0 * x**2)
        assert prep.num_compilations == before + 1
    if name != "tensorify_reset":  # (nothing slower to name: no float was specialized here)
        assert len(_warnings_naming(caplog, name)) == 1


@pytest.mark.parametrize("name", ["release", "guard_lookup", "compiler_wrappers"])
def test_dropped_preps_free_f_without_an_internal(name, without):
    without(name)
    x = torch.ones(100)

    def one_prep():
        big = torch.randn(10_000)
        prep = td.prepare_gradient(lambda v: (v * big[:100]).sum(), BACKEND, x)
        torch.testing.assert_close(td.gradient(prep.f, BACKEND, x, prep=prep), big[:100])
        return weakref.ref(big), weakref.ref(prep.f)

    refs = [one_prep() for _ in range(3)]
    gc.collect()
    assert all(big() is None and f() is None for big, f in refs)


def _check_differentiate_with():
    g = td.DifferentiateWith(lambda z: torch.sin(z) * 2.0, td.AutoFunc())
    x = torch.linspace(-1.0, 1.0, 4, dtype=torch.float64)
    # eager autograd
    xr = x.clone().requires_grad_()
    g(xr).sum().backward()
    torch.testing.assert_close(xr.grad, 2.0 * torch.cos(x))
    # torch.func, second order included
    torch.testing.assert_close(torch.func.grad(lambda z: g(z).sum())(x), 2.0 * torch.cos(x))
    torch.testing.assert_close(torch.func.hessian(lambda z: g(z).sum())(x), torch.diag(-2.0 * torch.sin(x)))
    # forward mode (with a backend that does not open a dual level of its own: torch.func.jvp
    # refuses to nest in one, so DifferentiateWith(f, AutoFunc()) is refused there on any torch)
    import torch.autograd.forward_ad as fwAD

    h = td.DifferentiateWith(lambda z: torch.sin(z) * 2.0, td.AutoFiniteDiff())
    v = torch.ones(4, dtype=torch.float64)
    with fwAD.dual_level():
        tangent = fwAD.unpack_dual(h(fwAD.make_dual(x, v))).tangent
    torch.testing.assert_close(tangent, 2.0 * torch.cos(x), rtol=1e-6, atol=1e-7)
    # under torch.compile
    compiled = torch.compile(lambda z: g(z * 2.0).sum(), backend="aot_eager")
    xr = x.clone().requires_grad_()
    compiled(xr).backward()
    torch.testing.assert_close(xr.grad, 4.0 * torch.cos(2.0 * x))
    # and an eager backend's operator, whose calls switch grad mode
    torch.testing.assert_close(td.gradient(lambda z: g(z).sum(), td.AutoAutograd(), x), 2.0 * torch.cos(x))
    assert torch.is_grad_enabled()  # the caller's grad mode, restored
    with torch.no_grad():
        td.gradient(lambda z: g(z).sum(), td.AutoAutograd(), x)
        assert not torch.is_grad_enabled()


@pytest.mark.parametrize("name", sorted(AUTOGRAD_HOOKS))
def test_differentiate_with_without_an_internal(name, without):
    without(name)
    _check_differentiate_with()


def test_differentiate_with_with_every_internal():
    _check_differentiate_with()


def test_missing_dynamo_knobs_are_left_out_with_one_warning(caplog, monkeypatch):
    """A ``torch._dynamo.config`` knob a torch renamed is left out (``torch.compile``'s
    ``recompile_limit=`` argument covers the recompile limit where torch has it)."""
    monkeypatch.setattr(_dynamo, "_warned", set())
    real = _dynamo._has_knob
    monkeypatch.setattr(_dynamo, "_has_knob", lambda config, name: "recompile_limit" not in name and real(config, name))
    x = torch.linspace(-1.0, 1.0, 5)
    f, change = _closure()
    with caplog.at_level(logging.WARNING, logger="torchdi"):
        prep = td.prepare_gradient(f, BACKEND, x)
        torch.testing.assert_close(td.gradient(f, BACKEND, x, prep=prep), 6.0 * x**2)
        change()
        torch.testing.assert_close(td.gradient(f, BACKEND, x, prep=prep), 15.0 * x**2)
    assert len(_warnings_naming(caplog, "dynamo_config")) == 1
    assert "recompile_limit" in _warnings_naming(caplog, "dynamo_config")[0].getMessage()
