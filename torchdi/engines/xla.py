"""``AutoXLA``: the inner backend's runner traced once through torch-xla's dynamo bridge.

Preparation compiles ``torch.compile(runner, backend="openxla")``: dynamo captures the runner
(the same one ``AutoCompile`` compiles) in one graph, torch-xla lowers it to an XLA program
once, and every later call only runs the cached program (``_run_cached_graph``). Calls are as
sound as raw ``torch.compile`` (rule 7), as on ``AutoCompile`` (``_dynamo``): each call
evaluates dynamo's guards for the preparation's cache entries (globals, closure cells,
attributes, grad mode ...) and runs dynamo's transformed code for the entry whose guards pass,
without ``torch.compile``'s per-call wrapper; a failed guard recompiles through
``torch.compile``, is counted and logged with the guard that failed, and a result is never stale.

What is traced follows ``AutoCompile``'s one rule: each leaf of ``x``, the tangents and the
contexts goes through ``to_device_tensor``; tensors are graph inputs (new values never
recompile), anything else is static. Python floats travel as exact float64 values and reach
``f`` as (symbolic) Python floats, as on ``AutoCompile`` (``translate.float_positions``).
Three details keep it that way on torch-xla (measured on torch-xla 2.9's CPU client):

- A 0-d tensor equal to 0 or 1 becomes a compile-time constant on an XLA device (and is then
  synced by the bridge on every call): 0-d leaves travel as shape-(1,) device buffers and are
  viewed as 0-d *inside* the graph.
- Randomness: the bridge feeds the device's RNG seed to the program as an input. When the
  graph has random ops, each call seeds it from the host generator, so results are fresh each
  call, reproducible under ``torch.manual_seed``, and never recompile.
- An ``nn.Module`` context is replaced by a replica whose parameters and buffers live on the
  device (made once at preparation, owned by the runner). Before each call the replica takes
  the values of host tensors whose version counter moved (an optimizer step) and the host
  modules' ``training`` flags.

Where dynamo cannot capture the runner in one graph, the runner falls back to lazy tensors
(torch-xla traces it on every call and caches compiled programs by graph structure); the
fallback and its cause are logged and shown in the ``Prep``'s repr (``path``).

``torch.autocast`` is refused: an XLA program does not see the host's autocast state, and
running it in full precision would silently ignore the user's request.
"""

from __future__ import annotations

import copy
import logging
import weakref
from typing import Any, ClassVar, cast

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from torchdi._fence import tensor_version
from torchdi.backends import AutoFunc, AutoXLA, xla_device_problem
from torchdi.engines import _xla_private
from torchdi.engines._dynamo import (
    RECOMPILE_LIMIT,
    DynamoCache,
    compile_function,
    forget_float_specializations,
    fresh_entry_point,
    release,
)
from torchdi.engines.base import ALL_FAMILIES
from torchdi.runners import build_runner, register_engine
from torchdi.translate import float_positions, keep_float_factories_traced, to_device_tensor

__all__ = ["XLAEngine", "XLARunner", "xla_device_problem"]

logger = logging.getLogger("torchdi")

# The dynamo settings every call through torch.compile of a preparation's entry point runs under.
_RECOMPILE_LIMITS = {"recompile_limit": RECOMPILE_LIMIT, "accumulated_recompile_limit": RECOMPILE_LIMIT}


def _uncached_compiles() -> int:
    import torch_xla.debug.metrics as metrics

    return int(metrics.counter_value("UncachedCompile") or 0)


def _is_xla(t: Any) -> bool:
    # (t.device.type costs 8x more on XLA tensors; is_xla is missing from torch's type stubs)
    return isinstance(t, torch.Tensor) and bool(t.is_xla)  # type: ignore[attr-defined]


def _refuse_autocast(name: str) -> None:
    """Raise when ``torch.autocast`` is on: the XLA program would silently ignore it."""
    for device_type in ("cpu", "cuda", "xla"):
        if torch.is_autocast_enabled(device_type):
            raise RuntimeError(
                f"AutoXLA ({name}): torch.autocast is enabled for {device_type!r} "
                f"(dtype {torch.get_autocast_dtype(device_type)}), and AutoXLA does not apply autocast to the "
                "XLA program: it would silently run in full precision. Call it outside autocast, and cast "
                "inside f where lower precision is wanted (e.g. x.to(torch.bfloat16))."
            )


def _is_random(node: torch.fx.Node) -> bool:
    """Whether an aten-level graph node draws random numbers."""
    tags = getattr(node.target, "tags", ())
    return node.op == "call_function" and torch.Tag.nondeterministic_seeded in tags


class _CountingOpenXLA:
    """The ``openxla`` dynamo backend, counting the graphs it is asked to compile for one runner.

    It is torch's own ``openxla`` backend (``aot_autograd`` with torch-xla's bridge as forward
    compiler), rebuilt here so that the forward graph can be inspected for random ops.
    """

    def __init__(self, owner: XLARunner) -> None:
        self.owner = weakref.ref(owner)  # the runner owns this compiler, not the reverse
        found = _xla_private.hooks()
        if found.aot_autograd is None or found.openxla_eval_boxed is None or found.get_decompositions is None:
            # Public path: torch.compile(graph, backend="openxla"). Its forward graph cannot be
            # inspected, so every program is taken as random (seeded each call: same results).
            _xla_private.warn_off("openxla_parts")
            self._openxla_eval_boxed: Any = None
            self._aot: Any = self._public
            return
        self._openxla_eval_boxed = found.openxla_eval_boxed
        # torch-xla lowers batch norm's backward only in training mode (an eval-mode BatchNorm
        # fails with "size of mean should be compatible"): decompose it into elementwise ops.
        self._aot = found.aot_autograd(
            fw_compiler=self._forward,
            decompositions=found.get_decompositions([torch.ops.aten.native_batch_norm_backward]),
        )

    def _public(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        owner = self.owner()
        if owner is not None:
            owner.random = True
        compiled = torch.compile(graph, backend="openxla", fullgraph=True, dynamic=False)
        return lambda *args: compiled(*args)

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        keep_float_factories_traced(graph)  # rule 2: torch.tensor(c) of a float context stays traced
        compiled = self._aot(graph, example_inputs)
        owner = self.owner()
        if owner is not None:
            owner.num_compilations += 1
            if owner.prepared:
                cause = owner.cache.recompile_cause() if owner.cache is not None else "of a change"
                logger.warning(
                    "torchdi: AutoXLA recompiled the %s after preparation (compilation %d) because %s. "
                    "Raw torch.compile recompiles here too; prepare again if the change is permanent.",
                    owner.name,
                    owner.num_compilations,
                    cause,
                )
        return compiled

    def _forward(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        owner = self.owner()
        if owner is not None and any(_is_random(node) for node in graph.graph.nodes):
            owner.random = True
        return _ExtractOnCopies(self._openxla_eval_boxed(graph, example_inputs))


class _ExtractOnCopies:
    """The bridge's compiled function, first called (where it traces and keeps its arguments
    for good) on copies of the arguments: with zero-copy inputs those alias the user's memory,
    which a prep must not keep alive. Later calls pass the arguments through."""

    _boxed_call = True  # aot_autograd's calling convention: one list of arguments

    def __init__(self, compiled: Any) -> None:
        self.compiled: Any = compiled
        self.extracted = False

    def __call__(self, args: list[Any]) -> Any:
        if not self.extracted:
            self.extracted = True
            args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        return self.compiled(args)


class _FunctorchSafePooling(TorchFunctionMode):
    """Runs ``max_pool2d``/``max_pool3d`` as ``max_pool*d_with_indices(...)[0]``.

    torch-xla implements the pooling ops' autograd on XLA tensors as C++ ``autograd::Function``s,
    which ``torch.func`` transforms refuse ("cannot use C++ torch::autograd::Function with
    functorch transforms"); the ``_with_indices`` ops compute the same values with PyTorch's
    own derivative formulas. This is what lets a ResNet be differentiated on ``AutoXLA``.
    """

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        op = _POOLING_OPS.get(func)
        if op is not None and not kwargs.pop("return_indices", False) and len(args) < 7:
            return _pool_with_indices(op, *args, **kwargs)
        return func(*args, **kwargs)


def _pool_with_indices(
    op: Any, x: torch.Tensor, kernel_size: Any, stride: Any = None, padding: Any = 0, dilation: Any = 1, ceil_mode: bool = False
) -> torch.Tensor:
    return op(x, kernel_size, [] if stride is None else stride, padding, dilation, ceil_mode)[0]


_POOLING_OPS = {
    torch.max_pool2d: torch.ops.aten.max_pool2d_with_indices,
    torch.nn.functional.max_pool2d: torch.ops.aten.max_pool2d_with_indices,
    torch.max_pool3d: torch.ops.aten.max_pool3d_with_indices,
    torch.nn.functional.max_pool3d: torch.ops.aten.max_pool3d_with_indices,
}


def _entry_template(*leaves: Any) -> Any:
    """The runner on the unflattened arguments, 0-d leaves viewed from shape (1,): the body of
    each preparation's entry point, whose globals (``fresh_entry_point``) are its own."""
    items = list(leaves)
    for slot in scalar_slots:  # type: ignore[name-defined]  # noqa: F821  (the entry's own globals)
        items[slot] = items[slot].view(())
    for slot in float_slots:  # type: ignore[name-defined]  # noqa: F821  (Python floats, in double precision)
        items[slot] = items[slot].item()
    x, tangents, contexts = tree_unflatten(items, spec)  # type: ignore[name-defined]  # noqa: F821
    with functorch_safe_pooling():  # type: ignore[name-defined]  # noqa: F821
        return runner(x, tangents, contexts)  # type: ignore[name-defined]  # noqa: F821


def _graph_entry(runner: Any, spec: pytree.TreeSpec, scalar_slots: tuple[int, ...], float_slots: tuple[int, ...]) -> Any:
    """``entry(*leaves)`` for one preparation: a code object and globals of its own."""
    names = {
        "runner": runner,
        "spec": spec,
        "scalar_slots": scalar_slots,
        "float_slots": float_slots,
        "tree_unflatten": pytree.tree_unflatten,
        "functorch_safe_pooling": _FunctorchSafePooling,
    }
    return fresh_entry_point(_entry_template, "torchdi_xla_runner", names)


class _ModuleReplica:
    """A device copy of a user's module, refreshed from it before each call.

    Parameters and buffers are copied to the device once (the host tensors are never copied on
    the host); afterwards only tensors whose version counter or identity changed are copied
    again. The ``training`` flags follow the host module. The replica keeps a weak reference
    to the host module only.
    """

    def __init__(self, module: torch.nn.Module, device: torch.device) -> None:
        memo: dict[int, Any] = {}
        for tensor in self._host_tensors(module):
            if id(tensor) in memo:
                continue
            moved = tensor.detach().to(device)
            memo[id(tensor)] = torch.nn.Parameter(moved, requires_grad=False) if isinstance(tensor, torch.nn.Parameter) else moved
        self.module = copy.deepcopy(module, memo)
        self.host = weakref.ref(module)
        self.seen = self._state(module)

    @staticmethod
    def _host_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
        return [t for _, t in module.named_parameters(remove_duplicate=False)] + [
            t for _, t in module.named_buffers(remove_duplicate=False) if t is not None
        ]

    @staticmethod
    def _versions(tensors: list[torch.Tensor]) -> list[tuple[int, Any]]:
        # Without the version counter (fence), a fresh object per tensor: every call sees a change
        # and copies the host values (slower, never stale).
        return [(id(t), version if (version := tensor_version(t)) is not None else object()) for t in tensors]

    def _state(self, module: torch.nn.Module) -> list[tuple[int, Any]]:
        return self._versions(self._host_tensors(module))

    def refresh(self, module: torch.nn.Module) -> torch.nn.Module:
        """The replica, with the host module's current values and training flags."""
        host = self._host_tensors(module)
        state = self._versions(host)
        if state != self.seen:
            mine = self._host_tensors(self.module)
            if len(mine) != len(host):
                raise ValueError(
                    "AutoXLA: a module passed as a Constant gained or lost parameters or buffers since "
                    "preparation; prepare again"
                )
            for (seen, now), source, target in zip(zip(self.seen, state), host, mine):
                if seen != now:
                    if source.shape != target.shape or source.dtype != target.dtype:
                        raise ValueError(
                            f"AutoXLA: a parameter or buffer of a module Constant changed shape or dtype since "
                            f"preparation ({tuple(target.shape)} {target.dtype} -> {tuple(source.shape)} {source.dtype}); "
                            "prepare again"
                        )
                    target.data.copy_(source.detach())  # a host-to-device transfer, no host copy
            self.seen = state
        for theirs, mine_module in zip(module.modules(), self.module.modules()):
            if mine_module.training != theirs.training:
                mine_module.training = theirs.training
        return self.module


class XLARunner:
    """A runner compiled for an XLA device; ``warm_up`` (preparation) compiles.

    Attributes:
        num_compilations: graphs the ``openxla`` backend compiled for this runner (on the lazy
            fallback: torch-xla's ``UncachedCompile`` events during its calls).
        path: ``"traced (openxla)"``, or ``"lazy fallback: <why>"``.
        buffers: the device buffers it owns (``reuse_buffers=True``), one per leaf of
            ``(x, tangents, contexts)``; ``None`` for leaves it does not copy (static, or already
            on the device).
        zero_copy: whether host tensors reach the program through DLPack without a copy
            (torch-xla's CPU client, host results; unaligned or strided tensors are copied into
            ``buffers``).
        random: whether the compiled program draws random numbers.
    """

    def __init__(
        self, runner: Any, backend: AutoXLA, family: str = "runner", function_name: str = "f", state_contexts: tuple[int, ...] = ()
    ) -> None:
        import torch_xla

        self.runner = runner
        self.device = torch_xla.device() if backend.device is None else torch.device(backend.device)
        self.reuse_buffers = backend.reuse_buffers
        self.name = f"{family} of {function_name}"
        self.num_compilations = 0
        self.prepared = False
        self.random = False
        self.fallback: str | None = None
        self.buffers: list[torch.Tensor | None] | None = None
        self.replicas: dict[int, _ModuleReplica] = {}
        self.scalar_slots: tuple[int, ...] = ()
        self.float_slots: tuple[int, ...] = ()  # Python-float contexts, handed back to f as floats
        self.state_contexts = state_contexts
        # Flat positions of the State contexts' tensors: f updates the device copies in place,
        # and the call writes them back into the caller's host tensors.
        self.state_slots: tuple[int, ...] = ()
        self._compiled: Any = None
        self.cache: DynamoCache | None = None
        self._spec: pytree.TreeSpec | None = None
        self.translate = True
        self.n_x_leaves = 1
        self.zero_copy = False
        self._from_dlpack: Any = None
        self._compiler = _CountingOpenXLA(self)
        self._entry_holder: list[Any] = []  # the entry point, once made: what the finalizer releases
        weakref.finalize(self, release, id(self._compiler), self._entry_holder)

    @property
    def path(self) -> str:
        return "traced (openxla)" if self.fallback is None else f"lazy fallback: {self.fallback}"

    def warm_up(self, x: Any, tangents: Any, contexts: tuple[Any, ...]) -> None:
        """Allocate device buffers and module replicas, then compile for these signatures."""
        _refuse_autocast(self.name)
        # Contexts without floats or numpy values need no translation (a few us per call).
        self.translate = any(
            not isinstance(leaf, torch.Tensor) and to_device_tensor(leaf, None) is not leaf for leaf in pytree.tree_leaves(contexts)
        )
        translated = to_device_tensor(contexts, None)
        leaves, spec = pytree.tree_flatten((x, tangents, translated))
        self._spec = spec
        offset = len(pytree.tree_leaves((x, tangents)))
        self.float_slots = tuple(offset + i for i in float_positions(contexts))
        slots: list[int] = []
        for i, context in enumerate(translated):
            count = len(pytree.tree_leaves(context))
            if i in self.state_contexts:
                slots.extend(range(offset, offset + count))
            offset += count
        self.state_slots = tuple(slots)
        self.n_x_leaves = len(pytree.tree_leaves(x))
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.nn.Module):
                self.replicas[i] = _ModuleReplica(leaf, self.device)
        host_tensor = [isinstance(leaf, torch.Tensor) and not _is_xla(leaf) for leaf in leaves]
        self.scalar_slots = tuple(i for i, leaf in enumerate(leaves) if host_tensor[i] and leaf.dim() == 0)
        if self.reuse_buffers:
            self.buffers = [
                torch.empty((1,) if leaf.dim() == 0 else leaf.shape, dtype=leaf.dtype, device=self.device) if moved else None
                for leaf, moved in zip(leaves, host_tensor)
            ]
        # On torch-xla's CPU client a host tensor can be handed to the program without a copy
        # (DLPack: the device buffer aliases host memory, which must be 64-byte aligned). Only
        # when results come back to the host: the call then waits for the program, so the
        # user's memory is never read after the call returns.
        if not all(_is_xla(leaf) for leaf in pytree.tree_leaves(x)):
            import torch_xla.runtime as xr
            import torch_xla.utils.dlpack as xla_dlpack

            self.zero_copy = xr.device_type() == "CPU" and self.device.type == "xla"
            self._from_dlpack = xla_dlpack.from_dlpack
        entry = _graph_entry(self.runner, spec, self.scalar_slots, self.float_slots)
        self._entry_holder.append(entry)
        self.cache = DynamoCache(entry)
        self._compiled = compile_function(entry, backend=self._compiler, fullgraph=True, dynamic=False)  # shapes are fixed
        try:
            self(x, tangents, contexts)
        except Exception as error:  # dynamo cannot capture it, or the bridge cannot lower it
            self._compiled = None
            self.cache = None
            self.num_compilations = 0
            self.random = False
            reason = " ".join(str(error).strip().splitlines()[:2])[:300]
            self.fallback = f"{type(error).__name__}: {reason}"
            logger.warning(
                "torchdi: AutoXLA cannot trace %s once through torch.compile(backend='openxla') (%s); "
                "using torch-xla's lazy tensors instead (traced on every call, compiled programs cached)",
                self.name,
                self.fallback,
            )
            self(x, tangents, contexts)  # the lazy path; a genuine error in f surfaces here
        self.prepared = True

    def _arguments(self, x: Any, tangents: Any, contexts: tuple[Any, ...]) -> tuple[list[Any], bool, list[Any]]:
        """The flat leaves on the device (0-d ones as shape (1,)), whether ``x`` lived there, and
        the flat leaves as given."""
        if self.translate:
            contexts = to_device_tensor(contexts, None)
        leaves: list[Any] = []
        _append_leaves((x, tangents, contexts), leaves)
        x_on_device = True
        n_x_leaves = self.n_x_leaves  # x's leaves come first
        buffers = self.buffers
        scalar = self.scalar_slots
        moved: list[Any] = []
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                if leaf.is_xla:  # type: ignore[attr-defined]
                    moved.append(leaf)
                    continue
                if i < n_x_leaves:
                    x_on_device = False
                if i in scalar:
                    leaf = leaf.reshape(1)
                if self.zero_copy and leaf.is_cpu and leaf.data_ptr() % 64 == 0 and leaf.is_contiguous():
                    moved.append(self._from_dlpack(leaf))
                elif buffers is not None and buffers[i] is not None:
                    moved.append(buffers[i].copy_(leaf))  # type: ignore[union-attr]
                else:
                    moved.append(leaf.to(self.device))
            elif i in self.replicas:
                moved.append(self.replicas[i].refresh(leaf))
            else:
                moved.append(leaf)
        return moved, x_on_device, leaves

    def __call__(self, x: Any, tangents: Any, contexts: tuple[Any, ...]) -> Any:
        _refuse_autocast(self.name)
        leaves, x_on_device, given = self._arguments(x, tangents, contexts)
        if self._compiled is not None:
            if self.random:  # the program's seed input, drawn from the host generator
                import torch_xla.core.xla_model as xm

                xm.set_rng_state(int(torch.randint(0, 2**62, (), dtype=torch.int64)), str(self.device))
            result = self._run_compiled(tuple(leaves))
        else:
            result = self._lazy(leaves)
        updated = [(given[i], leaves[i]) for i in self.state_slots if given[i] is not leaves[i]]
        return _to_host(result, updated, outputs=not x_on_device)

    def _run_compiled(self, leaves: tuple[Any, ...]) -> Any:
        """Dynamo's transformed code for the cache entry whose guards pass (as ``AutoCompile``
        does, rule 7), else a call through ``torch.compile``, which recompiles."""
        cache = self.cache
        assert cache is not None  # made with self._compiled
        if cache.fast:
            transformed = cache.lookup({"leaves": leaves})
            if transformed is not None:
                return transformed(*leaves)
        # .item() of a float context gives dynamo a symbolic float: no recompilation per value.
        forget_float_specializations()
        try:
            return cache.call(self._compiled, leaves, {"leaves": leaves}, {"capture_scalar_outputs": True, **_RECOMPILE_LIMITS})
        finally:
            forget_float_specializations()

    def _lazy(self, leaves: list[Any]) -> Any:
        """The fallback: trace with lazy tensors, materialize only this call's outputs."""
        pending = [leaf for leaf in leaves if _is_xla(leaf)]
        # The caller's own pending work must not join (and change) our graph.
        _xla_private.sync(pending)
        before = _uncached_compiles()
        items = [leaf.view(()) if i in self.scalar_slots else leaf for i, leaf in enumerate(leaves)]
        for slot in self.float_slots:
            items[slot] = items[slot].item()
        assert self._spec is not None  # set by warm_up
        x, tangents, contexts = pytree.tree_unflatten(items, self._spec)
        with _FunctorchSafePooling():
            result = self.runner(x, tangents, contexts)
        outputs = [leaf for leaf in pytree.tree_leaves(result) if _is_xla(leaf)]
        _xla_private.sync(outputs)  # this call's outputs only
        self.num_compilations += _uncached_compiles() - before
        return result


def _to_host(result: Any, updated: list[tuple[torch.Tensor, torch.Tensor]], outputs: bool) -> Any:
    """``result``, its XLA tensors copied to the CPU if ``outputs``, after copying each device
    tensor of ``updated``'s ``(host, device)`` pairs (``State`` tensors ``f`` updated in place)
    into its host tensor: everything in one transfer from the device (a ``.cpu()`` per tensor
    waits for the device once per tensor: 62 times for resnet18's gradient)."""
    leaves, spec = pytree.tree_flatten(result)
    positions = [i for i, leaf in enumerate(leaves) if _is_xla(leaf)] if outputs else []
    if not positions and not updated:
        return result
    fetched = _xla_private.to_cpu([device for _, device in updated] + [leaves[i] for i in positions])
    with torch.no_grad():
        for (host, _), value in zip(updated, fetched):
            host.copy_(value.reshape(host.shape))
    for i, value in zip(positions, fetched[len(updated):]):
        leaves[i] = value
    return pytree.tree_unflatten(leaves, spec)


def _append_leaves(tree: Any, leaves: list[Any]) -> None:
    """``pytree.tree_leaves(tree)``, appended to ``leaves``; plain tuples, lists and dicts are
    walked here (a fifth of the time of the generic walk, on every call)."""
    kind = type(tree)
    if kind is tuple or kind is list:
        for item in tree:
            _append_leaves(item, leaves)
    elif kind is dict:
        for item in tree.values():  # pytree's order: the dict's own
            _append_leaves(item, leaves)
    elif kind in pytree.SUPPORTED_NODES or isinstance(tree, (tuple, dict)):  # namedtuple, OrderedDict ...
        leaves.extend(pytree.tree_leaves(tree))
    else:
        leaves.append(tree)


class XLAEngine:
    """Builds the inner backend's runner and compiles it for the XLA device."""

    native: ClassVar[frozenset[str]] = ALL_FAMILIES
    keeps_static: ClassVar[bool] = True

    def __init__(self, backend: AutoXLA) -> None:
        self.backend = backend

    def build(self, family: str, f: Any, spec: Any) -> Any:
        inner_backend = self.backend.inner
        if (
            family == "hessian"
            and type(inner_backend) is AutoFunc
            and inner_backend.chunk_size is None
            and inner_backend.mode is None
            and torch.Size(spec.y.shapes[0]).numel() == 1
        ):
            inner = _hessian_from_hvps(f, spec)
        else:
            inner = build_runner(inner_backend, family, f, spec)
        return XLARunner(inner, self.backend, family, getattr(f, "function_name", repr(f)), spec.state_contexts)


def _hessian_from_hvps(f: Any, spec: Any) -> Any:
    """``AutoFunc``'s forward-over-reverse hessian as ``vmap`` of ``jvp(grad_and_value)`` over a basis.

    The same computation as ``jacfwd(grad)``, in the form dynamo captures in one graph (2.9
    refuses to inline ``jacfwd``'s wrapper with ``has_aux``, which would force the lazy fallback).
    """
    from torch.func import grad_and_value, jvp, vmap

    y_shape = spec.y.shapes[0]

    def run(x: torch.Tensor, _: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any, Any]:
        def gradient_and_value(x_: torch.Tensor) -> tuple[Any, Any]:
            return grad_and_value(lambda z: f(z, contexts).reshape(()))(x_)

        def along(t: torch.Tensor) -> tuple[Any, Any, Any]:
            (g, y), tangent_out = cast(tuple[Any, Any], jvp(gradient_and_value, (x,), (t,)))
            return tangent_out[0], g, y

        n = x.numel()
        basis = torch.eye(n, dtype=x.dtype, device=x.device).reshape(n, *x.shape)
        out_dims: Any = (0, None, None)  # g and y do not depend on the tangent
        columns, g, y = vmap(along, out_dims=out_dims)(basis)  # columns[j] = H e_j
        hess = columns.reshape(n, n).transpose(0, 1).reshape(*x.shape, *x.shape)  # jacfwd's layout
        return y.reshape(y_shape), g, hess

    return run


register_engine(AutoXLA, XLAEngine)
