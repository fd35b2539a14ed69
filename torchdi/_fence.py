"""What every module fencing private torch internals shares: probing, and one warning per fast path.

A fence module (``engines/_dynamo.py`` for dynamo, functorch and autograd, ``engines/_xla_private.py``
for torch-xla, ``_distributed_private.py`` for ``torch.distributed``, ``sparsity/_private.py`` for
aten's operator objects) probes each private internal once, keeps it in a module attribute (which
the fence tests set to "missing" in turn) and gives a public fallback for it. This module sits on
the lowest floor (it imports only torch), so that fences below the engines can use it.

It also fences the two private attributes of ``torch.Tensor`` that modules on every floor read:
``Tensor._version`` (autograd's in-place version counter: torch has ``torch.autograd.graph.
increment_version`` to bump it, nothing public to read it) and ``Tensor._base`` (whether a tensor
is a view; ``Tensor._is_view`` is private too). Both have been on ``TensorBase`` since torch 0.4,
and torch's own Python (checkpointing, functorch, the optimizers' tests) reads them; still, they
are private by name, so each reader goes through ``tensor_version`` / ``maybe_view`` and has a
public fallback: compare values (a clone of each watched tensor), or treat a tensor as a view
(copy it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["REAL_ZEROS", "TENSOR", "UNPROBED", "Fence", "maybe_view", "probe", "probed_once", "tensor_version"]

logger = logging.getLogger("torchdi")


def probe(getter: Callable[[], Any]) -> Any:
    """``getter()``, or ``None`` when what it reaches for does not exist in this torch."""
    try:
        return getter()
    except (AttributeError, ImportError, TypeError):
        return None


#: What a fence module's lazily probed attribute holds until its first use (``probed_once``).
UNPROBED: Any = object()


def probed_once(namespace: dict[str, Any], attribute: str, getter: Callable[[], Any]) -> Any:
    """A fence module's ``attribute`` (``namespace`` is its ``globals()``), probed with ``getter``
    on first use: ``UNPROBED`` until then (importing those parts of torch costs time that a user
    who never needs them should not pay), ``None`` where this torch lacks them (the fence tests
    set it to ``None`` to say so)."""
    value = namespace[attribute]
    if value is UNPROBED:
        value = namespace[attribute] = probe(getter)
    return value


class Fence:
    """The fast paths of one fence module, and the one warning each gets when it is off.

    Args:
        fast_paths: name -> what the private internal behind it does for torchdi.
        costs: name -> what the public path costs instead, where it is more than time.
        what: the software whose internals these are (named in the warning).
    """

    def __init__(self, fast_paths: dict[str, str], costs: dict[str, str] | None = None, what: str = "torch") -> None:
        self.fast_paths = fast_paths
        self.costs = costs or {}
        self.what = what
        self.warned: set[str] = set()

    def warn_off(self, name: str, detail: str = "") -> None:
        """Log once per process that the fast path ``name`` is off in this torch (slower, still right)."""
        if name in self.warned:
            return
        self.warned.add(name)
        logger.warning(
            "torchdi: %s (torch %s) lacks the internal behind a fast path (%s: %s)%s; torchdi uses the "
            "public path instead, %s.",
            self.what,
            torch.__version__,
            name,
            self.fast_paths[name],
            f" ({detail})" if detail else "",
            self.costs.get(name, "which is slower but gives the same results"),
        )


TENSOR = Fence(
    {
        "version_counter": "Tensor._version, autograd's in-place version counter (a write into x, a Constant or a "
        "same-point tensor, or into an AutoXLA module's host tensors, seen without comparing values)",
        "view_base": "Tensor._base, whether a tensor is a view (into_grad adopts a fresh gradient as .grad without a copy)",
    },
    costs={
        "version_counter": "which compares values (a clone of each watched tensor: more memory, and a write "
        "that keeps every value goes unseen, which leaves the tensor as it was)",
        "view_base": "which copies every gradient it adopts as .grad",
    },
)

# Probed once (the fence tests set them to None in turn): the getset descriptors on TensorBase.
VERSION_COUNTER: Any = probe(lambda: torch.Tensor._version)
VIEW_BASE: Any = probe(lambda: torch.Tensor._base)


def tensor_version(tensor: torch.Tensor) -> int | None:
    """autograd's version counter of ``tensor`` (every in-place write bumps it), or ``None`` where
    this torch lacks it: the caller then compares values."""
    if VERSION_COUNTER is None:
        TENSOR.warn_off("version_counter")
        return None
    return int(tensor._version)


def maybe_view(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a view of another tensor (``True`` where this torch cannot say)."""
    if VIEW_BASE is None:
        TENSOR.warn_off("view_base")
        return True
    return tensor._base is not None


def _real_zeros(
    size: list[int], *, dtype: torch.dtype | None = None, layout: torch.layout | None = None, device: Any = None, pin_memory: bool | None = None
) -> torch.Tensor:
    return torch.zeros(size, dtype=dtype, layout=layout, device=device, pin_memory=bool(pin_memory))


# A decomposition both compiling fences hand to torch's compilers. Forward mode makes a ZeroTensor
# (aten._efficientzerotensor: zeros without memory) for a tangent known to be zero. Inductor keeps
# that operator as a fallback to the eager kernel, and its own kernels then read the ZeroTensor's
# data as memory; make_fx records torch's ZeroTensor fallback (meta-device copies, prims) around
# it, which AOTInductor reads the same way. On torch 2.13 a hessian through gather, topk and
# atan2, compiled after a jacobian of the same function, read out of bounds and crashed the
# process (segfault) on both. As plain zeros: real memory, the same values.
REAL_ZEROS: dict[Any, Any] = {torch.ops.aten._efficientzerotensor.default: _real_zeros}
