"""The engine interface shared by all backends."""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

from torch.utils import _pytree as pytree

# Every operator family; engines that wrap another backend's runners (compile, xla) build them all.
from torchdi.families import ALL_FAMILIES

__all__ = ["ALL_FAMILIES", "Engine", "like_primal"]


class Engine(Protocol):
    """What ``torchdi.operators`` asks of a backend's engine.

    Attributes:
        native: the operator families the engine builds itself; the others come from the
            generic fallbacks (which use this set to pick forward or reverse mode).
        keeps_static: whether static leaves (ints, strings, objects) are baked into what the
            engine builds, so that the strict check must compare their values.
    """

    native: ClassVar[frozenset[str]]

    @property
    def keeps_static(self) -> bool:
        """Whether static leaves are baked into what the engine builds."""
        ...

    def build(self, family: str, f: Any, spec: Any) -> Any:
        """A runner ``(x, batched_tangents, context_values) -> full result``, or ``None``."""
        ...


def like_primal(tangent: Any, primal: Any) -> Any:
    """``tangent`` in the dtypes of ``primal``: forward-mode AD (dual tensors, ``torch.func.jvp``)
    promotes the tangent of a 0-d float32 tensor times a Python float to float64, losing the
    wrapped-number rule that keeps the primal float32."""
    return pytree.tree_map(lambda t, p: t if t.dtype == p.dtype else t.to(p.dtype), tangent, primal)
