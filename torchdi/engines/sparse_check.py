"""A numerical check of a traced sparsity pattern against ``f`` itself, at the preparation point.

The tracer reads ``f``'s aten graph; if that graph or one of its rules is wrong, the pattern can
miss a structural non-zero and every later result would silently lack it. So the pattern is
checked once: colour it, compute the compressed products ``J S`` (hessians: ``H S``) together
with one random product ``J v`` in one batched pass of the dense backend (its eager inner
backend for ``AutoCompile``/``AutoXLA``: nothing is compiled), recover ``J`` on the pattern and
compare ``J_pattern v`` with ``J v`` (or, in reverse mode when that needs fewer or cheaper
products, ``w^T J_pattern`` with ``w^T J`` over colour groups of rows). A non-zero outside the pattern changes ``J v`` (it either
adds a term the pattern lacks or is folded into a recovered entry of its colour), so a row that
disagrees beyond rounding is a row the pattern gets wrong. Accidental zeros at this point never
raise a false alarm: the check only looks for non-zeros the pattern lacks.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from torchdi.backends import AutoCompile, AutoFiniteDiff, AutoXLA
from torchdi.runners import BoundFunction, Spec, build_runner, engine_for, replace_spec, warm_up
from torchdi.sparsity.coloring import GreedyColoring, column_coloring
from torchdi.sparsity.decompression import jacobian_recovery
from torchdi.sparsity.index_sets import IndexSets

__all__ = ["rows_missing_nonzeros"]


def rows_missing_nonzeros(
    pattern: IndexSets, dense: Any, f: BoundFunction, spec: Spec, x: torch.Tensor, contexts: tuple[Any, ...], hessian: bool
) -> np.ndarray:
    """The rows (reverse mode: columns) of the jacobian (``hessian``: hessian) of ``f`` at ``x``
    that have a non-zero outside ``pattern``, as far as one random probe shows; empty when the
    pattern holds, or when no probe can be run (the check is then skipped, as before it existed)."""
    backend = dense
    while isinstance(backend, (AutoCompile, AutoXLA)):
        backend = backend.inner
    columns = column_coloring(pattern, GreedyColoring())
    if hessian:
        modes = [("hvp", False, columns)]
    else:
        rows = column_coloring(pattern.transpose(), GreedyColoring())
        native = engine_for(backend).native
        modes = [("pushforward", False, columns), ("pullback", True, rows)]
        # The cheaper direction first. A forward-mode product costs about twice a reverse-mode
        # one (measured with torch.func on CPU: heat equation 12 vs 6.5 ms for 4 products,
        # Brusselator N=32 36 vs 18 ms for 9; functorch's jvp runs many ops through Python
        # decompositions). Finite differences keep their own direction.
        cheaper_reverse = _FORWARD_COST * (_count(columns) + 1) > _count(rows) + 1 and not isinstance(backend, AutoFiniteDiff)
        if "pullback" in native and ("pushforward" not in native or cheaper_reverse):
            modes.reverse()
    for family, by_rows, colors in modes:  # a function only one direction can run gets the other
        try:
            return _probe(pattern, backend, family, by_rows, colors, f, spec, x, contexts, hessian)
        except Exception:  # this direction cannot run f (an op without a batching rule...)
            continue
    return np.zeros(0, dtype=np.int64)


_FORWARD_COST = 2


def _count(colors: np.ndarray) -> int:
    return int(colors.max(initial=-1)) + 1


def _probe(
    pattern: IndexSets, backend: Any, family: str, by_rows: bool, colors: np.ndarray, f: BoundFunction, spec: Spec,
    x: torch.Tensor, contexts: tuple[Any, ...], hessian: bool,
) -> np.ndarray:
    n = spec.x.numel
    m = n if hessian else spec.y.numel
    size, other = (m, n) if by_rows else (n, m)  # colours of the rows in reverse mode
    meta = spec.y if by_rows else spec.x
    ncolors = _count(colors)
    dtype = meta.dtypes[0]
    generator = torch.Generator().manual_seed(0)  # not the global RNG: preparation leaves it alone
    probe = torch.randn(size, generator=generator, dtype=torch.float64).to(dtype=dtype, device=x.device)
    tangents = torch.zeros(ncolors + 1, size, dtype=dtype, device=x.device)
    tangents[torch.from_numpy(colors).to(x.device), torch.arange(size, device=x.device)] = 1
    tangents[ncolors] = probe
    tangents = tangents.reshape(ncolors + 1, *meta.shapes[0])
    runner = build_runner(backend, family, f, replace_spec(spec, n_tangents=ncolors + 1))
    warm_up(runner, x, tangents, contexts)
    products = runner(x, tangents, contexts)[-1].detach().reshape(ncolors + 1, other)
    compressed, wanted = products[:ncolors], products[ncolors]
    gather = torch.from_numpy(jacobian_recovery(pattern, colors, by_rows=by_rows).direct).to(x.device)
    values = compressed.reshape(-1).index_select(0, gather)
    rows = torch.from_numpy(pattern.row_ids()).to(x.device)
    cols = torch.from_numpy(pattern.indices).to(x.device)
    # Forward: (J v)_i over the pattern's row i; reverse: (w^T J)_j over its column j.
    into, along = (cols, rows) if by_rows else (rows, cols)
    terms = values * probe[along]
    got = torch.zeros(other, dtype=terms.dtype, device=x.device).index_add_(0, into, terms)
    scale = torch.zeros(other, dtype=terms.real.dtype, device=x.device).index_add_(0, into, terms.abs())
    scale = scale + wanted.abs()
    # Rounding in the passes grows with the terms summed; finite differences are much coarser.
    eps = torch.finfo(scale.dtype).eps
    finite = isinstance(backend, AutoFiniteDiff)
    rtol = eps**0.25 if finite else 1e3 * eps
    floor = (rtol if finite else 10 * eps) * float(scale.max()) if other else 0.0
    wrong = (wanted - got).abs() > rtol * scale + floor
    return wrong.nonzero().reshape(-1).cpu().numpy()
