"""``KnownSparsity``: a pattern the user gives (a boolean or sparse tensor, or a numpy array)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from torchdi.sparsity.index_sets import IndexSets

__all__ = ["KnownColoring", "KnownSparsity", "TracedColoring", "known_sparsity"]


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


_MODES = ("forward", "reverse", "mixed", "star", "substitution")


class KnownColoring:
    """A computed sparsity pattern and colouring, as plain data, to reuse without detection or colouring.

    ``prep.known_coloring`` of an ``AutoSparse`` preparation is one; pass it back as
    ``AutoSparse(dense, coloring=known)`` for the same ``f`` (and shapes): preparation then only
    checks that the colouring is valid for its pattern and builds the passes. It pickles, and
    ``to_dict()`` gives tensors, strings and ints that ``torch.save``/``torch.load(weights_only=True)``
    take (``KnownColoring.from_dict`` reads them back).

    Args:
        pattern: the ``(m, n)`` pattern (flattened ``y`` by flattened ``x``; hessians ``(n, n)``,
            symmetric): a sparse CSR/COO tensor (its stored entries), or a dense tensor or numpy
            array (its non-zeros).
        colors: the colours (``-1``: in no pass), an integer tensor or array: of the ``n``
            columns (``mode="forward"``, ``"star"``, ``"substitution"``), of the ``m`` rows
            (``"reverse"``), or a pair ``(column colours, row colours)`` (``"mixed"``, for a
            ``MixedMode`` dense backend).
        mode: ``"forward"``, ``"reverse"``, ``"mixed"`` (jacobians), ``"star"`` or
            ``"substitution"`` (hessians), as ``prep.sparse_mode`` says.

    As with ``KnownSparsity``, an entry missing from the pattern is taken as zero on every call
    (``AutoSparse``'s ``sparsity=`` is not consulted). A colouring that cannot recover every entry
    of the pattern is refused at preparation. Two ``KnownColoring`` with the same data are equal.

    Example::

        >>> prep = torchdi.prepare_jacobian(torch.diff, torchdi.AutoSparse(torchdi.AutoFunc()), torch.ones(5))
        >>> known = prep.known_coloring
        >>> backend = torchdi.AutoSparse(torchdi.AutoFunc(), coloring=known)
        >>> torchdi.prepare_jacobian(torch.diff, backend, torch.ones(5)).ncolors
        2
    """

    __slots__ = ("_hash", "colors", "mode", "sets")

    def __init__(self, pattern: Any, colors: Any, mode: str) -> None:
        if mode not in _MODES:
            raise ValueError(f"KnownColoring: mode must be one of {', '.join(map(repr, _MODES))}, got {mode!r}")
        if isinstance(pattern, IndexSets):
            sets = pattern
        else:
            known = KnownSparsity(pattern)
            if len(known.shape) != 2:
                raise ValueError(f"KnownColoring: pattern must be 2-D (m, n), got shape {known.shape}")
            sets = known.matrix(known.shape[0], known.shape[1])
        m, n = sets.nrows, sets.ncols
        if mode in ("star", "substitution") and m != n:
            raise ValueError(f"KnownColoring: a {mode!r} (hessian) colouring needs a square pattern, got {m} x {n}")
        parts = tuple(colors) if mode == "mixed" and isinstance(colors, (tuple, list)) else (colors,)
        if mode == "mixed" and len(parts) != 2:
            raise ValueError("KnownColoring: mode 'mixed' takes colors=(column colours, row colours)")
        lengths = (n, m) if mode == "mixed" else ((m,) if mode == "reverse" else (n,))
        arrays = []
        for part, length, what in zip(parts, lengths, ("colors" if mode != "mixed" else "column colours", "row colours")):
            array = np.asarray(part.detach().cpu() if isinstance(part, torch.Tensor) else part)
            if array.dtype.kind not in "iu" or array.shape != (length,) or (array.size and array.min() < -1):
                raise ValueError(
                    f"KnownColoring: {what} must be {length} integers >= -1 (one per "
                    f"{'row' if what == 'row colours' or mode == 'reverse' else 'column'}), got "
                    f"{array.dtype} of shape {array.shape}"
                )
            arrays.append(array.astype(np.int64).copy())
        self.sets = sets
        self.colors: tuple[np.ndarray, ...] = tuple(arrays)
        self.mode = mode
        self._hash = hash((m, n, sets.nnz, mode, tuple(a.tobytes() for a in arrays)))

    @property
    def shape(self) -> tuple[int, int]:
        return (self.sets.nrows, self.sets.ncols)

    @property
    def ncolors(self) -> int:
        """The number of compressed passes."""
        return sum(int(c.max(initial=-1)) + 1 for c in self.colors)

    def to_dict(self) -> dict[str, Any]:
        """Tensors, strings and ints only (``torch.load(weights_only=True)`` reads them back)."""
        return {
            "shape": list(self.shape),
            "crow_indices": torch.from_numpy(self.sets.indptr.copy()),
            "col_indices": torch.from_numpy(self.sets.indices.copy()),
            "colors": [torch.from_numpy(c.copy()) for c in self.colors],
            "mode": self.mode,
        }

    @staticmethod
    def from_dict(data: dict[str, Any]) -> KnownColoring:
        """The ``KnownColoring`` that ``to_dict`` described."""
        try:
            m, n = (int(s) for s in data["shape"])
            indptr = np.asarray(data["crow_indices"], dtype=np.int64)
            indices = np.asarray(data["col_indices"], dtype=np.int64)
            colors, mode = list(data["colors"]), str(data["mode"])
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"KnownColoring.from_dict: not a KnownColoring.to_dict() result ({error})") from None
        valid = (
            indptr.shape == (m + 1,) and indptr[0] == 0 and np.all(np.diff(indptr) >= 0) and indptr[-1] == indices.size
            and (indices.size == 0 or (indices.min() >= 0 and indices.max() < n))
        )
        if not valid:
            raise ValueError("KnownColoring.from_dict: crow_indices/col_indices do not form an (m, n) CSR pattern")
        rows = np.repeat(np.arange(m, dtype=np.int64), np.diff(indptr))
        sets = IndexSets.from_pairs(rows, indices, m, n)
        return KnownColoring(sets, colors if mode == "mixed" else colors[0], mode)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KnownColoring):
            return NotImplemented
        return (
            self.mode == other.mode
            and self.sets == other.sets
            and len(self.colors) == len(other.colors)
            and all(np.array_equal(a, b) for a, b in zip(self.colors, other.colors))
        )

    def __hash__(self) -> int:
        return self._hash

    def __getstate__(self) -> dict[str, Any]:
        return self.to_dict()

    def __setstate__(self, state: dict[str, Any]) -> None:
        restored = KnownColoring.from_dict(state)
        for name in KnownColoring.__slots__:
            object.__setattr__(self, name, getattr(restored, name))

    def __repr__(self) -> str:
        m, n = self.shape
        return f"KnownColoring(shape=({m}, {n}), nnz={self.sets.nnz}, mode={self.mode!r}, ncolors={self.ncolors})"


class TracedColoring(KnownColoring):
    """A ``KnownColoring`` torchdi made from a pattern it traced, with the colouring settings it
    came from (``coloring``): a ``strict=False`` preparation for another dtype or device of ``x``
    reuses its preparation's pattern and colours this way. Unlike a ``KnownColoring`` a user
    passes (their promise for every call), it is watched as the traced pattern it came from is,
    and traced and coloured again with ``coloring`` when what ``f`` reads changes."""

    __slots__ = ("coloring",)

    def __init__(self, known: KnownColoring, coloring: Any) -> None:
        self.sets, self.colors, self.mode = known.sets, known.colors, known.mode
        self.coloring = coloring
        self._hash = hash((known._hash, coloring))

    def __eq__(self, other: object) -> bool:
        # Never equal to a user's KnownColoring of the same data: backends holding them are
        # cached apart, and only this one is watched.
        if not isinstance(other, KnownColoring):
            return NotImplemented
        return isinstance(other, TracedColoring) and KnownColoring.__eq__(self, other) is True and self.coloring == other.coloring

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"Traced{KnownColoring.__repr__(self)[:-1]}, coloring={self.coloring!r})"
