"""``SecondOrder(outer, inner)``: first-order operators from ``inner``, second-order ones composed."""

from __future__ import annotations

from typing import Any, ClassVar

from torchdi.backends import SecondOrder
from torchdi.families import FIRST_ORDER
from torchdi.runners import build_runner, engine_for, register_engine

__all__ = ["SecondOrderEngine"]


class SecondOrderEngine:
    """Delegates first-order families to ``inner``; second-order ones use the generic fallbacks,
    which compose ``outer``'s forward/reverse mode over ``inner``'s first-order runner."""

    native: ClassVar[frozenset[str]] = FIRST_ORDER

    def __init__(self, backend: SecondOrder) -> None:
        self.backend = backend
        # A compiled outer or inner bakes static leaves in, so the strict check must see them.
        self.keeps_static = engine_for(backend.outer).keeps_static or engine_for(backend.inner).keeps_static

    def build(self, family: str, f: Any, spec: Any) -> Any:
        if family in FIRST_ORDER:
            return build_runner(self.backend.inner, family, f, spec)
        return None


register_engine(SecondOrder, SecondOrderEngine)
