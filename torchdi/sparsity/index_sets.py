"""Index sets: one set of input indices per element of a tensor, stored as a boolean CSR matrix.

``IndexSets`` is what the tracer propagates (row ``i``: the flat input indices that element ``i``
of a tensor may depend on) and what colouring consumes (a sparsity pattern). Every operation is
vectorised with numpy: building the pattern of a 10^5-element banded map takes milliseconds.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

__all__ = ["IndexSets", "quiet_sparse_csr"]


@contextmanager
def quiet_sparse_csr() -> Iterator[None]:
    """Silence torch's "Sparse CSR tensor support is in beta state" warning (and torch 2.11's
    "Sparse invariant checks are implicitly disabled", printed even with ``check_invariants=False``)
    around torchdi's own construction of CSR tensors (a user's own CSR code still sees them)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state")
        warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled")
        yield


@dataclass(frozen=True, eq=False)
class IndexSets:
    """A boolean sparse matrix in CSR form: ``indices[indptr[i]:indptr[i + 1]]`` is row ``i``.

    Rows hold sorted, distinct column indices (every constructor here keeps that invariant).
    """

    indptr: np.ndarray
    indices: np.ndarray
    ncols: int

    @property
    def nrows(self) -> int:
        return len(self.indptr) - 1

    @property
    def nnz(self) -> int:
        return int(self.indptr[-1])

    @cached_property
    def row_lengths(self) -> np.ndarray:
        return self.indptr[1:] - self.indptr[:-1]

    @cached_property
    def width(self) -> int:
        """The length every row has, or ``-1`` when the lengths differ. Uniform sets (an identity,
        its slices, a stencil's interior) take the fast paths of ``take`` and ``union``: rows as
        one ``(nrows, width)`` block, no per-entry offsets."""
        nrows = self.nrows
        if nrows == 0 or self.nnz == 0:
            return 0
        width, rest = divmod(self.nnz, nrows)
        if rest or not np.array_equal(self.indptr, np.arange(0, (nrows + 1) * width, width, dtype=np.int64)):
            return -1
        return width

    @staticmethod
    def uniform(block: np.ndarray, ncols: int) -> IndexSets:
        """The sets whose row ``i`` is ``block[i]`` (a ``(nrows, width)`` array of sorted, distinct indices per row)."""
        nrows, width = block.shape
        sets = IndexSets(np.arange(0, (nrows + 1) * width, width, dtype=np.int64) if width else np.zeros(nrows + 1, dtype=np.int64),
                         block.reshape(-1), ncols)
        sets.__dict__["width"] = width  # known: what the cached property would compute
        return sets

    @staticmethod
    def empty(nrows: int, ncols: int) -> IndexSets:
        return IndexSets(np.zeros(nrows + 1, dtype=np.int64), np.zeros(0, dtype=np.int64), ncols)

    @staticmethod
    def identity(n: int) -> IndexSets:
        return IndexSets.uniform(np.arange(n, dtype=np.int64).reshape(n, 1), n)

    @staticmethod
    def full(nrows: int, ncols: int) -> IndexSets:
        return IndexSets(np.arange(nrows + 1, dtype=np.int64) * ncols, np.tile(np.arange(ncols, dtype=np.int64), nrows), ncols)

    @staticmethod
    def from_pairs(rows: np.ndarray, cols: np.ndarray, nrows: int, ncols: int) -> IndexSets:
        """The sets holding each ``(row, col)`` pair (duplicates allowed, order free)."""
        rows = np.asarray(rows, dtype=np.int64)
        cols = np.asarray(cols, dtype=np.int64)
        if rows.size == 0:
            return IndexSets.empty(nrows, ncols)
        # np.sort then drop repeats: numpy 2.x's np.unique is hash-based and far slower here.
        keys = np.sort(rows * max(ncols, 1) + cols, kind="stable")  # timsort: pairs come in sorted runs
        if keys.size > 1:
            keys = keys[np.concatenate(([True], keys[1:] != keys[:-1]))]
        rows, cols = np.divmod(keys, max(ncols, 1))
        indptr = np.zeros(nrows + 1, dtype=np.int64)
        np.cumsum(np.bincount(rows, minlength=nrows), out=indptr[1:])
        return IndexSets(indptr, cols, ncols)

    @staticmethod
    def from_dense(mask: np.ndarray | torch.Tensor) -> IndexSets:
        """The non-zeros of a 2-D array."""
        mask = np.asarray(mask.detach().cpu() if isinstance(mask, torch.Tensor) else mask) != 0
        rows, cols = np.nonzero(mask)
        indptr = np.zeros(mask.shape[0] + 1, dtype=np.int64)
        np.cumsum(np.bincount(rows, minlength=mask.shape[0]), out=indptr[1:])
        return IndexSets(indptr, cols.astype(np.int64), int(mask.shape[1]))

    def row_ids(self) -> np.ndarray:
        """The row of each stored index."""
        return np.repeat(np.arange(self.nrows, dtype=np.int64), self.row_lengths)

    def take(self, rows: np.ndarray) -> IndexSets:
        """Row ``i`` of the result is row ``rows[i]`` of ``self`` (the empty set where ``rows[i] < 0``)."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        width = self.width
        if width > 0 and rows.size and rows.min() >= 0:  # one gather of whole rows
            return IndexSets.uniform(self.indices.reshape(-1, width)[rows], self.ncols)
        valid = rows >= 0
        safe = np.where(valid, rows, 0)
        lengths = np.where(valid, self.indptr[safe + 1] - self.indptr[safe], 0)
        indptr = np.zeros(rows.size + 1, dtype=np.int64)
        np.cumsum(lengths, out=indptr[1:])
        total = int(indptr[-1])
        offsets = np.repeat(self.indptr[safe] - indptr[:-1], lengths)
        return IndexSets(indptr, self.indices[offsets + np.arange(total, dtype=np.int64)], self.ncols)

    def group(self, owner: np.ndarray, nrows: int) -> IndexSets:
        """Row ``r`` of the result is the union of the rows ``i`` with ``owner[i] == r`` (``owner[i] < 0``: dropped)."""
        owner = np.asarray(owner, dtype=np.int64).reshape(-1)
        rows = owner[self.row_ids()]
        keep = rows >= 0
        return IndexSets.from_pairs(rows[keep], self.indices[keep], nrows, self.ncols)

    def compose(self, sources: IndexSets) -> IndexSets:
        """``self`` maps each row to rows of ``sources``; the result is the union of those rows (a boolean product)."""
        return sources.take(self.indices).group(self.row_ids(), self.nrows)

    @staticmethod
    def union(parts: list[IndexSets]) -> IndexSets:
        """Row-wise union of sets with the same number of rows."""
        nonempty = [p for p in parts if p.nnz]
        if len(nonempty) <= 1:
            return nonempty[0] if nonempty else parts[0]
        widths = [p.width for p in nonempty]
        if min(widths) > 0:  # uniform parts: sort each row of their side-by-side blocks, drop repeats
            block = np.concatenate([p.indices.reshape(-1, w) for p, w in zip(nonempty, widths)], axis=1)
            block.sort(axis=1)
            distinct = np.empty(block.shape, dtype=bool)
            distinct[:, 0] = True
            np.not_equal(block[:, 1:], block[:, :-1], out=distinct[:, 1:])
            if distinct.all():
                return IndexSets.uniform(block, parts[0].ncols)
            indptr = np.zeros(block.shape[0] + 1, dtype=np.int64)
            np.cumsum(distinct.sum(axis=1), out=indptr[1:])
            return IndexSets(indptr, block[distinct], parts[0].ncols)
        rows = np.concatenate([p.row_ids() for p in nonempty])
        cols = np.concatenate([p.indices for p in nonempty])
        return IndexSets.from_pairs(rows, cols, parts[0].nrows, parts[0].ncols)

    @staticmethod
    def stack(parts: list[IndexSets]) -> IndexSets:
        """Rows of ``parts[0]``, then rows of ``parts[1]``, ..."""
        lengths = np.concatenate([p.row_lengths for p in parts])
        indptr = np.zeros(lengths.size + 1, dtype=np.int64)
        np.cumsum(lengths, out=indptr[1:])
        return IndexSets(indptr, np.concatenate([p.indices for p in parts]), parts[0].ncols)

    def transpose(self) -> IndexSets:
        """The sets of the transposed matrix (computed once per object: sets are never changed in place)."""
        cached = self.__dict__.get("_transposed")
        if cached is None:
            cached = self.__dict__["_transposed"] = IndexSets.from_pairs(self.indices, self.row_ids(), self.ncols, self.nrows)
        return cached

    def to_dense(self) -> np.ndarray:
        dense = np.zeros((self.nrows, self.ncols), dtype=bool)
        dense[self.row_ids(), self.indices] = True
        return dense

    def to_torch(self) -> torch.Tensor:
        """A sparse boolean CSR tensor of shape ``(nrows, ncols)``."""
        with quiet_sparse_csr():
            return torch.sparse_csr_tensor(
                torch.from_numpy(self.indptr.copy()),
                torch.from_numpy(self.indices.copy()),
                torch.ones(self.nnz, dtype=torch.bool),
                (self.nrows, self.ncols),
                check_invariants=False,
            )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, IndexSets):
            return NotImplemented
        return (
            self.ncols == other.ncols
            and np.array_equal(self.indptr, other.indptr)
            and np.array_equal(self.indices, other.indices)
        )

    __hash__ = None  # type: ignore[assignment]
