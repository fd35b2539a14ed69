"""DifferentiateWith: derivatives of a piece of a program from another backend, under eager
autograd, torch.func and torchdi itself."""

from __future__ import annotations

import gc
import warnings
import weakref

import numpy as np
import pytest
import torch
from torch import nn

import torchdi as td

EAGER = [td.AutoAutograd(), td.AutoFunc(), td.AutoFiniteDiff()]
IDS = ["autograd", "func", "finitediff"]
TOL = {"atol": 1e-6, "rtol": 1e-6}  # finite differences in float64


def f(x: torch.Tensor, c: float) -> torch.Tensor:
    return torch.sin(x) * x.sum() * c


def df_dx(x: torch.Tensor, c: float) -> torch.Tensor:
    """The jacobian of ``f`` by eager autograd, the reference."""
    return torch.autograd.functional.jacobian(lambda z: f(z, c), x)


@pytest.fixture
def x() -> torch.Tensor:
    return torch.randn(4, dtype=torch.float64)


def test_value_is_f(x):
    g = td.DifferentiateWith(f, td.AutoFiniteDiff())
    assert torch.equal(g(x, td.Constant(2.0)), f(x, 2.0))
    with torch.no_grad():
        y = g(x.clone().requires_grad_(), td.Constant(2.0))
    assert y.grad_fn is None and g.num_preparations == 0  # inference: no graph, nothing prepared
    pair = td.DifferentiateWith(lambda z: {"s": z.sin(), "c": (z.cos(), z * 2)}, td.AutoFunc())(x)
    assert torch.equal(pair["s"], x.sin()) and torch.equal(pair["c"][1], x * 2)


@pytest.mark.parametrize("backend", EAGER, ids=IDS)
def test_eager_backward_and_autograd_grad(backend, x):
    g = td.DifferentiateWith(f, backend)
    w = torch.randn(4, dtype=torch.float64)
    xr = x.clone().requires_grad_()
    (g(xr, td.Constant(3.0)) * w).sum().backward()
    torch.testing.assert_close(xr.grad, df_dx(x, 3.0).T @ w, **TOL)
    xr = x.clone().requires_grad_()
    (dx,) = torch.autograd.grad(g(xr, td.Constant(3.0)), xr, w)
    torch.testing.assert_close(dx, df_dx(x, 3.0).T @ w, **TOL)


@pytest.mark.parametrize("backend", EAGER, ids=IDS)
def test_torch_func_transforms(backend, x):
    g = td.DifferentiateWith(f, backend)
    jac = df_dx(x, 2.0)
    c = td.Constant(2.0)
    torch.testing.assert_close(torch.func.grad(lambda z: g(z, c).sum())(x), jac.sum(0), **TOL)
    y, vjp_fn = torch.func.vjp(lambda z: g(z, c), x)
    torch.testing.assert_close(y, f(x, 2.0))
    w = torch.randn(4, dtype=torch.float64)
    torch.testing.assert_close(vjp_fn(w)[0], jac.T @ w, **TOL)
    y, dy = torch.func.jvp(lambda z: g(z, c), (x,), (w,))
    torch.testing.assert_close(dy, jac @ w, **TOL)
    torch.testing.assert_close(torch.func.jacrev(lambda z: g(z, c))(x), jac, **TOL)
    torch.testing.assert_close(torch.func.jacfwd(lambda z: g(z, c))(x), jac, **TOL)
    batch = torch.randn(3, 4, dtype=torch.float64)
    torch.testing.assert_close(torch.func.vmap(lambda z: g(z, c))(batch), torch.stack([f(b, 2.0) for b in batch]))
    per_sample = torch.func.vmap(torch.func.grad(lambda z: g(z, c).sum()))(batch)
    torch.testing.assert_close(per_sample, torch.stack([df_dx(b, 2.0).sum(0) for b in batch]), **TOL)


@pytest.mark.parametrize("backend", [td.AutoFunc(), td.AutoFiniteDiff()], ids=["func", "finitediff"])
def test_pytree_x_and_output(backend):
    def h(p, scale):
        return {"prod": p["a"] * p["b"] * scale, "sum": p["a"].sum()}

    def reference(p):
        return h(p, 2.0)

    g = td.DifferentiateWith(h, backend)
    p = {"a": torch.randn(3, dtype=torch.float64, requires_grad=True), "b": torch.randn(3, dtype=torch.float64, requires_grad=True)}
    out = g(p, td.Constant(2.0))
    (out["prod"].sum() + out["sum"]).backward()
    torch.testing.assert_close(p["a"].grad, 2 * p["b"].detach() + 1, **TOL)
    torch.testing.assert_close(p["b"].grad, 2 * p["a"].detach(), **TOL)
    q = {k: v.detach() for k, v in p.items()}
    t = {k: torch.randn_like(v) for k, v in q.items()}

    def through_g(p_):
        return g(p_, td.Constant(2.0))

    torch.testing.assert_close(torch.func.jvp(through_g, (q,), (t,))[1], torch.func.jvp(reference, (q,), (t,))[1], **TOL)
    torch.testing.assert_close(torch.func.jacrev(through_g)(q), torch.func.jacrev(reference)(q), **TOL)
    torch.testing.assert_close(
        torch.func.hessian(lambda p_: through_g(p_)["prod"].sum())(q),
        torch.func.hessian(lambda p_: reference(p_)["prod"].sum())(q),
        atol=1e-6, rtol=1e-6,
    )


def test_cache_and_float_constant_change_without_new_preparation(x):
    def h(z, buf, c):
        buf.copy_(z * c)  # scratch written by f
        return (buf**2).sum()

    g = td.DifferentiateWith(h, td.AutoAutograd())
    for c in (1.0, 2.0, 3.0):
        xr = x.clone().requires_grad_()
        g(xr, td.Cache(torch.empty(4, dtype=torch.float64)), td.Constant(c)).backward()
        torch.testing.assert_close(xr.grad, 2 * c * c * x)
    assert g.num_preparations == 1


def test_pullback_called_once_per_backward(x):
    """AutoAutograd's pullback evaluates f once: a training step costs the value plus one pullback."""
    calls = []

    def counted(z):
        calls.append(z.shape)
        return torch.tanh(z)

    g = td.DifferentiateWith(counted, td.AutoAutograd())
    xr = x.clone().requires_grad_()
    g(xr).sum().backward()  # first step: value, preparation's evaluation, pullback
    assert len(calls) == 3
    for _ in range(3):
        calls.clear()
        xr = torch.randn(4, dtype=torch.float64, requires_grad=True)
        y = g(xr)
        assert len(calls) == 1  # the forward pass only evaluates f
        (y * 2).sum().backward()
        assert len(calls) == 2  # exactly one pullback per backward
    assert g.num_preparations == 1


def test_jacobian_is_one_batched_pullback(x):
    """jacrev's vmap over the pullback reaches the backend as one call with all cotangents."""
    calls = []

    def counted(z):
        calls.append(z.shape)
        return torch.tanh(z) * z.sum()

    g = td.DifferentiateWith(counted, td.AutoFunc())
    torch.func.jacrev(g)(x)  # warm-up: prepares the pullback for 4 cotangents
    calls.clear()
    jac = torch.func.jacrev(g)(x)
    assert len(calls) == 2  # the value, then one vjp for the 4 cotangents
    torch.testing.assert_close(jac, torch.autograd.functional.jacobian(lambda z: torch.tanh(z) * z.sum(), x))


def test_prepared_once_per_signature_and_cache_holds_no_user_data():
    g = td.DifferentiateWith(f, td.AutoFunc())
    for _ in range(3):
        xr = torch.randn(4, requires_grad=True)
        g(xr, td.Constant(1.5)).sum().backward()
    assert g.num_preparations == 1
    xr = torch.randn(5, requires_grad=True)  # a new shape: a second preparation
    g(xr, td.Constant(1.5)).sum().backward()
    assert g.num_preparations == 2
    for n in range(6, 6 + td.differentiate_with.CACHE_SIZE):  # the cache is bounded
        g(torch.randn(n, requires_grad=True), td.Constant(1.5)).sum().backward()
    assert len(g._preps["pullback"]) == td.differentiate_with.CACHE_SIZE
    xr = torch.randn(4, requires_grad=True)
    context = torch.ones(4)
    refs = [weakref.ref(xr), weakref.ref(context)]
    g(xr, td.Constant(context)).sum().backward()
    del xr, context
    gc.collect()
    assert all(r() is None for r in refs), "DifferentiateWith kept a reference to user data"


def test_inputs_untouched_and_writes_refused(x):
    c = torch.randn(4, dtype=torch.float64)
    before = (x.clone(), c.clone())
    xr = x.clone().requires_grad_()
    td.DifferentiateWith(lambda z, k: (z * k).sum(), td.AutoFiniteDiff())(xr, td.Constant(c)).backward()
    assert torch.equal(xr.detach(), before[0]) and torch.equal(c, before[1])

    def writes(z, k):
        k.add_(1.0)
        return z * k

    with pytest.raises(ValueError, match=r"context 1 \(Constant\)"):
        td.DifferentiateWith(writes, td.AutoAutograd())(x, td.Constant(c.clone()))


# A black box: numpy code torch cannot trace, differentiated by finite differences.
def numpy_softclip(z: torch.Tensor) -> torch.Tensor:
    values = z.detach().cpu().numpy()
    out = np.empty_like(values)
    for i, v in np.ndenumerate(values):  # a loop no AD system sees through
        out[i] = np.log1p(np.exp(v)) - np.log1p(np.exp(v - 3.0))
    return torch.from_numpy(out).to(z.dtype)


def torch_softclip(z: torch.Tensor) -> torch.Tensor:
    return nn.functional.softplus(z) - nn.functional.softplus(z - 3.0)


class BlackBoxNet(nn.Module):
    def __init__(self, activation):
        super().__init__()
        self.inner = nn.Linear(3, 5, dtype=torch.float64)
        self.outer = nn.Linear(5, 1, dtype=torch.float64)
        self.activation = activation

    def forward(self, z):
        return self.outer(self.activation(self.inner(z)))


def _train(model, steps=5):
    torch.manual_seed(1)
    inputs, targets = torch.randn(16, 3, dtype=torch.float64), torch.randn(16, 1, dtype=torch.float64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("black_box", ["numpy", "scipy"])
def test_black_box_module_trains_like_autograd(black_box):
    if black_box == "scipy":
        special = pytest.importorskip("scipy.special", reason="scipy is not installed (pip install torchdi[test])")
        box = td.DifferentiateWith(
            lambda z: torch.from_numpy(special.log_expit(z.detach().numpy())), td.AutoFiniteDiff()
        )
        reference = nn.functional.logsigmoid
    else:
        box = td.DifferentiateWith(numpy_softclip, td.AutoFiniteDiff())
        reference = torch_softclip
    torch.manual_seed(0)
    model = BlackBoxNet(box)
    torch.manual_seed(0)
    expected = BlackBoxNet(reference)
    losses, expected_losses = _train(model), _train(expected)
    assert losses[-1] < losses[0]
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-7)
    for p, q in zip(model.parameters(), expected.parameters()):
        torch.testing.assert_close(p, q, **TOL)
    assert box.num_preparations == 1  # one signature, prepared once for the whole loop


def test_compiled_piece_in_eager_model_matches_eager():
    def piece(h, scale):
        return torch.tanh(h) * scale + h.pow(2).mean(-1, keepdim=True)

    compiled = td.DifferentiateWith(piece, td.AutoCompile(compiler="aot_eager"))
    torch.manual_seed(0)
    model = BlackBoxNet(lambda h: compiled(h, td.Constant(0.5)))
    torch.manual_seed(0)
    expected = BlackBoxNet(lambda h: piece(h, 0.5))
    np.testing.assert_allclose(_train(model), _train(expected), rtol=1e-12)
    for p, q in zip(model.parameters(), expected.parameters()):
        torch.testing.assert_close(p, q)
    assert compiled.num_compilations == 1  # compiled at the first backward, never again
    # Cotangents of other layouts (expanded by sum(), transposed) do not recompile either.
    h = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    compiled(h, td.Constant(2.0)).sum().backward()
    (compiled(h, td.Constant(2.0)).T * torch.randn(5, 4, dtype=torch.float64)).sum().backward()
    assert compiled.num_compilations == 2  # one new signature (h's shape), compiled once


def test_nested_in_torchdi(x):
    inner = td.DifferentiateWith(lambda z: torch.exp(z).sum(), td.AutoFiniteDiff())

    def outer(z):
        return inner(z * 2.0) ** 2

    def outer_ref(z):
        return torch.exp(z * 2.0).sum() ** 2

    expected = td.gradient(outer_ref, td.AutoAutograd(), x)
    torch.testing.assert_close(td.gradient(outer, td.AutoAutograd(), x), expected, **TOL)
    torch.testing.assert_close(td.gradient(outer, td.AutoFunc(), x), expected, **TOL)
    torch.testing.assert_close(td.jacobian(lambda z: z * inner(z), td.AutoFunc(), x),
                               td.jacobian(lambda z: z * torch.exp(z).sum(), td.AutoAutograd(), x), **TOL)


@pytest.mark.parametrize("outer", [td.AutoAutograd(), td.AutoFunc()], ids=["autograd", "func"])
@pytest.mark.parametrize(
    "backend",
    [td.AutoFunc(), td.SecondOrder(td.AutoAutograd(), td.AutoFunc()), td.AutoFiniteDiff()],
    ids=["func", "second-order", "finitediff"],
)
def test_second_order_through_the_backend(outer, backend, x):
    g = td.DifferentiateWith(lambda z: torch.sin(z) * z.sum(), backend)

    def loss(z):
        return (g(z) ** 2).sum()

    def loss_ref(z):
        return ((torch.sin(z) * z.sum()) ** 2).sum()

    v = torch.randn(4, dtype=torch.float64)
    tol = {"atol": 1e-5, "rtol": 1e-5}
    expected = td.hvp(loss_ref, td.AutoAutograd(), x, (v,))[0]
    torch.testing.assert_close(td.hvp(loss, outer, x, (v,))[0], expected, **tol)
    torch.testing.assert_close(torch.func.hessian(loss)(x), torch.func.hessian(loss_ref)(x), **tol)
    xr = x.clone().requires_grad_()
    (grad,) = torch.autograd.grad(loss(xr), xr, create_graph=True)
    (hv,) = torch.autograd.grad(grad, xr, v)
    torch.testing.assert_close(hv, expected, **tol)


def test_errors(x):
    with pytest.raises(TypeError, match="f must be callable"):
        td.DifferentiateWith(3, td.AutoFunc())
    with pytest.raises(TypeError, match="backend must be a torchdi backend"):
        td.DifferentiateWith(torch.sin, "autograd")
    g = td.DifferentiateWith(f, td.AutoFunc())
    with pytest.raises(TypeError, match=r"context 1 \(argument 2\) must be wrapped"):  # counted from 1 (issue 10 item 13)
        g(x, 2.0)
    with pytest.raises(TypeError, match="x must be a real floating-point tensor"):
        g(torch.ones(3, dtype=torch.int64), td.Constant(1.0))
    with pytest.raises(TypeError, match="complex x is not supported"):
        g(torch.ones(3, dtype=torch.complex64), td.Constant(1.0))
    with pytest.raises(TypeError, match="f must return a real floating-point tensor"):
        td.DifferentiateWith(lambda z: z.argmax(), td.AutoFunc())(x)
    weights = torch.ones(4, dtype=torch.float64, requires_grad=True)
    y = td.DifferentiateWith(lambda z, w: z * w, td.AutoFunc())(x.clone().requires_grad_(), td.Constant(weights))
    with pytest.raises(ValueError, match=r"context 1 \(Constant\), but only x is differentiated"):
        y.sum().backward()
    with pytest.raises(ValueError, match="only x is differentiated"):
        torch.func.grad(lambda w: td.DifferentiateWith(lambda z, w_: z * w_, td.AutoFunc())(x, td.Constant(w)).sum())(x)


def test_unsupported_combinations(x):
    # torch.func cannot differentiate torch.autograd.grad: the backend's HVP is refused.
    bad = td.DifferentiateWith(lambda z: z**3, td.SecondOrder(td.AutoFunc(), td.AutoAutograd()))
    with pytest.raises(td.UnsupportedOperatorError, match="Backends that can"):
        torch.func.hessian(lambda z: bad(z).sum())(x)
    g = td.DifferentiateWith(torch.sin, td.AutoFunc())
    with pytest.raises(td.UnsupportedOperatorError, match="forward-over-forward"):
        torch.func.jacfwd(torch.func.jacfwd(g))(x)
    with pytest.raises(td.UnsupportedOperatorError, match="third-order"):
        torch.func.jacrev(torch.func.hessian(lambda z: g(z).sum()))(x)


def test_eager_forward_ad_and_compiled_outer(x):
    import torch.autograd.forward_ad as fwAD

    g = td.DifferentiateWith(torch.sin, td.AutoFiniteDiff())
    v = torch.randn(4, dtype=torch.float64)
    with fwAD.dual_level():
        tangent = fwAD.unpack_dual(g(fwAD.make_dual(x, v))).tangent
    torch.testing.assert_close(tangent, torch.cos(x) * v, **TOL)
    compiled = torch.compile(lambda z: g(z * 2.0).sum(), backend="aot_eager")
    xr = x.clone().requires_grad_()
    compiled(xr).backward()
    torch.testing.assert_close(xr.grad, 2.0 * torch.cos(2.0 * x), **TOL)


def test_warns_about_trainable_tensors_f_holds():
    layer = nn.Linear(3, 3)
    with pytest.warns(UserWarning, match="parameter 'weight'"):
        td.DifferentiateWith(layer, td.AutoFunc())
    with pytest.warns(UserWarning, match="closure variable 'layer'"):
        td.DifferentiateWith(lambda h: layer(h), td.AutoFunc())
    layer.requires_grad_(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        td.DifferentiateWith(lambda h: layer(h), td.AutoFunc())


@pytest.mark.slow
def test_nested_in_a_compiled_torchdi_backend(x):
    inner = td.DifferentiateWith(lambda z: torch.exp(z).sum(), td.AutoFiniteDiff())

    def outer(z):
        return inner(z * 2.0) ** 2

    expected = td.gradient(lambda z: torch.exp(z * 2.0).sum() ** 2, td.AutoAutograd(), x)
    broken = td.AutoCompile(compiler="aot_eager", fullgraph=False)  # g is a graph break
    torch.testing.assert_close(td.gradient(outer, broken, x), expected, **TOL)
    with pytest.raises(RuntimeError, match="custom jvp"):
        td.gradient(outer, td.AutoCompile(compiler="aot_eager"), x)
