"""The fence of torch's dynamo, inductor, functorch and autograd internals.

Every such private access torchdi makes is probed here ONCE (at import; those that import
``torch._dynamo`` on first use, so that ``import torchdi`` does not load dynamo), and each has a
public path as its fallback: when a torch release moves or removes an internal, torchdi gets
slower, never wrong. Each probe says in a comment which torch versions have it (checked on 2.9,
2.13, 2.14.1). When a fast path is off, one warning (logger ``torchdi``) names it, the first time
it matters. The other fences (same rules): ``engines/_xla_private.py`` (torch-xla),
``sparsity/_private.py`` (aten's operator schemas), ``_distributed_private.py``
(``torch.distributed``).

The fast paths, by name (``FAST_PATHS``):

- ``"guard_lookup"``: dynamo's cache entries of a code object
  (``torch._C._dynamo.eval_frame._debug_get_cache_entry_list``, ``CacheEntry.code`` and
  ``CacheEntry.guard_manager.check``) and calling dynamo's transformed bytecode ourselves. A
  prepared call evaluates the guards and runs the transformed code without ``torch.compile``'s
  per-call wrapper. Fallback: every call goes through the ``torch.compile``d entry point (the
  same guards, evaluated by dynamo's frame evaluation; a few microseconds more per call).
- ``"release"``: ``torch._C._dynamo.eval_frame.reset_code`` and
  ``torch._dynamo.eval_frame.cached_backends``, which free what dynamo holds for a dropped
  preparation at once. Fallback: the preparation's entry-point globals (the runner, and so ``f``)
  are emptied, which is what frees ``f`` and the compiled graphs (rule 9); dynamo's empty cache
  entries on the dead code object remain until torch drops them.
- ``"compiler_wrappers"``: ``torch._TorchCompileInductorWrapper`` / ``torch._TorchCompileWrapper``,
  the objects ``torch.compile`` itself builds from ``backend=``, ``mode=``, ``options=``.
  Fallback: the graph dynamo hands torchdi's counting backend is compiled with a public
  ``torch.compile(graph, backend=..., mode=..., options=...)`` (compiled on its first call, which
  preparation makes).
- ``"tensorify_reset"``: ``torch._dynamo.symbolic_convert.TensorifyState.clear()`` (symbolic
  floats, torch >= 2.6). Fallback: nothing (a float a previous compilation had to specialize may
  then recompile per value: counted and logged, never stale).
- ``"dynamo_config"``: the ``torch._dynamo.config`` knobs torchdi sets per call
  (``capture_scalar_outputs``, ``recompile_limit``, ``accumulated_recompile_limit``, the logging
  knob, ``record_runtime_overhead`` off: no profiler markers in the transformed bytecode, left out
  silently where torch lacks it). A knob torch does not have is left out (``torch.compile(recompile_limit=...)`` is used
  where torch has that argument). ``caching_precompile`` is turned off around every torchdi
  compilation (``sound_settings``: it drops guards rule 7 needs).
- ``"as_tensor_handler"``: an entry for ``torch.as_tensor`` in dynamo's table of special
  handlers (``TorchInGraphFunctionVariable._get_handlers()``), installed only while a torchdi
  preparation compiles: ``torch.as_tensor(c)`` of a symbolic float is traced as dynamo traces
  ``torch.tensor(c)`` (``torch._refs.tensor``, the same tensor: a Python scalar is always
  copied), so a float context stays an input of the program. Fallback: dynamo specializes the
  float there (one compilation per value, counted and logged, never stale).
- ``"function_apply"``: ``super(torch.autograd.Function, fn).apply`` with
  ``torch._functorch.utils.unwrap_dead_wrappers``: the C++ apply without
  ``Function.apply``'s Python argument binding (about 70 us less per call). Fallback:
  ``fn.apply``. Never used while dynamo traces (torch 2.14 refuses it there).
- ``"transforms_active"``: ``torch._C._are_functorch_transforms_active``. Fallback: assume a
  transform may be active (the full path through ``torch.autograd.Function``, always correct).
- ``"forward_ad_level"``: ``torch.autograd.forward_ad._current_level``. Fallback: assume a
  dual level may be open.
- ``"set_grad_enabled"``: ``torch._C._set_grad_enabled`` (no context-manager object, ~1 us per
  call). Fallback: ``torch.set_grad_enabled(mode)`` called as a function.
- ``"functorch_level"``: ``torch._C._functorch.maybe_current_level`` (is a ``torch.func``
  transform wrapping this call?). Fallback: ``"transforms_active"`` (and, without it, "a transform
  may be active": eager backends then always run transparently, compiled ones refuse).
- ``"functorch_unwrap"``: ``torch._C._functorch.is_functorch_wrapped_tensor`` and ``get_unwrapped``
  (the plain tensor under ``torch.func``'s wrappers). Fallback: a tensor is taken as wrapped
  whenever a transform is active (finite differences then keep their step a tensor), and value
  comparisons of possibly wrapped tensors (the mutation check's, under a transform) are left to
  the version counters alone.
- ``"jvp_nesting"``: ``torch._functorch.eager_transforms.JVP_NESTING``, the count that lets a
  backend's ``torch.func.jvp`` nest in the user's eager dual level (``DifferentiateWith`` under
  ``fwAD.dual_level``). Fallback: nothing counted; torch then refuses the nested jvp with its own
  error ("Nested forward mode AD is not supported"); backends without a jvp of their own
  (``AutoFiniteDiff``) still work there, and ``torch.func.jvp`` around ``g`` works for all.
- ``"dispatch_keys"``: ``torch._C._dispatch_keys`` (a tensor's dispatch key set, to recognise
  torch's legacy ``vmap`` batching). Fallback: not recognised; ``DifferentiateWith`` loses its
  clear message there and torch's own error ("Batching rule not implemented") remains.
- ``"dynamo_errors"``: ``torch._dynamo.exc.BackendCompilerFailed`` and ``UserError``, which
  ``AutoCompile`` turns into messages naming what works. Fallback: the errors surface as torch
  raised them.
- ``"artifact_scope"``: ``torch.compiler._cache.CacheArtifactManager.with_fresh_cache`` (torch
  2.7 .. 2.14.1): the Mega-Cache artifacts (``torch.compiler.save_cache_artifacts``) of one
  persisted preparation, apart from those of the process's other compilations. Fallback: the
  process's artifacts so far (a larger cache entry, the same programs).
- ``"compile_cache_counts"``: ``torch._dynamo.utils.counters`` (AOTAutograd and FX graph cache
  hits and misses), which say whether a compilation reused persisted artifacts. Fallback:
  ``prep.loaded_from_cache`` says that artifacts were loaded, not whether they were used.
- ``"real_zeros"``: ``torch._inductor.compile_fx.compile_fx`` and ``torch._inductor.decomposition.
  select_decomp_table`` (torch 2.9 .. 2.14.1): inductor compiles a graph that uses forward mode
  with its default decompositions plus ``_fence.REAL_ZEROS`` (ZeroTensors as real zeros), called as
  ``torch.compile``'s inductor wrapper calls it, with that wrapper's mode and options. Inductor
  otherwise keeps ``aten._efficientzerotensor`` as a fallback to the eager kernel and its own
  kernels read the ZeroTensor's missing memory: a hessian through gather, topk and atan2,
  compiled after a jacobian of the same function, crashed the process (torch 2.13). Fallback:
  ``torch.compile``'s inductor wrapper as it is (that crash is then torch's, as with raw
  ``torch.compile``), named in the warning.
- ``"sealed_programs"``: ``torch._C._dynamo.guards.GlobalStateGuard`` (dynamo's C++ global-state
  guard, rebuilt from its ``__getstate__`` JSON), ``torch._C._autograd.
  _top_saved_tensors_default_hooks`` and ``torch._C._len_torch_function_stack``, with
  ``"transforms_active"`` and ``"forward_ad_level"``: the global state a sealed preparation
  (``engines/_sealed.py``) records and checks without importing dynamo (torch 2.9 .. 2.14.1).
  Fallback: nothing is sealed (a warm run traces with dynamo, as before).

Not a fast path but a feature: ``torch.autograd.grad(is_grads_batched=True)``,
``torch.autograd.functional.jacobian/hessian(vectorize=True)`` and
``gradcheck(check_batched_grad=True)`` batch cotangents with torch's legacy vmap
(``torch._vmap_internals``). ``legacy_unbatch``/``legacy_rebatch`` turn its batched tensors into
plain ones with the batch as a leading dimension and back (``torch._C._functorch.
is_legacy_batchedtensor``, ``torch._remove_batch_dim``, ``torch._add_batch_dim``,
``torch._C._vmapmode_increment_nesting``; torch 2.0 .. 2.14.1); ``outside_legacy_vmap`` runs
the backend on them outside the legacy vmap mode. Fallback: ``legacy_unbatch``
returns ``None`` and the caller refuses clearly, naming ``torch.func``'s transforms.

torch-xla's internals are fenced the same way in ``engines/_xla_private.py``, which probes only
when an XLA backend is used (importing torch-xla is slow and may fail on a mismatched torch).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import itertools
import logging
import re
import sys
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, cast

import torch
import torch.autograd.forward_ad as fwAD

from torchdi._fence import REAL_ZEROS, Fence, probed_once
from torchdi._fence import UNPROBED as _UNPROBED
from torchdi._fence import probe as _probe

__all__ = [
    "FAST_PATHS",
    "RECOMPILE_LIMIT",
    "DynamoCache",
    "fresh_entry_point",
    "release",
    "apply_function",
    "artifact_scope",
    "cache_entries",
    "compile_cache_counts",
    "compile_function",
    "compiler_for",
    "compiler_failure_errors",
    "dispatch_keys",
    "dynamo_settings",
    "dynamo_user_errors",
    "forget_float_specializations",
    "graph_break_errors",
    "forward_ad_level",
    "global_state",
    "global_state_check",
    "functorch_level",
    "functorch_unwrapped",
    "is_compiling",
    "is_functorch_wrapped",
    "is_legacy_batched",
    "jvp_nests_in_dual_level",
    "legacy_rebatch",
    "legacy_unbatch",
    "outside_legacy_vmap",
    "patched_config",
    "release_code",
    "set_grad_enabled",
    "sound_settings",
    "split_marked_value",
    "transforms_active",
    "warn_off",
]

logger = logging.getLogger("torchdi")


# -- probes (once: at import, or on first use for those that import dynamo) ----------------------

# (_UNPROBED: a probe not run yet, see _LAZY_PROBES.)

# torch 2.1 .. 2.14.1 (the C++ guard manager, CacheEntry.guard_manager, since 2.4).
_CACHE_ENTRY_LIST: Callable[[types.CodeType], Any] | None = _probe(
    lambda: torch._C._dynamo.eval_frame._debug_get_cache_entry_list
)


def _reset_code_and_backends() -> tuple[Callable[[types.CodeType], None], dict[int, Any]]:
    from torch._dynamo import eval_frame

    return torch._C._dynamo.eval_frame.reset_code, eval_frame.cached_backends


# torch 2.1 .. 2.14.1 (reset_code; cached_backends, a dict by id of the backend).
_RELEASE: tuple[Callable[[types.CodeType], None], dict[int, Any]] | None = _UNPROBED

# torch 2.0 .. 2.14.1.
_COMPILER_WRAPPERS: tuple[type, type] | None = _probe(lambda: (torch._TorchCompileInductorWrapper, torch._TorchCompileWrapper))


def _tensorify_state() -> Any:
    from torch._dynamo.symbolic_convert import TensorifyState

    return TensorifyState


def _lookup_backend() -> Callable[[str], Any]:
    import torch._dynamo

    return torch._dynamo.lookup_backend


# torch 2.0 .. 2.14.1: dynamo's registry of backends by name (the compiler wrappers' fallback).
_LOOKUP_BACKEND: Callable[[str], Any] | None = _UNPROBED

# torch 2.6 .. 2.14.1 (symbolic floats).
_TENSORIFY_STATE: Any = _UNPROBED


def _unwrap_dead_wrappers() -> Callable[[Any], Any]:
    from torch._functorch.utils import unwrap_dead_wrappers

    return unwrap_dead_wrappers


# torch 2.0 .. 2.14.1: Function's C++ base (_C._FunctionBase) apply, and functorch's unwrapping.
_FUNCTION_APPLY: tuple[Any, Callable[[Any], Any]] | None = _probe(
    lambda: (super(torch.autograd.Function, torch.autograd.Function).apply, _unwrap_dead_wrappers())
)

# torch 2.0 .. 2.14.1.
_TRANSFORMS_ACTIVE: Callable[[], bool] | None = _probe(lambda: torch._C._are_functorch_transforms_active)

# torch 1.10 .. 2.14.1: the innermost open dual level (-1: none).
_FORWARD_AD_LEVEL: bool = isinstance(_probe(lambda: fwAD._current_level), int)

# torch 2.9 .. 2.14.1: C++ objects, reachable without importing torch._dynamo ("sealed_programs").
_GLOBAL_STATE_GUARD: Any = _probe(lambda: torch._C._dynamo.guards.GlobalStateGuard)
_TOP_SAVED_TENSORS_HOOKS: Callable[[bool], Any] | None = _probe(lambda: torch._C._autograd._top_saved_tensors_default_hooks)
_TORCH_FUNCTION_STACK: Callable[[], int] | None = _probe(lambda: torch._C._len_torch_function_stack)

# torch 1.x .. 2.14.1.
_SET_GRAD_ENABLED: Callable[[bool], None] | None = _probe(lambda: torch._C._set_grad_enabled)

def _functorch_level() -> Callable[[], int | None]:
    return torch._C._functorch.maybe_current_level


def _functorch_unwrap() -> tuple[Callable[[torch.Tensor], bool], Callable[[torch.Tensor], torch.Tensor]]:
    return torch._C._functorch.is_functorch_wrapped_tensor, torch._C._functorch.get_unwrapped


# torch 2.0 .. 2.14.1: functorch's current level (None outside every transform).
_FUNCTORCH_LEVEL: Callable[[], int | None] | None = _probe(_functorch_level)

# torch 2.0 .. 2.14.1: functorch's wrapper tensors.
_FUNCTORCH_UNWRAP: tuple[Callable[[torch.Tensor], bool], Callable[[torch.Tensor], torch.Tensor]] | None = _probe(_functorch_unwrap)


def _eager_transforms() -> Any:
    import torch._functorch.eager_transforms as eager_transforms

    if not isinstance(eager_transforms.JVP_NESTING, int):
        raise TypeError("JVP_NESTING is not a count")
    return eager_transforms


# torch 2.0 .. 2.14.1: the module holding torch.func.jvp's nesting count (JVP_NESTING).
_JVP_NESTING: Any = _probe(_eager_transforms)

# torch 1.x .. 2.14.1: a tensor's dispatch key set.
_DISPATCH_KEYS: Callable[[torch.Tensor], Any] | None = _probe(lambda: torch._C._dispatch_keys)


def _dynamo_errors() -> tuple[type[BaseException], type[BaseException]]:
    import torch._dynamo.exc

    return torch._dynamo.exc.BackendCompilerFailed, torch._dynamo.exc.UserError


# torch 2.0 .. 2.14.1: a compiler's failure, and dynamo's refusal of the function itself.
_DYNAMO_ERRORS: tuple[type[BaseException], type[BaseException]] | None = _UNPROBED

def _legacy_vmap_api() -> tuple[Callable[[torch.Tensor], bool], Callable[..., torch.Tensor], Callable[..., torch.Tensor], Callable[[], int], Callable[[], int]]:
    return (
        torch._C._functorch.is_legacy_batchedtensor,
        torch._remove_batch_dim,
        torch._add_batch_dim,
        torch._C._vmapmode_increment_nesting,
        torch._C._vmapmode_decrement_nesting,
    )


# torch 2.0 .. 2.14.1: torch's legacy vmap (torch._vmap_internals), which batched autograd uses.
_LEGACY_VMAP = _probe(_legacy_vmap_api)

# torch.compile(recompile_limit=...) (a public argument; torch 2.13 and later).
_COMPILE_PARAMETERS = frozenset(inspect.signature(torch.compile).parameters)


def _dynamo_config() -> Any:
    import torch._dynamo

    return torch._dynamo.config


_CONFIG: Any = _UNPROBED


def _graph_break_errors() -> tuple[type[BaseException], ...]:
    import torch._dynamo.exc

    return (torch._dynamo.exc.Unsupported,)


# torch 2.0 .. 2.14.1: what dynamo raises for a graph break under fullgraph=True. Without it,
# nothing is taken for a graph break: the error surfaces as torch raised it.
_GRAPH_BREAK_ERRORS: tuple[type[BaseException], ...] | None = _UNPROBED

# The probes that import torch._dynamo (about a second, most of `import torchdi` otherwise) run
# on first use, once: a program that never compiles never imports dynamo. (They import torch's
# modules, not torchdi's: nothing here dodges an import cycle.)
def _compile_fx() -> tuple[Callable[..., Any], Callable[[], dict[Any, Any]], bool]:
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.decomposition import select_decomp_table

    parameters = inspect.signature(compile_fx).parameters
    if "decompositions" not in parameters or "config_patches" not in parameters:
        raise TypeError("compile_fx takes no decompositions")
    return compile_fx, select_decomp_table, "compile_region_name" in parameters


# torch 2.9 .. 2.14.1: inductor's compile_fx (what torch.compile's inductor wrapper calls, with
# the same config patches) and its default decompositions, to add REAL_ZEROS to them.
_COMPILE_FX: tuple[Callable[..., Any], Callable[[], dict[Any, Any]], bool] | None = _UNPROBED

_LAZY_PROBES: dict[str, Callable[[], Any]] = {
    "_RELEASE": _reset_code_and_backends,
    "_LOOKUP_BACKEND": _lookup_backend,
    "_TENSORIFY_STATE": _tensorify_state,
    "_DYNAMO_ERRORS": _dynamo_errors,
    "_CONFIG": _dynamo_config,
    "_GRAPH_BREAK_ERRORS": _graph_break_errors,
    "_COMPILE_FX": _compile_fx,
}


def _lazy(name: str) -> Any:
    """The probe ``name`` (one of ``_LAZY_PROBES``), probed now if it was not yet."""
    return probed_once(globals(), name, _LAZY_PROBES[name])


def graph_break_errors() -> tuple[type[BaseException], ...]:
    """What dynamo raises for a graph break under ``fullgraph=True`` (``()``: none recognised)."""
    return _lazy("_GRAPH_BREAK_ERRORS") or ()


def _graph_copier() -> Callable[[torch.fx.GraphModule], torch.fx.GraphModule]:
    """A copy of a dynamo graph module that AOTAutograd and inductor accept as dynamo's own.

    ``copy.deepcopy`` of an FX graph copies its nodes but not the attributes dynamo sets on them
    (``Node._dynamo_source``, which AOTAutograd requires on every placeholder) nor those it sets
    on the module (``_param_name_to_source``, ...): both are carried over here. The deepcopy's
    memo doubles as its old-node -> new-node map only when it is not empty (torch 2.9 .. 2.14.1's
    ``Graph.__deepcopy__``), hence the seed entry.
    """
    if not hasattr(torch.fx.Graph, "__deepcopy__"):
        raise AttributeError("torch.fx.Graph.__deepcopy__")

    def copy_module(module: torch.fx.GraphModule) -> torch.fx.GraphModule:
        memo: dict[Any, Any] = {-1: None}
        graph = copy.deepcopy(module.graph, memo)
        nodes = [(old, new) for old, new in memo.items() if isinstance(old, torch.fx.Node) and isinstance(new, torch.fx.Node)]
        mapped = {old for old, _ in nodes}
        if not all(node in mapped for node in module.graph.nodes if node.op != "output"):
            raise AttributeError("Graph.__deepcopy__ no longer maps the nodes it copies")
        for old, new in nodes:
            for name, value in vars(old).items():
                if name not in vars(new):
                    setattr(new, name, value)
        copied = torch.fx.GraphModule(module, graph)
        for name, value in vars(module).items():
            if name not in vars(copied):
                setattr(copied, name, value)
        copied.meta = dict(module.meta)
        return copied

    return copy_module


# torch 2.9 .. 2.14.1 (FX's deepcopy memo; dynamo's node attributes and "example_value" meta).
_GRAPH_COPY: Callable[[torch.fx.GraphModule], torch.fx.GraphModule] | None = _probe(_graph_copier)


def split_marked_value(module: torch.fx.GraphModule, marker: Any) -> torch.fx.GraphModule | None:
    """For a graph whose value passes through ``marker`` (an identity op), remove the marker from
    ``module`` in place and return a copy in which the value is a zero of its dtype and device
    instead: compiled, the copy leaves out what only the value needed (``f``'s final reduction
    once AOTAutograd has differentiated the graph). ``None`` when ``module`` has no marker, or
    when this torch cannot copy a dynamo graph (then only the marker goes: one program serves
    both calls)."""
    marked = list(module.graph.find_nodes(op="call_function", target=marker))
    if not marked:
        return None
    copier = _GRAPH_COPY
    lean: torch.fx.GraphModule | None = None
    if copier is None:
        warn_off("value_free_graph")
    else:
        try:
            lean = copier(module)
        except Exception as error:  # a graph this copy does not handle: the one program serves both
            warn_off("value_free_graph", str(error))
    if lean is not None:
        for node in lean.graph.find_nodes(op="call_function", target=marker):
            example = node.meta.get("example_value")
            if not isinstance(example, torch.Tensor):
                lean = None
                break
            with lean.graph.inserting_before(node):
                zero = lean.graph.call_function(torch.zeros, (tuple(example.shape),), {"dtype": example.dtype, "device": example.device})
            zero.meta = dict(node.meta)
            node.replace_all_uses_with(zero)
            lean.graph.erase_node(node)
    if lean is not None:
        lean.recompile()
    for node in marked:
        node.replace_all_uses_with(node.args[0])
        module.graph.erase_node(node)
    module.recompile()
    return lean


FAST_PATHS: dict[str, str] = {
    "guard_lookup": "evaluating dynamo's guards and running its transformed code without torch.compile's per-call wrapper",
    "release": "freeing dynamo's cache entries of a dropped preparation at once (reset_code, cached_backends)",
    "compiler_wrappers": "torch.compile's own compiler wrappers (torch._TorchCompileInductorWrapper)",
    "tensorify_reset": "forgetting dynamo's float specializations between preparations (TensorifyState)",
    "dynamo_config": "torch._dynamo.config knobs",
    "as_tensor_handler": "tracing torch.as_tensor of a symbolic float as torch.tensor (dynamo's handler table)",
    "function_apply": "the C++ torch.autograd.Function apply without Python argument binding",
    "transforms_active": "asking functorch whether a transform is active",
    "forward_ad_level": "reading forward-mode AD's current level",
    "set_grad_enabled": "switching grad mode without a context-manager object",
    "artifact_scope": "collecting one preparation's Mega-Cache artifacts apart from the process's others",
    "compile_cache_counts": "counting AOTAutograd / FX graph cache hits (whether persisted artifacts were used)",
    "functorch_level": "reading functorch's current transform level",
    "functorch_unwrap": "recognising and unwrapping torch.func's wrapper tensors",
    "jvp_nesting": "nesting a backend's torch.func.jvp in the caller's eager dual level",
    "dispatch_keys": "reading a tensor's dispatch keys (torch's legacy vmap batching)",
    "dynamo_errors": "recognising dynamo's compiler failures and refusals (torch._dynamo.exc)",
    "value_free_graph": "a value-free copy of a traced gradient graph (the plain gradient skips f's final reduction)",
    "real_zeros": "inductor's compile_fx and default decompositions, to compile forward mode's ZeroTensors as real zeros",
    "repeated_guards": "leaving out repeats of dynamo's functorch-stack guard (one Python call each per program call)",
    "sealed_programs": "checking dynamo's global-state guards without importing dynamo (GlobalStateGuard, the mode and hook "
    "stacks), so that a persisted AOTInductor preparation loads without dynamo",
}

# What a fallback costs when it is more than time (the others are slower, never different).
_COSTS: dict[str, str] = {
    "real_zeros": (
        "torch.compile's own inductor backend, whose kernels may read a forward-mode ZeroTensor's missing memory "
        "(a process crash seen on torch 2.13 with a hessian through gather, topk and atan2); compiler=\"aot_eager\" avoids it"
    ),
    "jvp_nesting": (
        "with which DifferentiateWith(f, backend) under an eager fwAD.dual_level works for backends that open no "
        "jvp of their own (AutoFiniteDiff); torch refuses the others ('Nested forward mode AD is not supported'), "
        "torch.func.jvp around g works for all"
    ),
    "sealed_programs": "dynamo's import and trace on every warm run of a persisted aot_inductor preparation (about a second)",
}

fence = Fence(FAST_PATHS, _COSTS)
warn_off = fence.warn_off


# -- dynamo's cache entries ("guard_lookup", "release") -----------------------------------------


def cache_entries(code: types.CodeType) -> list[tuple[Callable[[dict[str, Any]], bool], types.CodeType, Any]] | None:
    """Dynamo's cache entries on ``code``, newest first, as ``(guard check, transformed code,
    entry)``; ``None`` when this torch does not let torchdi read them (then every call goes
    through ``torch.compile``)."""
    reader = _CACHE_ENTRY_LIST
    if reader is None:
        warn_off("guard_lookup")
        return None
    try:
        return [(entry.guard_manager.check, entry.code, entry) for entry in reader(code)]
    except AttributeError as error:  # a CacheEntry without .code or .guard_manager
        warn_off("guard_lookup", str(error))
        return None


def release_code(code: types.CodeType | None, backend_key: int) -> bool:
    """Drop dynamo's cache entries on ``code`` and its cached backend ``backend_key`` (``id`` of the
    object passed as ``backend=``). Returns whether it could (``False``: the caller empties what it
    owns instead)."""
    hooks = _lazy("_RELEASE")
    if hooks is None:
        warn_off("release")
        return False
    reset_code, cached_backends = hooks
    cached_backends.pop(backend_key, None)
    if code is not None:
        reset_code(code)
    return True


# -- compiling ---------------------------------------------------------------------------------


def compiler_for(compiler: str, mode: str | None, options: dict[str, Any] | None, dynamic: bool | None) -> Any:
    """The dynamo backend ``torch.compile(backend=compiler, mode=mode, options=options,
    dynamic=dynamic)`` would use, as an object torchdi can call on each graph (to count them).

    Without torch.compile's own wrappers: dynamo's backend registry (``lookup_backend``, what
    ``torch.compile`` resolves a backend name with), and ``mode``/``options`` are then not applied
    (named in the warning: slower, e.g. no CUDA graphs, same results). A backend called from
    dynamo cannot itself go through a public ``torch.compile`` (dynamo skips FX-generated code).
    """
    wrappers = _COMPILER_WRAPPERS
    if wrappers is None:
        lookup = _lazy("_LOOKUP_BACKEND")
        if lookup is None:
            raise RuntimeError(
                f"AutoCompile: torch {torch.__version__} has neither torch._TorchCompileWrapper nor "
                "torch._dynamo.lookup_backend, which torchdi compiles through; use AutoFunc() (eager) "
                "or a torch torchdi supports (see README, Versions)."
            )
        ignored = ", ".join(name for name, value in (("mode", mode), ("options", options)) if value)
        warn_off("compiler_wrappers", f"compiling with dynamo's {compiler!r} backend" + (f", without {ignored}" if ignored else ""))
        return lookup(compiler)
    inductor, generic = wrappers
    if compiler == "inductor":
        wrapper = inductor(mode, options, dynamic)
        compile_fx = _lazy("_COMPILE_FX")
        if compile_fx is None or not isinstance(getattr(wrapper, "config", None), dict):
            warn_off("real_zeros")
            return wrapper
        return _InductorWithRealZeros(wrapper, compile_fx)
    return generic(compiler, mode, options, dynamic)


def uses_forward_mode(graph: torch.fx.GraphModule) -> bool:
    """Whether dynamo's ``graph`` (or a subgraph) enters forward-mode AD (``torch.func.jvp``, dual
    tensors): where ZeroTensors come from."""
    for module in graph.modules():
        if isinstance(module, torch.fx.GraphModule):
            for node in module.graph.nodes:
                if node.op == "call_function" and re.search(r"jvp|dual", str(getattr(node.target, "__name__", node.target))):
                    return True
    return False


class _InductorWithRealZeros:
    """``torch.compile``'s inductor backend (``wrapper``, with its mode and options) whose
    decompositions turn ZeroTensors into real zeros (``_fence.REAL_ZEROS``: inductor's own
    kernels read a ZeroTensor's missing memory and crashed the process), for the graphs that use
    forward mode. Only those: with decompositions of its own, a compilation bypasses AOTAutograd's
    on-disk cache (a warm re-run compiles it again; measured: the persisted gradient of
    tests/test_persist.py no longer loaded), so the reverse-mode graphs keep the plain wrapper."""

    compiler_name = "inductor"

    def __init__(self, wrapper: Any, compile_fx: tuple[Callable[..., Any], Callable[[], dict[Any, Any]], bool]) -> None:
        self.wrapper = wrapper
        self.compile_fx, self.decompositions, self.takes_region_name = compile_fx

    def __call__(self, model_: Any, inputs_: Any, *, config_patches: dict[str, Any] | None = None) -> Any:
        if not uses_forward_mode(model_):
            if config_patches is None:  # (torch 2.9's wrapper takes no config_patches)
                return self.wrapper(model_, inputs_)
            return self.wrapper(model_, inputs_, config_patches=config_patches)
        extra = {"compile_region_name": getattr(self.wrapper, "name", None)} if self.takes_region_name else {}
        return self.compile_fx(
            model_, inputs_, config_patches={**self.wrapper.config, **(config_patches or {})},
            decompositions={**self.decompositions(), **REAL_ZEROS}, **extra,
        )

    def __getattr__(self, name: str) -> Any:  # get_compiler_config, reset, ...: the wrapper's
        return getattr(self.wrapper, name)


class _ConfigLoggingFailures(logging.Filter):
    """Drops dynamo's "Unexpected exception logging ... metrics" records whose cause is its own
    config logger failing on the functions in the logging knob (``_compiled._dynamo_settings``).

    torch 2.10 .. 2.12 sort that set and JSON-encode it when they log a compilation's metrics
    (``TypeError``, caught and logged with its traceback at ERROR level, twice per compilation);
    torch 2.9 and 2.13 leave the knob out. The metrics are only logging: the compilation and its
    results are unaffected (measured on torch 2.11, tests/test_fence.py). Any other failure of
    dynamo's metrics logging is still shown.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if not isinstance(error, TypeError) or not record.getMessage().startswith("Unexpected exception logging"):
            return True
        frame, names = error.__traceback__, set()
        while frame is not None:
            names.add(frame.tb_frame.f_code.co_name)
            frame = frame.tb_next
        return "_get_dynamo_config_for_logging" not in names


# The logger of torch 2.5 .. 2.14.1's torch/_dynamo/metrics_context.py (a name only: where torch
# logs elsewhere, the filter filters nothing and the records show, as without torchdi).
_METRICS_LOGGER = "torch._dynamo.metrics_context"
_metrics_filter = _ConfigLoggingFailures()


# The guard that compares functorch's interpreter stack with the one the program was traced in.
_FUNCTORCH_STACK_GUARD = "FUNCTORCH_STACK_MATCH"


def without_repeated_guards(entries: Sequence[Any]) -> list[bool]:
    """Which of dynamo's guard ``entries`` (``GuardFilterEntry``) to keep: all but the
    functorch-stack guards whose code repeats one kept before (``"repeated_guards"``).

    Args:
        entries: what ``torch.compile``'s ``guard_filter_fn`` receives.

    Returns:
        One ``bool`` per entry: whether dynamo installs it.
    """
    seen: set[frozenset[str]] = set()
    keep = []
    for entry in entries:
        if getattr(entry, "guard_type", None) == _FUNCTORCH_STACK_GUARD:
            code = getattr(getattr(entry, "orig_guard", None), "code_list", None)
            if not code:  # a torch that does not spell the guard out: it stays
                warn_off("repeated_guards", "a guard entry without its code (orig_guard.code_list)")
            else:
                # (a set: a guard built twice, as dynamo may, lists its code twice)
                key = frozenset(code)
                if key in seen:
                    keep.append(False)
                    continue
                seen.add(key)
        keep.append(True)
    return keep


def compile_function(
    function: Callable[..., Any], backend: Any, *, fullgraph: bool, dynamic: bool | None,
    guards_seen: Callable[[Sequence[Any], list[bool]], None] | None = None,
) -> Any:
    """``torch.compile(function, ...)`` with the preparation's recompile limit where torch takes
    it as an argument (the config knob covers older torch), outside dynamo's caching precompile
    (``sound_settings``: ``torch.compile`` decides at this call whether a function joins it),
    without repeats of a guard (``without_repeated_guards``). ``guards_seen(entries, kept)`` is
    told every guard entry of each compilation (a seal's record, ``engines/_sealed.py``)."""
    logging.getLogger(_METRICS_LOGGER).addFilter(_metrics_filter)  # once: a filter is added once
    guard_filter: Callable[[Sequence[Any]], list[bool]] = without_repeated_guards
    if guards_seen is not None:
        sink = guards_seen

        def guard_filter(entries: Sequence[Any]) -> list[bool]:
            keep = without_repeated_guards(entries)
            sink(entries, keep)
            return keep

    extra: dict[str, Any] = {"options": {"guard_filter_fn": guard_filter}}
    if "recompile_limit" in _COMPILE_PARAMETERS:
        extra["recompile_limit"] = RECOMPILE_LIMIT
    with patched_config(sound_settings()):
        return torch.compile(function, backend=backend, fullgraph=fullgraph, dynamic=dynamic, **extra)


def sound_settings() -> dict[str, Any]:
    """The ``torch._dynamo.config`` values every torchdi compilation needs for rule 7, where this
    torch has the knob (a torch without it lacks what they turn off: no warning).

    ``caching_precompile`` (``TORCH_CACHING_PRECOMPILE=1``, torch 2.8 .. 2.14.1) off: with it on,
    dynamo drops its ``ID_MATCH``, ``CLOSURE_MATCH``, ``FUNCTION_MATCH`` (derived), ``DICT_VERSION``
    and ``WEAKREF_ALIVE`` guards from every compilation, in this process too, so a helper function
    rebound after preparation is not seen and the old program's value is returned (measured on
    torch 2.13: ``helper = helper2`` kept returning ``helper``'s value); and it keys its on-disk
    packages by a function's qualified name and first line, which every preparation's entry point
    (``fresh_entry_point``) shares with the template it is made from. (Loading such a package of a
    ``torch.func.grad_and_value`` fails on torch 2.13 anyway: "TracingContext.get() must be
    called within an ongoing trace", from unpickling an ``ImportSource`` guard.)
    """
    config = _lazy("_CONFIG")
    if config is None or not _has_knob(config, "caching_precompile"):
        return {}
    return {"caching_precompile": False}


# A preparation recompiles only when a guard fails (a static value, a global, the grad mode...).
# Its cache is its own, so dynamo's per-code limit (8) would only turn a correct recompilation
# into a crash (fullgraph=True) or a silent fall back to eager (fullgraph=False).
RECOMPILE_LIMIT = 1024


def dynamo_settings(wanted: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``wanted`` (``torch._dynamo.config`` knob -> value) this torch has; a
    missing knob is left out and named in one warning."""
    config = _lazy("_CONFIG")
    if config is None:
        warn_off("dynamo_config", "no torch._dynamo.config")
        return {}
    present = {name: value for name, value in wanted.items() if _has_knob(config, name)}
    missing = sorted(set(wanted) - set(present))
    if missing:
        warn_off("dynamo_config", "missing: " + ", ".join(missing))
    return present


def _has_knob(config: Any, name: str) -> bool:
    try:
        getattr(config, name)
    except AttributeError:
        return False
    return True


def config_value(name: str, default: Any) -> Any:
    """``torch._dynamo.config.<name>``, or ``default`` where this torch lacks it."""
    config = _lazy("_CONFIG")
    return default if config is None or not _has_knob(config, name) else getattr(config, name)


@contextlib.contextmanager
def patched_config(settings: dict[str, Any]) -> Iterator[None]:
    """``torch._dynamo.config.patch(settings)`` for the knobs this torch has."""
    present = dynamo_settings(settings)
    if not present:
        yield
        return
    with _lazy("_CONFIG").patch(present):
        yield


def forget_float_specializations() -> None:
    """Empty dynamo's record of the symbolic floats it had to specialize.

    Dynamo keeps that record by symbol name ("zf0") in a process-wide set that outlives the
    frame it was made for, so the first float of a later, unrelated compilation is specialized
    too (and then recompiles on every new value). It is only meant for the restarts within one
    compilation, which happen inside dynamo, between these calls.
    """
    state = _lazy("_TENSORIFY_STATE")
    if state is None:
        return  # a torch without symbolic floats, or one that moved the record: nothing to forget
    with contextlib.suppress(AttributeError):
        state.clear()


def _as_tensor_api() -> tuple[dict[Any, Any], Any, type] | None:
    """Dynamo's special-handler table, its in-graph function variable and its symbolic-scalar
    variable (torch 2.4 .. 2.14.1), probed on first use: importing dynamo's variables is slow."""
    global _AS_TENSOR_API
    if _AS_TENSOR_API is None:

        def probe() -> tuple[dict[Any, Any], Any, type]:
            from torch._dynamo.variables.tensor import SymNodeVariable
            from torch._dynamo.variables.torch import TorchInGraphFunctionVariable

            handlers = TorchInGraphFunctionVariable._get_handlers()
            if not isinstance(handlers, dict) or not hasattr(torch._refs, "tensor"):
                raise AttributeError("dynamo's handler table")
            return handlers, TorchInGraphFunctionVariable, SymNodeVariable

        _AS_TENSOR_API = _probe(probe) or False
    return _AS_TENSOR_API or None


_AS_TENSOR_API: Any = None
_AS_TENSOR_NAMES = ("data", "dtype", "device")


def _handle_as_tensor(variable: Any, tx: Any, *args: Any, **kwargs: Any) -> Any:
    """Dynamo's handler for ``torch.as_tensor(data, *, dtype=None, device=None)``: a symbolic scalar
    ``data`` is traced as ``torch.tensor`` traces it; anything else as dynamo does (``None``)."""
    api = _as_tensor_api()
    if api is None or len(args) > 1 or set(kwargs) - set(_AS_TENSOR_NAMES):
        return None  # (as_tensor takes data alone by position: torch's own error for the rest)
    _, in_graph_function, symbolic_scalar = api
    named = dict(zip(_AS_TENSOR_NAMES, args)) | kwargs
    data = named.pop("data", None)
    if not isinstance(data, symbolic_scalar):
        return None
    # A Python scalar is always copied by as_tensor: the same tensor as torch.tensor(data, ...).
    return in_graph_function(torch._refs.tensor).call_function(tx, [data], named)


@contextlib.contextmanager
def symbolic_as_tensor() -> Iterator[None]:
    """While torchdi compiles: ``torch.as_tensor(c)`` of a symbolic float keeps ``c`` symbolic.

    Dynamo traces ``torch.tensor(c)`` of a symbolic float through ``torch._refs.tensor`` (no
    specialization, then ``translate.keep_float_factories_traced`` keeps ``c`` an input), but
    runs ``torch.as_tensor(c)`` as is, which specializes ``c``: one compilation per value. The
    handler is in dynamo's table only inside the block (torchdi's own compilations), and never
    replaces one torch has.
    """
    api = _as_tensor_api()
    if api is None:
        warn_off("as_tensor_handler")
        yield
        return
    handlers = api[0]
    if torch.as_tensor in handlers:  # torch's own handler, or ours from an enclosing compilation
        yield
        return
    handlers[torch.as_tensor] = _handle_as_tensor
    try:
        yield
    finally:
        if handlers.get(torch.as_tensor) is _handle_as_tensor:
            del handlers[torch.as_tensor]


def is_compiling() -> bool:
    """Whether dynamo is tracing the caller (public: ``torch.compiler.is_compiling``)."""
    return torch.compiler.is_compiling()


# -- autograd and functorch ("function_apply", "transforms_active", "forward_ad_level", ...) ------


def transforms_active() -> bool:
    """Whether a ``torch.func`` transform is active (``True`` when this torch cannot say)."""
    probe = _TRANSFORMS_ACTIVE
    if probe is None:
        warn_off("transforms_active")
        return True
    return bool(probe())


def forward_ad_level() -> int:
    """The innermost open forward-mode AD level, -1 for none (0 when this torch cannot say)."""
    if not _FORWARD_AD_LEVEL:
        warn_off("forward_ad_level")
        return 0
    return int(getattr(fwAD, "_current_level", 0))


def _current_device() -> str | None:
    device = getattr(sys.modules.get("torch.utils._device"), "CURRENT_DEVICE", None)
    return None if device is None else str(device)


def _seal_internals() -> bool:
    """Whether this torch lets a seal read back every global state dynamo guards."""
    if _GLOBAL_STATE_GUARD is None or _TOP_SAVED_TENSORS_HOOKS is None or _TORCH_FUNCTION_STACK is None or _TRANSFORMS_ACTIVE is None or not _FORWARD_AD_LEVEL:
        warn_off("sealed_programs")
        return False
    return True


def global_state(refusal: type[Exception]) -> dict[str, Any]:
    """The global state dynamo guards, now, written down for a seal (``engines/_sealed.py``).

    Args:
        refusal: raised (with why) where a seal cannot check that state: this torch lacks the
            internals, or a ``torch.func`` transform, a ``TorchFunctionMode`` or saved-tensors
            hooks are active (states a seal does not record).

    Returns:
        ``{"state": GlobalStateGuard's JSON, "dual_level": ..., "device": ...}``.
    """
    if not _seal_internals():
        raise refusal("this torch lacks the global-state internals")
    assert _TORCH_FUNCTION_STACK is not None and _TOP_SAVED_TENSORS_HOOKS is not None
    if transforms_active():
        raise refusal("a torch.func transform is active")
    if _TORCH_FUNCTION_STACK() != 0:
        raise refusal("a TorchFunctionMode is active")
    if _TOP_SAVED_TENSORS_HOOKS(True) is not None:
        raise refusal("saved-tensors hooks are active")
    return {"state": _GLOBAL_STATE_GUARD().__getstate__(), "dual_level": forward_ad_level(), "device": _current_device()}


def global_state_check(recorded: dict[str, Any]) -> Callable[[], bool]:
    """A check that the global state is ``recorded`` (``global_state``'s) again; raises
    ``ValueError`` when this torch cannot read it back."""
    if not _seal_internals():
        raise ValueError("this torch lacks the global-state internals")
    assert _TORCH_FUNCTION_STACK is not None and _TOP_SAVED_TENSORS_HOOKS is not None and _TRANSFORMS_ACTIVE is not None
    guard = _GLOBAL_STATE_GUARD.__new__(_GLOBAL_STATE_GUARD)
    guard.__setstate__(recorded["state"])
    check, level, device = guard.check, recorded["dual_level"], recorded["device"]
    active, hooks, modes = _TRANSFORMS_ACTIVE, _TOP_SAVED_TENSORS_HOOKS, _TORCH_FUNCTION_STACK

    def global_state_holds() -> bool:
        return (
            bool(check()) and not active() and modes() == 0 and hooks(True) is None
            and forward_ad_level() == level and _current_device() == device
        )

    return global_state_holds


def apply_function(function: Any, *args: Any) -> Any:
    """``function.apply(*args)`` for a ``torch.autograd.Function``.

    Outside ``torch.func`` transforms and dynamo tracing, ``Function.apply`` only binds default
    arguments with ``inspect.signature`` (70 us per call for setup_context-style Functions, which
    have none here) before the C++ apply: call that directly. Under a transform the full path
    (``custom_function_call``) is needed; while dynamo traces, only ``Function.apply`` is
    understood (torch 2.14 raises ``AsPythonConstantNotImplementedError`` on the shortcut).
    """
    fast = _FUNCTION_APPLY
    if fast is None:
        warn_off("function_apply")
        return function.apply(*args)
    if torch.compiler.is_compiling() or transforms_active():
        return function.apply(*args)
    _, unwrap_dead_wrappers = fast
    return super(torch.autograd.Function, function).apply(*unwrap_dead_wrappers(args))


def functorch_level() -> int | None:
    """The innermost active ``torch.func`` transform's level, ``None`` outside every transform
    (``0`` when this torch cannot say but a transform may be active). Not callable while dynamo
    traces (check ``is_compiling()`` first)."""
    probe = _FUNCTORCH_LEVEL
    if probe is None:
        warn_off("functorch_level")
        return 0 if transforms_active() else None
    return probe()


def is_functorch_wrapped(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is wrapped by a ``torch.func`` transform (``True`` whenever a transform
    is active, when this torch cannot say)."""
    probe = _FUNCTORCH_UNWRAP
    if probe is None:
        warn_off("functorch_unwrap")
        return transforms_active()
    return bool(probe[0](tensor))


def functorch_unwrapped(tensor: torch.Tensor) -> torch.Tensor | None:
    """The plain tensor under ``torch.func``'s wrappers (all batch entries of a ``vmap``ped
    tensor); ``None`` when it may be wrapped and this torch cannot unwrap it."""
    probe = _FUNCTORCH_UNWRAP
    if probe is None:
        if not transforms_active():
            return tensor
        warn_off("functorch_unwrap", "under torch.func transforms the mutation check reads version counters only")
        return None
    is_wrapped, get_unwrapped = probe
    while is_wrapped(tensor):
        tensor = get_unwrapped(tensor)
    return tensor


@contextlib.contextmanager
def jvp_nests_in_dual_level() -> Iterator[None]:
    """Count the caller's eager dual level (``fwAD.dual_level``) as an outer ``torch.func.jvp``.

    Forward-mode AD has one dual level at a time. ``torch.func.jvp`` enters it when it is the
    outermost jvp (its count ``JVP_NESTING`` is 0) and nests inside it otherwise, telling its
    tangents apart by functorch's own levels. Counting the user's level as an outer jvp lets a
    backend's jvp nest in it as under ``torch.func.jvp``, instead of failing with "Nested forward
    mode AD is not supported". Without the count (``"jvp_nesting"``), nothing changes.
    """
    transforms = _JVP_NESTING
    if forward_ad_level() < 0:
        yield
        return
    if transforms is None:
        warn_off("jvp_nesting")
        yield
        return
    if transforms.JVP_NESTING != 0:
        yield
        return
    transforms.JVP_NESTING += 1
    try:
        yield
    finally:
        transforms.JVP_NESTING -= 1


def dispatch_keys(tensor: torch.Tensor) -> str | None:
    """The repr of ``tensor``'s dispatch key set, ``None`` when this torch does not show it."""
    probe = _DISPATCH_KEYS
    if probe is None:
        warn_off("dispatch_keys")
        return None
    return repr(probe(tensor))


def compiler_failure_errors() -> tuple[type[BaseException], ...]:
    """Dynamo's "the backend compiler failed" error class (``()``: none recognised)."""
    errors = _lazy("_DYNAMO_ERRORS")
    if errors is None:
        warn_off("dynamo_errors")
        return ()
    return (errors[0],)


def dynamo_user_errors() -> tuple[type[BaseException], ...]:
    """Dynamo's refusals of the traced function itself (a data-dependent guard...) (``()``: none recognised)."""
    errors = _lazy("_DYNAMO_ERRORS")
    if errors is None:
        warn_off("dynamo_errors")
        return ()
    return (errors[1],)


def set_grad_enabled(mode: bool) -> None:
    """Set grad mode (``torch.set_grad_enabled(mode)`` without its context-manager object)."""
    setter = _SET_GRAD_ENABLED
    if setter is None:
        warn_off("set_grad_enabled")
        torch.set_grad_enabled(mode)
        return
    setter(mode)


# -- a preparation's own entry point and dynamo cache ------------------------------------------

# Dynamo keeps automatic-dynamic and profile state by (file, line, name) of a code object: a
# number never reused (unlike id()) keeps a new preparation from inheriting a dead one's.
_preparation_numbers = itertools.count(1)


def fresh_entry_point(template: Callable[..., Any], prefix: str, names: dict[str, Any]) -> types.FunctionType:
    """``template``'s code under a name, file and globals of its own.

    (``CodeType.replace`` and ``FunctionType`` are Python's public API, not torch's.)

    Args:
        template: a function whose body reads only its arguments and the globals in ``names``.
        prefix: the start of the new function's name (a preparation number is appended).
        names: the new function's globals (``__builtins__`` is added).

    Returns:
        A function dynamo sees as a new code object: its own cache entries, recompile count and
        globals (where dynamo installs the compiled graphs, so they die with it).
    """
    function = cast(types.FunctionType, template)
    name = f"{prefix}_{next(_preparation_numbers)}"
    code = function.__code__.replace(co_name=name, co_qualname=name, co_filename=f"<torchdi {name}>")
    # __name__: the template's module. Dynamo (torch 2.9) resolves the frame's module through
    # sys.modules and silently caches nothing on a frame whose module it cannot find.
    scope = {**names, "__builtins__": __builtins__, "__name__": function.__module__, "__torchdi_names__": tuple(names)}
    return types.FunctionType(code, scope, name)


class DynamoCache:
    """Dynamo's cache entries for one entry point: their guard checks and transformed code.

    Dynamo keeps, per code object, a list of cache entries: a guard manager (every guard it
    installed while tracing: arguments, globals, closure cells, attributes, helper functions, the
    grad mode and the rest of the global state) and the transformed bytecode it runs when those
    guards pass. Frame evaluation does exactly this: find the first entry whose guards pass, run
    its bytecode, else compile a new entry. ``lookup`` does the same first step from Python,
    without ``torch.compile``'s per-call wrapper; a miss is the caller's cue to call through
    ``torch.compile``, which recompiles where raw ``torch.compile`` would. Without the
    ``"guard_lookup"`` internals, ``fast`` stays ``False`` and every call goes through
    ``torch.compile``.

    Args:
        function: the entry point passed to ``torch.compile`` (from ``fresh_entry_point``).

    Attributes:
        entries: ``(guard check, transformed code)`` per cache entry, newest first.
        fast: whether ``lookup`` may be used. The transformed code of a graph with breaks calls
            resume functions that only dynamo's frame evaluation compiles: then every call must
            go through ``torch.compile``.
        in_flight: the arguments by name of the call now going through ``call`` (``None``
            between calls: a preparation keeps no user data), for ``recompile_cause``.
    """

    def __init__(self, function: types.FunctionType) -> None:
        self.function = function
        self.entries: tuple[tuple[Any, Any], ...] = ()
        self.fast = False
        self.readable = True  # whether this torch lets torchdi read the entries ("guard_lookup")
        self.in_flight: dict[str, Any] | None = None

    def refresh(self) -> None:
        """Read the current cache entries (after a compilation added one)."""
        entries = cache_entries(self.function.__code__)
        if entries is None:
            self.entries, self.fast, self.readable = (), False, False
            return
        fast = []
        for check, code, _ in entries:
            names = code.co_names
            one_graph = sum(name.startswith("__compiled_fn") for name in names) == 1
            if not one_graph or any(name.startswith("__resume") for name in names):
                self.entries, self.fast = (), False
                return
            transformed = types.FunctionType(code, self.function.__globals__, self.function.__code__.co_name)
            fast.append((check, transformed))
        self.entries, self.fast = tuple(fast), bool(fast)

    def lookup(self, frame_locals: dict[str, Any]) -> Any:
        """The transformed code of the first entry whose guards pass for ``frame_locals`` (the
        entry point's arguments by name), or ``None``: dynamo would then compile."""
        for check, transformed in self.entries:
            if check(frame_locals):
                return transformed
        return None

    def call(self, compiled: Callable[..., Any], args: tuple[Any, ...], frame_locals: dict[str, Any], settings: Mapping[str, Any]) -> Any:
        """Call ``compiled`` (``torch.compile`` of the entry point) through dynamo's frame
        evaluation: its guards, and a recompilation where none of its entries' pass.

        Args:
            compiled: what ``torch.compile(entry point)`` returned.
            args: its arguments.
            frame_locals: the same arguments as the entry point's frame names them (what its
                guards read); ``recompile_cause`` reads them while the call runs.
            settings: ``torch._dynamo.config`` values the call runs under (knobs this torch
                lacks are left out).

        Returns:
            The entry point's result. The entries are read again when the call compiled one.
        """
        before = self._transformed_codes()
        self.in_flight = frame_locals
        try:
            with patched_config({**settings, **sound_settings()}), symbolic_as_tensor():
                result = compiled(*args)
        finally:
            self.in_flight = None
        if before is not None and self._transformed_codes() != before:
            self.refresh()
        return result

    def _transformed_codes(self) -> tuple[types.CodeType, ...] | None:
        entries = cache_entries(self.function.__code__)
        return None if entries is None else tuple(code for _, code, _ in entries)

    def recompile_cause(self) -> str:
        """Why the call in flight recompiles: dynamo's words for the guard of the newest cache
        entry that fails for its arguments (asked from the compiler, before the new entry exists)."""
        if self.in_flight is None:
            return "of a change"
        entries = cache_entries(self.function.__code__)
        if entries is None:
            return "one of dynamo's guards failed (TORCH_LOGS=recompiles names it)"
        if not entries:
            return "dynamo's cache for it was emptied (torch._dynamo.reset())"
        try:
            info = entries[0][2].guard_manager.check_verbose(self.in_flight)
            parts = [" ".join(part.split()) for part in info.verbose_code_parts if part.strip()]
        except Exception:  # a guard that cannot say why: the recompilation still happens
            parts = []
        return ("this guard failed: " + "; ".join(parts)) if parts else "one of dynamo's guards failed"


def release(backend_key: int, holder: list[types.FunctionType]) -> None:
    """Free what dynamo holds for a dropped preparation.

    Dynamo keeps its backend in a module-level cache (by ``id``), and keeps the globals of a
    compiled frame (where it installs the compiled graphs, next to the runner and so ``f``)
    alive through a cleanup hook tied to the cache entry on the frame's code object: a cycle
    through C-level state that the garbage collector cannot see. Emptying the cache and dropping
    the entry point's globals breaks it (dynamo's own hooks remove the names it installed).
    Without ``"release"``'s internals, emptying the globals (ours and the compiled graphs
    dynamo installed there) is what frees ``f`` and the graphs.

    Args:
        backend_key: ``id`` of the backend object passed to ``torch.compile``.
        holder: a list holding the entry point, if it was made (filled after the finalizer was
            registered, so that the finalizer does not keep the preparation alive).
    """
    released = release_code(holder[0].__code__ if holder else None, backend_key)
    if holder:
        scope = holder[0].__globals__
        for name in scope.get("__torchdi_names__", ()):  # ours: dynamo's hooks remove its own
            scope.pop(name, None)
        if not released:  # the compiled graphs go; their names stay for dynamo's own hooks to delete
            for name in [name for name in scope if name.startswith(("__compiled_fn", "__resume"))]:
                scope[name] = None


# -- torch's legacy vmap (is_grads_batched, vectorize=True, check_batched_grad) -----------------

# Levels looked for above the calling thread's legacy vmap nesting: the autograd engine may run a
# backward on a device thread whose own nesting count is 0.
_LEGACY_LEVEL_MARGIN = 4


# torch 2.0 .. 2.14.1: legacy vmap mode's dispatch key (not a DispatchKey member: parsed by name).
def _vmap_mode_keys() -> Any:
    key = torch._C._parse_dispatch_key("VmapMode")
    if key is None:
        raise AttributeError("VmapMode")
    return torch._C.DispatchKeySet(key)


_VMAP_MODE_KEYS: Any = _probe(_vmap_mode_keys)

# Legacy vmap's "Batched" key in a dispatch key set's repr (not a DispatchKey member): how a
# torch without is_legacy_batchedtensor is still refused clearly (``dispatch_keys``).
_BATCHED_KEY = re.compile(r"[(, ]Batched[,)]")


def is_legacy_batched(tensor: Any) -> bool:
    """Whether ``tensor`` is batched by torch's legacy vmap (``False`` when this torch cannot say)."""
    if not isinstance(tensor, torch.Tensor):
        return False
    api = _LEGACY_VMAP
    if api is not None:
        return bool(api[0](tensor))
    keys = dispatch_keys(tensor)
    return keys is not None and _BATCHED_KEY.search(keys) is not None


def _legacy_nesting() -> int:
    """The calling thread's legacy vmap nesting, read without changing it."""
    assert _LEGACY_VMAP is not None
    current = _LEGACY_VMAP[3]() - 1
    _LEGACY_VMAP[4]()
    return current


@contextlib.contextmanager
def outside_legacy_vmap() -> Iterator[None]:
    """Leave torch's legacy vmap mode for the block, on plain tensors from ``legacy_unbatch``.

    Inside the mode, the dispatcher adds ``VmapMode`` to every tensor's keys (a compiled
    backend's guards then fail, one recompilation per mode) and refuses random operations; the
    block computes on plain tensors, so it runs as outside any vmap. The nesting is restored after.
    """
    api = _LEGACY_VMAP
    depth = _legacy_nesting() if api is not None else 0
    with contextlib.ExitStack() as stack:
        # The mode's key is also in the thread-local dispatch keys the autograd engine hands its
        # device threads, whose own nesting count is 0: exclude it as well.
        if _VMAP_MODE_KEYS is not None:
            stack.enter_context(torch._C._ExcludeDispatchKeyGuard(_VMAP_MODE_KEYS))
        if api is not None and depth > 0:
            for _ in range(depth):
                api[4]()
            stack.callback(lambda: [api[3]() for _ in range(depth)])
        yield


def legacy_unbatch(tensors: tuple[torch.Tensor, ...]) -> tuple[tuple[torch.Tensor, ...], tuple[tuple[int, int], ...], int] | None:
    """Plain tensors for legacy-vmap batched ones: every batch level as one leading dimension.

    Returns ``(plain, levels, size)``: each of ``tensors`` with its batch dimensions (from every
    level any of them carries, an unbatched one expanded) flattened into one leading dimension of
    ``size``, and the ``(level, batch size)`` pairs ``legacy_rebatch`` needs. ``None`` when this
    torch lacks the internals or a batch level could not be found (the caller refuses then).
    """
    api = _LEGACY_VMAP
    if api is None:
        return None
    is_batched, remove_batch_dim = api[0], api[1]
    current = _legacy_nesting()
    # A level a tensor does not carry expands it by the batch size given: 0 tells "absent" apart
    # from a present level (whose own size is used, and is never 0 for a batch that has rows).
    found: dict[int, int] = {}
    for tensor in tensors:
        if not is_batched(tensor):
            continue
        for level in range(max(current, 0) + _LEGACY_LEVEL_MARGIN, 0, -1):
            if level in found:
                continue
            size = remove_batch_dim(tensor, level, 0, 0).shape[0]
            if size:
                found[level] = size
    levels = tuple(sorted(found.items()))  # outermost (lowest) level first
    plain = []
    for tensor in tensors:
        for level, size in reversed(levels):  # innermost first: each becomes the new leading dim
            tensor = remove_batch_dim(tensor, level, size, 0)
        if is_batched(tensor):
            return None
        plain.append(tensor.reshape(-1, *tensor.shape[len(levels) :]) if len(levels) != 1 else tensor)
    total = 1
    for _, size in levels:
        total *= size
    return tuple(plain), levels, total


def legacy_rebatch(tensor: torch.Tensor, levels: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """The inverse of ``legacy_unbatch`` for one result with the same leading batch dimension."""
    api = _LEGACY_VMAP
    assert api is not None
    add_batch_dim = api[2]
    if len(levels) != 1:
        tensor = tensor.reshape(*(size for _, size in levels), *tensor.shape[1:])
    for level, _ in levels:  # outermost first, as legacy vmap nests
        tensor = add_batch_dim(tensor, 0, level)
    return tensor


# -- persisted compiled artifacts ("artifact_scope", "compile_cache_counts") ---------------------
# Lazy probes (_LAZY_PROBES): they import inductor's and dynamo's modules.


def _fresh_artifacts() -> Any:
    from torch.compiler._cache import CacheArtifactManager

    return CacheArtifactManager.with_fresh_cache


def _dynamo_counters() -> Any:
    from torch._dynamo.utils import counters

    return counters


# torch 2.7 .. 2.14.1.
_FRESH_ARTIFACTS: Any = _UNPROBED
# torch 2.0 .. 2.14.1 (the cache counters: AOTAutograd's since 2.4, the FX graph cache's since 2.2).
_COUNTERS: Any = _UNPROBED
_LAZY_PROBES["_FRESH_ARTIFACTS"] = _fresh_artifacts
_LAZY_PROBES["_COUNTERS"] = _dynamo_counters


def artifact_scope() -> contextlib.AbstractContextManager[None]:
    """A scope whose compilations' Mega-Cache artifacts ``torch.compiler.save_cache_artifacts``
    returns alone (the process's earlier ones are set aside and restored after it)."""
    fresh = _lazy("_FRESH_ARTIFACTS")
    if fresh is None:
        warn_off("artifact_scope")
        return contextlib.nullcontext()
    return cast("contextlib.AbstractContextManager[None]", fresh())


def compile_cache_counts() -> tuple[int, int] | None:
    """``(hits, misses)`` of AOTAutograd's and inductor's FX graph caches in this process so far,
    or ``None`` when this torch does not count them."""
    counters = _lazy("_COUNTERS")
    if counters is None:
        warn_off("compile_cache_counts")
        return None
    try:
        hits = counters["aot_autograd"]["autograd_cache_hit"] + counters["inductor"]["fxgraph_cache_hit"]
        misses = counters["aot_autograd"]["autograd_cache_miss"] + counters["inductor"]["fxgraph_cache_miss"]
    except (KeyError, TypeError):
        return None
    return int(hits), int(misses)
