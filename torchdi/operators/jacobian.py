"""Jacobian of shape ``y.shape + x.shape``; generic fallback from batched pullbacks or pushforwards."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torchdi.backends import Backend
from torchdi.composition import jacobian_uses_forward
from torchdi.contexts import Context
from torchdi.operators._core import prepare_operator, run_operator, write_out
from torchdi.operators.pushforward import _output_basis
from torchdi.prep import Prep
from torchdi.runners import (
    BoundFunction,
    Runner,
    Spec,
    build_runner,
    engine_for,
    register_fallback,
    replace_spec,
)

__all__ = ["jacobian", "prepare_jacobian", "value_and_jacobian"]


def prepare_jacobian(f: Callable[..., Any], backend: Backend, x: torch.Tensor, *contexts: Context[Any], strict: bool = True) -> Prep:
    """Prepare ``jacobian`` and ``value_and_jacobian`` of ``f`` at the tensor ``x``.

    Args:
        f: the function ``f(x, *contexts) -> y`` (tensor to tensor).
        backend: a torchdi backend.
        x: a tensor.
        *contexts: ``Constant``/``Cache`` arguments.
        strict: check on every call that the arguments match this preparation.
    """
    return prepare_operator("jacobian", "prepare_jacobian", f, backend, x, None, contexts, strict)


def value_and_jacobian(
    f: Callable[..., Any], backend: Backend, x: torch.Tensor, *contexts: Context[Any], prep: Prep | None = None, out: Any = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(f(x), J)`` with ``J`` of shape ``y.shape + x.shape``; ``out=`` receives ``J``."""
    y, jac = run_operator("jacobian", "value_and_jacobian", f, backend, x, None, contexts, prep)
    return y, write_out(jac, out, "value_and_jacobian")


def jacobian(
    f: Callable[..., Any], backend: Backend, x: torch.Tensor, *contexts: Context[Any], prep: Prep | None = None, out: Any = None
) -> torch.Tensor:
    """The Jacobian of ``f`` at ``x``, of shape ``y.shape + x.shape`` (the ``torch.func.jacrev`` layout).

    Args:
        f: the function ``f(x, *contexts) -> y`` (tensor to tensor).
        backend: a torchdi backend.
        x: a tensor.
        *contexts: ``Constant``/``Cache`` arguments.
        prep: the result of ``prepare_jacobian``.
        out: optional preallocated buffer of shape ``y.shape + x.shape``.

    Example::

        >>> torchdi.jacobian(torch.sin, torchdi.AutoFunc(), torch.zeros(2))
        tensor([[1., 0.],
                [0., 1.]])
    """
    _, jac = run_operator("jacobian", "jacobian", f, backend, x, None, contexts, prep)
    return write_out(jac, out, "jacobian")


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
            return y, columns.reshape(n, m).T.reshape(y_shape + x_shape)

        return run_forward
    pullback = build_runner(backend, "pullback", f, replace_spec(spec, n_tangents=m))

    def run_reverse(x: Any, _: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any]:
        y, rows = pullback(x, _output_basis(spec, x), contexts)  # (m, *x_shape)
        return y, rows.reshape(y_shape + x_shape)

    return run_reverse


register_fallback("jacobian", jacobian_from_batches)
