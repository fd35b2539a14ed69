"""Jacobian of shape ``y.shape + x.shape``; generic fallback from batched pullbacks or pushforwards."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torchdi.backends import Backend
from torchdi.composition import jacobian_uses_forward
from torchdi.contexts import Context
from torchdi.families import JacobianResult
from torchdi.operators._core import prepare_operator, run_operator, with_aux_result, write_out
from torchdi.operators._inplace import in_place, write_value
from torchdi.operators.pushforward import _output_basis
from torchdi.prep import Prep
from torchdi.runners import (
    BoundFunction,
    Runner,
    Spec,
    build_runner,
    check_output_shapes,
    engine_for,
    register_fallback,
    replace_spec,
)

__all__ = ["jacobian", "prepare_jacobian", "value_and_jacobian"]


def prepare_jacobian(f: Callable[..., Any], backend: Backend, x: torch.Tensor, *contexts: Context[Any], strict: bool = True, has_aux: bool = False,
    y: Any = None,
) -> Prep:
    """Prepare ``jacobian`` and ``value_and_jacobian`` of ``f`` at the tensor ``x``.

    Args:
        f: the function ``f(x, *contexts) -> y`` (tensor to tensor).
        backend: a torchdi backend.
        x: a tensor.
        *contexts: ``Constant``/``Cache`` arguments.
        strict: check on every call that the arguments match this preparation.
    """
    return prepare_operator("jacobian", "prepare_jacobian", in_place(f, y, "prepare_jacobian", has_aux, x), backend, x, None, contexts, strict, has_aux=has_aux)


def value_and_jacobian(
    f: Callable[..., Any], backend: Backend, x: torch.Tensor, *contexts: Context[Any], prep: Prep | None = None, out: Any = None,
    has_aux: bool = False,
    y: Any = None,
) -> JacobianResult:
    """``(f(x), J)`` with ``J`` of shape ``y.shape + x.shape``; ``out=`` receives ``J``.

    Returned as a ``JacobianResult(value, jacobian)`` NamedTuple (unpacks as a plain tuple).
    """
    value, jac = run_operator("jacobian", "value_and_jacobian", in_place(f, y, "value_and_jacobian", has_aux, x), backend, x, None, contexts, prep, has_aux=has_aux, detached=out is not None)
    return JacobianResult(write_value(value, y), write_out(jac, out, "value_and_jacobian"))


def jacobian(
    f: Callable[..., Any], backend: Backend, x: torch.Tensor, *contexts: Context[Any], prep: Prep | None = None, out: Any = None,
    has_aux: bool = False,
    y: Any = None,
) -> torch.Tensor:
    """The Jacobian of ``f`` at ``x``, of shape ``y.shape + x.shape`` (the ``torch.func.jacrev`` layout).

    For a pytree ``x`` or a pytree ``f(x)`` the result is nested as ``torch.func.jacrev`` nests
    it: the outer level has ``f(x)``'s structure, the inner one ``x``'s, each leaf of shape
    ``y_leaf.shape + x_leaf.shape``.

    Args:
        f: the function ``f(x, *contexts) -> y`` (a tensor or pytree of tensors).
        backend: a torchdi backend.
        x: a tensor or a pytree (dict/list/tuple) of tensors.
        *contexts: ``Constant``/``Cache`` arguments.
        prep: the result of ``prepare_jacobian``.
        out: optional preallocated buffer(s) of the result's shape (and nesting).
        has_aux: ``f`` returns ``(y, aux)``; ``aux`` comes back untouched, not differentiated:
            the result is then ``(result, aux)`` (``value_and_*``: ``((y, aux), ...)``).
        y: for an in-place ``f(y, x, *contexts)`` that writes its output into ``y`` and returns
            ``None``: a tensor of ``f``'s output shape and dtype, on ``x``'s device; it holds
            ``f(x)`` after the call.

    Example::

        >>> torchdi.jacobian(torch.sin, torchdi.AutoFunc(), torch.zeros(2))
        tensor([[1., 0.],
                [0., 1.]])
    """
    if y is None and out is None and has_aux is False:  # the plain call: nothing to wrap or write (~1 us less)
        return run_operator("jacobian", "jacobian", f, backend, x, None, contexts, prep)[1]
    value, jac = result = run_operator("jacobian", "jacobian", in_place(f, y, "jacobian", has_aux, x), backend, x, None, contexts, prep, has_aux=has_aux, detached=out is not None)
    write_value(value, y)
    return with_aux_result(write_out(jac, out, "jacobian"), result, has_aux)


def jacobian_from_batches(backend: Backend, f: BoundFunction, spec: Spec) -> Runner:
    """Generic jacobian: rows from pullbacks of the output basis, or columns from pushforwards.

    Forward mode is used when the engine has no native reverse mode, when it has both and the
    input is smaller than the output, and for complex ``x`` or ``y`` (``jacobian_uses_forward``).
    """
    native = engine_for(backend).native
    m, n = spec.y.numel, spec.x.numel
    y_shape, x_shape = tuple(spec.y.shapes[0]), tuple(spec.x.shapes[0])
    forward = jacobian_uses_forward(native, spec)
    if forward:
        pushforward = build_runner(backend, "pushforward", f, replace_spec(spec, n_tangents=n))

        def run_forward(x: Any, _: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any]:
            y, columns = pushforward(x, spec.x.basis(x), contexts)  # (n, *y_shape)
            check_output_shapes(y, spec.y.shapes)  # (as in run_reverse)
            return y, columns.reshape(n, m).T.reshape(y_shape + x_shape)

        return run_forward
    pullback = build_runner(backend, "pullback", f, replace_spec(spec, n_tangents=m))

    def run_reverse(x: Any, _: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any]:
        y, rows = pullback(x, _output_basis(spec, x), contexts)  # (m, *x_shape)
        check_output_shapes(y, spec.y.shapes)  # a new shape of as many elements reshapes silently
        return y, rows.reshape(y_shape + x_shape)

    return run_reverse


register_fallback("jacobian", jacobian_from_batches)
