"""``DenseSparsity``: the pattern of a dense jacobian (or hessian) at the preparation point.

Local only: an entry that happens to be zero at that point (``x * y`` at ``y = 0``, a ReLU
below its kink) is left out of the pattern, and every later call assumes it stays zero. Use
it for black-box functions the tracer cannot see into, at a generic point.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["DenseSparsity"]


@dataclass(frozen=True)
class DenseSparsity:
    """Detect the pattern from a dense jacobian/hessian at the preparation point (local).

    Args:
        backend: the torchdi backend that computes the dense matrix once; ``None`` uses the
            ``AutoSparse``'s dense backend (its eager inner backend for ``AutoCompile``/``AutoXLA``,
            so that detection compiles nothing).
        atol: entries with ``|value| <= atol`` count as zeros.

    The pattern is only valid near the preparation point: entries that vanish there by accident
    are dropped for good. ``TracerSparsity`` gives a pattern valid everywhere.
    """

    backend: Any = None
    atol: float = 0.0

    def __post_init__(self) -> None:
        # sparsity/ is the bottom floor and cannot import torchdi.backends (which imports it):
        # a torchdi backend is recognised by its module. AutoSparse checks the class itself, and
        # the detection (which builds the backend's runner) lives in torchdi/engines/sparse.py.
        if self.backend is not None and type(self.backend).__module__ != "torchdi.backends":
            raise TypeError(f"DenseSparsity: backend must be None or a torchdi backend, got {self.backend!r}")
        if not isinstance(self.atol, (int, float)) or self.atol < 0:
            raise ValueError(f"DenseSparsity: atol must be a non-negative number, got {self.atol!r}")
