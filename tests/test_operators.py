"""Every operator x backend x input kind x contexts x dtype, against closed forms and AutoAutograd.

Each test prepares at one point (``x0``, tangents and contexts ``*0``) and executes with
``prep=`` at another point of the same shapes (``*1``), then compares:

- the result of every backend (AutoAutograd included) with a closed-form derivative at ``x1``;
- the result of every other backend with an unprepared ``AutoAutograd`` call at ``x1``;
- the plain operator with the last element of its ``value_and_*`` variant;
- ``out=`` buffers (written in place and returned as the same object);
- the inputs, tangents and ``Constant`` values, which must be bit-identical afterwards.

Closed forms are written as a flat Jacobian ``J`` (rows: outputs, columns: the inputs, dict
leaves in key order) and, for scalar outputs, a flat Hessian ``H``; every operator's expected
result is derived from them with plain linear algebra, independently of torchdi.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

import torchdi
from torchdi import (
    AutoAutograd,
    AutoFiniteDiff,
    AutoFunc,
    Cache,
    Constant,
    SecondOrder,
)

# --------------------------------------------------------------------------- backends

FIRST_ORDER_BACKENDS: dict[str, Any] = {
    "autograd": AutoAutograd(),
    "func": AutoFunc(),
    "func_chunk2": AutoFunc(chunk_size=2),
    "fd_central": AutoFiniteDiff(),
    "fd_forward": AutoFiniteDiff(method="forward"),
}
SECOND_ORDER_BACKENDS: dict[str, Any] = {
    **FIRST_ORDER_BACKENDS,
    "so_func_func": SecondOrder(AutoFunc(), AutoFunc()),
    "so_autograd_func": SecondOrder(AutoAutograd(), AutoFunc()),
    "so_autograd_autograd": SecondOrder(AutoAutograd(), AutoAutograd()),
    "so_fd_func": SecondOrder(AutoFiniteDiff(), AutoFunc()),
}

SECOND_ORDER_FAMILIES = {"second_derivative", "hvp", "hessian"}


def tolerance(backend_id: str, dtype: torch.dtype, family: str) -> dict[str, float]:
    """rtol/atol for ``backend_id``: tight for AD, looser for finite differences."""
    f64 = dtype == torch.float64
    second = family in SECOND_ORDER_FAMILIES
    if backend_id == "fd_central":
        if second:  # differences of differences (except the native second derivative)
            return {"rtol": 1e-4, "atol": 1e-4} if f64 else {"rtol": 3e-2, "atol": 3e-2}
        return {"rtol": 1e-5, "atol": 1e-6} if f64 else {"rtol": 1e-2, "atol": 1e-2}
    if backend_id == "fd_forward":
        if second:
            return {"rtol": 1e-3, "atol": 1e-3} if f64 else {"rtol": 1e-1, "atol": 1e-1}
        return {"rtol": 1e-5, "atol": 1e-5} if f64 else {"rtol": 5e-2, "atol": 5e-2}
    if backend_id == "so_fd_func":  # one level of central differences over exact gradients
        return {"rtol": 1e-5, "atol": 1e-6} if f64 else {"rtol": 1e-2, "atol": 1e-2}
    return {"rtol": 1e-9, "atol": 1e-10} if f64 else {"rtol": 1e-4, "atol": 1e-4}


# --------------------------------------------------------------------------- scenarios


def flat(tree: Any) -> torch.Tensor:
    """Flatten a tensor or a dict of tensors (keys in insertion order) into one vector."""
    if isinstance(tree, dict):
        return torch.cat([leaf.reshape(-1) for leaf in tree.values()])
    return tree.reshape(-1)


def unflat(vector: torch.Tensor, like: Any) -> Any:
    """Inverse of ``flat`` for the layout of ``like``."""
    if isinstance(like, dict):
        out, start = {}, 0
        for key, leaf in like.items():
            out[key] = vector[start : start + leaf.numel()].reshape(leaf.shape)
            start += leaf.numel()
        return out
    return vector.reshape(like.shape)


def first_leaf(x: Any) -> torch.Tensor:
    return next(iter(x.values())) if isinstance(x, dict) else x


def with_first_leaf(x: Any, leaf: torch.Tensor) -> Any:
    if isinstance(x, dict):
        key = next(iter(x))
        return {**x, key: leaf}
    return leaf


@dataclass
class Scenario:
    """``g(x)`` with closed forms: flat Jacobian, flat Hessian (scalar y), d2y (scalar x)."""

    name: str
    make_x: Callable[[torch.Generator, torch.dtype], Any]
    g: Callable[[Any], torch.Tensor]
    jac: Callable[[Any], torch.Tensor]
    families: frozenset[str]
    hess: Callable[[Any], torch.Tensor] | None = None
    d2: Callable[[Any], torch.Tensor] | None = None
    f_ctx: Callable[..., torch.Tensor] = field(init=False)

    def __post_init__(self) -> None:
        g = self.g

        # Contexts: a Constant scale and a Cache that f overwrites in place and then reads.
        def f_ctx(x: Any, c: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
            buf.copy_(first_leaf(x))
            return c * g(with_first_leaf(x, buf))

        self.f_ctx = f_ctx


def _uniform(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return (torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1).to(dtype)


A4 = torch.tensor(
    [[1.0, 2.0, -1.0, 0.5], [0.0, -1.5, 0.3, 1.0], [2.0, 0.1, 0.7, -0.4], [-0.6, 0.9, 0.0, 1.2]],
    dtype=torch.float64,
)
B43 = torch.tensor([[1.0, -2.0, 0.5], [0.3, 0.0, 1.5], [-1.0, 0.7, 0.2], [0.4, 0.4, -0.9]], dtype=torch.float64)


def _scalar_to_vec_g(t: torch.Tensor) -> torch.Tensor:
    return torch.stack([torch.sin(t), t**3, torch.exp(t) * t])


def _scalar_to_scalar_g(t: torch.Tensor) -> torch.Tensor:
    return torch.sin(t) * t**2


def _vec_to_scalar_g(x: torch.Tensor) -> torch.Tensor:
    return (x**3).sum() + x @ A4.to(x.dtype) @ x


def _vec_to_vec_g(x: torch.Tensor) -> torch.Tensor:
    return B43.to(x.dtype) @ torch.sin(x)


def _mat_to_mat_g(x: torch.Tensor) -> torch.Tensor:
    return x.T @ x


def _mat_to_mat_jac(x: torch.Tensor) -> torch.Tensor:
    eye = torch.eye(3, dtype=x.dtype)
    # d(X^T X)[i, j] / dX[k, l] = delta(l, i) X[k, j] + X[k, i] delta(l, j)
    j4 = torch.einsum("li,kj->ijkl", eye, x) + torch.einsum("ki,lj->ijkl", x, eye)
    return j4.reshape(9, 6)


def _mat_to_scalar_g(x: torch.Tensor) -> torch.Tensor:
    return (x**3).sum() + x.sum() ** 2


def _dict_to_scalar_g(x: dict[str, torch.Tensor]) -> torch.Tensor:
    a, b = x["a"], x["b"]
    return (a**2).sum() * b.sum() + torch.sin(b).sum()


def _dict_to_scalar_jac(x: dict[str, torch.Tensor]) -> torch.Tensor:
    a, b = x["a"], x["b"]
    return torch.cat([2 * a * b.sum(), ((a**2).sum() + torch.cos(b)).reshape(-1)]).reshape(1, 7)


def _dict_to_scalar_hess(x: dict[str, torch.Tensor]) -> torch.Tensor:
    a, b = x["a"], x["b"]
    h = torch.zeros(7, 7, dtype=a.dtype)
    h[:3, :3] = 2 * b.sum() * torch.eye(3, dtype=a.dtype)
    h[:3, 3:] = 2 * a[:, None]
    h[3:, :3] = 2 * a[None, :]
    h[3:, 3:] = torch.diag(-torch.sin(b).reshape(-1))
    return h


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in [
        Scenario(
            "scalar_to_vec",
            lambda gen, dt: _uniform(gen, (), dt),
            _scalar_to_vec_g,
            lambda t: torch.stack([torch.cos(t), 3 * t**2, torch.exp(t) * (1 + t)]).reshape(3, 1),
            frozenset({"pushforward", "pullback", "derivative", "second_derivative", "jacobian"}),
            d2=lambda t: torch.stack([-torch.sin(t), 6 * t, torch.exp(t) * (2 + t)]),
        ),
        Scenario(
            "scalar_to_scalar",
            lambda gen, dt: _uniform(gen, (), dt),
            _scalar_to_scalar_g,
            lambda t: (torch.cos(t) * t**2 + 2 * t * torch.sin(t)).reshape(1, 1),
            frozenset({"gradient", "hvp", "hessian", "derivative", "second_derivative", "jacobian"}),
            hess=lambda t: (-(t**2) * torch.sin(t) + 4 * t * torch.cos(t) + 2 * torch.sin(t)).reshape(1, 1),
            d2=lambda t: -(t**2) * torch.sin(t) + 4 * t * torch.cos(t) + 2 * torch.sin(t),
        ),
        Scenario(
            "vec_to_scalar",
            lambda gen, dt: _uniform(gen, (4,), dt),
            _vec_to_scalar_g,
            lambda x: (3 * x**2 + (A4 + A4.T).to(x.dtype) @ x).reshape(1, 4),
            frozenset({"gradient", "hvp", "hessian", "jacobian", "pushforward", "pullback"}),
            hess=lambda x: torch.diag(6 * x) + (A4 + A4.T).to(x.dtype),
        ),
        Scenario(
            "vec_to_vec",
            lambda gen, dt: _uniform(gen, (3,), dt),
            _vec_to_vec_g,
            lambda x: B43.to(x.dtype) * torch.cos(x)[None, :],
            frozenset({"pushforward", "pullback", "jacobian"}),
        ),
        Scenario(
            "mat_to_mat",
            lambda gen, dt: _uniform(gen, (2, 3), dt),
            _mat_to_mat_g,
            _mat_to_mat_jac,
            frozenset({"pushforward", "pullback", "jacobian"}),
        ),
        Scenario(
            "mat_to_scalar",
            lambda gen, dt: _uniform(gen, (2, 3), dt),
            _mat_to_scalar_g,
            lambda x: (3 * x**2 + 2 * x.sum()).reshape(1, 6),
            frozenset({"gradient", "hvp", "hessian"}),
            hess=lambda x: torch.diag(6 * x.reshape(-1)) + 2 * torch.ones(6, 6, dtype=x.dtype),
        ),
        Scenario(
            "dict_to_scalar",
            lambda gen, dt: {"a": _uniform(gen, (3,), dt), "b": _uniform(gen, (2, 2), dt)},
            _dict_to_scalar_g,
            _dict_to_scalar_jac,
            frozenset({"gradient", "hvp", "pullback", "pushforward"}),
            hess=_dict_to_scalar_hess,
        ),
    ]
}

# --------------------------------------------------------------------------- operators

# family -> (prepare, plain operator, value variant, tangents like "x"/"y"/None, has out=)
FAMILIES: dict[str, tuple[Callable, Callable, Callable, str | None, bool]] = {
    "pushforward": (torchdi.prepare_pushforward, torchdi.pushforward, torchdi.value_and_pushforward, "x", False),
    "pullback": (torchdi.prepare_pullback, torchdi.pullback, torchdi.value_and_pullback, "y", False),
    "derivative": (torchdi.prepare_derivative, torchdi.derivative, torchdi.value_and_derivative, None, True),
    "gradient": (torchdi.prepare_gradient, torchdi.gradient, torchdi.value_and_gradient, None, True),
    "jacobian": (torchdi.prepare_jacobian, torchdi.jacobian, torchdi.value_and_jacobian, None, True),
    "second_derivative": (
        torchdi.prepare_second_derivative,
        torchdi.second_derivative,
        torchdi.value_derivative_and_second_derivative,
        None,
        True,
    ),
    "hvp": (torchdi.prepare_hvp, torchdi.hvp, torchdi.gradient_and_hvp, "x", False),
    "hessian": (torchdi.prepare_hessian, torchdi.hessian, torchdi.value_gradient_and_hessian, None, True),
}


def expected_full(family: str, scen: Scenario, x: Any, tangents: tuple[Any, ...] | None, scale: Any) -> tuple:
    """What ``value_and_<family>`` must return at ``x``, from the closed forms (times ``scale``)."""
    y = scale * scen.g(x)
    jac = scale * scen.jac(x)
    grad_like_x = unflat(jac[0], x) if jac.shape[0] == 1 else None
    if family == "pushforward":
        return y, tuple(unflat(jac @ flat(t), y) for t in tangents)
    if family == "pullback":
        return y, tuple(unflat(jac.T @ flat(t), x) for t in tangents)
    if family == "derivative":
        return y, jac[:, 0].reshape(y.shape)
    if family == "gradient":
        return y, grad_like_x
    if family == "jacobian":
        return y, jac.reshape(y.shape + x.shape)
    if family == "second_derivative":
        return y, jac[:, 0].reshape(y.shape), (scale * scen.d2(x)).reshape(y.shape)
    hess = scale * scen.hess(x)
    if family == "hvp":
        return grad_like_x, tuple(unflat(hess @ flat(t), x) for t in tangents)
    if family == "hessian":
        return y, grad_like_x, hess.reshape(x.shape + x.shape)
    raise AssertionError(family)


def make_point(scen: Scenario, family: str, dtype: torch.dtype, seed: int, n_tangents: int, with_ctx: bool):
    """``x``, tangents (or None) and contexts (or ()) of one evaluation point, plus the Constant scale."""
    gen = torch.Generator().manual_seed(seed)
    x = scen.make_x(gen, dtype)
    like = FAMILIES[family][3]
    tangents = None
    if like is not None:
        base = x if like == "x" else scen.g(x)
        tangents = tuple(
            unflat(_uniform(gen, (flat(base).numel(),), dtype), base) for _ in range(n_tangents)
        )
    if not with_ctx:
        return x, tangents, (), 1.0
    scale = torch.tensor([1.5, -0.75][seed % 2], dtype=dtype)
    scratch = torch.full(first_leaf(x).shape, math.nan, dtype=dtype)  # its initial value must not matter
    return x, tangents, (Constant(scale), Cache(scratch)), scale


def call(fn: Callable, f: Callable, backend: Any, x: Any, tangents: Any, contexts: tuple, **kwargs: Any) -> Any:
    if tangents is None:
        return fn(f, backend, x, *contexts, **kwargs)
    return fn(f, backend, x, tangents, *contexts, **kwargs)


def clone_tree(tree: Any) -> Any:
    return torch.utils._pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, tree)


def assert_bit_identical(before: Any, after: Any) -> None:
    b_leaves = torch.utils._pytree.tree_leaves(before)
    a_leaves = torch.utils._pytree.tree_leaves(after)
    assert len(b_leaves) == len(a_leaves)
    for b, a in zip(b_leaves, a_leaves):
        if isinstance(b, torch.Tensor):
            assert torch.equal(b, a) or (b.isnan().all() and a.isnan().all()), "an input was modified"


def assert_plain_tensors(tree: Any) -> None:
    for leaf in torch.utils._pytree.tree_leaves(tree):
        assert isinstance(leaf, torch.Tensor)
        assert leaf.grad_fn is None and not leaf.requires_grad


def nan_like(tree: Any) -> Any:
    return torch.utils._pytree.tree_map(lambda t: torch.full_like(t, math.nan), tree)


# --------------------------------------------------------------------------- the grid


def _grid() -> list[Any]:
    params = []
    for family in FAMILIES:
        backends = SECOND_ORDER_BACKENDS if family in SECOND_ORDER_FAMILIES else FIRST_ORDER_BACKENDS
        for scen in SCENARIOS.values():
            if family not in scen.families:
                continue
            for backend_id in backends:
                for dtype in (torch.float32, torch.float64):
                    # one and three tangents in float64 (two code paths), two in float32
                    counts = (1, 3) if dtype == torch.float64 else (2,)
                    if FAMILIES[family][3] is None:
                        counts = (0,)
                    for n in counts:
                        for with_ctx in (False, True):
                            ident = f"{family}-{scen.name}-{backend_id}-{str(dtype)[6:]}" + (
                                f"-t{n}" if n else ""
                            ) + ("-ctx" if with_ctx else "")
                            params.append(pytest.param(family, scen.name, backend_id, dtype, n, with_ctx, id=ident))
    return params


@pytest.mark.parametrize(("family", "scen_name", "backend_id", "dtype", "n_tangents", "with_ctx"), _grid())
def test_operator(family, scen_name, backend_id, dtype, n_tangents, with_ctx):
    scen = SCENARIOS[scen_name]
    backends = SECOND_ORDER_BACKENDS if family in SECOND_ORDER_FAMILIES else FIRST_ORDER_BACKENDS
    backend = backends[backend_id]
    prepare, plain, value_variant, _, has_out = FAMILIES[family]
    f = scen.f_ctx if with_ctx else scen.g
    tol = tolerance(backend_id, dtype, family)

    x0, t0, ctx0, _ = make_point(scen, family, dtype, 0, n_tangents, with_ctx)
    x1, t1, ctx1, scale1 = make_point(scen, family, dtype, 1, n_tangents, with_ctx)
    prep = call(prepare, f, backend, x0, t0, ctx0)
    assert isinstance(prep, torchdi.Prep)
    assert prep.num_compilations == 0

    before = clone_tree((x1, t1, [c.value for c in ctx1 if isinstance(c, Constant)]))
    full = call(value_variant, f, backend, x1, t1, ctx1, prep=prep)
    only = call(plain, f, backend, x1, t1, ctx1, prep=prep)
    assert_bit_identical(before, (x1, t1, [c.value for c in ctx1 if isinstance(c, Constant)]))

    assert isinstance(full, tuple)
    expected = expected_full(family, scen, x1, t1, scale1)
    assert len(full) == len(expected)
    torch.testing.assert_close(full, expected, **tol)
    torch.testing.assert_close(only, expected[-1], **tol)
    if t1 is not None:
        assert isinstance(only, tuple) and len(only) == n_tangents
    assert_plain_tensors((full, only))

    if backend_id != "autograd":
        reference = call(value_variant, f, AutoAutograd(), x1, t1, ctx1)
        torch.testing.assert_close(full, reference, **tol)

    if has_out:
        buf = nan_like(expected[-1])
        returned = call(plain, f, backend, x1, t1, ctx1, prep=prep, out=buf)
        assert returned is buf
        torch.testing.assert_close(buf, expected[-1], **tol)
        buf2 = nan_like(expected[-1])
        full_out = call(value_variant, f, backend, x1, t1, ctx1, prep=prep, out=buf2)
        assert full_out[-1] is buf2
        torch.testing.assert_close(full_out, expected, **tol)


# --------------------------------------------------------------------------- focused checks


@pytest.mark.parametrize("backend", list(FIRST_ORDER_BACKENDS.values()), ids=list(FIRST_ORDER_BACKENDS))
def test_gradient_out_dict_is_filled_in_place(backend):
    scen = SCENARIOS["dict_to_scalar"]
    x = scen.make_x(torch.Generator().manual_seed(3), torch.float64)
    out = {"a": torch.full((3,), math.nan, dtype=torch.float64), "b": torch.full((2, 2), math.nan, dtype=torch.float64)}
    leaves = (out["a"], out["b"])
    returned = torchdi.gradient(scen.g, backend, x, out=out)
    assert returned is out and out["a"] is leaves[0] and out["b"] is leaves[1]
    torch.testing.assert_close(out, unflat(scen.jac(x)[0], x), **tolerance("fd_central", torch.float64, "gradient"))


@pytest.mark.parametrize("backend", list(SECOND_ORDER_BACKENDS.values()), ids=list(SECOND_ORDER_BACKENDS))
def test_derivative_accepts_python_float(backend):
    d = torchdi.derivative(lambda t: torch.stack([t**2, torch.sin(t)]), backend, 0.5)
    torch.testing.assert_close(
        d, torch.tensor([1.0, math.cos(0.5)], dtype=torch.get_default_dtype()), rtol=1e-2, atol=1e-2
    )
    d2 = torchdi.second_derivative(lambda t: t**3, backend, 2.0)
    torch.testing.assert_close(d2, torch.tensor(12.0), rtol=1e-2, atol=1e-2)


def test_hessian_of_quadratic_form_is_a_plus_a_transpose():
    a = torch.randn(5, 5, dtype=torch.float64)
    x = torch.randn(5, dtype=torch.float64)
    for backend in SECOND_ORDER_BACKENDS.values():
        h = torchdi.hessian(lambda v: v @ a @ v, backend, x)
        torch.testing.assert_close(h, a + a.T, rtol=1e-4, atol=1e-4)


def test_jacobian_layout_is_jacrev_layout():
    x = torch.randn(2, 3, dtype=torch.float64)

    def f(m):
        return torch.sin(m).sum(0)  # shape (3,)

    expected = torch.func.jacrev(f)(x)
    for backend in FIRST_ORDER_BACKENDS.values():
        jac = torchdi.jacobian(f, backend, x)
        assert jac.shape == (3, 2, 3)
        torch.testing.assert_close(jac, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", list(FIRST_ORDER_BACKENDS.values()), ids=list(FIRST_ORDER_BACKENDS))
def test_gradient_with_python_float_constant_changes_value(backend):
    def f(x, c):
        return c * (x**2).sum()

    x = torch.tensor([1.0, -2.0], dtype=torch.float64)
    prep = torchdi.prepare_gradient(f, backend, x, Constant(2.0))
    g1 = torchdi.gradient(f, backend, x, Constant(2.0), prep=prep)
    g2 = torchdi.gradient(f, backend, x, Constant(-3.0), prep=prep)
    torch.testing.assert_close(g1, 4.0 * x, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g2, -6.0 * x, rtol=1e-5, atol=1e-6)


def test_pushforward_and_pullback_are_adjoint():
    """<J dx, dy> == <dx, J^T dy> for every backend on a random non-square map."""
    w = torch.randn(4, 3, dtype=torch.float64)

    def f(x):
        return torch.tanh(w @ x) * x.sum()

    x, dx, dy = torch.randn(3, dtype=torch.float64), torch.randn(3, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    for backend in FIRST_ORDER_BACKENDS.values():
        (jdx,) = torchdi.pushforward(f, backend, x, (dx,))
        (jtdy,) = torchdi.pullback(f, backend, x, (dy,))
        torch.testing.assert_close(torch.dot(jdx, dy), torch.dot(dx, jtdy), rtol=1e-4, atol=1e-6)
