"""DESIGN rule 10: operators compose with torch.func transforms, torch.autograd and torch.compile.

Every eager backend (and SecondOrder pairs of them) under vmap, grad, jacrev, jacfwd, jvp, vjp,
hessian and torch.autograd, compared with torch.func / torch.autograd references; nested
torchdi operators (a PINN, a gradient penalty, MAML) on every pairing; compiled backends either
give the outer derivative or refuse at once (never a zero); torch.compile around operators
without graph breaks; preparation with the caller's grad mode.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, jvp, vjp, vmap
from torch.utils import _pytree as pytree

import torchdi as td
from torchdi import (
    AutoAutograd,
    AutoCompile,
    AutoFiniteDiff,
    AutoFunc,
    AutoSparse,
    AutoXLA,
    SecondOrder,
)
from torchdi.operators import _transparent

DT = torch.float64
EAGER: dict[str, Any] = {
    "autograd": AutoAutograd(),
    "func": AutoFunc(),
    "fd": AutoFiniteDiff(),
    "so_func_func": SecondOrder(AutoFunc(), AutoFunc()),
    "so_autograd_func": SecondOrder(AutoAutograd(), AutoFunc()),
    "so_autograd_autograd": SecondOrder(AutoAutograd(), AutoAutograd()),
    "so_fd_func": SecondOrder(AutoFiniteDiff(), AutoFunc()),
}
EAGER_IDS, EAGER_VALUES = list(EAGER), list(EAGER.values())
AOT = AutoCompile(compiler="aot_eager")
ROOT = Path(__file__).resolve().parents[1]


def tol(backend: Any) -> dict[str, float]:
    """Finite differences are approximate; AD backends agree to rounding."""
    fd = "FiniteDiff" in repr(backend)
    return {"rtol": 1e-5, "atol": 1e-5} if fd else {"rtol": 1e-9, "atol": 1e-10}


def close(got: Any, want: Any, backend: Any) -> None:
    for g, w in zip(pytree.tree_leaves(got), pytree.tree_leaves(want), strict=True):
        torch.testing.assert_close(g, w, **tol(backend))


def f_scalar(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return (c * torch.sin(x) ** 2).sum() + (x[0] * x[-1]) ** 2


def f_vec(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return torch.stack([(c * x).sin().sum(), (x**2 * c).sum(), x.prod()])


def f_of_t(t: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return torch.sin(t * c) * t**2


def _x(seed: int = 0) -> torch.Tensor:
    return torch.randn(3, dtype=DT, generator=torch.Generator().manual_seed(seed))


C = torch.tensor([0.7, -1.3, 2.0], dtype=DT)
V = torch.tensor([1.0, 0.5, -2.0], dtype=DT)

# family -> (call(backend, x, c) -> the derivative, reference(x, c) by torch.func)
FAMILIES: dict[str, tuple[Any, Any]] = {
    "gradient": (lambda b, x, c: td.gradient(f_scalar, b, x, td.Constant(c)), lambda x, c: grad(f_scalar)(x, c)),
    "jacobian": (lambda b, x, c: td.jacobian(f_vec, b, x, td.Constant(c)), lambda x, c: jacrev(f_vec)(x, c)),
    "hessian": (lambda b, x, c: td.hessian(f_scalar, b, x, td.Constant(c)), lambda x, c: hessian(f_scalar)(x, c)),
    "hvp": (
        lambda b, x, c: td.hvp(f_scalar, b, x, (V,), td.Constant(c))[0],
        lambda x, c: jvp(lambda x_: grad(f_scalar)(x_, c), (x,), (V,))[1],
    ),
    "pushforward": (
        lambda b, x, c: td.pushforward(f_vec, b, x, (V,), td.Constant(c))[0],
        lambda x, c: jvp(lambda x_: f_vec(x_, c), (x,), (V,))[1],
    ),
    "pullback": (
        lambda b, x, c: td.pullback(f_vec, b, x, (V,), td.Constant(c))[0],
        lambda x, c: vjp(lambda x_: f_vec(x_, c), x)[1](V)[0],
    ),
    "derivative": (
        lambda b, x, c: td.derivative(f_of_t, b, x[0], td.Constant(c)),
        lambda x, c: jvp(lambda t: f_of_t(t, c), (x[0],), (torch.ones((), dtype=DT),))[1],
    ),
    "second_derivative": (
        lambda b, x, c: td.second_derivative(f_of_t, b, x[0], td.Constant(c)),
        lambda x, c: jvp(lambda t: jvp(lambda s: f_of_t(s, c), (t,), (torch.ones((), dtype=DT),))[1], (x[0],), (torch.ones((), dtype=DT),))[1],
    ),
}
FAMILY_IDS = list(FAMILIES)
SECOND_ORDER = {"hessian", "hvp", "second_derivative"}


def skip_fd_third_order(backend: Any, family: str) -> None:
    """Finite differences of finite differences of second derivatives lose every digit."""
    if "FiniteDiff" in repr(backend) and family in SECOND_ORDER:
        pytest.skip("an outer derivative of a finite-difference second derivative is a third difference")


# --------------------------------------------------------------------------- vmap


@pytest.mark.parametrize("family", FAMILY_IDS)
@pytest.mark.parametrize("backend", EAGER_VALUES, ids=EAGER_IDS)
def test_vmap_over_every_operator(backend, family):
    call, reference = FAMILIES[family]
    xs = torch.stack([_x(i) for i in range(4)])
    cs = torch.stack([C * (1 + i) for i in range(4)])
    got = vmap(lambda x, c: call(backend, x, c))(xs, cs)
    want = torch.stack([reference(x, c) for x, c in zip(xs, cs)])
    close(got, want, backend)


@pytest.mark.parametrize("backend", EAGER_VALUES, ids=EAGER_IDS)
def test_vmap_over_a_prepared_operator(backend):
    xs = torch.stack([_x(i) for i in range(5)])
    prep = td.prepare_hessian(f_scalar, backend, xs[0], td.Constant(C))
    got = vmap(lambda x: td.hessian(f_scalar, backend, x, td.Constant(C), prep=prep))(xs)
    close(got, vmap(hessian(f_scalar), in_dims=(0, None))(xs, C), backend)
    # a wrong shape under vmap still gets the strict check's message
    with pytest.raises(td.PreparationMismatchError):
        vmap(lambda x: td.hessian(f_scalar, backend, x[:2], td.Constant(C), prep=prep))(xs)


@pytest.mark.parametrize("backend", EAGER_VALUES, ids=EAGER_IDS)
def test_vmap_still_refuses_writes_into_x(backend):
    def writes(x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return (x**2).sum()

    xs = torch.stack([_x(i) for i in range(3)])
    before = xs.clone()
    with pytest.raises(ValueError, match="wrote in place into x"):
        vmap(lambda x: td.gradient(writes, backend, x))(xs)
    assert torch.equal(xs, before)


def test_per_sample_gradients_of_a_cnn_match_torch_func():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 10)
    ).double()
    params = {k: v.detach() for k, v in model.named_parameters()}
    images, labels = torch.randn(8, 1, 8, 8, dtype=DT), torch.randint(0, 10, (8,))

    def loss(p: dict[str, torch.Tensor], image: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, p, (image.unsqueeze(0),))
        return torch.nn.functional.cross_entropy(logits, label.unsqueeze(0))

    want = vmap(grad(loss), in_dims=(None, 0, 0))(params, images, labels)
    for backend in (AutoFunc(), AutoAutograd()):
        prep = td.prepare_gradient(loss, backend, params, td.Constant(images[0]), td.Constant(labels[0]))
        got = vmap(
            lambda image, label: td.gradient(loss, backend, params, td.Constant(image), td.Constant(label), prep=prep)  # noqa: B023
        )(images, labels)
        for k in want:
            torch.testing.assert_close(got[k], want[k])


# --------------------------------------------------------------------------- torch.func transforms


@pytest.mark.parametrize("family", FAMILY_IDS)
@pytest.mark.parametrize("backend", EAGER_VALUES, ids=EAGER_IDS)
def test_outer_jacrev_and_jacfwd_see_x_and_the_context(backend, family):
    """Mixed partials: the outer jacobian of the operator's result w.r.t. x and w.r.t. a Constant."""
    skip_fd_third_order(backend, family)
    call, reference = FAMILIES[family]
    x = _x()
    for outer in (jacrev, jacfwd):
        got_x = outer(lambda x_: call(backend, x_, C))(x)
        got_c = outer(lambda c_: call(backend, x, c_))(C)
        close(got_x, jacfwd(lambda x_: reference(x_, C))(x), backend)
        close(got_c, jacfwd(lambda c_: reference(x, c_))(C), backend)


@pytest.mark.parametrize("backend", EAGER_VALUES, ids=EAGER_IDS)
def test_outer_grad_vjp_jvp_hessian(backend):
    x = _x()
    s = lambda x_: td.gradient(f_scalar, backend, x_, td.Constant(C)).pow(2).sum()  # noqa: E731
    ref = lambda x_: grad(f_scalar)(x_, C).pow(2).sum()  # noqa: E731
    close(grad(s)(x), grad(ref)(x), backend)
    close(vjp(s, x)[1](torch.tensor(1.0, dtype=DT)), vjp(ref, x)[1](torch.tensor(1.0, dtype=DT)), backend)
    close(jvp(s, (x,), (V,)), jvp(ref, (x,), (V,)), backend)
    y = lambda x_: td.value_and_gradient(f_scalar, backend, x_, td.Constant(C))[0]  # noqa: E731
    if "FiniteDiff" not in repr(backend):
        close(hessian(y)(x), hessian(f_scalar)(x, C), backend)


@pytest.mark.parametrize("backend", EAGER_VALUES, ids=EAGER_IDS)
def test_outer_grad_through_a_tensor_f_closes_over(backend):
    x = _x()

    def outer(c: torch.Tensor) -> torch.Tensor:
        return td.gradient(lambda x_: f_scalar(x_, c), backend, x).sum()

    close(grad(outer)(C), grad(lambda c: grad(f_scalar)(x, c).sum())(C), backend)


# --------------------------------------------------------------------------- torch.autograd


@pytest.mark.parametrize("family", FAMILY_IDS)
@pytest.mark.parametrize("backend", EAGER_VALUES, ids=EAGER_IDS)
def test_torch_autograd_through_x_and_a_context(backend, family):
    skip_fd_third_order(backend, family)
    call, reference = FAMILIES[family]
    x, c = _x().requires_grad_(), C.clone().requires_grad_()
    got = torch.autograd.grad(call(backend, x, c).sum(), (x, c))
    x_ref, c_ref = x.detach().requires_grad_(), c.detach().requires_grad_()
    want = torch.autograd.grad(reference(x_ref, c_ref).sum(), (x_ref, c_ref))
    close(got, want, backend)


TANGENT_CALLS: dict[str, tuple[Any, Any]] = {
    "pushforward": (
        lambda b, t: td.pushforward(f_vec, b, _x(), (t,), td.Constant(C))[0],
        lambda t: jvp(lambda x_: f_vec(x_, C), (_x(),), (t,))[1],
    ),
    "pullback": (
        lambda b, t: td.pullback(f_vec, b, _x(), (t,), td.Constant(C))[0],
        lambda t: vjp(lambda x_: f_vec(x_, C), _x())[1](t)[0],
    ),
    "hvp": (
        lambda b, t: td.hvp(f_scalar, b, _x(), (t,), td.Constant(C))[0],
        lambda t: jvp(lambda x_: grad(f_scalar)(x_, C), (_x(),), (t,))[1],
    ),
}


@pytest.mark.parametrize("family", list(TANGENT_CALLS))
@pytest.mark.parametrize("backend", EAGER_VALUES, ids=EAGER_IDS)
def test_torch_autograd_through_the_tangents(backend, family):
    """Only the tangent requires grad: the result is linear in it, and torch.autograd sees that."""
    call, reference = TANGENT_CALLS[family]
    t = V.clone().requires_grad_()
    (got,) = torch.autograd.grad(call(backend, t).pow(2).sum(), t)
    t_ref = V.clone().requires_grad_()
    (want,) = torch.autograd.grad(reference(t_ref).pow(2).sum(), t_ref)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", EAGER_VALUES, ids=EAGER_IDS)
def test_torch_autograd_through_a_parameter_f_closes_over(backend):
    """Only the closure requires grad: seen at preparation, the result is still differentiable."""
    c = torch.nn.Parameter(C.clone())
    x = _x()

    def f(x_: torch.Tensor) -> torch.Tensor:
        return f_scalar(x_, c)

    prep = td.prepare_gradient(f, backend, x)
    g = td.gradient(f, backend, x, prep=prep)
    (got,) = torch.autograd.grad(g.sum(), c)
    c_ref = C.clone().requires_grad_()
    x_ref = x.clone().requires_grad_()
    (g_ref,) = torch.autograd.grad(f_scalar(x_ref, c_ref), x_ref, create_graph=True)
    (want,) = torch.autograd.grad(g_ref.sum(), c_ref)
    close(got, want, backend)


@pytest.mark.parametrize("backend", EAGER_VALUES, ids=EAGER_IDS)
def test_out_and_no_grad_keep_the_plain_fast_path(backend):
    """A training loop's call (out=, or no grad mode) returns plain tensors even when x requires grad."""
    x = _x().requires_grad_()
    g_out = td.gradient(f_scalar, backend, x, td.Constant(C), out=torch.empty(3, dtype=DT))
    with torch.no_grad():
        g_plain = td.gradient(f_scalar, backend, x, td.Constant(C))
    for g in (g_out, g_plain):
        assert g.grad_fn is None and not g.requires_grad
        close(g, grad(f_scalar)(x.detach(), C), backend)


# --------------------------------------------------------------------------- nested torchdi: PINN, penalty, MAML

PINN_OUTER: dict[str, Any] = {"autograd": AutoAutograd(), "func": AutoFunc(), "compile_aot_eager": AOT}
PINN_INNER: dict[str, Any] = {k: v for k, v in EAGER.items() if k in ("autograd", "func", "fd", "so_func_func", "so_autograd_func")}


def _pinn() -> tuple[torch.nn.Module, dict[str, torch.Tensor], torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    return model, params, torch.randn(16, 2, dtype=DT)


@pytest.mark.parametrize("inner", list(PINN_INNER.values()), ids=list(PINN_INNER))
@pytest.mark.parametrize("outer", list(PINN_OUTER.values()), ids=list(PINN_OUTER))
def test_pinn_parameter_gradient_of_an_input_laplacian(outer, inner):
    if outer is AOT and "FiniteDiff" in repr(inner):
        # It composes, but dynamo unrolls finite differences' per-coordinate loop (an HVP of
        # finite differences over 32 coordinates): minutes of tracing for one test.
        pytest.skip("finite differences traced by dynamo: too slow for the suite")
    model, params, points = _pinn()
    basis = torch.eye(2, dtype=DT)

    def u(x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
        return functional_call(model, p, (x,)).sum()  # points are independent: sum, then per-point HVPs

    def loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
        hv = td.hvp(u, inner, points, tuple(basis[i].expand_as(points) for i in range(2)), td.Constant(p))
        return ((hv[0][:, 0] + hv[1][:, 1]) ** 2).mean()

    def loss_ref(p: dict[str, torch.Tensor]) -> torch.Tensor:
        lap = vmap(lambda x: torch.trace(hessian(lambda x_: functional_call(model, p, (x_,)).squeeze())(x)))(points)
        return (lap**2).mean()

    want = grad(loss_ref)(params)
    prep = td.prepare_gradient(loss, outer, params)
    got = td.gradient(loss, outer, params, prep=prep)
    assert sum(float(v.abs().sum()) for v in got.values()) > 0
    close(got, want, inner)
    if outer is AOT:  # the inner eager operator is traced into the outer program
        assert prep.num_compilations == 1  # one program serves gradient and value_and_gradient


# --------------------------------------------------------------------------- one-shot calls under a transform

LEARNING = {"func": AutoFunc(), "autograd": AutoAutograd(), "so_autograd_func": SecondOrder(AutoAutograd(), AutoFunc())}


@pytest.mark.parametrize("backend", list(LEARNING.values()), ids=list(LEARNING))
def test_one_shot_call_under_a_transform_evaluates_f_once_less_after_the_first(backend):
    """The PINN pattern: an operator without prep inside the step's grad. Preparation's extra
    evaluation of f happens at the first step only; the result stays torch.func's."""
    evaluations = [0]

    def counted(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        evaluations[0] += 1
        return f_scalar(x, c)

    x = _x()

    def loss(c: torch.Tensor) -> torch.Tensor:
        return td.hvp(counted, backend, x, (V,), td.Constant(c))[0].sum()

    def reference(c: torch.Tensor) -> torch.Tensor:
        return jvp(lambda x_: grad(f_scalar)(x_, c), (x,), (V,))[1].sum()

    counts = []
    for _ in range(3):
        evaluations[0] = 0
        close(grad(loss)(C), grad(reference)(C), backend)
        counts.append(evaluations[0])
    assert counts[1] == counts[0] - 1 and counts[2] == counts[1], counts
    cs = torch.stack([C, 2 * C])
    for _ in range(2):  # under vmap too (other logical shapes: learned anew)
        close(vmap(grad(loss))(cs), vmap(grad(reference))(cs), backend)


def test_one_shot_call_whose_output_changed_is_prepared_again():
    """What the first call learned about f's output is checked at every evaluation: a changed
    output layout gets the result (or the error) of a fresh preparation, never a stale layout."""
    n = [3]

    def f(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return (c * x.sin())[: n[0]]

    def jac(c: torch.Tensor) -> torch.Tensor:
        return td.jacobian(f, AutoFunc(), _x(), td.Constant(c))

    for size in (3, 3, 2, 2):
        n[0] = size
        close(jacrev(jac)(C), jacrev(lambda c: jacrev(f)(_x(), c))(C), AutoFunc())

    def scalar_then_vector(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        y = (c * x.sin()).sum()
        return y if n[0] else y.expand(2)

    def hv(c: torch.Tensor) -> torch.Tensor:
        return td.hvp(scalar_then_vector, AutoFunc(), _x(), (V,), td.Constant(c))[0].sum()

    n[0] = 1
    grad(hv)(C)
    grad(hv)(C)
    n[0] = 0  # the message of a fresh preparation, not torch.func's
    with pytest.raises(ValueError, match="f must return a scalar"):
        grad(hv)(C)


@pytest.mark.parametrize("into", ["x", "context 1 (Constant)"])
def test_one_shot_call_under_a_transform_still_refuses_writes(into):
    """After the first call, f starts writing into its inputs: refused as at preparation (vmap
    lets writes into batched tensors happen; grad refuses writes into captured tensors itself)."""
    writes = [False]

    def f(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        if writes[0]:
            (x if into == "x" else c).mul_(2)
        return (c * x.sin()).sum()

    xs, cs = torch.stack([_x(i) for i in range(3)]), torch.stack([C * (1 + i) for i in range(3)])
    before = xs.clone(), cs.clone()

    def batched() -> torch.Tensor:
        return vmap(lambda x, c: td.gradient(f, AutoFunc(), x, td.Constant(c)))(xs, cs)

    want = batched()
    close(batched(), want, AutoFunc())
    writes[0] = True
    with pytest.raises(ValueError, match=f"wrote in place into {into}".replace("(", r"\(").replace(")", r"\)")):
        batched()
    assert torch.equal(xs, before[0]) and torch.equal(cs, before[1])


def test_one_shot_call_under_a_transform_draws_what_a_fresh_one_draws():
    def noisy(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return (c * x.sin() * torch.rand(3, dtype=DT)).sum()

    def loss(c: torch.Tensor) -> torch.Tensor:
        return td.gradient(noisy, AutoFunc(), _x(), td.Constant(c)).sum()

    results = []
    for _ in range(3):  # a fresh preparation, then learned calls
        torch.manual_seed(7)
        results.append((grad(loss)(C), torch.rand(())))
    for got in results[1:]:
        torch.testing.assert_close(got, results[0], rtol=0, atol=0)


def test_autofunc_adds_no_view_for_a_0d_output():
    """A reshape of a 0-d output would add a view to the graph of every transform level."""
    from torchdi.engines import func

    y = torch.ones((), dtype=DT)
    assert func.scalar_output(y) is y and func.in_output_shape(y, torch.Size([])) is y
    assert func.scalar_output(torch.ones(1, 1)).shape == () and func.in_output_shape(y, (1,)).shape == (1,)


def test_what_one_shot_calls_learned_dies_with_f():
    import gc
    import weakref

    from torchdi.operators import _one_shot

    def learn() -> Any:
        def f(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
            return (c * x.sin()).sum()

        grad(lambda c: td.gradient(f, AutoFunc(), _x(), td.Constant(c)).sum())(C)
        assert f in _one_shot._LEARNED
        return weakref.ref(f)

    alive = learn()
    gc.collect()
    assert alive() is None


@pytest.mark.parametrize("backend", EAGER_VALUES, ids=EAGER_IDS)
def test_gradient_penalty_trains_the_critic(backend):
    torch.manual_seed(1)
    critic = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
    samples = torch.randn(5, 3, dtype=DT)

    def penalty(use_torchdi: bool) -> list[torch.Tensor]:
        critic.zero_grad()
        x = samples.clone().requires_grad_()
        if use_torchdi:
            g = td.gradient(lambda x_: critic(x_).sum(), backend, x)
        else:
            (g,) = torch.autograd.grad(critic(x).sum(), x, create_graph=True)
        ((g.norm(dim=1) - 1) ** 2).mean().backward()
        # (the last bias does not reach the input gradient: no .grad, as with torch.autograd)
        return [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in critic.parameters()]

    want = penalty(False)
    got = penalty(True)
    assert sum(float(g.abs().sum()) for g in got) > 0
    close(got, want, backend)


@pytest.mark.parametrize("backend", EAGER_VALUES, ids=EAGER_IDS)
def test_maml_outer_gradient_flows_through_the_inner_step(backend):
    torch.manual_seed(2)
    w = torch.randn(3, dtype=DT, requires_grad=True)
    support, query = torch.randn(6, 3, dtype=DT), torch.randn(6, 3, dtype=DT)

    def task_loss(w_: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
        return ((data @ w_).tanh() - 0.5).pow(2).mean()

    def meta_grad(use_torchdi: bool) -> torch.Tensor:
        if use_torchdi:
            g = td.gradient(task_loss, backend, w, td.Constant(support))
        else:
            (g,) = torch.autograd.grad(task_loss(w, support), w, create_graph=True)
        adapted = w - 0.1 * g
        (out,) = torch.autograd.grad(task_loss(adapted, query), w)
        return out

    want, got = meta_grad(False), meta_grad(True)
    close(got, want, backend)
    # the second-order term is there: first-order MAML differs
    first_order = torch.autograd.grad(task_loss(w - 0.1 * grad(task_loss)(w.detach(), support), query), w)[0]
    assert not torch.allclose(want, first_order)


def test_autofunc_gradient_under_torch_autograd_runs_on_autograds_own_graph():
    """Under torch.autograd alone AutoFunc's gradient is computed by torch.autograd.grad(create_graph=True)
    (the outer backward then walks one plain graph, not torch.func's wrappers); under a torch.func
    transform it stays torch.func's; with has_aux it keeps its own runner. Same derivatives each way."""
    x = _x().requires_grad_()
    prep = td.prepare_gradient(f_scalar, AutoFunc(), x.detach(), td.Constant(C))
    g = td.gradient(f_scalar, AutoFunc(), x, td.Constant(C), prep=prep)
    (got,) = torch.autograd.grad(g.pow(2).sum(), x)
    close(got, grad(lambda x_: grad(f_scalar)(x_, C).pow(2).sum())(x.detach()), AutoFunc())
    assert set(prep.transparent_runners) == {(_transparent.AUTOGRAD, True)}
    vmap(lambda x_: td.gradient(f_scalar, AutoFunc(), x_, td.Constant(C), prep=prep))(torch.stack([_x(1), _x(2)]))
    assert (_transparent.AS_IS, True) in prep.transparent_runners

    def with_aux(x_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return f_scalar(x_, C), x_.sum()

    prep_aux = td.prepare_gradient(with_aux, AutoFunc(), x.detach(), has_aux=True)
    g_aux, aux = td.gradient(with_aux, AutoFunc(), x, prep=prep_aux, has_aux=True)
    (got_aux,) = torch.autograd.grad(g_aux.pow(2).sum() + aux, x)
    want_aux = grad(lambda x_: grad(f_scalar)(x_, C).pow(2).sum() + x_.sum())(x.detach())
    close(got_aux, want_aux, AutoFunc())
    assert all(key[0] == _transparent.AS_IS for key in prep_aux.transparent_runners)


# --------------------------------------------------------------------------- compiled backends: through or refuse


REFUSING: dict[str, tuple[Any, str]] = {
    "compile": (AOT, "gradient"),
    "compile_autograd": (AutoCompile(inner=AutoAutograd(), compiler="aot_eager", fullgraph=False), "gradient"),
    "so_compile_func": (SecondOrder(AOT, AutoFunc()), "hvp"),
    "sparse_func_hessian": (AutoSparse(AutoFunc()), "hessian"),
    "sparse_func_jacobian": (AutoSparse(AutoFunc()), "jacobian"),
    "sparse_compile_gradient": (AutoSparse(AOT), "gradient"),
}


@pytest.mark.parametrize(("backend", "family"), list(REFUSING.values()), ids=list(REFUSING))
@pytest.mark.parametrize("outer", ["vmap", "grad", "autograd", "prepared_then_vmap", "torch_compile"])
def test_compiled_backends_refuse_at_once_never_a_zero(backend, family, outer):
    if outer == "autograd" and _transparent.eager_of_compiled(backend) is not None:
        pytest.skip("AutoCompile gives the outer derivative under torch.autograd: test_compiled_results_under_torch_autograd")
    call, _ = FAMILIES[family]
    x = _x()
    # Under torch.compile(fullgraph=True) dynamo reports the refusal as its own Unsupported error,
    # whose text carries torchdi's message.
    expected = torch._dynamo.exc.Unsupported if outer == "torch_compile" else td.UnsupportedOperatorError
    with pytest.raises(expected, match=r"Backends that compose: .*AutoFunc\(\)"):
        if outer == "vmap":
            vmap(lambda x_: call(backend, x_, C))(torch.stack([x, x]))
        elif outer == "grad":
            grad(lambda c_: call(backend, x, c_).sum())(C)
        elif outer == "autograd":
            # torch.autograd alone: the result may be read, and its backward raises
            c = C.clone().requires_grad_()
            sparse = isinstance(backend, AutoSparse) and family in ("jacobian", "hessian")
            result = call(backend, x, c)  # sparse results are refused at once
            assert not sparse
            close(result.detach(), FAMILIES[family][1](x, C), AutoFiniteDiff())
            result.sum().backward()
        elif outer == "prepared_then_vmap":
            prepare = {"gradient": td.prepare_gradient, "hessian": td.prepare_hessian, "jacobian": td.prepare_jacobian}
            if family not in prepare:
                pytest.skip("one prepared family is enough")
            f = f_vec if family == "jacobian" else f_scalar
            prep = prepare[family](f, backend, x, td.Constant(C))
            op = {"gradient": td.gradient, "hessian": td.hessian, "jacobian": td.jacobian}[family]
            vmap(lambda x_: op(f, backend, x_, td.Constant(C), prep=prep))(torch.stack([x, x]))
        else:
            torch._dynamo.reset()
            torch.compile(lambda x_: call(backend, x_, C), backend="aot_eager", fullgraph=True)(x)
    # without an outer transform it still works
    if outer == "autograd" and not (isinstance(backend, AutoSparse) and family in ("jacobian", "hessian")):
        close(call(backend, x, C), FAMILIES[family][1](x, C), AutoFiniteDiff())


THROUGH_EAGER: dict[str, tuple[Any, str]] = {
    "compile_gradient": (AOT, "gradient"),
    "compile_pullback": (AOT, "pullback"),
    "compile_jacobian": (AOT, "jacobian"),
    "compile_hvp": (AOT, "hvp"),
    "compile_autograd_gradient": (AutoCompile(inner=AutoAutograd(), compiler="aot_eager", fullgraph=False), "gradient"),
}


@pytest.mark.parametrize(("backend", "family"), list(THROUGH_EAGER.values()), ids=list(THROUGH_EAGER))
def test_compiled_results_under_torch_autograd(backend, family):
    """Under torch.autograd alone an AutoCompile result is the compiled one, and its backward
    differentiates the eager inner backend at the same point: through x, the tangents and a context."""
    call, reference = FAMILIES[family]
    x, c = _x().requires_grad_(), C.clone().requires_grad_()
    result = call(backend, x, c)
    close(result.detach(), reference(x.detach(), C), backend)
    got = torch.autograd.grad(result.pow(2).sum(), (x, c))
    x_ref, c_ref = x.detach().requires_grad_(), c.detach().requires_grad_()
    want = torch.autograd.grad(reference(x_ref, c_ref).pow(2).sum(), (x_ref, c_ref))
    close(got, want, backend)
    if family == "pullback":  # through the cotangent too
        ty = V.clone().requires_grad_()
        (got_ty,) = torch.autograd.grad(td.pullback(f_vec, backend, x.detach(), (ty,), td.Constant(C))[0].sum(), ty)
        close(got_ty, torch.autograd.grad(vjp(lambda x_: f_vec(x_, C), x.detach())[1](ty)[0].sum(), ty)[0], backend)


def test_compiled_gradient_penalty_maml_and_double_backward():
    """The patterns of rule 10 on AutoCompile under torch.autograd, prepared once: no recompilation."""
    torch.manual_seed(1)
    critic = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
    for p in critic.parameters():  # (a critic reading trainable parameters from its closure is refused: see below)
        p.requires_grad_(False)
    w = torch.randn(3, dtype=DT, requires_grad=True)
    samples = torch.randn(5, 3, dtype=DT)

    def critic_sum(x_: torch.Tensor, w_: torch.Tensor) -> torch.Tensor:
        return (critic(x_).squeeze(-1) * (x_ @ w_).tanh()).sum()

    prep = td.prepare_gradient(critic_sum, AOT, samples, td.Constant(w.detach()))
    for seed in (0, 1):  # gradient penalty: backward through the input gradient to the weights w
        x = (samples + seed).requires_grad_()
        g = td.gradient(critic_sum, AOT, x, td.Constant(w), prep=prep)
        (got,) = torch.autograd.grad(((g.norm(dim=1) - 1) ** 2).mean(), w)
        x_ref = x.detach().requires_grad_()
        (g_ref,) = torch.autograd.grad(critic_sum(x_ref, w), x_ref, create_graph=True)
        (want,) = torch.autograd.grad(((g_ref.norm(dim=1) - 1) ** 2).mean(), w)
        close(got, want, AOT)
    # MAML: the meta-gradient through an inner step taken with the compiled gradient
    prep_w = td.prepare_gradient(lambda w_, data: critic_sum(data, w_), AOT, w.detach(), td.Constant(samples))
    inner = lambda w_, data: critic_sum(data, w_)  # noqa: E731
    prep_w = td.prepare_gradient(inner, AOT, w.detach(), td.Constant(samples))
    adapted = w - 0.1 * td.gradient(inner, AOT, w, td.Constant(samples), prep=prep_w)
    (got,) = torch.autograd.grad(inner(adapted, samples + 1), w)
    adapted_ref = w - 0.1 * torch.autograd.grad(inner(w, samples), w, create_graph=True)[0]
    close(got, torch.autograd.grad(inner(adapted_ref, samples + 1), w)[0], AOT)
    # double backward: the third derivative through the recomputation
    g = td.gradient(inner, AOT, w, td.Constant(samples), prep=prep_w)
    (h,) = torch.autograd.grad(g.pow(2).sum(), w, create_graph=True)
    (t,) = torch.autograd.grad(h.sum(), w)
    w_ref = w.detach().requires_grad_()
    (h_ref,) = torch.autograd.grad(grad(inner)(w_ref, samples).pow(2).sum(), w_ref, create_graph=True)
    close(t, torch.autograd.grad(h_ref.sum(), w_ref)[0], AOT)
    assert prep.num_compilations == 1 and prep_w.num_compilations == 1


def test_compiled_result_that_cannot_be_recomputed_refuses_at_backward():
    """An f that draws random numbers (dropout) or updates a State cannot be recomputed in
    backward: backward raises, reading the result still works."""

    def noisy(x_: torch.Tensor) -> torch.Tensor:
        return (torch.nn.functional.dropout(x_, 0.5) ** 2).sum()

    x = _x().requires_grad_()
    g = td.gradient(noisy, AOT, x)
    assert g.shape == x.shape
    with pytest.raises(td.UnsupportedOperatorError, match="draws random numbers"):
        g.sum().backward()
    assert not td.prepare_gradient(f_scalar, AOT, _x(), td.Constant(C)).recompute_refusal

    def counting(x_: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
        counter.add_(1)
        return (x_ * counter).pow(2).sum()

    counter = torch.zeros((), dtype=DT)
    g = td.gradient(counting, AOT, x, td.State(counter))
    assert float(counter) == 1.0  # updated once, by the compiled call
    with pytest.raises(td.UnsupportedOperatorError, match="State"):
        g.sum().backward()
    assert float(counter) == 1.0


def test_compiled_backend_reading_a_tracked_closure_refuses_at_once():
    c = torch.nn.Parameter(C.clone())

    def f(x_: torch.Tensor) -> torch.Tensor:
        return f_scalar(x_, c)

    prep = td.prepare_gradient(f, AOT, _x())
    with pytest.raises(td.UnsupportedOperatorError, match="Backends that compose"):
        td.gradient(f, AOT, _x(), prep=prep)
    with torch.no_grad():
        close(td.gradient(f, AOT, _x(), prep=prep), grad(f_scalar)(_x(), C), AutoFiniteDiff())


def test_composes_classification():
    assert _transparent.composes(AutoXLA(), "gradient") is False
    assert _transparent.composes(AutoSparse(AutoXLA()), "gradient") is False
    assert _transparent.composes(SecondOrder(AutoFiniteDiff(), AutoXLA()), "hvp") is False
    assert _transparent.composes(AutoSparse(AutoAutograd()), "gradient") is True
    assert _transparent.composes(AutoSparse(AutoAutograd()), "jacobian") is False
    assert all(_transparent.composes(b, "hessian") for b in EAGER_VALUES)


def test_autograd_is_run_by_torch_func_under_transforms():
    assert _transparent.functorch_safe(SecondOrder(AutoAutograd(), AutoAutograd())) == SecondOrder(AutoFunc(), AutoFunc())
    assert _transparent.functorch_safe(AutoSparse(AutoAutograd())) == AutoSparse(AutoFunc())
    assert _transparent.functorch_safe(AutoFiniteDiff()) == AutoFiniteDiff()


# --------------------------------------------------------------------------- torch.compile around operators


@pytest.mark.parametrize("family", ["gradient", "hvp", "jacobian", "second_derivative"])
@pytest.mark.parametrize("backend", EAGER_VALUES, ids=EAGER_IDS)
def test_torch_compile_around_operators_has_no_graph_break(backend, family):
    call, reference = FAMILIES[family]
    x = _x()
    # fullgraph=True raises at the first graph break, so one compile both checks for breaks and
    # gives the value (a torch._dynamo.explain first traced everything twice: ~40% of this file).
    torch._dynamo.reset()
    got = torch.compile(lambda x_: call(backend, x_, C) * 2, backend="aot_eager", fullgraph=True)(x)
    close(got, 2 * reference(x, C), backend)


FIRST_CALL_COMPILED = """
import torch, torchdi as td
x = torch.linspace(0.5, 1.5, 5, dtype=torch.float64)
step = torch.compile(lambda x: td.gradient(lambda y: (y ** 3).sum(), td.AutoFunc(), x) * 2, backend="aot_eager", fullgraph=True)
assert torch.allclose(step(x), 6 * x ** 2)
print("ok")
"""


def test_torch_compile_around_the_first_operator_call_of_a_process_has_no_graph_break():
    # The tests above run after other torchdi calls in the same process; a user's first call may
    # be the traced one (torchdi's one-time set-up, such as the protocols' members that
    # runners.implements reads, must not happen inside the trace: it was a graph break).
    done = subprocess.run([sys.executable, "-c", FIRST_CALL_COMPILED], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_torch_compile_around_a_prepared_operator_has_no_graph_break():
    x = _x()
    prep = td.prepare_hvp(f_scalar, AutoFunc(), x, (V,), td.Constant(C))
    step = lambda x_: td.hvp(f_scalar, AutoFunc(), x_, (V,), td.Constant(C), prep=prep)[0]  # noqa: E731
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(step)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for seed in (1, 2):
        close(compiled(_x(seed)), FAMILIES["hvp"][1](_x(seed), C), AutoFunc())


# --------------------------------------------------------------------------- preparation with the caller's grad mode


def _input_gradient_norm(w: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    """A gradient-penalty style f: it calls torch.autograd.grad(create_graph=True) itself."""
    p = points.detach().requires_grad_()
    (g,) = torch.autograd.grad((p @ w).tanh().sum(), p, create_graph=True)
    return g.pow(2).sum()


def _input_gradient_norm_ref(w: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    return (((1 - (points @ w).tanh() ** 2)[:, None] * w) ** 2).sum()


F_CALLS_AUTOGRAD = {
    "autograd": AutoAutograd(),
    "fd": AutoFiniteDiff(),
    "so_fd_fd": SecondOrder(AutoFiniteDiff(), AutoFiniteDiff()),
    "sparse_fd": AutoSparse(AutoFiniteDiff()),
}


@pytest.mark.parametrize("backend", list(F_CALLS_AUTOGRAD.values()), ids=list(F_CALLS_AUTOGRAD))
def test_f_may_call_torch_autograd_itself(backend):
    """A gradient-penalty style f prepares and runs, prepared or not, with or without grad mode;
    the plain result is a plain tensor (the graph f built for itself is not handed out)."""
    w, points = _x(), torch.randn(4, 3, dtype=DT, generator=torch.Generator().manual_seed(5))
    want = grad(_input_gradient_norm_ref)(w, points)
    prep = td.prepare_gradient(_input_gradient_norm, backend, w, td.Constant(points))
    got = td.gradient(_input_gradient_norm, backend, w, td.Constant(points), prep=prep)
    close(got, want, backend)
    assert not got.requires_grad
    with torch.no_grad():
        close(td.gradient(_input_gradient_norm, backend, w, td.Constant(points)), want, backend)
    if not isinstance(backend, AutoSparse):
        hvp_want = jvp(lambda w_: grad(_input_gradient_norm_ref)(w_, points), (w,), (V,))[1]
        hv = td.hvp(_input_gradient_norm, backend, w, (V,), td.Constant(points))[0]
        torch.testing.assert_close(hv, hvp_want, rtol=1e-4, atol=1e-4)  # (finite differences of finite differences)


def test_f_needs_grad_mode_only_when_it_calls_torch_autograd():
    """Finite differences keep evaluating an ordinary f under no_grad (no graph built per call)."""
    assert not td.prepare_gradient(f_scalar, AutoFiniteDiff(), _x(), td.Constant(C)).f_needs_grad
    prep = td.prepare_gradient(_input_gradient_norm, AutoFiniteDiff(), _x(), td.Constant(torch.randn(4, 3, dtype=DT)))
    assert prep.f_needs_grad
