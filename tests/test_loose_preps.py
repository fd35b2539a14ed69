"""``strict=False`` preparations (DESIGN rule 3): a call whose ``x`` (or tangents) has another
dtype, shape, structure or device than at preparation gets what plain ``torch.func`` gives for
that ``x`` (values *and* dtype), from a preparation made again for it, or a clear
``PreparationMismatchError`` naming ``x`` (an ``AutoSparse`` pattern is per shape): never a result
of the prepared dtype, never an error from deep inside torch or dynamo.

Compiled coverage uses ``AutoCompile(compiler="aot_eager")``.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch.utils import _pytree as pytree

import torchdi as td
from torchdi.sparsity.known import KnownColoring
from torchdi.testing.sparse_scenarios import chained_rosenbrock, diff_square

pytestmark = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")


def aot() -> td.AutoCompile:
    return td.AutoCompile(compiler="aot_eager")


BACKENDS: dict[str, Any] = {
    "func": td.AutoFunc(),
    "autograd": td.AutoAutograd(),
    "fd": td.AutoFiniteDiff(),
    "so_func_func": td.SecondOrder(td.AutoFunc(), td.AutoFunc()),
    "so_autograd_func": td.SecondOrder(td.AutoAutograd(), td.AutoFunc()),
    "sparse_func": td.AutoSparse(td.AutoFunc()),
    "sparse_autograd": td.AutoSparse(td.AutoAutograd()),
    "compile": aot(),
    "so_compile_func": td.SecondOrder(aot(), td.AutoFunc()),
    "sparse_compile": td.AutoSparse(aot()),
}
COMPILED = {"compile", "so_compile_func", "sparse_compile"}
SPARSE = {"sparse_func", "sparse_autograd", "sparse_compile"}


def ones_like_y(x: torch.Tensor) -> torch.Tensor:
    return torch.ones(x.shape[0] - 1, dtype=x.dtype)


# operator -> (f, call(backend, x, prep), plain torch.func of the same result). The tangents follow
# x's dtype and shape, as a caller's would.
OPERATORS: dict[str, tuple[Any, Any, Any]] = {
    "gradient": (
        chained_rosenbrock,
        lambda b, x, p: td.value_and_gradient(chained_rosenbrock, b, x, prep=p),
        lambda x: torch.func.grad_and_value(chained_rosenbrock)(x)[::-1],
    ),
    "hessian": (
        chained_rosenbrock,
        lambda b, x, p: td.value_gradient_and_hessian(chained_rosenbrock, b, x, prep=p),
        lambda x: (chained_rosenbrock(x), torch.func.grad(chained_rosenbrock)(x), torch.func.hessian(chained_rosenbrock)(x)),
    ),
    "hvp": (
        chained_rosenbrock,
        lambda b, x, p: td.gradient_and_hvp(chained_rosenbrock, b, x, (torch.ones_like(x),), prep=p),
        lambda x: (
            torch.func.grad(chained_rosenbrock)(x),
            (torch.func.jvp(torch.func.grad(chained_rosenbrock), (x,), (torch.ones_like(x),))[1],),
        ),
    ),
    "jacobian": (
        diff_square,
        lambda b, x, p: td.value_and_jacobian(diff_square, b, x, prep=p),
        lambda x: (diff_square(x), torch.func.jacrev(diff_square)(x)),
    ),
    "pushforward": (
        diff_square,
        lambda b, x, p: td.value_and_pushforward(diff_square, b, x, (torch.ones_like(x),), prep=p),
        lambda x: torch.func.jvp(diff_square, (x,), (torch.ones_like(x),)),
    ),
    "pullback": (
        diff_square,
        lambda b, x, p: td.value_and_pullback(diff_square, b, x, (ones_like_y(x),), prep=p),
        lambda x: (diff_square(x), torch.func.vjp(diff_square, x)[1](ones_like_y(x))),
    ),
}
PREPARE = {
    "gradient": lambda f, b, x: td.prepare_gradient(f, b, x, strict=False),
    "hessian": lambda f, b, x: td.prepare_hessian(f, b, x, strict=False),
    "hvp": lambda f, b, x: td.prepare_hvp(f, b, x, (torch.ones_like(x),), strict=False),
    "jacobian": lambda f, b, x: td.prepare_jacobian(f, b, x, strict=False),
    "pushforward": lambda f, b, x: td.prepare_pushforward(f, b, x, (torch.ones_like(x),), strict=False),
    "pullback": lambda f, b, x: td.prepare_pullback(f, b, x, (ones_like_y(x),), strict=False),
}


def cases() -> list[Any]:
    """Every eager backend with every operator; the compiled ones (a compilation or two each) with
    the operators that hold the most of x's signature: hessian and jacobian (sparse: seeds,
    pattern), hvp; sparse backends with their own operators."""
    out = []
    for name in BACKENDS:
        for op in OPERATORS:
            if name in SPARSE and op not in ("hessian", "jacobian"):
                continue
            if name in COMPILED and op not in ("hessian", "jacobian", "hvp"):
                continue
            if name == "so_compile_func" and op != "hessian":
                continue
            out.append(pytest.param(name, op, id=f"{name}-{op}"))
    return out


def assert_like_torch_func(got: Any, want: Any, fresh: Any = None) -> None:
    """``got`` has ``want``'s dtypes and values (``fresh``'s values where given: a finite-difference
    result is compared with one prepared for this ``x``, being no closer to torch.func's in float32)."""
    got_leaves, want_leaves = pytree.tree_leaves(got), pytree.tree_leaves(want if fresh is None else fresh)
    assert len(got_leaves) == len(want_leaves)
    for g, w, exact in zip(got_leaves, want_leaves, pytree.tree_leaves(want)):
        assert g.dtype == exact.dtype, f"dtype {g.dtype}, torch.func gives {exact.dtype}"
        if g.layout != torch.strided:  # an AutoSparse matrix: (y.numel, x.numel), CSR
            g, w = g.to_dense(), w.reshape(g.shape)
        torch.testing.assert_close(g, w)


def fresh(name: str, op: str, x: torch.Tensor) -> Any:
    """What a finite-difference preparation for ``x`` gives (``None`` for the other backends)."""
    return OPERATORS[op][1](BACKENDS[name], x, None) if name == "fd" else None


def point(n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.linspace(0.5, 1.5, n, dtype=dtype)


@pytest.mark.parametrize(("name", "op"), cases())
def test_another_dtype_of_x_gives_what_torch_func_gives(name, op):
    # The float64 preparation's seeds (AutoSparse), bases (jacobians over torch.autograd, finite
    # differences) and pytree layouts made float64 results for a float32 x.
    backend = BACKENDS[name]
    f, call, plain = OPERATORS[op]
    prep = PREPARE[op](f, backend, point(8, torch.float64))
    before = prep.num_compilations
    for _ in range(2):  # the second call reuses what the first one prepared
        x = point(8, torch.float32) + 0.125
        assert_like_torch_func(call(backend, x, prep), plain(x), fresh(name, op, x))
        assert len(prep.variants) == 1
    assert prep.num_compilations == (2 * before if name in COMPILED else 0)
    x64 = point(8, torch.float64) - 0.125  # the prepared dtype: the preparation itself
    assert_like_torch_func(call(backend, x64, prep), plain(x64), fresh(name, op, x64))
    assert len(prep.variants) == 1


@pytest.mark.parametrize(("name", "op"), cases())
def test_another_shape_of_x_gives_what_torch_func_gives_or_a_clear_error(name, op):
    backend = BACKENDS[name]
    f, call, plain = OPERATORS[op]
    prep = PREPARE[op](f, backend, point(8, torch.float64))
    x = point(11, torch.float64)
    if name in SPARSE:
        family = "hessian" if op == "hessian" else "jacobian"
        with pytest.raises(td.PreparationMismatchError) as info:
            call(backend, x, prep)
        message = str(info.value)
        assert "x: mismatch: expected Tensor(shape=(8,)" in message and "received Tensor(shape=(11,)" in message
        assert "per shape of x" in message and f"prepare_{family}(f, backend, x)" in message
        assert not prep.variants
        return
    assert_like_torch_func(call(backend, x, prep), plain(x), fresh(name, op, x))
    x8 = point(8, torch.float64)
    assert_like_torch_func(call(backend, x8, prep), plain(x8), fresh(name, op, x8))


def test_the_error_names_x_also_for_a_pytree_x_on_a_sparse_backend():
    backend = td.AutoSparse(td.AutoFunc())
    prep = td.prepare_jacobian(diff_square, backend, point(6, torch.float64), strict=False)
    with pytest.raises(td.PreparationMismatchError, match=r"x: mismatch: expected Tensor\(shape=\(6,\).*received \[Tensor"):
        td.jacobian(diff_square, backend, [point(6, torch.float64)], prep=prep)
    # The same shape on another dtype: prepared again with the same pattern and colouring (no detection).
    got = td.jacobian(diff_square, backend, point(6, torch.float32), prep=prep)
    (variant,) = prep.variants.values()
    # (equal, not identical: engines are cached per backend, and an equal KnownColoring from an
    # earlier preparation in the process may be the one the cached engine holds)
    # (the variant's is a TracedColoring of the same data, watched as the traced pattern is)
    assert KnownColoring.__eq__(variant.backend.coloring, prep.known_coloring) and variant.known_coloring == prep.known_coloring
    assert got.dtype == torch.float32


def swap_squares(d):
    return torch.cat([d["a"] ** 2, d["b"] ** 3])


@pytest.mark.parametrize("backend", [td.AutoFunc(), td.AutoAutograd()], ids=["func", "autograd"])
def test_a_pytree_x_with_other_leaf_shapes(backend):
    # The jacobian of a pytree x differentiates the raveled function: its layout is the prepared one.
    x = {"a": point(3, torch.float64), "b": point(4, torch.float64)}
    prep = td.prepare_jacobian(swap_squares, backend, x, strict=False)
    other = {"a": point(4, torch.float32), "b": point(3, torch.float32)}
    got, want = td.jacobian(swap_squares, backend, other, prep=prep), torch.func.jacrev(swap_squares)(other)
    assert_like_torch_func(got, want)


def test_preparations_made_again_are_bounded_and_counted(caplog):
    backend = aot()
    prep = td.prepare_gradient(chained_rosenbrock, backend, point(4, torch.float64), strict=False)
    assert prep.num_compilations == 1
    with caplog.at_level(logging.WARNING, logger="torchdi"):
        td.gradient(chained_rosenbrock, backend, point(4, torch.float32), prep=prep)
    assert prep.num_compilations == 2
    assert "strict=False preparation of the gradient of chained_rosenbrock" in caplog.text
    assert "x Tensor(shape=(4,), dtype=torch.float32, device=cpu) instead of x Tensor(shape=(4,), dtype=torch.float64" in caplog.text

    eager = td.prepare_gradient(chained_rosenbrock, td.AutoFunc(), point(4, torch.float64), strict=False)
    limit = td.Prep.MAX_VARIANTS
    for n in range(5, 5 + limit + 2):
        x = point(n, torch.float64)
        torch.testing.assert_close(td.gradient(chained_rosenbrock, td.AutoFunc(), x, prep=eager), torch.func.grad(chained_rosenbrock)(x))
    assert len(eager.variants) == limit  # the oldest shapes dropped
    assert [key[0][1] for key in eager.variants] == [torch.Size([n]) for n in range(7, 5 + limit + 2)]


def test_tangents_of_another_dtype_prepare_again():
    backend = td.AutoFunc()
    x = point(5, torch.float64)
    prep = td.prepare_pushforward(diff_square, backend, x, (torch.ones_like(x),), strict=False)
    x32 = x.float()
    got = td.pushforward(diff_square, backend, x32, (torch.ones_like(x32),), prep=prep)
    assert_like_torch_func(got, (torch.func.jvp(diff_square, (x32,), (torch.ones_like(x32),))[1],))


def cube_sum(x):
    return (x**3).sum()


@pytest.mark.parametrize("backend", [td.AutoFunc(), td.AutoAutograd(), td.AutoFiniteDiff()], ids=["func", "autograd", "fd"])
def test_another_dtype_under_torch_compile_vmap_and_autograd(backend):
    prep = td.prepare_hessian(cube_sum, backend, point(4, torch.float64), strict=False)
    tolerance = {"rtol": 1e-2, "atol": 1e-2} if isinstance(backend, td.AutoFiniteDiff) else {}
    if isinstance(backend, td.AutoFunc):  # (finite differences and torch.autograd: graph breaks, 2-15 s)
        # Traced into the caller's graph: prepared again there, not kept.
        compiled = torch.compile(lambda v: td.hessian(cube_sum, backend, v, prep=prep), backend="aot_eager")
        x = point(6, torch.float32)
        got = compiled(x)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, torch.diag(6 * x))
    # Under vmap: prepared again per call, not kept (prepared under a transform, it never probed
    # what f reads besides x, which a plain call needs).
    batch = torch.stack([point(7, torch.float32), point(7, torch.float32) + 1])
    got = torch.func.vmap(lambda v: td.hessian(cube_sum, backend, v, prep=prep))(batch)
    torch.testing.assert_close(got, torch.stack([torch.diag(6 * v) for v in batch]), **tolerance)
    assert not prep.variants
    # Under torch.autograd: outer derivatives flow through the preparation made again.
    x = point(5, torch.float32).requires_grad_()
    (outer,) = torch.autograd.grad(td.hessian(cube_sum, backend, x, prep=prep).trace(), x)
    torch.testing.assert_close(outer, torch.full((5,), 6.0), **tolerance)
    assert len(prep.variants) == 1


def test_a_closed_over_parameter_still_gets_its_derivative_after_a_vmap_call():
    weight = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)

    def f(x):
        return weight * (x**3).sum()

    backend = td.AutoFunc()
    prep = td.prepare_gradient(f, backend, point(4, torch.float64), strict=False)
    x = point(5, torch.float64)
    torch.func.vmap(lambda v: td.gradient(f, backend, v, prep=prep))(torch.stack([x, x + 1]))
    (outer,) = torch.autograd.grad(td.gradient(f, backend, x, prep=prep).sum(), weight)
    torch.testing.assert_close(outer, (3 * x**2).sum())
