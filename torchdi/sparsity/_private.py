"""The private torch internals of sparsity detection, fenced (see ``torchdi/_fence.py``).

The tracer reads aten's operator objects in the graph ``make_fx`` records: which nodes are aten
operators (``torch._ops.OpOverload``), their schemas (``OpOverload._schema``: which argument is
written, which result is a view, which arguments are numbers) and overload names
(``OpOverload._overloadname``, to find an in-place op's functional twin).

Fast path (``FAST_PATHS``):

- ``"op_overload"``: ``torch._ops.OpOverload`` and its ``_schema``/``_overloadname`` (torch 2.0 ..
  2.14.1). Fallback: no node is recognised as an aten operator, and each takes the tracer's
  conservative rule (every output element depends on every input element): a denser pattern,
  more colours, the same derivatives.
"""

from __future__ import annotations

from typing import Any

import torch

from torchdi._fence import Fence, probe

__all__ = ["FAST_PATHS", "fence", "op_schema", "overload_name"]

FAST_PATHS = {"op_overload": "reading aten operators' schemas in a traced graph (torch._ops.OpOverload)"}

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
