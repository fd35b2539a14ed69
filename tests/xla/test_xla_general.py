"""AutoXLA with the general forms: pytree jacobians, non-scalar hessians, has_aux, y=, same point."""

from __future__ import annotations

import pytest
import torch

torch_xla = pytest.importorskip("torch_xla", reason="torch-xla is not installed here: `make test-xla` runs these in .venv-xla")

from torch.func import hessian, jacrev  # noqa: E402
from torch.utils import _pytree as pytree  # noqa: E402

import torchdi as td  # noqa: E402

XLA = td.AutoXLA()


def _close(actual, expected):
    a, a_spec = pytree.tree_flatten(actual)
    e, e_spec = pytree.tree_flatten(expected)
    assert a_spec == e_spec
    for p, q in zip(a, e):
        torch.testing.assert_close(p.cpu(), q, atol=1e-5, rtol=1e-5)


def test_pytree_jacobian_and_non_scalar_hessian():
    x = {"a": torch.randn(2, 3), "b": torch.randn(3)}

    def f(x):
        return (x["a"].sin() * x["b"].sum(), (x["a"] ** 2).sum() * x["b"])

    _close(td.jacobian(f, XLA, x), jacrev(f)(x))

    def g(x):
        return torch.stack([(x**3).sum(), (x.sin() * x).sum()])

    xt = torch.randn(4)
    _close(td.hessian(g, XLA, xt), hessian(g)(xt))


def test_has_aux_and_y():
    x = torch.randn(4)
    g, aux = td.gradient(lambda x: ((x**2).sum(), x * 3), XLA, x, has_aux=True)
    _close((g, aux), (2 * x, 3 * x))
    y = torch.empty(3)

    def f_inplace(y, x):
        y.copy_(x[1:] * x[:-1])

    _close(td.jacobian(f_inplace, XLA, x, y=y), jacrev(lambda x: x[1:] * x[:-1])(x))
    _close(y, x[1:] * x[:-1])


def test_same_point_hvp_falls_back_with_the_point_checked():
    x, t = torch.randn(3), torch.randn(3)

    def cube(x):
        return (x**3).sum()

    prep = td.prepare_hvp_same_point(cube, XLA, x, (t,))
    _close(td.hvp(cube, XLA, x, (t,), prep=prep), (6 * x * t,))
    with pytest.raises(td.PreparationMismatchError, match="another tensor"):
        td.hvp(cube, XLA, x.clone(), (t,), prep=prep)
