"""Pullback (VJP): ``dx = J(x)^T @ dy`` for each cotangent ``dy``; generic fallback from pushforwards."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from torchdi.backends import Backend
from torchdi.contexts import Context
from torchdi.families import PullbackResult
from torchdi.operators._core import prepare_operator, run_operator, with_aux_result
from torchdi.operators._inplace import in_place, write_value
from torchdi.prep import Prep
from torchdi.runners import (
    BoundFunction,
    Runner,
    Spec,
    build_runner,
    register_fallback,
    replace_spec,
    unbatch,
)
from torchdi.translate import ravel

__all__ = ["prepare_pullback", "pullback", "value_and_pullback"]


def prepare_pullback(
    f: Callable[..., Any], backend: Backend, x: Any, ty: tuple[Any, ...], *contexts: Context[Any], strict: bool = True, has_aux: bool = False,
    y: Any = None,
) -> Prep:
    """Prepare ``pullback`` and ``value_and_pullback`` of ``f`` at ``x`` for the cotangents ``ty``.

    Args:
        f: the function ``f(x, *contexts) -> y``.
        backend: a torchdi backend.
        x: a tensor or pytree of tensors.
        ty: tuple of cotangents, each shaped like ``f(x)``.
        *contexts: ``Constant``/``Cache`` arguments.
        strict: check on every call that the arguments match this preparation.

    Returns:
        A ``Prep`` to pass as ``prep=``.
    """
    return prepare_operator("pullback", "prepare_pullback", in_place(f, y, "prepare_pullback", has_aux, x), backend, x, ty, contexts, strict, has_aux=has_aux)


def value_and_pullback(
    f: Callable[..., Any], backend: Backend, x: Any, ty: tuple[Any, ...], *contexts: Context[Any], prep: Prep | None = None, has_aux: bool = False, y: Any = None
) -> PullbackResult:
    """``(f(x), (J^T dy1, J^T dy2, ...))``: the value and one vector-Jacobian product per cotangent.

    Returned as a ``PullbackResult(value, dx)`` NamedTuple (unpacks as a plain tuple).

    Example::

        >>> y, (dx,) = torchdi.value_and_pullback(torch.sin, torchdi.AutoFunc(), torch.zeros(2), (torch.ones(2),))
        >>> dx
        tensor([1., 1.])
    """
    value, dx = run_operator("pullback", "value_and_pullback", in_place(f, y, "value_and_pullback", has_aux, x), backend, x, ty, contexts, prep, has_aux=has_aux)
    return PullbackResult(write_value(value, y), unbatch(dx, len(ty)))


def pullback(
    f: Callable[..., Any], backend: Backend, x: Any, ty: tuple[Any, ...], *contexts: Context[Any], prep: Prep | None = None, has_aux: bool = False, y: Any = None
) -> tuple[Any, ...]:
    """The vector-Jacobian products ``(J^T dy1, ...)`` of ``f`` at ``x``, one per cotangent in ``ty``.

    Args:
        f: the function ``f(x, *contexts) -> y``.
        backend: a torchdi backend.
        x: a tensor or pytree of tensors.
        ty: tuple of cotangents, each shaped like ``f(x)``.
        *contexts: ``Constant``/``Cache`` arguments.
        prep: the result of ``prepare_pullback`` (prepared on the spot when ``None``).
        has_aux: ``f`` returns ``(y, aux)``; ``aux`` comes back untouched, not differentiated:
            the result is then ``(result, aux)`` (``value_and_*``: ``((y, aux), ...)``).
        y: for an in-place ``f(y, x, *contexts)`` that writes its output into ``y`` and returns
            ``None``: a tensor of ``f``'s output shape and dtype, on ``x``'s device; it holds
            ``f(x)`` after the call.

    Returns:
        A tuple with one ``dx`` (shaped like ``x``) per cotangent.
    """
    value, dx = result = run_operator("pullback", "pullback", in_place(f, y, "pullback", has_aux, x), backend, x, ty, contexts, prep, has_aux=has_aux)
    write_value(value, y)
    return with_aux_result(unbatch(dx, len(ty)), result, has_aux)


def pullback_from_pushforwards(backend: Backend, f: BoundFunction, spec: Spec) -> Runner:
    """Generic pullback: the Jacobian's columns from pushforwards of the input basis.

    PyTorch's complex convention: the pullback of ``v`` is the gradient of ``Re(<v, y>)`` as
    ``∂/∂Re x + i ∂/∂Im x`` (``J^H v`` for holomorphic ``f``), so complex ``x`` takes the
    pushforwards of the imaginary basis too.
    """
    n = spec.x.numel
    complex_x = any(d.is_complex for d in spec.x.dtypes)
    n_directions = 2 * n if complex_x else n
    pushforward = build_runner(backend, "pushforward", f, replace_spec(spec, n_tangents=n_directions))

    def run(x: Any, ty: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any]:
        basis = spec.x.basis(x)
        if complex_x:
            basis = pytree.tree_map(lambda b: torch.cat([b, 1j * b]), basis)
        y, columns = pushforward(x, basis, contexts)  # each column: dy for one basis dx
        jac_t = torch.stack([ravel(column)[0] for column in unbatch(columns, n_directions)])  # (n_directions, m)
        flat_ty = torch.stack([ravel(t)[0] for t in unbatch(ty, spec.n_tangents)])  # (k, m)
        flat_x, unravel_x = ravel(x)
        products = flat_ty.to(jac_t.dtype).conj() @ jac_t.T  # (k, n_directions): <v, J e>
        if complex_x:
            products = torch.complex(products[:, :n].real, products[:, n:].real)
        elif products.is_complex():
            products = products.real
        return y, unravel_x(products.to(flat_x.dtype))  # (k, n) -> x layout with batch dim

    return run


register_fallback("pullback", pullback_from_pushforwards)
