"""torchdi.scipy: to_scipy and objective, against scipy's own functions."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import torchdi
from torchdi import AutoAutograd, AutoFunc, AutoSparse

scipy_sparse = pytest.importorskip("scipy.sparse")
optimize = pytest.importorskip("scipy.optimize")
tds = pytest.importorskip("torchdi.scipy")

X0 = np.array([1.3, 0.7, 0.8, 1.9, 1.2])
P = np.arange(5.0) - 2.0


def rosen(x):
    return (100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2).sum()


# --------------------------------------------------------------------------- to_scipy


@pytest.mark.filterwarnings("ignore:Sparse")
def test_to_scipy_layouts():
    dense = torch.tensor([[1.0, 0.0, 2.0], [0.0, 0.0, 3.0]], dtype=torch.float64)
    for layout, expected in (
        (dense.to_sparse_csr(), scipy_sparse.csr_array),
        (dense.to_sparse_coo(), scipy_sparse.coo_array),
        (dense.to_sparse_csc(), scipy_sparse.csc_array),
    ):
        converted = tds.to_scipy(layout)
        assert isinstance(converted, expected) and converted.shape == (2, 3) and converted.dtype == np.float64
        np.testing.assert_array_equal(converted.toarray(), dense.numpy())
    array = tds.to_scipy(dense.requires_grad_())
    assert isinstance(array, np.ndarray)
    np.testing.assert_array_equal(array, dense.detach().numpy())
    uncoalesced = torch.sparse_coo_tensor([[0, 0], [1, 1]], [1.0, 2.0], (2, 2))
    np.testing.assert_array_equal(tds.to_scipy(uncoalesced).toarray(), [[0.0, 3.0], [0.0, 0.0]])


def test_to_scipy_errors():
    with pytest.raises(TypeError, match=r"expected a torch\.Tensor, got list"):
        tds.to_scipy([1.0])
    with pytest.raises(ValueError, match=r"2-d matrices.*shape \(2, 2, 2\)"):
        tds.to_scipy(torch.ones(2, 2, 2).to_sparse())
    with pytest.raises(TypeError, match="bfloat16"):
        tds.to_scipy(torch.ones(2, dtype=torch.bfloat16))


def test_sparse_jacobian_to_scipy_matches_the_dense_one():
    def f(x):
        return x[1:] * x[:-1] + x[1:].sin()

    x = torch.linspace(0.1, 1.0, 6, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CSR assembly's own warning is the sparse code's business
        jac = torchdi.jacobian(f, AutoSparse(AutoFunc()), x)
    converted = tds.to_scipy(jac)
    assert isinstance(converted, scipy_sparse.csr_array) and converted.nnz == 10
    np.testing.assert_allclose(converted.toarray(), torch.func.jacrev(f)(x).numpy())


# --------------------------------------------------------------------------- objective

BACKENDS = {"func": AutoFunc(), "autograd": AutoAutograd(), "sparse": AutoSparse(AutoFunc())}


@pytest.mark.parametrize("backend", BACKENDS.values(), ids=BACKENDS.keys())
def test_objective_matches_scipy_rosenbrock(backend):
    obj = tds.objective(rosen, backend, torch.tensor(X0))
    assert isinstance(obj.fun(X0), float)
    np.testing.assert_allclose(obj.fun(X0), optimize.rosen(X0))
    np.testing.assert_allclose(obj.jac(X0), optimize.rosen_der(X0), rtol=1e-12)
    np.testing.assert_allclose(obj.hessp(X0, P), optimize.rosen_hess_prod(X0, P), rtol=1e-12)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        h = obj.hess(X0)
    assert not [w for w in caught if "beta state" in str(w.message)]
    if isinstance(backend, AutoSparse):
        assert isinstance(h, scipy_sparse.csr_array) and h.nnz == 13  # tridiagonal 5x5
        h = h.toarray()
    np.testing.assert_allclose(h, optimize.rosen_hess(X0), rtol=1e-12)


@pytest.mark.parametrize("method", ["BFGS", "Newton-CG", "trust-exact", "trust-krylov"])
def test_minimize_with_the_objective(method):
    obj = tds.objective(rosen, AutoFunc(), torch.tensor(X0))
    kwargs = {"jac": obj.jac}
    if method in ("Newton-CG", "trust-krylov"):
        kwargs["hessp"] = obj.hessp
    if method == "trust-exact":
        kwargs["hess"] = obj.hess
    ours = optimize.minimize(obj.fun, obj.x0, method=method, **kwargs)
    reference = optimize.minimize(
        optimize.rosen, X0, method=method, jac=optimize.rosen_der,
        **({"hessp": optimize.rosen_hess_prod} if "hessp" in kwargs else {}),
        **({"hess": optimize.rosen_hess} if "hess" in kwargs else {}),
    )
    assert ours.success
    np.testing.assert_allclose(ours.x, reference.x, rtol=1e-6)
    assert ours.nit == reference.nit


def test_fun_and_jac_share_one_evaluation():
    calls = []

    def counted(x):
        calls.append(1)
        return (x**2).sum()

    obj = tds.objective(counted, AutoAutograd(), torch.zeros(3, dtype=torch.float64))
    calls.clear()
    x = np.array([1.0, 2.0, 3.0])
    assert obj.fun(x) == 14.0
    np.testing.assert_array_equal(obj.jac(x), [2.0, 4.0, 6.0])
    assert len(calls) == 1
    obj.jac(x + 1)
    assert len(calls) == 2


def test_objective_keeps_x0_layout_and_contexts():
    seen = []

    def f(x, a):
        seen.append((x.shape, x.dtype))
        return ((x - a) ** 2).sum()

    a = torch.ones(2, 2)
    obj = tds.objective(f, AutoFunc(), torch.zeros(2, 2), torchdi.Constant(a))
    assert obj.x0.dtype == np.float64 and obj.x0.shape == (4,)
    result = optimize.minimize(obj.fun, obj.x0, jac=obj.jac, method="BFGS")
    assert seen[-1] == (torch.Size([2, 2]), torch.float32)
    torch.testing.assert_close(obj.to_torch(result.x), a, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="x has 3 elements, x0 had 4"):
        obj.fun(np.zeros(3))
    with pytest.raises(TypeError, match="x0 must be a real floating-point"):
        tds.objective(f, AutoFunc(), torch.zeros(2, dtype=torch.long))
