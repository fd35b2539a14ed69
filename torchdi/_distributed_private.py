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
- ``"graphless_gradient"``: ``torch._functorch.eager_transforms``' ``grad_increment_nesting``,
  ``_wrap_all_tensors``, ``_create_differentiable``, ``_autograd_grad`` and
  ``_undo_create_differentiable`` (checked on torch 2.9, 2.13, 2.14.1; what ``torch.func.grad_and_value`` is
  made of): ``torch.func.grad_and_value`` with its backward run without ``create_graph``, for
  ``DataParallel(AutoFunc())``'s unit-by-unit gradient when no transform and no grad mode is
  active around it (nothing can differentiate its result then). ``torch.func.grad_and_value``
  always builds the graph of its backward (so that an outer transform can differentiate it), and
  that graph keeps each layer's output gradient and activation alive until the whole backward
  ends (measured: 0.5 MiB per 1024-wide layer at batch 64, 1.16x eager FSDP2's step peak).
  Fallback: ``torch.func.grad_and_value`` (the same results, that memory).
- ``"unit_schedule"``: ``torch._dynamo.backends.common.aot_autograd``, ``functorch.compile``'s
  ``boxed_nop`` and ``min_cut_rematerialization_partition`` (torch 2.1 .. 2.14.1; what torch's
  own ``aot_eager`` backend is made of) and the ``_c10d_functional`` operators (torch 2.3 ..
  2.14.1): under ``DataParallel(AutoCompile(compiler="aot_eager"))`` a pass over AOTAutograd's
  graph (``schedule_units``) moves each FSDP2 unit's all-gather to just before the unit first
  uses it, gathers it again before a later use (its backward), and moves each reduce-scatter to
  just after the gradients it reduces exist, so that the compiled program holds about one unit's
  full parameters and gradients at a time. Fallback: the graph as traced, which gathers every
  shard at once (the same results; the whole parameters held at the peak).
"""

from __future__ import annotations

import operator
import types
from collections.abc import Callable
from typing import Any

import torch

from torchdi._fence import UNPROBED as _UNPROBED
from torchdi._fence import Fence, probe, probed_once

__all__ = [
    "FAST_PATHS",
    "fence",
    "forward_hook_dicts",
    "functional_collectives",
    "graphless_grad_and_value",
    "is_fsdp_hook",
    "layer_by_layer",
    "outside_functorch",
    "put_parameter",
    "schedule_units",
    "unit_scheduled_compiler",
]

FAST_PATHS = {
    "functional_collectives": "torch.distributed._functional_collectives (traceable collectives returning new tensors)",
    "fsdp_hooks": "switching FSDP2's own forward hooks off (torch.nn.Module._forward_pre_hooks, _forward_hooks)",
    "layer_by_layer": "gathering FSDP2 units one at a time under torch.func "
    "(torch._functorch.pyfunctorch.temporarily_clear_interpreter_stack, torch.nn.Module._parameters)",
    "unit_schedule": "gathering FSDP2 units one at a time inside the compiled program "
    "(torch._dynamo.backends.common.aot_autograd, torch.ops._c10d_functional)",
    "graphless_gradient": "torch.func.grad_and_value's backward without create_graph "
    "(torch._functorch.eager_transforms)",
}

fence = Fence(FAST_PATHS, costs={
    "layer_by_layer": "which gathers every parameter at once (the same results, more memory per process)",
    "unit_schedule": "the compiled program then gathers every parameter at once (the same results, more memory per process)",
    "graphless_gradient": "whose backward keeps each layer's activation and output gradient until it ends "
    "(the same results, more memory per process)",
})



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


def _import_grad_parts() -> tuple[Any, ...]:
    from torch._functorch.eager_transforms import (
        _autograd_grad,
        _create_differentiable,
        _undo_create_differentiable,
        _wrap_all_tensors,
        grad_increment_nesting,
    )

    return grad_increment_nesting, _wrap_all_tensors, _create_differentiable, _autograd_grad, _undo_create_differentiable


_GRAD_PARTS: Any = _UNPROBED


def graphless_grad_and_value(func: Callable[..., Any]) -> Callable[..., Any] | None:
    """``torch.func.grad_and_value(func, argnums=0, has_aux=True)`` whose backward builds no graph
    (``create_graph=False``, ``retain_graph=False``: each saved tensor is released as its node
    runs, as ``loss.backward()`` does), or ``None`` where this torch lacks the parts.

    Only for a call with no ``torch.func`` transform and no grad mode active around it: its
    gradient can then not be differentiated again, and the graph ``torch.func`` builds for that
    (``create_graph=True``) would only hold memory until the backward ends."""
    parts = probed_once(globals(), "_GRAD_PARTS", _import_grad_parts)
    if parts is None:
        fence.warn_off("graphless_gradient")
        return None
    nesting, wrap_all, create_differentiable, autograd_grad, undo = parts

    def run(x: Any, *args: Any) -> tuple[Any, tuple[Any, Any]]:
        # torch.func.grad_and_value's own steps (torch/_functorch/eager_transforms.py), all but
        # create_graph=True.
        with nesting() as level, torch.enable_grad():
            x, args = wrap_all((x, args), level)
            torch.utils._pytree.tree_map_(lambda t: create_differentiable(t, level), x)
            output, aux = func(x, *args)
            if not isinstance(output, torch.Tensor) or output.dim() != 0:
                raise RuntimeError(f"graphless_grad_and_value: f must return a 0-d tensor, got {type(output).__name__}")
            flat, spec = torch.utils._pytree.tree_flatten(x)
            grads = autograd_grad((output,), flat, retain_graph=False, create_graph=False)
            aux = None if aux is None else undo(aux, level)
            return undo(torch.utils._pytree.tree_unflatten(list(grads), spec), level), (undo(output, level), aux)

    return run


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
    # Not probed_once: this runs inside the programs dynamo traces, which cannot trace globals().
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


# -- unit by unit inside the compiled program ("unit_schedule") -----------------------------------
#
# DataParallel(AutoCompile()) traces one program: all-gather the shards (one collective per FSDP2
# unit), the gradient of f on the full parameters (torch.func, flattened by AOTAutograd into one
# graph of forward and backward operations), reduce-scatter each unit's gradient. As traced, every
# unit's full parameters are gathered at the start and live until the last backward operation
# that reads them, and every full gradient lives until the reductions at the end: the whole model
# at the peak. FSDP2's schedule is a reordering of that graph plus a recomputation, which this
# pass makes:
#
# - each all-gather (with the operations that pad and flatten its shards before it, and the views
#   and copies that cut its result into parameters after it: operations that only move or copy
#   those values) is copied to just before each *stretch* of the graph that uses it, a stretch
#   ending where another unit's gathered parameters are used (so: once before the unit's forward,
#   once more before its backward), and the original removed. The copies compute the same values
#   from the same shards (collectives of the same inputs, views, copies: nothing random);
# - each reduce-scatter (with the operations that pad and flatten its gradients, and its wait) is
#   moved to just after the last of the gradients it reduces is computed.
#
# Nothing else moves, so every process (whose graphs differ only in the shapes of its own shards,
# all of which stay inside the moved groups) issues the same collectives in the same order.


def _packets(*names: str) -> frozenset[Any]:
    aten = torch.ops.aten
    return frozenset(getattr(aten, name) for name in names)


def _schedule_ops() -> tuple[Any, Any, Any, frozenset[Any], frozenset[Any], frozenset[Any]]:
    c10d = torch.ops._c10d_functional
    moves = _packets("view", "_unsafe_view", "reshape", "slice", "select", "t", "transpose", "permute", "expand",
                     "alias", "detach", "squeeze", "unsqueeze", "clone", "_to_copy", "split", "split_with_sizes",
                     "as_strided", "contiguous")
    packs = moves | _packets("cat", "constant_pad_nd")
    finishes = moves | _packets("mul", "div")
    return (c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default, c10d.wait_tensor.default, moves, packs,
            finishes)


def _import_aot_eager_parts() -> tuple[Any, Any, Any]:
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop  # (what torch's aot_eager is made of)

    return aot_autograd, boxed_nop, min_cut_rematerialization_partition


_SCHEDULE_OPS: Any = _UNPROBED
_AOT_EAGER_PARTS: Any = _UNPROBED


def _is(node: torch.fx.Node, packets: frozenset[Any], extra: tuple[Any, ...] = ()) -> bool:
    target = node.target
    if node.op != "call_function":
        return False
    if target is operator.getitem or target in extra:
        return True
    return getattr(target, "overloadpacket", None) in packets


def _upstream(root: torch.fx.Node, order: dict[torch.fx.Node, int], packs: frozenset[Any], group: set[torch.fx.Node]) -> None:
    """Add to ``group`` the packing operations before ``root`` that only ``group`` uses."""
    pending = list(root.all_input_nodes)
    while pending:
        pending.sort(key=order.__getitem__)
        node = pending.pop()  # the latest first: its users are decided before its inputs
        if node in group or not _is(node, packs) or not all(user in group for user in node.users):
            continue
        group.add(node)
        pending.extend(node.all_input_nodes)


def _downstream(group: set[torch.fx.Node], finishes: frozenset[Any]) -> None:
    """Add to ``group`` the operations after it that read only ``group`` (the views that cut a
    reduced gradient into parameters and the scaling by 1/world that makes the mean), so they
    move with it: left at the end of the graph, inductor fuses every unit's scaling into one
    kernel there, which holds every unit's reduced gradient and its scaled copy at once."""
    pending = [user for node in group for user in node.users]
    while pending:
        node = pending.pop()
        if node in group or not _is(node, finishes) or not all(n in group for n in node.all_input_nodes):
            continue
        group.add(node)
        pending.extend(node.users)


def schedule_units(graph: torch.fx.Graph) -> bool:
    """Reorder ``graph`` (AOTAutograd's, of a ``DataParallel(AutoCompile())`` program) so that it
    gathers and reduces FSDP2 units one at a time (see above). Returns whether it changed it.

    Raises ``AttributeError`` where this torch lacks the ``_c10d_functional`` operators."""
    ops = probed_once(globals(), "_SCHEDULE_OPS", _schedule_ops)
    if ops is None:
        raise AttributeError("torch.ops._c10d_functional")
    gather_op, reduce_op, wait_op, moves, packs, finishes = ops
    nodes = list(graph.nodes)
    order = {node: i for i, node in enumerate(nodes)}
    gathers = [node for node in nodes if node.target is gather_op]
    reduces = [node for node in nodes if node.target is reduce_op]
    if len(gathers) + len(reduces) < 2:
        return False
    # Each gather's group: its packing, the collective, and what cuts its result (in graph order).
    groups: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    owner: dict[torch.fx.Node, torch.fx.Node] = {}
    for gather in gathers:
        group = {gather}
        for node in nodes[order[gather] + 1:]:
            if _is(node, moves, (wait_op,)) and node.all_input_nodes and all(n in group for n in node.all_input_nodes):
                group.add(node)
        _upstream(gather, order, packs, group)
        if any(node in owner for node in group):
            return False  # (groups that share operations: left as traced)
        groups[gather] = sorted(group, key=order.__getitem__)
        owner.update((node, gather) for node in group)
    # A copy reads its shards again later, a reduce-scatter moved up reads its gradients earlier:
    # refused where the graph writes into a tensor they read (AOTAutograd's graphs are functional,
    # inductor's until its reinplacing, which runs after this pass; input mutations at the end).
    written = {n for node in nodes if getattr(getattr(node.target, "_schema", None), "is_mutable", False) for n in node.all_input_nodes}
    if any(n in written for members in groups.values() for node in members for n in node.all_input_nodes):
        return False
    uses = {g: sorted({u for n in members for u in n.users if u not in owner}, key=order.__getitem__) for g, members in groups.items()}
    used_at = sorted((order[u], g) for g, us in uses.items() for u in us)
    changed = False
    for gather, members in groups.items():
        stretches: list[list[torch.fx.Node]] = []
        for use in uses[gather]:
            if stretches:
                start, end = order[stretches[-1][-1]], order[use]
                if not any(start < at < end and other is not gather for at, other in used_at):
                    stretches[-1].append(use)
                    continue
            stretches.append([use])
        if len(stretches) == 1 and order[stretches[0][0]] == order[members[-1]] + 1:
            continue  # used in one stretch, right after it is made
        for stretch in stretches:
            copies: dict[torch.fx.Node, torch.fx.Node] = {}
            with graph.inserting_before(stretch[0]):
                for node in members:
                    copies[node] = graph.node_copy(node, lambda n, copies=copies: copies.get(n, n))  # type: ignore[misc]
            for use in stretch:
                for node in use.all_input_nodes:
                    if node in copies:
                        use.replace_input_with(node, copies[node])
        for node in reversed(members):
            if not node.users:
                graph.erase_node(node)
        changed = True
    # Each reduce-scatter (its packing before, its wait after) just after its inputs exist.
    for reduce in reduces:
        group = {reduce}
        _upstream(reduce, {n: i for i, n in enumerate(graph.nodes)}, packs, group)
        group.update(user for user in reduce.users if user.target is wait_op)
        _downstream(group, finishes)
        if any(n in written for node in group for n in node.all_input_nodes):
            continue
        for node in [n for n in graph.nodes if n in group]:
            position = {n: i for i, n in enumerate(graph.nodes)}
            inputs = node.all_input_nodes
            if not inputs:
                continue
            latest = max(inputs, key=position.__getitem__)
            if position[node] != position[latest] + 1:
                latest.append(node)
                changed = True
    graph.lint()
    return changed


def _import_inductor_parts() -> tuple[type, type]:
    from torch._inductor.custom_graph_pass import CustomGraphPass

    return torch._TorchCompileInductorWrapper, CustomGraphPass


_INDUCTOR_PARTS: Any = _UNPROBED
_SCHEDULE_PASS: Any = None


def _inductor_pass(base: type) -> Any:
    """``schedule_units`` as an inductor post-grad pass (a ``CustomGraphPass``, ``base``, whose uuid
    keys inductor's cache on this file's text)."""
    global _SCHEDULE_PASS
    if _SCHEDULE_PASS is None:

        class SchedulePass(base):
            def __call__(self, graph: torch.fx.Graph) -> None:
                try:
                    schedule_units(graph)
                except AttributeError as error:  # (the graph stays as traced)
                    fence.warn_off("unit_schedule", str(error))

            def uuid(self) -> Any:
                from torch._inductor.custom_graph_pass import get_hash_for_files

                return get_hash_for_files((__file__,))

        _SCHEDULE_PASS = SchedulePass()
    return _SCHEDULE_PASS


def unit_scheduled_compiler(compiler: str, mode: str | None = None, options: dict[str, Any] | None = None,
                            dynamic: bool | None = None) -> Callable[..., Any] | None:
    """A dynamo backend that is ``compiler`` (``"aot_eager"`` or ``"inductor"``, with ``mode``,
    ``options``, ``dynamic``) with ``schedule_units`` applied to AOTAutograd's graph, or ``None``
    where it cannot be made (another compiler, or a torch without the parts: the caller then
    compiles the graph as traced, every shard at once)."""
    if compiler == "inductor":
        inductor_parts = probed_once(globals(), "_INDUCTOR_PARTS", _import_inductor_parts)
        if inductor_parts is None or (options or {}).get("post_grad_custom_post_pass") is not None:
            fence.warn_off("unit_schedule")
            return None
        wrapper, pass_base = inductor_parts
        return wrapper(mode, {**(options or {}), "post_grad_custom_post_pass": _inductor_pass(pass_base)}, dynamic)
    if compiler != "aot_eager":
        return None
    aot_eager_parts = probed_once(globals(), "_AOT_EAGER_PARTS", _import_aot_eager_parts)
    if aot_eager_parts is None:
        fence.warn_off("unit_schedule")
        return None
    aot_autograd, boxed_nop, partition = aot_eager_parts

    def scheduled(module: torch.fx.GraphModule, example_inputs: Any) -> Any:
        try:
            if schedule_units(module.graph):
                module.recompile()
        except AttributeError as error:
            fence.warn_off("unit_schedule", str(error))
        return boxed_nop(module, example_inputs)

    return aot_autograd(fw_compiler=scheduled, bw_compiler=boxed_nop, inference_compiler=scheduled,
                        partition_fn=partition, keep_inference_input_mutations=True)
