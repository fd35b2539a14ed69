"""Data-parallel training with torchdi: gradients all-reduced in a few flat buckets.

``DistributedDataParallel`` averages gradients from hooks that fire inside ``loss.backward()``;
torchdi computes gradients without ``backward()`` on the wrapped module (``torch.autograd.grad``,
``torch.func`` or a compiled graph), so those hooks never fire and each process would keep its
own gradient. The remedy is to differentiate the plain module and average the gradients
explicitly, once per step, with ``all_reduce_``. Preparation refuses a DDP-wrapped module
inside ``f`` (``refuse_data_parallel``) rather than return silently per-process gradients.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["all_reduce_"]

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


@contextlib.contextmanager
def refuse_data_parallel(operator: str) -> Iterator[None]:
    """Raise if a ``DistributedDataParallel`` module runs inside the block (``f``'s evaluation at
    preparation): its gradient averaging would silently never happen."""
    from torch.nn.parallel import DistributedDataParallel

    seen: list[str] = []

    def pre_hook(module: torch.nn.Module, args: Any) -> None:
        if isinstance(module, DistributedDataParallel) and not seen:
            seen.append(type(module.module).__name__)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(pre_hook)
    try:
        yield
    finally:
        handle.remove()
    if seen:
        raise ValueError(
            f"{operator}: f runs a DistributedDataParallel-wrapped {seen[0]}. DDP averages gradients "
            "in hooks that only loss.backward() triggers, so torchdi's gradients would silently stay "
            "per-process. Differentiate the wrapped module instead (ddp_model.module, or the model "
            "before wrapping) and average the gradients once per step with "
            "torchdi.distributed.all_reduce_(grads)."
        )
