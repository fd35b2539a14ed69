"""``MixedMode(forward, reverse)``: forward-mode families from ``forward``, reverse-mode ones from
``reverse``; the dense jacobian from whichever needs fewer passes (the generic jacobian, which
picks by size when both modes are native); second order as ``SecondOrder(forward, reverse)``.

Bidirectional colouring of sparse jacobians is ``AutoSparse``'s (``engines/sparse.py``): it builds
this engine's pushforward and pullback runners on the column and row seeds.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torchdi.backends import MixedMode, SecondOrder
from torchdi.families import ALL_FAMILIES
from torchdi.runners import build_runner, engine_for, register_engine

__all__ = ["MixedModeEngine"]

_FORWARD = frozenset({"pushforward", "derivative"})
_REVERSE = frozenset({"pullback", "gradient"})
_SECOND = frozenset({"hvp", "hessian", "second_derivative"})


class MixedModeEngine:
    """Delegates each family to the backend whose mode computes it."""

    native: ClassVar[frozenset[str]] = ALL_FAMILIES

    def __init__(self, backend: MixedMode) -> None:
        self.backend = backend
        self.keeps_static = engine_for(backend.forward).keeps_static or engine_for(backend.reverse).keeps_static

    def build(self, family: str, f: Any, spec: Any) -> Any:
        if family in _FORWARD:
            return build_runner(self.backend.forward, family, f, spec)
        if family in _REVERSE:
            return build_runner(self.backend.reverse, family, f, spec)
        if family in _SECOND:
            return build_runner(SecondOrder(self.backend.forward, self.backend.reverse), family, f, spec)
        return None  # jacobian: the generic one, columns or rows by size


register_engine(MixedMode, MixedModeEngine)
