"""scipy interop: torchdi results as scipy objects, and prepared objectives for ``scipy.optimize``.

scipy is optional (``pip install torchdi[scipy]``); this module imports it on use.

- ``to_scipy(t)``: a sparse CSR or COO result (``AutoSparse`` jacobians and hessians) as a
  ``scipy.sparse`` array, a dense tensor as a numpy array.
- ``objective(f, backend, x0, *contexts)``: ``fun``, ``jac``, ``hess`` and ``hessp`` taking and
  returning numpy arrays, prepared once, for ``scipy.optimize.minimize``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from torchdi.backends import AutoSparse, Backend
from torchdi.contexts import Context
from torchdi.operators import (
    gradient_and_hvp,
    prepare_gradient,
    prepare_hessian,
    prepare_hvp,
    value_and_gradient,
    value_gradient_and_hessian,
)
from torchdi.prep import Prep

__all__ = ["Objective", "objective", "to_scipy"]


def _scipy_sparse() -> Any:
    try:
        import scipy.sparse
    except ImportError as error:  # pragma: no cover - scipy is in the test extra
        raise ImportError("torchdi.scipy needs scipy: pip install scipy (or torchdi[scipy])") from error
    return scipy.sparse


def _numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    if t.dtype == torch.bfloat16:
        raise TypeError("to_scipy: numpy has no bfloat16; convert first (t.float())")
    return t.cpu().resolve_conj().resolve_neg().numpy()


def to_scipy(t: torch.Tensor) -> Any:
    """A torch result as scipy/numpy sees it: sparse CSR -> ``scipy.sparse.csr_array``, sparse COO
    -> ``scipy.sparse.coo_array``, dense -> ``numpy.ndarray`` (copied to the host, detached).

    Args:
        t: a tensor: a 2-d sparse CSR or COO matrix (``AutoSparse`` jacobians and hessians are
            CSR), or a dense tensor of any shape.

    Returns:
        A ``scipy.sparse`` array of ``t``'s shape and dtype, or a numpy array.

    Example::

        >>> import torchdi.scipy
        >>> J = torch.eye(3).to_sparse()  # COO; CSR results (AutoSparse) give a csr_array
        >>> torchdi.scipy.to_scipy(J).toarray()
        array([[1., 0., 0.],
               [0., 1., 0.],
               [0., 0., 1.]], dtype=float32)
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"to_scipy: expected a torch.Tensor, got {type(t).__name__}")
    if t.layout == torch.strided:
        return _numpy(t)
    sparse = _scipy_sparse()
    if t.dim() != 2 or (t.layout == torch.sparse_coo and t.dense_dim() != 0):
        raise ValueError(
            f"to_scipy: scipy.sparse holds 2-d matrices; got a {t.layout} tensor of shape {tuple(t.shape)} "
            "(reshape it, or t.to_dense() for a numpy array)"
        )
    shape = tuple(t.shape)
    if t.layout == torch.sparse_csr:
        return sparse.csr_array((_numpy(t.values()), _numpy(t.col_indices()), _numpy(t.crow_indices())), shape=shape)
    if t.layout == torch.sparse_coo:
        t = t.coalesce()
        rows, cols = _numpy(t.indices())
        return sparse.coo_array((_numpy(t.values()), (rows, cols)), shape=shape)
    if t.layout == torch.sparse_csc:
        return sparse.csc_array((_numpy(t.values()), _numpy(t.row_indices()), _numpy(t.ccol_indices())), shape=shape)
    raise ValueError(f"to_scipy: layout {t.layout} is not supported; use t.to_sparse_csr() or t.to_dense()")


@contextlib.contextmanager
def _without_beta_warning() -> Iterator[None]:
    """torch warns that sparse CSR support is "in beta" whenever a CSR tensor is made: about
    torch, not about this result, and repeated each time scipy asks for a hessian."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state")
        yield


class Objective:
    """``fun``, ``jac``, ``hess`` and ``hessp`` of ``f`` for ``scipy.optimize.minimize``.

    Each takes scipy's flat float64 numpy ``x`` (and ``p`` for ``hessp``), runs ``f`` on a
    tensor of ``x0``'s shape, dtype and device, and returns numpy (``fun``: a Python float;
    ``hess``: a ``scipy.sparse.csr_array`` when the backend is ``AutoSparse``). The gradient is
    prepared at construction, the hessian and HVP on their first use (a method that never
    asks for them never prepares them). ``fun`` and ``jac`` at the same ``x`` share one
    ``value_and_gradient`` call, as scipy asks for both in turn.

    Attributes:
        x0: the flat float64 numpy starting point to pass to ``minimize``.
        prep_gradient: the gradient's ``Prep``; ``prep_hessian``/``prep_hvp`` once used.
    """

    def __init__(self, f: Any, backend: Backend, x0: Any, contexts: tuple[Context[Any], ...]) -> None:
        if not isinstance(x0, torch.Tensor):
            x0 = torch.as_tensor(np.asarray(x0), dtype=torch.get_default_dtype())
        if not x0.is_floating_point():
            raise TypeError(f"objective: x0 must be a real floating-point tensor or array, got {x0.dtype}")
        self.f, self.backend, self.contexts = f, backend, contexts
        self._like = x0.detach()
        self.x0 = _numpy(x0).astype(np.float64).reshape(-1)
        # The dense backend computes values and gradients; AutoSparse's own work is the hessian.
        self._dense = backend.dense if isinstance(backend, AutoSparse) else backend
        self.prep_gradient: Prep = prepare_gradient(f, self._dense, self._like.clone(), *contexts)
        self.prep_hessian: Prep | None = None
        self.prep_hvp: Prep | None = None
        self._last: tuple[np.ndarray, float, np.ndarray] | None = None

    def to_torch(self, x: Any) -> torch.Tensor:
        """scipy's flat ``x`` as the tensor ``f`` takes (``x0``'s shape, dtype and device)."""
        array = np.asarray(x)
        if array.size != self._like.numel():
            raise ValueError(f"objective: x has {array.size} elements, x0 had {self._like.numel()}")
        return torch.as_tensor(array, device=self._like.device).to(self._like.dtype).reshape(self._like.shape)

    def _value_and_gradient(self, x: Any) -> tuple[float, np.ndarray]:
        array = np.asarray(x, dtype=np.float64)
        if self._last is not None and np.array_equal(self._last[0], array):
            return self._last[1], self._last[2]
        y, g = value_and_gradient(self.f, self._dense, self.to_torch(array), *self.contexts, prep=self.prep_gradient)
        result = (float(y), _numpy(g).astype(np.float64).reshape(-1))
        self._last = (array.copy(), *result)
        return result

    def fun(self, x: Any) -> float:
        """``f(x)`` as a Python float."""
        return self._value_and_gradient(x)[0]

    def jac(self, x: Any) -> np.ndarray:
        """The gradient at ``x``, flat float64."""
        return self._value_and_gradient(x)[1].copy()

    def hess(self, x: Any) -> Any:
        """The hessian at ``x``: ``(n, n)`` float64 numpy, or a ``scipy.sparse.csr_array`` with ``AutoSparse``."""
        x_t = self.to_torch(x)
        with _without_beta_warning():
            if self.prep_hessian is None:
                self.prep_hessian = prepare_hessian(self.f, self.backend, x_t, *self.contexts)
            _, _, h = value_gradient_and_hessian(self.f, self.backend, x_t, *self.contexts, prep=self.prep_hessian)
        n = x_t.numel()
        if h.layout != torch.strided:
            return to_scipy(h).astype(np.float64)
        return _numpy(h).astype(np.float64).reshape(n, n)

    def hessp(self, x: Any, p: Any) -> np.ndarray:
        """The Hessian-vector product ``H(x) p``, flat float64."""
        x_t, p_t = self.to_torch(x), self.to_torch(p)
        if self.prep_hvp is None:
            self.prep_hvp = prepare_hvp(self.f, self._dense, x_t, (p_t,), *self.contexts)
        _, (hv,) = gradient_and_hvp(self.f, self._dense, x_t, (p_t,), *self.contexts, prep=self.prep_hvp)
        return _numpy(hv).astype(np.float64).reshape(-1)


def objective(f: Any, backend: Backend, x0: Any, *contexts: Context[Any]) -> Objective:
    """Prepared numpy-in/numpy-out ``fun``, ``jac``, ``hess``, ``hessp`` of the scalar ``f`` for
    ``scipy.optimize.minimize``.

    Args:
        f: ``f(x, *contexts) -> y`` with a one-element output.
        backend: a torchdi backend (``AutoSparse(...)`` makes ``hess`` return a sparse matrix).
        x0: the starting point, a tensor (its shape, dtype and device are what ``f`` receives)
            or an array.
        *contexts: ``Constant``/``Cache`` arguments of ``f``.

    Returns:
        An ``Objective``: pass ``obj.fun``, ``obj.x0``, ``jac=obj.jac``, ``hess=obj.hess`` or
        ``hessp=obj.hessp`` to ``minimize``; ``obj.to_torch(result.x)`` gives the tensor back.

    Example::

        >>> from scipy.optimize import minimize
        >>> import torchdi.scipy
        >>> f = lambda x: ((x - 1.0) ** 2).sum() + (x**4).sum()
        >>> obj = torchdi.scipy.objective(f, torchdi.AutoFunc(), torch.zeros(3, dtype=torch.float64))
        >>> result = minimize(obj.fun, obj.x0, jac=obj.jac, hessp=obj.hessp, method="Newton-CG")
        >>> bool(result.success), obj.to_torch(result.x).round(decimals=4)
        (True, tensor([0.5898, 0.5898, 0.5898], dtype=torch.float64))
    """
    return Objective(f, backend, x0, contexts)
