"""Issue 23, the compiled engines and DifferentiateWith (items 3, 5, 7, 8, 9, 11, 13, 16, 17).

One test per item, each failing before its fix. Compiled coverage uses
``AutoCompile(compiler="aot_eager")``; inductor only where the item is inductor's own layout
handling (marked ``inductor``). AutoXLA's side of item 5 is in ``tests/xla``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.autograd.forward_ad as fwAD

import torchdi as td
from torchdi import (
    AutoAutograd,
    AutoCompile,
    AutoFiniteDiff,
    AutoFunc,
    Constant,
    State,
    UnsupportedOperatorError,
)

COMPILED = AutoCompile(compiler="aot_eager")


# -- item 3: a non-contiguous State tensor is updated on AutoCompile -------------------------------


def _counting(x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    state.add_(x.detach().sum())
    return (x * x).sum()


def _non_contiguous_states() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(the tensor the user holds, the non-contiguous view passed as the State)."""
    base = torch.zeros(2, 3)
    big = torch.zeros(6)
    return {"transposed": (base, base.t()), "strided": (big, big[::2])}


@pytest.mark.parametrize("layout", ["transposed", "strided"])
@pytest.mark.parametrize("prepared", [False, True], ids=["one-shot", "prepared"])
def test_item3_non_contiguous_state_is_updated(layout: str, prepared: bool) -> None:
    x = torch.tensor([1.0, 2.0, 3.0])
    base, view = _non_contiguous_states()[layout]
    expected_base, expected_view = _non_contiguous_states()[layout]
    _counting(x, expected_view)  # eager: one update
    prep = td.prepare_gradient(_counting, COMPILED, x, State(view)) if prepared else None
    assert torch.equal(base, torch.zeros_like(base))  # preparation has no side effect
    grad = td.gradient(_counting, COMPILED, x, State(view), prep=prep)
    torch.testing.assert_close(grad, 2 * x)
    assert torch.equal(base, expected_base)  # updated exactly once, through the user's view
    compilations = None if prep is None else prep.num_compilations
    td.gradient(_counting, COMPILED, x, State(view), prep=prep)
    _counting(x, expected_view)
    assert torch.equal(base, expected_base)
    if prep is not None:
        assert prep.num_compilations == compilations  # copied to the compiled layout, not recompiled


@pytest.mark.inductor
def test_item3_non_contiguous_state_is_updated_inductor() -> None:
    x = torch.tensor([1.0, 2.0, 3.0])
    base = torch.zeros(2, 3)
    prep = td.prepare_gradient(_counting, AutoCompile(), x, State(base.t()))
    td.gradient(_counting, AutoCompile(), x, State(base.t()), prep=prep)
    td.value_and_gradient(_counting, AutoCompile(), x, State(base.t()))  # one-shot
    torch.testing.assert_close(base, torch.full((2, 3), 12.0))


# -- items 7, 8, 9, 17: DifferentiateWith under forward mode, legacy batching, with a State ------

DW_BACKENDS = {"autograd": AutoAutograd(), "func": AutoFunc(), "compile": COMPILED, "finitediff": AutoFiniteDiff()}


def _piece(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return (x * c).sin() + x**2


def _tolerance(name: str) -> dict[str, float]:
    return {"rtol": 1e-6, "atol": 1e-6} if name == "finitediff" else {"rtol": 1e-10, "atol": 1e-12}


@pytest.mark.parametrize("name", list(DW_BACKENDS))
def test_item7_tensor_constant_under_forward_mode(name: str) -> None:
    g = td.DifferentiateWith(_piece, DW_BACKENDS[name])
    x, c, v = torch.randn(3, 4, dtype=torch.float64).unbind()
    c = c.abs()
    mine = lambda x: g(x, Constant(c))  # noqa: E731
    ref = lambda x: _piece(x, c)  # noqa: E731
    tol = _tolerance(name)
    torch.testing.assert_close(torch.func.jvp(mine, (x,), (v,))[1], torch.func.jvp(ref, (x,), (v,))[1], **tol)
    torch.testing.assert_close(torch.func.jacfwd(mine)(x), torch.func.jacfwd(ref)(x), **tol)
    scalar_tol = {"rtol": 1e-4, "atol": 1e-5} if name == "finitediff" else tol
    torch.testing.assert_close(
        torch.func.hessian(lambda x: mine(x).sum())(x), torch.func.hessian(lambda x: ref(x).sum())(x), **scalar_tol
    )
    expected = torch.func.jvp(ref, (x,), (v,))[1]
    with fwAD.dual_level():
        tangent = fwAD.unpack_dual(mine(fwAD.make_dual(x, v))).tangent
    torch.testing.assert_close(tangent, expected, **tol)
    # A Constant the outer transform does differentiate is still refused, as in reverse mode.
    with pytest.raises(ValueError, match=r"context 1 \(Constant\).*only x is differentiated"):
        torch.func.jvp(lambda c: g(x, Constant(c)), (c,), (v,))


def test_item7_unused_output_cotangent_is_zero() -> None:
    """Absent cotangents are no longer materialized by torch: DifferentiateWith fills them in."""
    g = td.DifferentiateWith(lambda x: (x.sin(), x.cos()), AutoFunc())
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    first, _ = g(x)
    first.sum().backward()
    torch.testing.assert_close(x.grad, x.detach().cos())


@pytest.mark.parametrize("name", ["func", "compile", "autograd"])
def test_item8_eager_forward_ad(name: str) -> None:
    g = td.DifferentiateWith(lambda x: (x.sin() * x).sum(0), DW_BACKENDS[name])
    x, v = torch.randn(2, 3, 2, dtype=torch.float64).unbind()
    expected = torch.func.jvp(lambda x: (x.sin() * x).sum(0), (x,), (v,))[1]
    for _ in range(2):  # the second call reuses the preparation made inside the dual level
        with fwAD.dual_level():
            tangent = fwAD.unpack_dual(g(fwAD.make_dual(x, v))).tangent
        torch.testing.assert_close(tangent, expected)
    assert torch.autograd.gradcheck(g, (x.clone().requires_grad_(),), check_forward_ad=True)
    # and torch.func.jvp still works with the same preparations
    torch.testing.assert_close(torch.func.jvp(g, (x,), (v,))[1], expected)
    if name == "compile":
        compilations = g.num_compilations
        with fwAD.dual_level():
            fwAD.unpack_dual(g(fwAD.make_dual(x, v)))
        assert g.num_compilations == compilations


# -- item 9: torch's batched autograd (legacy vmap) through DifferentiateWith ---------------------


def _coupled(x: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two outputs coupling neighbours, with a tensor Constant: every cotangent slot is exercised."""
    return x.sin() * x.roll(1) * c, (x**3).sum(0, keepdim=True)


LEGACY_BATCHED_CALLS = {
    "jacobian-vectorize": lambda g, x: torch.autograd.functional.jacobian(g, x, vectorize=True),
    "hessian-vectorize": lambda g, x: torch.autograd.functional.hessian(lambda x: sum(y.sum() for y in g(x)), x, vectorize=True),
    "is_grads_batched": lambda g, x: torch.autograd.grad(
        g(x), x, (torch.eye(4, dtype=x.dtype), torch.arange(4.0, dtype=x.dtype)[:, None]), is_grads_batched=True
    ),
}


@pytest.fixture(scope="module")
def legacy_batching_functions() -> dict[str, object]:
    """One DifferentiateWith per backend, shared by the cases: preparations are made once."""
    c = torch.linspace(0.5, 1.5, 4, dtype=torch.float64)

    def bound(g: td.DifferentiateWith) -> object:
        return lambda x: g(x, Constant(c))

    functions = {name: bound(td.DifferentiateWith(_coupled, backend)) for name, backend in DW_BACKENDS.items()}
    return functions | {"torch": lambda x: _coupled(x, c)}


# (compiled: is_grads_batched only, the vectorize=True calls reach the same backward and cost compilations)
@pytest.mark.parametrize(
    ("name", "call"),
    [(name, call) for name in DW_BACKENDS for call in LEGACY_BATCHED_CALLS if name != "compile" or call == "is_grads_batched"],
)
def test_item9_legacy_batching_works(name: str, call: str, legacy_batching_functions: dict[str, object]) -> None:
    """vectorize=True / is_grads_batched=True batch the cotangents with torch's legacy vmap: they
    reach the backend as one call with several tangents, and the results equal plain torch's."""
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    run = LEGACY_BATCHED_CALLS[call]
    mine, expected = run(legacy_batching_functions[name], x), run(legacy_batching_functions["torch"], x)
    torch.testing.assert_close(mine, expected, **_tolerance(name))


@pytest.mark.parametrize("name", ["autograd", "func", "finitediff"])
def test_item9_gradcheck_batched_grad(name: str) -> None:
    g = td.DifferentiateWith(lambda x: x.sin() * x.roll(1), DW_BACKENDS[name])
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(g, (x,), check_batched_grad=True)
    if name != "finitediff":  # second order: batched cotangents of the pullback (HVPs and pushforwards)
        assert torch.autograd.gradgradcheck(g, (x,), check_batched_grad=True)


def test_item9_batched_cotangents_of_pushforwards_and_create_graph() -> None:
    """The pushforward's backward and a batched double backward see legacy-batched cotangents too."""
    f = lambda x: x.sin() * x.roll(1)  # noqa: E731
    g = td.DifferentiateWith(f, AutoFunc())
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(4, dtype=torch.float64)
    eye = torch.eye(4, dtype=torch.float64)

    def forward_then_batched(h: object) -> torch.Tensor:
        with fwAD.dual_level():
            tangent = fwAD.unpack_dual(h(fwAD.make_dual(x, v))).tangent  # type: ignore[operator]
        return torch.autograd.grad(tangent, x, eye, is_grads_batched=True)[0]

    def batched_then_backward(h: object) -> torch.Tensor:
        rows = torch.autograd.grad(h(x), x, eye, is_grads_batched=True, create_graph=True)[0]  # type: ignore[operator]
        return torch.autograd.grad((rows**2).sum(), x)[0]

    for check in (forward_then_batched, batched_then_backward):
        torch.testing.assert_close(check(g), check(f))


def test_item9_compiled_backend_runs_outside_legacy_vmap_mode() -> None:
    """The batch of cotangents is one compiled pullback with 4 tangents, the same preparation
    ``jacrev`` uses: called outside legacy vmap mode, it does not recompile between the two."""
    g = td.DifferentiateWith(lambda x: x.sin() * x.roll(1), COMPILED)
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    eye = torch.eye(4, dtype=torch.float64)
    expected = torch.func.jacrev(lambda x: x.sin() * x.roll(1))(x.detach())
    torch.testing.assert_close(torch.autograd.grad(g(x), x, eye, is_grads_batched=True)[0], expected)
    compilations = g.num_compilations
    torch.testing.assert_close(torch.func.jacrev(g)(x.detach()), expected)
    torch.testing.assert_close(torch.autograd.grad(g(x), x, eye, is_grads_batched=True)[0], expected)
    assert (g.num_compilations, g.num_preparations) == (compilations, 1)


@pytest.mark.parametrize("thread", ["caller", "device"])
def test_item9_backend_runs_outside_legacy_vmap_mode(thread: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """f may use random operations (legacy vmap mode refuses them), on the calling thread and on
    an autograd device thread, which gets the mode's dispatch key but not its nesting count."""
    from torchdi.engines import _dynamo

    if thread == "device":
        monkeypatch.setattr(_dynamo, "_legacy_nesting", lambda: 0)
    f = lambda x: x.sin() + 0.0 * torch.randn(())  # noqa: E731
    g = td.DifferentiateWith(f, AutoFunc())
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    rows = torch.autograd.grad(g(x), x, torch.eye(3, dtype=x.dtype), is_grads_batched=True)[0]
    torch.testing.assert_close(rows, torch.diag(x.detach().cos()))


def test_item9_nested_legacy_vmap() -> None:
    from torch._vmap_internals import _vmap

    f = lambda x: x.sin() * x.roll(1)  # noqa: E731
    g = td.DifferentiateWith(f, AutoFunc())
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    u = torch.randn(2, 3, 4, dtype=torch.float64)

    def rows(h: object) -> torch.Tensor:
        return _vmap(_vmap(lambda u: torch.autograd.grad(h(x), x, u, retain_graph=True)[0]))(u)  # type: ignore[operator]

    torch.testing.assert_close(rows(g), rows(f))


def test_item9_without_legacy_vmap_internals_is_refused_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a torch without the legacy vmap internals torchdi uses, a clear refusal, never torch's
    "Batching rule not implemented" or a wrong result."""
    from torchdi.engines import _dynamo

    monkeypatch.setattr(_dynamo, "_LEGACY_VMAP", None)
    g = td.DifferentiateWith(lambda x: x.sin(), AutoFunc())
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    with pytest.raises(UnsupportedOperatorError, match=r"legacy vmap.*torch\.func\.jacrev/jacfwd/vmap"):
        torch.autograd.functional.jacobian(g, x, vectorize=True)
    torch.testing.assert_close(torch.autograd.functional.jacobian(g, x), torch.diag(x.detach().cos()))


@pytest.mark.parametrize("transform", ["jacrev", "jacfwd"])
def test_item9_legacy_batch_over_torch_func_batches(transform: str) -> None:
    """jacrev's / jacfwd's batch of pullbacks / pushforwards, then a legacy batch over their
    cotangents: one backend call for both batches, plain torch's result."""
    f = lambda x: x.sin() * x.roll(1) + x.sum() ** 2  # noqa: E731
    g = td.DifferentiateWith(f, AutoFunc())
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 4, 4, dtype=torch.float64)
    jacobian = getattr(torch.func, transform)

    def rows(h: object) -> torch.Tensor:
        return torch.autograd.grad(jacobian(h)(x), x, w, is_grads_batched=True)[0]

    torch.testing.assert_close(rows(g), rows(f))


@pytest.mark.parametrize("name", ["func", "compile"])
def test_item17_state_is_refused_at_the_call(name: str) -> None:
    def f(x: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
        counter.add_(1)
        return (x * x).sum()

    g = td.DifferentiateWith(f, DW_BACKENDS[name])
    counter = torch.zeros(())
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(UnsupportedOperatorError, match=r"context 1 is a torchdi\.State.*DifferentiateWith.*torchdi\.gradient") as error:
        g(x, State(counter))
    assert "prepare_pullback" not in str(error.value)
    assert counter.item() == 0  # refused before f ran


# -- item 13: dynamo's UserError (a data-dependent guard) is wrapped, naming what works -----------


def test_item13_data_dependent_guard_names_what_works() -> None:
    bn = torch.nn.BatchNorm1d(3, momentum=None)  # running average: 1 / num_batches_tracked
    params = dict(bn.named_parameters())
    batch = torch.randn(4, 3)

    def loss(p: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], batch: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(bn, {**p, **buffers}, (batch,)).square().sum()

    buffers = {k: v.clone() for k, v in bn.named_buffers()}
    with pytest.raises(RuntimeError, match=r"(?s)cannot compile.*data-dependent.*fullgraph=False.*AutoFunc\(\)") as error:
        td.gradient(loss, COMPILED, params, State(buffers), Constant(batch))
    assert not isinstance(error.value, torch._dynamo.exc.UserError)
    assert isinstance(error.value.__cause__, torch._dynamo.exc.UserError)
    # What the message names works, and agrees with eager autograd
    reference = {k: v.clone() for k, v in bn.named_buffers()}
    expected = td.gradient(loss, AutoAutograd(), params, State(reference), Constant(batch))
    for backend in (AutoFunc(), AutoCompile(compiler="aot_eager", fullgraph=False)):
        mine = {k: v.clone() for k, v in bn.named_buffers()}
        torch.testing.assert_close(td.gradient(loss, backend, params, State(mine), Constant(batch)), expected)
        torch.testing.assert_close(mine, reference)


# -- item 11: a float Constant made into a tensor inside f stays traced ----------------------------

FLOAT_FACTORIES = {
    "tensor": lambda x, c: x * torch.tensor(c),
    "tensor-float64": lambda x, c: x * torch.tensor(1 - c, dtype=torch.float64),
    "scalar_tensor": lambda x, c: x * torch.scalar_tensor(c, dtype=x.dtype),
    "full": lambda x, c: x * torch.full((3,), c),
    "full_like": lambda x, c: x * torch.full_like(x, c),
    "as_tensor": lambda x, c: x * torch.as_tensor(c),
    "as_tensor-dtype": lambda x, c: x * torch.as_tensor(c, dtype=x.dtype),
    "as_tensor-keywords": lambda x, c: x * torch.as_tensor(data=1 - c, dtype=torch.float64, device=x.device),
}


@pytest.mark.parametrize("form", list(FLOAT_FACTORIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_item11_float_made_into_a_tensor_does_not_recompile(form: str, dtype: torch.dtype) -> None:
    def f(x: torch.Tensor, c: float) -> torch.Tensor:
        return FLOAT_FACTORIES[form](x, c).sum()

    x = torch.tensor([1.0, -2.0, 0.5], dtype=dtype)
    prep = td.prepare_gradient(f, COMPILED, x, Constant(0.1))
    compilations = prep.num_compilations
    for c in (1 - 1e-7, 2.5, -3.25, 0.1 + 1e-12):
        value, grad = td.value_and_gradient(f, COMPILED, x, Constant(c), prep=prep)
        expected_value, expected_grad = td.value_and_gradient(f, AutoAutograd(), x, Constant(c))
        assert value.dtype == expected_value.dtype and grad.dtype == expected_grad.dtype
        torch.testing.assert_close(value, expected_value, rtol=0, atol=0)
        torch.testing.assert_close(grad, expected_grad, rtol=0, atol=0)
    assert prep.num_compilations == compilations


@pytest.mark.inductor
def test_item11_float_made_into_a_tensor_does_not_recompile_inductor() -> None:
    def f(x: torch.Tensor, c: float) -> torch.Tensor:
        return (x * torch.full_like(x, c) + torch.tensor(1 - c)).sum()

    x = torch.tensor([1.0, -2.0, 0.5])
    prep = td.prepare_gradient(f, AutoCompile(), x, Constant(0.5))
    compilations = prep.num_compilations
    for c in (1 - 1e-7, 2.5, -3.25):
        value, grad = td.value_and_gradient(f, AutoCompile(), x, Constant(c), prep=prep)
        torch.testing.assert_close(value, f(x, c))
        torch.testing.assert_close(grad, torch.full_like(x, c))
    assert prep.num_compilations == compilations


def test_item11_as_tensor_of_other_data_is_unchanged() -> None:
    """torch.as_tensor of a tensor (shared, not copied), of a list with the float, and a float
    context used in Python control flow (which must specialize) trace as before."""

    def f(x: torch.Tensor, c: float) -> torch.Tensor:
        same = torch.as_tensor(x)
        listed = torch.as_tensor([c, 2.0], dtype=x.dtype)
        return (same * listed[0] + listed[1] * x).sum() * (2.0 if c > 0 else -1.0)

    x = torch.tensor([1.0, -2.0, 0.5])
    prep = td.prepare_gradient(f, COMPILED, x, Constant(0.5))
    for c in (0.5, -0.25):
        torch.testing.assert_close(
            td.value_and_gradient(f, COMPILED, x, Constant(c), prep=prep), td.value_and_gradient(f, AutoAutograd(), x, Constant(c))
        )


def test_item11_as_tensor_handler_is_only_installed_while_torchdi_compiles() -> None:
    """The handler lives in dynamo's table only during torchdi's own compilations: a user's
    torch.compile elsewhere traces torch.as_tensor exactly as torch does."""
    from torch._dynamo.variables.torch import TorchInGraphFunctionVariable

    handlers = TorchInGraphFunctionVariable._get_handlers()
    had = torch.as_tensor in handlers
    f = lambda x, c: (x * torch.as_tensor(c)).sum()  # noqa: E731
    prep = td.prepare_gradient(f, COMPILED, torch.ones(3), Constant(0.5))
    td.gradient(f, COMPILED, torch.ones(3), Constant(1.5), prep=prep)
    assert (torch.as_tensor in handlers) == had


# -- item 16: the translation note on the one-shot path ---------------------------------------------


def _numpy_method(x: torch.Tensor, a: np.ndarray) -> torch.Tensor:
    return (x * torch.as_tensor(a.astype(np.float32))).sum()


@pytest.mark.parametrize(
    "call",
    [
        lambda x, a: td.gradient(_numpy_method, COMPILED, x, a),
        lambda x, a: td.value_and_gradient(_numpy_method, COMPILED, x, a),
        lambda x, a: td.hessian(_numpy_method, COMPILED, x, a),
        lambda x, a: td.gradient(_numpy_method, COMPILED, x, a, prep=td.prepare_gradient(_numpy_method, COMPILED, x, a)),
    ],
    ids=["gradient", "value_and_gradient", "hessian", "prepared"],
)
def test_item16_numpy_method_error_carries_the_translation_note(call: object) -> None:
    x = torch.ones(3)
    with pytest.raises(AttributeError, match="astype") as error:
        call(x, Constant(np.arange(3.0)))  # type: ignore[operator]
    notes = "\n".join(getattr(error.value, "__notes__", []))
    assert "context 1 (ndarray) as torch.Tensor" in notes and "torchdi.Static(value)" in notes
    # what the note suggests works: tensor methods on the traced array
    works = lambda x, a: (x * torch.as_tensor(a).to(torch.float32)).sum()  # noqa: E731
    torch.testing.assert_close(td.gradient(works, COMPILED, x, Constant(np.arange(3.0))), torch.arange(3.0))
