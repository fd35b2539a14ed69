"""has_aux=True on every operator: f returns (y, aux); aux comes back untouched, not differentiated."""

from __future__ import annotations

import pytest
import torch
from torch.func import grad, jacrev

import torchdi
from torchdi import AutoAutograd, AutoCompile, AutoFiniteDiff, AutoFunc, SecondOrder

BACKENDS = {
    "autograd": AutoAutograd(),
    "func": AutoFunc(),
    "fd": AutoFiniteDiff(),
    "so_func_func": SecondOrder(AutoFunc(), AutoFunc()),
    "compile": AutoCompile(compiler="aot_eager"),
}
X = torch.linspace(-1, 1, 3, dtype=torch.float64)
ONES = torch.ones(3, dtype=torch.float64)


def _tol(backend):
    return {"atol": 1e-5, "rtol": 1e-5} if isinstance(backend, AutoFiniteDiff) else {"atol": 1e-10, "rtol": 1e-10}


def loss(x):
    return (x**3).sum(), {"logits": x * 2, "norm": x.norm()}


def vector(x):
    return x.sin() * 2, x.cos()


def _check_aux(aux, x):
    torch.testing.assert_close(aux["logits"], 2 * x)
    torch.testing.assert_close(aux["norm"], x.norm())


@pytest.mark.parametrize("backend", BACKENDS.values(), ids=BACKENDS.keys())
def test_gradient_family(backend):
    g, aux = torchdi.gradient(loss, backend, X, has_aux=True)
    g_ref, _aux_ref = grad(loss, has_aux=True)(X)
    torch.testing.assert_close(g, g_ref, **_tol(backend))
    _check_aux(aux, X)
    (y, aux), g = torchdi.value_and_gradient(loss, backend, X, has_aux=True)
    torch.testing.assert_close(y, (X**3).sum())
    _check_aux(aux, X)
    prep = torchdi.prepare_gradient(loss, backend, X, has_aux=True)
    g2, aux2 = torchdi.gradient(loss, backend, X * 2, prep=prep, has_aux=True)
    torch.testing.assert_close(g2, 3 * (2 * X) ** 2, **_tol(backend))
    _check_aux(aux2, X * 2)


@pytest.mark.parametrize("backend", BACKENDS.values(), ids=BACKENDS.keys())
def test_first_order_families(backend):
    tol = _tol(backend)
    (dx,), aux = torchdi.pullback(vector, backend, X, (ONES,), has_aux=True)
    torch.testing.assert_close(dx, 2 * X.cos(), **tol)
    torch.testing.assert_close(aux, X.cos())
    (y, aux), (dx,) = torchdi.value_and_pullback(vector, backend, X, (ONES,), has_aux=True)
    torch.testing.assert_close(y, 2 * X.sin())
    (dy,), aux = torchdi.pushforward(vector, backend, X, (ONES, 2 * ONES), has_aux=True)[0][:1], torchdi.pushforward(
        vector, backend, X, (ONES,), has_aux=True
    )[1]
    torch.testing.assert_close(dy, 2 * X.cos(), **tol)
    torch.testing.assert_close(aux, X.cos())
    jac, aux = torchdi.jacobian(vector, backend, X, has_aux=True)
    torch.testing.assert_close(jac, jacrev(vector, has_aux=True)(X)[0], **tol)
    torch.testing.assert_close(aux, X.cos())
    (y, aux), jac = torchdi.value_and_jacobian(vector, backend, X, has_aux=True)
    torch.testing.assert_close(aux, X.cos())
    d, aux = torchdi.derivative(lambda t: (t.sin(), t * 3), backend, 0.5, has_aux=True)
    torch.testing.assert_close(d, torch.tensor(0.5).cos(), **tol)
    torch.testing.assert_close(aux, torch.tensor(1.5))


@pytest.mark.parametrize("backend", BACKENDS.values(), ids=BACKENDS.keys())
def test_second_order_families(backend):
    tol = {"atol": 1e-4, "rtol": 1e-4} if isinstance(backend, AutoFiniteDiff) else _tol(backend)
    h, aux = torchdi.hessian(loss, backend, X, has_aux=True)
    torch.testing.assert_close(h, torch.diag(6 * X), **tol)
    _check_aux(aux, X)
    (y, aux), g, h = torchdi.value_gradient_and_hessian(loss, backend, X, has_aux=True)
    torch.testing.assert_close(y, (X**3).sum())
    torch.testing.assert_close(g, 3 * X**2, **tol)
    _check_aux(aux, X)
    (hv,), aux = torchdi.hvp(loss, backend, X, (ONES,), has_aux=True)
    torch.testing.assert_close(hv, 6 * X, **tol)
    (g, aux), (hv,) = torchdi.gradient_and_hvp(loss, backend, X, (ONES,), has_aux=True)
    torch.testing.assert_close(g, 3 * X**2, **tol)
    _check_aux(aux, X)
    d2, aux = torchdi.second_derivative(lambda t: (t**3, t * 2), backend, 0.5, has_aux=True)
    torch.testing.assert_close(d2, torch.tensor(3.0), **tol)
    (_y, aux), _d, d2 = torchdi.value_derivative_and_second_derivative(lambda t: (t**3, t * 2), backend, 0.5, has_aux=True)
    torch.testing.assert_close(aux, torch.tensor(1.0))


def test_func_evaluates_f_once():
    calls = []

    def counted(x):
        calls.append(1)
        return (x**2).sum(), x * 3

    prep = torchdi.prepare_gradient(counted, AutoFunc(), X, has_aux=True)
    calls.clear()
    _g, aux = torchdi.gradient(counted, AutoFunc(), X, prep=prep, has_aux=True)
    torch.testing.assert_close(aux, 3 * X)
    assert len(calls) == 1  # aux comes out of torch.func's transform, not a second evaluation


def test_compile_returns_aux_from_its_one_program():
    backend = AutoCompile(compiler="aot_eager")
    prep = torchdi.prepare_gradient(loss, backend, X, has_aux=True)
    for scale in (2.0, 3.0):
        g, aux = torchdi.gradient(loss, backend, X * scale, prep=prep, has_aux=True)
        _check_aux(aux, X * scale)
        torch.testing.assert_close(g, 3 * (X * scale) ** 2)
    assert prep.num_compilations == 1


@pytest.mark.parametrize("backend", [AutoAutograd(), AutoFunc(), AutoFiniteDiff(method="forward")], ids=["autograd", "func", "fd"])
def test_aux_sees_the_same_random_draws(backend):
    def dropout_loss(x):
        mask = torch.nn.functional.dropout(torch.ones_like(x), p=0.5, training=True)
        return (x * mask).sum(), mask

    x = torch.ones(64, dtype=torch.float64)
    torch.manual_seed(3)
    g, mask = torchdi.gradient(dropout_loss, backend, x, has_aux=True)
    tol = {"atol": 1e-6, "rtol": 1e-6} if isinstance(backend, AutoFiniteDiff) else {}
    if not isinstance(backend, AutoFiniteDiff):  # FD evaluates f many times: draws differ per evaluation
        torch.testing.assert_close(g, mask, **tol)
    # the RNG is left where the differentiated evaluation left it
    torch.manual_seed(3)
    torchdi.gradient(lambda x: dropout_loss(x)[0], backend, x)
    after_plain = torch.rand(1)
    torch.manual_seed(3)
    torchdi.gradient(dropout_loss, backend, x, has_aux=True)
    assert torch.equal(torch.rand(1), after_plain)


def test_non_tensor_aux_is_returned_untouched():
    marker = object()
    g, aux = torchdi.gradient(lambda x: ((x**2).sum(), {"tag": marker, "k": 3}), AutoFunc(), X, has_aux=True)
    assert aux["tag"] is marker and aux["k"] == 3
    torch.testing.assert_close(g, 2 * X)


def test_aux_with_pytree_x_jacobian():
    x = {"a": X, "b": ONES}
    jac, aux = torchdi.jacobian(lambda d: (d["a"] * d["b"], d["a"].sum()), AutoFunc(), x, has_aux=True)
    torch.testing.assert_close(jac["a"], torch.diag(ONES))
    torch.testing.assert_close(aux, X.sum())


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("backend", [AutoAutograd(), AutoFunc()], ids=["autograd", "func"])
def test_f_must_return_a_pair(backend):
    with pytest.raises(TypeError, match=r"has_aux=True, f must return a pair \(y, aux\).*got Tensor"):
        torchdi.gradient(lambda x: (x**2).sum(), backend, X, has_aux=True)
    with pytest.raises(TypeError, match="got a tuple of length 3"):
        torchdi.jacobian(lambda x: (x, x, x), backend, X, has_aux=True)
    with pytest.raises(TypeError, match="has_aux must be True or False"):
        torchdi.gradient(loss, backend, X, has_aux=1)


@pytest.mark.parametrize("strict", [True, False])
def test_prep_records_has_aux(strict):
    prep = torchdi.prepare_gradient(loss, AutoFunc(), X, has_aux=True, strict=strict)
    with pytest.raises(torchdi.PreparationMismatchError, match="has_aux: mismatch: expected True, received False"):
        torchdi.gradient(loss, AutoFunc(), X, prep=prep)
    plain = torchdi.prepare_gradient(lambda x: (x**2).sum(), AutoFunc(), X, strict=strict)
    with pytest.raises(torchdi.PreparationMismatchError, match="has_aux: mismatch: expected False, received True"):
        torchdi.gradient(plain.f, AutoFunc(), X, prep=plain, has_aux=True)


def test_state_with_aux_on_a_generic_backend_is_refused():
    buffer = torch.zeros(1)

    def with_state(x, state):
        state.add_(1)
        return (x**2).sum(), x

    with pytest.raises(torchdi.UnsupportedOperatorError, match=r"update the State twice.*AutoFunc"):
        torchdi.gradient(with_state, AutoAutograd(), X, torchdi.State(buffer), has_aux=True)
    _g, _aux = torchdi.gradient(with_state, AutoFunc(), X, torchdi.State(buffer), has_aux=True)
    assert buffer.item() == 1.0
