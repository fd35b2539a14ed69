"""Gradient of a scalar-valued ``f``; generic fallback from a pullback of 1."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from torchdi.backends import Backend
from torchdi.contexts import Context
from torchdi.families import GradientResult
from torchdi.operators._core import prepare_operator, run_operator, with_aux_result, write_out
from torchdi.prep import Prep
from torchdi.runners import (
    BoundFunction,
    Runner,
    Spec,
    build_runner,
    register_fallback,
    replace_spec,
)

__all__ = ["gradient", "prepare_gradient", "value_and_gradient"]


def prepare_gradient(f: Callable[..., Any], backend: Backend, x: Any, *contexts: Context[Any], strict: bool = True, has_aux: bool = False
) -> Prep:
    """Prepare ``gradient`` and ``value_and_gradient`` of ``f`` at ``x``.

    The expensive part (tracing, compilation, buffer allocation) happens here, once; the
    ``Prep`` then serves any ``x`` and contexts of the same structure, shapes, dtypes and devices.

    Args:
        f: the function ``f(x, *contexts) -> y`` with a one-element output.
        backend: a torchdi backend.
        x: a tensor or pytree (dict/list/tuple) of tensors.
        *contexts: ``Constant``/``Cache`` arguments.
        strict: check on every call that the arguments match this preparation.

    Returns:
        A ``Prep`` to pass as ``prep=``.

    Example::

        >>> f = lambda x, batch: ((batch @ x) ** 2).mean()
        >>> backend, x = torchdi.AutoFunc(), torch.ones(3)
        >>> prep = torchdi.prepare_gradient(f, backend, x, torchdi.Constant(torch.zeros(4, 3)))
        >>> for batch in (torch.ones(4, 3), 2 * torch.ones(4, 3)):  # new values, same shapes
        ...     print(torchdi.gradient(f, backend, x, torchdi.Constant(batch), prep=prep))
        tensor([6., 6., 6.])
        tensor([24., 24., 24.])
    """
    return prepare_operator("gradient", "prepare_gradient", f, backend, x, None, contexts, strict, has_aux=has_aux)


def value_and_gradient(
    f: Callable[..., Any], backend: Backend, x: Any, *contexts: Context[Any], prep: Prep | None = None, out: Any = None,
    has_aux: bool = False,
) -> GradientResult:
    """``(f(x), gradient)`` (value first, as in DifferentiationInterface.jl and JAX), as a
    ``GradientResult(value, gradient)`` NamedTuple (unpacks as a pair).

    ``out=`` receives the gradient (same structure as ``x``).

    Example::

        >>> torchdi.value_and_gradient(lambda x: (x**2).sum(), torchdi.AutoFunc(), torch.ones(2))
        GradientResult(value=tensor(2.), gradient=tensor([2., 2.]))
    """
    y, grad = run_operator("gradient", "value_and_gradient", f, backend, x, None, contexts, prep, has_aux=has_aux, detached=out is not None)
    return GradientResult(y, write_out(grad, out, "value_and_gradient"))


def gradient(
    f: Callable[..., Any], backend: Backend, x: Any, *contexts: Context[Any], prep: Prep | None = None, out: Any = None,
    has_aux: bool = False,
) -> Any:
    """The gradient of the scalar ``f(x, *contexts)`` with respect to ``x``.

    Args:
        f: the function ``f(x, *contexts) -> y`` with a one-element output.
        backend: a torchdi backend.
        x: a tensor or pytree (dict/list/tuple) of tensors.
        *contexts: ``Constant``/``Cache`` arguments.
        prep: the result of ``prepare_gradient`` (prepared on the spot when ``None``).
        out: optional preallocated buffers shaped like ``x`` (e.g. parameters' ``.grad``).
        has_aux: ``f`` returns ``(y, aux)``; ``aux`` (logits, metrics) is returned untouched and
            not differentiated, as with ``torch.func.grad(has_aux=True)``.

    Returns:
        The gradient, with the structure of ``x`` (``out`` when given); ``(gradient, aux)``
        with ``has_aux`` (``value_and_gradient`` then returns ``((y, aux), gradient)``).

    Raises:
        ValueError: when ``f`` does not return a one-element tensor.

    Example::

        >>> torchdi.gradient(lambda x: (x**2).sum(), torchdi.AutoFunc(), torch.tensor([1., 2.]))
        tensor([2., 4.])
    """
    _, grad = result = run_operator("gradient", "gradient", f, backend, x, None, contexts, prep, value=False, has_aux=has_aux, detached=out is not None)
    return with_aux_result(write_out(grad, out, "gradient"), result, has_aux)


def gradient_from_pullback(backend: Backend, f: BoundFunction, spec: Spec) -> Runner:
    """Generic gradient: the pullback of the cotangent 1."""
    pullback = build_runner(backend, "pullback", f, replace_spec(spec, n_tangents=1))
    y_shape, y_dtype = spec.y.shapes[0], spec.y.dtypes[0]

    def run(x: Any, _: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any]:
        device = pytree.tree_leaves(x)[0].device
        y, dx = pullback(x, torch.ones((1, *y_shape), dtype=y_dtype, device=device), contexts)
        return y, pytree.tree_map(lambda t: t[0], dx)

    return run


register_fallback("gradient", gradient_from_pullback)
