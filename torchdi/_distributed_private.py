"""The private torch internals of ``torchdi.distributed``, fenced (see ``torchdi/_fence.py``).

It imports only torch (``torch.distributed``'s private modules on first use), so that
``torchdi.distributed`` and ``engines/data_parallel.py`` may both use it.

Fast paths (``FAST_PATHS``):

- ``"functional_collectives"``: ``torch.distributed._functional_collectives`` (torch 2.1 ..
  2.14.1; underscored, though torch documents it as the traceable collectives): collectives that
  return a new tensor, which dynamo traces into the compiled program, and whose eager result
  (``AsyncCollectiveTensor``) is waited for once. Fallback: the public ``torch.distributed``
  collectives (``all_reduce``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``) on fresh
  output tensors, which dynamo maps onto the same traceable collectives where it can.
- ``"fsdp_hooks"``: ``torch.nn.Module._forward_pre_hooks`` / ``_forward_hooks`` (torch 1.0 ..
  2.14.1), where FSDP2 registers the forward hooks that all-gather its own parameters (bound
  methods of its per-module ``FSDPState``, recognised by that class name). torchdi switches them
  off while ``f`` runs on the tensors it is given. Fallback: none that computes: an FSDP2 module
  in ``f`` is refused at preparation with ``UnsupportedOperatorError`` naming what works
  (replicated parameters), never differentiated through FSDP's gathered copies.
- ``"layer_by_layer"``: ``torch._functorch.pyfunctorch.temporarily_clear_interpreter_stack``
  (torch 2.1 .. 2.14.1) and ``torch.nn.Module._parameters`` (torch 1.0 .. 2.14.1): under
  ``DataParallel(AutoFunc())`` each FSDP2 unit's gathered parameters are put in the unit's
  place while it runs, and refilled in its backward, which ``torch.func`` runs inside its
  transform (where writing into a tensor made outside it is refused; the refill writes memory
  the transform never sees as a tensor of its own). Fallback: every shard gathered at once
  around ``f`` (the same results; the whole parameters held at the peak).
"""

from __future__ import annotations

import types
from typing import Any

import torch

from torchdi._fence import Fence, probe

__all__ = [
    "FAST_PATHS",
    "fence",
    "forward_hook_dicts",
    "functional_collectives",
    "is_fsdp_hook",
    "layer_by_layer",
    "outside_functorch",
    "put_parameter",
]

FAST_PATHS = {
    "functional_collectives": "torch.distributed._functional_collectives (traceable collectives returning new tensors)",
    "fsdp_hooks": "switching FSDP2's own forward hooks off (torch.nn.Module._forward_pre_hooks, _forward_hooks)",
    "layer_by_layer": "gathering FSDP2 units one at a time under torch.func "
    "(torch._functorch.pyfunctorch.temporarily_clear_interpreter_stack, torch.nn.Module._parameters)",
}

fence = Fence(FAST_PATHS, costs={"layer_by_layer": "which gathers every parameter at once (the same results, more memory per process)"})

_UNPROBED: Any = object()


def _import_functional_collectives() -> types.ModuleType:
    import torch.distributed._functional_collectives as funcol

    for name in ("all_reduce", "AsyncCollectiveTensor"):
        getattr(funcol, name)
    if not hasattr(funcol, "all_gather_single") and not hasattr(funcol, "all_gather_tensor"):
        raise AttributeError("no all_gather_single")
    if not hasattr(funcol, "reduce_scatter_single") and not hasattr(funcol, "reduce_scatter_tensor"):
        raise AttributeError("no reduce_scatter_single")
    return funcol


# torch 2.1 .. 2.14.1. Probed on first use: importing torch.distributed's modules costs time that
# a user without a process group should not pay.
_FUNCTIONAL_COLLECTIVES: Any = _UNPROBED


def _hook_dicts() -> bool:
    module = torch.nn.Module()
    return isinstance(module._forward_pre_hooks, dict) and isinstance(module._forward_hooks, dict)


# torch 1.0 .. 2.14.1.
_HOOK_DICTS: bool = bool(probe(_hook_dicts))


def _import_clear_stack() -> Any:
    from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack

    return temporarily_clear_interpreter_stack


def _parameter_dicts() -> bool:
    return isinstance(torch.nn.Linear(1, 1)._parameters, dict)


# torch 2.1 .. 2.14.1 (torch.func is imported by torch itself: no cost at import).
_CLEAR_STACK: Any = probe(_import_clear_stack)
# torch 1.0 .. 2.14.1.
_PARAMETER_DICTS: bool = bool(probe(_parameter_dicts))


def layer_by_layer() -> bool:
    """Whether FSDP2 units can be gathered one at a time under ``torch.func`` in this torch."""
    if _CLEAR_STACK is None or not _PARAMETER_DICTS:
        fence.warn_off("layer_by_layer")
        return False
    return True


def outside_functorch() -> Any:
    """A context in which no ``torch.func`` transform is active (check ``layer_by_layer()`` first)."""
    return _CLEAR_STACK()


def put_parameter(module: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Make ``tensor`` (not a ``Parameter``) what ``module`` computes with as its parameter ``name``,
    as ``torch.func.functional_call`` does (check ``layer_by_layer()`` first)."""
    module._parameters[name] = tensor  # type: ignore[assignment]


class _NoTensor:
    """A type no tensor is (the public collectives return plain tensors: nothing to wait for)."""


class PublicCollectives:
    """The functional collectives torchdi uses, written with ``torch.distributed``'s public ones
    (each returns a new tensor; ``op`` is ``"sum"``, the only one torchdi uses)."""

    AsyncCollectiveTensor = _NoTensor

    @staticmethod
    def _sum(op: str) -> Any:
        if op != "sum":
            raise ValueError(f"torchdi: only the 'sum' reduction is used, not {op!r}")
        return torch.distributed.ReduceOp.SUM

    @staticmethod
    def all_reduce(tensor: torch.Tensor, op: str, group: Any) -> torch.Tensor:
        out = tensor.clone()
        torch.distributed.all_reduce(out, op=PublicCollectives._sum(op), group=group)
        return out

    @staticmethod
    def all_gather_single(tensor: torch.Tensor, gather_dim: int, group: Any) -> torch.Tensor:
        if gather_dim != 0:
            raise ValueError("torchdi: all-gathers run along dim 0")
        world = torch.distributed.get_world_size(group)
        out = tensor.new_empty((world * tensor.shape[0], *tensor.shape[1:]))
        # all_gather_single: its public name since torch 2.13 (all_gather_into_tensor before, deprecated since)
        gather = getattr(torch.distributed, "all_gather_single", None) or torch.distributed.all_gather_into_tensor
        gather(out, tensor.contiguous(), group=group)
        return out

    @staticmethod
    def reduce_scatter_single(tensor: torch.Tensor, op: str, scatter_dim: int, group: Any) -> torch.Tensor:
        if scatter_dim != 0:
            raise ValueError("torchdi: reduce-scatters run along dim 0")
        world = torch.distributed.get_world_size(group)
        out = tensor.new_empty((tensor.shape[0] // world, *tensor.shape[1:]))
        scatter = getattr(torch.distributed, "reduce_scatter_single", None) or torch.distributed.reduce_scatter_tensor
        scatter(out, tensor.contiguous(), op=PublicCollectives._sum(op), group=group)
        return out


def functional_collectives() -> Any:
    """``torch.distributed._functional_collectives``, or ``PublicCollectives`` (the same names on
    torch's public collectives) where this torch lacks it."""
    global _FUNCTIONAL_COLLECTIVES
    if _FUNCTIONAL_COLLECTIVES is _UNPROBED:
        _FUNCTIONAL_COLLECTIVES = probe(_import_functional_collectives)
    if _FUNCTIONAL_COLLECTIVES is None:
        fence.warn_off("functional_collectives")
        return PublicCollectives
    return _FUNCTIONAL_COLLECTIVES


def forward_hook_dicts(module: torch.nn.Module) -> tuple[dict[int, Any], ...]:
    """``module``'s forward pre-hooks and forward hooks, by handle id, as the module keeps them
    (``()`` where this torch does not let torchdi reach them: nothing is switched off then)."""
    if not _HOOK_DICTS:
        fence.warn_off("fsdp_hooks")
        return ()
    return (module._forward_pre_hooks, module._forward_hooks)


def is_fsdp_hook(hook: Any) -> bool:
    """Whether ``hook`` is one of FSDP2's own forward hooks: bound methods of its per-module state
    (``FSDPState._pre_forward`` and ``_post_forward``), matched by the state's class name. A hook
    not recognised stays on (its FSDPModule is then refused at preparation)."""
    return type(getattr(hook, "__self__", None)).__name__ == "FSDPState"
