"""Second derivative ``d2y/dx2`` at a scalar ``x``; generic fallback: outer derivative of inner derivative."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torchdi.backends import Backend
from torchdi.composition import outer_inner
from torchdi.contexts import Context
from torchdi.families import SecondDerivativeResult
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

__all__ = ["prepare_second_derivative", "second_derivative", "value_derivative_and_second_derivative"]


def prepare_second_derivative(f: Callable[..., Any], backend: Backend, x: Any, *contexts: Context[Any], strict: bool = True, has_aux: bool = False
) -> Prep:
    """Prepare ``second_derivative`` and ``value_derivative_and_second_derivative`` at the scalar ``x``."""
    return prepare_operator("second_derivative", "prepare_second_derivative", f, backend, x, None, contexts, strict, has_aux=has_aux)


def value_derivative_and_second_derivative(
    f: Callable[..., Any], backend: Backend, x: Any, *contexts: Context[Any], prep: Prep | None = None, out: Any = None,
    has_aux: bool = False,
) -> SecondDerivativeResult:
    """``(f(x), dy/dx, d2y/dx2)`` for a scalar ``x``; ``out=`` receives the second derivative.

    Returned as a ``SecondDerivativeResult(value, derivative, second_derivative)`` NamedTuple (unpacks as a plain tuple).
    """
    y, dy, d2y = run_operator(
        "second_derivative", "value_derivative_and_second_derivative", f, backend, x, None, contexts, prep, has_aux=has_aux,
        detached=out is not None,
    )
    return SecondDerivativeResult(y, dy, write_out(d2y, out, "value_derivative_and_second_derivative"))


def second_derivative(
    f: Callable[..., Any], backend: Backend, x: Any, *contexts: Context[Any], prep: Prep | None = None, out: Any = None,
    has_aux: bool = False,
) -> Any:
    """The second derivative ``d2y/dx2`` of ``f`` at the scalar ``x``, shaped like ``f(x)``.

    Example::

        >>> torchdi.second_derivative(lambda t: t**3, torchdi.AutoFunc(), 2.0)
        tensor(12.)
    """
    _, _, d2y = result = run_operator("second_derivative", "second_derivative", f, backend, x, None, contexts, prep, has_aux=has_aux, detached=out is not None)
    return with_aux_result(write_out(d2y, out, "second_derivative"), result, has_aux)


def second_derivative_from_derivatives(backend: Backend, f: BoundFunction, spec: Spec) -> Runner:
    """Generic second derivative: ``outer``'s pushforward of the tangent 1 through ``inner``'s derivative."""
    outer, inner = outer_inner(backend)
    inner_derivative = build_runner(inner, "derivative", f, replace_spec(spec, inside_forward_mode=True))

    def value_and_derivative(x: Any, contexts: tuple[Any, ...]) -> Any:
        return inner_derivative(x, None, contexts)

    y_meta = TreeMeta.of((torch.empty(spec.y.shapes[0], dtype=spec.y.dtypes[0]),) * 2)
    pushforward = build_runner(outer, "pushforward", value_and_derivative, replace_spec(spec, y=y_meta, n_tangents=1))

    def run(x: Any, _: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any, Any]:
        (y, dy), (_, d2y) = pushforward(x, torch.ones((1,), dtype=x.dtype, device=x.device), contexts)
        return y, dy, d2y[0]

    return composed(run, inner_derivative, pushforward)


register_fallback("second_derivative", second_derivative_from_derivatives)
