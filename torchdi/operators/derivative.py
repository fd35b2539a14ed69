"""Derivative ``dy/dx`` of ``f`` at a scalar ``x``; generic fallback from a pushforward of 1."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torchdi.backends import Backend
from torchdi.contexts import Context
from torchdi.families import DerivativeResult
from torchdi.operators._core import prepare_operator, run_operator, with_aux_result, write_out
from torchdi.operators._inplace import in_place, write_value
from torchdi.prep import Prep
from torchdi.runners import (
    BoundFunction,
    Runner,
    Spec,
    build_runner,
    register_fallback,
    replace_spec,
)

__all__ = ["derivative", "prepare_derivative", "value_and_derivative"]


def prepare_derivative(f: Callable[..., Any], backend: Backend, x: Any, *contexts: Context[Any], strict: bool = True, has_aux: bool = False,
    y: Any = None,
) -> Prep:
    """Prepare ``derivative`` and ``value_and_derivative`` of ``f`` at the scalar ``x``.

    Args:
        f: the function ``f(x, *contexts) -> y``.
        backend: a torchdi backend.
        x: a Python number or a 0-d tensor (Python numbers become tensors of the default dtype).
        *contexts: ``Constant``/``Cache`` arguments.
        strict: check on every call that the arguments match this preparation.
    """
    return prepare_operator("derivative", "prepare_derivative", in_place(f, y, "prepare_derivative", has_aux, x), backend, x, None, contexts, strict, has_aux=has_aux)


def value_and_derivative(
    f: Callable[..., Any], backend: Backend, x: Any, *contexts: Context[Any], prep: Prep | None = None, out: Any = None,
    has_aux: bool = False,
    y: Any = None,
) -> DerivativeResult:
    """``(f(x), dy/dx)`` for a scalar ``x``; ``out=`` receives the derivative.

    Returned as a ``DerivativeResult(value, derivative)`` NamedTuple (unpacks as a plain tuple).
    """
    value, dy = run_operator("derivative", "value_and_derivative", in_place(f, y, "value_and_derivative", has_aux, x), backend, x, None, contexts, prep, has_aux=has_aux, detached=out is not None)
    return DerivativeResult(write_value(value, y), write_out(dy, out, "value_and_derivative"))


def derivative(
    f: Callable[..., Any], backend: Backend, x: Any, *contexts: Context[Any], prep: Prep | None = None, out: Any = None,
    has_aux: bool = False,
    y: Any = None,
) -> Any:
    """The derivative ``dy/dx`` of ``f`` at the scalar ``x``, shaped like ``f(x)``.

    Args:
        f: the function ``f(x, *contexts) -> y``.
        backend: a torchdi backend.
        x: a Python number or a 0-d tensor.
        *contexts: ``Constant``/``Cache`` arguments.
        prep: the result of ``prepare_derivative``.
        out: optional preallocated result buffer.
        has_aux: ``f`` returns ``(y, aux)``; ``aux`` comes back untouched, not differentiated:
            the result is then ``(result, aux)`` (``value_and_*``: ``((y, aux), ...)``).
        y: for an in-place ``f(y, x, *contexts)`` that writes its output into ``y`` and returns
            ``None``: a tensor of ``f``'s output shape and dtype, on ``x``'s device; it holds
            ``f(x)`` after the call.

    Example::

        >>> torchdi.derivative(lambda t: torch.stack([t, t**2]), torchdi.AutoAutograd(), 3.0)
        tensor([1., 6.])
    """
    value, dy = result = run_operator("derivative", "derivative", in_place(f, y, "derivative", has_aux, x), backend, x, None, contexts, prep, has_aux=has_aux, detached=out is not None)
    write_value(value, y)
    return with_aux_result(write_out(dy, out, "derivative"), result, has_aux)


def derivative_from_pushforward(backend: Backend, f: BoundFunction, spec: Spec) -> Runner:
    """Generic derivative: the pushforward of the tangent 1."""
    pushforward = build_runner(backend, "pushforward", f, replace_spec(spec, n_tangents=1))

    def run(x: Any, _: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any]:
        y, dy = pushforward(x, torch.ones((1,), dtype=x.dtype, device=x.device), contexts)
        return y, dy[0]

    return run


register_fallback("derivative", derivative_from_pushforward)
