"""Training across processes with torchdi: data parallel (replicated or FSDP2-sharded) and ``all_reduce_``.

``DistributedDataParallel`` averages gradients from hooks that fire inside ``loss.backward()``,
and FSDP2 (``fully_shard``) all-gathers parameters in forward hooks and reduce-scatters
gradients in backward hooks; torchdi computes gradients without ``backward()`` on the wrapped
module (``torch.autograd.grad``, ``torch.func`` or a compiled graph), so those hooks would do the
wrong thing silently: per-process gradients, or gradients of FSDP's own gathered copies (zero
for the tensors passed in). The remedies:

- ``DataParallel(backend)``: a backend whose gradients are reduced across processes. Plain
  ``x`` is all-reduced in flat buckets; FSDP2 DTensor ``x`` is all-gathered before ``f`` and its
  gradient reduce-scattered after, as FSDP2 does; on ``AutoCompile`` inside the compiled program.
- ``functional_call(module, params, args)``: ``torch.func.functional_call`` that keeps FSDP2's
  hooks out and takes DTensor parameters (gathered differentiably on eager autograd).
- ``all_reduce_(grads)``: average a pytree of gradients in place, once per step.

Preparation refuses a DDP-wrapped module inside ``f``, and an FSDP2 module whose own hooks run
inside ``f``, rather than return silently wrong gradients (``refuse_data_parallel``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from torchdi._distributed_private import forward_hook_dicts, functional_collectives, is_fsdp_hook
from torchdi.backends import DataParallel as DataParallel  # exported here, as DESIGN names it
from torchdi.errors import UnsupportedOperatorError

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
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
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
                if _overlaps(t):
                    # An expanded gradient (d sum(x) is a stride-0 view of one number): its
                    # elements share memory, so it cannot hold different values; the tensor is
                    # pointed at its own reduced storage instead, still in place for the caller.
                    fresh = reduced.clone()
                    t.set_(fresh.untyped_storage(), 0, fresh.shape, fresh.stride())
                else:
                    t.copy_(reduced)
                offset += t.numel()
    return grads


def _overlaps(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share memory (conservative: ``True`` when unsure).

    Dimensions sorted by stride, each must step past everything the smaller ones span.
    """
    span = 0
    for stride, size in sorted((s, n) for n, s in zip(t.shape, t.stride()) if n > 1):
        if stride <= span:
            return True
        span += stride * (size - 1)
    return False


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


def require_process_group(who: str, group: Any = None) -> None:
    """Raise ``RuntimeError`` naming ``init_process_group`` when ``torch.distributed`` is not set up."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        raise RuntimeError(
            f"{who}: torch.distributed is not initialized; call torch.distributed.init_process_group "
            "(e.g. under python -m torch.distributed.run) in every process first"
        )


# -- FSDP2 -----------------------------------------------------------------------------------------


def _fsdp_module_type() -> type | None:
    """``torch.distributed.fsdp.FSDPModule`` (FSDP2), or ``None`` where this torch has none."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without distributed, or before FSDP2 was public (2.6)
        return None
    return FSDPModule


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return DTensor


# Ids of FSDP2 modules whose own forward hooks are switched off right now (see _fsdp_hooks_off),
# and whether a DataParallel runner is running f on gathered (full, plain) parameters.
_HOOKS_OFF: set[int] = set()
_GATHERED = [0]
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
    if _GATHERED[0]:
        # Inside a DataParallel runner: full plain tensors, FSDP's hooks already off (switched
        # outside any compiled program, which would otherwise have to trace the switching).
        return torch.func.functional_call(module, parameter_and_buffer_dicts, args, kwargs, tie_weights=tie_weights, strict=strict)
    dtensor = _dtensor_type()
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


def _registered(module: torch.nn.Module, name: str) -> Any:
    try:
        return module.get_parameter(name)
    except AttributeError:
        return None


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
                    f"{tuple(leaf.placements)}; mixed placements are not supported: every parameter must be sharded "
                    f"on dim 0 over the same 1-D mesh (fully_shard's default), the first is {placements} on {mesh}."
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
