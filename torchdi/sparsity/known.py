"""``KnownSparsity``: a pattern the user gives (a boolean or sparse tensor, or a numpy array)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from torchdi.sparsity.index_sets import IndexSets

__all__ = ["KnownSparsity", "known_sparsity"]


class KnownSparsity:
    """A sparsity pattern given by the user.

    Args:
        pattern: the structural non-zeros, as a dense tensor or numpy array (non-zero entries
            count), or a sparse COO/CSR tensor (its stored entries count, even explicit zeros).
            Shape ``(y.numel(), x.numel())`` or ``y.shape + x.shape`` for jacobians, ``(n, n)``
            or ``x.shape + x.shape`` for hessians (symmetrised).

    A missing entry is taken as zero on every call: a wrong pattern gives wrong results.
    The pattern is copied; two ``KnownSparsity`` with the same pattern are equal.
    """

    __slots__ = ("_hash", "mask", "sets", "shape")

    def __init__(self, pattern: Any) -> None:
        if isinstance(pattern, np.ndarray):
            pattern = torch.from_numpy(pattern)
        if not isinstance(pattern, torch.Tensor):
            raise TypeError(f"KnownSparsity: pattern must be a tensor (dense or sparse) or a numpy array, got {type(pattern).__name__}")
        self.shape = tuple(pattern.shape)
        if pattern.layout in (torch.sparse_csr, torch.sparse_coo, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc):
            coo = pattern.to_sparse_coo().coalesce() if pattern.layout != torch.sparse_coo else pattern.coalesce()
            index = coo.indices()
            flat_cols = int(np.prod(self.shape[1:])) if len(self.shape) > 1 else 1
            if coo.dim() == 2:
                rows, cols = index[0].numpy(), index[1].numpy()
            else:
                raise ValueError(f"KnownSparsity: a sparse pattern must be 2-D, got shape {self.shape}")
            self.sets: IndexSets | None = IndexSets.from_pairs(rows, cols, self.shape[0], flat_cols)
            self.mask: np.ndarray | None = None
        else:
            if pattern.dim() < 2:
                raise ValueError(f"KnownSparsity: pattern must have at least two dimensions, got shape {self.shape}")
            self.sets = None
            self.mask = (pattern.detach().cpu() != 0).numpy().copy()
        nnz = self.sets.nnz if self.sets is not None else int(self.mask.sum())  # type: ignore[union-attr]
        self._hash = hash((self.shape, nnz))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KnownSparsity):
            return NotImplemented
        if self.shape != other.shape:
            return False
        if self.mask is not None and other.mask is not None:
            return bool(np.array_equal(self.mask, other.mask))
        return self.matrix(self.shape[0], -1) == other.matrix(other.shape[0], -1)

    def matrix(self, m: int, n: int) -> IndexSets:
        """The pattern as an ``m x n`` index-set matrix (``n=-1``: whatever the size implies)."""
        if self.sets is not None:
            return self.sets
        assert self.mask is not None
        return IndexSets.from_dense(self.mask.reshape(m, n))

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"KnownSparsity(shape={self.shape}, nnz={self.matrix(self.shape[0], -1).nnz})"


def known_sparsity(detector: KnownSparsity, m: int, n: int, y_shape: tuple[int, ...], x_shape: tuple[int, ...], hessian: bool) -> IndexSets:
    """The user's pattern as an ``(m, n)`` index-set matrix, checked against the problem's shapes."""
    accepted = list(dict.fromkeys([(m, n), tuple(y_shape) + tuple(x_shape)]))  # one, when x and y are 1-D
    if detector.shape not in accepted:
        what = "hessian" if hessian else "jacobian"
        raise ValueError(
            f"KnownSparsity: the pattern has shape {detector.shape}, but this {what} is {m} x {n}: "
            f"expected shape {' or '.join(str(shape) for shape in accepted)}"
        )
    sets = detector.matrix(m, n)
    if hessian:  # the hessian is symmetric: an entry given on one side holds on both
        sets = IndexSets.union([sets, sets.transpose()])
    return sets
