"""``TracerSparsity``: a global, conservative sparsity pattern from ``f``'s aten graph.

``f`` is run once (an ``f`` that writes into a tensor: stopped at its first write and run again
functionalized, where in-place writes become ``*_scatter`` ops; views stay views, because
removing them loses the storage offsets that autograd's backward of a write into a slice reads
through ``as_strided``) under a dispatch mode that sees each aten op as it runs and
interprets it on *index sets*: for every element of every tensor, the set of flat input indices
it may depend on. The
pattern holds for every value of ``x`` (global): no rule looks at values of ``x`` or of
contexts (floats and numpy values are traced as tensors, as compiled backends trace them).
Values that are fixed (tensors ``f`` creates or closes over, and what is computed from them
alone) are read: a multiplication by a fixed zero, a fixed banded matrix in a matmul, fixed
indices in indexing and a fixed convolution kernel give their exact structure.

Rules (the op's first matching rule applies):

- an integer or boolean result, or an op whose derivative is zero (``sign``, ``floor``,
  ``zeros_like``, ``detach`` ...): depends on nothing;
- copies and casts: the same sets;
- data movement (views, slicing, ``cat``/``stack``, ``roll``, ``flip``, padding, ``gather``,
  indexing, scatters, ``where`` with a fixed condition ...): the op is run on tensors of
  element *indices* instead of values, which tells exactly which input element each output
  element is;
- pointwise ops (aten's ``pointwise`` tag), with broadcasting: the union of the operands' sets;
- reductions and line ops (``sum``, ``mean``, ``amax``, ``softmax``, ``cumsum`` ...) over some
  dimensions: the union over the reduced elements;
- ``mm``/``bmm``/``mv``/``dot``/``addmm``/``baddbmm``: the union over the contracted index, using
  the non-zeros of a fixed operand;
- ``index_add``/``scatter_add``/``index_reduce``/``scatter_reduce`` and ``index_put`` with
  ``accumulate=True`` (indexing's gradient) with fixed indices: each output element joins the
  source elements sent to it; ``native_layer_norm``: rows over the normalized
  dimensions;
- ``convolution`` (1-d, 2-d, 3-d, groups, stride, padding, dilation), with a fixed kernel's zeros;
- anything else: every output element depends on every input element of every operand
  (correct, only denser); such ops are listed in ``fallbacks``.

Writes into views (in-place ops left by decompositions) update the sets of the viewed tensor.
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
from torch.utils import _pytree as pytree

from torchdi.sparsity._private import op_schema, overload_name, recording
from torchdi.sparsity.index_sets import IndexSets
from torchdi.translate import to_device_tensor

__all__ = ["TracerResult", "TracerSparsity", "trace_sparsity"]


@dataclass(frozen=True)
class TracerSparsity:
    """Detect the sparsity pattern from ``f``'s aten graph (global and conservative).

    The pattern holds at every ``x``: it never misses a structural non-zero. Ops without a rule
    make each output element depend on all input elements; ``prep.sparsity_fallbacks`` lists
    them. Tensors that ``f`` creates or closes over are fixed: their zeros count as structural
    (pass values that change as ``Constant`` contexts, which are never read).

    Example::

        >>> prep = torchdi.prepare_jacobian(torch.diff, torchdi.AutoSparse(torchdi.AutoFunc()), torch.ones(4))
        >>> prep.sparsity_pattern.to_dense().int()
        tensor([[1, 1, 0, 0],
                [0, 1, 1, 0],
                [0, 0, 1, 1]], dtype=torch.int32)
    """


@dataclass
class TracerResult:
    """The detected pattern and the ops that fell back to the dense rule."""

    pattern: IndexSets
    fallbacks: tuple[str, ...] = ()


# ----------------------------------------------------------------------------------------------
# Tracing


def trace_sparsity(
    f: Callable[[Any, tuple[Any, ...]], Any], x: torch.Tensor, contexts: tuple[Any, ...], *, hessian: bool = False
) -> TracerResult:
    """The jacobian pattern of ``f(x, contexts)`` (or, with ``hessian``, the hessian pattern of the
    scalar ``f``: the jacobian pattern of its gradient), with ``x`` and ``y`` flattened."""
    from torch.func import functionalize

    leaves, spec = pytree.tree_flatten(contexts)
    # Context values are never read, only their shapes: a Constant may change between calls.
    # Floats and numpy values (what compiled backends trace, ``to_device_tensor``) are traced as
    # tensors, as tensors are; a module's parameters and buffers are marked as varying.
    converted = {i: to_device_tensor(leaf, None) for i, leaf in enumerate(leaves) if not isinstance(leaf, torch.Tensor)}
    converted = {i: t for i, t in converted.items() if isinstance(t, torch.Tensor)}
    varying = {
        t.untyped_storage().data_ptr()
        for leaf in leaves
        if isinstance(leaf, torch.nn.Module)
        for t in [*leaf.parameters(), *leaf.buffers()]
    }
    x = x.detach().clone()
    error: Exception | None = None
    with torch.enable_grad() if hessian else torch.no_grad():
        for as_tensors in (True, False) if converted else (True,):
            slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) or (as_tensors and i in converted)]
            # Own copies: the interpreter replays writes (a Cache written by f) on them.
            tensors = [(leaves[i] if isinstance(leaves[i], torch.Tensor) else converted[i]).detach().clone() for i in slots]
            # Traced with the raw float/numpy values (f used them as Python numbers: torch.full(shape, c),
            # numpy methods): any tensor f creates may hold them, so none is read.
            try:
                with warnings.catch_warnings():
                    # f written for a float receives a tensor: torch.tensor(c) then warns about copying.
                    warnings.filterwarnings("ignore", message="To copy construct from a tensor")
                    traceable = _traceable(f, leaves, spec, slots, hessian)
                    # First as f is: functionalizing costs a fifth of a small trace. At f's first
                    # write (before it runs, so x and the copies are intact) the run stops and f
                    # is traced again functionalized, where writes become *_scatter ops.
                    try:
                        return _Interpreter(x.numel(), read_created=as_tensors, varying=varying, stop_at_writes=True).run(traceable, x, tensors)
                    except _Writes:
                        pass
                    interpreter = _Interpreter(x.numel(), read_created=as_tensors, varying=varying)
                    return interpreter.run(functionalize(traceable, remove="mutations"), x, tensors)
            except Exception as failure:
                error = error or failure
                continue
    assert error is not None
    raise RuntimeError(
        "TracerSparsity: cannot trace f into an aten graph: "
        f"{str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__}\n"
        "Data-dependent Python control flow (if on a tensor value, .item(), .tolist()) cannot be "
        "traced for a global pattern. Use DenseSparsity() (a local pattern at the preparation point) "
        "or KnownSparsity(pattern)."
    ) from error


def _traceable(
    f: Callable[[Any, tuple[Any, ...]], Any], leaves: list[Any], spec: Any, slots: list[int], hessian: bool
) -> Callable[..., torch.Tensor]:
    """``f`` as a function of ``x`` and the context leaves at ``slots`` (the others stay as given)."""

    def call(x_: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        filled = list(leaves)
        for i, t in zip(slots, tensors):
            filled[i] = t
        return f(x_, pytree.tree_unflatten(filled, spec))

    if not hessian:
        return call

    def gradient(x_: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        return torch.func.grad(lambda z: call(z, *tensors).sum())(x_)

    return gradient


class _Writes(BaseException):  # a signal, not an error: f's own `except Exception` lets it through
    """Raised at f's first op that writes into a tensor, in a run that is not functionalized."""


class _Store:
    """The index sets of one tensor's elements (in its logical row-major order), and whether its
    values are fixed (independent of ``x`` and of the contexts)."""

    __slots__ = ("fixed", "sets", "value")

    def __init__(self, sets: IndexSets, fixed: bool) -> None:
        self.sets = sets
        self.fixed = fixed
        # The real tensor this store's elements live in: ``as_strided`` addresses its storage.
        self.value: torch.Tensor | None = None


@dataclass
class _Ref:
    """A tensor as seen by the interpreter: its store and, for a view, which of the store's elements."""

    store: _Store
    positions: np.ndarray | None = None  # None: the whole store, in order

    def sets(self) -> IndexSets:
        return self.store.sets if self.positions is None else self.store.sets.take(self.positions)

    @property
    def fixed(self) -> bool:
        return self.store.fixed


_ZERO_DERIVATIVE = {
    "detach", "sign", "sgn", "floor", "ceil", "round", "trunc", "zeros_like", "ones_like", "full_like",
    "empty_like", "new_zeros", "new_ones", "new_full", "new_empty", "new_empty_strided", "rand_like",
    "randn_like", "randint_like", "scalar_tensor", "zeros", "ones", "full", "empty", "empty_strided",
    "arange", "eye", "linspace", "bernoulli", "rand", "randn", "fill", "zero", "_local_scalar_dense",
    "heaviside", "isnan", "isinf", "signbit",
}
_ARBITRARY_VALUES = {"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided"}
_SAME_SETS = {"clone", "_to_copy", "lift_fresh_copy", "lift_fresh", "contiguous", "alias", "alias_copy", "to", "positive"}
_MOVEMENT = {
    "view", "view_copy", "_unsafe_view", "reshape", "expand", "expand_copy", "permute", "permute_copy", "t", "t_copy",
    "transpose", "transpose_copy", "squeeze", "squeeze_copy", "unsqueeze", "unsqueeze_copy", "slice", "slice_copy",
    "select", "select_copy", "diagonal", "diagonal_copy", "unfold", "unfold_copy", "as_strided", "as_strided_copy",
    "split", "split_copy", "split_with_sizes", "split_with_sizes_copy", "unbind", "unbind_copy", "narrow", "narrow_copy",
    "chunk", "cat", "stack", "hstack", "vstack", "roll", "flip", "rot90", "constant_pad_nd", "index_select", "gather",
    "index", "_unsafe_index", "repeat", "tile", "slice_scatter", "select_scatter", "diagonal_scatter",
    "as_strided_scatter", "index_put", "_unsafe_index_put", "scatter", "masked_fill", "masked_scatter", "tril", "triu",
    "reflection_pad1d", "reflection_pad2d", "reflection_pad3d", "replication_pad1d", "replication_pad2d",
    "replication_pad3d", "_reflection_pad", "movedim", "take", "where", "pad", "diag_embed", "flatten",
    "unflatten", "swapaxes", "slice_backward", "select_backward", "diagonal_backward", "_unsafe_view_copy", "view_as_real", "view_as_complex",
}
_REDUCTIONS = {
    "sum", "mean", "amax", "amin", "prod", "logsumexp", "var", "std", "var_mean", "std_mean", "max", "min",
    "linalg_vector_norm", "norm", "nansum", "nanmean", "aminmax", "_softmax", "_log_softmax", "softmax", "log_softmax",
    "_softmax_backward_data", "_log_softmax_backward_data", "cumsum", "cumprod", "logcumsumexp", "cummax", "cummin",
    "sort", "median", "nanmedian", "mode", "topk", "kthvalue",
}
_CONTRACTIONS = {"mm", "bmm", "mv", "dot", "addmm", "baddbmm", "addmv", "matmul", "vdot"}
# Contracting a fixed operand by its non-zeros costs (rows x non-zeros) pairs: above this, the
# operands are taken as dense.
_MAX_PAIRS = 30_000_000


# Aten arguments and results nest only in lists and tuples (kwargs: one dict): these walk them
# without pytree, whose generic node lookup was half of the interpreter's time.
def _leaves(obj: Any) -> list[Any]:
    """The leaves of nested lists, tuples and dicts, ``None`` included (so two structures align)."""
    if isinstance(obj, (list, tuple)):
        return [leaf for item in obj for leaf in _leaves(item)]
    if isinstance(obj, dict):
        return [leaf for item in obj.values() for leaf in _leaves(item)]
    return [obj]


def _map(fn: Callable[[Any], Any], obj: Any) -> Any:
    """``fn`` on every leaf of nested lists and tuples (``None`` stays ``None``)."""
    if isinstance(obj, (list, tuple)):
        mapped = [_map(fn, item) for item in obj]
        return mapped if isinstance(obj, list) else tuple(mapped)
    return None if obj is None else fn(obj)


def _refs_in(refs: Any) -> list[_Ref]:
    found: list[_Ref] = []
    for item in refs.values() if isinstance(refs, dict) else refs:
        if isinstance(item, _Ref):
            found.append(item)
        elif isinstance(item, (list, tuple, dict)):
            found += _refs_in(item)
    return found


def _remember(value: Any, refs: Any) -> None:
    """Record, for every store that a result created, the real tensor holding its elements."""
    for v, r in zip(_leaves(value), _leaves(refs)):
        if isinstance(v, torch.Tensor) and isinstance(r, _Ref) and r.positions is None and r.store.value is None:
            r.store.value = v


def _storage_positions(store: _Store, view_of: torch.Tensor, size: Any, stride: Any, offset: Any) -> np.ndarray | None:
    """The store positions that ``view_of.as_strided(size, stride, offset)`` reads, or ``None``.

    ``as_strided`` addresses the *storage* of ``view_of``, which it shares with the store's real
    tensor: an int64 copy of that storage holding each element's store position (-1 elsewhere)
    answers exactly, whatever the strides and storage offsets (autograd's backward of a write
    into a slice reads the gradient this way, at the slice's storage offset).
    """
    root = store.value
    if root is None or not isinstance(view_of, torch.Tensor) or root.device.type == "meta":
        return None
    try:
        if view_of.untyped_storage().data_ptr() != root.untyped_storage().data_ptr():
            return None
        storage = torch.full((root.untyped_storage().nbytes() // root.element_size(),), -1, dtype=torch.int64)
        storage.as_strided(root.shape, root.stride(), root.storage_offset()).copy_(
            torch.arange(root.numel(), dtype=torch.int64).reshape(root.shape)
        )
        positions = storage.as_strided(size, stride, storage.storage_offset() if offset is None else offset)
    except Exception:  # overlapping or out-of-bounds layouts: let the dense rule answer
        return None
    flat = positions.reshape(-1).numpy().astype(np.int64)
    if flat.size and flat.min() < 0:
        return None
    return flat


_SCALAR_ARGUMENTS: dict[Any, dict[str, bool]] = {}
_OP_INFO: dict[Any, tuple[str, str, bool, bool, bool] | None] = {}


def _op_info(target: Any) -> tuple[str, str, bool, bool, bool] | None:
    """An aten op's packet name, kind (``"write"``: it writes its first argument, ``"view"``:
    its result aliases an input, else ``"functional"``), whether it is tagged pointwise and
    nondeterministic_seeded, and whether it writes into any argument (in place or ``out=``);
    ``None`` when ``target`` is not an aten operator. Cached per op: reading schemas and tags
    costs more than most rules."""
    schema = op_schema(target)  # first, every time: the fence's fallback (no schemas) is never cached over
    if schema is None:
        return None
    found = _OP_INFO.get(target)
    if found is not None:
        return found
    if schema.arguments and schema.arguments[0].alias_info is not None and schema.arguments[0].alias_info.is_write:
        kind = "write"
    elif schema.returns and schema.returns[0].alias_info is not None:
        kind = "view"
    else:
        kind = "functional"
    tags = cast(Any, target).tags
    writes = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
    info = (cast(Any, target).overloadpacket.__name__, kind, torch.Tag.pointwise in tags, torch.Tag.nondeterministic_seeded in tags, writes)
    _OP_INFO[target] = info
    return info


def _scalar_arguments(target: Any) -> dict[str, bool]:
    """Which of an op's arguments are numbers (a padding or fill value), by name, in order (cached:
    reading the schema's types costs more than the op itself)."""
    found = _SCALAR_ARGUMENTS.get(target)
    if found is None:
        found = _SCALAR_ARGUMENTS[target] = {
            a.name: str(a.type).replace("Optional[", "") in ("number]", "number", "Scalar") for a in op_schema(target).arguments
        }
    return found


def _mirror(indices: torch.Tensor, like: torch.Tensor) -> torch.Tensor | None:
    """``indices`` in a tensor with ``like``'s sizes, strides and storage offset (``None``: cannot)."""
    try:
        storage = torch.zeros(like.untyped_storage().nbytes() // like.element_size(), dtype=torch.int64)
        mirror = storage.as_strided(like.shape, like.stride(), like.storage_offset())
        mirror.copy_(indices)  # raises for overlapping strides
    except Exception:
        return None
    return mirror


class _Interpreter:
    """Index sets for every tensor ``f`` computes, op by op, while ``f`` runs (once, on real values).

    The ops are seen by a dispatch mode rather than read from a ``make_fx`` graph: building the
    graph (proxies, fake-tensor metadata per node) cost about 4x the rules themselves on small
    functions, and the graph was then run a second time to get the values the rules read.
    """

    def __init__(self, n: int, read_created: bool = True, varying: set[int] | None = None, stop_at_writes: bool = False) -> None:
        self.n = n
        # True: f runs as it is (not functionalized), and its first write raises _Writes.
        self.stop_at_writes = stop_at_writes
        self.fallbacks: list[str] = []
        # False: the values of tensors f creates or closes over are not read (they may hold a
        # context's value); ``varying``: storages of such tensors (a module context's parameters).
        self.read_created = read_created
        self.varying = varying or set()
        # id(tensor) -> (tensor, refs): the tensor is held, so its id is not reused during the run.
        self.known: dict[int, tuple[torch.Tensor, _Ref]] = {}

    # -- helpers ---------------------------------------------------------------------------
    def empty(self, numel: int) -> IndexSets:
        return IndexSets.empty(numel, self.n)

    def run(self, traceable: Callable[..., Any], x: torch.Tensor, tensors: Sequence[torch.Tensor]) -> TracerResult:
        self.register(x, _Ref(_Store(IndexSets.identity(self.n), fixed=False)))
        for t in tensors:
            self.register(t, _Ref(_Store(self.empty(t.numel()), fixed=False)))
        mode = recording(self.call)
        if mode is not None:
            with mode:
                output = traceable(x, *tensors)
        else:  # no dispatch modes in this torch: record the graph, then replay it op by op
            # Imported when needed: slow to import.
            from torch.fx.experimental.proxy_tensor import make_fx

            output = self.replay(make_fx(traceable, tracing_mode="real")(x, *tensors), x, tensors)
        result = _leaves(output)[0]
        ref = self.ref_of(result)
        return TracerResult(ref.sets(), tuple(dict.fromkeys(self.fallbacks)))

    def replay(self, graph: torch.fx.GraphModule, x: torch.Tensor, tensors: Sequence[torch.Tensor]) -> Any:
        """Run a recorded graph's ops through ``call`` (the values are recomputed from the inputs)."""
        env: dict[torch.fx.Node, Any] = {}
        placeholders = iter([x, *tensors])
        output: Any = None
        for node in graph.graph.nodes:
            if node.op == "placeholder":
                env[node] = next(placeholders)
            elif node.op == "get_attr":  # a tensor f closed over: a constant to ref_of
                env[node] = getattr(graph, str(node.target))
            elif node.op == "call_function":
                args, kwargs = pytree.tree_map_only(torch.fx.Node, env.__getitem__, (node.args, node.kwargs))
                env[node] = args[0][args[1]] if node.target is operator.getitem else self.call(node.target, args, kwargs)
            elif node.op == "output":
                output = pytree.tree_map_only(torch.fx.Node, env.__getitem__, node.args[0])
        return output

    def register(self, value: Any, refs: Any) -> None:
        """Remember the refs of every tensor of an op's result (and the real tensor of new stores)."""
        if isinstance(value, torch.Tensor) and isinstance(refs, _Ref):  # most ops: one tensor
            if refs.positions is None and refs.store.value is None:
                refs.store.value = value
            self.known[id(value)] = (value, refs)
            return
        _remember(value, refs)
        for v, r in zip(_leaves(value), _leaves(refs)):
            if isinstance(v, torch.Tensor) and isinstance(r, _Ref):
                self.known[id(v)] = (v, r)

    def ref_of(self, tensor: torch.Tensor) -> _Ref:
        """The refs of a tensor the run has seen; otherwise a tensor created before the run
        (closed over by ``f``): it depends on nothing, and is fixed unless it is a module's."""
        found = self.known.get(id(tensor))
        if found is not None and found[0] is tensor:
            return found[1]
        try:
            varying = tensor.untyped_storage().data_ptr() in self.varying
        except Exception:  # no storage to compare (a tensor subclass): take it as varying
            varying = True
        ref = _Ref(_Store(self.empty(tensor.numel()), fixed=self.read_created and not varying))
        self.register(tensor, ref)
        return ref

    def ref_args(self, args: Any) -> Any:
        """``args`` with each tensor replaced by its refs (lists and tuples walked; the common flat
        case without the generic ``_map``: this runs for every op)."""
        out = []
        for a in args:
            if isinstance(a, torch.Tensor):
                out.append(self.ref_of(a))
            elif isinstance(a, (list, tuple)):
                out.append(_map(lambda b: self.ref_of(b) if isinstance(b, torch.Tensor) else b, a))
            else:
                out.append(a)
        return out

    def call(self, target: Any, positional: Any, keywords: dict[str, Any]) -> Any:
        info = _op_info(target)
        if self.stop_at_writes and (info is None or info[4]):  # a write, or an op whose writes are unknown
            raise _Writes
        refs = (tuple(self.ref_args(positional)), dict(zip(keywords, self.ref_args(keywords.values()))))
        value = target(*positional, **keywords)
        if not isinstance(value, torch.Tensor) and any(isinstance(v, (bool, int, float, complex)) for v in _leaves(value)) and not self.fixed_inputs(refs):
            # A Python number read from x or a context (.item(), if on a tensor): what f does next
            # depends on the value, so no pattern from this one run holds for every x.
            raise RuntimeError(
                f"f reads a value computed from x or a context ({target}): data-dependent Python control flow"
            )
        args = (tuple(positional), keywords)
        if info is None:  # not an aten operator (or a torch whose operators torchdi cannot read)
            self.register(value, self.fallback(str(target), value, refs, fixed=False))
            return value
        name, kind = info[:2]
        if kind == "write":
            result = self.write(target, name, value, args, refs)
        elif kind == "view":
            result = self.view(target, value, args, refs)
        else:
            result = self.functional(target, name, value, args, refs)
        self.register(value, result)
        return value

    def fixed_inputs(self, refs: Any) -> bool:
        return all(r.fixed for r in _refs_in(refs))

    def fallback(self, name: str, value: Any, refs: Any, fixed: bool) -> Any:
        """Every output element depends on every input element."""
        inputs = _refs_in(refs)
        columns = np.concatenate([r.sets().indices for r in inputs]) if inputs else np.zeros(0, dtype=np.int64)
        union = IndexSets.from_pairs(np.zeros(columns.size, dtype=np.int64), columns, 1, self.n)  # one row: all of them
        if union.nnz:
            self.fallbacks.append(name)

        def one(v: Any) -> Any:
            if not isinstance(v, torch.Tensor):
                return None
            if not (v.is_floating_point() or v.is_complex()) or not union.nnz:
                return _Ref(_Store(self.empty(v.numel()), fixed))
            return _Ref(_Store(union.take(np.zeros(v.numel(), dtype=np.int64)), fixed))

        return _map(one, value)

    # -- in-place writes and views -----------------------------------------------------------------
    def write(self, target: Any, name: str, value: Any, args: Any, refs: Any) -> Any:
        dest: _Ref = refs[0][0]
        if name == "copy_":
            src = refs[0][1]
            new = self.broadcast(src, args[0][1], value.shape) if isinstance(src, _Ref) else self.empty(value.numel())
            fixed = src.fixed if isinstance(src, _Ref) else self.read_created
        else:
            functional = getattr(getattr(torch.ops.aten, name.rstrip("_"), None), overload_name(target) or "default", None)
            if functional is None:
                result = self.fallback(name, value, refs, fixed=False)
            else:
                result = self.functional(functional, name.rstrip("_"), value, args, refs)
            new, fixed = result.sets(), result.fixed
        store = dest.store
        positions = np.arange(store.sets.nrows, dtype=np.int64) if dest.positions is None else dest.positions
        rows = np.arange(store.sets.nrows, dtype=np.int64)
        rows[positions] = store.sets.nrows + np.arange(positions.size, dtype=np.int64)
        store.sets = IndexSets.stack([store.sets, new]).take(rows)
        store.fixed = store.fixed and fixed
        return dest

    def view(self, target: Any, value: Any, args: Any, refs: Any) -> Any:
        parent: _Ref = refs[0][0]
        base = parent.store
        if target.overloadpacket.__name__ in ("as_strided", "as_strided_copy"):
            flat = self.strided(target, args, base)
            if flat is None:
                return self.fallback(str(target), value, refs, fixed=False)
            return _Ref(base, flat)
        else:
            positions = (
                torch.arange(base.sets.nrows) if parent.positions is None else torch.from_numpy(parent.positions)
            ).reshape(args[0][0].shape)
        try:
            moved = target(positions, *args[0][1:], **args[1])
        except Exception:
            return self.fallback(str(target), value, refs, fixed=False)
        return _map(lambda p: _Ref(base, p.reshape(-1).numpy().astype(np.int64)), moved)

    def strided(self, target: Any, args: Any, store: _Store) -> np.ndarray | None:
        """The store positions an ``as_strided``/``as_strided_copy`` call reads."""
        names = [a.name for a in op_schema(target).arguments]
        bound = dict(zip(names, args[0])) | args[1]
        return _storage_positions(store, bound["self"], bound["size"], bound["stride"], bound.get("storage_offset"))

    # -- out-of-place ops ----------------------------------------------------------------------------
    def functional(self, target: Any, name: str, value: Any, args: Any, refs: Any) -> Any:
        info = _op_info(target)
        pointwise, nondeterministic = (False, False) if info is None else info[2:4]
        inputs = _refs_in(refs)
        fixed = self.read_created and all(r.fixed for r in inputs) and name not in _ARBITRARY_VALUES and not nondeterministic
        if isinstance(value, torch.Tensor):
            float_out = value.is_floating_point() or value.is_complex()
        else:
            float_out = any(isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()) for v in _leaves(value))
        if not float_out or name in _ZERO_DERIVATIVE or all(r.store.sets.nnz == 0 for r in inputs):
            return _map(lambda v: _Ref(_Store(self.empty(v.numel()), fixed)) if isinstance(v, torch.Tensor) else None, value)
        (positional, keywords) = args
        (ref_pos, ref_kw) = refs
        if name in _SAME_SETS and isinstance(value, torch.Tensor) and value.shape == positional[0].shape:
            return _Ref(_Store(ref_pos[0].sets(), fixed))
        if name == "as_strided_copy" and isinstance(ref_pos[0], _Ref):
            flat = self.strided(target, args, ref_pos[0].store)
            if flat is not None:
                return _Ref(_Store(ref_pos[0].store.sets.take(flat), fixed))
        if name == "copy" and isinstance(ref_pos[1], _Ref):  # functionalized copy_: the source, broadcast
            return _Ref(_Store(self.broadcast(ref_pos[1], positional[1], value.shape), ref_pos[1].fixed))
        if name == "where" and len(positional) == 3:
            cond = ref_pos[0]
            if isinstance(cond, _Ref) and not cond.fixed:
                return _Ref(_Store(self.pointwise(value.shape, positional[1:], ref_pos[1:]), fixed))
        if name in ("index_put", "_unsafe_index_put") and (positional[3:4] == (True,) or keywords.get("accumulate")):
            accumulated = self.index_put_accumulate(value, positional, ref_pos)
            if accumulated is not None:
                return _Ref(_Store(accumulated, fixed))
        elif name in _MOVEMENT:
            sets = self.movement(target, name, value, positional, keywords, ref_pos, ref_kw)
            if sets is not None:
                return _map(lambda s: _Ref(_Store(s, fixed)), sets)
        elif name == "mul" and len(positional) == 2:
            return _Ref(_Store(self.pointwise(value.shape, positional, ref_pos, masks=True), fixed))
        elif pointwise and isinstance(value, torch.Tensor):
            return _Ref(_Store(self.pointwise(value.shape, positional + tuple(keywords.values()), ref_pos + tuple(ref_kw.values())), fixed))
        elif name in _REDUCTIONS:
            sets = self.reduction(target, value, positional, keywords, ref_pos)
            if sets is not None:
                return _map(
                    lambda v: _Ref(_Store(sets if v.is_floating_point() or v.is_complex() else self.empty(v.numel()), fixed)),
                    value,
                )
        elif name in _CONTRACTIONS:
            sets = self.contraction(name, value, positional, keywords, ref_pos)
            if sets is not None:
                return _Ref(_Store(sets, fixed))
        elif name in ("index_add", "scatter_add", "index_reduce", "scatter_reduce"):
            sets = self.accumulate(name, value, positional, keywords, ref_pos)
            if sets is not None:
                return _Ref(_Store(sets, fixed))
        elif name == "native_layer_norm":
            sets = self.layer_norm(value, positional, ref_pos)
            if sets is not None:
                return tuple(_Ref(_Store(part, fixed)) for part in sets)
        elif name == "convolution":
            sets = self.convolution(value, positional, ref_pos)
            if sets is not None:
                return _Ref(_Store(sets, fixed))
        return self.fallback(str(target), value, refs, fixed)

    def broadcast(self, ref: _Ref, operand: torch.Tensor, shape: torch.Size) -> IndexSets:
        """``ref``'s sets, broadcast to ``shape``."""
        if tuple(operand.shape) == tuple(shape):
            return ref.sets()
        rows = torch.arange(operand.numel()).reshape(operand.shape).expand(shape).reshape(-1).numpy()
        return ref.sets().take(rows)

    def pointwise(self, shape: torch.Size, operands: Sequence[Any], refs: Sequence[Any], masks: bool = False) -> IndexSets:
        numel = int(torch.Size(shape).numel())
        parts, keep = [], None
        for operand, ref in zip(operands, refs):
            if not isinstance(ref, _Ref):
                continue
            if ref.store.sets.nnz:
                parts.append(self.broadcast(ref, operand, shape))
            elif masks and ref.fixed:  # a fixed factor: its zeros are structural
                nonzero = (operand != 0).expand(shape).reshape(-1).numpy()
                keep = nonzero if keep is None else keep & nonzero
        sets = IndexSets.union(parts) if parts else self.empty(numel)
        if keep is not None:
            sets = sets.take(np.where(keep, np.arange(numel, dtype=np.int64), -1))
        return sets

    def movement(self, target: Any, name: str, value: Any, positional: Any, keywords: Any, ref_pos: Any, ref_kw: Any) -> Any:
        """Run the op on element indices (shifted by one: 0 marks 'no input')."""
        data: list[IndexSets] = []
        offset = [1]
        varying_index = False
        unmirrored = [False]

        def substitute(arg: Any, ref: Any) -> Any:
            nonlocal varying_index
            if isinstance(arg, torch.Tensor) and isinstance(ref, _Ref):
                if arg.is_floating_point() or arg.is_complex():
                    data.append(ref.sets())
                    start = offset[0]
                    offset[0] += arg.numel()
                    indices = torch.arange(start, start + arg.numel(), dtype=torch.int64).reshape(arg.shape)
                    if name == "as_strided_scatter" and len(data) == 1:
                        # Its strides and offset address self's storage: run it on a tensor laid
                        # out exactly as self is (0, no input, elsewhere in that storage).
                        mirrored = _mirror(indices, arg)
                        if mirrored is None:
                            unmirrored[0] = True
                        return mirrored
                    return indices
                if not ref.fixed:
                    varying_index = True
            return arg

        pos = [
            [substitute(a, r) for a, r in zip(arg, ref)] if isinstance(arg, (list, tuple)) and isinstance(ref, (list, tuple)) else substitute(arg, ref)
            for arg, ref in zip(positional, ref_pos)
        ]
        kw = {k: substitute(v, ref_kw.get(k)) for k, v in keywords.items()}
        if not data or unmirrored[0]:
            return None
        # A scalar written into the result (padding value, masked_fill/scatter/where value) is no
        # input element: it becomes index 0.
        scalar = _scalar_arguments(target)
        names = list(scalar)
        pos = [0 if i < len(names) and scalar[names[i]] and a is not None else a for i, a in enumerate(pos)]
        kw = {k: 0 if scalar.get(k) and v is not None else v for k, v in kw.items()}
        if name in ("index_put", "_unsafe_index_put") and ((len(pos) > 3 and pos[3]) or kw.get("accumulate")):
            return None
        if name == "scatter" and ("reduce" in kw or len(pos) > 4):
            return None
        stacked = IndexSets.stack(data) if len(data) > 1 else data[0]
        try:
            moved = target(*pos, **kw)
        except Exception:
            return None
        results = [t for t in _leaves(moved) if isinstance(t, torch.Tensor)]
        if any(t.is_floating_point() or t.is_complex() or (t.numel() and (t.min() < 0 or t.max() >= offset[0])) for t in results):
            return None  # not a pure movement of elements after all: let the dense rule answer

        def sets_of(indices: Any) -> IndexSets:
            if varying_index:  # which elements move where depends on values: everything may land anywhere
                union = IndexSets.from_pairs(np.zeros(stacked.nnz, dtype=np.int64), stacked.indices, 1, self.n)
                return union.take(np.zeros(indices.numel(), dtype=np.int64))
            return stacked.take(indices.reshape(-1).numpy().astype(np.int64) - 1)

        return _map(lambda t: sets_of(t) if isinstance(t, torch.Tensor) else None, moved)

    def reduction(self, target: Any, value: Any, positional: Any, keywords: Any, ref_pos: Any) -> IndexSets | None:
        """Union over the reduced dimensions, broadcast back for ops that keep the shape (softmax)."""
        names = [a.name for a in op_schema(target).arguments]
        bound = dict(zip(names, positional)) | keywords
        operands = [(a, r) for a, r in zip(positional, ref_pos) if isinstance(a, torch.Tensor) and isinstance(r, _Ref)]
        shape = operands[0][0].shape
        if any(a.shape != shape for a, _ in operands):
            return None
        ndim = len(shape)
        dims = bound.get("dim", None)
        if isinstance(dims, int):
            dims = [dims]
        if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
            dims = list(range(ndim))
        if not isinstance(dims, (list, tuple)) or not all(isinstance(d, int) for d in dims):
            return None
        dims = sorted({d % max(ndim, 1) for d in dims}) if ndim else []
        reduced = [1 if d in dims else s for d, s in enumerate(shape)]
        n_groups = int(np.prod(reduced)) if reduced else 1
        owner = torch.arange(n_groups).reshape(reduced).expand(shape).reshape(-1).numpy() if ndim else np.zeros(1, dtype=np.int64)
        grouped = IndexSets.union([r.sets().group(owner, n_groups) for _, r in operands])
        out = _leaves(value)[0]
        if out.numel() == n_groups:
            return grouped
        if tuple(out.shape) == tuple(shape):
            return grouped.take(owner)
        return None

    def contraction(self, name: str, value: Any, positional: Any, keywords: Any, ref_pos: Any) -> IndexSets | None:
        """``(B, I, K) @ (B, K, J)``: element ``(b, i, j)`` joins ``a[b, i, k]`` and ``b[b, k, j]`` over ``k``."""
        bias = None
        if name in ("addmm", "baddbmm", "addmv"):
            bias = (positional[0], ref_pos[0])
            positional, ref_pos = positional[1:], ref_pos[1:]
        a, b = positional[0], positional[1]
        ra, rb = ref_pos[0], ref_pos[1]
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return None
        a3 = a.reshape(1, 1, -1) if a.dim() == 1 else (a.unsqueeze(0) if a.dim() == 2 else a)
        b3 = b.reshape(1, -1, 1) if b.dim() == 1 else (b.unsqueeze(0) if b.dim() == 2 else b)
        if a3.dim() != 3 or b3.dim() != 3 or a3.shape[0] != b3.shape[0]:
            return None
        nb, ni, nk = a3.shape
        nj = b3.shape[2]
        n_out = nb * ni * nj
        parts = []
        for other, ref, other_ref, left in ((b3, ra, rb, True), (a3, rb, ra, False)):
            if not isinstance(ref, _Ref) or not ref.store.sets.nnz:
                continue
            sets = ref.sets()
            if other_ref.fixed and (other != 0).sum().item() * (ni if left else nj) <= _MAX_PAIRS:
                mask = other != 0
                if left:  # rows (b, i, j) <- a (b, i, k) for b[b, k, j] != 0
                    bb, kk, jj = (t.numpy() for t in mask.nonzero(as_tuple=True))
                    ii = np.arange(ni)[:, None]
                    out_rows = ((bb * ni + ii) * nj + jj).reshape(-1)
                    in_rows = ((bb * ni + ii) * nk + kk).reshape(-1)
                else:  # rows (b, i, j) <- b (b, k, j) for a[b, i, k] != 0
                    bb, ii, kk = (t.numpy() for t in mask.nonzero(as_tuple=True))
                    jj = np.arange(nj)[:, None]
                    out_rows = ((bb * ni + ii) * nj + jj).reshape(-1)
                    in_rows = ((bb * nk + kk) * nj + jj).reshape(-1)
                parts.append(IndexSets.from_pairs(out_rows, in_rows, n_out, sets.nrows).compose(sets))
            else:  # dense other operand: the whole row of a (or column of b)
                if left:
                    owner = (np.arange(nb)[:, None, None] * ni + np.arange(ni)[None, :, None]).repeat(nk, axis=2).reshape(-1)
                    rows = (np.arange(nb)[:, None, None] * ni + np.arange(ni)[None, :, None]).repeat(nj, axis=2).reshape(-1)
                    parts.append(sets.group(owner, nb * ni).take(rows))
                else:
                    owner = (np.arange(nb)[:, None, None] * nj + np.arange(nj)[None, None, :]).repeat(nk, axis=1).reshape(-1)
                    rows = (np.arange(nb)[:, None, None] * nj + np.arange(nj)[None, None, :]).repeat(ni, axis=1).reshape(-1)
                    parts.append(sets.group(owner, nb * nj).take(rows))
        if bias is not None and isinstance(bias[1], _Ref) and bias[1].store.sets.nnz:
            parts.append(self.broadcast(bias[1], bias[0], value.shape))
        return IndexSets.union(parts) if parts else self.empty(n_out)

    def accumulate(self, name: str, value: torch.Tensor, positional: Any, keywords: Any, ref_pos: Any) -> IndexSets | None:
        """``index_add``/``scatter_add`` (and their ``reduce`` forms) with fixed indices: each output
        element joins ``self``'s element and the source elements sent to it."""
        _, dim, index, source = positional[:4]
        r_base, _, r_index, r_source = ref_pos[:4]
        if not (isinstance(r_index, _Ref) and r_index.fixed and isinstance(dim, int)):
            return None
        grid = torch.arange(value.numel()).reshape(value.shape)
        parts = []
        if isinstance(r_base, _Ref) and r_base.store.sets.nnz:
            parts.append(r_base.sets())
        if isinstance(r_source, _Ref) and r_source.store.sets.nnz:
            sources = r_source.sets()
            if name.startswith("index_"):
                owner = grid.index_select(dim, index)  # shaped like the source
            else:
                owner = grid.gather(dim, index)  # shaped like the index: source elements beyond it are unused
                if tuple(index.shape) != tuple(source.shape):
                    used = torch.arange(source.numel()).reshape(source.shape)[tuple(slice(0, k) for k in index.shape)]
                    sources = sources.take(used.reshape(-1).numpy())
            parts.append(sources.group(owner.reshape(-1).numpy(), value.numel()))
        return IndexSets.union(parts) if parts else self.empty(value.numel())

    def index_put_accumulate(self, value: torch.Tensor, positional: Any, ref_pos: Any) -> IndexSets | None:
        """``index_put(accumulate=True)`` (indexing's gradient) with fixed indices: each output
        element joins ``self``'s element and the ``values`` elements added into it."""
        _, indices, values = positional[:3]
        r_base, r_indices, r_values = ref_pos[:3]
        if not all(i is None or (isinstance(r, _Ref) and r.fixed) for i, r in zip(indices, r_indices)):
            return None
        grid = torch.arange(value.numel()).reshape(value.shape)
        try:  # aten's None index is a full slice; Python indexing gives aten's result layout
            owner = grid[tuple(slice(None) if i is None else i for i in indices)]
        except (IndexError, RuntimeError):
            return None
        parts = []
        if isinstance(r_base, _Ref) and r_base.store.sets.nnz:
            parts.append(r_base.sets())
        if isinstance(r_values, _Ref) and r_values.store.sets.nnz:
            sources = self.broadcast(r_values, values, owner.shape)
            parts.append(sources.group(owner.reshape(-1).numpy(), value.numel()))
        return IndexSets.union(parts) if parts else self.empty(value.numel())

    def layer_norm(self, value: Any, positional: Any, ref_pos: Any) -> tuple[IndexSets, ...] | None:
        """``native_layer_norm``: each row over the normalized dimensions mixes; weight and bias per column."""
        inp, shape, weight, bias = positional[:4]
        r_in, r_w, r_b = ref_pos[0], ref_pos[2], ref_pos[3]
        if not isinstance(r_in, _Ref):
            return None
        inner = int(np.prod(shape)) if len(shape) else 1
        rows = inp.numel() // inner
        owner = np.repeat(np.arange(rows, dtype=np.int64), inner)
        grouped = r_in.sets().group(owner, rows)
        parts = [grouped.take(owner)]
        column = np.tile(np.arange(inner, dtype=np.int64), rows)
        for tensor, ref in ((weight, r_w), (bias, r_b)):
            if isinstance(tensor, torch.Tensor) and isinstance(ref, _Ref) and ref.store.sets.nnz:
                parts.append(ref.sets().take(column))
        return IndexSets.union(parts), grouped, grouped

    def convolution(self, value: torch.Tensor, positional: Any, ref_pos: Any) -> IndexSets | None:
        inp, weight, _, stride, padding, dilation, transposed, _, groups = positional[:9]
        r_in, r_w, r_b = ref_pos[0], ref_pos[1], ref_pos[2]
        if transposed or isinstance(padding, str):
            return None
        nd = inp.dim() - 2
        batch, c_in = inp.shape[:2]
        c_out = weight.shape[0]
        c_group = c_in // groups
        out_spatial = int(np.prod(value.shape[2:]))
        kernel = int(np.prod(weight.shape[2:]))
        n_out = value.numel()
        parts = []
        if isinstance(r_in, _Ref) and r_in.store.sets.nnz:
            if batch * c_out * c_group * out_spatial * kernel > _MAX_PAIRS:
                return None
            idx = torch.arange(1, inp.numel() + 1, dtype=torch.int64).reshape(inp.shape)
            pad = [p for p in reversed(padding) for _ in range(2)]
            idx = torch.nn.functional.pad(idx, pad, value=0)
            for d in range(nd):
                k = weight.shape[2 + d]
                idx = idx.unfold(2 + d, dilation[d] * (k - 1) + 1, stride[d])[..., :: dilation[d]]
            # (B, C_in, O..., K...) -> (B, G, 1, C_group, O, K)
            idx = idx.reshape(batch, groups, 1, c_group, out_spatial, kernel)
            mask = (weight != 0) if r_w.fixed else torch.ones(weight.shape, dtype=torch.bool)
            mask = mask.reshape(1, groups, c_out // groups, c_group, 1, kernel)
            hit = (idx > 0) & mask
            b, g, co, _, o, _ = hit.nonzero(as_tuple=True)
            sources = idx.expand(hit.shape)[hit] - 1
            out_rows = ((b * c_out + g * (c_out // groups) + co) * out_spatial + o).numpy()
            parts.append(IndexSets.from_pairs(out_rows, sources.numpy(), n_out, inp.numel()).compose(r_in.sets()))
        channel = np.arange(c_out)[None, :, None].repeat(batch, axis=0).repeat(out_spatial, axis=2).reshape(-1)
        if isinstance(r_w, _Ref) and r_w.store.sets.nnz:
            owner = np.repeat(np.arange(c_out), weight.numel() // c_out)
            parts.append(r_w.sets().group(owner, c_out).take(channel))
        if isinstance(r_b, _Ref) and r_b.store.sets.nnz:
            parts.append(r_b.sets().take(channel))
        return IndexSets.union(parts) if parts else self.empty(n_out)

