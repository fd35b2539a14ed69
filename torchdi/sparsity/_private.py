"""The private torch internals of sparsity detection and of the sparse compiled program, fenced
(see ``torchdi/_fence.py``).

The tracer reads aten's operator objects in the graph ``make_fx`` records: which nodes are aten
operators (``torch._ops.OpOverload``), their schemas (``OpOverload._schema``: which argument is
written, which result is a view, which arguments are numbers) and overload names
(``OpOverload._overloadname``, to find an in-place op's functional twin).

Fast paths (``FAST_PATHS``):

- ``"op_overload"``: ``torch._ops.OpOverload`` and its ``_schema``/``_overloadname`` (torch 2.0 ..
  2.14.1). Fallback: no node is recognised as an aten operator, and each takes the tracer's
  conservative rule (every output element depends on every input element): a denser pattern,
  more colours, the same derivatives.
- ``"dispatch_mode"``: ``torch.utils._python_dispatch.TorchDispatchMode`` (torch 1.13 .. 2.14.1),
  through which the tracer sees each aten op of ``f`` as it runs. Fallback: ``make_fx`` (public
  ``torch.fx.experimental``) records the graph and the tracer replays it: the same pattern,
  about 4x slower on small functions.
- ``"loop_tail_vec"``: inductor's C++ knob ``cpp.enable_loop_tail_vec`` (``torch._inductor.config``,
  torch 2.9 .. 2.14.1), which ``AutoSparse`` over ``AutoCompile`` turns off for its one program
  (see ``fused_inductor_options``). Fallback: inductor's default (tails vectorised): the same
  values, the Brusselator N=32 call about 2x slower.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, cast

import torch

from torchdi._fence import Fence, probe

__all__ = ["FAST_PATHS", "fence", "fused_inductor_options", "op_schema", "overload_name", "recording"]

FAST_PATHS = {
    "op_overload": "reading aten operators' schemas in a traced graph (torch._ops.OpOverload)",
    "dispatch_mode": "seeing f's aten ops as they run (torch.utils._python_dispatch.TorchDispatchMode)",
    "loop_tail_vec": "scalar loop tails in AutoSparse's compiled program (inductor's cpp.enable_loop_tail_vec)",
}

fence = Fence(FAST_PATHS)


def _op_overload() -> type:
    kind = torch._ops.OpOverload
    schema = torch.ops.aten.add.Tensor._schema  # the attributes read below, on an operator every torch has
    if not isinstance(torch.ops.aten.add.Tensor, kind) or not schema.arguments or not isinstance(torch.ops.aten.add_.Tensor._overloadname, str):
        raise TypeError("OpOverload without a schema")
    return kind


# torch 2.0 .. 2.14.1.
_OP_OVERLOAD: type | None = probe(_op_overload)


def op_schema(target: Any) -> Any:
    """``target``'s aten schema (``.arguments``, ``.returns`` with their ``alias_info``), or
    ``None`` when ``target`` is not an aten operator or this torch does not show its schema."""
    kind = _OP_OVERLOAD
    if kind is None:
        fence.warn_off("op_overload")
        return None
    operator: Any = target
    return operator._schema if isinstance(target, kind) else None


def overload_name(target: Any) -> str | None:
    """``target``'s overload name (``"Tensor"`` for ``aten.add_.Tensor``), or ``None``."""
    kind = _OP_OVERLOAD
    if kind is None or not isinstance(target, kind):
        return None
    operator: Any = target
    return str(operator._overloadname)


def _dispatch_mode() -> type:
    kind = importlib.import_module("torch.utils._python_dispatch").TorchDispatchMode
    if not isinstance(kind, type) or not hasattr(kind, "__torch_dispatch__"):
        raise TypeError("TorchDispatchMode without __torch_dispatch__")
    return cast(type, kind)


# torch 1.13 .. 2.14.1.
_DISPATCH_MODE: type | None = probe(_dispatch_mode)
_RECORDERS: dict[type, type] = {}


def recording(handler: Callable[[Any, Any, dict[str, Any]], Any]) -> Any:
    """A dispatch mode (a context manager) under which every aten op goes to
    ``handler(op, args, kwargs)``, which runs it and returns its result; ``None`` when this torch
    has no dispatch modes (the caller then records a ``make_fx`` graph)."""
    base = _DISPATCH_MODE
    if base is None:
        fence.warn_off("dispatch_mode")
        return None
    recorder = _RECORDERS.get(base)
    if recorder is None:

        def __torch_dispatch__(self: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            return self.handler(func, args, kwargs or {})

        recorder = _RECORDERS[base] = type("_Recorder", (base,), {"__torch_dispatch__": __torch_dispatch__})
    mode = recorder()
    mode.handler = handler
    return mode


def _loop_tail_knob() -> str:
    config = importlib.import_module("torch._inductor.config")
    if not isinstance(config.cpp.enable_loop_tail_vec, bool):
        raise TypeError("cpp.enable_loop_tail_vec is not a flag")
    return "cpp.enable_loop_tail_vec"


# torch 2.9 .. 2.14.1; probed on the first sparse compiled preparation, not at torchdi's import
# (which does not import inductor). False: not probed yet; None: missing.
_LOOP_TAIL_KNOB: str | bool | None = False


def fused_inductor_options() -> dict[str, Any]:
    """The inductor options ``AutoSparse`` adds under the user's for its one compiled program:
    loop tails not vectorised, or ``{}`` where this torch lacks the knob.

    Inductor vectorises a loop's tail with masked loads and stores; on a tensor whose last
    dimension is shorter than a SIMD vector (the Brusselator's ``(N, N, 2)``), every iteration
    is a tail. Measured on the prepared Brusselator N=32 jacobian (8 JVPs and the gather, one
    thread, thread CPU time, medians of 21 interleaved batches): 878 us with inductor's default,
    448 us with scalar tails (``cpp.simdlen=1``, no vectorisation at all: 402 us, but 2425 ->
    3425 us on a banded linear map, whose batched matmul inductor vectorises); heat equation,
    Rosenbrock N=200 and 1e5, banded linear n=1000: unchanged within noise.
    """
    global _LOOP_TAIL_KNOB
    if _LOOP_TAIL_KNOB is False:
        _LOOP_TAIL_KNOB = probe(_loop_tail_knob)
    knob = _LOOP_TAIL_KNOB
    if not isinstance(knob, str):
        fence.warn_off("loop_tail_vec")
        return {}
    return {knob: False}
