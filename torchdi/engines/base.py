"""What the engines share (the ``Engine`` protocol itself lives in ``torchdi.runners``)."""

from __future__ import annotations

from typing import Any

from torch.utils import _pytree as pytree

# Every operator family; engines that wrap another backend's runners (compile, xla) build them all.
from torchdi.families import ALL_FAMILIES
from torchdi.runners import Engine

__all__ = ["ALL_FAMILIES", "Engine", "like_primal"]


def like_primal(tangent: Any, primal: Any) -> Any:
    """``tangent`` in the dtypes of ``primal``: forward-mode AD (dual tensors, ``torch.func.jvp``)
    promotes the tangent of a 0-d float32 tensor times a Python float to float64, losing the
    wrapped-number rule that keeps the primal float32."""
    return pytree.tree_map(lambda t, p: t if t.dtype == p.dtype else t.to(p.dtype), tangent, primal)
