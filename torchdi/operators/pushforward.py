"""Pushforward (JVP): ``dy = J(x) @ dx`` for each tangent ``dx``; generic fallback from pullbacks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from torchdi.backends import Backend
from torchdi.contexts import Context
from torchdi.errors import UnsupportedOperatorError
from torchdi.families import PushforwardResult
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

__all__ = ["prepare_pushforward", "pushforward", "value_and_pushforward"]


def prepare_pushforward(
    f: Callable[..., Any], backend: Backend, x: Any, tx: tuple[Any, ...], *contexts: Context[Any], strict: bool = True, has_aux: bool = False,
    y: Any = None,
) -> Prep:
    """Prepare ``pushforward`` and ``value_and_pushforward`` of ``f`` at ``x`` for the tangents ``tx``.

    Args:
        f: the function ``f(x, *contexts) -> y``.
        backend: a torchdi backend.
        x: a tensor or pytree of tensors.
        tx: tuple of tangents, each shaped like ``x``.
        *contexts: ``Constant``/``Cache`` arguments passed to ``f`` after ``x``.
        strict: check on every call that the arguments match this preparation.

    Returns:
        A ``Prep`` to pass as ``prep=``.
    """
    return prepare_operator("pushforward", "prepare_pushforward", in_place(f, y, "prepare_pushforward", has_aux, x), backend, x, tx, contexts, strict, has_aux=has_aux)


def value_and_pushforward(
    f: Callable[..., Any], backend: Backend, x: Any, tx: tuple[Any, ...], *contexts: Context[Any], prep: Prep | None = None, has_aux: bool = False, y: Any = None
) -> PushforwardResult:
    """``(f(x), (J dx1, J dx2, ...))``: the value and one Jacobian-vector product per tangent.

    Returned as a ``PushforwardResult(value, dy)`` NamedTuple (unpacks as a plain tuple).

    Example::

        >>> y, (dy,) = torchdi.value_and_pushforward(torch.sin, torchdi.AutoFunc(), torch.zeros(2), (torch.ones(2),))
        >>> dy
        tensor([1., 1.])
    """
    value, dy = run_operator("pushforward", "value_and_pushforward", in_place(f, y, "value_and_pushforward", has_aux, x), backend, x, tx, contexts, prep, has_aux=has_aux)
    return PushforwardResult(write_value(value, y), unbatch(dy, len(tx)))


def pushforward(
    f: Callable[..., Any], backend: Backend, x: Any, tx: tuple[Any, ...], *contexts: Context[Any], prep: Prep | None = None, has_aux: bool = False, y: Any = None
) -> tuple[Any, ...]:
    """The Jacobian-vector products ``(J dx1, J dx2, ...)`` of ``f`` at ``x``, one per tangent in ``tx``.

    Args:
        f: the function ``f(x, *contexts) -> y``.
        backend: a torchdi backend.
        x: a tensor or pytree of tensors.
        tx: tuple of tangents, each shaped like ``x``.
        *contexts: ``Constant``/``Cache`` arguments.
        prep: the result of ``prepare_pushforward`` (prepared on the spot when ``None``).
        has_aux: ``f`` returns ``(y, aux)``; ``aux`` comes back untouched, not differentiated:
            the result is then ``(result, aux)`` (``value_and_*``: ``((y, aux), ...)``).
        y: for an in-place ``f(y, x, *contexts)`` that writes its output into ``y`` and returns
            ``None``: a tensor of ``f``'s output shape and dtype, on ``x``'s device; it holds
            ``f(x)`` after the call.

    Returns:
        A tuple with one ``dy`` (shaped like ``f(x)``) per tangent.
    """
    value, dy = result = run_operator("pushforward", "pushforward", in_place(f, y, "pushforward", has_aux, x), backend, x, tx, contexts, prep, has_aux=has_aux)
    write_value(value, y)
    return with_aux_result(unbatch(dy, len(tx)), result, has_aux)


def pushforward_from_pullbacks(backend: Backend, f: BoundFunction, spec: Spec) -> Runner:
    """Generic pushforward: the Jacobian's rows from pullbacks of the output basis."""
    if not spec.y.is_tensor:
        raise UnsupportedOperatorError(f"{backend!r} has no forward mode and f returns a pytree; use AutoFunc() or AutoAutograd()")
    pullback = build_runner(backend, "pullback", f, replace_spec(spec, n_tangents=spec.y.numel))

    def run(x: Any, tx: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any]:
        y, rows = pullback(x, _output_basis(spec, x), contexts)
        jac = torch.stack([ravel(row)[0] for row in unbatch(rows, spec.y.numel)])  # (m, n)
        flat_tx = torch.stack([ravel(t)[0] for t in unbatch(tx, spec.n_tangents)])  # (k, n)
        dy = (flat_tx @ jac.T).reshape(spec.n_tangents, *spec.y.shapes[0])
        return y, dy

    return run


def _output_basis(spec: Spec, x: Any) -> Any:
    leaf = pytree.tree_leaves(x)[0]
    m = spec.y.numel
    return torch.eye(m, dtype=spec.y.dtypes[0], device=leaf.device).reshape(m, *spec.y.shapes[0])


register_fallback("pushforward", pushforward_from_pullbacks)
