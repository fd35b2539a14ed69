"""``AutoXLA``: the inner backend's runner traced lazily by torch-xla and compiled by XLA.

torch-xla records operations on XLA tensors and compiles the graph when results are needed;
graphs are cached by structure, so new *values* reuse the compiled program. Three rules keep it
that way (each measured on torch-xla 2.9's CPU client):

- Only this call's outputs are materialized (``_xla_sync_multi``), never everything pending
  (``torch_xla.sync()``), which would pull stray intermediates into a new graph.
- A 0-d value equal to 0 or 1 is compiled in as a constant, and equal scalars share device
  data: every 0-d leaf therefore travels as a shape-(1,) buffer viewed as 0-d.
- Python floats become 0-d tensors (``to_device_tensor``, in ``x``'s precision), i.e. data; ints, strings and other
  objects are static and part of the graph (the strict check compares them).

With ``reuse_buffers=True`` the runner owns device buffers for ``x``, the tangents and the tensor
contexts, fills them in place each call (``copyto_``) and brings results back with ``copyfrom``.
Inputs that already live on the XLA device are used as they are, and results then stay there.

``num_compilations`` counts torch-xla's ``UncachedCompile`` events during this runner's calls.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import torch
from torch.utils import _pytree as pytree

from torchdi.backends import AutoXLA
from torchdi.engines.base import ALL_FAMILIES
from torchdi.translate import copyfrom, copyto_, translate_contexts

__all__ = ["XLAEngine", "XLARunner", "xla_device_problem"]


@functools.cache
def _probe(device: Any) -> str | None:
    try:
        import torch_xla
    except Exception as error:  # ImportError, or undefined symbols on a torch version mismatch
        return f"AutoXLA: 'import torch_xla' failed ({type(error).__name__}: {error}); torch-xla pins its torch version"
    try:
        target = torch_xla.device() if device is None else torch.device(device)
        torch.zeros(1, device=target).add_(1).cpu()
    except Exception as error:  # no libtpu, no PJRT plugin, ...
        return (
            f"AutoXLA: no XLA device is usable ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); "
            "set PJRT_DEVICE=TPU on a TPU host, or PJRT_DEVICE=CPU for torch-xla's CPU client"
        )
    try:
        probe = torch.zeros(1, device=target, requires_grad=True)
        (probe * 2).sum().backward()
    except RuntimeError as error:
        if "device_ready_queues_" not in str(error):
            raise
        # PyTorch's autograd engine sizes its per-device queues at its first backward pass.
        return (
            "AutoXLA: this process ran a backward pass before the XLA device existed, and PyTorch's "
            "autograd engine cannot learn about new devices afterwards. Call "
            "torchdi.check_available(torchdi.AutoXLA()) (or torch_xla.device()) before any other "
            "differentiation in the process."
        )
    return None


def xla_device_problem(backend: AutoXLA) -> str | None:
    """Why ``backend``'s XLA device cannot be used here, or ``None`` (the probe runs once)."""
    return _probe(None if backend.device is None else str(backend.device))


def _uncached_compiles() -> int:
    import torch_xla.debug.metrics as metrics

    return int(metrics.counter_value("UncachedCompile") or 0)


def _is_xla(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "xla"


class XLARunner:
    """A runner executed on an XLA device; the first call (``warm_up``) compiles.

    Attributes:
        num_compilations: XLA compilations during this runner's calls.
        buffers: the device buffers it owns (``reuse_buffers=True``), one per tensor leaf of
            ``(x, tangents, contexts)`` that did not already live on the device.
    """

    def __init__(self, runner: Any, backend: AutoXLA) -> None:
        import torch_xla

        self.runner = runner
        self.device = torch_xla.device() if backend.device is None else torch.device(backend.device)
        self.reuse_buffers = backend.reuse_buffers
        self.num_compilations = 0
        self.buffers: list[torch.Tensor | None] | None = None

    def warm_up(self, x: Any, tangents: Any, contexts: tuple[Any, ...]) -> None:
        """Allocate the device buffers (with ``reuse_buffers``) and compile for these signatures."""
        if self.reuse_buffers:
            leaves = pytree.tree_leaves((x, tangents, translate_contexts(contexts, None, x)))
            self.buffers = [
                torch.empty((1,) if leaf.dim() == 0 else leaf.shape, dtype=leaf.dtype, device=self.device)
                if isinstance(leaf, torch.Tensor) and not _is_xla(leaf)
                else None
                for leaf in leaves
            ]
        self(x, tangents, contexts)

    def _on_device(self, x: Any, tangents: Any, contexts: tuple[Any, ...]) -> tuple[Any, bool]:
        """The runner's arguments on the device, and whether ``x`` already lived there."""
        arguments = (x, tangents, translate_contexts(contexts, None, x))
        leaves, spec = pytree.tree_flatten(arguments)
        x_on_device = all(_is_xla(leaf) for leaf in pytree.tree_leaves(x))
        pending = [leaf for leaf in leaves if _is_xla(leaf)]
        if pending:  # the caller's own pending work must not join (and change) our graph
            import torch_xla

            torch_xla._XLAC._xla_sync_multi(pending, devices=[], wait=True)
        if self.buffers is not None:
            moved = []
            for leaf, buffer in zip(leaves, self.buffers):
                if buffer is None:  # static, or already on the device
                    moved.append(leaf)
                elif leaf.dim() == 0:
                    moved.append(copyto_(buffer, leaf.reshape(1)).view(()))
                else:
                    moved.append(copyto_(buffer, leaf))
        else:
            moved = [
                (leaf.reshape(1).to(self.device).view(()) if leaf.dim() == 0 else leaf.to(self.device))
                if isinstance(leaf, torch.Tensor) and not _is_xla(leaf)
                else leaf
                for leaf in leaves
            ]
        return pytree.tree_unflatten(moved, spec), x_on_device

    def __call__(self, x: Any, tangents: Any, contexts: tuple[Any, ...]) -> Any:
        import torch_xla

        before = _uncached_compiles()
        (x_dev, tangents_dev, contexts_dev), x_on_device = self._on_device(x, tangents, contexts)
        result = self.runner(x_dev, tangents_dev, contexts_dev)
        outputs = [leaf for leaf in pytree.tree_leaves(result) if _is_xla(leaf)]
        torch_xla._XLAC._xla_sync_multi(outputs, devices=[], wait=True)  # this call's outputs only
        self.num_compilations += _uncached_compiles() - before
        return result if x_on_device else copyfrom(result)


class XLAEngine:
    """Builds the inner backend's runner and runs it on the XLA device."""

    native: ClassVar[frozenset[str]] = ALL_FAMILIES
    keeps_static: ClassVar[bool] = True

    def __init__(self, backend: AutoXLA) -> None:
        self.backend = backend

    def build(self, family: str, f: Any, spec: Any) -> Any:
        from torchdi.runners import build_runner

        return XLARunner(build_runner(self.backend.inner, family, f, spec), self.backend)
