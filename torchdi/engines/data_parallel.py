"""``DataParallel``: the wrapped backend's gradient, reduced across processes.

The runner fixes ``x``'s layout at preparation (``distributed.Layout``: replicated plain
tensors, or FSDP2 DTensors sharded on dim 0). Each call takes the local tensors (the shards),
gathers them whole, runs the wrapped backend's gradient on them with FSDP2's hooks kept out,
then reduces value and gradient (all-reduce, or reduce-scatter back to the shards) and wraps
sharded gradients as DTensors again. On ``AutoCompile`` the gather, the gradient and the
reduction are one compiled program (functional collectives are traceable), with one collective
per FSDP2 unit that a pass over the compiled graph moves next to the unit's forward and backward
(``_distributed_private.schedule_units``); on eager backends the same functions run eagerly. Two routes gather unit by unit instead: FSDP2's own hooks on
``AutoAutograd`` (``distributed.FsdpUnits``), and on ``AutoFunc`` the wrapped gradient of ``f`` on
the shards, whose ``functional_call`` gathers each unit while it runs (``distributed.LayeredCall``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch.utils import _pytree as pytree

from torchdi._distributed_private import (
    graphless_grad_and_value,
    layer_by_layer,
    unit_scheduled_compiler,
)
from torchdi.backends import AutoAutograd, AutoCompile, AutoFunc, DataParallel
from torchdi.distributed import (
    FsdpUnits,
    LayeredCall,
    Layout,
    reduced_gradient,
    require_process_group,
    running_gathered,
    running_layered,
    unit_buckets,
)
from torchdi.engines._compiled import CompiledRunner, inductor_options
from torchdi.engines._dynamo import functorch_level
from torchdi.engines.func import in_output_shape, scalar_output
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
        # FSDP2 x on AutoAutograd: FSDP2's own hooks, layer by layer (distributed.FsdpUnits)
        self.units: FsdpUnits | None = None
        # FSDP2 x on AutoFunc: the wrapped gradient on the shards, f's functional_call gathering
        # unit by unit (distributed.LayeredCall)
        self.layered: Any = None
        # the same gradient without the graph of its backward, where nothing can differentiate it
        self.graphless: Any = None
        self.last_call: LayeredCall | None = None  # (what the last call gathered: for tests and benchmarks)

    @property
    def num_compilations(self) -> int:
        return int(getattr(self.inner, "num_compilations", 0))

    def warm_up(self, x: Any, tangents: Any, contexts: tuple[Any, ...]) -> None:
        """Fix ``x``'s layout and build (and on ``AutoCompile`` compile) the reduced gradient."""
        who = repr(self.backend)
        wrapped = self.backend.backend
        if isinstance(wrapped, AutoAutograd) and self.units is None:
            self.units = FsdpUnits.of(x, contexts)
            if self.units is not None:
                return  # the gathering route is built only if a call needs it (see __call__)
        self.layout = Layout.of(x, self.backend.group, who)
        if isinstance(wrapped, AutoFunc) and self.layout.sharded and self.layered is None and layer_by_layer():
            self.layered = build_runner(wrapped, "gradient", self.f, self.spec)
            if not getattr(self.spec, "has_aux", False):
                self.graphless = _graphless_gradient(self.f, self.spec)
        eager = wrapped.inner if isinstance(wrapped, AutoCompile) else wrapped
        compiler = None
        if isinstance(wrapped, AutoCompile) and self.layout.sharded:
            # One all-gather and one reduce-scatter per FSDP2 unit, which the compiler's pass
            # (schedule_units) moves next to the unit's forward and backward: the program holds
            # about one unit's full parameters at a time, as FSDP2 does.
            given = dict(wrapped.options) if wrapped.options else None
            options = inductor_options(given) if wrapped.compiler == "inductor" else given
            compiler = unit_scheduled_compiler(wrapped.compiler, wrapped.mode, options, wrapped.dynamic)
            if compiler is not None:
                self.layout = unit_buckets(self.layout, x, contexts)
        body = reduced_gradient(self.layout, build_runner(eager, "gradient", self.f, self.spec), self.backend.op)
        if isinstance(wrapped, AutoCompile):
            compiled = CompiledRunner(body, wrapped, "gradient", getattr(self.f, "function_name", repr(self.f)), compiler=compiler)
            with running_gathered(contexts):
                compiled.warm_up(self.layout.lower(x, who), tangents, contexts)
            self.inner = compiled
        else:
            self.inner = body

    def __call__(self, x: Any, tangents: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any]:
        if self.layout is None and self.units is None:
            self.warm_up(x, tangents, contexts)
        if self.units is not None and not torch.is_grad_enabled():
            params = self.units.match(pytree.tree_leaves(x))
            if params is not None:
                return self.units.gradient(self.f, x, params, contexts, self.backend.op, self.spec.needs_value)
        # Not the FSDP2 modules' own parameters, or an outer derivative (whose graph FSDP2's
        # hooks would not build): the shards gathered whole around the wrapped backend.
        if self.layout is None:
            self.warm_up(x, tangents, contexts)
        assert self.layout is not None
        if self.layered is not None and not torch.is_grad_enabled():
            return self._layered(x, tangents, contexts)
        local = self.layout.lower(x, repr(self.backend))
        with running_gathered(contexts):
            value, grads = self.inner(local, tangents, contexts)
        return value, self.layout.lift(grads)

    def _layered(self, x: Any, tangents: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any]:
        """FSDP2 ``x`` on ``AutoFunc``: ``torch.func``'s gradient of ``f`` on the shards, each unit's
        parameters all-gathered while it runs and its gradients reduce-scattered by its backward
        (``functional_call`` under ``running_layered``), so that a process holds the full
        parameters of the root and one unit at a time, as with FSDP2's own hooks."""
        layout = self.layout
        assert layout is not None
        who = repr(self.backend)
        local = layout.lower(x, who)
        scale = 1.0 / layout.world if self.backend.op == "mean" else 1.0
        call = self.last_call = LayeredCall(layout.group, layout.world, scale, local)
        # Grad mode is off here (see __call__); with no torch.func transform around either, nothing
        # can differentiate the gradient, and torch.func's graph of its backward would only hold
        # each layer's activation and output gradient until the backward ends (measured on
        # benchmarks/distributed.py --memory: 1.16x eager FSDP2's step peak with it, 0.9x without).
        runner = self.graphless if self.graphless is not None and functorch_level() is None else self.layered
        with running_layered(call, contexts):
            value, grads = runner(pytree.tree_unflatten(local, layout.spec), tangents, contexts)
        grads = pytree.tree_leaves(grads)
        call.check(grads, [pytree.keystr(path) for path, _ in pytree.tree_flatten_with_path(x)[0]], who)
        if value is not None:
            total = value.detach().clone()
            torch.distributed.all_reduce(total, group=layout.group)
            value = total * scale
        return value, layout.lift(grads)


def _graphless_gradient(f: Any, spec: Spec) -> Any:
    """``AutoFunc``'s gradient runner (``FuncEngine``, without ``has_aux``) on
    ``graphless_grad_and_value``: for a call that no transform and no grad mode surround. ``None``
    where this torch lacks the parts."""
    y_shape = spec.y.shapes[0]

    def scalar(x_: Any, contexts: tuple[Any, ...]) -> tuple[torch.Tensor, None]:
        return scalar_output(f(x_, contexts)), None

    transform = graphless_grad_and_value(scalar)
    if transform is None:
        return None

    def run(x: Any, _: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any]:
        g, (y, _aux) = transform(x, contexts)
        return in_output_shape(y, y_shape) if spec.needs_value else None, g

    return run


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
