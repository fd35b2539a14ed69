"""Hessian-vector products; generic fallback: ``outer``'s pushforward of ``inner``'s gradient."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torchdi.backends import Backend
from torchdi.composition import outer_inner
from torchdi.contexts import Context
from torchdi.families import HvpResult
from torchdi.operators._core import prepare_operator, run_operator, with_aux_result
from torchdi.prep import Prep
from torchdi.runners import (
    BoundFunction,
    Runner,
    Spec,
    build_runner,
    composed,
    register_fallback,
    replace_spec,
    unbatch,
)

__all__ = ["gradient_and_hvp", "hvp", "prepare_hvp"]


def prepare_hvp(
    f: Callable[..., Any], backend: Backend, x: Any, tx: tuple[Any, ...], *contexts: Context[Any], strict: bool = True, has_aux: bool = False
) -> Prep:
    """Prepare ``hvp`` and ``gradient_and_hvp`` of the scalar ``f`` at ``x`` for the tangents ``tx``.

    Use ``SecondOrder(outer, inner)`` to choose how: the default for a plain backend ``b`` is
    ``SecondOrder(b, b)``; ``AutoFunc`` computes forward-over-reverse natively.
    """
    return prepare_operator("hvp", "prepare_hvp", f, backend, x, tx, contexts, strict, has_aux=has_aux)


def gradient_and_hvp(
    f: Callable[..., Any], backend: Backend, x: Any, tx: tuple[Any, ...], *contexts: Context[Any], prep: Prep | None = None, has_aux: bool = False
) -> HvpResult:
    """``(gradient, (H dx1, H dx2, ...))`` of the scalar ``f`` at ``x``.

    Returned as a ``HvpResult(gradient, hvp)`` NamedTuple (unpacks as a plain tuple).
    """
    grad, hvps = run_operator("hvp", "gradient_and_hvp", f, backend, x, tx, contexts, prep, has_aux=has_aux)
    return HvpResult(grad, unbatch(hvps, len(tx)))


def hvp(
    f: Callable[..., Any], backend: Backend, x: Any, tx: tuple[Any, ...], *contexts: Context[Any], prep: Prep | None = None, has_aux: bool = False
) -> tuple[Any, ...]:
    """The Hessian-vector products ``(H dx1, H dx2, ...)`` of the scalar ``f`` at ``x``.

    Args:
        f: the function ``f(x, *contexts) -> y`` with a one-element output.
        backend: a torchdi backend or ``SecondOrder(outer, inner)``.
        x: a tensor or pytree of tensors.
        tx: tuple of tangents, each shaped like ``x``.
        *contexts: ``Constant``/``Cache`` arguments.
        prep: the result of ``prepare_hvp``.
        has_aux: ``f`` returns ``(y, aux)``; ``aux`` comes back untouched, not differentiated:
            the result is then ``(result, aux)`` (``value_and_*``: ``((y, aux), ...)``).

    Returns:
        A tuple with one product (shaped like ``x``) per tangent.

    Example::

        >>> torchdi.hvp(lambda x: (x**3).sum(), torchdi.AutoFunc(), torch.ones(2), (torch.ones(2),))
        (tensor([6., 6.]),)
    """
    _, hvps = result = run_operator("hvp", "hvp", f, backend, x, tx, contexts, prep, has_aux=has_aux)
    return with_aux_result(unbatch(hvps, len(tx)), result, has_aux)


def hvp_from_second_order(backend: Backend, f: BoundFunction, spec: Spec) -> Runner:
    """Generic HVP: ``outer``'s pushforward of the tangents through ``inner``'s gradient."""
    outer, inner = outer_inner(backend)
    inner_gradient = build_runner(inner, "gradient", f, replace_spec(spec, n_tangents=0))

    def gradient_of(x: Any, contexts: tuple[Any, ...]) -> Any:
        return inner_gradient(x, None, contexts)[1]

    # (finite differences over a compiled gradient: the gradient compiles at preparation, counted)
    return composed(build_runner(outer, "pushforward", gradient_of, replace_spec(spec, y=spec.x)), inner_gradient)


register_fallback("hvp", hvp_from_second_order)
