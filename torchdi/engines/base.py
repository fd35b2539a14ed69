"""The engine interface shared by all backends."""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

__all__ = ["Engine"]


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
