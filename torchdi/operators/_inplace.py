"""``y=``: functions that write their output in place, ``f(y, x, *contexts)`` (DI's ``f!(y, x)``).

The operator differentiates ``x -> y`` where ``y`` is a fresh buffer created *inside* the
differentiated function from ``x`` (``x.new_zeros``): under ``vmap`` and the other ``torch.func``
transforms, and under ``torch.compile``, the buffer then lives at the transforms' levels, so
``f``'s in-place writes into it are ordinary traced operations (no write into a tensor captured
from outside a transform). After the call the user's ``y`` receives ``f(x)``.

The wrapper compares equal to another wrapper of the same ``f`` and the same ``y`` layout, so a
``Prep`` serves later calls with the same ``f`` and a ``y`` of the same shape, dtype and device;
it keeps no reference to the user's ``y`` (rule 4).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["OutOfPlace", "in_place", "write_value"]


class OutOfPlace:
    """``f(y, x, *contexts)`` as ``x, *contexts -> y`` with ``y`` a fresh buffer of a fixed layout."""

    def __init__(self, f: Callable[..., Any], shape: torch.Size, dtype: torch.dtype, device: torch.device, operator: str) -> None:
        self.f, self.shape, self.dtype, self.device, self.operator = f, shape, dtype, device, operator
        self.__qualname__ = getattr(f, "__qualname__", None) or repr(f)

    def __call__(self, x: Any, *contexts: Any) -> torch.Tensor:
        # On x's device as the engine runs it (AutoXLA moves x to the XLA device): f's output is
        # made where x is; the user's y= was checked against the user's x.
        buffer = pytree.tree_leaves(x)[0].new_zeros(self.shape, dtype=self.dtype)
        try:
            returned = self.f(buffer, x, *contexts)
        except RuntimeError as error:
            error.add_note(
                f"torchdi note: {self.operator} called f(y, x, *contexts) with y of shape {tuple(self.shape)} and dtype "
                f"{self.dtype} (those of y=): pass a y= of f's output shape and dtype."
            )
            raise
        if returned is not None:
            raise TypeError(
                f"{self.operator}: with y=, f is called as f(y, x, *contexts) and must write its output into y "
                f"and return None; it returned {type(returned).__name__}. Drop y= for a function that returns "
                "its output."
            )
        return buffer

    def _key(self) -> tuple[Any, ...]:
        return (self.shape, self.dtype, self.device)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OutOfPlace) and (other.f is self.f or other.f == self.f) and other._key() == self._key()

    def __hash__(self) -> int:
        return hash((id(self.f), *self._key()))

    def __repr__(self) -> str:
        return (
            f"{self.__qualname__} writing into y= of shape {tuple(self.shape)}, dtype {self.dtype}, "
            f"device {self.device}"
        )


def in_place(f: Callable[..., Any], y: Any, operator: str, has_aux: bool = False, x: Any = None) -> Callable[..., Any]:
    """``f`` itself without ``y=``, else its out-of-place wrapper (after checking ``y`` against ``x``)."""
    if y is None:
        return f
    if has_aux:
        raise TypeError(f"{operator}: y= and has_aux=True do not combine: with y=, f writes into y and returns None")
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"{operator}: y= must be a tensor (f writes its output into it), got {type(y).__name__}")
    if not (y.is_floating_point() or y.is_complex()):
        raise TypeError(f"{operator}: y= must have a floating-point or complex dtype (f's output is differentiated), got {y.dtype}")
    x_tensors = [leaf for leaf in pytree.tree_leaves(x) if isinstance(leaf, torch.Tensor)]
    if x_tensors and x_tensors[0].device != y.device:
        raise ValueError(f"{operator}: y= is on {y.device} but x is on {x_tensors[0].device}; pass y on x's device")
    if isinstance(f, OutOfPlace):
        return f
    return OutOfPlace(f, y.shape, y.dtype, y.device, operator)


def write_value(value: Any, y: torch.Tensor | None) -> Any:
    """Copy ``f(x)`` into the user's ``y`` and return ``y`` (or return ``value`` without ``y=``)."""
    if y is None:
        return value
    with torch.no_grad():
        y.copy_(value)
    return y
