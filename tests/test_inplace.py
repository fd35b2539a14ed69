"""y= for in-place functions f(y, x, *contexts) (DifferentiationInterface.jl's f!(y, x))."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.func import jacrev, jvp, vjp

import torchdi
from torchdi import (
    AutoAutograd,
    AutoCompile,
    AutoFiniteDiff,
    AutoFunc,
    AutoSparse,
    Constant,
    SecondOrder,
)

BACKENDS = {
    "autograd": AutoAutograd(),
    "func": AutoFunc(),
    "func_forward": AutoFunc(mode="forward"),
    "fd": AutoFiniteDiff(),
    "so_func_func": SecondOrder(AutoFunc(), AutoFunc()),
    "compile": AutoCompile(compiler="aot_eager"),
}


def f_inplace(y, x, a):
    y.copy_(x[1:] * x[:-1])
    y.mul_(a)
    y[0].add_(x[0] ** 2)


def f_outplace(x, a):
    y = torch.zeros(x.shape[0] - 1, dtype=x.dtype)
    f_inplace(y, x, a)
    return y


X = torch.linspace(0.1, 1.0, 4, dtype=torch.float64)
A = torch.tensor(2.0, dtype=torch.float64)


def _tol(backend):
    return {"atol": 1e-6, "rtol": 1e-6} if isinstance(backend, AutoFiniteDiff) else {"atol": 1e-12, "rtol": 1e-12}


@pytest.mark.parametrize("backend", BACKENDS.values(), ids=BACKENDS.keys())
def test_four_operators_match_torch_func(backend):
    tol = _tol(backend)
    expected_y = f_outplace(X, A)
    x_before = X.clone()
    y = torch.full((3,), float("nan"), dtype=torch.float64)
    jac = torchdi.jacobian(f_inplace, backend, X, Constant(A), y=y)
    torch.testing.assert_close(jac, jacrev(f_outplace)(X, A), **tol)
    torch.testing.assert_close(y, expected_y)
    y = torch.empty(3, dtype=torch.float64)
    value, jac = torchdi.value_and_jacobian(f_inplace, backend, X, Constant(A), y=y)
    assert value is y
    torch.testing.assert_close(y, expected_y)
    t = torch.ones(4, dtype=torch.float64)
    (dy,) = torchdi.pushforward(f_inplace, backend, X, (t,), Constant(A), y=y)
    torch.testing.assert_close(dy, jvp(lambda x: f_outplace(x, A), (X,), (t,))[1], **tol)
    value, (dy,) = torchdi.value_and_pushforward(f_inplace, backend, X, (t,), Constant(A), y=y)
    assert value is y
    ty = torch.tensor([1.0, -1.0, 2.0], dtype=torch.float64)
    (dx,) = torchdi.pullback(f_inplace, backend, X, (ty,), Constant(A), y=y)
    torch.testing.assert_close(dx, vjp(lambda x: f_outplace(x, A), X)[1](ty)[0], **tol)
    value, (dx,) = torchdi.value_and_pullback(f_inplace, backend, X, (ty,), Constant(A), y=y)
    assert value is y
    torch.testing.assert_close(X, x_before)

    def g_inplace(y, t):
        y.copy_(torch.stack([t, t**2, t.sin()]))

    y3 = torch.empty(3)
    d = torchdi.derivative(g_inplace, backend, torch.tensor(3.0), y=y3)
    torch.testing.assert_close(d, torch.stack([torch.tensor(1.0), torch.tensor(6.0), torch.tensor(3.0).cos()]), atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(y3, torch.stack([torch.tensor(3.0), torch.tensor(9.0), torch.tensor(3.0).sin()]))
    value, d = torchdi.value_and_derivative(g_inplace, backend, torch.tensor(3.0), y=y3)
    assert value is y3


@pytest.mark.parametrize("dense", [AutoFunc(), AutoAutograd()], ids=["func", "autograd"])
def test_sparse_jacobian_with_y(dense):
    y = torch.empty(3, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prep = torchdi.prepare_jacobian(f_inplace, AutoSparse(dense), X, Constant(A), y=y)
        jac = torchdi.jacobian(f_inplace, AutoSparse(dense), X * 2, Constant(A), prep=prep, y=y)
    torch.testing.assert_close(jac.to_dense(), jacrev(f_outplace)(X * 2, A))
    torch.testing.assert_close(y, f_outplace(X * 2, A))
    assert prep.ncolors == 2


def test_prep_is_reused_and_checks_y():
    backend = AutoCompile(compiler="aot_eager")
    y = torch.empty(3, dtype=torch.float64)
    prep = torchdi.prepare_jacobian(f_inplace, backend, X, Constant(A), y=y)
    for scale in (2.0, 3.0):
        jac = torchdi.jacobian(f_inplace, backend, X * scale, Constant(A), prep=prep, y=torch.empty(3, dtype=torch.float64))
        torch.testing.assert_close(jac, jacrev(f_outplace)(X * scale, A))
    assert prep.num_compilations == 1
    with pytest.raises(torchdi.PreparationMismatchError, match=r"f: mismatch.*shape \(3,\).*shape \(4,\)"):
        torchdi.jacobian(f_inplace, backend, X, Constant(A), prep=prep, y=torch.empty(4, dtype=torch.float64))
    with pytest.raises(torchdi.PreparationMismatchError, match="f: mismatch"):
        torchdi.jacobian(f_outplace, backend, X, Constant(A), prep=prep)


def test_errors():
    with pytest.raises(TypeError, match=r"y= must be a tensor.*got list"):
        torchdi.jacobian(f_inplace, AutoFunc(), X, Constant(A), y=[0.0])
    with pytest.raises(TypeError, match=r"y= must have a floating-point or complex dtype.*torch\.int64"):
        torchdi.jacobian(f_inplace, AutoFunc(), X, Constant(A), y=torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="y= is on meta but x is on cpu"):
        torchdi.jacobian(f_inplace, AutoFunc(), X, Constant(A), y=torch.empty(3, dtype=torch.float64, device="meta"))
    with pytest.raises(TypeError, match=r"must write its output into y\s+and return None; it returned Tensor"):
        torchdi.jacobian(lambda y, x: x * 2, AutoFunc(), X, y=torch.empty(4, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"got NoneType; if f writes its output into its first argument.*pass y="):
        torchdi.jacobian(lambda x: None, AutoFunc(), X)
    with pytest.raises(TypeError, match="y= and has_aux=True do not combine"):
        torchdi.jacobian(f_inplace, AutoFunc(), X, Constant(A), y=torch.empty(3, dtype=torch.float64), has_aux=True)
    with pytest.raises(RuntimeError) as info:  # f writes 3 values into a y of 5: torch's own error, with a note
        torchdi.jacobian(f_inplace, AutoFunc(), X, Constant(A), y=torch.empty(5, dtype=torch.float64))
    assert "called f(y, x, *contexts) with y of shape (5,)" in "".join(getattr(info.value, "__notes__", []))
