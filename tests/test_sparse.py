"""AutoSparse: detectors, colouring, decompression, out=, compilation counts (issue 11)."""

from __future__ import annotations

import contextlib
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import torchdi
from torchdi.families import FAMILIES
from torchdi.sparsity.coloring import (
    ORDERS,
    GreedyColoring,
    acyclic_coloring,
    adjacency,
    bidirectional_coloring,
    column_coloring,
    star_coloring,
    symmetric_coloring,
)
from torchdi.sparsity.decompression import (
    TorchRecovery,
    bidirectional_recovery,
    seeds,
    star_recovery,
    substitution_recovery,
)
from torchdi.sparsity.index_sets import IndexSets
from torchdi.sparsity.tracer import trace_sparsity
from torchdi.testing.sparse_scenarios import (
    brusselator,
    chained_rosenbrock,
    diff_square,
    sparse_scenarios,
    true_pattern,
)

pytestmark = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")


def dense_jacobian(f, x):
    return torch.autograd.functional.jacobian(f, x).reshape(-1, x.numel())


def traced(f, x, hessian=False):
    return trace_sparsity(lambda z, _: f(z), x, (), hessian=hessian)


# ----------------------------------------------------------------------------------------------
# Detectors


@pytest.mark.parametrize(
    "name, shape, hessian",
    [
        ("brusselator", (6, 6, 2), False),
        ("diff_square", (9,), False),
        ("diff_cube", (9,), False),
        ("chained_rosenbrock", (9,), True),
        ("broyden_tridiagonal", (9,), True),
    ],
)
def test_tracer_finds_the_true_pattern(name, shape, hessian):
    import torchdi.testing.sparse_scenarios as scenarios

    result = traced(getattr(scenarios, name), torch.rand(shape, dtype=torch.float64) + 0.5, hessian=hessian)
    pattern = result.pattern
    if hessian:
        pattern = IndexSets.union([pattern, pattern.transpose()])
    assert np.array_equal(pattern.to_dense(), true_pattern(name, shape))
    assert result.fallbacks == ()


RULE_CASES = {
    # name: (f, x); each pattern is checked to be exact against the dense jacobian at x
    "cat-stack-flip": (lambda x: torch.cat([x[:3].flip(0), torch.stack([x[3], x[5]])]) * 2, torch.rand(6) + 1),
    "fixed-index-gather": (lambda x: x[torch.tensor([4, 0, 2])] + x.gather(0, torch.tensor([1, 1, 3])), torch.rand(5) + 1),
    "where-fixed-mask": (lambda x: torch.where(torch.arange(4) % 2 == 0, x, x.roll(1)), torch.rand(4) + 1),
    "mask-multiply": (lambda x: x * torch.tensor([1.0, 0.0, 2.0, 0.0]), torch.rand(4) + 1),
    "softmax-rows": (lambda x: torch.softmax(x.reshape(2, 3), dim=1), torch.rand(6)),
    "sum-keepdim": (lambda x: x.reshape(2, 3).sum(0, keepdim=True) * x.reshape(2, 3), torch.rand(6) + 1),
    "matmul-fixed-band": (lambda x: torch.diag(torch.ones(5)) @ x.reshape(5, 2) + x.reshape(5, 2), torch.rand(10) + 1),
    "matmul-both-varying": (lambda x: x.reshape(2, 3) @ x.reshape(3, 2), torch.rand(6) + 1),
    "conv1d-strided": (
        lambda x: torch.nn.functional.conv1d(x.reshape(1, 1, 8), torch.tensor([[[1.0, 0.0, 1.0]]]), stride=2, padding=1),
        torch.rand(8) + 1,
    ),
    "pad-reflect": (lambda x: torch.nn.functional.pad(x.reshape(1, 1, 5), (2, 2), mode="reflect").reshape(-1), torch.rand(5) + 1),
    "cache-write": (lambda x: torch.zeros(4).index_put((torch.tensor([1, 3]),), x[:2] ** 2), torch.rand(4) + 1),
    "scatter-slices": (lambda x: torch.zeros(6).slice_scatter(x[::2], 0, 0, 3), torch.rand(6) + 1),
    "where-scalar": (lambda x: torch.where(torch.arange(4) % 2 == 0, x, 2.5), torch.rand(4) + 1),
    "masked-fill": (lambda x: x.masked_fill(torch.tensor([True, False, True, False]), 3.0), torch.rand(4) + 1),
    "scatter-value": (lambda x: x.scatter(0, torch.tensor([1, 2]), 7.0), torch.rand(4) + 1),
    "pad-value": (lambda x: torch.nn.functional.pad(x, (1, 2), value=4.0), torch.rand(4) + 1),
    "layer-norm": (lambda x: torch.nn.functional.layer_norm(x[:4].reshape(2, 2), (2,), weight=x[4:]).reshape(-1), torch.rand(6)),
    "index-put-accumulate": (
        lambda x: torch.zeros(5).index_put((torch.tensor([4, 0, 4]),), x[:3] * x[3:], accumulate=True),
        torch.rand(6) + 1,
    ),
    "index-put-accumulate-2d": (
        lambda x: x.reshape(2, 3).index_put((torch.tensor([1, 0, 1]), torch.tensor([2, 2, 2])), x[3:] ** 2, accumulate=True).reshape(-1),
        torch.rand(6) + 1,
    ),
    "index-add": (lambda x: x[:3].index_add(0, torch.tensor([2, 0, 1]), x[3:]), torch.rand(6) + 1),
    "scatter-add-2d": (
        lambda x: torch.zeros(2, 3).scatter_add(1, torch.tensor([[0, 0, 1], [2, 2, 2]]), x.reshape(2, 3)).reshape(-1),
        torch.rand(6) + 1,
    ),
    # Writes: the first run (not functionalized) stops at f's first write and f is traced again
    # functionalized; f's own `except Exception` must not swallow that stop.
    "write-into-slice": (lambda x: _writes_in_place(x), torch.rand(4) + 1),
    "write-into-created": (lambda x: _writes_into_created(x), torch.rand(4) + 1),
    "write-in-try": (lambda x: _writes_in_try(x), torch.rand(4) + 1),
}


def _writes_in_place(x):
    y = x * 2
    y[1:3] += x[:2] ** 2
    return y.mul_(3)


def _writes_into_created(x):
    buffer = torch.zeros(3)
    buffer[1:] = x[:2] * x[2:]
    return buffer


def _writes_in_try(x):
    y = x.clone()
    with contextlib.suppress(Exception):  # a tracer that signalled with an Exception would lose the write here
        y[0] = x[3]
    return y


@pytest.mark.parametrize("case", sorted(RULE_CASES))
def test_tracer_rules_are_exact(case):
    f, x = RULE_CASES[case]
    result = traced(f, x)
    truth = (dense_jacobian(f, x) != 0).numpy()
    assert np.array_equal(result.pattern.to_dense(), truth), case
    assert result.fallbacks == ()


def test_indexing_gradient_gives_an_exact_hessian_pattern():
    # The gradient of x[I] is an index_put(accumulate=True): without its rule the pattern was dense.
    generator = torch.Generator().manual_seed(0)
    n = 40
    i, j = torch.randint(0, n, (60,), generator=generator), torch.randint(0, n, (60,), generator=generator)
    w = torch.rand(60, generator=generator, dtype=torch.float64)
    f = lambda x: (w * torch.sin(x[i]) * torch.sin(x[j])).sum()  # noqa: E731
    x = torch.rand(n, generator=generator, dtype=torch.float64)
    result = traced(f, x, hessian=True)
    pattern = IndexSets.union([result.pattern, result.pattern.transpose()]).to_dense()
    assert result.fallbacks == ()
    assert np.array_equal(pattern, (torch.autograd.functional.hessian(f, x) != 0).numpy())


def test_tracer_is_conservative_where_values_decide():
    # The condition depends on x: both branches count, whatever x is.
    result = traced(lambda x: torch.where(x > 0, x, x.roll(1)), torch.ones(4))
    assert result.pattern.to_dense().sum() == 8
    # An index computed from x: every element may land anywhere.
    result = traced(lambda x: x.index_select(0, x.argmax().reshape(1)) * torch.ones(3), torch.arange(3.0))
    assert result.pattern.to_dense().all()


def test_tracer_refuses_data_dependent_control_flow_clearly():
    def f(x):
        return x * 2 if x.sum() > 0 else x

    with pytest.raises(RuntimeError, match=r"(?s)TracerSparsity: cannot trace f.*DenseSparsity"):
        torchdi.prepare_jacobian(f, torchdi.AutoSparse(torchdi.AutoFunc()), torch.ones(3))
    prep = torchdi.prepare_jacobian(f, torchdi.AutoSparse(torchdi.AutoFunc(), sparsity=torchdi.DenseSparsity()), torch.ones(3))
    assert prep.ncolors == 1


def test_tracer_lists_ops_without_rules():
    result = traced(lambda x: torch.linalg.inv(x.reshape(2, 2)).reshape(-1) + x, torch.eye(2).reshape(-1) + 1)
    assert result.pattern.to_dense().all()
    assert any("inv" in op or "linalg" in op for op in result.fallbacks), result.fallbacks


def test_tracer_reads_contexts_as_varying_and_leaves_caches_alone():
    cache = torch.full((4,), 7.0)
    c = torch.tensor([1.0, 0.0, 1.0, 0.0])

    def f(x, c, cache):
        cache.copy_(x * 2)
        return cache * c

    prep = torchdi.prepare_jacobian(f, torchdi.AutoSparse(torchdi.AutoFunc()), torch.ones(4), torchdi.Constant(c), torchdi.Cache(cache))
    # A Constant's zeros may change between calls: not structural.
    assert prep.sparsity_pattern.to_dense().sum() == 4
    assert prep.sparsity_fallbacks == ()
    assert torch.equal(c, torch.tensor([1.0, 0.0, 1.0, 0.0]))


def test_dense_sparsity_is_local():
    c = torch.tensor([1.0, 0.0, 1.0])
    backend = torchdi.AutoSparse(torchdi.AutoFunc(), sparsity=torchdi.DenseSparsity())
    prep = torchdi.prepare_jacobian(lambda x, c: x * c, backend, torch.ones(3), torchdi.Constant(c))
    assert prep.sparsity_pattern.to_dense().tolist() == [[True, False, False], [False, False, False], [False, False, True]]
    atol = torchdi.AutoSparse(torchdi.AutoFunc(), sparsity=torchdi.DenseSparsity(atol=1.5))
    prep = torchdi.prepare_jacobian(lambda x: x * torch.tensor([1.0, 2.0, 3.0]), atol, torch.ones(3))
    assert prep.sparsity_pattern.to_dense().diagonal().tolist() == [False, True, True]


def test_known_sparsity_accepts_dense_and_sparse_patterns():
    x = torch.rand(6) + 1
    truth = true_pattern("diff_square", (6,))
    expected = dense_jacobian(diff_square, x)
    for pattern in (torch.from_numpy(truth), torch.from_numpy(truth).to_sparse_csr(), torch.from_numpy(truth).float().to_sparse()):
        backend = torchdi.AutoSparse(torchdi.AutoFunc(), sparsity=torchdi.KnownSparsity(pattern))
        jac = torchdi.jacobian(diff_square, backend, x)
        assert torch.allclose(jac.to_dense(), expected)
    assert torchdi.KnownSparsity(torch.from_numpy(truth)) == torchdi.KnownSparsity(torch.from_numpy(truth).clone())
    with pytest.raises(ValueError, match=r"pattern has shape \(5, 5\).*expected shape \(5, 6\)"):
        torchdi.prepare_jacobian(diff_square, torchdi.AutoSparse(sparsity=torchdi.KnownSparsity(torch.ones(5, 5))), x)


# ----------------------------------------------------------------------------------------------
# Colouring


def random_pattern(rows: int, cols: int, density: float, seed: int) -> IndexSets:
    rng = np.random.default_rng(seed)
    return IndexSets.from_dense(rng.random((rows, cols)) < density)


def random_symmetric(n: int, density: float, seed: int, diagonal: bool = True) -> IndexSets:
    upper = np.triu(np.random.default_rng(seed).random((n, n)) < density, 1)
    return IndexSets.from_dense(upper | upper.T | (np.eye(n, dtype=bool) & diagonal))


@pytest.mark.parametrize("seed", range(3))
def test_index_sets_uniform_fast_paths_equal_the_general_ones(seed):
    # take and union read uniform sets (every row the same length) as one block; the results
    # must be the sets the general CSR paths give (compared through dense masks).
    rng = np.random.default_rng(seed)
    n, width = 30, 3
    block = np.sort(np.stack([rng.choice(40, size=width, replace=False) for _ in range(n)]), axis=1)
    uniform = IndexSets.uniform(block, 40)
    general = IndexSets(uniform.indptr.copy(), uniform.indices.copy(), 40)  # width computed, not given
    assert uniform.width == general.width == width
    assert random_pattern(n, 40, 0.3, seed).width == -1
    dense = general.to_dense()
    rows = rng.integers(0, n, size=50)
    assert np.array_equal(uniform.take(rows).to_dense(), dense[rows])
    assert uniform.take(rows).width == width
    with_missing = np.where(rng.random(50) < 0.3, -1, rows)
    assert np.array_equal(uniform.take(with_missing).to_dense(), np.where((with_missing >= 0)[:, None], dense[rows], False))
    other = IndexSets.uniform(np.sort(rng.integers(0, 40, size=(n, 1)), axis=1), 40)  # overlaps block's rows at random
    union = IndexSets.union([uniform, other, IndexSets.identity(40).take(np.arange(n))])
    assert np.array_equal(union.to_dense(), dense | other.to_dense() | np.eye(n, 40, dtype=bool))
    assert all(np.all(np.diff(union.indices[a:b]) > 0) for a, b in zip(union.indptr[:-1], union.indptr[1:]))  # sorted, distinct
    assert IndexSets.union([uniform, uniform]) == uniform


def test_check_and_preparation_colour_a_jacobian_pattern_once(monkeypatch):
    # The numerical check of the traced pattern colours its columns and rows with the default
    # colouring, as the preparation then does: each is computed once per pattern.
    import torchdi.sparsity.coloring as coloring_module

    calls = []
    real = coloring_module._column_coloring
    monkeypatch.setattr(coloring_module, "_column_coloring", lambda p, c: calls.append((p.nrows, p.ncols)) or real(p, c))
    monkeypatch.setenv("TORCHDI_CACHE_DIR", "")
    x = torch.rand(4, 4, 2, dtype=torch.float64)
    backend = torchdi.AutoSparse(torchdi.AutoFunc())
    prep = torchdi.prepare_jacobian(brusselator, backend, x)
    assert sorted(calls) == [(32, 32), (32, 32)]  # the columns of the pattern and of its transpose
    assert torch.allclose(torchdi.jacobian(brusselator, backend, x, prep=prep).to_dense(), dense_jacobian(brusselator, x))
    pattern = random_pattern(20, 30, 0.2, 0)
    first = column_coloring(pattern, GreedyColoring())
    first[:] = -7  # a caller's copy: the memo keeps its own
    assert np.array_equal(column_coloring(pattern, GreedyColoring()), column_coloring(random_pattern(20, 30, 0.2, 0), GreedyColoring()))
    assert pattern.transpose() is pattern.transpose()


def banded(n: int, lower: int, upper: int) -> np.ndarray:
    i = np.arange(n)
    return (i[None, :] - i[:, None] <= upper) & (i[:, None] - i[None, :] <= lower)


def arrowhead(n: int) -> np.ndarray:
    mask = np.eye(n, dtype=bool)
    mask[0, :] = mask[:, 0] = True
    return mask


def two_coloured_components(pattern: IndexSets, colors: np.ndarray) -> list[tuple[int, int]]:
    """(vertices, edges) of every connected component of the subgraphs of two colours."""
    graph = adjacency(pattern)
    rows, cols = graph.row_ids(), graph.indices
    result = []
    for a in range(colors.max() + 1):
        for b in range(a + 1, colors.max() + 1):
            keep = (rows < cols) & np.isin(colors[rows], (a, b)) & np.isin(colors[cols], (a, b))
            parent = list(range(pattern.nrows))

            def find(v, parent=parent):
                while parent[v] != v:
                    v = parent[v]
                return v

            for u, v in zip(rows[keep], cols[keep]):
                parent[find(u)] = find(v)
            members = {}
            for u, v in zip(rows[keep], cols[keep]):
                members.setdefault(find(u), [set(), 0])
                members[find(u)][0].update((u, v))
                members[find(u)][1] += 1
            result += [(len(vs), e) for vs, e in members.values()]
    return result


def is_star_colouring(pattern: IndexSets, colors: np.ndarray) -> bool:
    graph = adjacency(pattern)
    if (colors[graph.row_ids()] == colors[graph.indices]).any():
        return False
    # every two-coloured component is a star: a tree whose edges all meet one vertex
    degree_ok = True
    rows, cols = graph.row_ids(), graph.indices
    for a in range(colors.max() + 1):
        for b in range(colors.max() + 1):
            if a == b:
                continue
            # a vertex of colour a with >= 2 neighbours of colour b is a centre; its b-neighbours
            # must have no other a-neighbour (else a path of 4 vertices in 2 colours)
            mask = (colors[rows] == a) & (colors[cols] == b)
            count = np.bincount(rows[mask], minlength=pattern.nrows)
            back = np.bincount(cols[mask], minlength=pattern.nrows)  # a-neighbours of each b vertex
            centres = np.flatnonzero(count >= 2)
            for c in centres:
                spokes = cols[mask & (rows == c)]
                degree_ok &= bool((back[spokes] == 1).all())
    return degree_ok and all(e == v - 1 for v, e in two_coloured_components(pattern, colors))


def is_acyclic_colouring(pattern: IndexSets, colors: np.ndarray) -> bool:
    graph = adjacency(pattern)
    proper = not (colors[graph.row_ids()] == colors[graph.indices]).any()
    return proper and all(e == v - 1 for v, e in two_coloured_components(pattern, colors))


def symmetric_values(pattern: IndexSets, seed: int) -> np.ndarray:
    values = np.random.default_rng(seed).standard_normal((pattern.nrows, pattern.ncols)) * pattern.to_dense()
    return np.triu(values) + np.triu(values, 1).T


ALL_ORDERS = [*ORDERS, ("natural", "smallest_last", "random")]


@pytest.mark.parametrize("order", ALL_ORDERS)
@pytest.mark.parametrize("seed", range(3))
def test_column_colouring_groups_are_structurally_orthogonal(order, seed):
    pattern = random_pattern(30, 40, 0.1, seed)
    colors = column_coloring(pattern, GreedyColoring(order, seed=seed))
    dense = pattern.to_dense()
    for c in range(colors.max() + 1):
        assert (dense[:, colors == c].sum(axis=1) <= 1).all()


@pytest.mark.parametrize("order", ALL_ORDERS)
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("density", [0.12, 0.6])
def test_star_and_acyclic_colourings_are_valid_and_recover_the_hessian(order, seed, density):
    pattern = random_symmetric(30, density, seed)
    values = symmetric_values(pattern, seed)
    star = star_coloring(pattern, GreedyColoring(order, seed=seed))
    acyclic = acyclic_coloring(pattern, GreedyColoring(order, seed=seed))
    assert is_star_colouring(pattern, star)
    assert is_acyclic_colouring(pattern, acyclic)
    for colors, recovery in ((star, star_recovery(pattern, star)), (acyclic, substitution_recovery(pattern, acyclic))):
        assert recovery is not None
        hvps = seeds(colors, 30, torch.float64, torch.device("cpu")) @ torch.from_numpy(values)  # H symmetric
        recovered = TorchRecovery(recovery, torch.device("cpu")).values(hvps.reshape(-1))
        assert torch.allclose(recovered, torch.from_numpy(values[pattern.row_ids(), pattern.indices]))
    chosen = symmetric_coloring(pattern, GreedyColoring(order, seed=seed, decompression="substitution"))
    assert chosen.max() <= star.max()  # substitution never needs more colours than star


@pytest.mark.parametrize("order", ["natural", "smallest_last"])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("density", [0.05, 0.12, 0.3])
def test_postprocessed_acyclic_colourings_recover_the_hessian(order, seed, density):
    # Patterns without a full diagonal: post-processing may leave colours out of every HVP; the
    # substitution must still recover every entry, with no more colours than before.
    pattern = random_symmetric(30, density, seed, diagonal=False) if seed % 2 else star_forest(30, density, seed)
    values = symmetric_values(pattern, seed)
    plain = symmetric_coloring(pattern, GreedyColoring(order, seed=seed, decompression="substitution"))
    processed = symmetric_coloring(pattern, GreedyColoring(order, seed=seed, postprocessing=True, decompression="substitution"))
    assert processed.max() <= plain.max()
    assert np.array_equal(processed >= 0, np.isin(plain, np.unique(plain[processed >= 0])))  # whole colours go
    recovery = substitution_recovery(pattern, processed)
    hvps = seeds(processed, 30, torch.float64, torch.device("cpu")) @ torch.from_numpy(values)
    recovered = TorchRecovery(recovery, torch.device("cpu")).values(hvps.reshape(-1))
    assert torch.allclose(recovered, torch.from_numpy(values[pattern.row_ids(), pattern.indices]))


def star_forest(n: int, extra: float, seed: int) -> IndexSets:
    """Stars around four centres (some with a diagonal entry), and a few random edges."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((n, n), dtype=bool)
    centres = rng.choice(n, size=4, replace=False)
    for v in range(n):
        if v not in centres:
            c = centres[rng.integers(4)]
            mask[v, c] = mask[c, v] = True
    noise = np.triu(rng.random((n, n)) < extra / 4, 1)
    mask |= noise | noise.T
    mask[centres, centres] = rng.random(4) < 0.5
    return IndexSets.from_dense(mask)


def test_postprocessed_acyclic_colouring_known_counts_and_refusals():
    from torchdi.sparsity.coloring import postprocess_acyclic

    star = np.zeros((6, 6), dtype=bool)
    star[0, 1:] = star[1:, 0] = True
    leaves_only = IndexSets.from_dense(star)  # K_{1,5} without diagonal: the centre's colour alone
    coloring = GreedyColoring(postprocessing=True, decompression="substitution")
    assert symmetric_coloring(leaves_only, coloring).tolist() == [0, -1, -1, -1, -1, -1]
    centre_diagonal = star.copy()
    centre_diagonal[0, 0] = True
    assert symmetric_coloring(IndexSets.from_dense(centre_diagonal), coloring).max() + 1 == 1
    full_diagonal = IndexSets.from_dense(star | np.eye(6, dtype=bool))  # every colour is read on the diagonal
    assert symmetric_coloring(full_diagonal, coloring).max() + 1 == 2
    path = IndexSets.from_dense(banded(6, 1, 1) & ~np.eye(6, dtype=bool))  # interior vertices see two of the other colour
    assert postprocess_acyclic(path, np.array([0, 1, 0, 1, 0, 1])).tolist() == [0, 1, 0, 1, 0, 1]
    # Colourings substitution cannot use: neighbours both in no seed, a neutral vertex inside a tree.
    with pytest.raises(ValueError, match="not proper"):
        substitution_recovery(path, np.array([0, -1, -1, 0, 1, 0]))
    with pytest.raises(ValueError, match="not a leaf"):
        substitution_recovery(path, np.array([0, -1, 0, 1, 0, 1]))
    with pytest.raises(ValueError, match="diagonal entry of a vertex in no seed"):
        substitution_recovery(full_diagonal, np.array([0, -1, -1, -1, -1, -1]))


@pytest.mark.parametrize("order", ALL_ORDERS)
@pytest.mark.parametrize("seed", range(3))
def test_bidirectional_colouring_recovers_the_jacobian(order, seed):
    pattern = random_pattern(25, 30, 0.12, seed)
    dense = pattern.to_dense()
    dense[0, :] = dense[:, 0] = True  # a dense row and column: bidirectional pays
    pattern = IndexSets.from_dense(dense)
    jac = torch.from_numpy(np.random.default_rng(seed).standard_normal(dense.shape) * dense)
    columns, rows = bidirectional_coloring(pattern, GreedyColoring(order, seed=seed))
    forward = (jac @ seeds(columns, 30, torch.float64, torch.device("cpu")).T).T  # (nf, m)
    reverse = seeds(rows, 25, torch.float64, torch.device("cpu")) @ jac  # (nr, n)
    flat = torch.cat([forward.reshape(-1), reverse.reshape(-1)])
    recovered = TorchRecovery(bidirectional_recovery(pattern, columns, rows), torch.device("cpu")).values(flat)
    assert torch.equal(recovered, jac[pattern.row_ids(), pattern.indices])
    passes = columns.max() + rows.max() + 2
    assert passes <= min(column_coloring(pattern, GreedyColoring()).max(), column_coloring(pattern.transpose(), GreedyColoring()).max()) + 1


@pytest.mark.parametrize("order", ALL_ORDERS)
def test_colour_counts_on_known_structures(order):
    coloring = GreedyColoring(order)
    # banded jacobians: the band width, whatever the order (a clique of that many columns)
    for lower, upper in ((0, 1), (1, 1), (2, 2), (0, 4)):
        assert column_coloring(IndexSets.from_dense(banded(300, lower, upper)), coloring).max() + 1 == lower + upper + 1
    assert column_coloring(IndexSets.full(40, 60), coloring).max() + 1 == 60  # dense: one column per colour
    dense = IndexSets.full(300, 300)  # a dense hessian: n colours, without a search of n^3 steps
    assert star_coloring(dense, coloring).max() + 1 == 300 and acyclic_coloring(dense, coloring).max() + 1 == 300
    # a tridiagonal hessian: 3 colours for star colouring, 2 for acyclic (a path is a tree)
    tridiagonal = IndexSets.from_dense(banded(1000, 1, 1))
    if order in ("natural", "largest_first", "smallest_last", "incidence_degree"):
        assert star_coloring(tridiagonal, coloring).max() + 1 == 3
    assert acyclic_coloring(tridiagonal, coloring).max() + 1 <= 3
    assert star_coloring(IndexSets.from_dense(arrowhead(50)), coloring).max() + 1 == 2  # distance-2 would need 50
    # bidirectional: a dense first row and column, n passes in either single direction
    columns, rows = bidirectional_coloring(IndexSets.from_dense(arrowhead(200)), coloring)
    assert columns.max() + rows.max() + 2 <= 3


def test_colouring_orders_best_of():
    pattern = random_symmetric(60, 0.08, 3)
    each = [star_coloring(pattern, GreedyColoring(o, seed=1)).max() for o in ORDERS]
    assert star_coloring(pattern, GreedyColoring(tuple(ORDERS), seed=1)).max() == min(each)
    acyclic = acyclic_coloring(IndexSets.from_dense(banded(1000, 1, 1)), GreedyColoring())
    assert acyclic.max() + 1 == 2


def test_arrowhead_1e4_in_three_passes():
    n = 10_000
    rows = np.concatenate([np.zeros(n), np.arange(n), np.arange(1, n)])
    cols = np.concatenate([np.arange(n), np.arange(n), np.zeros(n - 1)])
    pattern = IndexSets.from_pairs(rows, cols, n, n)
    columns, row_colors = bidirectional_coloring(pattern, GreedyColoring())
    assert columns.max() + row_colors.max() + 2 <= 3
    recovery = bidirectional_recovery(pattern, columns, row_colors)  # every entry readable
    assert recovery.direct.size == pattern.nnz


def test_postprocessing_drops_unneeded_colours():
    # A hessian pattern without diagonal: a star K_{1,5}: colours {0: centre, 1: leaves}; every
    # entry can be read from the centre's colour alone (at the leaves).
    star = np.zeros((6, 6), dtype=bool)
    star[0, 1:] = star[1:, 0] = True
    pattern = IndexSets.from_dense(star)
    plain = symmetric_coloring(pattern, GreedyColoring())
    processed = symmetric_coloring(pattern, GreedyColoring(postprocessing=True))
    assert plain.max() + 1 == 2 and processed.max() + 1 == 1
    assert star_recovery(pattern, processed) is not None
    with_diagonal = IndexSets.from_dense(star | np.eye(6, dtype=bool))
    assert symmetric_coloring(with_diagonal, GreedyColoring(postprocessing=True)).max() + 1 == 2


def test_coloring_options_are_checked():
    with pytest.raises(ValueError, match="order must be one of"):
        torchdi.GreedyColoring(order="alphabetical")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="order must be one of"):
        torchdi.GreedyColoring(order=())
    with pytest.raises(ValueError, match="decompression must be 'direct' or 'substitution'"):
        torchdi.GreedyColoring(decompression="solve")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="postprocessing must be a bool"):
        torchdi.GreedyColoring(postprocessing=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="MixedMode: reverse must be a dense torchdi backend"):
        torchdi.MixedMode(torchdi.AutoFunc(), torchdi.AutoSparse())
    with pytest.raises(TypeError, match="dense must be a dense torchdi backend"):
        torchdi.AutoSparse(torchdi.AutoSparse())
    with pytest.raises(TypeError, match="sparsity must be"):
        torchdi.AutoSparse(torchdi.AutoFunc(), sparsity="tracer")


# ----------------------------------------------------------------------------------------------
# Decompression against dense results


# AutoFunc runs the same scenarios in test_sparse_scenarios_pass_test_differentiation.
@pytest.mark.parametrize("dense", [torchdi.AutoAutograd(), torchdi.AutoFiniteDiff()], ids=["autograd", "finitediff"])
@pytest.mark.parametrize("scenario", sparse_scenarios(sizes=(8,)), ids=lambda s: s.name)
def test_sparse_results_equal_dense(dense, scenario):
    backend = torchdi.AutoSparse(dense)
    x2, _, contexts2 = scenario.second_point()
    if scenario.op == "jacobian":
        prep = torchdi.prepare_jacobian(scenario.f, backend, x2, *contexts2)
        y, jac = torchdi.value_and_jacobian(scenario.f, backend, scenario.x, prep=prep)
        assert torch.allclose(y, scenario.f(scenario.x))
    else:
        prep = torchdi.prepare_hessian(scenario.f, backend, x2, *contexts2)
        y, grad, jac = torchdi.value_gradient_and_hessian(scenario.f, backend, scenario.x, prep=prep)
        assert torch.allclose(grad, torchdi.gradient(scenario.f, torchdi.AutoAutograd(), scenario.x))
    assert jac.layout == torch.sparse_csr
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if isinstance(dense, torchdi.AutoFiniteDiff) else {}
    assert torch.allclose(jac.to_dense(), scenario.reference().reshape(jac.shape), **tolerance)
    assert prep.num_compilations == 0


def test_reverse_mode_when_rows_need_fewer_colours():
    f = lambda x: x.reshape(10, 10).sum(1)  # noqa: E731 - 10 rows, each touching 10 columns
    prep = torchdi.prepare_jacobian(f, torchdi.AutoSparse(torchdi.AutoFunc()), torch.ones(100))
    assert (prep.sparse_mode, prep.ncolors) == ("reverse", 1)
    x = torch.rand(100)
    assert torch.equal(torchdi.jacobian(f, torchdi.AutoSparse(torchdi.AutoFunc()), x, prep=prep).to_dense(), dense_jacobian(f, x))


def test_prep_exposes_pattern_colours_and_groups():
    prep = torchdi.prepare_jacobian(diff_square, torchdi.AutoSparse(torchdi.AutoFunc()), torch.rand(6))
    assert prep.ncolors == 2 and prep.sparse_mode == "forward"
    assert prep.sparsity_pattern.layout == torch.sparse_csr and prep.sparsity_pattern.dtype == torch.bool
    assert prep.colors.tolist() == [0, 1, 0, 1, 0, 1]
    assert [g.tolist() for g in prep.groups] == [[0, 2, 4], [1, 3, 5]]
    with pytest.raises(AttributeError):
        _ = prep.no_such_attribute


def test_other_operators_pass_through_to_the_dense_backend():
    backend = torchdi.AutoSparse(torchdi.AutoFunc())
    x = torch.rand(5)
    assert torch.allclose(torchdi.gradient(chained_rosenbrock, backend, x), torchdi.gradient(chained_rosenbrock, torchdi.AutoFunc(), x))
    (dy,) = torchdi.pushforward(diff_square, backend, x, (torch.ones(5),))
    assert torch.allclose(dy, dense_jacobian(diff_square, x).sum(1))


def test_function_independent_of_x_gives_an_empty_jacobian():
    jac = torchdi.jacobian(lambda x: torch.ones(3), torchdi.AutoSparse(torchdi.AutoFunc()), torch.rand(4))
    assert jac.shape == (3, 4) and jac.values().numel() == 0


def test_out_is_filled_in_place():
    backend = torchdi.AutoSparse(torchdi.AutoFunc())
    x = torch.rand(8, 8, 2, dtype=torch.float64)
    prep = torchdi.prepare_jacobian(brusselator, backend, x)
    out = torchdi.jacobian(brusselator, backend, x, prep=prep)
    values = out.values()
    x2 = x + 0.3
    returned = torchdi.jacobian(brusselator, backend, x2, prep=prep, out=out)
    assert returned is out
    assert out.values().data_ptr() == values.data_ptr()
    assert torch.allclose(out.to_dense(), dense_jacobian(brusselator, x2))
    _, jac = torchdi.value_and_jacobian(brusselator, backend, x, prep=prep, out=out)
    assert jac is out and torch.allclose(out.to_dense(), dense_jacobian(brusselator, x))
    wrong = torch.eye(128, dtype=torch.float64).to_sparse_csr()
    with pytest.raises(ValueError, match=r"same\s+sparsity pattern"):
        torchdi.jacobian(brusselator, backend, x, prep=prep, out=wrong)


def test_strict_check_still_applies():
    backend = torchdi.AutoSparse(torchdi.AutoFunc())
    prep = torchdi.prepare_jacobian(diff_square, backend, torch.rand(6))
    with pytest.raises(torchdi.PreparationMismatchError, match="x: mismatch"):
        torchdi.jacobian(diff_square, backend, torch.rand(7), prep=prep)


# ----------------------------------------------------------------------------------------------
# Compiled dense backend: one program, never recompiled


def test_compiled_dense_backend_compiles_once():
    backend = torchdi.AutoSparse(torchdi.AutoCompile(compiler="aot_eager"))
    x = torch.rand(30, dtype=torch.float64)
    prep = torchdi.prepare_jacobian(diff_square, backend, x)
    assert (prep.num_compilations, prep.ncolors) == (1, 2)
    for shift in (0.1, 0.2, 0.3):
        jac = torchdi.jacobian(diff_square, backend, x + shift, prep=prep)
        assert torch.allclose(jac.to_dense(), dense_jacobian(diff_square, x + shift))
    assert prep.num_compilations == 1
    hprep = torchdi.prepare_hessian(chained_rosenbrock, backend, torch.rand(20, dtype=torch.float64))
    compiled = hprep.num_compilations  # one program: the compressed HVPs, the value and the gradient
    for _ in range(2):
        z = torch.rand(20, dtype=torch.float64)
        hess = torchdi.hessian(chained_rosenbrock, backend, z, prep=hprep)
        assert torch.allclose(hess.to_dense(), torch.autograd.functional.hessian(chained_rosenbrock, z))
        value, grad, hess = torchdi.value_gradient_and_hessian(chained_rosenbrock, backend, z, prep=hprep)
        assert torch.allclose(value, chained_rosenbrock(z))
        assert torch.allclose(grad, torch.func.grad(chained_rosenbrock)(z))
    assert hprep.num_compilations == compiled == 1


# ----------------------------------------------------------------------------------------------
# Goals of issue 11 (counts, not speed)


def test_brusselator_32_pattern_and_colours():
    x = 1 + 0.1 * torch.rand(32, 32, 2)
    prep = torchdi.prepare_jacobian(brusselator, torchdi.AutoSparse(torchdi.AutoFunc()), x)
    assert np.array_equal(prep.sparsity_pattern.to_dense().numpy(), true_pattern("brusselator", (32, 32, 2)))
    assert prep.ncolors <= 8


def test_rosenbrock_1e5_hessian_in_three_colours():
    n = 100_000
    x = 1 + 0.1 * torch.rand(n, dtype=torch.float64)
    prep = torchdi.prepare_hessian(chained_rosenbrock, torchdi.AutoSparse(torchdi.AutoFunc()), x)
    assert prep.ncolors == 3
    hess = torchdi.hessian(chained_rosenbrock, torchdi.AutoSparse(torchdi.AutoFunc()), x, prep=prep)
    crow, col, values = hess.crow_indices(), hess.col_indices(), hess.values()
    rows = torch.repeat_interleave(torch.arange(n), crow.diff())
    diagonal = torch.full((n,), 0.0, dtype=torch.float64)
    diagonal[:-1] += 1200 * x[:-1] ** 2 - 400 * x[1:] + 2
    diagonal[1:] += 200
    on_diagonal = rows == col
    assert torch.allclose(values[on_diagonal], diagonal)
    upper = col == rows + 1
    assert torch.allclose(values[upper], -400 * x[:-1])
    assert values.numel() == 3 * n - 2


# ----------------------------------------------------------------------------------------------
# Property: the detected pattern covers the jacobian's non-zeros, and sparse equals dense


@st.composite
def structured_functions(draw):
    n = draw(st.integers(3, 12))
    m = draw(st.integers(1, 12))
    a = np.array(draw(st.lists(st.integers(0, n - 1), min_size=m, max_size=m)))
    b = np.array(draw(st.lists(st.integers(0, n - 1), min_size=m, max_size=m)))
    shift = draw(st.integers(-2, 2))
    kind = draw(st.sampled_from(["product", "sin", "roll", "cumsum"]))
    ia, ib = torch.from_numpy(a), torch.from_numpy(b)

    def f(x):
        if kind == "product":
            return x[ia] * x[ib] + x[ia] ** 2
        if kind == "sin":
            return torch.sin(x[ia] - x.roll(shift)[ib])
        if kind == "roll":
            return torch.cat([x.roll(shift) * x, x[ia]])
        return torch.cumsum(x, 0)[ib] * x[ia]

    return f, n


@given(structured_functions(), st.integers(0, 2**16))
def test_pattern_covers_dense_nonzeros(case, seed):
    f, n = case
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=generator, dtype=torch.float64)
    backend = torchdi.AutoSparse(torchdi.AutoFunc())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prep = torchdi.prepare_jacobian(f, backend, torch.randn(n, generator=generator, dtype=torch.float64))
        jac = torchdi.jacobian(f, backend, x, prep=prep)
    dense = dense_jacobian(f, x)
    pattern = prep.sparsity_pattern.to_dense()
    assert not ((dense != 0) & ~pattern).any()
    assert torch.allclose(jac.to_dense(), dense)


def test_sparse_benchmark_is_a_bench_suite():
    import torchdi.__main__ as cli

    assert cli.build_parser().parse_args(["bench", "--suite", "sparse"]).suite == "sparse"
    assert callable(cli._benchmark_main("sparse"))


def test_sparse_scenarios_pass_test_differentiation():
    # Prepared at one point, run at another, inputs intact, no recompilation, no reference kept.
    from torchdi.testing import test_differentiation

    test_differentiation([torchdi.AutoSparse(torchdi.AutoFunc())], sparse_scenarios(sizes=(8,)), rtol=1e-6, atol=1e-8)


# ----------------------------------------------------------------------------------------------
# MixedMode, substitution, post-processing through the public API (issue 26)


def arrow(x):
    return torch.cat([(x**2).sum().reshape(1), x[1:] * x[0] + x[1:] ** 3])


def test_mixed_mode_sparse_jacobian_equals_dense():
    backend = torchdi.AutoSparse(torchdi.MixedMode(torchdi.AutoFunc(), torchdi.AutoFunc()))
    x = torch.rand(200, dtype=torch.float64) + 0.5
    prep = torchdi.prepare_jacobian(arrow, backend, torch.rand(200, dtype=torch.float64))
    assert prep.sparse_mode == "mixed" and prep.ncolors <= 3  # n = 200 in either single direction
    y, jac = torchdi.value_and_jacobian(arrow, backend, x, prep=prep)
    assert torch.allclose(y, arrow(x))
    assert torch.allclose(jac.to_dense(), dense_jacobian(arrow, x))
    one_sided = torchdi.prepare_jacobian(arrow, torchdi.AutoSparse(torchdi.AutoFunc()), x)
    assert one_sided.ncolors == 200
    # A pattern where one direction is as good keeps a single kind of pass.
    prep = torchdi.prepare_jacobian(diff_square, backend, torch.rand(9, dtype=torch.float64))
    assert prep.sparse_mode == "forward" and prep.ncolors == 2


def test_mixed_mode_compiled_compiles_once_and_mixes_backends():
    backend = torchdi.AutoSparse(torchdi.MixedMode(torchdi.AutoCompile(compiler="aot_eager"), torchdi.AutoAutograd()))
    prep = torchdi.prepare_jacobian(arrow, backend, torch.rand(50, dtype=torch.float64))
    assert prep.sparse_mode == "mixed" and prep.num_compilations == 1
    for _ in range(2):
        x = torch.rand(50, dtype=torch.float64) + 0.5
        assert torch.allclose(torchdi.jacobian(arrow, backend, x, prep=prep).to_dense(), dense_jacobian(arrow, x))
    assert prep.num_compilations == 1


def test_mixed_mode_dense_operators():
    backend = torchdi.MixedMode(torchdi.AutoFunc(), torchdi.AutoAutograd())
    x = torch.rand(5, dtype=torch.float64)
    wide = lambda x: torch.cat([x, x**2, x.sin()])  # noqa: E731 - 15 outputs, 5 inputs: forward mode
    assert torch.allclose(torchdi.jacobian(wide, backend, x), dense_jacobian(wide, x).reshape(15, 5))
    assert torch.allclose(torchdi.jacobian(arrow, backend, x), dense_jacobian(arrow, x))
    assert torch.allclose(torchdi.gradient(chained_rosenbrock, backend, x), torchdi.gradient(chained_rosenbrock, torchdi.AutoAutograd(), x))
    (dy,) = torchdi.pushforward(wide, backend, x, (torch.ones(5, dtype=torch.float64),))
    assert torch.allclose(dy, dense_jacobian(wide, x).sum(1))
    func = torchdi.MixedMode(torchdi.AutoFunc(), torchdi.AutoFunc())
    assert torch.allclose(torchdi.hessian(chained_rosenbrock, func, x), torch.autograd.functional.hessian(chained_rosenbrock, x))
    assert torchdi.check_available(func)


@pytest.mark.parametrize("dense", [torchdi.AutoFunc(), torchdi.AutoCompile(compiler="aot_eager")], ids=["func", "compile"])
def test_substitution_hessian_equals_dense(dense):
    backend = torchdi.AutoSparse(dense, coloring=torchdi.GreedyColoring(decompression="substitution"))
    x = torch.rand(30, dtype=torch.float64) + 0.5
    prep = torchdi.prepare_hessian(chained_rosenbrock, backend, torch.rand(30, dtype=torch.float64))
    assert (prep.sparse_mode, prep.ncolors) == ("substitution", 2)  # star colouring needs 3
    y, grad, hess = torchdi.value_gradient_and_hessian(chained_rosenbrock, backend, x, prep=prep)
    assert torch.allclose(y, chained_rosenbrock(x))
    assert torch.allclose(hess.to_dense(), torch.autograd.functional.hessian(chained_rosenbrock, x))
    assert torch.allclose(grad, torchdi.gradient(chained_rosenbrock, torchdi.AutoAutograd(), x))
    x32 = x.float()
    prep32 = torchdi.prepare_hessian(chained_rosenbrock, backend, x32)
    hess32 = torchdi.hessian(chained_rosenbrock, backend, x32, prep=prep32)
    assert hess32.dtype == torch.float32
    assert torch.allclose(hess32.to_dense(), torch.autograd.functional.hessian(chained_rosenbrock, x32), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("scenario", [s for s in sparse_scenarios(sizes=(8,)) if s.op == "hessian"], ids=lambda s: s.name)
def test_substitution_never_more_colours_than_star(scenario):
    star = torchdi.prepare_hessian(scenario.f, torchdi.AutoSparse(torchdi.AutoFunc()), scenario.x)
    backend = torchdi.AutoSparse(torchdi.AutoFunc(), coloring=torchdi.GreedyColoring(decompression="substitution"))
    substitution = torchdi.prepare_hessian(scenario.f, backend, scenario.x)
    assert substitution.ncolors <= star.ncolors
    hess = torchdi.hessian(scenario.f, backend, scenario.x, prep=substitution)
    assert torch.allclose(hess.to_dense(), scenario.reference().reshape(hess.shape))


def test_no_csr_beta_warning_from_torchdi_results():
    # torch warns once per process: check in a fresh one.
    import subprocess
    import sys

    code = (
        "import warnings, torch, torchdi\n"
        "warnings.filterwarnings('error', message='.*Sparse CSR')\n"
        "b = torchdi.AutoSparse(torchdi.AutoFunc())\n"
        "p = torchdi.prepare_jacobian(torch.diff, b, torch.ones(5))\n"
        "torchdi.jacobian(torch.diff, b, torch.ones(5), prep=p)\n"
        "torchdi.hessian(lambda x: (x**3).sum(), b, torch.ones(4))\n"
        "p.sparsity_pattern\n"
        "print('clean')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "clean", done.stderr


@pytest.mark.parametrize("band", [5, 10, 20])
def test_colour_counts_on_difftest_banded_scenarios(band):
    # DifferentiationInterfaceTest's sparse scenarios: A * x.^2 with an upper banded A (n = 50) and
    # the quadratic form dot(x.^2, A, x.^2), whose hessian has half-bandwidth `band`.
    i = np.arange(50)
    upper = IndexSets.from_dense((i[None, :] - i[:, None] >= 0) & (i[None, :] - i[:, None] <= band))
    assert column_coloring(upper, GreedyColoring()).max() + 1 == band + 1  # optimal: a row holds band + 1
    hessian = IndexSets.from_dense(np.abs(i[:, None] - i[None, :]) <= band)
    assert acyclic_coloring(hessian, GreedyColoring()).max() + 1 == band + 1  # optimal: a clique of band + 1
    assert star_coloring(hessian, GreedyColoring()).max() + 1 <= 2 * band + 1


def test_postprocessing_refuses_a_colouring_that_is_not_star():
    from torchdi.sparsity.coloring import postprocess_symmetric

    path = IndexSets.from_dense(banded(4, 1, 1) & ~np.eye(4, dtype=bool))  # 0-1-2-3 in two colours
    with pytest.raises(ValueError, match="no colour can be read from"):
        postprocess_symmetric(path, np.array([0, 1, 0, 1]))
    assert star_recovery(path, np.array([0, 1, 0, 1])) is None


def _sparse_rule_2_case(family):
    def vector(x):
        return x[1:] * x[:-1] + x[1:].sin()

    def scalar(x):
        return (vector(x) ** 2).sum()

    x0, x1 = torch.linspace(-1.0, 1.0, 6), torch.linspace(-0.5, 1.5, 6)
    tangents = {"pullback": (torch.ones(5),), "pushforward": (torch.ones(6),), "hvp": (torch.ones(6),)}.get(family)
    f = scalar if family in ("gradient", "hvp", "hessian") else vector
    return f, x0, x1, tangents


@pytest.mark.parametrize("family", ["jacobian", "hessian", "gradient", "pullback", "pushforward", "hvp", "derivative"])
def test_rule_2_on_compiled_sparse_both_variants(family):
    # After prepare_*, neither the plain operator nor its value_ variant compiles anything.
    row = FAMILIES[family]
    backend = torchdi.AutoSparse(torchdi.AutoCompile(compiler="aot_eager"))
    if family == "derivative":
        f, x0, x1, tangents = (lambda x: x.sin() * x), torch.tensor(0.3), torch.tensor(0.7), None
    else:
        f, x0, x1, tangents = _sparse_rule_2_case(family)
    head0 = (x0,) if tangents is None else (x0, tangents)
    head1 = (x1,) if tangents is None else (x1, tangents)
    prep = getattr(torchdi, f"prepare_{family}")(f, backend, *head0)
    before = prep.num_compilations
    assert before >= 1
    for name in (row.operator, row.value_operator):
        got = getattr(torchdi, name)(f, backend, *head1, prep=prep)
        want = getattr(torchdi, name)(f, torchdi.AutoFunc(), *head1)
        got, want = (got,) if not isinstance(got, tuple) else got, (want,) if not isinstance(want, tuple) else want
        for g, w in zip(got, want):
            g = g.to_dense() if isinstance(g, torch.Tensor) and g.layout == torch.sparse_csr else g
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
        assert prep.num_compilations == before, name


def test_substitution_with_bidirectional_is_refused_clearly():
    # Not implemented: an error naming what works, never the option silently dropped.
    mixed = torchdi.MixedMode(torchdi.AutoFunc(), torchdi.AutoFunc())
    backend = torchdi.AutoSparse(mixed, coloring=torchdi.GreedyColoring(decompression="substitution"))
    with pytest.raises(ValueError, match=r"bidirectional colouring \(MixedMode jacobians\).*GreedyColoring\(decompression='direct'\)"):
        torchdi.prepare_jacobian(arrow, backend, torch.rand(20, dtype=torch.float64))
    # The same backend's hessians keep substitution; one-sided jacobians are read directly.
    x = torch.rand(8, dtype=torch.float64) + 0.5
    prep = torchdi.prepare_hessian(chained_rosenbrock, backend, x)
    assert prep.sparse_mode == "substitution"
    assert torch.allclose(torchdi.hessian(chained_rosenbrock, backend, x, prep=prep).to_dense(), torch.autograd.functional.hessian(chained_rosenbrock, x))
    one_sided = torchdi.AutoSparse(torchdi.AutoFunc(), coloring=torchdi.GreedyColoring(decompression="substitution"))
    assert torch.allclose(torchdi.jacobian(arrow, one_sided, x).to_dense(), dense_jacobian(arrow, x))


def test_substitution_with_postprocessing_hessian_equals_dense():
    # x0 * sum(x[1:]) + x0^3: an arrowhead hessian with one diagonal entry: one HVP (star and
    # plain acyclic colourings need two), recovered by substitution, equal to the dense hessian;
    # the colouring round-trips through prep.known_coloring.
    def arrowhead(x):
        return x[0] * x[1:].sum() + x[0] ** 3

    x = torch.rand(12, dtype=torch.float64) + 0.5
    backend = torchdi.AutoSparse(torchdi.AutoFunc(), coloring=torchdi.GreedyColoring(postprocessing=True, decompression="substitution"))
    prep = torchdi.prepare_hessian(arrowhead, backend, x)
    assert (prep.sparse_mode, prep.ncolors) == ("substitution", 1)
    want = torch.autograd.functional.hessian(arrowhead, x)
    assert torch.allclose(torchdi.hessian(arrowhead, backend, x, prep=prep).to_dense(), want)
    again = torchdi.AutoSparse(torchdi.AutoFunc(), coloring=prep.known_coloring)
    assert torch.allclose(torchdi.hessian(arrowhead, again, x).to_dense(), want)


# ----------------------------------------------------------------------------------------------
# Colourings as data: prep.known_coloring, KnownColoring, coloring=


def _round_trips(known):
    """The colouring after pickle and after torch.save/torch.load(weights_only=True) of to_dict()."""
    import io
    import pickle

    buffer = io.BytesIO()
    torch.save(known.to_dict(), buffer)
    buffer.seek(0)
    return pickle.loads(pickle.dumps(known)), torchdi.KnownColoring.from_dict(torch.load(buffer, weights_only=True))


def wide(x):  # 3 rows, 12 columns, each row dense: reverse mode (3 colours) beats forward (12)
    return torch.stack([x.sum(), (x**2).sum(), x.sin().sum()])


@pytest.mark.parametrize(
    ("operator", "f", "dense", "coloring", "n", "mode"),
    [
        ("jacobian", diff_square, torchdi.AutoFunc(), torchdi.GreedyColoring(), 9, "forward"),
        ("jacobian", wide, torchdi.AutoFunc(), torchdi.GreedyColoring(), 12, "reverse"),
        ("jacobian", arrow, torchdi.MixedMode(torchdi.AutoFunc(), torchdi.AutoFunc()), torchdi.GreedyColoring(), 30, "mixed"),
        ("hessian", chained_rosenbrock, torchdi.AutoFunc(), torchdi.GreedyColoring(), 10, "star"),
        ("hessian", chained_rosenbrock, torchdi.AutoFunc(), torchdi.GreedyColoring(decompression="substitution"), 10, "substitution"),
    ],
)
def test_known_coloring_round_trips_and_skips_detection(operator, f, dense, coloring, n, mode, monkeypatch):
    x = torch.rand(n, dtype=torch.float64) + 0.5
    prepare = torchdi.prepare_jacobian if operator == "jacobian" else torchdi.prepare_hessian
    call = torchdi.jacobian if operator == "jacobian" else torchdi.hessian
    prep = prepare(f, torchdi.AutoSparse(dense, coloring=coloring), x)
    known = prep.known_coloring
    assert prep.sparse_mode == known.mode == mode and known.ncolors == prep.ncolors
    for copy in _round_trips(known):
        assert copy == known and hash(copy) == hash(known)
    pickled, loaded = _round_trips(known)
    # No detection and no colouring: the tracer is never called.
    monkeypatch.setattr("torchdi.engines.sparse.trace_sparsity", lambda *a, **k: pytest.fail("traced"))
    backend = torchdi.AutoSparse(dense, coloring=loaded)
    again = prepare(f, backend, x)
    assert (again.sparse_mode, again.ncolors) == (mode, prep.ncolors)
    assert again.known_coloring is loaded
    assert torch.equal(again.sparsity_pattern.to_dense(), prep.sparsity_pattern.to_dense())
    colors = again.colors if isinstance(again.colors, tuple) else (again.colors,)
    expected = prep.colors if isinstance(prep.colors, tuple) else (prep.colors,)
    assert all(torch.equal(a, b) for a, b in zip(colors, expected))
    want = dense_jacobian(f, x) if operator == "jacobian" else torch.autograd.functional.hessian(f, x)
    assert torch.allclose(call(f, backend, x, prep=again).to_dense(), want.reshape(-1, n))
    assert torchdi.AutoSparse(dense, coloring=pickled) == backend  # equal backends: one engine


def test_known_coloring_serves_f_the_tracer_cannot_trace():
    def f(x):  # data-dependent control flow: TracerSparsity refuses it
        return x[1:] * x[:-1] if x.sum() > 0 else x[1:]

    x = torch.rand(6, dtype=torch.float64)
    prep = torchdi.prepare_jacobian(f, torchdi.AutoSparse(torchdi.AutoFunc(), sparsity=torchdi.DenseSparsity()), x)
    backend = torchdi.AutoSparse(torchdi.AutoFunc(), coloring=prep.known_coloring)  # default TracerSparsity, unused
    assert torch.allclose(torchdi.jacobian(f, backend, x).to_dense(), dense_jacobian(f, x))


def test_known_coloring_errors_name_what_works():
    x = torch.rand(9, dtype=torch.float64)
    known = torchdi.prepare_jacobian(diff_square, torchdi.AutoSparse(torchdi.AutoFunc()), x).known_coloring
    with pytest.raises(ValueError, match=r"for a 8 x 9 matrix, but this jacobian is 9 x 10"):
        torchdi.prepare_jacobian(diff_square, torchdi.AutoSparse(torchdi.AutoFunc(), coloring=known), torch.rand(10))
    with pytest.raises(ValueError, match=r"mode='forward'\) cannot serve a hessian.*'star' or 'substitution'"):
        torchdi.prepare_hessian(chained_rosenbrock, torchdi.AutoSparse(torchdi.AutoFunc(), coloring=known), torch.rand(9))
    # Adjacent columns share a row: one colour cannot hold both.
    bad = torchdi.KnownColoring(known.sets, np.zeros(9, dtype=np.int64), "forward")
    with pytest.raises(ValueError, match="cannot recover every entry of its pattern"):
        torchdi.prepare_jacobian(diff_square, torchdi.AutoSparse(torchdi.AutoFunc(), coloring=bad), x)
    star = torchdi.prepare_hessian(chained_rosenbrock, torchdi.AutoSparse(torchdi.AutoFunc()), x).known_coloring
    with pytest.raises(ValueError, match="cannot recover every entry"):
        torchdi.prepare_hessian(chained_rosenbrock, torchdi.AutoSparse(torchdi.AutoFunc(), coloring=torchdi.KnownColoring(star.sets, np.arange(9) % 2, "star")), x)
    mixed = torchdi.KnownColoring(known.sets, (known.colors[0], np.full(8, -1)), "mixed")
    with pytest.raises(ValueError, match="mode 'mixed' needs a MixedMode"):
        torchdi.prepare_jacobian(diff_square, torchdi.AutoSparse(torchdi.AutoFunc(), coloring=mixed), x)
    with pytest.raises(ValueError, match="mode must be one of"):
        torchdi.KnownColoring(known.sets, known.colors[0], "columns")
    with pytest.raises(ValueError, match=r"colors must be 9 integers >= -1 \(one per column\)"):
        torchdi.KnownColoring(known.sets, np.zeros(8, dtype=np.int64), "forward")
    with pytest.raises(ValueError, match=r"not a KnownColoring\.to_dict"):
        torchdi.KnownColoring.from_dict({"shape": [8, 9]})
    with pytest.raises(TypeError, match="coloring must be GreedyColoring"):
        torchdi.AutoSparse(torchdi.AutoFunc(), coloring="star")
