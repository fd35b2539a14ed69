"""Decompression: the seeds of the compressed passes, and how to read every stored entry of the
pattern back from their results.

A preparation turns a colouring into a ``Recovery`` (numpy, built once): positions in the flat
compressed products (the passes' results concatenated, each ``(ncolors, length)`` flattened) of
the values read directly, and for substitution the signed tree sums that solve the others.
``TorchRecovery`` holds it as tensors on one device and runs it with ``index_select`` and one
``cumsum``: no Python per entry, traceable by ``torch.compile``. ``csr`` wraps the values and
the result's own copy of the pattern's index tensors without re-validating them.

- Columns (forward passes): entry ``(i, j)`` sits at ``(c(j), i)`` of the ``(ncolors, m)`` JVPs.
- Rows (reverse passes): ``(i, j)`` at ``(c(i), j)`` of the ``(ncolors, n)`` VJPs.
- Bidirectional (``MixedMode``): from the forward pass of ``j``'s colour when ``j`` is the only
  column of that colour in row ``i``, else from the reverse pass of ``i``'s colour.
- Star (hessian, direct): ``H[i, j]`` from HVP ``c(j)`` at row ``i`` when no other neighbour of
  ``i`` has that colour, else from HVP ``c(i)`` at row ``j``.
- Substitution (hessian, acyclic colouring): the edges between two colours form a forest. Root
  each tree; for a vertex ``d`` with parent ``p``, HVP ``c(p)`` at row ``d`` is ``H[d, p]`` plus
  ``H[d, k]`` over the children ``k`` of ``d``, so ``H[i, p]`` is the alternating sum over the
  subtree of ``i`` of those HVP entries: a difference of two prefix sums in DFS order (summed in
  float64 for float32 and half inputs).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from torchdi.sparsity.coloring import adjacency
from torchdi.sparsity.index_sets import IndexSets, quiet_sparse_csr

__all__ = [
    "Recovery",
    "TorchRecovery",
    "bidirectional_recovery",
    "csr",
    "jacobian_recovery",
    "quiet_sparse_csr",
    "seeds",
    "star_recovery",
    "substitution_recovery",
]


@dataclass(frozen=True)
class Recovery:
    """How to read the stored entries of a pattern (CSR order) from the flat compressed products.

    Attributes:
        direct: positions of the values read directly.
        terms, signs: substitution only: the positions of the tree terms in DFS order, with their
            signs; ``starts``/``stops``/``solved_signs``: each solved value is
            ``solved_signs * sum(signs * flat[terms])[starts:stops]``.
        order: where each value of ``[direct values, solved values]`` goes in CSR order
            (``None``: there are no solved values and the direct ones are in CSR order).
    """

    direct: np.ndarray
    terms: np.ndarray | None = None
    signs: np.ndarray | None = None
    starts: np.ndarray | None = None
    stops: np.ndarray | None = None
    solved_signs: np.ndarray | None = None
    order: np.ndarray | None = None


def jacobian_recovery(pattern: IndexSets, colors: np.ndarray, by_rows: bool) -> Recovery:
    """Direct recovery from column (forward, ``(ncolors, m)``) or row (reverse, ``(ncolors, n)``) passes."""
    rows, cols = pattern.row_ids(), pattern.indices
    if by_rows:
        return Recovery(colors[rows] * pattern.ncols + cols)
    return Recovery(colors[cols] * pattern.nrows + rows)


def star_recovery(pattern: IndexSets, colors: np.ndarray) -> Recovery | None:
    """Direct recovery of the symmetric ``pattern`` from the HVPs ``(ncolors, n)``; ``None`` when
    ``colors`` (``-1``: in no seed) does not allow it for every entry."""
    n = pattern.nrows
    k = max(int(colors.max(initial=-1)) + 1, 1)
    rows, cols = pattern.row_ids(), pattern.indices
    cc, cr = colors[cols], colors[rows]
    # How many seeded entries of row i carry colour c: (i, c) reads an entry of colour c iff 1.
    seeded = cc >= 0
    counts = np.bincount(rows[seeded] * k + cc[seeded], minlength=n * k)
    direct = seeded & (counts[rows * k + np.maximum(cc, 0)] == 1)
    swapped = (cr >= 0) & (counts[cols * k + np.maximum(cr, 0)] == 1)
    if not np.all(direct | swapped):
        return None
    return Recovery(np.where(direct, cc * n + rows, cr * n + cols))


def bidirectional_recovery(pattern: IndexSets, columns: np.ndarray, rows_colors: np.ndarray) -> Recovery:
    """Direct recovery from forward passes ``(nf, m)`` followed by reverse passes ``(nr, n)``
    (flattened and concatenated); ``columns``/``rows_colors`` hold ``-1`` for what is in no seed."""
    m, n = pattern.nrows, pattern.ncols
    nf = int(columns.max(initial=-1)) + 1
    nr = int(rows_colors.max(initial=-1)) + 1
    rows, cols = pattern.row_ids(), pattern.indices
    cf, cr = columns[cols], rows_colors[rows]
    kf, kr = max(nf, 1), max(nr, 1)
    seeded_f = cf >= 0
    count_f = np.bincount(rows[seeded_f] * kf + cf[seeded_f], minlength=m * kf)
    by_forward = seeded_f & (count_f[rows * kf + np.maximum(cf, 0)] == 1)
    seeded_r = cr >= 0
    count_r = np.bincount(cols[seeded_r] * kr + cr[seeded_r], minlength=n * kr)
    by_reverse = seeded_r & (count_r[cols * kr + np.maximum(cr, 0)] == 1)
    if not np.all(by_forward | by_reverse):
        raise ValueError("bidirectional_recovery: the colouring leaves some entries unreadable")
    return Recovery(np.where(by_forward, cf * m + rows, nf * m + cr * n + cols))


def substitution_recovery(pattern: IndexSets, colors: np.ndarray) -> Recovery:
    """Recovery of the symmetric ``pattern`` from the HVPs ``(ncolors, n)`` of an acyclic colouring:
    diagonal entries directly, the others by substitution along the two-coloured trees."""
    n = pattern.nrows
    # Neutral vertices (-1, post-processing) are colour 0 here: shifted colours, pairs among k + 1.
    shifted = colors + 1
    ncolors = max(int(shifted.max(initial=0)) + 1, 1)
    prow, pcol = pattern.row_ids(), pattern.indices
    on_diagonal = prow == pcol
    graph = adjacency(pattern)
    rows, cols = graph.row_ids(), graph.indices
    if np.any(colors[rows] == colors[cols]):  # two neutral neighbours included: that entry is in no HVP
        raise ValueError("substitution_recovery: the colouring is not proper")
    if np.any(colors[prow[on_diagonal]] < 0):
        raise ValueError("substitution_recovery: a diagonal entry of a vertex in no seed")
    # One node per (colour pair, vertex): the forest of each pair of colours, as one graph.
    low, high = np.minimum(shifted[rows], shifted[cols]), np.maximum(shifted[rows], shifted[cols])
    pair = low * ncolors + high
    key = pair * n + rows
    order = np.lexsort((cols, key))
    key_sorted = key[order]
    nodes, first = np.unique(key_sorted, return_index=True)
    neighbours = np.searchsorted(nodes, (pair * n + cols)[order]).tolist()
    indptr = np.append(first, key_sorted.size).tolist()
    vertex = (nodes % n).tolist()
    count = nodes.size
    visited = bytearray(count)
    parent = [-1] * count
    depth = [0] * count
    preorder: list[int] = []  # non-root nodes, each subtree contiguous
    # Roots of seeded vertices first: a neutral vertex must be a leaf (its colour has no HVP).
    for root in np.argsort(colors[nodes % n] < 0, kind="stable").tolist():
        if visited[root]:
            continue
        visited[root] = 1
        stack = [root]
        while stack:
            u = stack.pop()
            if u != root:
                preorder.append(u)
            for q in neighbours[indptr[u] : indptr[u + 1]]:
                if visited[q]:
                    if q != parent[u]:
                        raise ValueError("substitution_recovery: the colouring is not acyclic")
                    continue
                visited[q] = 1
                parent[q] = u
                depth[q] = depth[u] + 1
                stack.append(q)
    size = [1] * count
    for u in reversed(preorder):
        size[parent[u]] += size[u]
    pre = np.array(preorder, dtype=np.int64)
    vertex_np = np.array(vertex, dtype=np.int64)
    parent_np = np.array(parent, dtype=np.int64)[pre]
    sign = np.where(np.array(depth, dtype=np.int64)[pre] % 2 == 0, 1.0, -1.0)
    v, p = vertex_np[pre], vertex_np[parent_np]
    if np.any(colors[p] < 0):
        raise ValueError("substitution_recovery: a vertex in no seed is not a leaf of its two-coloured trees")
    terms = colors[p] * n + v  # HVP of the parent's colour, at row v
    starts = np.arange(pre.size, dtype=np.int64)
    stops = starts + np.array(size, dtype=np.int64)[pre]
    # The solved values are H[v, p]; the pattern holds it at (v, p) and (p, v).
    keys = prow * n + pcol
    solved_at = np.concatenate([np.searchsorted(keys, v * n + p), np.searchsorted(keys, p * n + v)])
    slots = np.full(keys.size, -1, dtype=np.int64)
    diagonal = np.flatnonzero(on_diagonal)
    slots[diagonal] = np.arange(diagonal.size)
    slots[solved_at] = diagonal.size + np.concatenate([starts, starts])
    if np.any(slots < 0):
        raise ValueError("substitution_recovery: some entries are in no two-coloured tree")
    return Recovery(
        direct=colors[prow[diagonal]] * n + prow[diagonal],
        terms=terms,
        signs=sign,
        starts=starts,
        stops=stops,
        solved_signs=sign,
        order=slots,
    )


def seeds(colors: np.ndarray, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The ``(ncolors, numel)`` 0/1 seeds: row ``c`` is the indicator of colour ``c`` (``-1``: none)."""
    ncolors = int(colors.max(initial=-1)) + 1
    result = torch.zeros(ncolors, numel, dtype=dtype, device=device)
    members = np.flatnonzero(colors >= 0)
    if members.size:
        result[torch.from_numpy(colors[members]).to(device), torch.from_numpy(members).to(device)] = 1
    return result


def _accumulator(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    if device.type == "mps":  # no float64 there
        return dtype
    if dtype in (torch.float16, torch.bfloat16, torch.float32):
        return torch.float64
    if dtype == torch.complex64:
        return torch.complex128
    return dtype


class TorchRecovery:
    """A ``Recovery`` as index tensors on one device; ``values(flat)`` reads the CSR values."""

    def __init__(self, recovery: Recovery, device: torch.device) -> None:
        def tensor(a: np.ndarray | None, dtype: torch.dtype = torch.int64) -> torch.Tensor | None:
            return None if a is None else torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)

        self.direct = tensor(recovery.direct)
        self.terms = tensor(recovery.terms)
        self.signs = tensor(recovery.signs, torch.float64)
        self.starts = tensor(recovery.starts)
        self.stops = None if recovery.stops is None else tensor(recovery.stops)
        self.solved_signs = tensor(recovery.solved_signs, torch.float64)
        self.order = tensor(recovery.order)
        self.size = int(recovery.direct.size + (0 if recovery.terms is None else recovery.terms.size))

    def values(self, flat: torch.Tensor) -> torch.Tensor:
        """The CSR values from the flat compressed products."""
        assert self.direct is not None
        direct = flat.index_select(0, self.direct)  # 6x faster than flat[direct] on CPU
        if self.terms is None:
            return direct
        assert self.signs is not None and self.starts is not None and self.stops is not None
        assert self.solved_signs is not None and self.order is not None
        acc = _accumulator(flat.dtype, flat.device)
        terms = flat.index_select(0, self.terms).to(acc) * self.signs.to(acc)
        prefix = torch.cat([terms.new_zeros(1), terms.cumsum(0)])
        solved = (prefix.index_select(0, self.stops) - prefix.index_select(0, self.starts)) * self.solved_signs.to(acc)
        return torch.cat([direct, solved.to(flat.dtype)]).index_select(0, self.order)


_quiet_done = False


def csr(crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """A CSR tensor on index tensors known to be valid (the pattern's), without re-validating them.

    The caller hands over index tensors no other result holds: a CSR tensor's in-place methods
    write into them (``zero_()`` empties ``col_indices``, ``copy_`` copies another pattern in).

    torch's "Sparse CSR tensor support is in beta state" warning is silenced for torchdi's own
    results. torch warns once per process, so only the first construction needs the (40 us)
    ``catch_warnings`` around it; if that one is torchdi's, a user's later CSR code does not see it.
    """
    global _quiet_done
    if _quiet_done:
        return torch.sparse_csr_tensor(crow, col, values, shape, check_invariants=False)
    with quiet_sparse_csr():
        result = torch.sparse_csr_tensor(crow, col, values, shape, check_invariants=False)
    _quiet_done = True
    return result
