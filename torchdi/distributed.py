"""Training across processes with torchdi: data parallel (replicated or FSDP2-sharded) and ``all_reduce_``.

``DistributedDataParallel`` averages gradients from hooks that fire inside ``loss.backward()``,
and FSDP2 (``fully_shard``) all-gathers parameters in forward hooks and reduce-scatters
gradients in backward hooks; torchdi computes gradients without ``backward()`` on the wrapped
module (``torch.autograd.grad``, ``torch.func`` or a compiled graph), so those hooks would do the
wrong thing silently: per-process gradients, or gradients of FSDP's own gathered copies (zero
for the tensors passed in). The remedies:

- ``DataParallel(backend)``: a backend whose gradients are reduced across processes. Plain
  ``x`` is all-reduced in flat buckets; FSDP2 DTensor ``x`` is all-gathered before ``f`` and its
  gradient reduce-scattered after, as FSDP2 does; on ``AutoCompile`` inside the compiled program,
  one unit at a time (``unit_buckets``, and the compiler's pass ``schedule_units``).
  On ``AutoAutograd``, FSDP2 ``x`` that is the modules' own parameters runs FSDP2's own hooks
  instead (``FsdpUnits``): gathered layer by layer, with FSDP2's memory and prefetching. On
  ``AutoFunc``, ``f`` receives the shards and ``functional_call`` gathers each FSDP2 unit while
  it runs, by differentiable operations (``LayeredCall``): FSDP2's schedule without its hooks.
- ``functional_call(module, params, args)``: ``torch.func.functional_call`` that keeps FSDP2's
  hooks out and takes DTensor parameters (gathered differentiably on eager autograd).
- ``all_reduce_(grads)``: average a pytree of gradients in place, once per step.

Preparation refuses a DDP-wrapped module inside ``f``, and an FSDP2 module whose own hooks run
inside ``f``, rather than return silently wrong gradients (``refuse_data_parallel``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from torchdi._distributed_private import (
    PublicCollectives,
    forward_hook_dicts,
    functional_collectives,
    is_fsdp_hook,
    layer_by_layer,
    outside_functorch,
    put_parameter,
)
from torchdi.backends import DataParallel as DataParallel  # exported here, as DESIGN names it
from torchdi.errors import UnsupportedOperatorError
from torchdi.translate import overlaps_itself

__all__ = ["DataParallel", "all_reduce_", "functional_call"]

# DDP's default bucket cap: large enough that a small model goes out in one collective, small
# enough that a large one does not need a second full copy of its gradients at once.
_BUCKET_BYTES = 25 * 2**20


def all_reduce_(grads: Any, group: Any = None, op: str = "mean") -> Any:
    """All-reduce a pytree of gradients in place through ``torch.distributed``, in flat buckets.

    Tensors are packed by dtype and device into flat buckets of at most 25 MiB (a tensor larger
    than that is a bucket of its own), each bucket is reduced with one ``all_reduce`` call, and
    the results are copied back: one or a few collective calls per step instead of one per
    tensor. Call it on every process of ``group`` with gradients of the same structure.

    Args:
        grads: a tensor or a pytree (dict/list/tuple) of tensors, e.g. the ``out=`` of
            ``torchdi.gradient`` or ``{name: p.grad}``. ``None`` leaves are skipped.
        group: the process group (``None``: the default group).
        op: ``"mean"`` (average over the group's processes, what ``DistributedDataParallel``
            does) or ``"sum"``.

    Returns:
        ``grads``, reduced in place.

    Example (in each process of ``python -m torch.distributed.run --nproc-per-node 2``; see
    ``examples/train_ddp.py``)::

        td.gradient(loss, backend, params, td.Constant(local_batch), prep=prep, out=grads)
        td.distributed.all_reduce_(grads)   # every process now holds the full-batch gradient
        optimizer.step()
    """
    if op not in ("mean", "sum"):
        raise ValueError(f'all_reduce_: op must be "mean" or "sum", got {op!r}')
    if not process_group_initialized():
        raise RuntimeError(
            "all_reduce_: torch.distributed is not initialized; call torch.distributed.init_process_group "
            "(e.g. under python -m torch.distributed.run) first"
        )
    leaves = [leaf for leaf in pytree.tree_leaves(grads) if leaf is not None]
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"all_reduce_: grads must be a pytree of tensors, found a leaf of type {type(leaf).__name__}")
    world = torch.distributed.get_world_size(group)
    for bucket in _buckets(leaves):
        flat = bucket[0].reshape(-1) if len(bucket) == 1 and bucket[0].is_contiguous() else torch.cat([t.reshape(-1) for t in bucket])
        torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.SUM, group=group)
        if op == "mean":
            flat.div_(world)
        if len(bucket) == 1 and flat.data_ptr() == bucket[0].data_ptr():
            continue  # reduced in place already
        offset = 0
        with torch.no_grad():
            for t in bucket:
                reduced = flat[offset : offset + t.numel()].view(t.shape)
                if overlaps_itself(t):
                    # An expanded gradient (d sum(x) is a stride-0 view of one number): its
                    # elements share memory, so it cannot hold different values; the tensor is
                    # pointed at its own reduced storage instead, still in place for the caller.
                    fresh = reduced.clone()
                    t.set_(fresh.untyped_storage(), 0, fresh.shape, fresh.stride())
                else:
                    t.copy_(reduced)
                offset += t.numel()
    return grads


def _buckets(leaves: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Leaves grouped by (dtype, device), in order, each group split at ``_BUCKET_BYTES``."""
    groups: dict[tuple[torch.dtype, torch.device], list[list[torch.Tensor]]] = {}
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    for leaf in leaves:
        key = (leaf.dtype, leaf.device)
        nbytes = leaf.numel() * leaf.element_size()
        if key not in groups or sizes[key] + nbytes > _BUCKET_BYTES:
            groups.setdefault(key, []).append([])
            sizes[key] = 0
        groups[key][-1].append(leaf)
        sizes[key] += nbytes
    return [bucket for buckets in groups.values() for bucket in buckets if bucket]


def process_group_initialized() -> bool:
    """Whether ``torch.distributed`` is available and a default process group is initialized."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def require_process_group(who: str, group: Any = None) -> None:
    """Raise ``RuntimeError`` naming ``init_process_group`` when ``torch.distributed`` is not set up."""
    if not process_group_initialized():
        raise RuntimeError(
            f"{who}: torch.distributed is not initialized; call torch.distributed.init_process_group "
            "(e.g. under python -m torch.distributed.run) in every process first"
        )


# -- FSDP2 -----------------------------------------------------------------------------------------


# Both types only as far as something imported their modules already: every use is an isinstance
# check, and no FSDP2 module or DTensor exists before its module is imported. Importing them here
# cost every preparation about 0.5 s (torch.distributed.fsdp, through DTensor's operator tables:
# a third of a warm AutoCompile(compiler="aot_inductor") MLP's first result).


def _fsdp_module_type() -> type | None:
    """``torch.distributed.fsdp.FSDPModule`` (FSDP2), or ``None`` where this torch has none
    (before 2.6, or without distributed) or nothing has imported it."""
    return getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)


def _dtensor_type() -> type | None:
    """``torch.distributed.tensor.DTensor``, or ``None`` where nothing has imported it."""
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


# Ids of FSDP2 modules whose own forward hooks are switched off right now (see _fsdp_hooks_off),
# and whether a DataParallel runner is running f on gathered (full, plain) parameters.
_HOOKS_OFF: set[int] = set()
_GATHERED = [0]
# Whether a DataParallel(AutoAutograd()) runner runs f with FSDP2's own hooks on (FSDPUnits).
_NATIVE = [0]
# The call of f a DataParallel(AutoFunc()) runner runs with x's shards, gathered unit by unit.
_LAYERED: list[LayeredCall | None] = [None]
_LOCK = threading.Lock()


@contextlib.contextmanager
def _fsdp_hooks_off(modules: list[torch.nn.Module]) -> Iterator[None]:
    """Switch FSDP2's forward hooks off on the FSDP modules among ``modules`` and their children.

    Those hooks all-gather FSDP's own parameters and use them in place of the tensors passed to
    ``functional_call``; with them off, the modules compute with the tensors they are given.
    """
    fsdp = _fsdp_module_type()
    removed: list[tuple[dict[int, Any], list[tuple[int, Any]], dict[int, Any]]] = []
    ids: list[int] = []
    if fsdp is not None:
        seen: set[int] = set()
        for root in modules:
            for module in root.modules():
                if not isinstance(module, fsdp) or id(module) in seen or id(module) in _HOOKS_OFF:
                    continue
                seen.add(id(module))
                found = False
                dicts = forward_hook_dicts(module)
                if not dicts:  # (fence: a torch whose modules do not show their hooks)
                    raise UnsupportedOperatorError(
                        f"torchdi.distributed: torch {torch.__version__} does not let torchdi switch FSDP2's own "
                        f"forward hooks off on the sharded {type(module).__name__}, and with them on, f would compute "
                        "with FSDP's gathered copies instead of the tensors torchdi differentiates. Use replicated "
                        "parameters (plain tensors, all-reduced as with DDP) with torchdi.distributed.DataParallel, "
                        "or a torch where FSDP2 modules are supported (2.9 .. 2.14.1)."
                    )
                for hooks in dicts:
                    ours = {key: hook for key, hook in hooks.items() if is_fsdp_hook(hook)}
                    if ours:
                        found = True
                        removed.append((hooks, list(hooks.items()), ours))
                        for key in ours:
                            del hooks[key]
                if found:  # else its hooks stay on, and refuse_data_parallel refuses it at preparation
                    ids.append(id(module))
    with _LOCK:
        _HOOKS_OFF.update(ids)
    try:
        yield
    finally:
        with _LOCK:
            _HOOKS_OFF.difference_update(ids)
        for hooks, order, ours in removed:
            current = dict(hooks)
            hooks.clear()
            for key, _hook in order:  # back in their places (FSDP's pre-hook runs first)
                if key in ours:
                    hooks[key] = ours[key]
                elif key in current:
                    hooks[key] = current.pop(key)
            hooks.update(current)  # hooks added meanwhile, after


def _replicated(tensor: Any) -> torch.Tensor:
    """A DTensor parameter gathered whole, differentiably: its gradient is reduce-scattered back
    to its placements and averaged over the mesh (what FSDP2 computes) by DTensor's autograd."""
    from torch.distributed.tensor import Partial, Replicate

    mesh = tensor.device_mesh
    return tensor.redistribute(mesh, [Replicate()] * mesh.ndim).to_local(grad_placements=[Partial("avg")] * mesh.ndim)


# -- FSDP2 units gathered one at a time, as differentiable operations ---------------------------------
#
# FSDP2 all-gathers a unit's parameters in a forward pre-hook, frees them after the unit's forward,
# all-gathers them again when the unit's backward begins and reduce-scatters their gradients when it
# ends. Its hooks do that by saved-tensor and tensor hooks, which torch.func turns off. The same
# schedule, as two autograd.Functions (which torch.func differentiates):
#
# - _GatherUnit: forward all-gathers the unit's shards into full tensors (one collective), backward
#   reduce-scatters their gradients to the shards (one collective) and frees the full tensors;
# - _RegatherInBackward: identity on the unit's outputs, whose backward (which runs just before the
#   unit's own backward nodes) all-gathers the parameters again into the storage they had.
#
# Between the unit's forward and its backward the full tensors keep their shape but not their
# memory (``untyped_storage().resize_(0)``, as FSDP2 frees them), so the backward nodes that saved
# them find them filled again when they run. The outermost units (the root) keep theirs until their
# backward, as FSDP2 keeps the root's.


@dataclass(frozen=True)
class _UnitPlan:
    """One FSDP2 unit: the parameters it manages (by name in the called module), where each is
    registered (tied ones: every place), and their global shapes."""

    module: torch.nn.Module
    names: tuple[str, ...]
    slots: tuple[tuple[tuple[torch.nn.Module, str], ...], ...]
    shapes: tuple[torch.Size, ...]
    outermost: bool


@dataclass(frozen=True)
class _ModulePlan:
    key: tuple[int, ...]  # the ids of the module's parameters when the plan was made
    units: tuple[_UnitPlan, ...]
    mesh: Any
    sharded: frozenset[str]  # every name of a parameter some unit gathers


# The plans of the last few modules called (by id, checked against their parameters' ids): a
# plan holds its modules, so the cache is small rather than keyed weakly.
_PLANS: dict[int, _ModulePlan] = {}
_PLANS_KEPT = 8


def _module_plan(module: torch.nn.Module) -> _ModulePlan | None:
    """The FSDP2 units of ``module`` and the parameters each gathers, or ``None`` when a sharded
    parameter is not ``Shard(0)`` over one 1-D mesh (then the parameters are gathered whole)."""
    fsdp: Any = _fsdp_module_type()
    dtensor: Any = _dtensor_type()
    if fsdp is None or dtensor is None or not layer_by_layer():
        return None
    named = dict(module.named_parameters())
    key = tuple(id(p) for p in named.values())
    cached = _PLANS.get(id(module))
    if cached is not None and cached.key == key:
        return cached
    from torch.distributed.tensor import Shard

    name_of = {id(p): n for n, p in named.items()}
    units = [m for m in module.modules() if isinstance(m, fsdp)]
    inner = {id(m) for unit in units for m in unit.modules() if m is not unit and isinstance(m, fsdp)}
    owner: dict[int, int] = {}
    slots: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    order: list[list[int]] = [[] for _ in units]
    for index, unit in enumerate(units):
        stack = [unit]
        while stack:  # the unit's modules, not descending into nested units
            sub = stack.pop()
            for attr, param in sub.named_parameters(recurse=False, remove_duplicate=False):
                if param is None:
                    continue
                slots.setdefault(id(param), []).append((sub, attr))
                if id(param) not in owner:
                    owner[id(param)] = index
                    order[index].append(id(param))
            stack.extend(child for child in sub.children() if not isinstance(child, fsdp))
    mesh = None
    plans = []
    params: dict[int, Any] = {id(p): p for p in named.values()}
    for index, unit in enumerate(units):
        names, unit_slots, shapes = [], [], []
        for pid in order[index]:
            param = params.get(pid)
            if param is None or not isinstance(param, dtensor):
                return None
            mesh = param.device_mesh if mesh is None else mesh
            if param.device_mesh != mesh or mesh.ndim != 1 or tuple(param.placements) != (Shard(0),):
                return None
            names.append(name_of[pid])
            unit_slots.append(tuple(slots[pid]))
            shapes.append(param.shape)
        if names:
            plans.append(_UnitPlan(unit, tuple(names), tuple(unit_slots), tuple(shapes), id(unit) not in inner))
    if mesh is None:
        return None
    plan = _ModulePlan(key, tuple(plans), mesh, frozenset(n for p in plans for n in p.names))
    _PLANS.pop(id(module), None)
    _PLANS[id(module)] = plan
    while len(_PLANS) > _PLANS_KEPT:
        del _PLANS[next(iter(_PLANS))]  # the oldest
    return plan


class LayeredCall:
    """What one call of ``f`` shares across its units: the process group, the scale of the
    gradients (``1 / world`` for the mean) and, under a ``DataParallel`` runner, the gradients
    each of ``x``'s shards received through the gathers (to check that they are all it received)."""

    def __init__(self, group: Any, world: int, scale: float, shards: list[torch.Tensor] | None = None) -> None:
        self.group = group
        self.world = world
        self.scale = scale
        self.index = {_storage_key(t): i for i, t in enumerate(shards)} if shards is not None else None
        self.received: dict[int, list[torch.Tensor]] = {}
        self.gathered_elements: list[int] = []  # the size of each all-gather, in order (for tests)
        self.live_bytes = 0  # of gathered full parameters alive now, and at most (for benchmarks)
        self.peak_bytes = 0
        self.staged_bytes = 0  # of gradients padded (copied) before their reduce-scatter (for tests)

    def count(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def record(self, shard: torch.Tensor, grad: torch.Tensor) -> None:
        if self.index is not None:
            i = self.index.get(_storage_key(shard))
            if i is not None:
                self.received.setdefault(i, []).append(grad)

    def check(self, grads: list[torch.Tensor], names: list[str], who: str) -> None:
        """Raise unless each gradient is exactly what the gathers of its shard reduce-scattered."""
        received, self.received, self.index = self.received, {}, None  # (held no longer than the call)
        for i, (grad, name) in enumerate(zip(grads, names)):
            parts = received.get(i)
            if parts is None:
                ok = not bool(grad.ne(0).any())
            elif len(parts) == 1:
                ok = torch.equal(grad, parts[0])
            else:  # several gathers of one shard: summed in another order than autograd's
                ok = torch.allclose(grad, torch.stack(parts).sum(0), rtol=1e-6, atol=0.0)
            if not ok:
                raise ValueError(
                    f"{who}: x{name} reached f's result other than through torchdi.distributed.functional_call. "
                    "Layer by layer, f receives this process's shards of x (each FSDP2 unit's parameters are gathered "
                    "only while the unit runs), so a computation on them elsewhere in f (a weight penalty, a copy) "
                    "would differentiate a shard, not the parameter. Compute it inside the module, or use "
                    "DataParallel(torchdi.AutoCompile()), which gives f the whole parameters."
                )


class _UnitRun:
    """One forward of one unit: its shards, the full tensors gathered from them."""

    def __init__(self, plan: _UnitPlan, call: LayeredCall) -> None:
        self.plan = plan
        self.call = call
        self.shards: list[torch.Tensor] = []
        self.fulls: list[torch.Tensor] = []

    def _all_gather(self, shards: list[torch.Tensor]) -> list[torch.Tensor]:
        world = self.call.world
        chunks = [-(-shape[0] // world) for shape in self.plan.shapes]
        flat = torch.cat([_pad_rows(s, c).reshape(-1) for s, c in zip(shards, chunks)])
        self.call.gathered_elements.append(flat.numel() * world)
        with outside_functorch():  # (torch.func's transforms run gloo's collectives into a crash)
            rows = PublicCollectives.all_gather_single(flat, 0, self.call.group).view(world, -1)
        pieces, offset = [], 0
        for shape, chunk in zip(self.plan.shapes, chunks):
            size = chunk * (shape.numel() // max(shape[0], 1))
            pieces.append(rows[:, offset : offset + size].reshape(world * chunk, *shape[1:])[: shape[0]])
            offset += size
        return pieces

    def gather(self, shards: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        self.shards = [s.detach() for s in shards]
        # each its own memory, so that each can be freed and filled again on its own
        self.fulls = [piece.clone(memory_format=torch.contiguous_format) for piece in self._all_gather(self.shards)]
        self.call.count(sum(full.untyped_storage().nbytes() for full in self.fulls))
        return self.fulls

    def free(self) -> None:
        for full in self.fulls:
            self.call.count(-full.untyped_storage().nbytes())
            full.untyped_storage().resize_(0)

    def regather(self) -> None:
        if not self.fulls or self.fulls[0].untyped_storage().nbytes() > 0:
            return  # (kept: an outermost unit, or already gathered again)
        # Outside torch.func's transform (whose backward this runs in): the full tensors were
        # made outside it, and writing into them is refused there.
        with outside_functorch():
            for full, piece in zip(self.fulls, self._all_gather(self.shards)):
                full.untyped_storage().resize_(full.numel() * full.element_size())
                self.call.count(full.untyped_storage().nbytes())
                full.data.copy_(piece)  # .data: the saved tensor's version stays, as it was saved

    def reduce_scatter(self, grads: tuple[torch.Tensor | None, ...]) -> list[torch.Tensor]:
        world = self.call.world
        # The unit's backward is over (every node that saved its full parameters has passed its
        # gradient here): they are freed before the reduce-scatter allocates.
        self.free()
        # One reduce-scatter per tensor, straight from the gradient's own memory: the engine holds
        # the full gradients until this backward returns, so a flat bucket copied from them (one
        # collective per unit) would be a second full gradient alive at once. Measured
        # (benchmarks/distributed.py --memory, MLP 8x1024^2): the flat copy and an out-of-place
        # scaling made the step peak 1.43x eager FSDP2's. A tensor whose rows do not divide by the
        # processes is padded (a copy of that tensor only).
        out = []
        for grad, full, shard in zip(grads, self.fulls, self.shards):
            chunk = -(-full.shape[0] // world)
            g = torch.zeros(full.shape, dtype=full.dtype, device=full.device) if grad is None else grad
            if world * chunk != full.shape[0]:
                self.call.staged_bytes += world * chunk * (full.numel() // max(full.shape[0], 1)) * full.element_size()
            staged = _pad_rows(g, world * chunk).contiguous()
            del g
            with outside_functorch():
                part = PublicCollectives.reduce_scatter_single(staged.reshape(-1), "sum", 0, self.call.group)
                part.mul_(self.call.scale)  # in place: the output is this tensor's own (no copy for the mean)
            del staged
            grad_shard = part.view(chunk, *full.shape[1:])[: shard.shape[0]]
            self.call.record(shard, grad_shard)
            out.append(grad_shard)
        self.fulls, self.shards = [], []
        return out


class _GatherUnit(torch.autograd.Function):
    """A unit's shards -> its full parameters (all-gather); backward: reduce-scatter."""

    @staticmethod
    def forward(run: _UnitRun, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with outside_functorch():
            return tuple(run.gather(shards))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.run = inputs[0]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        run, ctx.run = ctx.run, None  # (no cycle through the graph keeps the unit's tensors alive)
        return (None, *run.reduce_scatter(grads))


class _RegatherInBackward(torch.autograd.Function):
    """The identity on a unit's outputs; backward: the unit's parameters gathered again."""

    @staticmethod
    def forward(run: _UnitRun, *outputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(o.view_as(o) for o in outputs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.run = inputs[0]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        run, ctx.run = ctx.run, None
        run.regather()
        return (None, *grads)


def _layered_call(module: torch.nn.Module, plan: _ModulePlan, dicts: tuple[dict[str, Any], ...], call: LayeredCall,
                  args: Any, kwargs: dict[str, Any] | None, tie_weights: bool, strict: bool, several: bool) -> Any:
    """``torch.func.functional_call`` with ``dicts`` holding this process's shards of the sharded
    parameters, each unit's gathered just before it runs (see above)."""
    values: dict[str, Any] = {}
    for d in dicts:
        values.update(d)
    handles = []

    def pre_hook(unit: _UnitPlan) -> Callable[..., None]:
        def hook(module_: torch.nn.Module, inputs: Any) -> None:
            run = _UnitRun(unit, call)
            fulls = _GatherUnit.apply(run, *[values[name] for name in unit.names])
            for full, places in zip(fulls, unit.slots):
                for sub, attr in places:
                    put_parameter(sub, attr, full)
            runs[id(module_)] = run

        return hook

    def post_hook(module_: torch.nn.Module, inputs: Any, output: Any) -> Any:
        run = runs[id(module_)]
        leaves, spec = pytree.tree_flatten(output)
        where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()]
        run.free()
        if where and torch.is_grad_enabled():
            wrapped = _RegatherInBackward.apply(run, *[leaves[i] for i in where])
            for i, leaf in zip(where, wrapped):
                leaves[i] = leaf
            return pytree.tree_unflatten(leaves, spec)
        return None

    runs: dict[int, _UnitRun] = {}
    for unit in plan.units:
        for name, shape in zip(unit.names, unit.shapes):
            value = values.get(name)
            expected = (-(-shape[0] // call.world) if call.world else 0, *shape[1:])
            if not isinstance(value, torch.Tensor) or value.dim() != len(shape) or tuple(value.shape[1:]) != tuple(shape[1:]) or value.shape[0] > expected[0]:
                raise ValueError(
                    f"torchdi.distributed.functional_call: parameter {name!r} of the FSDP2-sharded module needs this "
                    f"process's shard (rows of a {tuple(shape)} tensor sharded on dim 0), got "
                    f"{type(value).__name__ if not isinstance(value, torch.Tensor) else tuple(value.shape)}: pass x's "
                    "tensors as f receives them (params = dict(model.named_parameters()))."
                )
        handles.append(unit.module.register_forward_pre_hook(pre_hook(unit)))
        if not unit.outermost:
            handles.append(unit.module.register_forward_hook(post_hook))
    # functional_call writes what the module holds at its end back into the dicts: the gathered
    # tensors would replace the shards there (and torch.func, which reads its inputs back from
    # them, would differentiate those). Copies take that; the rest (a buffer the module
    # reassigned) is written back as functional_call would.
    copies = tuple(dict(d) for d in dicts)
    try:
        with _fsdp_hooks_off([module]):
            return torch.func.functional_call(module, copies if several else copies[0], args, kwargs, tie_weights=tie_weights, strict=strict)
    finally:
        for handle in handles:
            handle.remove()
        for d, copy in zip(dicts, copies):
            for name in d:
                if name not in plan.sharded and copy.get(name, d[name]) is not d[name]:
                    d[name] = copy[name]


def functional_call(
    module: torch.nn.Module,
    parameter_and_buffer_dicts: Any,
    args: Any = (),
    kwargs: dict[str, Any] | None = None,
    *,
    tie_weights: bool = True,
    strict: bool = False,
) -> Any:
    """``torch.func.functional_call`` for modules sharded with FSDP2 (and for any other module).

    Runs ``module`` with the given tensors in place of its parameters and buffers, with FSDP2's
    forward hooks kept out: those hooks all-gather FSDP's own parameters and use them instead
    of the tensors passed in, so nothing passed in would be differentiated (a zero gradient).
    DTensor entries (the sharded parameters, as ``dict(model.named_parameters())`` holds them)
    are gathered whole first, differentiably: on eager autograd their gradients come back
    sharded like them, averaged over the mesh as FSDP2 averages. Under
    ``torchdi.distributed.DataParallel`` the parameters arrive gathered already, and the
    gathering and the reduction of gradients happen around ``f`` (inside the compiled program on
    ``AutoCompile``). On a module without FSDP2 it is ``torch.func.functional_call``.

    Args:
        module: the module (an FSDP2 root, a module containing FSDP2 modules, or any module).
        parameter_and_buffer_dicts: a dict of tensors by name, or a tuple of dicts (parameters,
            buffers), as for ``torch.func.functional_call``.
        args, kwargs: the module's inputs.
        tie_weights, strict: as for ``torch.func.functional_call``.

    Returns:
        The module's output.

    Raises:
        UnsupportedOperatorError: DTensor parameters reached ``f`` through a ``torch.func`` or
            ``torch.compile`` backend without ``DataParallel`` (those cannot differentiate
            DTensors): the message names the backend to use.

    Example (each process; see ``examples/train_fsdp.py``)::

        def loss_fn(params, model, batch):
            inputs, labels = batch
            logits = torchdi.distributed.functional_call(model, params, (inputs,))
            return torch.nn.functional.cross_entropy(logits, labels)

        params = dict(model.named_parameters())          # DTensors, sharded by fully_shard
        backend = torchdi.distributed.DataParallel(torchdi.AutoCompile())
        torchdi.gradient(loss_fn, backend, params, torchdi.Constant(model), torchdi.Constant(batch),
                         out=torchdi.into_grad(params))  # .grad: DTensors, sharded like params
    """
    several = isinstance(parameter_and_buffer_dicts, (tuple, list))
    dicts = tuple(parameter_and_buffer_dicts) if several else (parameter_and_buffer_dicts,)
    if _NATIVE[0]:
        # Inside DataParallel(AutoAutograd()) on FSDP2 parameters: the module runs as FSDP2
        # intends, its hooks gathering each unit's parameters; so the tensors passed must be
        # the module's own (views of them), else they would silently not be what is computed with.
        _check_own_tensors(module, dicts)
        return module(*args, **(kwargs or {}))
    if _LAYERED[0] is not None:
        # Inside DataParallel(AutoFunc()): the dicts hold this process's shards; each FSDP2 unit's
        # are gathered while it runs, and its gradients reduce-scattered by its backward.
        plan = _module_plan(module)
        if plan is None:
            raise ValueError(
                f"torchdi.distributed.functional_call: {type(module).__name__} has FSDP2 parameters that are not all "
                "sharded on dim 0 over one 1-D mesh (fully_shard's default), which DataParallel(torchdi.AutoFunc()) "
                "gathers unit by unit; use DataParallel(torchdi.AutoAutograd()), which runs FSDP2's own hooks."
            )
        return _layered_call(module, plan, dicts, _LAYERED[0], args, kwargs, tie_weights, strict, several)
    if _GATHERED[0]:
        # Inside a DataParallel runner: full plain tensors, FSDP's hooks already off (switched
        # outside any compiled program, which would otherwise have to trace the switching).
        return torch.func.functional_call(module, parameter_and_buffer_dicts, args, kwargs, tie_weights=tie_weights, strict=strict)
    dtensor = _dtensor_type()
    if dtensor is not None and any(isinstance(v, dtensor) for d in dicts for v in d.values()):
        # DTensor parameters on eager autograd (and at preparation): gathered unit by unit too,
        # by the same operations on their local shards, whose gradients come back as DTensors.
        plan = _module_plan(module)
        given = {name for d in dicts for name, v in d.items() if isinstance(v, dtensor)}
        if plan is not None and plan.sharded == given:
            mesh = plan.mesh
            call = LayeredCall(mesh.get_group(), mesh.size(), 1.0 / mesh.size())
            local = tuple({name: v.to_local() if name in given else v for name, v in d.items()} for d in dicts)
            return _layered_call(module, plan, local, call, args, kwargs, tie_weights, strict, several)
    with _fsdp_hooks_off([module]):
        if dtensor is not None:
            dicts = tuple({name: _full(module, name, value, dtensor) for name, value in d.items()} for d in dicts)
        return torch.func.functional_call(module, dicts if several else dicts[0], args, kwargs, tie_weights=tie_weights, strict=strict)


def _full(module: torch.nn.Module, name: str, value: Any, dtensor: type) -> Any:
    if isinstance(value, dtensor):
        return _replicated(value)
    if isinstance(value, torch.Tensor) and isinstance(_registered(module, name), dtensor):
        # A DTensor that torch.func wrapped (it is no longer a DTensor to isinstance) or a plain
        # tensor passed for a sharded parameter outside DataParallel: torch.func and
        # torch.compile cannot differentiate DTensors, and computing with this would mix them.
        raise UnsupportedOperatorError(
            f"torchdi.distributed.functional_call: parameter {name!r} of the FSDP2-sharded module is a DTensor, "
            "and this backend (torch.func or torch.compile) cannot differentiate DTensors. Wrap the backend: "
            "torchdi.distributed.DataParallel(torchdi.AutoFunc()) or DataParallel(torchdi.AutoCompile()) gather "
            "the shards before f and reduce-scatter the gradients after; AutoAutograd() also works unwrapped."
        )
    return value


def _check_own_tensors(module: torch.nn.Module, dicts: tuple[Any, ...]) -> None:
    for d in dicts:
        for name, value in d.items():
            own = _registered(module, name)
            if own is None:
                try:
                    own = module.get_buffer(name)
                except AttributeError:
                    own = None
            if own is None or not isinstance(value, torch.Tensor) or _storage_key(value) != _storage_key(own):
                raise ValueError(
                    f"torchdi.distributed.functional_call: under DataParallel(AutoAutograd()) the FSDP2-sharded "
                    f"module runs with FSDP2's own hooks, which compute with its own parameters, but {name!r} is "
                    "another tensor. Pass the module's own tensors (params = dict(model.named_parameters()), "
                    "x of the gradient), or use DataParallel(AutoFunc()) / DataParallel(AutoCompile()), which "
                    "compute with the tensors passed."
                )


def _storage_key(t: torch.Tensor) -> tuple[Any, ...]:
    """Where ``t``'s elements live (its local shard for a DTensor): equal for a tensor and its detached views."""
    dtensor: Any = _dtensor_type()
    local = t.to_local() if dtensor is not None and isinstance(t, dtensor) else t
    return (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape), tuple(local.stride()), local.dtype)


def _registered(module: torch.nn.Module, name: str) -> Any:
    try:
        return module.get_parameter(name)
    except AttributeError:
        return None


class FsdpUnits:
    """FSDP2 modules run with their own hooks, for ``DataParallel(AutoAutograd())``: layer by layer.

    Eager FSDP2 all-gathers each ``fully_shard``-ed unit's parameters in a forward pre-hook, frees
    them after the unit's forward, gathers them again before its backward (prefetching the next
    unit's while one computes) and reduce-scatters each unit's gradients as soon as they exist,
    so a process never holds more than a unit or two of full parameters. Under eager autograd
    torchdi runs exactly that: ``f`` calls the module itself (``functional_call`` passes through
    when given the module's own tensors), the backward runs over FSDP2's unsharded parameters
    (``inputs=``, so no other tensor's ``.grad`` moves), and the sharded gradients FSDP2 writes
    into the parameters' ``.grad`` are taken (and every ``.grad`` put back as it was). What
    ``fully_shard`` accepts works as it does for FSDP2: any mesh (HSDP's 2-D one), any shard
    placement, mixed precision, prefetching.
    """

    def __init__(self, roots: list[torch.nn.Module], owned: dict[tuple[Any, ...], torch.nn.Parameter]) -> None:
        fsdp = _fsdp_module_type()
        self.roots = roots
        self.owned = owned  # the sharded parameters, by where their shards live
        self.units = [m for root in roots for m in root.modules() if fsdp is not None and isinstance(m, fsdp)]

    @staticmethod
    def of(x: Any, contexts: tuple[Any, ...]) -> FsdpUnits | None:
        """The FSDP2 roots among ``contexts`` when every leaf of ``x`` is one of their sharded
        parameters (or a detached view of one), else ``None``."""
        fsdp: Any = _fsdp_module_type()
        dtensor: Any = _dtensor_type()
        leaves = pytree.tree_leaves(x)
        if fsdp is None or dtensor is None or not leaves or not all(isinstance(leaf, dtensor) for leaf in leaves):
            return None
        roots = [m for m in pytree.tree_leaves(contexts) if isinstance(m, fsdp)]
        owned: dict[tuple[Any, ...], torch.nn.Parameter] = {}
        for root in roots:
            for param in root.parameters():
                if isinstance(param, dtensor):
                    owned.setdefault(_storage_key(param), param)
        units = FsdpUnits(roots, owned)
        return units if units.match(leaves) is not None else None

    def match(self, leaves: list[Any]) -> list[torch.nn.Parameter] | None:
        """The sharded parameters that ``leaves`` are (views of), or ``None`` if one is not."""
        dtensor: Any = _dtensor_type()
        params = [self.owned.get(_storage_key(leaf)) if dtensor is not None and isinstance(leaf, dtensor) else None for leaf in leaves]
        if any(p is None for p in params) or len({id(p) for p in params}) != len(params):
            return None
        return params  # type: ignore[return-value]  # (no None left)

    def gradient(self, f: Callable[..., Any], x: Any, params: list[torch.nn.Parameter], contexts: tuple[Any, ...],
                 op: str, needs_value: bool) -> tuple[Any, Any]:
        """``f``'s value (reduced over the mesh) and the gradient, as FSDP2's backward leaves it."""
        dtensor = _dtensor_type()
        stashed = [(p, p.grad) for p in self.owned.values()]
        unsharded: dict[int, torch.Tensor] = {}

        def record(module: torch.nn.Module, args: Any) -> None:
            # Runs after FSDP2's own pre-forward hook (registered first, with prepend=True):
            # the unit's parameters are now the full tensors FSDP2 gathered, the leaves of the backward.
            for param in module.parameters():
                if param.requires_grad and not isinstance(param, dtensor):  # type: ignore[arg-type]
                    unsharded[id(param)] = param

        handles = [unit.register_forward_pre_hook(record) for unit in self.units]
        try:
            for p, _ in stashed:
                p.grad = None
            with torch.enable_grad():
                _NATIVE[0] += 1
                try:
                    value = f(x, contexts)
                finally:
                    _NATIVE[0] -= 1
                    for handle in handles:
                        handle.remove()
                if not isinstance(value, torch.Tensor):
                    raise TypeError(f"DataParallel: f must return a tensor, got {type(value).__name__}")
                mesh = params[0].device_mesh  # type: ignore[attr-defined]
                total, pending = None, None
                if needs_value:
                    # The value's reduction starts now and runs while the backward computes
                    # (every process issues it before FSDP2's backward collectives, in one order).
                    total = value.detach().clone()
                    pending = torch.distributed.all_reduce(total, group=mesh.get_group(0), async_op=True)
                if value.requires_grad and unsharded:
                    torch.autograd.backward(value, inputs=list(unsharded.values()))
                if pending is not None:
                    pending.wait()
            if any(p.grad is not None for p in unsharded.values()):
                # FSDP2 kept the unsharded gradients (set_requires_gradient_sync(False)): this
                # call's sharded gradient does not exist; a zero in its place would be wrong.
                raise ValueError(
                    "DataParallel(AutoAutograd()): FSDP2's gradient synchronisation is off "
                    "(set_requires_gradient_sync(False)), so FSDP2 accumulated this call's gradient unsharded "
                    "and reduce-scattered nothing. Keep synchronisation on and accumulate with "
                    "out=torchdi.into_grad(params) (it adds to .grad) instead."
                )
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        finally:
            for p, grad in stashed:
                p.grad = grad
        world = mesh.size()
        if op == "sum":  # FSDP2 averages over the mesh
            grads = [g * world for g in grads]
        value = value.detach()
        if total is not None:
            for dim in range(1, mesh.ndim):  # the sum over every process of the mesh
                torch.distributed.all_reduce(total, group=mesh.get_group(dim))
            value = total * (1.0 / world) if op == "mean" else total
        return value, pytree.tree_unflatten(grads, pytree.tree_structure(x))


@dataclass(frozen=True)
class Layout:
    """How ``x``'s leaves are laid out across processes, fixed at preparation.

    ``sharded``: every leaf is a DTensor sharded on dim 0 over one 1-D mesh (FSDP2); else every
    leaf is a plain tensor replicated over ``group``.
    """

    spec: pytree.TreeSpec
    sharded: bool
    group: Any
    world: int
    rank: int
    mesh: Any
    placements: tuple[Any, ...]
    shapes: tuple[torch.Size, ...]  # global shapes
    strides: tuple[tuple[int, ...], ...]  # global strides
    local_rows: tuple[int, ...]
    chunks: tuple[int, ...]  # rows per rank, padded (FSDP2's even split)
    buckets: tuple[tuple[int, ...], ...]

    @staticmethod
    def of(x: Any, group: Any, who: str) -> Layout:
        require_process_group(who)
        # Probed here, eagerly: probed first inside the compiled program, the fence's cached
        # module is a global that changes during the trace, and dynamo's guard on it then
        # recompiles the program at the next call.
        _funcol()
        leaves, spec = pytree.tree_flatten(x)
        dtensor = _dtensor_type()
        kinds = {dtensor is not None and isinstance(leaf, dtensor) for leaf in leaves}
        if kinds == {True, False}:
            names = [pytree.keystr(path) for path, leaf in pytree.tree_flatten_with_path(x)[0] if not isinstance(leaf, dtensor)]  # type: ignore[arg-type]
            raise ValueError(
                f"{who}: x mixes DTensors (sharded parameters) and plain tensors (e.g. x{names[0]}); mixed placements "
                "are not supported. Shard every parameter (fully_shard on the root module too, as FSDP2 recommends) or "
                "none (plain tensors are all-reduced, as with DDP)."
            )
        if True not in kinds:
            group = group if group is not None else torch.distributed.group.WORLD
            world, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
            sizes = [leaf.numel() * leaf.element_size() for leaf in leaves]
            return Layout(spec, False, group, world, rank, None, (), tuple(leaf.shape for leaf in leaves),
                          tuple(leaf.stride() for leaf in leaves), (), (), _bucket_indices(leaves, sizes))
        from torch.distributed.tensor import Shard

        mesh, placements = leaves[0].device_mesh, tuple(leaves[0].placements)
        for path, leaf in pytree.tree_flatten_with_path(x)[0]:
            if leaf.device_mesh != mesh or tuple(leaf.placements) != placements or mesh.ndim != 1 or placements != (Shard(0),):
                raise ValueError(
                    f"{who}: x{pytree.keystr(path)} is a DTensor on mesh {leaf.device_mesh} with placements "
                    f"{tuple(leaf.placements)}; this backend gathers the shards itself and supports only parameters "
                    f"all sharded on dim 0 over the same 1-D mesh (fully_shard's default), the first is {placements} "
                    f"on {mesh}. Other placements (a 2-D mesh as in HSDP, Shard(1), mixed placements) work with "
                    "DataParallel(torchdi.AutoAutograd()) and x = dict(model.named_parameters()) of FSDP2 modules: "
                    "FSDP2's own hooks then gather and reduce them."
                )
        mesh_group = mesh.get_group()
        if group is not None and group is not mesh_group:
            raise ValueError(f"{who}: group= differs from the device mesh's group of the sharded parameters; leave group=None")
        world, rank = mesh.size(), mesh.get_local_rank()
        shapes = tuple(leaf.shape for leaf in leaves)
        chunks = tuple(-(-shape[0] // world) for shape in shapes)
        locals_ = [leaf.to_local() for leaf in leaves]
        sizes = [c * (shape.numel() // max(shape[0], 1)) * leaf.element_size() * world for c, shape, leaf in zip(chunks, shapes, leaves)]
        return Layout(spec, True, mesh_group, world, rank, mesh, placements, shapes, tuple(leaf.stride() for leaf in leaves),
                      tuple(t.shape[0] for t in locals_), chunks, _bucket_indices(leaves, sizes))

    # -- outside the compiled program: DTensors in, DTensors out --------------------------------

    def lower(self, x: Any, who: str) -> list[torch.Tensor]:
        """The local tensors of ``x``'s leaves (its shards, or the tensors themselves)."""
        leaves = pytree.tree_leaves(x)
        if not self.sharded:
            return leaves
        dtensor = _dtensor_type()
        if not all(isinstance(leaf, dtensor) for leaf in leaves):  # type: ignore[arg-type]
            raise ValueError(f"{who}: x was prepared with DTensors (sharded parameters) and is now given plain tensors; prepare again")
        return [leaf.to_local() for leaf in leaves]

    def lift(self, grads: list[torch.Tensor]) -> Any:
        """The gradient pytree, as DTensors with ``x``'s placements when ``x`` is sharded."""
        if self.sharded:
            from torch.distributed.tensor import DTensor

            grads = [
                DTensor.from_local(g, self.mesh, self.placements, run_check=False, shape=shape, stride=stride)
                for g, shape, stride in zip(grads, self.shapes, self.strides)
            ]
        return pytree.tree_unflatten(grads, self.spec)

    # -- inside the (compiled) program: traceable functional collectives -------------------------

    def gather(self, local: list[torch.Tensor]) -> Any:
        """The full tensors, as a pytree like ``x``: one all-gather per bucket."""
        if not self.sharded:
            return pytree.tree_unflatten(local, self.spec)
        funcol = _funcol()
        full: list[Any] = [None] * len(local)
        for bucket in self.buckets:
            flat = torch.cat([_pad_rows(local[i], self.chunks[i]).reshape(-1) for i in bucket])
            rows = _waited(_all_gather(funcol)(flat, 0, self.group)).view(self.world, -1)
            offset = 0
            for i in bucket:
                shape, chunk = self.shapes[i], self.chunks[i]
                size = chunk * (shape.numel() // max(shape[0], 1))
                full[i] = rows[:, offset : offset + size].reshape(self.world * chunk, *shape[1:])[: shape[0]]
                offset += size
        return pytree.tree_unflatten(full, self.spec)

    def reduce(self, value: Any, grads: Any, op: str) -> tuple[Any, list[torch.Tensor]]:
        """The value and the local gradients reduced over the processes (``op``: mean or sum)."""
        funcol = _funcol()
        grads = pytree.tree_leaves(grads)
        scale = 1.0 / self.world if op == "mean" else 1.0
        out: list[Any] = [None] * len(grads)
        # Replicated x: the value rides in the first bucket of its dtype (no collective of its own).
        carrier = None
        if value is not None and not self.sharded:
            carrier = next((b for b in self.buckets if grads[b[0]].dtype == value.dtype), None)
        if value is not None and carrier is None:
            value = _waited(funcol.all_reduce(value, "sum", self.group))
            value = value * scale if op == "mean" else value
        for bucket in self.buckets:
            if self.sharded:
                pieces = []
                for i in bucket:
                    shape, chunk = self.shapes[i], self.chunks[i]
                    pieces.append(_pad_rows(grads[i], self.world * chunk).reshape(self.world, -1))
                flat = torch.cat(pieces, dim=1).reshape(-1)
                part = _waited(_reduce_scatter(funcol)(flat, "sum", 0, self.group))
                offset = 0
                for i in bucket:
                    shape, chunk = self.shapes[i], self.chunks[i]
                    size = chunk * (shape.numel() // max(shape[0], 1))
                    piece = part[offset : offset + size].view(chunk, *shape[1:])[: self.local_rows[i]]
                    out[i] = piece * scale if op == "mean" else piece.clone()
                    offset += size
            else:
                tail = [value.reshape(1)] if bucket is carrier else []
                flat = torch.cat([grads[i].reshape(-1) for i in bucket] + tail)
                total = _waited(funcol.all_reduce(flat, "sum", self.group))
                if tail:
                    value = total[-1].reshape(value.shape)
                    value = value * scale if op == "mean" else value.clone()
                offset = 0
                for i in bucket:
                    n = self.shapes[i].numel()
                    piece = total[offset : offset + n].view(self.shapes[i])
                    out[i] = piece * scale if op == "mean" else piece.clone()
                    offset += n
        return value, out


def unit_buckets(layout: Layout, x: Any, contexts: tuple[Any, ...]) -> Layout:
    """``layout`` with one bucket per FSDP2 unit (of the modules among ``contexts``) instead of
    buckets by size, when every leaf of sharded ``x`` is one of their parameters; else ``layout``.

    One all-gather and one reduce-scatter per unit is what FSDP2 issues; in the compiled program
    it lets ``schedule_units`` gather and reduce one unit at a time (buckets that mix units would
    bring a unit's neighbours along)."""
    fsdp: Any = _fsdp_module_type()
    if not layout.sharded or fsdp is None:
        return layout
    leaves = pytree.tree_leaves(x)
    where = {_storage_key(leaf): i for i, leaf in enumerate(leaves)}
    if len(where) != len(leaves):
        return layout  # (one tensor twice in x)
    buckets: list[tuple[int, ...]] = []
    for root in [m for m in pytree.tree_leaves(contexts) if isinstance(m, torch.nn.Module)]:
        if not any(isinstance(m, fsdp) for m in root.modules()):
            continue
        plan = _module_plan(root)
        if plan is None:
            return layout
        for unit in plan.units:
            indices = [where.pop(_storage_key(root.get_parameter(name)), None) for name in unit.names]
            if any(i is None for i in indices):
                return layout
            by_dtype: dict[torch.dtype, list[int]] = {}
            for i in indices:
                assert i is not None
                by_dtype.setdefault(leaves[i].dtype, []).append(i)
            buckets.extend(tuple(b) for b in by_dtype.values())
    if where or not buckets:
        return layout  # (a leaf of x that no unit gathers)
    return dataclasses.replace(layout, buckets=tuple(buckets))


def _funcol() -> Any:
    return functional_collectives()  # traceable collectives, fenced (public ones where torch lacks them)


def _waited(tensor: torch.Tensor) -> torch.Tensor:
    """The collective's result as a plain tensor. Eagerly, functional collectives return an
    ``AsyncCollectiveTensor`` whose every later slice and view goes through a Python
    ``__torch_dispatch__`` (measured: 46 ms per step on a tiny GPT-2 for ~90 slices, as long as
    its gradient); waiting once removes it. Traced by dynamo, the result is a plain tensor."""
    return tensor.wait() if isinstance(tensor, _funcol().AsyncCollectiveTensor) else tensor


def _all_gather(funcol: Any) -> Any:
    # all_gather_single in newer torch (all_gather_tensor, its older name, warns there; 2.13 has both).
    return getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def _reduce_scatter(funcol: Any) -> Any:
    return getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    missing = rows - t.shape[0]
    return torch.nn.functional.pad(t, (0, 0) * (t.dim() - 1) + (0, missing)) if missing else t


def _bucket_indices(leaves: list[torch.Tensor], sizes: list[int]) -> tuple[tuple[int, ...], ...]:
    """Leaf indices grouped by dtype, in order, each group split at ``_BUCKET_BYTES``."""
    groups: dict[torch.dtype, list[list[int]]] = {}
    filled: dict[torch.dtype, int] = {}
    for i, (leaf, size) in enumerate(zip(leaves, sizes)):
        if leaf.dtype not in groups or filled[leaf.dtype] + size > _BUCKET_BYTES:
            groups.setdefault(leaf.dtype, []).append([])
            filled[leaf.dtype] = 0
        groups[leaf.dtype][-1].append(i)
        filled[leaf.dtype] += size
    return tuple(tuple(b) for buckets in groups.values() for b in buckets if b)


def reduced_gradient(layout: Layout, body: Callable[..., Any], op: str) -> Callable[..., Any]:
    """``body`` (a gradient runner on full tensors) between the gather and the reduction: a
    runner on local tensors, traceable by dynamo end to end."""

    def run(local: list[torch.Tensor], tangents: Any, contexts: tuple[Any, ...]) -> tuple[Any, list[torch.Tensor]]:
        value, grads = body(layout.gather(local), tangents, contexts)
        return layout.reduce(value, grads, op)

    return run


@contextlib.contextmanager
def running_layered(call: LayeredCall, contexts: tuple[Any, ...]) -> Iterator[None]:
    """While a ``DataParallel(AutoFunc())`` runner runs ``f`` on ``x``'s shards: FSDP2's hooks
    off on the modules among the contexts, ``functional_call`` gathering unit by unit."""
    modules = [leaf for leaf in pytree.tree_leaves(contexts) if isinstance(leaf, torch.nn.Module)]
    with _fsdp_hooks_off(modules):
        previous, _LAYERED[0] = _LAYERED[0], call
        try:
            yield
        finally:
            _LAYERED[0] = previous


@contextlib.contextmanager
def running_gathered(contexts: tuple[Any, ...]) -> Iterator[None]:
    """While a DataParallel runner runs ``f`` on gathered parameters: FSDP2's hooks off on the
    modules among the contexts, and ``functional_call`` told the parameters are whole."""
    modules = [leaf for leaf in pytree.tree_leaves(contexts) if isinstance(leaf, torch.nn.Module)]
    with _fsdp_hooks_off(modules):
        _GATHERED[0] += 1
        try:
            yield
        finally:
            _GATHERED[0] -= 1


@contextlib.contextmanager
def refuse_data_parallel(operator: str) -> Iterator[None]:
    """Raise if a ``DistributedDataParallel`` module, or an FSDP2 module with its own hooks on,
    runs inside the block (``f``'s evaluation at preparation): DDP's gradient averaging would
    silently never happen, and FSDP2's hooks would make every gradient zero."""
    from torch.nn.parallel import DistributedDataParallel

    fsdp = _fsdp_module_type()
    seen: list[tuple[str, str]] = []

    def pre_hook(module: torch.nn.Module, args: Any) -> None:
        if seen:
            return
        if isinstance(module, DistributedDataParallel):
            seen.append(("ddp", type(module.module).__name__))
        elif fsdp is not None and isinstance(module, fsdp) and id(module) not in _HOOKS_OFF:
            seen.append(("fsdp", type(module).__name__))

    handle = torch.nn.modules.module.register_module_forward_pre_hook(pre_hook)
    try:
        yield
    finally:
        handle.remove()
    if seen and seen[0][0] == "ddp":
        raise ValueError(
            f"{operator}: f runs a DistributedDataParallel-wrapped {seen[0][1]}. DDP averages gradients "
            "in hooks that only loss.backward() triggers, so torchdi's gradients would silently stay "
            "per-process. Differentiate the wrapped module instead (ddp_model.module, or the model "
            "before wrapping) with the backend torchdi.distributed.DataParallel(backend), which averages "
            "the gradients across processes, or average them once per step with "
            "torchdi.distributed.all_reduce_(grads)."
        )
    if seen:
        raise ValueError(
            f"{operator}: f runs the FSDP2-sharded {seen[0][1]} with FSDP's own forward hooks (model(...) or "
            "torch.func.functional_call(model, ...)). Those hooks all-gather FSDP's own parameters and compute "
            "with them instead of the tensors torchdi differentiates: every gradient would silently be zero. "
            "The recipe that works: params = dict(model.named_parameters()) (the DTensor shards); in f, "
            "torchdi.distributed.functional_call(model, params, (inputs,)); the backend "
            "torchdi.distributed.DataParallel(torchdi.AutoCompile()) (or AutoFunc(), AutoAutograd()); "
            "out=torchdi.into_grad(params) writes the sharded gradients."
        )
