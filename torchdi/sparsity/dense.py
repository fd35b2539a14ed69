"""``DenseSparsity``: the pattern of a dense jacobian (or hessian) at the preparation point.

Local only: an entry that happens to be zero at that point (``x * y`` at ``y = 0``, a ReLU
below its kink) is left out of the pattern, and every later call assumes it stays zero. Use
it for black-box functions the tracer cannot see into, at a generic point.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from torchdi.runners import BoundFunction, Spec, build_runner
from torchdi.sparsity.index_sets import IndexSets

__all__ = ["DenseSparsity", "dense_sparsity"]


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
        from torchdi.backends import _BACKEND_TYPES

        if self.backend is not None and not isinstance(self.backend, _BACKEND_TYPES):
            raise TypeError(f"DenseSparsity: backend must be None or a torchdi backend, got {self.backend!r}")
        if not isinstance(self.atol, (int, float)) or self.atol < 0:
            raise ValueError(f"DenseSparsity: atol must be a non-negative number, got {self.atol!r}")


def dense_sparsity(
    detector: DenseSparsity, default: Any, f: BoundFunction, spec: Spec, x: torch.Tensor, contexts: tuple[Any, ...], hessian: bool
) -> IndexSets:
    """The non-zeros (above ``atol``) of the dense jacobian (``hessian``: hessian) at ``x``, flattened."""
    from torchdi.backends import AutoCompile, AutoXLA

    backend = detector.backend
    if backend is None:
        backend = default
        while isinstance(backend, (AutoCompile, AutoXLA)):
            backend = backend.inner
    runner = build_runner(backend, "hessian" if hessian else "jacobian", f, spec)
    warm_up = getattr(runner, "warm_up", None)
    if warm_up is not None:
        warm_up(x, None, contexts)
    matrix = runner(x, None, contexts)[-1]
    rows = spec.x.numel if hessian else spec.y.numel
    return IndexSets.from_dense((matrix.detach().reshape(rows, spec.x.numel).abs() > detector.atol).cpu())
