"""``DataParallel``: the wrapped backend's gradient, reduced across processes.

The runner fixes ``x``'s layout at preparation (``distributed.Layout``: replicated plain
tensors, or FSDP2 DTensors sharded on dim 0). Each call takes the local tensors (the shards),
gathers them whole, runs the wrapped backend's gradient on them with FSDP2's hooks kept out,
then reduces value and gradient (all-reduce, or reduce-scatter back to the shards) and wraps
sharded gradients as DTensors again. On ``AutoCompile`` the gather, the gradient and the
reduction are one compiled program (functional collectives are traceable); on eager backends
the same functions run eagerly.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torchdi.backends import AutoCompile, DataParallel
from torchdi.distributed import Layout, reduced_gradient, require_process_group, running_gathered
from torchdi.engines._compiled import CompiledRunner
from torchdi.errors import UnsupportedOperatorError
from torchdi.runners import Spec, build_runner, engine_for, register_engine

__all__ = ["DataParallelEngine", "DataParallelRunner"]


class DataParallelRunner:
    """A gradient runner whose results are reduced across processes (see the module docstring)."""

    def __init__(self, backend: DataParallel, f: Any, spec: Spec) -> None:
        self.backend = backend
        self.f = f
        self.spec = spec
        self.layout: Layout | None = None
        self.inner: Any = None

    @property
    def num_compilations(self) -> int:
        return int(getattr(self.inner, "num_compilations", 0))

    def warm_up(self, x: Any, tangents: Any, contexts: tuple[Any, ...]) -> None:
        """Fix ``x``'s layout and build (and on ``AutoCompile`` compile) the reduced gradient."""
        who = repr(self.backend)
        self.layout = Layout.of(x, self.backend.group, who)
        wrapped = self.backend.backend
        eager = wrapped.inner if isinstance(wrapped, AutoCompile) else wrapped
        body = reduced_gradient(self.layout, build_runner(eager, "gradient", self.f, self.spec), self.backend.op)
        if isinstance(wrapped, AutoCompile):
            compiled = CompiledRunner(body, wrapped, "gradient", getattr(self.f, "function_name", repr(self.f)))
            with running_gathered(contexts):
                compiled.warm_up(self.layout.lower(x, who), tangents, contexts)
            self.inner = compiled
        else:
            self.inner = body

    def __call__(self, x: Any, tangents: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any]:
        if self.layout is None:
            self.warm_up(x, tangents, contexts)
        assert self.layout is not None
        local = self.layout.lower(x, repr(self.backend))
        with running_gathered(contexts):
            value, grads = self.inner(local, tangents, contexts)
        return value, self.layout.lift(grads)


class DataParallelEngine:
    """Builds ``DataParallelRunner``s (gradient only)."""

    native: ClassVar[frozenset[str]] = frozenset({"gradient"})

    def __init__(self, backend: DataParallel) -> None:
        self.backend = backend
        self.wrapped = engine_for(backend.backend)

    @property
    def keeps_static(self) -> bool:
        return bool(self.wrapped.keeps_static)

    def contexts_seen_by_f(self, values: tuple[Any, ...]) -> tuple[Any, ...]:
        seen = getattr(self.wrapped, "contexts_seen_by_f", None)
        return values if seen is None else seen(values)

    def build(self, family: str, f: Any, spec: Any) -> Any:
        if family != "gradient":
            raise UnsupportedOperatorError(
                f"{self.backend!r}: {family} is not reduced across processes; DataParallel computes gradient "
                f"and value_and_gradient. Use {self.backend.backend!r} for other operators."
            )
        require_process_group(repr(self.backend))
        return DataParallelRunner(self.backend, f, spec)


register_engine(DataParallel, DataParallelEngine)
