"""The one module that touches private torch-xla (and torch's openxla bridge) internals.

A module apart from ``_dynamo.py`` because torch-xla is optional, slow to import and fails to
import beside a torch it was not built for: its internals are probed once, the first time an
``AutoXLA`` preparation asks (``hooks()``), never at ``import torchdi``. Each has a public path
as its fallback; one warning (logger ``torchdi``, through ``_dynamo.warn_off``'s wording) names
a fast path that is off. Checked on torch-xla 2.9.0 (the newest release; it pins torch 2.9.0).

- ``openxla_parts``: ``torch._dynamo.backends.common.aot_autograd``,
  ``torch._dynamo.backends.torchxla.openxla_eval_boxed`` and ``torch._decomp.get_decompositions``:
  torch's own ``openxla`` backend rebuilt, so the forward graph can be inspected for random ops
  and eval-mode batch norm's backward decomposed. Fallback: ``torch.compile(graph,
  backend="openxla")`` (public), every program then taken as random (seeded each call from the
  host generator: same results, one more transfer).
- ``sync``: ``torch_xla._XLAC._xla_sync_multi`` (materialize these tensors only). Fallback:
  ``torch_xla.sync()`` (everything pending; torch-xla >= 2.7) or ``xm.mark_step()``.
- ``to_cpu``: ``torch_xla._XLAC._xla_get_cpu_tensors`` (one transfer for many tensors).
  Fallback: ``.cpu()`` per tensor.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from torchdi._fence import Fence

__all__ = ["XLAHooks", "hooks", "sync", "to_cpu"]

logger = logging.getLogger("torchdi")

FAST_PATHS = {
    "openxla_parts": "torch's openxla backend rebuilt from aot_autograd and openxla_eval_boxed",
    "xla_sync_multi": "materializing only this call's XLA tensors (torch_xla._XLAC._xla_sync_multi)",
    "xla_get_cpu_tensors": "one device-to-host transfer for many tensors (torch_xla._XLAC._xla_get_cpu_tensors)",
}


class XLAHooks(NamedTuple):
    """The private callables found (``None``: missing, the public path is used)."""

    aot_autograd: Callable[..., Any] | None
    openxla_eval_boxed: Callable[..., Any] | None
    get_decompositions: Callable[..., Any] | None
    sync_multi: Callable[..., Any] | None
    get_cpu_tensors: Callable[..., Any] | None


def _get(getter: Callable[[], Any]) -> Any:
    try:
        return getter()
    except (AttributeError, ImportError):
        return None


def _aot_autograd() -> Any:
    from torch._dynamo.backends.common import aot_autograd  # torch 2.0 .. 2.14.1

    return aot_autograd


def _openxla_eval_boxed() -> Any:
    from torch._dynamo.backends.torchxla import openxla_eval_boxed  # torch 2.1 .. 2.14.1

    return openxla_eval_boxed


def _get_decompositions() -> Any:
    from torch._decomp import get_decompositions  # torch 2.0 .. 2.14.1

    return get_decompositions


def _xlac(name: str) -> Any:
    import torch_xla

    return getattr(torch_xla._XLAC, name)  # torch-xla 2.0 .. 2.9


@functools.cache
def hooks() -> XLAHooks:
    """Probe torch-xla's internals (once per process)."""
    found = XLAHooks(
        aot_autograd=_get(_aot_autograd),
        openxla_eval_boxed=_get(_openxla_eval_boxed),
        get_decompositions=_get(_get_decompositions),
        sync_multi=_get(lambda: _xlac("_xla_sync_multi")),
        get_cpu_tensors=_get(lambda: _xlac("_xla_get_cpu_tensors")),
    )
    return found


fence = Fence(FAST_PATHS, what="torch-xla")
warn_off = fence.warn_off


def sync(tensors: list[torch.Tensor]) -> None:
    """Materialize ``tensors`` on their XLA device and wait (the fallback materializes all
    pending work, which only costs time)."""
    sync_multi = hooks().sync_multi
    if sync_multi is not None:
        sync_multi(tensors, devices=[], wait=True)
        return
    warn_off("xla_sync_multi")
    import torch_xla

    if hasattr(torch_xla, "sync"):
        torch_xla.sync(wait=True)
    else:  # torch-xla before 2.7
        import torch_xla.core.xla_model as xm

        xm.mark_step(wait=True)


def to_cpu(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The CPU values of XLA ``tensors``, in one transfer where torch-xla allows it."""
    get_cpu_tensors = hooks().get_cpu_tensors
    if get_cpu_tensors is not None:
        return list(get_cpu_tensors(tensors))
    warn_off("xla_get_cpu_tensors")
    return [t.cpu() for t in tensors]
