"""The compiled runner: a runner compiled once with ``torch.compile`` at preparation.

The base every compiled path shares: ``AutoCompile``'s engine (``engines/autocompile.py``)
compiles the inner backend's runner with it, ``AutoSparse`` over ``AutoCompile`` its compressed
passes and decompression, ``DataParallel`` its gather, gradient and reduction, and the
same-point preparations their folded runners. It sits below all of them (it imports no engine).

What is traced follows one rule: every leaf of ``x``, of the tangents and of the contexts goes
through ``to_device_tensor``; what comes out as a tensor is a graph input (its value may change
without recompiling), anything else is static and baked in (dynamo guards on it, and the strict
check compares it). Python floats travel as exact float64 0-d tensors and are turned back into
Python floats (``.item()``, a symbolic float to dynamo) before ``f`` sees them, so ``f`` does its
Python arithmetic on them in double precision and combines them with tensors by eager's
wrapped-number rule, and a new value never recompiles.

Soundness (rule 7): a prepared call is never less sound than calling ``torch.compile`` directly.
Each call evaluates dynamo's own guard manager for the cache entries of this preparation (all of
its guards: arguments, globals, closure cells, attributes, helper functions, global state) and
runs dynamo's transformed bytecode for the entry whose guards pass, exactly what dynamo's frame
evaluation would run, minus its per-call machinery. When no entry's guards pass, the call goes
through ``torch.compile``'s entry point, which recompiles; the recompilation is counted and
logged with the guard that failed, in dynamo's words.

Persisted preparations (``AutoCompile(cache_dir=...)`` or ``TORCHDI_CACHE_DIR``): the compiled
artifacts of a preparation (torch's Mega-Cache: AOTAutograd's and inductor's FX graph cache
entries, ``torch.compiler.save_cache_artifacts``) are stored in ``torchdi.cache`` under a key of
the program (f and what it reads, the signature, the backend's settings), and loaded into torch's
caches before a later preparation of the same program compiles. Dynamo still traces ``f`` and
builds its guards from that trace, and those caches are keyed by the traced graph itself: what is
loaded can only make compilation faster, never change a result (rule 7 holds by construction).

With ``compiler="aot_inductor"``, a preparation that compiled one graph into AOTInductor
programs also stores its *seal* (``engines/_sealed.py``): every guard dynamo installed, written
down, with the sources of the graph's inputs and how the result is built. A later preparation
with the same key (this process or another) loads the seal and the programs without importing
dynamo, checks each guard against its own objects, and on every call checks every guard in
Python before running the programs; the first check that fails hands the call to dynamo
(compiled, counted and logged with the failed check). Never a stale result; measured in the
README ("Persisted preparations").

Each preparation owns its dynamo cache (a code object of its own), so its recompile limit is its
own business, and everything it compiled is freed with it (rule 9).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from torchdi.backends import AutoCompile
from torchdi.cache import ENV_DIR, Store, store_for
from torchdi.engines._aoti_private import AOTInductorCompiler, load_program
from torchdi.engines._dynamo import (
    RECOMPILE_LIMIT,
    DynamoCache,
    artifact_scope,
    compile_cache_counts,
    compile_function,
    compiler_failure_errors,
    compiler_for,
    config_value,
    dynamo_user_errors,
    forget_float_specializations,
    fresh_entry_point,
    graph_break_errors,
    patched_config,
    release,
    sound_settings,
    split_marked_value,
)
from torchdi.engines._sealed import Sealed, SealRecorder, dumps, loads, tensor_layout
from torchdi.errors import UnsupportedOperatorError
from torchdi.fingerprint import fingerprint
from torchdi.translate import (
    copyto_,
    float_positions,
    keep_float_factories_traced,
    to_device_tensor,
)

__all__ = ["AOT_INDUCTOR", "CompiledRunner", "float_positions", "inductor_options", "traced_view", "translated"]

logger = logging.getLogger("torchdi")

# AutoCompile(compiler=AOT_INDUCTOR): the graphs dynamo traces become AOTInductor programs where
# that is sound (engines/_aoti_private.py), inductor's otherwise.
AOT_INDUCTOR = "aot_inductor"

_LOGGER_METHODS = ("debug", "info", "warning", "warn", "error", "critical", "exception", "log", "warning_once", "info_once")


# The value of a compiled gradient passes through this identity on its way out of the traced
# program, so that the compiler can tell it from the gradient: the counting compiler removes it
# and compiles a second, value-free copy of the same traced graph (split_marked_value), which the
# plain `gradient` runs. One trace and one set of dynamo guards serve both calls (rule 7; one
# compilation counted, rule 2), and the plain gradient no longer pays f's final reduction: on
# Rosenbrock 1e6 (one thread, inductor) the one program took 5916 us a call against raw
# torch.compile(grad(f))'s 5198, the value-free copy 5235 (1.01x). The price is one more inductor
# compilation at preparation: 10-14% more CPU time for a cold prepare_gradient
# (benchmarks/cold_prepare.py; most of a cold compilation is inductor's first C++ build and imports).
@torch.library.custom_op("torchdi::gradient_value", mutates_args=())
def gradient_value(value: torch.Tensor) -> torch.Tensor:
    """The identity (a copy: a custom op may not return its input), marking a gradient's value."""
    return value.clone()


@gradient_value.register_fake
def _(value: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(value)


_MARKER = torch.ops.torchdi.gradient_value.default


def _marking_value(runner: Callable[..., Any]) -> Callable[..., Any]:
    """``runner`` (a gradient runner: ``(value, grad)``) with its value marked for the compiler."""

    def marked(x: Any, tangents: Any, contexts: Any) -> Any:
        value, grad = runner(x, tangents, contexts)
        return gradient_value(value), grad

    return marked


def _logging_calls() -> set[Any]:
    """``logging.Logger`` methods (and the ``*_once`` ones libraries such as transformers add)."""
    return {getattr(logging.Logger, name) for name in _LOGGER_METHODS if hasattr(logging.Logger, name)}


def _dynamo_settings() -> dict[str, Any]:
    """The dynamo settings every compilation of a preparation runs under (``_dynamo`` leaves
    out, with one warning, a knob this torch does not have)."""
    # A logging call is a graph break in dynamo, and real model code logs (transformers' losses
    # do): the compiled program skips such calls; f's eager run at preparation logs. (The knob's
    # name before torch 2.10: ignore_logger_methods.)
    logging_knob = "ignore_logging_functions" if config_value("ignore_logging_functions", None) is not None else "ignore_logger_methods"
    # The transformed bytecode then calls no "pregraph bytecode" profiler markers (two calls
    # through torch._disable_dynamo on every call, which only a running torch.profiler reads):
    # the prepared heat-equation jacobian (N=200, ~33 us a call) took ~1.5 us less. A speed knob
    # only: left out, without a warning, where this torch lacks it.
    markers = {"record_runtime_overhead": False} if config_value("record_runtime_overhead", None) is not None else {}
    # Aliasing guards (one object reached through two places) as C++ guards, not one Python
    # function run on every call: torch 2.13 emits them in Python for its recursive dict-tag
    # guard optimization, which is off there (as in 2.14.1, whose default this is; the heat
    # equation's guard check 7.2 -> 7.0 us). Left as torch has them where that optimization is
    # on (torch 2.9). The same guards either way: a speed knob, left out without a warning.
    aliasing = (
        {"use_lamba_guard_for_object_aliasing": False}
        if config_value("use_lamba_guard_for_object_aliasing", None) is not None and config_value("use_recursive_dict_tags_for_guards", True) is False
        else {}
    )
    return {
        **markers,
        **aliasing,
        # .item() of a float context gives dynamo a symbolic float: double-precision Python
        # arithmetic inside the graph, no recompilation per value.
        "capture_scalar_outputs": True,
        "recompile_limit": RECOMPILE_LIMIT,
        "accumulated_recompile_limit": RECOMPILE_LIMIT,
        logging_knob: set(config_value(logging_knob, ())) | _logging_calls(),
    }


# The message of the torch bug behind the refusal in CompiledRunner._warm_up.
_NESTED_FORWARD_OVERLAP = "more than one element of the written-to tensor refers to a single memory location"


def _entry_template(x: Any, tangents: Any, contexts: Any) -> Any:
    return runner(x, tangents, contexts)  # type: ignore[name-defined]  # noqa: F821  (the entry's own global)


def _aot_eager_verdict(entry: Callable[..., Any], arguments: tuple[Any, Any, Any], fullgraph: bool) -> str:
    """After inductor failed: whether ``compiler="aot_eager"`` compiles the same entry point (tried
    once, on a copy of the arguments), and so what to use instead."""
    try:
        with torch.compiler.set_stance("default"), patched_config(sound_settings()):
            torch.compile(entry, backend="aot_eager", fullgraph=fullgraph, dynamic=False)(*pytree.tree_map(
                lambda leaf: leaf.clone() if isinstance(leaf, torch.Tensor) else leaf, arguments
            ))
    except Exception as error:
        first = str(error).strip().splitlines()[:1]
        return (
            "compiler=\"aot_eager\" fails on this graph too (" + " ".join(first)[:300] + "): run it eagerly with "
            "AutoFunc() (for a PINN, a Laplacian from td.hvp along the coordinate directions compiles where "
            "td.hessian of each point does not)."
        )
    return (
        "compiler=\"aot_eager\" compiles this graph (AOTAutograd's graph run by eager kernels, tried just now): "
        "use AutoCompile(compiler=\"aot_eager\"). Graphs of nested derivatives (an f that calls another operator or "
        "a torch.func transform) hit such inductor failures."
    )


def inductor_options(options: dict[str, Any] | None) -> dict[str, Any]:
    """The inductor options of a preparation: the user's, over torchdi's one default.

    That default turns inductor's layout optimization off. A torchdi graph holds derivatives, and
    inductor keeps a convolution backward in the layout dynamo traced (contiguous), while layout
    optimization makes the forward convolutions channels-last: the graph then converts between
    the two. Measured on resnet18 in train mode (torch 2.9, 1 thread): first step 64 s against
    78 s, steps/s 8.3 against 7.4; on a BatchNorm CNN's pushforward (torch 2.13): 15-17 s
    against 19 s to compile, calls/s unchanged. ``options={"layout_optimization": True}`` or
    the ``TORCHINDUCTOR_LAYOUT_OPTIMIZATION`` environment variable turns it back on.

    Args:
        options: ``AutoCompile(options=...)``, or ``None``.

    Returns:
        The options handed to inductor (a new dict).

    Example::

        >>> from torchdi.engines._compiled import inductor_options
        >>> inductor_options({"cpp_wrapper": True})  # with TORCHINDUCTOR_LAYOUT_OPTIMIZATION unset
        {'layout_optimization': False, 'cpp_wrapper': True}
    """
    defaults = {} if "TORCHINDUCTOR_LAYOUT_OPTIMIZATION" in os.environ else {"layout_optimization": False}
    return {**defaults, **(options or {})}


def compiled_store(backend: AutoCompile) -> Store | None:
    """Where ``backend``'s compiled artifacts persist: ``cache_dir`` when given (``""``: nowhere),
    else ``TORCHDI_CACHE_DIR`` when set, else nowhere (opt-in: see the README)."""
    if backend.cache_dir is not None:
        return store_for(backend.cache_dir)
    if os.environ.get(ENV_DIR):
        return store_for(None)
    return None


def program_key(family: str, f: Any, spec: Any, backend: AutoCompile) -> str:
    """The key of a compiled program: the operator, f (``torchdi.fingerprint``, else its name:
    the artifacts are keyed by graph in torch's caches, so a coarse key costs a miss, never a
    wrong program), the signature and the backend's settings."""
    function = fingerprint(f, tensor_values=False) or getattr(f, "function_name", None) or repr(type(f))
    return json.dumps([family, function, repr(spec), repr(backend)])


class _CountingCompiler:
    """A ``torch.compile`` backend that counts the graphs it compiles for one runner, then delegates.

    It holds its runner weakly: dynamo keeps every backend it has seen in a module-level cache.
    """

    def __init__(self, owner: CompiledRunner, backend: AutoCompile, compiler: Any = None) -> None:
        self.owner = weakref.ref(owner)
        options = dict(backend.options) if backend.options else None
        if backend.compiler in ("inductor", AOT_INDUCTOR):
            options = inductor_options(options)
        if compiler is None and backend.compiler == AOT_INDUCTOR:
            # AOTInductor for the graphs it can run soundly, inductor for the rest (_aoti_private).
            fallback = _BuiltOnFirstUse(functools.partial(compiler_for, "inductor", backend.mode, options, backend.dynamic))
            compiler = AOTInductorCompiler(fallback, options, compiled_store(backend))
        self.compiler: Any = compiler if compiler is not None else compiler_for(backend.compiler, backend.mode, options, backend.dynamic)
        self.compiler_name = getattr(self.compiler, "compiler_name", backend.compiler)

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        # Counted once compiled: dynamo may abandon an attempt midway (RestartAnalysis) and trace again.
        keep_float_factories_traced(graph)  # rule 2: torch.tensor(c) of a float context stays traced
        lean = split_marked_value(graph, _MARKER)
        compiled = self.compiler(graph, example_inputs)
        owner = self.owner()
        if owner is not None:
            owner.graph_compiled(graph)
        if lean is None:
            return compiled
        # The same traced graph without the value: compiled now (preparation), chosen per call.
        compiled_lean = self.compiler(lean, example_inputs)
        holder = self.owner

        def value_or_not(*args: Any) -> Any:
            runner = holder()
            return (compiled_lean if runner is not None and getattr(runner.value_free, "on", False) else compiled)(*args)

        return value_or_not

    def __getattr__(self, name: str) -> Any:  # get_compiler_config, reset, ...: the real compiler's
        return getattr(self.compiler, name)


def traced_view(values: tuple[Any, ...]) -> tuple[Any, ...]:
    """The contexts as ``f`` sees them inside a compiled program: every leaf translated by
    ``to_device_tensor`` except Python floats, which ``f`` gets back as floats."""
    leaves, spec = pytree.tree_flatten(values)
    seen = [leaf if isinstance(leaf, float) else to_device_tensor(leaf, None) for leaf in leaves]
    return pytree.tree_unflatten(seen, spec)


def translated(values: tuple[Any, ...]) -> tuple[Any, ...]:
    """``to_device_tensor`` applied leaf by leaf (the pytree structure is kept as it is)."""
    leaves, spec = pytree.tree_flatten(values)
    return pytree.tree_unflatten([to_device_tensor(leaf, None) for leaf in leaves], spec)


def _with_floats_restored(runner: Any, positions: tuple[int, ...]) -> Any:
    """``runner`` that turns the float64 0-d tensors at ``positions`` back into Python floats."""
    if not positions:
        return runner

    def restore_floats(x: Any, tangents: Any, contexts: Any) -> Any:
        leaves, spec = pytree.tree_flatten(contexts)
        for i in positions:
            leaves[i] = leaves[i].item()
        return runner(x, tangents, pytree.tree_unflatten(leaves, spec))

    return restore_floats


def _contiguous(tree: Any) -> Any:
    """``tree`` with its tensors in the layout programs are compiled for: contiguous, at offset 0.

    (A view into a larger tensor, ``b[2:].view(3, 4)``, keeps its storage offset through
    ``contiguous()``; dynamo traces it as such, and forward mode over a complex one then fails
    inside torch: "Expected the output of forward differentiable view operations to have the
    tangent have the same layout as primal", an internal assert of ``x.conj()`` in an HVP.)
    """
    return pytree.tree_map(
        lambda t: (t.contiguous() if t.storage_offset() == 0 else t.clone(memory_format=torch.contiguous_format))
        if isinstance(t, torch.Tensor)
        else t,
        tree,
    )


class CompiledRunner:
    """A runner compiled with ``torch.compile``; compilation happens in ``warm_up`` (preparation).

    Attributes:
        num_compilations: graphs compiled for this runner so far.
        num_graphs: graphs compiled at preparation (more than one: graph breaks).
        num_ops: operations captured in those graphs (0: nothing was compiled).
        autocast: the autocast regions (device type -> dtype) active at preparation; calling
            under other ones recompiles, as raw ``torch.compile`` does.
        name: the user's function, for messages.
    """

    def __init__(
        self, runner: Any, backend: AutoCompile, family: str, function_name: str, state_contexts: tuple[int, ...] = (), can_drop_value: bool = False,
        compiler: Any = None,
    ) -> None:
        self.num_compilations = 0
        self.num_graphs = 0
        self.num_ops = 0
        self.prepared = False
        self.name = f"{family} of {function_name}"
        self.backend = backend
        self.inner = runner
        self.translate = True
        self.float_positions: tuple[int, ...] = ()
        # The positions of the State contexts: f updates them in place, and a State tensor
        # copied to the compiled layout must have its update copied back.
        self.state_contexts = state_contexts
        self.autocast: dict[str, torch.dtype] = {}
        # Persistence (torchdi.cache): the program's key, set by the engine that builds the runner
        # (None: not persisted), and whether preparation reused persisted artifacts.
        self.persist_key: str | None = None
        self.loaded_from_cache = False
        self._cache: DynamoCache | None = None
        # CUDA graphs replay on fixed addresses: with mode="reduce-overhead" the runner owns
        # static input buffers, filled in place each call, and clones the outputs it returns
        # (a later replay overwrites them).
        self.owns_buffers = backend.mode == "reduce-overhead"
        # A gradient runner whose value is marked (_marking_value, once without_value asked for it
        # before compiling): its compiled graphs come in a value-free copy too, run while
        # value_free.on is true. Per thread: a value_and_gradient call in one thread must not take
        # the value-free copy (a zero value) while a plain gradient call runs in another.
        self.can_drop_value = can_drop_value
        self.marks_value = False
        self.value_free = threading.local()
        self.buffers: tuple[Any, Any, Any] | None = None
        self._compiled: Any = None
        # (compiler: a dynamo backend used instead of the one backend names, e.g. DataParallel's
        # aot_eager with its unit-by-unit pass; backend's other settings still apply)
        self._compiler = _CountingCompiler(self, backend, compiler)
        self._entry_holder: list[Any] = []  # the entry point, once made: what the finalizer releases
        # Sealed preparations (engines/_sealed.py): the seal this preparation runs from (None: it
        # goes through dynamo), what the recorder collects while it compiles, why it was unsealed.
        self._sealed: Sealed | None = None
        self._recorder: SealRecorder | None = None
        self._warm_arguments: tuple[Any, Any, Any] | None = None
        self._unseal_cause: str | None = None
        weakref.finalize(self, release, id(self._compiler), self._entry_holder)

    @property
    def fast_path(self) -> bool:
        """Whether calls evaluate dynamo's guards and run its transformed code themselves
        (``False`` with graph breaks: every call then goes through ``torch.compile``)."""
        return self._cache is not None and self._cache.fast

    # -- compilation -------------------------------------------------------------------------

    def graph_compiled(self, graph: torch.fx.GraphModule) -> None:
        """Called by the counting compiler for each graph compiled for this runner."""
        self.num_compilations += 1
        if self._recorder is not None:
            self._recorder.graph(graph)
        if not self.prepared:
            self.num_graphs += 1
            self.num_ops += sum(node.op in ("call_function", "call_method", "call_module") for node in graph.graph.nodes)
            return
        cause = self._cache.recompile_cause() if self._cache is not None else "of a change"
        if self._unseal_cause is not None:
            cause, self._unseal_cause = f"the sealed program's check failed: {self._unseal_cause}", None
        logger.warning(
            "torchdi: AutoCompile recompiled the %s after preparation (compilation %d) because %s. "
            "Raw torch.compile recompiles here too; prepare again if the change is permanent.",
            self.name,
            self.num_compilations,
            cause,
        )

    @property
    def published(self) -> dict[str, Any]:
        """``prep.loaded_from_cache``: whether this preparation's compilation reused persisted
        artifacts (AOTAutograd / FX graph cache hits, and no miss)."""
        return {"loaded_from_cache": self.loaded_from_cache}

    def warm_up(self, x: Any, tangents: Any, contexts: tuple[Any, ...]) -> None:
        """Compile for these arguments' signatures (called once by ``prepare_*``), loading the
        program's persisted artifacts first and persisting them after, when a cache is on."""
        store = compiled_store(self.backend) if self.persist_key is not None else None
        if store is None or self.persist_key is None:
            self._warm_up(x, tangents, contexts)
            return
        aot_inductor = self._compiler.compiler
        if isinstance(aot_inductor, AOTInductorCompiler):  # its programs persist one by one (_aoti_private)
            if self._load_seal(store, x, tangents, contexts):
                return
            self._recorder = None if self.owns_buffers else SealRecorder()
            try:
                self._warm_up(x, tangents, contexts)
                programs = aot_inductor.loaded
                self.loaded_from_cache = bool(programs) and all(programs) and len(programs) == len(aot_inductor.programs)
                self._write_seal(store, aot_inductor)
            finally:  # (the recorder holds what the guards named: not kept past preparation, rule 4)
                self._recorder, self._warm_arguments = None, None
            return
        loaded = False
        payload = store.get("compiled", self.persist_key)
        if payload is not None:
            try:
                loaded = torch.compiler.load_cache_artifacts(payload) is not None
            except Exception as error:  # artifacts torch cannot read: compile from scratch
                logger.debug("torchdi cache: torch could not load the persisted artifacts of the %s (%s)", self.name, error)
        before = compile_cache_counts()
        with artifact_scope():
            self._warm_up(x, tangents, contexts)
            after = compile_cache_counts()
            reused = None if before is None or after is None else (after[0] - before[0], after[1] - before[1])
            self.loaded_from_cache = loaded and (reused is None or (reused[0] > 0 and reused[1] == 0))
            if self.loaded_from_cache:
                return
            try:
                saved = torch.compiler.save_cache_artifacts()
            except Exception as error:
                logger.debug("torchdi cache: torch could not save the artifacts of the %s (%s)", self.name, error)
                return
        if saved is not None:  # None: the compiler keeps no artifacts (aot_eager, eager)
            store.put("compiled", self.persist_key, saved[0])

    def _compiled_arguments(self, x: Any, tangents: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any, Any]:
        """Note what the entry point is prepared for (the autocast regions, the float contexts,
        whether contexts translate) and return the arguments as it takes them: contexts
        translated, tensors contiguous at offset 0 (a later call with another layout is copied
        into this one instead of recompiling per stride)."""
        self.autocast = _autocast_state()
        self.float_positions = float_positions(contexts)
        self.translate = _needs_translation(contexts)
        return _contiguous((x, tangents, translated(contexts)))

    def _warm_up(self, x: Any, tangents: Any, contexts: tuple[Any, ...]) -> None:
        x, tangents, contexts = self._compiled_arguments(x, tangents, contexts)
        entry = fresh_entry_point(_entry_template, f"torchdi_{self.name.split(' ')[0]}", {"runner": self._entry_runner()})
        self._entry_holder.append(entry)
        self._cache = DynamoCache(entry)
        holder = weakref.ref(self)

        def guards_seen(entries: Any, kept: list[bool]) -> None:  # (weakly: dynamo keeps its hooks)
            runner = holder()
            if runner is not None and runner._recorder is not None:
                runner._recorder.guards(entries, kept)

        self._compiled = compile_function(
            entry,
            backend=self._compiler,
            fullgraph=self.backend.fullgraph,
            # A preparation fixes shapes: by default (None) specialize them rather than let
            # dynamo turn a changed size or int into a symbol after a strict=False call.
            dynamic=False if self.backend.dynamic is None else self.backend.dynamic,
            guards_seen=guards_seen if self._recorder is not None else None,
        )
        if self._recorder is not None:
            self._warm_arguments = (x, tangents, contexts)
        if self.owns_buffers:
            self.buffers = pytree.tree_map(
                lambda leaf: leaf.clone() if isinstance(leaf, torch.Tensor) else leaf, (x, tangents, contexts)
            )
        try:
            # Preparing is compiling, whatever stance the caller runs under (a plain gradient's
            # variant is prepared on its first call, inside a user's fail_on_recompile block).
            with torch.compiler.set_stance("default"):
                self._through_dynamo(x, tangents, contexts)
        except graph_break_errors() as error:
            reason = str(error).strip().splitlines()
            raise RuntimeError(
                f"AutoCompile(fullgraph={self.backend.fullgraph}): torch.compile cannot capture the "
                f"{self.name} in one graph. Graph break: {' '.join(reason[:6])}\n"
                "Remove the graph break from the function (print calls, .item()/.tolist() of values, "
                "data-dependent Python control flow and calls into non-PyTorch libraries are the usual "
                "causes), or use AutoCompile(fullgraph=False), which compiles the pieces between graph "
                "breaks (preparation then logs how much was captured)."
            ) from error
        except compiler_failure_errors() as error:
            if self.backend.compiler not in ("inductor", AOT_INDUCTOR):
                raise
            # Inductor (or the AOTAutograd pass before it) fails inside torch on some graphs of
            # nested derivatives (a PINN's Laplacian, forward-over-reverse through views) that
            # aot_eager compiles: say which compiler works instead of a torch internal assert.
            failure = " ".join(str(error).strip().splitlines()[:3])
            raise RuntimeError(
                f"AutoCompile: inductor failed inside torch while compiling the {self.name} (an error of torch's "
                f"compiler on this graph, not of f): {failure}\n{_aot_eager_verdict(entry, (x, tangents, contexts), self.backend.fullgraph)}"
            ) from error
        except dynamo_user_errors() as error:
            # Dynamo's refusals of the function itself, the data-dependent guard above all
            # (a Python float computed from a tensor's value, such as BatchNorm's momentum=None
            # average 1 / num_batches_tracked): as unsupported as a graph break.
            reason = str(error).strip().splitlines()
            fallback = (
                "AutoCompile(fullgraph=False) (which runs what dynamo cannot capture eagerly), or "
                if self.backend.fullgraph
                else ""
            )
            raise RuntimeError(
                f"AutoCompile(fullgraph={self.backend.fullgraph}): torch.compile cannot compile the "
                f"{self.name}: {' '.join(reason[:4])}\n"
                "The function needs a tensor's value while it is traced (a data-dependent expression: "
                "a Python number computed from a tensor, or a branch on one; BatchNorm with momentum=None "
                "divides by its num_batches_tracked buffer). Keep such values in tensor operations "
                "(e.g. BatchNorm with a numeric momentum), or use "
                f"{fallback}an eager backend: AutoFunc() or AutoAutograd()."
            ) from error
        except Exception as error:
            if _NESTED_FORWARD_OVERLAP not in str(error):
                raise
            # A torch bug, raised from dynamo's fake-tensor pass (torch 2.13 and 2.14): a jvp nested
            # in a jvp (a second derivative) where f broadcasts a tensor it closes over against x
            # (W * t**3). Vmapping the outer jvp (as jacfwd nests) traces, but inductor then
            # segfaults on the graph (raw torch.compile of jacfwd(jacfwd(f)) too): refused instead.
            raise UnsupportedOperatorError(
                f"AutoCompile: torch.compile cannot trace the {self.name}: in forward mode (nested, as in a second "
                "derivative), a tensor f closes over is broadcast against x or has elements sharing memory (a torch "
                f"bug, raised from dynamo's fake-tensor pass: {_NESTED_FORWARD_OVERLAP!r}). What works: pass that "
                "tensor to f as a torchdi.Constant "
                "context (contexts enter forward mode as explicit primals, which compile), "
                "SecondOrder(AutoFiniteDiff(), AutoCompile()), or an eager backend: AutoFunc() or AutoAutograd()."
            ) from error
        self.prepared = True
        if self.num_ops == 0:
            logger.warning(
                "torchdi: AutoCompile captured no operation of the %s: it runs eagerly (graph breaks "
                "everywhere). Run it with fullgraph=True to see why.",
                self.name,
            )
        elif self.num_graphs > 1 or (not self.fast_path and self._cache is not None and self._cache.readable):
            logger.warning(
                "torchdi: AutoCompile captured the %s in %d graph(s) of %d operation(s) in all; graph "
                "breaks leave the rest to eager Python, and every call goes through dynamo. "
                "fullgraph=True names the graph breaks.",
                self.name,
                self.num_graphs,
                self.num_ops,
            )

    def _entry_runner(self) -> Any:
        """What the entry point calls as ``runner``: the inner runner with its float contexts
        restored and, where asked, its value marked."""
        inner = _with_floats_restored(self.inner, self.float_positions)
        return _marking_value(inner) if self.marks_value else inner

    def _seal_key(self, arguments: tuple[Any, Any, Any]) -> str:
        """The key of this preparation's seal: the program's key, the arguments' layouts as the
        entry point takes them, and the settings that choose what the entry point runs."""
        leaves, spec = pytree.tree_flatten(arguments)
        layouts = [
            tensor_layout(leaf) if isinstance(leaf, torch.Tensor) else [type(leaf).__qualname__, repr(leaf) if isinstance(leaf, (int, str, bool, type(None))) else None]
            for leaf in leaves
        ]
        autocast = sorted((device, str(dtype)) for device, dtype in self.autocast.items())
        return json.dumps([self.persist_key, str(spec), layouts, self.float_positions, self.marks_value, autocast])

    def _load_seal(self, store: Store, x: Any, tangents: Any, contexts: tuple[Any, ...]) -> bool:
        """Prepare from this preparation's seal, without dynamo, where one is stored and every
        check of it holds here (``engines/_sealed.py``); ``False``: prepare through dynamo."""
        if self.owns_buffers or self.persist_key is None:
            return False
        arguments = self._compiled_arguments(x, tangents, contexts)
        payload = store.get("sealed", self._seal_key(arguments))
        seal = loads(payload) if payload is not None else None
        if seal is None:
            return False
        programs = []
        for key in seal.get("programs", ()):
            program = load_program(store, key)
            if program is None:
                return False
            programs.append(program.run)
        try:
            sealed = Sealed(seal, self._entry_runner(), _frame(arguments), programs)
        except Exception as error:  # (Unsealable, or an entry this torchdi cannot read: through dynamo)
            logger.debug("torchdi cache: the seal of the %s does not hold here (%s)", self.name, error)
            return False
        self._sealed = sealed
        self.num_compilations = self.num_graphs = 1
        self.num_ops = int(seal.get("ops", 0))
        self.loaded_from_cache = True
        self.prepared = True
        return True

    def _write_seal(self, store: Store, compiler: AOTInductorCompiler) -> None:
        """Store this preparation's seal, where it compiled one graph of AOTInductor programs
        that were all persisted (``engines/_sealed.py`` says what else it takes)."""
        cache, arguments, recorder = self._cache, self._warm_arguments, self._recorder
        if cache is None or arguments is None or recorder is None or not cache.fast or len(cache.entries) != 1:
            return
        keys = compiler.keys
        if not keys or any(key is None for key in keys) or any(program != "aot_inductor" for program in compiler.programs):
            return
        transformed = cache.entries[0][1]
        try:
            seal = recorder.record(self._entry_holder[-1], transformed, [str(key) for key in keys], _frame(arguments), _spied_call(transformed, arguments))
        except Exception as error:  # Unsealable (what stops it), or a source that did not evaluate
            logger.debug("torchdi cache: the %s is not sealed (%s)", self.name, error)
            return
        seal["ops"] = self.num_ops
        store.put("sealed", self._seal_key(arguments), dumps(seal))

    def _call_sealed(self, sealed: Sealed, x: Any, tangents: Any, contexts: tuple[Any, ...]) -> tuple[bool, Any]:
        """The sealed program's result where every check holds (in this layout, else in the
        compiled one); else the seal is dropped and the call goes through dynamo (counted)."""
        if self.translate:
            contexts = translated(contexts)
        program = 1 if len(sealed.programs) > 1 and getattr(self.value_free, "on", False) else 0
        held, result = sealed({"x": x, "tangents": tangents, "contexts": contexts}, program)
        if held:
            return True, result
        dense = _contiguous((x, tangents, contexts))
        held, result = sealed(_frame(dense), program)
        if held:
            return True, result
        self._sealed, self._unseal_cause = None, sealed.failed
        return False, None

    def _through_dynamo(self, x: Any, tangents: Any, contexts: Any) -> Any:
        """Call through ``torch.compile``'s entry point (guards, recompilation if one fails)."""
        assert self._cache is not None  # made by warm_up, before the first call
        if self.owns_buffers and hasattr(torch.compiler, "cudagraph_mark_step_begin"):
            torch.compiler.cudagraph_mark_step_begin()
        forget_float_specializations()
        try:
            arguments = (x, tangents, contexts)
            return self._cache.call(self._compiled, arguments, _frame(arguments), _dynamo_settings())
        finally:
            forget_float_specializations()

    # -- calls ---------------------------------------------------------------------------------

    def _arguments(self, x: Any, tangents: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any, Any]:
        """What the compiled function takes: translated contexts, in owned buffers if any."""
        if self.translate:
            contexts = translated(contexts)
        if self.buffers is None:
            return x, tangents, contexts
        return copyto_(self.buffers, (x, tangents, contexts))

    def __call__(self, x: Any, tangents: Any, contexts: tuple[Any, ...]) -> Any:
        """Run the entry whose dynamo guards pass, else go through ``torch.compile``."""
        sealed = self._sealed
        if sealed is not None:
            held, result = self._call_sealed(sealed, x, tangents, contexts)
            if held:
                return result
            self._warm_up(x, tangents, contexts)  # (a compilation: counted and logged with the failed check)
        if self._compiled is None:
            if torch.compiler.is_compiling():
                # Nested in another compiled runner that dynamo traces now (the outer program of
                # SecondOrder(AutoCompile(), AutoCompile())): traced into that program, under its
                # guards, rather than compiled apart (dynamo cannot trace a compilation).
                return self.inner(x, tangents, contexts)
            # A runner nested in another one (finite differences over a compiled inner backend)
            # is not warmed up by preparation: it compiles on its first call.
            with torch.no_grad():
                self.warm_up(x, tangents, contexts)
        if self.translate or self.buffers is not None:
            x, tangents, contexts = self._arguments(x, tangents, contexts)
        cache = self._cache
        if cache is not None and cache.fast and not self.owns_buffers:
            transformed = cache.lookup({"x": x, "tangents": tangents, "contexts": contexts})
            if transformed is not None:
                return transformed(x, tangents, contexts)
            # Another memory layout of the same values: copy to the compiled one rather than
            # recompile per stride.
            dense = _contiguous((x, tangents, contexts))
            transformed = cache.lookup({"x": dense[0], "tangents": dense[1], "contexts": dense[2]})
            if transformed is not None:
                result = transformed(*dense)
                self._copy_back_states(contexts, dense[2])
                return result
        return self._finish(self._through_dynamo(x, tangents, contexts))

    def without_value(self) -> Any:
        """What the plain operator runs: this runner with the value-free copies of its graphs
        (its value is then a zero in place of ``f``'s), or ``None`` when it will have none. Asked
        before ``warm_up``: the copies are compiled at preparation, with the program."""
        if self._compiled is None and self.can_drop_value:
            self.marks_value = True
        return _ValueFree(self) if self.marks_value else None

    def _copy_back_states(self, given: tuple[Any, ...], ran_on: tuple[Any, ...]) -> None:
        """Write the updates f made to contiguous copies of State tensors into the caller's tensors
        (once per call, as eager training updates them)."""
        with torch.no_grad():
            for i in self.state_contexts:
                for mine, copy in zip(pytree.tree_leaves(given[i]), pytree.tree_leaves(ran_on[i])):
                    if isinstance(mine, torch.Tensor) and copy is not mine:
                        mine.copy_(copy)

    def _finish(self, result: Any) -> Any:
        if self.owns_buffers:
            return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, result)
        return result


def _frame(arguments: tuple[Any, Any, Any]) -> dict[str, Any]:
    """The entry point's arguments by name, as its frame (and so dynamo's guards) names them."""
    return dict(zip(("x", "tangents", "contexts"), arguments))


def _spied_call(transformed: Callable[..., Any], arguments: tuple[Any, Any, Any]) -> tuple[list[Any], list[Any], Any]:
    """One call of dynamo's transformed code, telling what its graph was called with and gave
    back: ``(arguments of the graph, its outputs, the entry point's result)``."""
    name = next(name for name in transformed.__code__.co_names if name.startswith("__compiled_fn"))
    scope = transformed.__globals__
    graph = scope[name]
    seen: dict[str, list[Any]] = {}

    def spy(*args: Any) -> Any:
        outputs = graph(*args)
        seen["args"], seen["outputs"] = list(args), list(outputs)
        return outputs

    scope[name] = spy
    try:
        result = transformed(*arguments)
    finally:
        scope[name] = graph
    return seen["args"], seen["outputs"], result


class _ValueFree:
    """``runner`` called with its value-free graphs (the counting compiler's second copies)."""

    def __init__(self, runner: CompiledRunner) -> None:
        self.runner = runner

    def __call__(self, x: Any, tangents: Any, contexts: tuple[Any, ...]) -> Any:
        mode = self.runner.value_free
        before = getattr(mode, "on", False)
        mode.on = True
        try:
            return self.runner(x, tangents, contexts)
        finally:
            mode.on = before


class _BuiltOnFirstUse:
    """A dynamo backend built when a graph first needs it: ``AOTInductorCompiler``'s inductor
    fallback, whose construction imports inductor's ``compile_fx`` (``real_zeros``), which a run
    that loads every program from the cache never calls (that import was about 0.6 s of a warm MLP
    first result's 2.2 s)."""

    def __init__(self, build: Callable[[], Any]) -> None:
        self._build = build
        self._built: Any = None

    def _backend(self) -> Any:
        if self._built is None:
            self._built = self._build()
        return self._built

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._backend()(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # (get_compiler_config, reset, ...: the backend's)
        if name.startswith("__"):  # (torch.compile asks for a __name__: not worth the build)
            raise AttributeError(name)
        return getattr(self._backend(), name)


def _autocast_state() -> dict[str, torch.dtype]:
    """The autocast regions active now, by device type (what a compiled program bakes in)."""
    return {
        device: torch.get_autocast_dtype(device)
        for device in ("cpu", "cuda", "xpu", "mps")
        if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)
    }


def _needs_translation(tree: Any) -> bool:
    return any(
        not isinstance(leaf, torch.Tensor) and to_device_tensor(leaf, None) is not leaf
        for leaf in pytree.tree_leaves(tree)
    )
