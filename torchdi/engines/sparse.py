"""``AutoSparse``: sparse jacobians and hessians from colour-compressed passes of a dense backend.

Preparation (``warm_up``, called once by ``prepare_*``): detect the pattern (``sparsity/``),
colour it (``sparsity/coloring.py``), build the seeds (one 0/1 tangent per colour) and prepare
the dense backend's *batched* runner on them (pushforward or pullback for jacobians, both for
``MixedMode``'s bidirectional colouring, HVP for hessians) with ``n_tangents = ncolors``: on a
compiled backend that is one compiled program, and later calls never recompile. A call runs the
compressed passes and reads every stored entry of the pattern from them
(``sparsity/decompression.py``: gathers at positions fixed at preparation, and prefix sums for
substitution), then wraps the values in a CSR tensor with index tensors of its own (a CSR tensor's
in-place methods write into them), made in the same compiled program on ``AutoCompile``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import time
import warnings
import weakref
from typing import Any, ClassVar

import numpy as np
import torch
from torch.utils import _pytree as pytree

from torchdi.backends import AutoAutograd, AutoCompile, AutoSparse, AutoXLA, MixedMode
from torchdi.cache import Store, store_for
from torchdi.composition import base_type, outer_inner, refuse_compiled_double_backward
from torchdi.engines._compiled import AOT_INDUCTOR, CompiledRunner, compiled_store, program_key
from torchdi.engines.sparse_check import rows_missing_nonzeros
from torchdi.errors import user_stacklevel
from torchdi.families import FAMILIES, MATRIX_FAMILIES
from torchdi.fingerprint import fingerprint
from torchdi.reads import MAX_PLACES, Reads
from torchdi.runners import (
    BoundFunction,
    Spec,
    build_runner,
    check_output_shapes,
    checked_entry,
    engine_for,
    num_compilations,
    register_engine,
    replace_spec,
    warm_up,
    zero_runner,
)
from torchdi.sparsity import decompression
from torchdi.sparsity._private import fused_inductor_options
from torchdi.sparsity.coloring import (
    bidirectional_coloring,
    color_groups,
    column_coloring,
    symmetric_coloring,
)
from torchdi.sparsity.decompression import (
    Recovery,
    TorchRecovery,
    bidirectional_recovery,
    jacobian_recovery,
    star_recovery,
    substitution_recovery,
)
from torchdi.sparsity.dense import DenseSparsity
from torchdi.sparsity.index_sets import IndexSets
from torchdi.sparsity.known import KnownColoring, KnownSparsity, TracedColoring, known_sparsity
from torchdi.sparsity.tracer import TracerSparsity, trace_sparsity
from torchdi.translate import IMMUTABLE_STATIC

__all__ = ["SparseEngine", "SparseRunner"]

logger = logging.getLogger("torchdi")


class SparseEngine:
    """Builds the sparse jacobian and hessian runners; every other family is the dense backend's."""

    native: ClassVar[frozenset[str]] = frozenset()
    # Families whose runner also serves an empty x or f(x) (a CSR result and its prep attributes,
    # rather than the generic dense zero map).
    builds_empty: ClassVar[frozenset[str]] = MATRIX_FAMILIES

    def __init__(self, backend: AutoSparse) -> None:
        self.backend = backend
        self.dense_engine = engine_for(backend.dense)
        self.native = self.dense_engine.native | MATRIX_FAMILIES  # type: ignore[misc]

    @property
    def keeps_static(self) -> bool:
        return bool(self.dense_engine.keeps_static)

    def build(self, family: str, f: Any, spec: Any) -> Any:
        if FAMILIES[family].matrix:
            return SparseRunner(self.backend, family, f, spec, self.dense_engine.native)
        return build_runner(self.backend.dense, family, f, spec)


def dense_sparsity(
    detector: DenseSparsity, default: Any, f: BoundFunction, spec: Spec, x: torch.Tensor, contexts: tuple[Any, ...], hessian: bool
) -> IndexSets:
    """The non-zeros (above ``atol``) of the dense jacobian (``hessian``: hessian) at ``x``, flattened."""
    backend = detector.backend
    if backend is None:
        backend = default
        while isinstance(backend, (AutoCompile, AutoXLA)):
            backend = backend.inner
    runner = build_runner(backend, "hessian" if hessian else "jacobian", f, spec)
    warm_up(runner, x, None, contexts)
    matrix = runner(x, None, contexts)[-1]
    rows = spec.x.numel if hessian else spec.y.numel
    return IndexSets.from_dense((matrix.detach().reshape(rows, spec.x.numel).abs() > detector.atol).cpu())


# --------------------------------------------------------------------------------------------
# Persisted detection and colouring (torchdi.cache)


def _store(backend: AutoSparse) -> Store | None:
    """The cache of this preparation: the dense ``AutoCompile``'s ``cache_dir`` if it names one,
    else ``TORCHDI_CACHE_DIR`` / the default directory; ``None`` when off."""
    return store_for(getattr(backend.dense, "cache_dir", None))


def _context_tensors(contexts: tuple[Any, ...]) -> tuple[torch.Tensor, ...]:
    """The tensors the tracer never reads the values of: context leaves, and the parameters and
    buffers of context modules (it marks them as varying)."""
    found: list[torch.Tensor] = []
    for leaf in pytree.tree_leaves(contexts):
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif isinstance(leaf, torch.nn.Module):
            found += [*leaf.parameters(), *leaf.buffers()]
    return tuple(found)


def _detection_key(backend: AutoSparse, f: BoundFunction, spec: Spec, contexts: tuple[Any, ...], hessian: bool) -> str | None:
    """What the traced pattern depends on: f and everything it reads (code, globals, closure
    cells, helper functions: ``torchdi.fingerprint``), the layouts of x, y and the contexts (the
    tracer reads context tensors' shapes only), the detector, and the operator. ``None``: f reads
    something that cannot be keyed soundly, so the pattern is detected afresh."""
    function = fingerprint(f)
    context_key = fingerprint(contexts, meta_only=_context_tensors(contexts))
    if function is None or context_key is None:
        return None
    return json.dumps([
        "hessian" if hessian else "jacobian", function, context_key, repr(backend.sparsity), np.__version__,
        str(spec.x.spec), [list(s) for s in spec.x.shapes], [str(d) for d in spec.x.dtypes],
        str(spec.y.spec), [list(s) for s in spec.y.shapes], [str(d) for d in spec.y.dtypes],
    ])


def _pack(arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    arrays = {**arrays, "__meta__": np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)}
    np.savez(buffer, **arrays)  # type: ignore[arg-type]  # numpy's stub types **kwds too narrowly
    return buffer.getvalue()


def _unpack(payload: bytes) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
    """The arrays and metadata of an entry, or ``None`` when it does not parse (never pickled
    objects: ``allow_pickle=False``)."""
    try:
        with np.load(io.BytesIO(payload), allow_pickle=False) as data:
            arrays = {name: data[name] for name in data.files}
        meta = json.loads(arrays.pop("__meta__").tobytes())
    except Exception as error:  # a payload that passed the checksum but not numpy: another layout
        logger.debug("torchdi cache: unreadable sparsity entry (%s); detecting afresh", error)
        return None
    return (arrays, meta) if isinstance(meta, dict) else None


def _pattern_from(arrays: dict[str, np.ndarray], meta: dict[str, Any], m: int, n: int) -> IndexSets | None:
    """The persisted pattern, if it is a well-formed ``m x n`` CSR pattern (else ``None``)."""
    try:
        return _checked_pattern(arrays, meta, m, n)
    except (TypeError, ValueError):
        return None


def _checked_pattern(arrays: dict[str, np.ndarray], meta: dict[str, Any], m: int, n: int) -> IndexSets | None:
    indptr, indices = arrays.get("indptr"), arrays.get("indices")
    if indptr is None or indices is None or meta.get("ncols") != n or indptr.shape != (m + 1,):
        return None
    indptr, indices = indptr.astype(np.int64), indices.astype(np.int64)
    if indptr[0] != 0 or indptr[-1] != len(indices) or (np.diff(indptr) < 0).any() or (indices.size and (indices.min() < 0 or indices.max() >= n)):
        return None
    return IndexSets(indptr, indices, n)


def _detect_persisted(
    backend: AutoSparse, f: BoundFunction, spec: Spec, x: torch.Tensor, contexts: tuple[Any, ...], hessian: bool
) -> tuple[IndexSets, tuple[str, ...], bool]:
    """``_detect``, through the cache for ``TracerSparsity``: ``(pattern, fallbacks, loaded)``.

    A loaded pattern is checked against f's own derivative at this x exactly as a freshly traced
    one is (``rows_missing_nonzeros``: one random product); one that misses a non-zero is
    dropped and the pattern traced again. ``KnownSparsity`` needs no detection and
    ``DenseSparsity``'s depends on x's values: neither is persisted."""
    store = _store(backend) if isinstance(backend.sparsity, TracerSparsity) else None
    key = _detection_key(backend, f, spec, contexts, hessian) if store is not None else None
    if store is not None and key is not None:
        payload = store.get("sparsity", key)
        unpacked = _unpack(payload) if payload is not None else None
        n = spec.x.numel
        m = n if hessian else spec.y.numel
        pattern = _pattern_from(*unpacked, m, n) if unpacked is not None else None
        if pattern is not None and unpacked is not None:
            if not rows_missing_nonzeros(pattern, backend.dense, f, spec, x, contexts, hessian).size:
                return pattern, tuple(str(name) for name in unpacked[1].get("fallbacks", ())), True
            logger.debug("torchdi cache: a persisted sparsity pattern misses non-zeros of f at this point; tracing again")
    pattern, fallbacks, dense_fallback = _detect(backend, f, spec, x, contexts, hessian)
    if store is not None and key is not None and not dense_fallback:  # the tracer's warning repeats
        store.put("sparsity", key, _pack(
            {"indptr": pattern.indptr, "indices": pattern.indices}, {"ncols": pattern.ncols, "fallbacks": list(fallbacks)}
        ))
    return pattern, fallbacks, False


def _detect(backend: AutoSparse, f: BoundFunction, spec: Spec, x: torch.Tensor, contexts: tuple[Any, ...], hessian: bool) -> tuple[IndexSets, tuple[str, ...], bool]:
    """The pattern, the ops the tracer had no rule for, and whether the tracer's pattern failed
    its check and the dense pattern replaced it."""
    n = spec.x.numel
    m = n if hessian else spec.y.numel
    detector = backend.sparsity
    if isinstance(detector, KnownSparsity):
        y_shape = tuple(spec.x.shapes[0]) if hessian else tuple(spec.y.shapes[0])
        return known_sparsity(detector, m, n, y_shape, tuple(spec.x.shapes[0]), hessian), (), False
    if isinstance(detector, DenseSparsity):
        return dense_sparsity(detector, backend.dense, f, spec, x, contexts, hessian), (), False
    traced = trace_sparsity(f, x, contexts, hessian=hessian)
    pattern = traced.pattern
    if hessian:  # symmetric by nature; the traced gradient graph may only show one side
        pattern = IndexSets.union([pattern, pattern.transpose()])
    missing = rows_missing_nonzeros(pattern, backend.dense, f, spec, x, contexts, hessian)
    if missing.size:
        # A tracer defect (a wrong graph or rule): never a silently missing entry. The dense
        # pattern is the only one that holds for every x (what one probe sees does not).
        warnings.warn(
            f"TracerSparsity: the traced {'hessian' if hessian else 'jacobian'} pattern misses non-zeros that "
            f"f's own derivative shows at the preparation point (in {missing.size} rows or columns): the tracer "
            "got an op of f wrong. Falling back to the dense pattern (every entry): results are correct, "
            "without the sparse speed-up. Pass sparsity=KnownSparsity(pattern) or DenseSparsity() for speed, "
            "and please report f's ops.",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
        return IndexSets.full(m, n), traced.fallbacks, True
    return pattern, traced.fallbacks, False


def _known_pattern(known: KnownColoring, m: int, n: int, hessian: bool) -> IndexSets:
    what = "hessian" if hessian else "jacobian"
    wanted = ("star", "substitution") if hessian else ("forward", "reverse", "mixed")
    if known.mode not in wanted:
        raise ValueError(
            f"AutoSparse: coloring=KnownColoring(mode={known.mode!r}) cannot serve a {what}: a {what} takes mode "
            f"{' or '.join(map(repr, wanted))} (prep.known_coloring of a {what} preparation)"
        )
    if known.shape != (m, n):
        raise ValueError(
            f"AutoSparse: the KnownColoring is for a {known.shape[0]} x {known.shape[1]} matrix, but this {what} is "
            f"{m} x {n} (x.numel() = {n}): pass the prep.known_coloring of a preparation with these shapes"
        )
    return known.sets


def _structurally_orthogonal(pattern: IndexSets, colors: np.ndarray) -> bool:
    """Whether every stored column has a colour and no row holds two columns of one colour."""
    cols = pattern.indices
    if cols.size and colors[cols].min() < 0:
        return False
    k = max(int(colors.max(initial=-1)) + 1, 1)
    keys = pattern.row_ids() * k + colors[cols]
    return bool(np.unique(keys).size == keys.size)


def _no_colors(mode: str, m: int, n: int) -> np.ndarray:
    """The colours of an empty colouring (no pass): every column (rows in reverse mode) in none."""
    return np.full(m if mode == "reverse" else n, -1, dtype=np.int64)


def _statics(contexts: tuple[Any, ...]) -> tuple[tuple[int, Any], ...]:
    """The static context leaves the traced pattern may depend on, with their positions: the
    tracer reads their values (x.roll(k) with Constant(k)), and the strict check of an eager dense
    backend (or strict=False) lets them change, so a call compares them (``IMMUTABLE_STATIC``:
    nothing of the user's is kept alive)."""
    return tuple((i, leaf) for i, leaf in enumerate(pytree.tree_leaves(contexts)) if isinstance(leaf, IMMUTABLE_STATIC))


def _statics_changed(statics: tuple[tuple[int, Any], ...], contexts: tuple[Any, ...]) -> bool:
    """Whether a leaf ``_statics`` recorded holds another value now."""
    leaves = pytree.tree_leaves(contexts)
    for i, value in statics:
        if i >= len(leaves) or type(leaves[i]) is not type(value) or leaves[i] != value:
            return True
    return False


class _PatternCurrent:
    """Whether a runner's pattern is still the one ``f`` gives: nothing it reads and no static
    context value changed since it was traced. A ``strict=False`` variant for another dtype or
    device of ``x`` starts from its preparation's pattern only then: made after such a change, it
    would take the old pattern and record the new state as its own, and never trace again. (A weak
    reference: the runner publishes it, and must not hold itself.)"""

    def __init__(self, runner: weakref.ref[SparseRunner]) -> None:
        self.runner = runner

    def __call__(self, contexts: tuple[Any, ...]) -> bool:
        runner = self.runner()
        return runner is not None and not runner.stale(contexts)


class SparseRunner:
    """The sparse jacobian (``(y, J)``) or hessian (``(y, grad, H)``) runner of one preparation.

    Attributes:
        published: what the ``Prep`` shows as attributes (``sparsity_pattern``, ``ncolors``, ...).
    """

    def __init__(self, backend: AutoSparse, family: str, f: BoundFunction, spec: Spec, dense_native: frozenset[str]) -> None:
        if not spec.x.is_tensor or (family == "jacobian" and not spec.y.is_tensor):
            raise TypeError(f"AutoSparse: {family} needs a tensor x and a tensor f(x)")
        self.backend = backend
        self.family = family
        self.f = f
        self.spec = spec
        self.dense_native = dense_native
        self.published: dict[str, Any] = {}
        self.passes: list[tuple[Any, torch.Tensor]] = []  # (runner, seeds) per kind of pass
        # On AutoCompile: the passes and the decompression as one compiled program
        # (x, seeds, contexts) -> (y, CSR values); None elsewhere.
        self.fused: Any = None
        self.gradient: Any = None
        self.prepared = False
        self.recovery = Recovery(np.zeros(0, dtype=np.int64))
        self.crow = torch.zeros(1, dtype=torch.int64)
        self.col = torch.zeros(0, dtype=torch.int64)
        self.shape = (0, 0)
        self.on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor, TorchRecovery]] = {}
        self.entries: dict[int, Any] = {}
        self.checked_entries: dict[int, Any] = {}
        self.fused_entries: tuple[Any, Any] | None = None  # (plain, checked) entry of the one program
        self.fused_seeds: torch.Tensor | None = None
        # f(x)'s shape, which the pattern is for: a jacobian's calls compare it (a context's value
        # or a global that changes it would otherwise give a matrix of the old size).
        self.y_shape: torch.Size | None = torch.Size(spec.y.shapes[0]) if family == "jacobian" else None
        # What f reads besides x and the contexts (torchdi.reads), watched on every call: the
        # pattern was traced from f as it read them, and a change makes it stale (None: a
        # KnownSparsity or KnownColoring, which the user vouches for, or too much to watch).
        self.reads: Reads | None = None
        # The static context values (ints, strings, Static ...) the pattern was traced with.
        self.statics: tuple[tuple[int, Any], ...] = ()
        self.pattern = IndexSets.empty(0, 0)
        self.earlier_compilations = 0  # of the runners a re-preparation replaced

    @property
    def num_compilations(self) -> int:
        runners = [r for r, _ in self.passes] + [self.fused, self.gradient]
        return self.earlier_compilations + sum(num_compilations(r) for r in runners)

    def _color_jacobian(self, pattern: IndexSets) -> tuple[str, list[tuple[str, np.ndarray]], Recovery]:
        """The jacobian's mode, its passes (family, colours) and recovery."""
        coloring = self.backend.coloring
        forward_ok = "pushforward" in self.dense_native or "pullback" not in self.dense_native
        reverse_ok = "pullback" in self.dense_native or "pushforward" not in self.dense_native
        columns = column_coloring(pattern, coloring) if forward_ok else None
        rows = column_coloring(pattern.transpose(), coloring) if reverse_ok else None
        n_columns = int(columns.max(initial=-1)) + 1 if columns is not None else None
        n_rows = int(rows.max(initial=-1)) + 1 if rows is not None else None
        if isinstance(self.backend.dense, MixedMode) and coloring.decompression == "substitution":
            # Star bicolouring with substitution (acyclic bicolouring) is not implemented: refused
            # rather than silently giving the direct variant the user did not ask for.
            raise ValueError(
                "AutoSparse: bidirectional colouring (MixedMode jacobians) recovers entries directly only; "
                "decompression='substitution' is for hessians. Use GreedyColoring(decompression='direct') for "
                "MixedMode jacobians (hessians may keep substitution in another AutoSparse backend), or a "
                "one-sided dense backend such as AutoFunc()"
            )
        if isinstance(self.backend.dense, MixedMode) and pattern.nnz:
            # Bidirectional only when it needs fewer passes than both one-sided colourings.
            mixed_columns, mixed_rows = bidirectional_coloring(pattern, coloring)
            n_mixed = int(mixed_columns.max(initial=-1)) + int(mixed_rows.max(initial=-1)) + 2
            if n_columns is not None and n_rows is not None and n_mixed < min(n_columns, n_rows):
                recovery = bidirectional_recovery(pattern, mixed_columns, mixed_rows)
                return "mixed", [("pushforward", mixed_columns), ("pullback", mixed_rows)], recovery
        # The mode that needs fewer passes; on a tie forward mode, except over torch.autograd,
        # whose forward mode is a double backward (twice the work, and not compilable).
        prefer_reverse = base_type(self.backend.dense) is AutoAutograd
        if columns is not None and (
            rows is None or n_columns < n_rows or (n_columns == n_rows and not prefer_reverse)  # type: ignore[operator]
        ):
            return "forward", [("pushforward", columns)], jacobian_recovery(pattern, columns, by_rows=False)
        assert rows is not None
        return "reverse", [("pullback", rows)], jacobian_recovery(pattern, rows, by_rows=True)

    def _known_passes(self, known: KnownColoring, pattern: IndexSets, hessian: bool) -> tuple[str, list[tuple[str, np.ndarray]], Recovery]:
        """The passes and recovery of a ``KnownColoring``, refused when its colours cannot recover
        every entry of its pattern or the dense backend cannot run its passes."""
        mode = known.mode
        if mode == "mixed" and not isinstance(self.backend.dense, MixedMode):
            raise ValueError("AutoSparse: a KnownColoring with mode 'mixed' needs a MixedMode(forward, reverse) dense backend")
        family = {"forward": "pushforward", "reverse": "pullback"}.get(mode)
        if family is not None and family not in self.dense_native and ({"pushforward", "pullback"} - {family}) & self.dense_native:
            raise ValueError(
                f"AutoSparse: a KnownColoring with mode {mode!r} needs {family}s, which {self.backend.dense!r} does not "
                "run natively; colour again (coloring=GreedyColoring()) for this dense backend"
            )
        invalid = ValueError(
            f"AutoSparse: the KnownColoring's colours (mode {mode!r}) cannot recover every entry of its pattern: "
            "pass the prep.known_coloring of a preparation unchanged, or colour again (coloring=GreedyColoring())"
        )
        if mode == "star":
            recovery = star_recovery(pattern, known.colors[0])
            if recovery is None:
                raise invalid
            return mode, [("hvp", known.colors[0])], recovery
        if mode == "substitution":
            try:
                return mode, [("hvp", known.colors[0])], substitution_recovery(pattern, known.colors[0])
            except ValueError:
                raise invalid from None
        if mode == "mixed":
            columns, rows = known.colors
            try:
                recovery = bidirectional_recovery(pattern, columns, rows)
            except ValueError:
                raise invalid from None
            return mode, [("pushforward", columns), ("pullback", rows)], recovery
        by_rows = mode == "reverse"
        colors = known.colors[0]
        if not _structurally_orthogonal(pattern.transpose() if by_rows else pattern, colors):
            raise invalid
        return mode, [("pullback" if by_rows else "pushforward", colors)], jacobian_recovery(pattern, colors, by_rows=by_rows)

    def _color_persisted(self, pattern: IndexSets, hessian: bool) -> tuple[str, list[tuple[str, np.ndarray]], Recovery, bool]:
        """The colouring of ``pattern``, through the cache: ``(mode, passes, recovery, loaded)``.

        A colouring is a function of the pattern, the colouring settings, the operator and the
        dense backend (which directions it runs), so that is its key (the pattern by content).
        The recovery is rebuilt from the loaded colours, as from fresh ones."""
        store = _store(self.backend)
        key = None
        if store is not None:
            digest = hashlib.sha256(pattern.indptr.astype(np.int64).tobytes() + b"|" + pattern.indices.astype(np.int64).tobytes()).hexdigest()
            key = json.dumps([self.family, digest, pattern.nrows, pattern.ncols, repr(self.backend.coloring),
                              repr(self.backend.dense), sorted(self.dense_native)])
            payload = store.get("coloring", key)
            unpacked = _unpack(payload) if payload is not None else None
            if unpacked is not None:
                restored = self._restore_coloring(pattern, *unpacked)
                if restored is not None:
                    return (*restored, True)
        mode, passes, recovery = (self._color_hessian if hessian else self._color_jacobian)(pattern)
        if store is not None and key is not None:
            arrays = {f"colors{i}": colors for i, (_, colors) in enumerate(passes)}
            store.put("coloring", key, _pack(arrays, {"mode": mode, "families": [family for family, _ in passes]}))
        return mode, passes, recovery, False

    def _restore_coloring(self, pattern: IndexSets, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> tuple[str, list[tuple[str, np.ndarray]], Recovery] | None:
        mode, families = meta.get("mode"), meta.get("families")
        if not isinstance(families, list) or len(families) != len(arrays):
            return None
        passes: list[tuple[str, np.ndarray]] = []
        for i, family in enumerate(families):
            colors = arrays.get(f"colors{i}")
            # Each pass colours columns (pushforward, hvp) or rows (pullback) of this pattern.
            length = pattern.nrows if family == "pullback" else pattern.ncols
            if colors is None or colors.dtype.kind != "i" or colors.shape != (length,):
                return None
            passes.append((str(family), colors.astype(np.int64)))
        try:
            if mode == "mixed":
                (_, columns), (_, rows) = passes
                recovery: Recovery | None = bidirectional_recovery(pattern, columns, rows)
            elif mode in ("forward", "reverse"):
                by_rows = mode == "reverse"
                if not _structurally_orthogonal(pattern.transpose() if by_rows else pattern, passes[0][1]):
                    return None  # jacobian_recovery does not check: colour afresh
                recovery = jacobian_recovery(pattern, passes[0][1], by_rows=by_rows)
            elif mode == "substitution":
                recovery = substitution_recovery(pattern, passes[0][1])
            elif mode == "star":
                recovery = star_recovery(pattern, passes[0][1])
            else:
                return None
        except Exception as error:  # colours of another layout: colour afresh
            logger.debug("torchdi cache: a persisted colouring does not fit the pattern (%s); colouring afresh", error)
            return None
        if recovery is None:
            return None
        return str(mode), passes, recovery

    def _color_hessian(self, pattern: IndexSets) -> tuple[str, list[tuple[str, np.ndarray]], Recovery]:
        coloring = self.backend.coloring
        colors = symmetric_coloring(pattern, coloring)
        if coloring.decompression == "substitution":
            return "substitution", [("hvp", colors)], substitution_recovery(pattern, colors)
        recovery = star_recovery(pattern, colors)
        assert recovery is not None, "a star colouring allows direct recovery"
        return "star", [("hvp", colors)], recovery

    def warm_up(self, x: torch.Tensor, tangents: Any, contexts: tuple[Any, ...]) -> None:
        """Detect, colour, and prepare the dense backend's batched runners on the colour seeds."""
        hessian = self.family == "hessian"
        start = time.perf_counter()
        n = self.spec.x.numel
        m = n if hessian else self.spec.y.numel
        known = self.backend.coloring if isinstance(self.backend.coloring, KnownColoring) else None
        fallbacks: tuple[str, ...]
        if known is not None:  # computed before: no detection, no colouring (and nothing to persist)
            pattern, fallbacks, detection_loaded = _known_pattern(known, m, n, hessian), (), True
        elif m and n:
            pattern, fallbacks, detection_loaded = _detect_persisted(self.backend, self.f, self.spec, x, contexts, hessian)
            detection_loaded |= not isinstance(self.backend.sparsity, TracerSparsity)  # nothing to persist
        else:  # an empty x or f(x): the empty pattern, no colour, no pass
            pattern, fallbacks, detection_loaded = IndexSets.empty(m, n), (), True
        detected = time.perf_counter()
        if known is not None:
            mode, passes, recovery = self._known_passes(known, pattern, hessian)
            coloring_loaded = True
        else:
            mode, passes, recovery, coloring_loaded = self._color_persisted(pattern, hessian)
        colored = time.perf_counter()
        self.shape = (m, n)
        self.crow = torch.from_numpy(pattern.indptr.copy())
        self.col = torch.from_numpy(pattern.indices.copy())
        self.recovery = recovery
        self.on_device = {}
        self.passes = []
        self.fused = None
        dense = self.backend.dense
        compiled = isinstance(dense, AutoCompile) and dense.fullgraph
        for family, colors in passes:
            meta = self.spec.y if family == "pullback" else self.spec.x
            count = int(colors.max(initial=-1)) + 1
            if not count:
                continue
            seed = decompression.seeds(colors, meta.numel, meta.dtypes[0], x.device).reshape(count, *meta.shapes[0])
            spec = replace_spec(self.spec, n_tangents=count)
            if compiled:  # the eager pass, compiled below together with the decompression
                assert isinstance(dense, AutoCompile)
                refuse_compiled_double_backward(dense, family, spec)
                runner = build_runner(dense.inner, family, self.f, spec)
            else:
                runner = build_runner(dense, family, self.f, spec)
                warm_up(runner, x, seed, contexts)
            self.passes.append((runner, seed))
        if compiled and self.passes:
            assert isinstance(dense, AutoCompile) and len(self.passes) == 1
            program_backend = _fused_backend(dense)
            indices = (self.crow.to(x.device), self.col.to(x.device))
            # A hessian's value and gradient come from the same program (one call, one set of guards).
            gradient = build_runner(dense.inner, "gradient", self.f, replace_spec(self.spec, n_tangents=0)) if hessian else None
            self.fused = _fused(
                self.passes[0][0], gradient, TorchRecovery(recovery, x.device), indices, program_backend, self.f, self.spec.state_contexts
            )
            if compiled_store(dense) is not None:  # the passes and the decompression persist as one program
                self.fused.persist_key = program_key(f"sparse {self.family} {mode}", self.f, self.passes[0][1].shape, program_backend)
            warm_up(self.fused, x, self.passes[0][1], contexts)
        if hessian and n == 0:
            self.gradient = zero_runner("gradient", self.f, replace_spec(self.spec, n_tangents=0))
        elif hessian and self.fused is None:
            _, inner = outer_inner(self.backend.dense)
            self.gradient = build_runner(inner, "gradient", self.f, replace_spec(self.spec, n_tangents=0))
            warm_up(self.gradient, x, None, contexts)
        # Each runner's entry points, looked up once: checked_entry's isinstance on a runtime
        # protocol costs ~10 us, a fifth of a prepared heat-equation call on inductor.
        runners = [r for r, _ in self.passes] + [r for r in (self.fused, self.gradient) if r is not None]
        self.entries = {id(r): r for r in runners}
        self.checked_entries = {id(r): checked_entry(r) for r in runners}
        # The one-program call's entry points and seeds, read without a dict per call.
        self.fused_entries = (self.fused, checked_entry(self.fused)) if self.fused is not None else None
        self.fused_seeds = self.passes[0][1] if self.fused is not None else None
        self.pattern = pattern
        traced = not isinstance(self.backend.sparsity, KnownSparsity) and (known is None or isinstance(known, TracedColoring))
        self.reads = Reads.of(self.f) if traced else None
        self.statics = _statics(contexts) if traced else ()
        if traced and self.reads is None:
            logger.warning(
                "torchdi: AutoSparse cannot watch everything %s reads (more than %d places): a change to its globals, "
                "closure cells or attributes after preparation is not seen by the sparsity pattern; prepare again after "
                "such a change.", _name(self.f), MAX_PLACES,
            )
        self.prepared = True
        all_colors = [torch.from_numpy(c) for _, c in passes]
        stored_colors = tuple(c for _, c in passes) if mode == "mixed" else (passes[0][1] if passes else _no_colors(mode, m, n))
        ncolors = sum(int(c.max(initial=-1)) + 1 for _, c in passes)
        self.published = {
            "sparsity_pattern": pattern.to_torch(),
            "ncolors": ncolors,
            "colors": all_colors[0] if len(all_colors) == 1 else tuple(all_colors),
            "groups": tuple(torch.from_numpy(g) for _, c in passes for g in color_groups(c)),
            "sparse_mode": mode,
            "known_coloring": known if known is not None and not isinstance(known, TracedColoring) else KnownColoring(pattern, stored_colors, mode),
            "sparsity_fallbacks": fallbacks,
            "detection_seconds": detected - start,
            "coloring_seconds": colored - detected,
            # The pattern (when traced) and the colouring both came from the on-disk cache.
            "loaded_from_cache": bool(detection_loaded and coloring_loaded and (self.fused is None or self.fused.persist_key is None or self.fused.loaded_from_cache)),
            # (for _core._prepared_again: a strict=False variant reuses this pattern only while it is current)
            "pattern_current": _PatternCurrent(weakref.ref(self)),
        }

    def stale(self, contexts: tuple[Any, ...]) -> bool:
        """Whether the pattern may no longer be ``f``'s: something ``f`` reads besides ``x`` and the
        contexts (``self.reads``), or a static context value (``self.statics``), changed since it
        was traced."""
        reads = self.reads
        return (reads is not None and reads.changed()) or bool(self.statics and _statics_changed(self.statics, contexts))

    def _prepare_again(self, x: torch.Tensor, contexts: tuple[Any, ...]) -> None:
        """The pattern is ``stale``: trace it again at this x. A pattern inside the old one keeps
        the old colouring (it recovers every entry of a sub-pattern, the others as zeros); any
        other is coloured and prepared again, its compilations counted, and logged as a guard
        failure is."""
        hessian = self.family == "hessian"
        if isinstance(self.backend.coloring, TracedColoring):  # trace and colour as its first preparation did
            self.backend = dataclasses.replace(self.backend, coloring=self.backend.coloring.coloring)
        pattern, _, _ = _detect(self.backend, self.f, self.spec, x, contexts, hessian)
        if IndexSets.union([self.pattern, pattern]).nnz == self.pattern.nnz:
            logger.info("torchdi: what %s reads changed; its sparsity pattern did not grow: kept", _name(self.f))
            self.reads, self.statics = Reads.of(self.f), _statics(contexts)
            return
        before = self.pattern.nnz
        self.earlier_compilations = self.num_compilations
        self.warm_up(x, None, contexts)
        logger.warning(
            "torchdi: AutoSparse prepared the %s of %s again (compilations: %d) because what it reads besides x "
            "changed (a global, a closure cell, an attribute, a tensor written in place, a static context value) and with it "
            "the sparsity pattern (%d -> %d entries). Tensors and floats that change are best passed as Constant "
            "contexts, whose values the pattern never depends on.",
            self.family, _name(self.f), self.num_compilations, before, self.pattern.nnz,
        )

    def _device(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, TorchRecovery]:
        found = self.on_device.get(device)
        if found is None:
            found = self.on_device[device] = (self.crow.to(device), self.col.to(device), TorchRecovery(self.recovery, device))
        return found

    def _assemble(self, compressed: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        device = like.device if not compressed else compressed[0].device
        crow, col, recovery = self._device(device)
        if not compressed:
            values = torch.zeros(0, dtype=like.dtype, device=device)
        else:
            flat = compressed[0].reshape(-1) if len(compressed) == 1 else torch.cat([c.reshape(-1) for c in compressed])
            values = recovery.values(flat)
        # Index tensors of the result's own: in-place methods of a CSR tensor write into them
        # (J.zero_() empties col_indices, J.copy_(K) copies K's pattern), which must not reach the
        # preparation's later results.
        return decompression.csr(crow.clone(), col.clone(), values, self.shape)

    def _run(self, x: torch.Tensor, contexts: tuple[Any, ...], checked: bool) -> tuple[Any, ...]:
        if not self.prepared:
            raise RuntimeError("AutoSparse: this runner was not prepared (warm_up was not called)")
        entries = self.checked_entries if checked else self.entries

        def call(runner: Any, tangents: Any) -> Any:
            return entries[id(runner)](x, tangents, contexts)

        if self.family == "hessian":
            y, grad = call(self.gradient, None)
            compressed = [call(runner, seed)[1] for runner, seed in self.passes]
            return y, grad, self._assemble(compressed, grad)
        if not self.passes:  # f does not depend on x
            y = self.f(x, contexts)
            return y, self._assemble([], y)
        results = [call(runner, seed) for runner, seed in self.passes]
        check_output_shapes(results[0][0], self.spec.y.shapes)  # the pattern is for that shape
        return results[0][0], self._assemble([r[1] for r in results], x)

    # The hot path, the one program (its result's index tensors fresh from it), is written out in
    # both entry points rather than reached through _run: one Python frame less per call.
    def __call__(self, x: torch.Tensor, tangents: Any, contexts: tuple[Any, ...]) -> tuple[Any, ...]:
        if self.stale(contexts):
            self._prepare_again(x, contexts)
        fused = self.fused_entries
        if fused is not None:
            *head, values, crow, col = fused[0](x, self.fused_seeds, contexts)
            if self.y_shape is not None and head[0].shape != self.y_shape:
                check_output_shapes(head[0], (self.y_shape,))
            return (*head, decompression.csr(crow, col, values, self.shape))
        return self._run(x, contexts, checked=False)

    def checked_call(self, x: torch.Tensor, tangents: Any, contexts: tuple[Any, ...]) -> tuple[Any, ...]:
        """A call whose strict check has passed: the dense runners may take their fast paths."""
        if self.stale(contexts):
            self._prepare_again(x, contexts)
        fused = self.fused_entries
        if fused is not None:
            *head, values, crow, col = fused[1](x, self.fused_seeds, contexts)
            if self.y_shape is not None and head[0].shape != self.y_shape:
                check_output_shapes(head[0], (self.y_shape,))
            return (*head, decompression.csr(crow, col, values, self.shape))
        return self._run(x, contexts, checked=True)


def _name(f: Any) -> str:
    return str(getattr(f, "function_name", getattr(f, "__name__", repr(f))))


def _fused_backend(dense: AutoCompile) -> AutoCompile:
    """``dense`` with the inductor options of the sparse program under the user's own
    (``sparsity._private.fused_inductor_options``; inductor's and AOTInductor's); ``dense`` itself
    for another compiler or a ``mode`` (which takes no options)."""
    if dense.compiler not in ("inductor", AOT_INDUCTOR) or dense.mode is not None:
        return dense
    defaults = fused_inductor_options()
    if not defaults:
        return dense
    return dataclasses.replace(dense, options={**defaults, **(dense.options or {})})


def _fused(
    runner: Any,
    gradient: Any,
    recovery: TorchRecovery,
    indices: tuple[torch.Tensor, torch.Tensor],
    backend: AutoCompile,
    f: Any,
    state_contexts: tuple[int, ...],
) -> CompiledRunner:
    """The compressed pass, the decompression and the result's index tensors, compiled as one
    program: ``(x, seeds, contexts) -> (y, CSR values, crow_indices, col_indices)`` for a
    jacobian, ``(value, gradient, CSR values, crow_indices, col_indices)`` for a hessian (with
    ``gradient``, the eager gradient runner: a second compiled program costs a second call into
    torch's compiled-code machinery; the prepared Rosenbrock N=200 hessian went from 290-335 to
    about 240 us per call, thread CPU time, one thread).

    The recovery's index tensors and ``indices`` (the pattern's, on x's device) are inputs of the
    program that no call changes; each call's result gets its own copies of ``indices``, so that a
    CSR result's in-place methods cannot reach another. Their price, measured in one process
    against the same program without them: 25-30 us per call on the heat equation N=200 (167 ->
    195 and 145 -> 175 us in two runs; two ``clone`` calls after the program cost the same), about
    1 ms (19%) on the Rosenbrock 1e5 hessian (3.2 MB of fresh int64 indices per call)."""
    crow, col = indices
    direct = recovery.direct if recovery.terms is None else None
    if direct is not None and crow.dtype == col.dtype == direct.dtype and crow.device == col.device == direct.device:
        # The three index arrays as one tensor, sliced in the program: dynamo guards each tensor
        # the traced code reads apart (layout, dimension marks, aliasing with the others), and
        # AOTInductor takes each as an input (the heat equation's call: 24.3 -> 23.4-23.6 us).
        crow_end, col_end = crow.numel(), crow.numel() + col.numel()
        held = torch.cat([crow, col, direct])

        def values_and_indices(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return flat.index_select(0, held[col_end:]), held[:crow_end].clone(), held[crow_end:col_end].clone()
    else:

        def values_and_indices(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return recovery.values(flat), crow.clone(), col.clone()

    def passes_and_values(x: Any, seeds: Any, contexts: tuple[Any, ...]) -> tuple[Any, ...]:
        first, compressed = runner(x, seeds, contexts)
        head = (first,) if gradient is None else tuple(gradient(x, None, contexts))
        return (*head, *values_and_indices(compressed.reshape(-1)))

    family = "jacobian" if gradient is None else "hessian"
    return CompiledRunner(passes_and_values, backend, family, getattr(f, "function_name", repr(f)), state_contexts)


register_engine(AutoSparse, SparseEngine)
