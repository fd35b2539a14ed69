"""Colouring: which columns (or rows) of a sparse jacobian, or of a symmetric hessian, can share
one pushforward (pullback, HVP).

- Jacobians: greedy *partial distance-2* colouring of the columns (two columns that share a row
  get different colours), or of the rows. Every non-zero is read directly.
- Jacobians with ``MixedMode``: *bidirectional* colouring (Coleman & Verma), a star colouring of
  the bipartite graph of rows and columns followed by the removal of unneeded colours, so that
  some non-zeros are read from forward passes (column colours) and the others from reverse
  passes (row colours). A jacobian with a dense first row and column needs ``n`` passes in
  either single direction and 3 bidirectionally.
- Hessians: greedy *star* colouring of the adjacency graph (every path on four vertices uses at
  least three colours; direct recovery), or *acyclic* colouring (every cycle uses at least three
  colours; fewer colours, recovery by substitution along the two-coloured trees). The sweeps
  follow Gebremedhin, Tarafdar, Manne & Pothen (2007), "New acyclic and star coloring algorithms
  with application to computing Hessians": two-coloured stars and trees are tracked as they
  grow, so each vertex costs a pass over the neighbours of its neighbours.

Vertex orders: ``natural``, ``largest_first``, ``smallest_last`` (Matula-Beck),
``incidence_degree``, ``dynamic_largest_first``, ``random``; a tuple tries each and keeps the
colouring with the fewest colours (passes).

Speed: orders, conflict graphs, lower bounds and recovery plans are vectorised numpy. The greedy
sweeps are sequential by nature and run as tight Python loops over adjacency lists. numba would
make them 20-50x faster, but it is not a dependency (it pins numpy and llvmlite versions and adds
seconds of JIT compilation per process, which dominates on the small patterns most users have);
instead, a colouring that provably needs no search is taken without one: when every row of the
conflict structure spans at most ``w`` consecutive columns and some row holds ``w`` non-zeros
(banded and dense patterns), ``j mod w`` is a distance-2 colouring meeting the clique lower
bound, so it is optimal whatever the order (a banded 10^5 pattern colours in milliseconds; a
dense 300 x 300 hessian, whose star sweep would cost n^3 steps, takes ``n`` colours at once).
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, TypeVar, cast

import numpy as np

from torchdi.sparsity.index_sets import IndexSets

__all__ = [
    "ORDERS",
    "GreedyColoring",
    "acyclic_coloring",
    "adjacency",
    "bidirectional_coloring",
    "color_groups",
    "column_coloring",
    "star_coloring",
    "symmetric_coloring",
    "vertex_order",
]

Order = Literal["natural", "largest_first", "smallest_last", "incidence_degree", "dynamic_largest_first", "random"]
ORDERS: tuple[str, ...] = (
    "natural",
    "largest_first",
    "smallest_last",
    "incidence_degree",
    "dynamic_largest_first",
    "random",
)


@dataclass(frozen=True)
class GreedyColoring:
    """Greedy colouring in a vertex order: partial distance-2 for jacobians, bidirectional for
    ``MixedMode`` jacobians, star (direct) or acyclic (substitution) for hessians.

    Args:
        order: the vertex order of the greedy sweep: ``"natural"`` (index order),
            ``"largest_first"`` (decreasing degree), ``"smallest_last"`` (Matula-Beck degeneracy
            order), ``"incidence_degree"`` (most already-ordered neighbours next),
            ``"dynamic_largest_first"`` (largest degree among the vertices not yet ordered next),
            ``"random"`` (a permutation drawn from ``seed``), or a tuple of these: each is tried
            and the colouring with the fewest colours (passes) wins, the first on ties.
        seed: the seed of the ``"random"`` order.
        postprocessing: after a star or acyclic colouring, drop the colours that no entry
            needs (neutral colours: those vertices join no seed). Fewer passes when the
            pattern has no full diagonal; bidirectional colouring always does it.
        decompression: ``"direct"`` (star colouring, every hessian entry read from one HVP) or
            ``"substitution"`` (acyclic colouring, never more colours than star; entries solved
            along two-coloured trees, with the rounding of a few additions). One-sided jacobian
            colourings are always read directly (each entry is alone in its colour group);
            bidirectional colouring (``MixedMode`` jacobians) has no substitution variant here:
            preparing one with ``"substitution"`` raises a ``ValueError``.

    A pattern whose optimal colouring is found without search (banded and dense ones: the
    columns modulo the band width, when a row fills the band) is coloured so whatever the order.

    Example::

        >>> backend = torchdi.AutoSparse(torchdi.AutoFunc(), coloring=torchdi.GreedyColoring(("natural", "smallest_last")))
    """

    order: Order | tuple[Order, ...] = "natural"
    seed: int = 0
    postprocessing: bool = False
    decompression: Literal["direct", "substitution"] = "direct"

    def __post_init__(self) -> None:
        orders = self.order if isinstance(self.order, tuple) else (self.order,)
        if not orders or any(o not in ORDERS for o in orders):
            raise ValueError(
                f"GreedyColoring: order must be one of {', '.join(map(repr, ORDERS))} or a non-empty tuple of them, "
                f"got {self.order!r}"
            )
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise TypeError(f"GreedyColoring: seed must be an int, got {type(self.seed).__name__}")
        if not isinstance(self.postprocessing, bool):
            raise TypeError(f"GreedyColoring: postprocessing must be a bool, got {self.postprocessing!r}")
        if self.decompression not in ("direct", "substitution"):
            raise ValueError(
                f"GreedyColoring: decompression must be 'direct' or 'substitution', got {self.decompression!r}"
            )

    @property
    def orders(self) -> tuple[str, ...]:
        """The vertex orders to try."""
        return self.order if isinstance(self.order, tuple) else (self.order,)


# ----------------------------------------------------------------------------------------------
# Graphs and orders


_F = TypeVar("_F", bound=Callable[..., np.ndarray])


def _without_cyclic_gc(sweep: _F) -> _F:
    """The sweeps allocate a small dict or list per vertex and free none until the end: Python's
    cyclic collector would rescan them all again and again (a 10^5 tridiagonal star colouring
    took 3 s with it). They build no cycles, so pausing the collector loses nothing."""

    @functools.wraps(sweep)
    def paused(*args: object) -> np.ndarray:
        enabled = gc.isenabled()
        gc.disable()
        try:
            return sweep(*args)
        finally:
            if enabled:
                gc.enable()

    return cast(_F, paused)


def conflict_graph(pattern: IndexSets) -> IndexSets:
    """Columns of ``pattern`` joined when they share a row (without self loops)."""
    return _without_diagonal(pattern.transpose().compose(pattern))


def adjacency(pattern: IndexSets) -> IndexSets:
    """The symmetric adjacency graph of a square pattern, without self loops."""
    rows, cols = pattern.row_ids(), pattern.indices
    off = rows != cols
    return IndexSets.from_pairs(
        np.concatenate([rows[off], cols[off]]), np.concatenate([cols[off], rows[off]]), pattern.nrows, pattern.ncols
    )


def bipartite_graph(pattern: IndexSets) -> IndexSets:
    """The graph of rows and columns of an ``m x n`` pattern: vertices ``0..n-1`` are the columns,
    ``n..n+m-1`` the rows, one edge per non-zero (the symmetric matrix ``[[0, J^T], [J, 0]]``)."""
    m, n = pattern.nrows, pattern.ncols
    rows, cols = pattern.row_ids() + n, pattern.indices
    return IndexSets.from_pairs(np.concatenate([rows, cols]), np.concatenate([cols, rows]), n + m, n + m)


def _without_diagonal(graph: IndexSets) -> IndexSets:
    rows = graph.row_ids()
    keep = rows != graph.indices
    if keep.all():
        return graph
    indptr = np.zeros(graph.nrows + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows[keep], minlength=graph.nrows), out=indptr[1:])
    return IndexSets(indptr, graph.indices[keep], graph.ncols)


def vertex_order(graph: IndexSets, order: str, seed: int) -> np.ndarray:
    """The order in which the greedy sweep visits the vertices of ``graph`` (without self loops)."""
    n = graph.nrows
    if order == "natural":
        return np.arange(n, dtype=np.int64)
    if order == "random":
        return np.random.default_rng(seed).permutation(n).astype(np.int64)
    if order == "largest_first":
        return np.argsort(-graph.row_lengths, kind="stable").astype(np.int64)
    return _dynamic_order(graph, order)


@_without_cyclic_gc
def _dynamic_order(graph: IndexSets, order: str) -> np.ndarray:
    """Orders whose degrees change as vertices are picked, with degree buckets (O(edges)).

    ``smallest_last``: repeatedly remove a vertex of smallest remaining degree, colour in reverse
    removal order. ``dynamic_largest_first``: repeatedly take a vertex of largest remaining
    degree. ``incidence_degree``: repeatedly take the vertex with most already-taken neighbours.
    """
    n = graph.nrows
    indptr, indices = graph.indptr.tolist(), graph.indices.tolist()
    incidence = order == "incidence_degree"
    key = [0] * n if incidence else np.diff(graph.indptr).tolist()
    top = max(graph.row_lengths.max(initial=0), 0) + 1
    buckets: list[set[int]] = [set() for _ in range(int(top) + 1)]
    for v, d in enumerate(key):
        buckets[d].add(v)
    taken = [False] * n
    picked: list[int] = []
    low = 0
    high = 0 if incidence else int(top)
    smallest = order == "smallest_last"
    for _ in range(n):
        if smallest:
            low = max(low - 1, 0)
            while not buckets[low]:
                low += 1
            v = buckets[low].pop()
        else:
            while not buckets[high]:
                high -= 1
            v = buckets[high].pop()
        taken[v] = True
        picked.append(v)
        step = 1 if incidence else -1
        for w in indices[indptr[v] : indptr[v + 1]]:
            if not taken[w]:
                d = key[w]
                buckets[d].discard(w)
                key[w] = d + step
                buckets[d + step].add(w)
                if incidence and d + step > high:
                    high = d + step
    result = np.array(picked, dtype=np.int64)
    return result[::-1].copy() if smallest else result


def _edge_ids(graph: IndexSets) -> np.ndarray:
    """For each stored entry ``(v, w)`` of a symmetric graph, one id shared with ``(w, v)``."""
    n = max(graph.nrows, 1)
    rows, cols = graph.row_ids(), graph.indices
    keys = rows * n + cols  # sorted: rows in order, columns sorted within rows
    twin = np.searchsorted(keys, cols * n + rows)
    return np.minimum(np.arange(keys.size, dtype=np.int64), twin)


# ----------------------------------------------------------------------------------------------
# Fast paths and lower bounds


def _banded_columns(pattern: IndexSets) -> np.ndarray | None:
    """``j mod w`` when it is an optimal distance-2 colouring of the columns of ``pattern``:
    every row spans at most ``w`` consecutive columns and some row holds ``w`` non-zeros (a clique
    of ``w`` columns: no colouring has fewer colours). ``None`` otherwise."""
    lengths = pattern.row_lengths
    if pattern.nnz == 0:
        return None
    full = lengths > 0
    first = pattern.indices[pattern.indptr[:-1][full]]
    last = pattern.indices[pattern.indptr[1:][full] - 1]
    width = int((last - first).max()) + 1
    if int(lengths.max()) != width:
        return None
    return np.arange(pattern.ncols, dtype=np.int64) % width


def _complete(graph: IndexSets) -> bool:
    """Whether every two distinct vertices are adjacent (a dense symmetric pattern)."""
    n = graph.nrows
    return graph.nnz == n * (n - 1)


# ----------------------------------------------------------------------------------------------
# Jacobians: partial distance-2 colouring


def column_coloring(pattern: IndexSets, coloring: GreedyColoring) -> np.ndarray:
    """A partial distance-2 colouring of the columns of ``pattern``: columns sharing a row differ.

    With several orders, the colouring with the fewest colours. The sweep never builds the column
    conflict graph (``rows x row length^2`` pairs): each row keeps the set of colours already used
    in it as the bits of a Python int, so colouring a column costs two passes over its own rows.
    Only the degree-based orders build the graph.

    Computed once per pattern object and colouring (a copy is returned): the numerical check of
    a traced pattern colours it as a preparation with the default colouring does.
    """
    memo: dict[GreedyColoring, np.ndarray] = pattern.__dict__.setdefault("_column_colorings", {})
    found = memo.get(coloring)
    if found is None:
        found = memo[coloring] = _column_coloring(pattern, coloring)
    return found.copy()


def _column_coloring(pattern: IndexSets, coloring: GreedyColoring) -> np.ndarray:
    banded = _banded_columns(pattern)
    if banded is not None:
        return banded
    best: np.ndarray | None = None
    graph: IndexSets | None = None
    for order in coloring.orders:
        if order in ("natural", "random"):
            sequence = vertex_order(IndexSets.empty(pattern.ncols, pattern.ncols), order, coloring.seed)
        else:
            graph = conflict_graph(pattern) if graph is None else graph
            sequence = vertex_order(graph, order, coloring.seed)
        colors = _distance2_sweep(pattern, sequence)
        if best is None or colors.max(initial=-1) < best.max(initial=-1):
            best = colors
    assert best is not None
    return best


@_without_cyclic_gc
def _distance2_sweep(pattern: IndexSets, order: np.ndarray) -> np.ndarray:
    by_column = pattern.transpose()
    indptr, rows_of = by_column.indptr.tolist(), by_column.indices.tolist()
    used = [0] * pattern.nrows  # bit c of used[r]: colour c is taken in row r
    color = [0] * pattern.ncols
    for v in order.tolist():
        rows = rows_of[indptr[v] : indptr[v + 1]]
        taken = 0
        for r in rows:
            taken |= used[r]
        bit = ~taken & (taken + 1)  # the lowest colour not taken
        color[v] = bit.bit_length() - 1
        for r in rows:
            used[r] |= bit
    return np.array(color, dtype=np.int64)


# ----------------------------------------------------------------------------------------------
# Hessians: star and acyclic colouring


# The acyclic sweep visits, per vertex, every colour around each neighbour: about the sum of the
# squared degrees. Above this (a 300 x 300 hessian denser than ~60%: 5 s of sweep for 2% fewer
# colours than star), substitution takes the star colouring.
_ACYCLIC_WORK = 1e7


def symmetric_coloring(pattern: IndexSets, coloring: GreedyColoring) -> np.ndarray:
    """The colouring of a symmetric pattern that ``coloring.decompression`` asks for: star
    (``"direct"``) or acyclic (``"substitution"``), best of the orders; neutral vertices (``-1``,
    in no seed) after post-processing. Acyclic colouring falls back to the star colouring if that
    one has fewer colours (every star colouring is acyclic)."""
    if coloring.decompression == "substitution":
        star = star_coloring(pattern, coloring)
        # Near-dense (above _ACYCLIC_WORK): every star colouring is acyclic, and the tree sweep would cost n^3.
        degree = pattern.row_lengths.astype(np.float64)
        colors = star
        if float((degree**2).sum()) <= _ACYCLIC_WORK:
            acyclic = acyclic_coloring(pattern, coloring)
            colors = star if star.max(initial=-1) < acyclic.max(initial=-1) else acyclic
        return postprocess_acyclic(pattern, colors) if coloring.postprocessing else colors
    colors = star_coloring(pattern, coloring)
    if coloring.postprocessing:
        colors = postprocess_symmetric(pattern, colors)
    return colors



def _best_symmetric_sweep(
    pattern: IndexSets, coloring: GreedyColoring, sweep: Callable[[IndexSets, np.ndarray, np.ndarray], np.ndarray]
) -> np.ndarray:
    """The colouring with fewest colours that ``sweep`` finds over ``coloring``'s orders, on the
    adjacency graph of the symmetric ``pattern`` (a complete graph: one colour per vertex, no search)."""
    graph = adjacency(pattern)
    if _complete(graph):
        return np.arange(graph.nrows, dtype=np.int64)
    eid = _edge_ids(graph)
    best: np.ndarray | None = None
    for order in coloring.orders:
        colors = sweep(graph, eid, vertex_order(graph, order, coloring.seed))
        if best is None or colors.max(initial=-1) < best.max(initial=-1):
            best = colors
    assert best is not None
    return best

def star_coloring(pattern: IndexSets, coloring: GreedyColoring) -> np.ndarray:
    """A greedy star colouring of the adjacency graph of the symmetric ``pattern`` (best of the
    orders): a proper colouring where every path on four vertices uses at least three colours,
    so that every entry can be read directly from one HVP."""
    return _best_symmetric_sweep(pattern, coloring, _star_sweep)


@_without_cyclic_gc
def _star_sweep(graph: IndexSets, eid_array: np.ndarray, order: np.ndarray) -> np.ndarray:
    n = graph.nrows
    indptr, indices, eid = graph.indptr.tolist(), graph.indices.tolist(), eid_array.tolist()
    color = [-1] * n
    forbidden = [-1] * (n + 1)  # forbidden[c] == v: colour c is forbidden for v
    first_v = [-1] * (n + 1)  # first_*[c]: the last vertex that saw a neighbour of colour c, that neighbour, the edge
    first_w = [-1] * (n + 1)
    first_e = [-1] * (n + 1)
    treated = [-1] * n
    star = [-1] * max(len(eid), 1)  # edge id -> star id
    hub: list[int] = []  # star id -> its centre (-1: a single edge, centre not known yet)
    # around[w]: colour -> [a coloured neighbour of that colour, the edge to it, how many]. The
    # sweep reads one neighbour per colour instead of all of them: a hub of degree d costs
    # O(colours), not O(d), each time a neighbour of it is coloured (an arrowhead: O(n), not O(n^2)).
    around: list[dict[int, list[int]]] = [{} for _ in range(n)]
    # spoke_of[w]: colour -> the centre of a star (of at least two edges) that w is a spoke of.
    # Case 2 below reads these instead of every neighbour of w: a near-dense pattern costs
    # O(edges), not O(n^3).
    spoke_of: list[dict[int, int]] = [{} for _ in range(n)]

    for v in order.tolist():
        start, stop = indptr[v], indptr[v + 1]
        for p in range(start, stop):
            w = indices[p]
            cw = color[w]
            if cw < 0:
                continue
            forbidden[cw] = v
            if first_v[cw] == v:  # v has two neighbours of colour cw: forbid the colours around both
                q = first_w[cw]
                if treated[q] != v:
                    for cx in around[q]:
                        forbidden[cx] = v
                    treated[q] = v
                for cx in around[w]:
                    forbidden[cx] = v
                treated[w] = v
            else:
                first_v[cw], first_w[cw], first_e[cw] = v, w, eid[p]
                for cx in spoke_of[w]:  # w is a spoke of a star centred on a vertex of colour cx
                    forbidden[cx] = v
        c = 0
        while forbidden[c] == v:
            c += 1
        color[v] = c
        # Grow the two-coloured stars with the edges of v, and tell each neighbour about v.
        for p in range(start, stop):
            w = indices[p]
            near = around[w]
            found = near.get(c)
            if found is None:
                near[c] = [v, eid[p], 1]
            else:
                found[2] += 1
            cw = color[w]
            if cw < 0:
                continue
            if found is not None:  # v-w-x with colour(x) == colour(v): w is the centre of a star
                s = star[found[1]]
                if hub[s] < 0:
                    hub[s] = w
                    spoke_of[found[0]][cw] = w
                spoke_of[v][cw] = w
                star[eid[p]] = s
            elif first_v[cw] == v and first_w[cw] != w:  # v-w and v-q with colour(w) == colour(q): v is a centre
                s = star[first_e[cw]]
                if hub[s] < 0:
                    hub[s] = v
                    spoke_of[first_w[cw]][c] = v
                spoke_of[w][c] = v
                star[eid[p]] = s
            else:
                hub.append(-1)
                star[eid[p]] = len(hub) - 1
    return np.array(color, dtype=np.int64)


def acyclic_coloring(pattern: IndexSets, coloring: GreedyColoring) -> np.ndarray:
    """A greedy acyclic colouring of the adjacency graph of the symmetric ``pattern`` (best of the
    orders): a proper colouring where every cycle uses at least three colours, so that the edges
    between any two colours form a forest, solved by substitution from its leaves."""
    return _best_symmetric_sweep(pattern, coloring, _acyclic_sweep)


@_without_cyclic_gc
def _acyclic_sweep(graph: IndexSets, eid_array: np.ndarray, order: np.ndarray) -> np.ndarray:
    n = graph.nrows
    indptr, indices, eid = graph.indptr.tolist(), graph.indices.tolist(), eid_array.tolist()
    color = [-1] * n
    forbidden = [-1] * (n + 1)
    first_v = [-1] * (n + 1)  # first_*[c]: the last vertex with a neighbour of colour c, the edge to it
    first_e = [-1] * (n + 1)
    parent = list(range(max(len(eid), 1)))  # disjoint sets of edges: the two-coloured trees
    visit_v = [-1] * max(len(eid), 1)  # per tree root: the last vertex that reached it, and through which neighbour
    visit_w = [-1] * max(len(eid), 1)
    # around[w]: colour -> an edge from w to a neighbour of that colour. All such edges lie in one
    # two-coloured tree (they meet at w), so one per colour tells which trees v reaches through w.
    around: list[dict[int, int]] = [{} for _ in range(n)]

    def find(e: int) -> int:
        root = e
        while parent[root] != root:
            root = parent[root]
        while parent[e] != root:
            parent[e], e = root, parent[e]
        return root

    for v in order.tolist():
        start, stop = indptr[v], indptr[v + 1]
        for p in range(start, stop):
            cw = color[indices[p]]
            if cw >= 0:
                forbidden[cw] = v
        for p in range(start, stop):
            w = indices[p]
            if color[w] < 0:
                continue
            for cx, e in around[w].items():
                if forbidden[cx] == v:
                    continue
                # v reaches the tree of w-x through w; a second way in would close a cycle of two colours.
                root = find(e)
                if visit_v[root] != v:
                    visit_v[root], visit_w[root] = v, w
                elif visit_w[root] != w:
                    forbidden[cx] = v
        c = 0
        while forbidden[c] == v:
            c += 1
        color[v] = c
        for p in range(start, stop):  # v joins the trees of its neighbours' colours (stars centred at v)
            cw = color[indices[p]]
            if cw < 0:
                continue
            e = eid[p]
            if first_v[cw] != v:
                first_v[cw], first_e[cw] = v, e
            else:
                a, b = find(e), find(first_e[cw])
                if a != b:
                    parent[a] = b
        for p in range(start, stop):  # merge the trees joined through a neighbour (v-w-x, colour(x) == c); tell w about v
            w = indices[p]
            near = around[w]
            e = near.get(c)
            if e is None:
                near[c] = eid[p]
            elif color[w] >= 0:
                a, b = find(eid[p]), find(e)
                if a != b:
                    parent[a] = b
    return np.array(color, dtype=np.int64)


# ----------------------------------------------------------------------------------------------
# Post-processing: drop the colours no entry is read from


def readable(graph: IndexSets, colors: np.ndarray) -> np.ndarray:
    """For each stored entry ``(v, w)`` of ``graph``: whether ``w`` is the only neighbour of ``v``
    in a seed with colour ``colors[w]`` (then the entry is read from that seed's product at ``v``).
    Vertices of colour ``-1`` are in no seed."""
    n = graph.nrows
    ncolors = int(colors.max(initial=-1)) + 1
    rows, cols = graph.row_ids(), graph.indices
    seeded = colors[cols] >= 0
    key = rows * max(ncolors, 1) + np.where(seeded, colors[cols], 0)
    counts = np.bincount(key[seeded], minlength=n * max(ncolors, 1))
    return seeded & (counts[key] == 1)


def _keep_units(graph: IndexSets, units: np.ndarray, forced: np.ndarray, colors: np.ndarray) -> np.ndarray:
    """Which units (a colour, on one side for bidirectional colouring) to keep so that every edge
    is read from a kept unit: those some entry can only be read from, then greedily the unit that
    serves the most entries still unread (a set cover). ``forced``: units kept anyway."""
    nunits = int(units.max(initial=-1)) + 1
    ok = readable(graph, colors)  # entry (v, w) read through w's unit
    rows, cols = graph.row_ids(), graph.indices
    eid = _edge_ids(graph)
    # Each undirected edge: option via w (entry (v, w)) and via v (entry (w, v)).
    first = np.arange(eid.size) == eid
    twin = np.empty_like(eid)
    order = np.argsort(eid, kind="stable")
    twin[order[0::2]], twin[order[1::2]] = order[1::2], order[0::2]
    a = np.where(ok[first], units[cols[first]], -1)
    b = np.where(ok[twin[first]], units[rows[first]], -1)
    if np.any((a < 0) & (b < 0)):
        raise ValueError("postprocessing: the colouring leaves an entry that no colour can be read from")
    keep = np.zeros(max(nunits, 1), dtype=bool)
    keep[forced[forced >= 0]] = True
    keep[a[b < 0][a[b < 0] >= 0]] = True
    keep[b[a < 0][b[a < 0] >= 0]] = True
    while True:
        open_ = ~((a >= 0) & keep[np.maximum(a, 0)]) & ~((b >= 0) & keep[np.maximum(b, 0)])
        if not open_.any():
            return keep
        votes = np.bincount(np.concatenate([a[open_], b[open_]]).clip(min=0), minlength=keep.size)
        keep[int(np.argmax(votes))] = True


def postprocess_symmetric(pattern: IndexSets, colors: np.ndarray) -> np.ndarray:
    """A star colouring with the colours no entry needs set to ``-1`` (neutral) and the others
    renumbered ``0..k-1``. A diagonal entry needs its vertex's colour."""
    graph = adjacency(pattern)
    diagonal = pattern.row_ids()[pattern.row_ids() == pattern.indices]
    keep = _keep_units(graph, colors, colors[diagonal], colors)
    return _renumber(np.where(keep[colors], colors, -1))


def postprocess_acyclic(pattern: IndexSets, colors: np.ndarray) -> np.ndarray:
    """An acyclic colouring with colours substitution does not need set to ``-1`` (neutral: in no
    HVP) and the others renumbered ``0..k-1``.

    A colour ``c`` can go when no vertex of colour ``c`` has a diagonal entry, every vertex of
    colour ``c`` has at most one neighbour of each other colour (it is then a leaf of every
    two-coloured tree, rooted at its neighbour, and its entries are read directly from that
    neighbour's HVP), and no neighbouring colour has gone already (an entry between two neutral
    vertices would be in no HVP). Colours are tried from the largest to the smallest.
    """
    ncolors = int(colors.max(initial=-1)) + 1
    if ncolors == 0:
        return colors
    graph = adjacency(pattern)
    n = graph.nrows
    rows, cols = graph.row_ids(), graph.indices
    diagonal = pattern.row_ids()[pattern.row_ids() == pattern.indices]
    blocked = np.zeros(ncolors, dtype=bool)
    blocked[colors[diagonal]] = True
    neighbours_per_colour = np.bincount(rows * ncolors + colors[cols], minlength=n * ncolors).reshape(n, ncolors)
    blocked[colors[(neighbours_per_colour > 1).any(axis=1)]] = True
    touching = np.zeros((ncolors, ncolors), dtype=bool)
    touching[colors[rows], colors[cols]] = True
    neutral = np.zeros(ncolors, dtype=bool)
    sizes = np.bincount(colors, minlength=ncolors)
    for c in np.argsort(-sizes, kind="stable"):
        if not blocked[c] and not (touching[c] & neutral).any():
            neutral[c] = True
    return _renumber(np.where(neutral[colors], -1, colors))


def _renumber(colors: np.ndarray) -> np.ndarray:
    used = np.unique(colors[colors >= 0])
    lookup = np.full(int(colors.max(initial=-1)) + 2, -1, dtype=np.int64)
    lookup[used] = np.arange(used.size)
    return lookup[colors]


# ----------------------------------------------------------------------------------------------
# MixedMode: bidirectional colouring


def bidirectional_coloring(pattern: IndexSets, coloring: GreedyColoring) -> tuple[np.ndarray, np.ndarray]:
    """Column and row colours of an ``m x n`` jacobian pattern for forward *and* reverse passes
    (``-1``: the column or row is in no seed; column colour ``c`` is forward pass ``c``, row colour
    ``c`` reverse pass ``c``), the candidate with the fewest passes of:

    - per order, a star colouring of the bipartite graph of rows and columns, post-processed so
      that only the colours some entry is read from stay (Coleman & Verma's star bicolouring);
    - splits by density: the rows with at least ``k`` non-zeros go to reverse passes (their
      distance-2 colouring), the other rows to forward passes (the distance-2 colouring of the
      columns over them), for a few thresholds ``k``; the same with columns. A dense first row
      and column take 1 + 2 passes.
    """
    n = pattern.ncols
    candidates: list[tuple[np.ndarray, np.ndarray]] = []
    graph = bipartite_graph(pattern)
    # The star sweep costs about the sum over edges of the colours around their ends: cap it.
    if int((graph.row_lengths.astype(np.float64) ** 2).sum()) <= 20_000_000:
        eid = _edge_ids(graph)
        for order in coloring.orders:
            colors = _star_sweep(graph, eid, vertex_order(graph, order, coloring.seed))
            ncolors = int(colors.max(initial=-1)) + 1
            units = colors + np.where(np.arange(colors.size) < n, 0, ncolors)  # (colour, side)
            keep = _keep_units(graph, units, np.zeros(0, dtype=np.int64), colors)
            kept = np.where(keep[units], colors, -1)
            candidates.append((_renumber(kept[:n]), _renumber(kept[n:])))
    candidates += _splits(pattern, coloring)
    candidates += [(c, r) for r, c in _splits(pattern.transpose(), coloring)]
    return min(candidates, key=lambda cr: int(cr[0].max(initial=-1)) + int(cr[1].max(initial=-1)) + 2)


def _splits(pattern: IndexSets, coloring: GreedyColoring, tries: int = 6) -> list[tuple[np.ndarray, np.ndarray]]:
    """(column colours, row colours) with the densest rows in reverse passes, the rest forward."""
    lengths = pattern.row_lengths
    result = []
    for threshold in np.unique(lengths[lengths > 0])[::-1][:tries]:
        dense = lengths >= threshold
        if dense.all():
            continue
        index = np.arange(pattern.nrows, dtype=np.int64)
        sparse_rows = pattern.take(np.where(dense, -1, index))
        dense_rows = pattern.take(np.where(dense, index, -1))
        columns = column_coloring(sparse_rows, coloring)
        columns = _renumber(np.where(sparse_rows.transpose().row_lengths > 0, columns, -1))
        rows = column_coloring(dense_rows.transpose(), coloring)
        rows = _renumber(np.where(dense, rows, -1))
        result.append((columns, rows))
    return result


def color_groups(colors: np.ndarray) -> tuple[np.ndarray, ...]:
    """The indices of each colour, in increasing order (``-1``, neutral, in none)."""
    ncolors = int(colors.max(initial=-1)) + 1
    order = np.argsort(colors, kind="stable")
    bounds = np.searchsorted(colors[order], np.arange(ncolors + 1))
    return tuple(order[bounds[c] : bounds[c + 1]] for c in range(ncolors))
