"""Hessian of a scalar ``f``, shaped ``x.shape + x.shape``; generic fallback from batched HVPs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from torchdi.backends import Backend
from torchdi.composition import outer_inner
from torchdi.contexts import Context
from torchdi.families import HessianResult
from torchdi.operators._core import prepare_operator, run_operator, with_aux_result, write_out
from torchdi.prep import Prep
from torchdi.runners import (
    BoundFunction,
    Runner,
    Spec,
    TreeMeta,
    build_runner,
    composed,
    register_fallback,
    replace_spec,
)

__all__ = ["hessian", "prepare_hessian", "value_gradient_and_hessian"]


def prepare_hessian(f: Callable[..., Any], backend: Backend, x: torch.Tensor, *contexts: Context[Any], strict: bool = True, has_aux: bool = False
) -> Prep:
    """Prepare ``hessian`` and ``value_gradient_and_hessian`` of the scalar ``f`` at the tensor ``x``."""
    return prepare_operator("hessian", "prepare_hessian", f, backend, x, None, contexts, strict, has_aux=has_aux)


def value_gradient_and_hessian(
    f: Callable[..., Any], backend: Backend, x: torch.Tensor, *contexts: Context[Any], prep: Prep | None = None, out: Any = None,
    has_aux: bool = False,
) -> HessianResult:
    """``(f(x), gradient, hessian)``; ``out=`` receives the Hessian.

    Returned as a ``HessianResult(value, gradient, hessian)`` NamedTuple (unpacks as a plain tuple).
    """
    y, grad, hess = run_operator("hessian", "value_gradient_and_hessian", f, backend, x, None, contexts, prep, has_aux=has_aux, detached=out is not None)
    return HessianResult(y, grad, write_out(hess, out, "value_gradient_and_hessian"))


def hessian(
    f: Callable[..., Any], backend: Backend, x: torch.Tensor, *contexts: Context[Any], prep: Prep | None = None, out: Any = None,
    has_aux: bool = False,
) -> torch.Tensor:
    """The Hessian of ``f`` at ``x``: shape ``x.shape + x.shape`` for a scalar ``f``, and
    ``y.shape + x.shape + x.shape`` otherwise (as ``torch.func.hessian``); a pytree ``x`` (or
    ``f(x)``) gives blocks nested as ``torch.func.hessian`` nests them. With ``has_aux=True``,
    ``f`` returns ``(y, aux)`` and the result is ``(hessian, aux)``.

    Example::

        >>> torchdi.hessian(lambda x: (x**3).sum(), torchdi.AutoFunc(), torch.ones(2))
        tensor([[6., 0.],
                [0., 6.]])
    """
    if out is None and has_aux is False:  # the plain call: nothing to wrap or write (~1 us less)
        return run_operator("hessian", "hessian", f, backend, x, None, contexts, prep)[2]
    _, _, hess = result = run_operator("hessian", "hessian", f, backend, x, None, contexts, prep, has_aux=has_aux, detached=out is not None)
    return with_aux_result(write_out(hess, out, "hessian"), result, has_aux)


def hessian_from_hvps(backend: Backend, f: BoundFunction, spec: Spec) -> Runner:
    """Generic Hessian: HVPs of the input basis, with the value and gradient from ``inner``.

    A non-scalar ``f`` gets ``outer``'s jacobian of ``inner``'s jacobian instead (one batch of
    pushforwards or pullbacks, not a loop over outputs): shape ``y.shape + x.shape + x.shape``.
    """
    if torch.Size(spec.y.shapes[0]).numel() != 1:
        return hessian_from_jacobians(backend, f, spec)
    _, inner = outer_inner(backend)
    n = spec.x.numel
    x_shape = tuple(spec.x.shapes[0])
    hvps = build_runner(backend, "hvp", f, replace_spec(spec, n_tangents=n))
    value_and_gradient = build_runner(inner, "gradient", f, replace_spec(spec, n_tangents=0))

    def run(x: Any, _: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any, Any]:
        y, grad = value_and_gradient(x, None, contexts)
        _, columns = hvps(x, spec.x.basis(x), contexts)  # (n, *x_shape): H e_i, a column of H
        return y, grad, columns.reshape(n, n).T.reshape(x_shape + x_shape)

    return composed(run, hvps, value_and_gradient)


def hessian_from_jacobians(backend: Backend, f: BoundFunction, spec: Spec) -> Runner:
    """Hessian of a non-scalar ``f``: ``outer``'s jacobian of ``inner``'s jacobian (as
    ``torch.func.hessian`` is ``jacfwd(jacrev(f))``), with the value and jacobian from ``inner``."""
    outer, inner = outer_inner(backend)
    y_shape, x_shape = tuple(spec.y.shapes[0]), tuple(spec.x.shapes[0])
    inner_jacobian = build_runner(inner, "jacobian", f, replace_spec(spec, n_tangents=0))
    jacobian_meta = TreeMeta(pytree.tree_structure(torch.empty(0)), (torch.Size(y_shape + x_shape),), (spec.y.dtypes[0],))

    def jacobian_of(x: Any, contexts: tuple[Any, ...]) -> Any:
        return inner_jacobian(x, None, contexts)[1]

    outer_jacobian = build_runner(outer, "jacobian", jacobian_of, replace_spec(spec, y=jacobian_meta, n_tangents=0))

    def run(x: Any, _: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any, Any]:
        y, jac = inner_jacobian(x, None, contexts)
        _, hess = outer_jacobian(x, None, contexts)  # (*y_shape, *x_shape, *x_shape)
        return y, jac, hess

    return composed(run, inner_jacobian, outer_jacobian)


register_fallback("hessian", hessian_from_hvps)
