"""Hessian of a scalar ``f``, shaped ``x.shape + x.shape``; generic fallback from batched HVPs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torchdi.backends import Backend
from torchdi.composition import outer_inner
from torchdi.contexts import Context
from torchdi.operators._core import prepare_operator, run_operator, write_out
from torchdi.prep import Prep
from torchdi.runners import (
    BoundFunction,
    Runner,
    Spec,
    build_runner,
    register_fallback,
    replace_spec,
)

__all__ = ["hessian", "prepare_hessian", "value_gradient_and_hessian"]


def prepare_hessian(f: Callable[..., Any], backend: Backend, x: torch.Tensor, *contexts: Context[Any], strict: bool = True) -> Prep:
    """Prepare ``hessian`` and ``value_gradient_and_hessian`` of the scalar ``f`` at the tensor ``x``."""
    return prepare_operator("hessian", "prepare_hessian", f, backend, x, None, contexts, strict)


def value_gradient_and_hessian(
    f: Callable[..., Any], backend: Backend, x: torch.Tensor, *contexts: Context[Any], prep: Prep | None = None, out: Any = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(f(x), gradient, hessian)``; ``out=`` receives the Hessian."""
    y, grad, hess = run_operator("hessian", "value_gradient_and_hessian", f, backend, x, None, contexts, prep)
    return y, grad, write_out(hess, out, "value_gradient_and_hessian")


def hessian(
    f: Callable[..., Any], backend: Backend, x: torch.Tensor, *contexts: Context[Any], prep: Prep | None = None, out: Any = None
) -> torch.Tensor:
    """The Hessian of the scalar ``f`` at the tensor ``x``, of shape ``x.shape + x.shape``.

    Example::

        >>> torchdi.hessian(lambda x: (x**3).sum(), torchdi.AutoFunc(), torch.ones(2))
        tensor([[6., 0.],
                [0., 6.]])
    """
    _, _, hess = run_operator("hessian", "hessian", f, backend, x, None, contexts, prep)
    return write_out(hess, out, "hessian")


def hessian_from_hvps(backend: Backend, f: BoundFunction, spec: Spec) -> Runner:
    """Generic Hessian: HVPs of the input basis, with the value and gradient from ``inner``."""
    _, inner = outer_inner(backend)
    n = spec.x.numel
    x_shape = tuple(spec.x.shapes[0])
    hvps = build_runner(backend, "hvp", f, replace_spec(spec, n_tangents=n))
    value_and_gradient = build_runner(inner, "gradient", f, replace_spec(spec, n_tangents=0))

    def run(x: Any, _: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any, Any]:
        y, grad = value_and_gradient(x, None, contexts)
        _, columns = hvps(x, spec.x.basis(x), contexts)  # (n, *x_shape): H e_i, a column of H
        return y, grad, columns.reshape(n, n).T.reshape(x_shape + x_shape)

    return run


register_fallback("hessian", hessian_from_hvps)
