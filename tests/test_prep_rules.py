"""The preparation rules of DESIGN.md for the eager backends.

- rule 1: a Prep serves new values of the same signature (also covered by test_operators);
- rule 2: eager preps compile nothing (``num_compilations == 0``, never growing);
- rule 4: a Prep keeps no reference to the user's ``x``, tangents or context values;
- rule 5: ``x``, tangents and ``Constant`` values are bit-identical after every call, a ``x``
  that requires grad is left alone, and results are plain tensors (no ``grad_fn``) unless an
  outer transform differentiates them (rule 10, tests/test_composition.py).
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import torchdi
from torchdi import AutoAutograd, AutoFiniteDiff, AutoFunc, Cache, Constant, SecondOrder

BACKENDS: dict[str, Any] = {
    "autograd": AutoAutograd(),
    "func": AutoFunc(),
    "func_chunk2": AutoFunc(chunk_size=2),
    "fd_central": AutoFiniteDiff(),
    "fd_forward": AutoFiniteDiff(method="forward"),
    "so_func_func": SecondOrder(AutoFunc(), AutoFunc()),
    "so_autograd_func": SecondOrder(AutoAutograd(), AutoFunc()),
    "so_autograd_autograd": SecondOrder(AutoAutograd(), AutoAutograd()),
    "so_fd_func": SecondOrder(AutoFiniteDiff(), AutoFunc()),
}
IDS = list(BACKENDS)
VALUES = list(BACKENDS.values())


def f_vec(x, c, buf):
    buf.copy_(torch.sin(x))
    return buf * c + x**2


def f_scalar(x, c, buf):
    buf.copy_(x * c)
    return (buf**3).sum() + (x * c).sum()


def f_of_t(t, c, buf):
    buf.copy_(torch.stack([t, t]))
    return torch.stack([torch.sin(t) * c[0], buf.sum() * t * c[1]])


def make_args(op: str, dtype: torch.dtype = torch.float64) -> tuple[Any, tuple | None, Any, Any]:
    """Fresh ``x``, tangents, Constant value and Cache value for ``op``."""
    if op in ("derivative", "second_derivative"):
        return torch.tensor(0.7, dtype=dtype), None, torch.tensor([1.5, -2.0], dtype=dtype), torch.empty(2, dtype=dtype)
    x = torch.tensor([0.3, -1.2, 0.8], dtype=dtype)
    tangents = None
    if op in ("pushforward", "pullback", "hvp"):
        tangents = (torch.tensor([1.0, 0.5, -1.0], dtype=dtype), torch.tensor([0.0, 2.0, 1.0], dtype=dtype))
    return x, tangents, torch.tensor(1.25, dtype=dtype), torch.empty(3, dtype=dtype)


# op -> (f, prepare, [operators sharing the preparation])
OPS: dict[str, tuple[Callable, Callable, list[Callable]]] = {
    "pushforward": (f_vec, torchdi.prepare_pushforward, [torchdi.pushforward, torchdi.value_and_pushforward]),
    "pullback": (f_vec, torchdi.prepare_pullback, [torchdi.pullback, torchdi.value_and_pullback]),
    "derivative": (f_of_t, torchdi.prepare_derivative, [torchdi.derivative, torchdi.value_and_derivative]),
    "gradient": (f_scalar, torchdi.prepare_gradient, [torchdi.gradient, torchdi.value_and_gradient]),
    "jacobian": (f_vec, torchdi.prepare_jacobian, [torchdi.jacobian, torchdi.value_and_jacobian]),
    "second_derivative": (
        f_of_t,
        torchdi.prepare_second_derivative,
        [torchdi.second_derivative, torchdi.value_derivative_and_second_derivative],
    ),
    "hvp": (f_scalar, torchdi.prepare_hvp, [torchdi.hvp, torchdi.gradient_and_hvp]),
    "hessian": (f_scalar, torchdi.prepare_hessian, [torchdi.hessian, torchdi.value_gradient_and_hessian]),
}
SECOND_ORDER_OPS = {"second_derivative", "hvp", "hessian"}


def applicable(backend_id: str, op: str) -> bool:
    return op in SECOND_ORDER_OPS or not backend_id.startswith("so_")


GRID = [
    pytest.param(op, backend_id, id=f"{op}-{backend_id}")
    for op in OPS
    for backend_id in BACKENDS
    if applicable(backend_id, op)
]


def invoke(fn: Callable, f: Callable, backend: Any, x: Any, tangents: Any, contexts: tuple, **kwargs: Any) -> Any:
    if tangents is None:
        return fn(f, backend, x, *contexts, **kwargs)
    return fn(f, backend, x, tangents, *contexts, **kwargs)


def tensors_of(tree: Any) -> list[torch.Tensor]:
    return [leaf for leaf in torch.utils._pytree.tree_leaves(tree) if isinstance(leaf, torch.Tensor)]


# --------------------------------------------------------------------------- rule 4


def _prepare_and_drop(op: str, backend: Any, call_once: bool) -> tuple[torchdi.Prep, list[weakref.ref]]:
    """Prepare (and optionally call) with fresh values; return the Prep and weakrefs to the values."""
    f, prepare, operators = OPS[op]
    x, tangents, constant, cache = make_args(op)
    contexts = (Constant(constant), Cache(cache))
    prep = invoke(prepare, f, backend, x, tangents, contexts)
    if call_once:
        invoke(operators[1], f, backend, x, tangents, contexts, prep=prep)
    refs = [weakref.ref(t) for t in (x, constant, cache, *(tangents or ()))]
    return prep, refs


@pytest.mark.parametrize("backend_id", IDS)
def test_rule4_prep_keeps_no_reference_to_user_values(backend_id):
    """For every operator: prepared only, and prepared then called once (one gc pass per backend)."""
    backend = BACKENDS[backend_id]
    preps, refs = {}, {}
    for op in OPS:
        if not applicable(backend_id, op):
            continue
        for call_once in (False, True):
            key = f"{op}{'-called' if call_once else ''}"
            preps[key], refs[key] = _prepare_and_drop(op, backend, call_once)
    if any(r() is not None for rs in refs.values() for r in rs):
        gc.collect()  # only reference cycles need the collector
    alive = {key: [i for i, r in enumerate(rs) if r() is not None] for key, rs in refs.items()}
    alive = {key: idx for key, idx in alive.items() if idx}
    assert not alive, f"Preps keep the user's tensors alive (x, constant, cache, tangents indices): {alive}"
    # and every Prep still works on new values of the same signature
    for key, prep in preps.items():
        op = key.removesuffix("-called")
        f, _, operators = OPS[op]
        x, tangents, constant, cache = make_args(op)
        invoke(operators[0], f, backend, x, tangents, (Constant(constant), Cache(cache)), prep=prep)


def test_rule4_pytree_leaves_and_parameters_are_released():
    def loss(params, batch):
        return ((params["w"] @ batch["inputs"].T - batch["targets"]) ** 2).mean() + params["b"].sum()

    def make():
        params = {"w": nn.Parameter(torch.randn(1, 3)), "b": nn.Parameter(torch.zeros(1))}
        batch = {"inputs": torch.randn(5, 3), "targets": torch.randn(1, 5)}
        prep = torchdi.prepare_gradient(loss, AutoFunc(), params, Constant(batch))
        refs = [weakref.ref(t) for t in (*params.values(), *batch.values())]
        return prep, refs

    prep, refs = make()
    gc.collect()
    assert all(r() is None for r in refs)
    assert prep.operator == "gradient"


# --------------------------------------------------------------------------- rule 5


@pytest.mark.parametrize(("op", "backend_id"), GRID)
def test_rule5_inputs_are_bit_identical_and_results_plain(op, backend_id):
    backend = BACKENDS[backend_id]
    f, prepare, operators = OPS[op]
    x, tangents, constant, cache = make_args(op)
    contexts = (Constant(constant), Cache(cache))
    before = [t.clone() for t in (x, constant, *(tangents or ()))]

    prep = invoke(prepare, f, backend, x, tangents, contexts)
    results = [invoke(fn, f, backend, x, tangents, contexts, prep=prep) for fn in operators]
    results += [invoke(fn, f, backend, x, tangents, contexts) for fn in operators]  # unprepared

    after = [x, constant, *(tangents or ())]
    for b, a in zip(before, after):
        assert torch.equal(b, a), "an input, tangent or Constant value was modified"
    for leaf in tensors_of(results):
        assert leaf.grad_fn is None and not leaf.requires_grad
        assert type(leaf) is torch.Tensor


@pytest.mark.parametrize("backend", VALUES, ids=IDS)
def test_rule5_parameter_x_is_not_modified(backend):
    """x is never modified; without grad mode (or with out=) results are plain tensors, and with
    grad mode on they are differentiable through x (rule 10), equal to torch.autograd's."""
    w = nn.Parameter(torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64))
    before = w.detach().clone()
    c = torch.tensor(2.0, dtype=torch.float64)

    def f(p, scale):
        return (scale * p**3).sum()

    with torch.no_grad():
        g = torchdi.gradient(f, backend, w, Constant(c))
        y, g2 = torchdi.value_and_gradient(f, backend, w, Constant(c))
        h = torchdi.hessian(f, backend, w, Constant(c))
        (hv,) = torchdi.hvp(f, backend, w, (torch.ones(3, dtype=torch.float64),), Constant(c))
    with torch.enable_grad():
        g_out = torchdi.gradient(f, backend, w, Constant(c), out=torch.empty(3, dtype=torch.float64))
        g_tracked = torchdi.gradient(f, backend, w, Constant(c))
    assert torch.equal(w.detach(), before)
    assert w.grad is None and w.requires_grad and isinstance(w, nn.Parameter)
    for leaf in (g, y, g2, h, hv, g_out):
        assert leaf.grad_fn is None and not leaf.requires_grad
    torch.testing.assert_close(g, 6 * before**2, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.diagonal(h), 12 * before, rtol=1e-3, atol=1e-3)
    # d/dw sum(6 c w^2 / 2) = 12 w: the outer derivative through the gradient
    (outer,) = torch.autograd.grad(g_tracked.sum(), w)
    torch.testing.assert_close(outer, 12 * before, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", [AutoAutograd(), AutoFunc(), AutoFiniteDiff()], ids=["autograd", "func", "fd"])
def test_rule5_constant_that_requires_grad_is_not_modified_and_is_seen_through(backend):
    scale = nn.Parameter(torch.tensor([1.0, 2.0], dtype=torch.float64))
    x = torch.tensor([0.5, -1.0], dtype=torch.float64)
    with torch.no_grad():
        y, g = torchdi.value_and_gradient(lambda v, s: (s * v**2).sum(), backend, x, Constant(scale))
        jac = torchdi.jacobian(lambda v, s: s * v, backend, x, Constant(scale))
    for leaf in (y, g, jac):
        assert leaf.grad_fn is None and not leaf.requires_grad
    assert scale.grad is None
    torch.testing.assert_close(g, 2 * scale.detach() * x, rtol=1e-5, atol=1e-6)
    # With grad mode on, the outer derivative flows through the Constant (rule 10): d/ds sum(2 s x) = 2 x.
    g = torchdi.gradient(lambda v, s: (s * v**2).sum(), backend, x, Constant(scale))
    (outer,) = torch.autograd.grad(g.sum(), scale)
    torch.testing.assert_close(outer, 2 * x, rtol=1e-5, atol=1e-6)
    assert torch.equal(scale.detach(), torch.tensor([1.0, 2.0], dtype=torch.float64))


@pytest.mark.parametrize("backend", VALUES[:5], ids=IDS[:5])
def test_rule5_pytree_x_is_not_modified(backend):
    x = {"a": torch.tensor([1.0, 2.0], dtype=torch.float64), "b": torch.tensor([[0.5]], dtype=torch.float64)}
    before = {k: v.clone() for k, v in x.items()}
    t = {"a": torch.ones(2, dtype=torch.float64), "b": torch.ones(1, 1, dtype=torch.float64)}

    def f(d):
        return (d["a"] ** 2).sum() * d["b"].sum()

    torchdi.gradient(f, backend, x)
    torchdi.pushforward(f, backend, x, (t,))
    torchdi.pullback(f, backend, x, (torch.tensor(1.0, dtype=torch.float64),))
    torchdi.hvp(f, backend, x, (t,))
    for k in x:
        assert torch.equal(x[k], before[k])
    assert torch.equal(t["a"], torch.ones(2, dtype=torch.float64))


def test_rule5_cache_initial_value_does_not_matter():
    def f(x, buf):
        buf.copy_(x * 2)
        return (buf**2).sum()

    x = torch.tensor([1.0, -1.0, 3.0])
    for backend in VALUES:
        results = [
            torchdi.gradient(f, backend, x, Cache(init))
            for init in (torch.zeros(3), torch.full((3,), float("nan")), torch.full((3,), 1e30))
        ]
        for r in results:
            torch.testing.assert_close(r, 8 * x, rtol=1e-2, atol=1e-2)


# --------------------------------------------------------------------------- rules 1 and 2, Prep object


@pytest.mark.parametrize(("op", "backend_id"), GRID)
def test_rule1_and_2_reuse_over_many_values(op, backend_id):
    backend = BACKENDS[backend_id]
    f, prepare, operators = OPS[op]
    x, tangents, constant, cache = make_args(op)
    prep = invoke(prepare, f, backend, x, tangents, (Constant(constant), Cache(cache)))
    assert prep.num_compilations == 0
    for step in range(3):
        x2 = x * (1.0 + 0.1 * step)
        t2 = None if tangents is None else tuple(t * (step - 1.0) for t in tangents)
        c2 = constant * (0.5 + step)
        got = invoke(operators[1], f, backend, x2, t2, (Constant(c2), Cache(torch.empty_like(cache))), prep=prep)
        ref = invoke(operators[1], f, AutoAutograd(), x2, t2, (Constant(c2), Cache(torch.empty_like(cache))))
        tol = 1e-3 if backend_id == "fd_forward" else 1e-4
        torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
        assert prep.num_compilations == 0


def test_prep_attributes_and_repr():
    x = torch.ones(2, 3)
    prep = torchdi.prepare_jacobian(lambda v: v.sum(0), AutoFunc(), x)
    assert isinstance(prep, torchdi.Prep)
    assert prep.operator == "jacobian"
    assert prep.backend == AutoFunc()
    assert prep.strict is True
    assert prep.output_shape == torch.Size([3])
    assert prep.num_compilations == 0
    text = repr(prep)
    assert "jacobian" in text and "AutoFunc" in text and "num_compilations=0" in text
    assert torchdi.prepare_jacobian(lambda v: v, AutoFunc(), x, strict=False).strict is False


def cube_sum(v):
    return (v**3).sum()


def test_one_prep_serves_both_variants():
    x = torch.tensor([1.0, 2.0])
    for prepare, plain, value_variant, extra in [
        (torchdi.prepare_gradient, torchdi.gradient, torchdi.value_and_gradient, ()),
        (torchdi.prepare_hessian, torchdi.hessian, torchdi.value_gradient_and_hessian, ()),
        (torchdi.prepare_hvp, torchdi.hvp, torchdi.gradient_and_hvp, ((x,),)),
    ]:
        prep = prepare(cube_sum, AutoFunc(), x, *extra)
        plain_result = plain(cube_sum, AutoFunc(), x, *extra, prep=prep)
        full = value_variant(cube_sum, AutoFunc(), x, *extra, prep=prep)
        torch.testing.assert_close(full[-1], plain_result)
    torch.testing.assert_close(full[0], 3 * x**2)  # gradient_and_hvp: gradient first
    torch.testing.assert_close(full[1][0], 6 * x * x)
