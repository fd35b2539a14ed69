"""Pytree ``x`` and pytree ``f(x)`` for ``jacobian`` and ``hessian``, in ``torch.func``'s layout.

Engines compute dense jacobians and hessians of tensor-to-tensor functions. A pytree ``x`` (or a
pytree output) is flattened into one vector (the leaves raveled and concatenated, in their
promoted dtype); the engine differentiates the flat function (the flattening is inside the
differentiated function, so compiled backends trace it into their one program), and the flat
result is cut back into blocks nested as ``torch.func.jacrev``/``torch.func.hessian`` nest them:
the outer level ``y``'s structure, then ``x``'s (twice for a hessian), each leaf
``y_leaf.shape + x_leaf.shape (+ x_leaf.shape)``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import reduce
from typing import Any

import torch
from torch.utils import _pytree as pytree

from torchdi.runners import BoundFunction, Runner

__all__ = ["Flattening", "needs_flattening"]


def needs_flattening(family: str, x: Any, y: Any) -> bool:
    """Whether ``family`` must flatten ``x`` or ``y`` before an engine sees them."""
    return family in ("jacobian", "hessian") and not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor))


class _Raveler:
    """Ravel a tensor pytree into one vector and back (each leaf keeps its own dtype)."""

    def __init__(self, tree: Any, what: str, operator: str) -> None:
        leaves, self.spec = pytree.tree_flatten(tree)
        self.is_tensor = isinstance(tree, torch.Tensor)
        self.shapes = [leaf.shape for leaf in leaves]
        self.dtypes = [leaf.dtype for leaf in leaves]
        self.sizes = [leaf.numel() for leaf in leaves]
        self.dtype = reduce(torch.promote_types, self.dtypes)
        devices = {leaf.device for leaf in leaves}
        if len(devices) > 1:
            raise ValueError(
                f"{operator}: the tensors of {what} must be on one device to be differentiated together, "
                f"got {sorted(str(d) for d in devices)}"
            )

    def ravel(self, tree: Any) -> torch.Tensor:
        leaves = pytree.tree_leaves(tree)
        return torch.cat([leaf.reshape(-1).to(self.dtype) for leaf in leaves])

    def unravel(self, flat: torch.Tensor) -> Any:
        pieces = torch.split(flat, self.sizes, dim=-1)
        leaves = [p.reshape((*flat.shape[:-1], *s)).to(d) for p, s, d in zip(pieces, self.shapes, self.dtypes)]
        return pytree.tree_unflatten(leaves, self.spec)

    def blocks(self, flat: torch.Tensor, lead: int, inner: Callable[[torch.Tensor], Any]) -> Any:
        """Cut axis ``lead`` of ``flat`` (this tree's raveled axis) into leaves; ``inner`` nests each block."""
        pieces = torch.split(flat, self.sizes, dim=lead)
        leaves = [inner(p.reshape((*p.shape[:lead], *s, *p.shape[lead + 1 :]))) for p, s in zip(pieces, self.shapes)]
        return pytree.tree_unflatten(leaves, self.spec)


class Flattening:
    """The flat function an engine differentiates, and the way back to the nested result."""

    def __init__(self, family: str, x: Any, y: Any, operator: str) -> None:
        self.family = family
        self.x = _Raveler(x, "x", operator)
        self.x_is_tensor = isinstance(x, torch.Tensor)
        self.y = None if isinstance(y, torch.Tensor) else _Raveler(y, "f(x)", operator)
        self.scalar = isinstance(y, torch.Tensor) and y.numel() == 1

    def flat_x(self, x: Any) -> torch.Tensor:
        return x if self.x_is_tensor else self.x.ravel(x)

    def flat_y(self, y: Any) -> torch.Tensor:
        return y if self.y is None else self.y.ravel(y)

    def function(self, f: BoundFunction) -> BoundFunction:
        x_is_tensor, x_raveler, y_raveler = self.x_is_tensor, self.x, self.y

        def flat(x_flat: torch.Tensor, contexts: tuple[Any, ...]) -> Any:
            y = f(x_flat if x_is_tensor else x_raveler.unravel(x_flat), contexts)
            return y if y_raveler is None else y_raveler.ravel(y)

        flat.function_name = getattr(f, "function_name", repr(f))  # type: ignore[attr-defined]
        return flat

    def _nest_x(self, flat: torch.Tensor, lead: int) -> Any:
        """Cut the last axis (``x`` raveled) of a derivative whose leading ``lead`` axes index ``y``."""
        if self.x_is_tensor:
            return flat.reshape((*flat.shape[:lead], *self.x.shapes[0]))
        return self.x.blocks(flat, lead, lambda block: block)

    def _nest_xx(self, flat: torch.Tensor, lead: int) -> Any:
        if self.x_is_tensor:
            shape = self.x.shapes[0]
            return flat.reshape((*flat.shape[:lead], *shape, *shape))
        return self.x.blocks(flat, lead, lambda block: self.x.blocks(block, block.dim() - 1, lambda b: b))

    def nest(self, result: tuple[Any, ...]) -> tuple[Any, ...]:
        if self.family == "jacobian":
            y, jac = result
            return self._value(y), self._nest_jacobian(jac)
        y, grad, hess = result
        if self.scalar:  # grad shaped like x, hess like x by x: no y axes
            return y, self._nest_x(grad.reshape(-1), 0), self._nest_xx(hess.reshape(grad.numel(), grad.numel()), 0)
        return self._value(y), self._nest_jacobian(grad), self._nest_hessian(hess)

    def _value(self, y: Any) -> Any:
        return y if self.y is None else self.y.unravel(y)

    def _nest_jacobian(self, jac: torch.Tensor) -> Any:
        if self.y is None:
            return self._nest_x(jac, jac.dim() - 1)
        return self.y.blocks(jac, 0, lambda block: self._nest_x(block, block.dim() - 1))

    def _nest_hessian(self, hess: torch.Tensor) -> Any:
        if self.y is None:
            return self._nest_xx(hess, hess.dim() - 2)
        return self.y.blocks(hess, 0, lambda block: self._nest_xx(block, block.dim() - 2))

    def runner(self, inner: Runner) -> Runner:
        return _FlatRunner(inner, self)


class _FlatRunner:
    """A runner over a pytree ``x``: ravels it, runs the flat runner, nests the result.

    What the flat runner publishes (``num_compilations``, ``path``, ``published``) reads through.
    """

    def __init__(self, inner: Runner, flattening: Flattening) -> None:
        self.inner = inner
        self.flattening = flattening
        checked = getattr(inner, "checked_call", None)
        if checked is not None:
            self.checked_call = self._wrap(checked)

    def _wrap(self, call: Runner) -> Runner:
        flattening = self.flattening

        def run(x: Any, tangents: Any, contexts: tuple[Any, ...]) -> tuple[Any, ...]:
            return flattening.nest(call(flattening.flat_x(x), tangents, contexts))

        return run

    def __call__(self, x: Any, tangents: Any, contexts: tuple[Any, ...]) -> tuple[Any, ...]:
        return self.flattening.nest(self.inner(self.flattening.flat_x(x), tangents, contexts))

    def __getattr__(self, name: str) -> Any:
        if name in ("inner", "flattening", "checked_call"):
            raise AttributeError(name)
        return getattr(self.inner, name)
