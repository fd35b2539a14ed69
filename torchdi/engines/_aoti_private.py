"""The fence of AOTInductor: a dynamo graph compiled into a standalone C++ program.

``AutoCompile(compiler="aot_inductor")`` hands each graph dynamo traces to ``AOTInductorCompiler``.
Dynamo still traces ``f`` and installs its guards, and torchdi still evaluates them on every call
(rule 7 holds as with ``compiler="inductor"``): only what runs once the guards pass changes.
Inductor's program is Python (AOTAutograd's runtime wrappers around inductor's generated ``call``,
which allocates and launches the kernels); AOTInductor's is C++ (``AOTIModelContainerRunnerCpu``),
called with the list of input tensors. Measured on the heat equation's compressed jacobian
(N=200, 3 colours, one thread, thread CPU time per call): 4.3 us against 13 us for inductor's
standalone program of the same graph; the whole prepared ``AutoSparse`` call is in the README.

The private internals, probed once on first use (torch 2.9 .. 2.14.1):
``torch._inductor.aot_compile`` (an FX graph to a shared library), ``torch._C._aoti.
AOTIModelContainerRunnerCpu`` (loads and runs it) and ``torch.fx.experimental.proxy_tensor.
make_fx`` (dynamo's graph to aten operators, as AOTInductor takes them). Fallback, where one is
missing or fails on a graph: that graph is compiled by inductor as ``compiler="inductor"``
compiles it (same results, the slower call).

``"stack_buffers"``: a program's small temporary buffers live on the C++ stack
(``aot_inductor.allow_stack_allocation``, inductor's own option; it keeps a program's
temporaries under 100 KB there and allocates the rest as before), which needs inductor's
``CppWrapperCpuArrayRef`` as the CPU wrapper: torch 2.9 and 2.13 choose the CPU wrapper once per
process, at inductor's first compilation (``torch._inductor.codegen.common.device_codegens``),
so it is set for the duration of each AOTInductor compilation (torch 2.14.1 chooses per
compilation itself). The prepared heat-equation jacobian: 22.4 -> 19.4 us a call, the Rosenbrock
hessian N=200 26.0 -> 21.8 us (one thread, thread CPU time). Fallback: the option stays off
(heap buffers; slower, the same results).

A graph is also left to inductor, for a reason named in one ``torchdi`` log line (INFO), when an
AOTInductor program of it could be wrong or cannot be made:

- an input requires grad while grad mode is on: the C++ program computes no autograd graph, so an
  outer derivative through it would be silently dropped (dynamo guards the grad mode and each
  input's ``requires_grad``: a call that changes either recompiles, and chooses again);
- an input is not a plain strided CPU tensor of static shape (a symbolic size with
  ``dynamic=True``, a subclass, a sparse or quantized tensor, another device);
- the graph holds tensors of its own (``get_attr``): AOTInductor copies them into the program, so a
  later in-place write to them would go unseen (dynamo makes the tensors ``f`` reads inputs of the
  graph, so this is rare);
- its aten graph writes in place into an input (a ``State`` context's update, a buffer's running
  statistics; a piece ``split`` made of one and an ``out=`` argument count) or draws random numbers
  (inductor's Python wrapper draws the seeds per call);
- its aten graph computes on the meta device or with a ZeroTensor (a kernel's internals, which
  make_fx records where a graph reaches torch's ZeroTensor fallback; forward mode's zero tangents are
  traced as plain zeros, so none is expected);
- its aten graph calls an operator outside aten's and prims' (``DataParallel``'s collectives, a
  user's custom operator): those run as inductor runs them;
- make_fx cannot retrace it (``math.exp`` of a float context: a data-dependent value);
- an output is not a tensor.

Persisted (``AutoCompile(compiler="aot_inductor", cache_dir=...)`` or ``TORCHDI_CACHE_DIR``): each
program's shared library is stored in torchdi's cache (``torchdi.cache``), keyed by what makes it:
dynamo's graph (its code and its subgraphs' code), its inputs' layouts, the global state dynamo's
graph does not spell out (default dtype, grad mode, autocast, deterministic algorithms), inductor's options,
torch's version (the store adds torchdi's) and the processor: the library is machine code built with
``-march=native`` for this one, which another (a shared cache directory, an image built elsewhere) may
lack the instructions of: it would die of an illegal instruction, which no ``try`` catches. Dynamo still traces ``f`` in every process and
installs its guards, so a changed global, closure cell or helper function changes the graph or
fails a guard, and finds another entry or compiles: a loaded program is never stale. A hit skips
``make_fx`` and AOTInductor's compilation (seconds) for loading the library (about a millisecond).
A preparation whose programs are all stored may also be *sealed* (``engines/_sealed.py``): then a
later one loads them with ``load_program`` without tracing (and without importing dynamo or
inductor), under the seal's own checks of dynamo's guards.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import operator
import os
import platform
import tempfile
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from torchdi._fence import REAL_ZEROS, Fence, probed_once
from torchdi._fence import UNPROBED as _UNPROBED
from torchdi._fence import probe as _probe

__all__ = ["FAST_PATHS", "AOTInductorCompiler", "fence", "load_program"]

logger = logging.getLogger("torchdi")

FAST_PATHS = {
    "aot_inductor": "torch._inductor.aot_compile, torch._C._aoti.AOTIModelContainerRunnerCpu and make_fx, which "
    "compile a graph into a C++ program called without Python wrappers (AutoCompile(compiler=\"aot_inductor\"))",
    "stack_buffers": "inductor's CPU wrapper registry, to keep an AOTInductor program's small temporaries on the stack",
}
fence = Fence(FAST_PATHS, {"aot_inductor": "inductor's Python program of the same graph (same results, slower calls)"})


# The kind of torchdi.cache entry holding an AOTInductor program's shared library.
_KIND = "aot_inductor"


_Api = tuple[Callable[..., Any], Callable[..., Any], type, Callable[[Any], Any]]


class Store(Protocol):
    """What the compiler asks of its store (``torchdi.cache.Store``, handed in by the engine: a
    fence imports only torch and ``torchdi._fence``)."""

    def get(self, kind: str, key: str) -> bytes | None: ...

    def put(self, kind: str, key: str, payload: bytes) -> bool: ...


def _aoti_api() -> _Api:
    import torch._guards
    import torch._inductor
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx, torch._inductor.aot_compile, torch._C._aoti.AOTIModelContainerRunnerCpu, torch._guards.tracing


# torch 2.9 .. 2.14.1 (probed on first use: it imports inductor). torch._guards.tracing(None)
# steps out of dynamo's tracing context for make_fx and AOTInductor, which would otherwise take
# dynamo's fake-tensor mode (and its shape environment) as their own: make_fx then made dropout's
# sizes symbolic, and inductor's compilation of the same graph failed after it.
_AOTI_API: _Api | None = _UNPROBED


def _api() -> _Api | None:
    return probed_once(globals(), "_AOTI_API", _aoti_api)


# torch 2.9 .. 2.14.1: the C++ loader alone (torch._C: no inductor import), for programs loaded
# from the store by a sealed preparation (engines/_sealed.py), which compiles nothing.
_RUNNER_TYPE: type | None = _probe(lambda: torch._C._aoti.AOTIModelContainerRunnerCpu)


def load_program(store: Store | None, key: str | None, runner_type: type | None = None) -> Any:
    """The persisted AOTInductor program of ``key`` loaded (an ``AOTIModelContainerRunnerCpu``),
    or ``None`` (none stored, this torch lacks the loader, or the library does not load here)."""
    runner_type = runner_type or _RUNNER_TYPE
    payload = store.get(_KIND, key) if store is not None and key is not None and runner_type is not None else None
    if payload is None or runner_type is None:
        return None
    try:
        with tempfile.TemporaryDirectory(prefix="torchdi-aoti-") as directory:
            library = os.path.join(directory, "program.so")
            with open(library, "wb") as file:
                file.write(payload)
            return runner_type(library, 1)  # (loaded before the directory goes: the mapping outlives the file)
    except Exception as error:  # a library this process cannot load: compiled again
        logger.debug("torchdi cache: the persisted AOTInductor program %s did not load (%s)", str(key)[:16], error)
        return None


_STACK_ALLOCATION = "aot_inductor.allow_stack_allocation"


def _cpu_wrappers() -> tuple[Any, type, type]:
    from torch._inductor.codegen import common
    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu
    from torch._inductor.codegen.cpp_wrapper_cpu_array_ref import CppWrapperCpuArrayRef

    common.init_backend_registration()
    entry = common.device_codegens["cpu"]
    if not hasattr(entry, "cpp_wrapper_codegen"):
        raise AttributeError("DeviceCodegen.cpp_wrapper_codegen")
    return entry, CppWrapperCpu, CppWrapperCpuArrayRef


# torch 2.9 .. 2.14.1 (probed on first use, after _api: it imports inductor).
_CPU_WRAPPERS: tuple[Any, type, type] | None = _UNPROBED


def _cpu_wrapper_entry() -> tuple[Any, type, type] | None:
    """Inductor's CPU entry of its wrapper registry and its plain and array-ref C++ wrappers, or
    ``None`` (this torch lacks them, or someone registered a CPU wrapper of their own)."""
    found = probed_once(globals(), "_CPU_WRAPPERS", _cpu_wrappers)
    if found is None:
        fence.warn_off("stack_buffers")
        return None
    entry, plain, array_ref = found
    return found if entry.cpp_wrapper_codegen in (plain, array_ref) else None


@contextlib.contextmanager
def _array_ref_wrapper(wanted: bool) -> Iterator[bool]:
    """With ``wanted``, inductor's array-ref CPU wrapper for the compilation in the block, where
    the process registered the plain one ("stack_buffers"). Yields whether the compilation may
    keep ``allow_stack_allocation`` as asked (``False``: this torch lacks the registry, or the
    process registered a CPU wrapper of its own)."""
    if not wanted:
        yield True
        return
    found = _cpu_wrapper_entry()
    if found is None:
        yield False
        return
    entry, plain, array_ref = found
    if entry.cpp_wrapper_codegen is array_ref:
        yield True
        return
    entry.cpp_wrapper_codegen = array_ref
    try:
        yield True
    finally:
        entry.cpp_wrapper_codegen = plain


@contextlib.contextmanager
def _state_restored() -> Iterator[None]:
    """Restores what retracing dynamo's graph changes when it fails midway, as dynamo does around
    its own frames: the graph's code enters functorch's transforms, grad mode and dispatch keys with
    plain calls, not ``with`` blocks. Left behind (``math.exp`` of a float context, which make_fx
    cannot retrace, inside ``torch.func.grad``), they broke the fallback's compilation of the same
    graph: "Cannot access storage of TensorWrapper", where ``compiler="inductor"`` compiles it."""
    depth = torch._C._functorch.get_dynamic_layer_stack_depth()
    grad = torch.is_grad_enabled()
    keys = (torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set())
    with torch._C._ForceDispatchKeyGuard(*keys):
        try:
            yield
        finally:
            torch._C._functorch.pop_dynamic_layer_stack_and_undo_to_depth(depth)
            torch.set_grad_enabled(grad)


def _plain_cpu_tensor(value: Any) -> bool:
    return (
        type(value) in (torch.Tensor, torch.nn.Parameter)
        and value.layout == torch.strided
        and value.device.type == "cpu"
        and not value.is_quantized
        and all(isinstance(size, int) for size in value.shape)
    )


def _unsuitable_graph(graph: torch.fx.GraphModule, example_inputs: list[Any]) -> str | None:
    """Why dynamo's ``graph`` must not become an AOTInductor program (``None``: it may)."""
    for value in example_inputs:
        if not isinstance(value, torch.Tensor):
            return f"an input is a {type(value).__name__}, not a tensor (a symbolic size?)"
        if not _plain_cpu_tensor(value):
            return f"an input is not a plain strided CPU tensor of static shape ({type(value).__name__} on {value.device})"
        if value.requires_grad and torch.is_grad_enabled():
            return "an input requires grad under grad mode (the C++ program records no autograd graph)"
    for node in graph.graph.nodes:
        if node.op == "get_attr" and isinstance(getattr(graph, str(node.target), None), torch.Tensor):
            return f"the graph holds a tensor of its own ({node.target}), which AOTInductor would copy"
    output = next(node for node in graph.graph.nodes if node.op == "output")
    if not all(isinstance(item, torch.fx.Node) for item in torch.utils._pytree.tree_leaves(output.args[0])):
        return "an output of the graph is not a tensor"
    return None


def _storage(node: Any) -> int | None:
    """The (fake) storage of the tensor ``node`` computes in a traced graph (its address), or ``None``."""
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return value.untyped_storage()._cdata if isinstance(value, torch.Tensor) else None


# The operators an AOTInductor program may call: aten's and prims' (torchdi's own value marker is
# gone by then: the counting compiler takes it out of the graph).
_PROGRAM_NAMESPACES = frozenset({"aten", "prims"})


def _unsuitable_aten_graph(graph: torch.fx.GraphModule) -> str | None:
    """Why the aten graph ``graph`` must not become an AOTInductor program (``None``: it may).

    In-place writes into the graph's own intermediates are fine (jacrev fills its basis in place);
    a write into an input's memory (the input, a view of it, a piece ``split`` or ``unbind`` made,
    an ``out=`` argument) is refused. Told by the fake storages make_fx records, which views and
    pieces share with their base: the operators' alias annotations stop at a list of pieces."""
    inputs = {node for node in graph.graph.nodes if node.op == "placeholder"}  # and the views of them
    storages = {storage for storage in map(_storage, inputs) if storage is not None}
    for node in graph.graph.nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and (value.device.type == "meta" or value._is_zerotensor()):
            return f"it computes on the meta device or with a ZeroTensor ({node.target}): a kernel's internals, not a program"
        target = node.target
        if node.op != "call_function" or getattr(target, "__module__", None) == operator.mul.__module__:
            continue  # (getitem, and the arithmetic of sizes)
        if not isinstance(target, torch._ops.OpOverload):
            return f"it calls {target}, not an aten operator"
        if target.namespace not in _PROGRAM_NAMESPACES:
            # Collectives (DataParallel's all-reduce), a user's custom operators: run as inductor runs them.
            return f"it calls {target}, outside aten's and prims' operators"
        if torch.Tag.nondeterministic_seeded in target.tags:
            return f"it draws random numbers ({target})"
        for i, argument in enumerate(target._schema.arguments):
            alias = argument.alias_info
            value = node.args[i] if i < len(node.args) and not argument.kwarg_only else node.kwargs.get(argument.name)
            if alias is None or value is None:
                continue
            written = [item for item in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(item, torch.fx.Node)]
            if not any(item in inputs or _storage(item) in storages for item in written):
                continue
            if alias.is_write:
                return f"it writes in place into an input ({target})"
            inputs.add(node)  # a view of an input
    return None


# The namespaces of operators whose code is torch's (or torchdi's, whose sources key every entry).
_OWN_NAMESPACES = frozenset({"aten", "prims", "torchdi"})


def _attribute(module: torch.nn.Module, path: str) -> Any:
    value: Any = module
    for name in path.split("."):
        value = getattr(value, name, None)
    return value


def _persistable(graph: torch.fx.GraphModule) -> bool:
    """Whether ``graph``'s code names everything its program does: it calls only torch's (and
    torchdi's) functions and operators. A user's custom operator or function called by name could
    change between processes under the same code, so such a graph is compiled, not persisted."""
    for module in graph.modules():
        if not isinstance(module, torch.fx.GraphModule):
            return False
        for node in module.graph.nodes:
            if node.op in ("call_module", "get_attr") and not isinstance(_attribute(module, str(node.target)), torch.fx.GraphModule):
                return False  # a value the graph's code does not spell out
            if node.op != "call_function":
                continue
            target = node.target
            if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
                if target.namespace not in _OWN_NAMESPACES:
                    return False
            elif str(getattr(target, "__module__", None) or "").split(".")[0] not in ("torch", "_operator", "math", "builtins"):
                return False
    return True


@functools.cache
def processor() -> str:
    """What this machine's compiled programs are built for (``-march=native``, inductor's vector
    instruction set): the architecture, torch's CPU capability and, where ``/proc/cpuinfo`` says,
    the first processor's model and feature flags. A shared cache then serves a program only to a
    processor like the one that built it (another model with the same flags misses: compiled again)."""
    described = [platform.machine(), platform.processor(), torch.backends.cpu.get_cpu_capability()]
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as file:
            for line in file:
                if not line.strip():
                    break  # the first processor's block
                name = line.split(":", 1)[0].strip()
                if name in ("vendor_id", "model name", "flags", "Features", "CPU implementer", "CPU part", "isa", "cpu"):
                    described.append(line.strip())
    except OSError:  # not Linux: the architecture and torch's capability above
        pass
    return "\n".join(described)


def program_key(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor], options: dict[str, Any]) -> str:
    """The key of the AOTInductor program of dynamo's ``graph`` for these inputs: everything the
    program depends on (see the module docstring)."""
    digest = hashlib.sha256(torch.__version__.encode())
    digest.update(processor().encode())
    for name, module in sorted(graph.named_modules(), key=lambda item: item[0]):
        if isinstance(module, torch.fx.GraphModule):
            digest.update(f"{name}\n{module.code}".encode())
    for value in example_inputs:
        digest.update(repr((tuple(value.shape), value.stride(), value.storage_offset(), value.dtype, str(value.device))).encode())
    autocast = [(device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)) for device in ("cpu", "cuda")]
    state = (
        torch.get_default_dtype(), torch.is_grad_enabled(), autocast, torch.are_deterministic_algorithms_enabled(), sorted(options.items(), key=repr)
    )
    digest.update(repr(state).encode())
    return digest.hexdigest()


class AOTInductorCompiler:
    """A dynamo backend compiling each graph into an AOTInductor program, run from C++.

    Args:
        fallback: the dynamo backend that compiles a graph AOTInductor must not or cannot (inductor's).
        options: inductor's config patches (``AutoCompile(options=...)``), applied to both.
        store: where programs persist (``None``: nowhere).

    Attributes:
        programs: per graph compiled, ``"aot_inductor"`` or why it went to the fallback (in order).
        loaded: per AOTInductor program, whether it was loaded from ``store`` (in order).
        keys: per graph compiled, its program's key in ``store`` (``None``: not persisted, or
            left to the fallback), for a seal (``engines/_sealed.py``).
        made: weak references to the programs (dynamo's cache entries hold them; a dropped
            preparation frees them, rule 9).
    """

    compiler_name = "aot_inductor"

    def __init__(self, fallback: Any, options: dict[str, Any] | None, store: Store | None = None) -> None:
        self.fallback = fallback
        self.options = dict(options or {})
        self.store = store
        self.programs: list[str] = []
        self.loaded: list[bool] = []
        self.keys: list[str | None] = []
        self.made: list[weakref.ref[Callable[..., Any]]] = []

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        api = _api()
        if api is None:
            fence.warn_off("aot_inductor")
            return self._fall_back("this torch lacks AOTInductor's internals", graph, example_inputs)
        reason = _unsuitable_graph(graph, example_inputs)
        if reason is not None:
            return self._fall_back(reason, graph, example_inputs)
        make_fx, aot_compile, runner_type, tracing = api
        options = self._program_options()
        key = program_key(graph, example_inputs, options) if self.store is not None and _persistable(graph) else None
        runner = load_program(self.store, key, runner_type)
        loaded = runner is not None
        if runner is None:
            try:
                with tracing(None), _state_restored():
                    aten = make_fx(graph, decomposition_table=REAL_ZEROS, tracing_mode="fake")(*example_inputs)
            except Exception as error:  # a graph make_fx cannot retrace: inductor compiles it as always
                return self._fall_back(f"make_fx failed on it ({type(error).__name__}: {error})", graph, example_inputs)
            reason = _unsuitable_aten_graph(aten)
            if reason is not None:
                return self._fall_back(reason, graph, example_inputs)
            try:
                with tempfile.TemporaryDirectory(prefix="torchdi-aoti-") as directory, tracing(None), warnings.catch_warnings(), _array_ref_wrapper(options.get(_STACK_ALLOCATION) is True) as as_asked:
                    # torch 2.13's own deprecation, raised while AOTInductor pickles its pytree specs.
                    warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
                    if not as_asked:  # built with heap buffers: not stored under the key that says otherwise
                        options, key = {**options, _STACK_ALLOCATION: False}, None
                    files = aot_compile(
                        aten,
                        tuple(example_inputs),
                        options={**options, "aot_inductor.package": True, "aot_inductor.output_path": directory},
                    )
                    library = next(str(name) for name in files if str(name).endswith(".so"))
                    # Loaded before the directory goes: the loader maps the library, which outlives its file.
                    runner = runner_type(library, 1)
                    if key is not None and self.store is not None:
                        with open(library, "rb") as file:
                            self.store.put(_KIND, key, file.read())
            except Exception as error:  # AOTInductor's own failure on this graph
                return self._fall_back(f"AOTInductor failed on it ({type(error).__name__}: {error})", graph, example_inputs)
        self.programs.append("aot_inductor")
        self.loaded.append(loaded)
        self.keys.append(key)
        run = runner.run  # (the bound method keeps the runner, and so the loaded library, alive)

        def aot_inductor_program(*args: torch.Tensor) -> list[torch.Tensor]:
            return run(list(args))

        self.made.append(weakref.ref(aot_inductor_program))
        return aot_inductor_program

    def _program_options(self) -> dict[str, Any]:
        """Inductor's options for AOTInductor: the user's, over small temporaries on the stack
        ("stack_buffers"). Asked without looking at inductor's wrappers, whose import a load of a
        persisted program (which compiles nothing) need not pay; a compilation that cannot have
        the stack builds without it and stores nothing (``_array_ref_wrapper``)."""
        if _STACK_ALLOCATION in self.options:
            return self.options
        return {_STACK_ALLOCATION: True, **self.options}

    def _fall_back(self, reason: str, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.programs.append(reason)
        self.keys.append(None)
        logger.info("torchdi: AutoCompile(compiler=\"aot_inductor\") leaves a graph to inductor: %s", reason)
        return self.fallback(graph, example_inputs)

    def __getattr__(self, name: str) -> Any:  # get_compiler_config, reset, ...: the fallback's
        return getattr(self.fallback, name)

