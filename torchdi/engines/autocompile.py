"""``AutoCompile``: the inner backend's runner, compiled once with ``torch.compile`` at preparation.

The compiled runner itself (tracing rule, soundness, rule 2/7/9) is ``engines/_compiled.py``,
shared with the other engines that compile.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torchdi.backends import AutoCompile
from torchdi.composition import refuse_compiled_double_backward
from torchdi.engines._compiled import CompiledRunner, compiled_store, program_key, traced_view
from torchdi.engines.base import ALL_FAMILIES
from torchdi.runners import build_runner, register_engine

__all__ = ["CompileEngine"]


class CompileEngine:
    """Builds the inner backend's runner and compiles it."""

    native: ClassVar[frozenset[str]] = ALL_FAMILIES
    keeps_static: ClassVar[bool] = True

    def __init__(self, backend: AutoCompile) -> None:
        self.backend = backend

    def build(self, family: str, f: Any, spec: Any) -> Any:
        refuse_compiled_double_backward(self.backend, family, spec)
        inner = build_runner(self.backend.inner, family, f, spec)
        # A prepared gradient also serves the plain gradient, which drops the value: asked for
        # (without_value) before it compiles, the runner marks its value so that a value-free copy
        # of the traced program is compiled beside it. Only in one graph (fullgraph=True): with
        # graph breaks the mark could end up in a graph of its own, compiled for nothing.
        can_drop_value = family == "gradient" and spec.needs_value and not spec.has_aux and self.backend.fullgraph
        runner = CompiledRunner(inner, self.backend, family, getattr(f, "function_name", repr(f)), spec.state_contexts, can_drop_value)
        if compiled_store(self.backend) is not None:  # persisted preparations (torchdi.cache)
            runner.persist_key = program_key(family, f, spec, self.backend)
        return runner

    @staticmethod
    def contexts_seen_by_f(values: tuple[Any, ...]) -> tuple[Any, ...]:
        """What ``f`` receives as contexts inside the compiled program (for preparation's own call)."""
        return traced_view(values)


register_engine(AutoCompile, CompileEngine)
