"""prepare_pushforward_same_point, prepare_pullback_same_point, prepare_hvp_same_point."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from torch.func import grad, jvp, vjp

import torchdi
import torchdi as td
from torchdi import (
    AutoAutograd,
    AutoCompile,
    AutoFiniteDiff,
    AutoFunc,
    Constant,
    PreparationMismatchError,
)

BACKENDS = {
    "autograd": AutoAutograd(),
    "func": AutoFunc(),
    "fd": AutoFiniteDiff(),
    "compile": AutoCompile(compiler="aot_eager"),
}


def _tol(backend):
    return {"atol": 1e-5, "rtol": 1e-5} if isinstance(backend, AutoFiniteDiff) else {"atol": 1e-10, "rtol": 1e-10}


def loss(x, a):
    return (torch.tanh(a @ x) ** 2).sum() + (x**4).sum()


def vector(x, a):
    return {"y": torch.tanh(a @ x), "s": x.sum().reshape(1)}


def _point():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(5, 4, dtype=torch.float64, generator=g)
    x = torch.randn(4, dtype=torch.float64, generator=g)
    tangents = [torch.randn(4, dtype=torch.float64, generator=g) for _ in range(3)]
    return a, x, tangents


@pytest.mark.parametrize("backend", BACKENDS.values(), ids=BACKENDS.keys())
def test_hvp_same_point_matches_torch_func(backend):
    a, x, ts = _point()
    tol = {"atol": 1e-4, "rtol": 1e-4} if isinstance(backend, AutoFiniteDiff) else _tol(backend)
    prep = torchdi.prepare_hvp_same_point(loss, backend, x, (ts[0], ts[1]), Constant(a))
    g_fn = grad(lambda x_: loss(x_, a))
    for pair in ((ts[0], ts[1]), (ts[2], ts[0])):  # new tangents, same point
        hvps = torchdi.hvp(loss, backend, x, pair, Constant(a), prep=prep)
        for hv, t in zip(hvps, pair):
            torch.testing.assert_close(hv, jvp(g_fn, (x,), (t,))[1], **tol)
        g, _ = torchdi.gradient_and_hvp(loss, backend, x, pair, Constant(a), prep=prep)
        torch.testing.assert_close(g, g_fn(x), **tol)


@pytest.mark.parametrize("backend", BACKENDS.values(), ids=BACKENDS.keys())
def test_pushforward_and_pullback_same_point(backend):
    a, x, ts = _point()
    tol = _tol(backend)
    y = vector(x, a)
    push = torchdi.prepare_pushforward_same_point(vector, backend, x, (ts[0],), Constant(a))
    for t in ts:
        (dy,) = torchdi.pushforward(vector, backend, x, (t,), Constant(a), prep=push)
        expected = jvp(lambda x_: vector(x_, a), (x,), (t,))[1]
        torch.testing.assert_close(dy, expected, **tol)
    value, _ = torchdi.value_and_pushforward(vector, backend, x, (ts[1],), Constant(a), prep=push)
    torch.testing.assert_close(value, y)
    cotangent = {"y": torch.ones(5, dtype=torch.float64), "s": torch.ones(1, dtype=torch.float64)}
    pull = torchdi.prepare_pullback_same_point(vector, backend, x, (cotangent,), Constant(a))
    for scale in (1.0, -2.0):
        ty = {k: v * scale for k, v in cotangent.items()}
        (dx,) = torchdi.pullback(vector, backend, x, (ty,), Constant(a), prep=pull)
        torch.testing.assert_close(dx, vjp(lambda x_: vector(x_, a), x)[1](ty)[0], **tol)


def test_pytree_x_same_point():
    x = {"w": torch.ones(2, dtype=torch.float64), "b": torch.tensor([0.5], dtype=torch.float64)}

    def f(p):
        return ((p["w"] ** 3).sum() + p["b"] ** 2 * p["w"].sum()).sum()

    t = {"w": torch.tensor([1.0, 0.0], dtype=torch.float64), "b": torch.tensor([1.0], dtype=torch.float64)}
    for backend in (AutoFunc(), AutoAutograd()):
        prep = torchdi.prepare_hvp_same_point(f, backend, x, (t,))
        (hv,) = torchdi.hvp(f, backend, x, (t,), prep=prep)
        (expected,) = torchdi.hvp(f, AutoAutograd(), x, (t,))
        torch.testing.assert_close(hv, expected)


@pytest.mark.parametrize("backend", [AutoFunc(), AutoAutograd(), AutoCompile(compiler="aot_eager")], ids=["func", "autograd", "compile"])
@pytest.mark.parametrize("strict", [True, False])
def test_refuses_another_or_mutated_point(backend, strict):
    a, x, ts = _point()
    prep = torchdi.prepare_hvp_same_point(loss, backend, x, (ts[0],), Constant(a), strict=strict)
    with pytest.raises(PreparationMismatchError, match=r"x is another tensor than at preparation.*prepare_hvp\b"):
        torchdi.hvp(loss, backend, x.clone(), (ts[0],), Constant(a), prep=prep)
    with pytest.raises(PreparationMismatchError, match=r"context 1 is another tensor"):
        torchdi.hvp(loss, backend, x, (ts[0],), Constant(a.clone()), prep=prep)
    a.add_(1.0)  # modified in place: the kept linearization would be stale
    with pytest.raises(PreparationMismatchError, match=r"context 1 was modified in place since preparation \(version 0 -> 1\)"):
        torchdi.hvp(loss, backend, x, (ts[0],), Constant(a), prep=prep)
    a2, x2, _ = _point()
    prep = torchdi.prepare_pullback_same_point(vector, backend, x2, ({"y": torch.ones(5, dtype=torch.float64), "s": torch.ones(1, dtype=torch.float64)},), Constant(a2), strict=strict)
    x2[0] = 3.0
    with pytest.raises(PreparationMismatchError, match="x was modified in place"):
        torchdi.pullback(vector, backend, x2, ({"y": torch.ones(5, dtype=torch.float64), "s": torch.ones(1, dtype=torch.float64)},), Constant(a2), prep=prep)


def test_same_point_prep_still_checks_the_signature():
    a, x, ts = _point()
    prep = torchdi.prepare_hvp_same_point(loss, AutoFunc(), x, (ts[0],), Constant(a))
    with pytest.raises(PreparationMismatchError, match="tx"):
        torchdi.hvp(loss, AutoFunc(), x, (ts[0], ts[1]), Constant(a), prep=prep)
    with pytest.raises(PreparationMismatchError, match="operator"):
        torchdi.gradient(loss, AutoFunc(), x, Constant(a), prep=prep)


def test_compiled_same_point_is_one_program_of_the_tangents():
    a, x, ts = _point()
    backend = AutoCompile(compiler="aot_eager")
    prep = torchdi.prepare_hvp_same_point(loss, backend, x, (ts[0],), Constant(a))
    assert prep.num_compilations == 1
    for t in ts:
        torchdi.hvp(loss, backend, x, (t,), Constant(a), prep=prep)
    assert prep.num_compilations == 1


def test_exported():
    for name in ("prepare_pushforward_same_point", "prepare_pullback_same_point", "prepare_hvp_same_point"):
        assert name in torchdi.__all__ and callable(getattr(torchdi, name))


SCALE = 1.0


def _scaled(x: torch.Tensor) -> torch.Tensor:
    return (SCALE * x.sin() ** 2).sum()


@pytest.mark.parametrize("backend", [td.AutoAutograd(), td.AutoFunc(), td.AutoCompile(compiler="aot_eager")], ids=["autograd", "func", "compile"])
def test_a_changed_global_is_refused_not_served_stale(backend: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The point's linearization was of f as it read its globals: after one changed, a call is
    refused (before: the old global's HVP, silently)."""
    x, t = torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    prep = td.prepare_hvp_same_point(_scaled, backend, x, (t,))
    td.hvp(_scaled, backend, x, (t,), prep=prep)
    monkeypatch.setattr(sys.modules[__name__], "SCALE", 3.0)
    with pytest.raises(td.PreparationMismatchError, match="what f reads besides x and the contexts changed"):
        td.hvp(_scaled, backend, x, (t,), prep=prep)
    monkeypatch.undo()  # the same global again: served
    torch.testing.assert_close(td.hvp(_scaled, backend, x, (t,), prep=prep)[0], torch.autograd.functional.hvp(_scaled, x, t)[1])
