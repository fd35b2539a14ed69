"""What the engines share (the ``Engine`` protocol itself lives in ``torchdi.runners``)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

# Every operator family; engines that wrap another backend's runners (compile, xla) build them all.
from torchdi.families import ALL_FAMILIES
from torchdi.runners import Engine

__all__ = ["ALL_FAMILIES", "Engine", "like_primal", "overlaps_itself"]


def like_primal(tangent: Any, primal: Any) -> Any:
    """``tangent`` in the dtypes of ``primal``: forward-mode AD (dual tensors, ``torch.func.jvp``)
    promotes the tangent of a 0-d float32 tensor times a Python float to float64, losing the
    wrapped-number rule that keeps the primal float32."""
    return pytree.tree_map(lambda t, p: t if t.dtype == p.dtype else t.to(p.dtype), tangent, primal)


def overlaps_itself(t: torch.Tensor) -> bool:
    """Whether elements of ``t`` may share memory: an ``expand``ed tensor (stride 0), or an
    ``as_strided`` view whose strides overlap.

    ``torch.func``'s forward mode refuses such a primal ("more than one element of the written-to
    tensor refers to a single memory location": ``make_dual`` writes the tangent into ``x``'s
    layout), so ``canonical_x`` hands runners a contiguous copy of such an ``x`` (the user's is
    untouched), and ``AutoFunc`` one of such a context tensor it makes a primal. Sufficient test on the dimensions of more than one element sorted by stride: each stride at
    least spans the dimensions below it. A layout that fails it without overlapping only costs
    a copy.
    """
    span = 1
    for stride, size in sorted((st, n) for st, n in zip(t.stride(), t.shape) if n > 1):
        if stride < span:
            return t.numel() > 1
        span = stride * size
    return False
