"""Pytree x and pytree outputs in torch.func's layout, hessians of non-scalar f, AutoFunc(mode=)."""

from __future__ import annotations

import pytest
import torch
from torch.func import hessian as func_hessian
from torch.func import jacfwd, jacrev
from torch.utils import _pytree as pytree

import torchdi
from torchdi import AutoAutograd, AutoCompile, AutoFiniteDiff, AutoFunc, AutoSparse, SecondOrder

BACKENDS = {
    "autograd": AutoAutograd(),
    "func": AutoFunc(),
    "func_forward": AutoFunc(mode="forward"),
    "func_reverse": AutoFunc(mode="reverse"),
    "func_chunked": AutoFunc(chunk_size=2),
    "fd": AutoFiniteDiff(),
    "so_autograd_func": SecondOrder(AutoAutograd(), AutoFunc()),
    "compile": AutoCompile(compiler="aot_eager"),
}


def _tol(backend):
    fd = isinstance(backend, AutoFiniteDiff)
    return {"atol": 1e-5, "rtol": 1e-5} if fd else {"atol": 1e-10, "rtol": 1e-10}


def _assert_tree_close(actual, expected, **tol):
    a_leaves, a_spec = pytree.tree_flatten(actual)
    e_leaves, e_spec = pytree.tree_flatten(expected)
    assert a_spec == e_spec
    for a, e in zip(a_leaves, e_leaves):
        assert a.shape == e.shape and a.dtype == e.dtype
        torch.testing.assert_close(a, e, **tol)


def dict_to_tuple(x):
    return (x["a"].sin() * x["b"].sum(), (x["a"] ** 2).sum() * x["b"])


def dict_to_vector(x):
    return torch.cat([(x["a"].sin() * x["b"].sum()).reshape(-1), x["b"] ** 3])


def dict_to_scalar(x):
    return (x["a"] ** 3).sum() * x["b"].sum()


def tensor_to_matrix(x):
    return torch.stack([(x**3).sum() * x, x.sin() * x.sum()])


def _x():
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(2, 3, dtype=torch.float64, generator=g), "b": torch.randn(3, dtype=torch.float64, generator=g)}


@pytest.mark.parametrize("backend", BACKENDS.values(), ids=BACKENDS.keys())
@pytest.mark.parametrize("f", [dict_to_tuple, dict_to_vector, dict_to_scalar], ids=["tuple_y", "vector_y", "scalar_y"])
def test_jacobian_of_pytrees_nests_as_jacrev(backend, f):
    x = _x()
    expected = jacrev(f)(x)
    _assert_tree_close(torchdi.jacobian(f, backend, x), expected, **_tol(backend))
    y, jac = torchdi.value_and_jacobian(f, backend, x)
    _assert_tree_close(y, f(x), atol=1e-12, rtol=1e-12)
    _assert_tree_close(jac, expected, **_tol(backend))
    prep = torchdi.prepare_jacobian(f, backend, x)
    x2 = pytree.tree_map(lambda t: t + 0.5, x)
    _assert_tree_close(torchdi.jacobian(f, backend, x2, prep=prep), jacrev(f)(x2), **_tol(backend))


@pytest.mark.parametrize("backend", BACKENDS.values(), ids=BACKENDS.keys())
def test_jacobian_of_tensor_x_pytree_y(backend):
    x = torch.linspace(-1, 1, 4, dtype=torch.float64)

    def f(x):
        return {"s": x.sin(), "p": [x.prod(), x[:2] * 3]}

    _assert_tree_close(torchdi.jacobian(f, backend, x), jacrev(f)(x), **_tol(backend))


@pytest.mark.parametrize("backend", BACKENDS.values(), ids=BACKENDS.keys())
@pytest.mark.parametrize("f", [dict_to_scalar, dict_to_vector, dict_to_tuple], ids=["scalar_y", "vector_y", "tuple_y"])
def test_hessian_of_pytrees_nests_as_torch_func(backend, f):
    x = _x()
    tol = {"atol": 1e-4, "rtol": 1e-4} if isinstance(backend, AutoFiniteDiff) else _tol(backend)
    expected = func_hessian(f)(x)
    _assert_tree_close(torchdi.hessian(f, backend, x), expected, **tol)
    y, first, hess = torchdi.value_gradient_and_hessian(f, backend, x)
    _assert_tree_close(y, f(x), atol=1e-12, rtol=1e-12)
    _assert_tree_close(first, jacrev(f)(x), **tol)
    _assert_tree_close(hess, expected, **tol)


@pytest.mark.parametrize("backend", BACKENDS.values(), ids=BACKENDS.keys())
def test_hessian_of_non_scalar_f(backend):
    x = torch.linspace(-1, 1, 3, dtype=torch.float64)
    tol = {"atol": 1e-4, "rtol": 1e-4} if isinstance(backend, AutoFiniteDiff) else _tol(backend)
    hess = torchdi.hessian(tensor_to_matrix, backend, x)
    assert hess.shape == (2, 3, 3, 3)
    torch.testing.assert_close(hess, func_hessian(tensor_to_matrix)(x), **tol)
    y, jac, hess2 = torchdi.value_gradient_and_hessian(tensor_to_matrix, backend, x, out=torch.empty(2, 3, 3, 3, dtype=torch.float64))
    torch.testing.assert_close(y, tensor_to_matrix(x))
    torch.testing.assert_close(jac, jacrev(tensor_to_matrix)(x), **tol)
    torch.testing.assert_close(hess2, hess)


def test_non_scalar_hessian_on_compile_is_one_program():
    x = torch.linspace(-1, 1, 3, dtype=torch.float64)
    prep = torchdi.prepare_hessian(tensor_to_matrix, AutoCompile(compiler="aot_eager"), x)
    assert prep.num_compilations == 1
    torch.testing.assert_close(torchdi.hessian(tensor_to_matrix, prep.backend, x * 2, prep=prep), func_hessian(tensor_to_matrix)(x * 2))
    assert prep.num_compilations == 1


def test_pytree_compiled_jacobian_is_one_program_reused():
    x = _x()
    backend = AutoCompile(compiler="aot_eager")
    prep = torchdi.prepare_jacobian(dict_to_tuple, backend, x)
    assert prep.num_compilations == 1
    for scale in (2.0, 3.0):
        x2 = {k: t * scale for k, t in x.items()}
        _assert_tree_close(torchdi.jacobian(dict_to_tuple, backend, x2, prep=prep), jacrev(dict_to_tuple)(x2))
    assert prep.num_compilations == 1


def test_jacobian_out_has_the_nested_structure():
    x = _x()
    out = pytree.tree_map(torch.empty_like, jacrev(dict_to_tuple)(x))
    result = torchdi.jacobian(dict_to_tuple, AutoFunc(), x, out=out)
    assert result is out
    _assert_tree_close(out, jacrev(dict_to_tuple)(x))
    with pytest.raises(ValueError, match="out="):
        torchdi.jacobian(dict_to_tuple, AutoFunc(), x, out=out[0])


def test_pytree_strict_check_names_the_leaf():
    x = _x()
    prep = torchdi.prepare_jacobian(dict_to_vector, AutoFunc(), x)
    with pytest.raises(torchdi.PreparationMismatchError, match="key 'b'"):
        torchdi.jacobian(dict_to_vector, AutoFunc(), {"a": x["a"], "b": torch.ones(4, dtype=torch.float64)}, prep=prep)


def test_mixed_dtypes_keep_each_leaf_dtype():
    x = {"a": torch.ones(2, dtype=torch.float32), "b": torch.ones(3, dtype=torch.float64)}

    def f(x):
        return x["a"].sum() * x["b"]

    jac = torchdi.jacobian(f, AutoFunc(), x)
    expected = jacrev(f)(x)
    assert jac["a"].shape == expected["a"].shape and jac["b"].shape == expected["b"].shape
    torch.testing.assert_close(jac["a"].double(), expected["a"].double())
    torch.testing.assert_close(jac["b"], expected["b"])


def test_empty_leaf():
    x = {"a": torch.ones(0), "b": torch.ones(2)}
    jac = torchdi.jacobian(lambda x: x["b"] * 2, AutoFunc(), x)
    assert jac["a"].shape == (2, 0)
    torch.testing.assert_close(jac["b"], 2 * torch.eye(2))


def test_sparse_refuses_pytrees_naming_what_works():
    backend = AutoSparse(AutoFunc())
    with pytest.raises(TypeError, match=r"Ravel the pytree.*AutoFunc") as info:
        torchdi.jacobian(dict_to_vector, backend, _x())
    assert "x is a dict" in str(info.value)
    with pytest.raises(TypeError, match="f\\(x\\) is a tuple"):
        torchdi.jacobian(lambda x: (x, x), backend, torch.ones(2))


def test_sparse_refuses_non_scalar_hessian_naming_the_dense_backend():
    with pytest.raises(torchdi.UnsupportedOperatorError, match=r"scalar f, but f returns shape \(3,\).*AutoFunc"):
        torchdi.hessian(lambda x: x**3, AutoSparse(AutoFunc()), torch.ones(3))


def test_devices_must_match():
    x = {"a": torch.ones(2), "b": torch.ones(2, device="meta")}
    with pytest.raises((ValueError, RuntimeError)):
        torchdi.jacobian(lambda x: x["a"] * 2, AutoFunc(), x)


# --------------------------------------------------------------------------- AutoFunc(mode=)


def test_autofunc_mode_validated():
    with pytest.raises(ValueError, match="mode must be None, 'forward' or 'reverse'"):
        AutoFunc(mode="fwd")
    assert AutoFunc(mode="reverse") != AutoFunc(mode="forward")
    assert hash(AutoFunc(mode="reverse")) == hash(AutoFunc(mode="reverse"))


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_autofunc_mode_forces_the_transform(mode, monkeypatch):
    import torchdi.engines.func as func_engine

    used = []
    for name, real in (("jacfwd", jacfwd), ("jacrev", jacrev)):
        def spy(*args, _name=name, _real=real, **kwargs):
            used.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(func_engine, name, spy)
    # 4x3: shape alone would pick jacfwd (fewer inputs than outputs)
    w = torch.randn(4, 3, dtype=torch.float64)
    x = torch.randn(3, dtype=torch.float64)
    jac = torchdi.jacobian(lambda x: torch.tanh(w @ x), AutoFunc(mode=mode), x)
    torch.testing.assert_close(jac, jacrev(lambda x: torch.tanh(w @ x))(x))
    assert used == [{"forward": "jacfwd", "reverse": "jacrev"}[mode]]


@pytest.mark.parametrize("backend", BACKENDS.values(), ids=BACKENDS.keys())
def test_pushforward_and_pullback_of_pytrees(backend):
    from torch.func import jvp, vjp

    x = _x()
    tx = {k: torch.ones_like(v) for k, v in x.items()}
    y, (dy,) = torchdi.value_and_pushforward(dict_to_tuple, backend, x, (tx,))
    _assert_tree_close(y, dict_to_tuple(x), atol=1e-12, rtol=1e-12)
    _assert_tree_close(dy, jvp(dict_to_tuple, (x,), (tx,))[1], **_tol(backend))
    ty = tuple(torch.ones_like(leaf) for leaf in dict_to_tuple(x))
    y, (dx,) = torchdi.value_and_pullback(dict_to_tuple, backend, x, (ty,))
    _assert_tree_close(dx, vjp(dict_to_tuple, x)[1](ty)[0], **_tol(backend))
