"""``AutoCompile``: the inner backend's runner, compiled once with ``torch.compile`` at preparation.

What is traced follows one rule: every leaf of ``x``, of the tangents and of the contexts goes
through ``to_device_tensor``; what comes out as a tensor is a graph input (its value may change
without recompiling), anything else is static and baked in (dynamo guards on it, and the strict
check compares it by equality). Contexts are arguments of the compiled function, never closed
over, so a new float or tensor value never triggers a recompilation.

``num_compilations`` counts the graphs the compiler backend is actually asked to compile for
this preparation: the compiler is wrapped per runner, so the count is exact and not shared with
any other code.
"""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch.utils import _pytree as pytree

from torchdi.backends import AutoCompile
from torchdi.engines.base import ALL_FAMILIES
from torchdi.prep import _IMMUTABLE_STATIC
from torchdi.translate import copyto_, to_device_tensor, translate_contexts

__all__ = ["CompileEngine", "CompiledRunner"]

logger = logging.getLogger("torchdi")


class _CountingCompiler:
    """A ``torch.compile`` backend that counts what it is asked to compile, then delegates."""

    def __init__(self, owner: CompiledRunner, backend: AutoCompile) -> None:
        self.owner = owner
        if backend.compiler == "inductor":
            self.compiler: Any = torch._TorchCompileInductorWrapper(
                backend.mode, dict(backend.options) if backend.options else None, backend.dynamic
            )
        else:
            self.compiler = torch._TorchCompileWrapper(
                backend.compiler, backend.mode, dict(backend.options) if backend.options else None, backend.dynamic
            )
        self.compiler_name = getattr(self.compiler, "compiler_name", backend.compiler)

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        # Counted once compiled: dynamo may abandon an attempt midway (RestartAnalysis) and trace again.
        compiled = self.compiler(graph, example_inputs)
        self.owner.num_compilations += 1
        if not self.owner.prepared:  # only the preparation's graph may be called directly
            self.owner.captured = (_placeholder_sources(graph), compiled)
        if self.owner.prepared:
            logger.warning(
                "torchdi: AutoCompile recompiled %s after preparation (compilation %d): a static "
                "argument (int, bool, str or object) or the grad mode changed. Prepare again for the "
                "new value, or make it a traced value (a float or tensor, see to_device_tensor).",
                self.owner.name,
                self.owner.num_compilations,
            )
        return compiled

    def __getattr__(self, name: str) -> Any:  # get_compiler_config, reset, ...: the real compiler's
        return getattr(self.compiler, name)


def _fresh_entry_point(runner: Any) -> Any:
    """``runner`` behind a function with a code object of its own.

    Dynamo keeps compiled entries per code object: runners built from the same engine code
    would otherwise share one cache, and each new preparation would count against the others'
    recompile limit (and evict them once it is hit).
    """
    global _entry_points
    _entry_points += 1
    name = f"torchdi_runner_{_entry_points}"
    # A unique file name too: dynamo's automatic-dynamic and profile state is keyed by
    # (file, line, name), and must not leak from one preparation to another.
    source = f"def {name}(x, tangents, contexts):\n    return runner(x, tangents, contexts)\n"
    namespace = {"runner": runner}
    exec(compile(source, f"<{name}>", "exec"), namespace)  # fixed source, nothing user-provided
    return namespace[name]


_entry_points = 0


def _placeholder_sources(graph: torch.fx.GraphModule) -> list[str] | None:
    """Where dynamo reads each graph input from, as Python expressions over the frame's locals."""
    sources = []
    for node in graph.graph.nodes:
        if node.op == "placeholder":
            graph_arg = node.meta.get("grapharg")
            if graph_arg is None or getattr(graph_arg, "source", None) is None:
                return None
            name = graph_arg.source.name
            sources.append(name() if callable(name) else name)  # a method before torch 2.10
    return sources


# Graph inputs the direct call may read: items of the runner's own arguments, nothing else
# (no globals, closure cells or object attributes, which only dynamo's guards watch).
_ARGUMENT_SOURCE = re.compile(r"L\['(x|tangents|contexts)'\](\[(\d+|'[^'\\]*')\])*")


@dataclass(frozen=True)
class _DirectCall:
    """The compiled graph with the inputs it reads and the structure of what it returns."""

    compiled: Any
    inputs: Any
    output_spec: pytree.TreeSpec
    rebuild: Any  # tree_unflatten for output_spec
    n_leaves: int
    slots: tuple[int, ...]  # positions of the graph's outputs among the result's leaves (others: None)
    global_state: Any

    def result(self, outputs: Any) -> Any:
        if len(self.slots) == self.n_leaves:
            return self.rebuild(outputs)
        leaves: list[Any] = [None] * self.n_leaves
        for slot, output in zip(self.slots, outputs):
            leaves[slot] = output
        return self.rebuild(leaves)



def _rebuilder(spec: pytree.TreeSpec) -> Any:
    """``tree_unflatten(leaves, spec)`` as a flat function (a few us less per call)."""
    counter = iter(range(spec.num_leaves))

    def expression(node: pytree.TreeSpec) -> str | None:
        if node.is_leaf():
            return f"leaves[{next(counter)}]"
        children = node.children() if hasattr(node, "children") else node.children_specs
        parts = [expression(child) for child in children]
        if any(part is None for part in parts):
            return None
        if node.type is tuple:
            return "(" + "".join(f"{part}, " for part in parts) + ")"
        if node.type is list:
            return "[" + ", ".join(parts) + "]"  # type: ignore[arg-type]
        if node.type is dict and all(isinstance(key, str) for key in node.context):
            return "{" + ", ".join(f"{key!r}: {part}" for key, part in zip(node.context, parts)) + "}"
        return None

    body = expression(spec)
    if body is None:
        return functools.partial(_unflatten, spec=spec)
    return eval(f"lambda leaves: {body}", {})  # built from the spec's structure only


def _unflatten(leaves: Any, spec: pytree.TreeSpec) -> Any:
    return pytree.tree_unflatten(leaves, spec)


def _direct_call(
    captured: tuple[list[str] | None, Any], result: Any, x: Any, tangents: Any, contexts: tuple[Any, ...]
) -> _DirectCall | None:
    """A ``_DirectCall`` when calling the compiled graph without dynamo is sound, else ``None``.

    Sound when every graph input is a tensor item of ``(x, tangents, contexts)`` (the strict
    check then guarantees their types, shapes, dtypes and devices), no tensor is passed twice
    (dynamo would have merged the two inputs), every static leaf is an immutable value (the
    strict check compares it by equality, while a mutable object such as a module may change
    attributes that dynamo guards on), and the graph returns exactly the result's tensors.
    """
    sources, compiled = captured
    if sources is None or not all(_ARGUMENT_SOURCE.fullmatch(source) for source in sources):
        return None
    leaves = pytree.tree_leaves((x, tangents, contexts))
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    if len({id(t) for t in tensors}) != len(tensors):
        return None
    if not all(isinstance(leaf, (torch.Tensor, *_IMMUTABLE_STATIC)) for leaf in leaves):
        return None
    # The graph returns the result's tensors; a runner's None (a value it was told to skip) is
    # a constant of the output structure.
    all_leaves, output_spec = pytree.tree_flatten(result)
    if not all(isinstance(leaf, torch.Tensor) or leaf is None for leaf in all_leaves):
        return None
    slots = tuple(i for i, leaf in enumerate(all_leaves) if leaf is not None)
    result_leaves = [all_leaves[i] for i in slots]
    body = ", ".join(source.replace("L['x']", "x").replace("L['tangents']", "tangents").replace("L['contexts']", "contexts") for source in sources)
    inputs = eval(f"lambda x, tangents, contexts: ({body}{',' if sources else ''})", {})  # validated above
    try:
        outputs = compiled(*inputs(x, tangents, contexts))
    except Exception:
        return None
    if not isinstance(outputs, (list, tuple)) or len(outputs) != len(result_leaves):
        return None
    for got, want in zip(outputs, result_leaves):
        if not isinstance(got, torch.Tensor) or got.dtype != want.dtype or not torch.equal(got, want):
            return None
    return _DirectCall(
        compiled, inputs, output_spec, _rebuilder(output_spec), len(all_leaves), slots, torch._C._dynamo.guards.GlobalStateGuard()
    )


def _needs_translation(tree: Any) -> bool:
    return any(
        not isinstance(leaf, torch.Tensor) and to_device_tensor(leaf, None) is not leaf
        for leaf in pytree.tree_leaves(tree)
    )


class CompiledRunner:
    """A runner compiled with ``torch.compile``; compilation happens in ``warm_up`` (preparation).

    Attributes:
        num_compilations: graphs compiled for this runner so far.
        name: the user's function, for messages.
    """

    def __init__(self, runner: Any, backend: AutoCompile, family: str, function_name: str) -> None:
        self.num_compilations = 0
        self.prepared = False
        self.name = f"{family} of {function_name}"
        self.backend = backend
        self.translate_contexts = True
        self.captured: tuple[list[str] | None, Any] | None = None
        self.direct: _DirectCall | None = None
        # CUDA graphs replay on fixed addresses: with mode="reduce-overhead" the runner owns
        # static input buffers, filled in place each call, and clones the outputs it returns
        # (a later replay overwrites them).
        self.owns_buffers = backend.mode == "reduce-overhead"
        self.buffers: tuple[Any, Any, Any] | None = None
        self._compiled = torch.compile(
            _fresh_entry_point(runner),
            backend=_CountingCompiler(self, backend),
            fullgraph=backend.fullgraph,
            # A preparation fixes shapes: by default (None) specialize them rather than let
            # dynamo turn a changed size or int into a symbol after a strict=False call.
            dynamic=False if backend.dynamic is None else backend.dynamic,
        )

    def warm_up(self, x: Any, tangents: Any, contexts: tuple[Any, ...]) -> None:
        """Compile for these arguments' signatures (called once by ``prepare_*``)."""
        self.translate_contexts = _needs_translation(contexts)
        if self.owns_buffers:
            translated = translate_contexts(contexts, None, x) if self.translate_contexts else contexts
            self.buffers = pytree.tree_map(
                lambda leaf: leaf.clone() if isinstance(leaf, torch.Tensor) else leaf, (x, tangents, translated)
            )
        try:
            result = self(x, tangents, contexts)
        except torch._dynamo.exc.Unsupported as error:
            reason = str(error).strip().splitlines()
            raise RuntimeError(
                f"AutoCompile(fullgraph={self.backend.fullgraph}): torch.compile cannot capture the "
                f"{self.name} in one graph. Graph break: {' '.join(reason[:6])}\n"
                "Remove the graph break from the function, or use AutoCompile(fullgraph=False)."
            ) from error
        self.prepared = True
        captured, self.captured = self.captured, None
        if self.num_compilations == 1 and captured is not None:
            self.direct = _direct_call(captured, result, *self._arguments(x, tangents, contexts))

    def _arguments(self, x: Any, tangents: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any, Any]:
        """What the compiled function takes: translated contexts, in owned buffers if any."""
        if self.translate_contexts:
            contexts = translate_contexts(contexts, None, x)
        if self.buffers is None:
            return x, tangents, contexts
        return copyto_(self.buffers, (x, tangents, contexts))

    def _finish(self, result: Any) -> Any:
        if self.owns_buffers:
            return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, result)
        return result

    def __call__(self, x: Any, tangents: Any, contexts: tuple[Any, ...]) -> Any:
        """Run through ``torch.compile``'s entry point: dynamo evaluates its guards first."""
        if self.owns_buffers and hasattr(torch.compiler, "cudagraph_mark_step_begin"):
            torch.compiler.cudagraph_mark_step_begin()
        return self._finish(self._compiled(*self._arguments(x, tangents, contexts)))

    def checked_call(self, x: Any, tangents: Any, contexts: tuple[Any, ...]) -> Any:
        """Run a call whose strict check has passed: the compiled graph directly when sound.

        The strict check already guarantees what dynamo's guards would check of the arguments
        (structure, types, shapes, dtypes, devices, static values); the global state (grad
        mode, autocast, default dtype, ...) is checked here. Strides are not in the signature:
        inductor's compiled code asserts them and a mismatch goes through dynamo instead.
        """
        direct = self.direct
        if direct is None or self.owns_buffers or not direct.global_state.check():
            return self(x, tangents, contexts)
        arguments = self._arguments(x, tangents, contexts)
        try:
            outputs = direct.compiled(*direct.inputs(*arguments))
        except AssertionError:  # inductor's size/stride assertion on an input
            return self._compiled(*arguments)
        return direct.result(outputs)


class CompileEngine:
    """Builds the inner backend's runner and compiles it."""

    native: ClassVar[frozenset[str]] = ALL_FAMILIES
    keeps_static: ClassVar[bool] = True

    def __init__(self, backend: AutoCompile) -> None:
        self.backend = backend

    def build(self, family: str, f: Any, spec: Any) -> Any:
        from torchdi.runners import build_runner

        inner = build_runner(self.backend.inner, family, f, spec)
        return CompiledRunner(inner, self.backend, family, getattr(f, "function_name", repr(f)))
