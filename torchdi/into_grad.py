"""``out=into_grad(params)``: gradients written into the parameters' ``.grad``, as ``backward()`` does.

A dict of ``.grad`` tensors captured once goes stale when ``optimizer.zero_grad()`` (whose default
is ``set_to_none=True``) drops them: results written there never reach the optimizer. An
``IntoGrad`` looks the ``.grad`` attributes up at each call instead, so every form of zeroing
works, and it accumulates as ``backward()`` does, so gradient accumulation over micro-batches
costs one in-place add per tensor and no extra copy.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from torchdi._fence import maybe_view

__all__ = ["IntoGrad", "into_grad"]


class IntoGrad:
    """An ``out=`` target that writes a gradient into ``p.grad`` for each tensor ``p`` of ``params``.

    Made by ``into_grad``; see there.
    """

    __slots__ = ("accumulate", "keys", "leaves", "spec")

    def __init__(self, params: Any, accumulate: bool) -> None:
        leaves, self.spec = pytree.tree_flatten(params)
        # A flat dict (named parameters, the usual case) is matched by its keys, without a
        # pytree round trip on each step.
        flat_dict = type(params) is dict and all(isinstance(v, torch.Tensor) for v in params.values())
        self.keys: tuple[Any, ...] | None = tuple(params) if flat_dict else None
        for leaf in leaves:
            if not isinstance(leaf, torch.Tensor):
                raise TypeError(f"into_grad: params must be a pytree of tensors, found a leaf of type {type(leaf).__name__}")
            if not leaf.is_leaf:
                # Autograd never fills a computed tensor's .grad and no optimizer reads it: the
                # gradients would go where nothing looks.
                path = next(path for path, t in pytree.tree_flatten_with_path(params)[0] if t is leaf)
                raise ValueError(
                    f"into_grad: params{pytree.keystr(path)} is not a leaf tensor (it was computed from tensors that "
                    "require grad), so its .grad is not what an optimizer reads; pass the parameters themselves, "
                    "e.g. dict(model.named_parameters())"
                )
        self.leaves: list[torch.Tensor] = leaves
        self.accumulate = accumulate

    def write(self, grads: Any, operator: str) -> Any:
        """Store ``grads`` (structured like ``params``) into the ``.grad`` attributes; returns them."""
        if self.keys is not None and type(grads) is dict and tuple(grads) == self.keys:
            leaves = list(grads.values())  # the same keys in the same order: the same structure
        else:
            leaves, spec = pytree.tree_flatten(grads)
            if spec != self.spec:
                raise ValueError(
                    f"{operator}: out=into_grad(params) needs params with the structure of x; got {self.spec} "
                    f"for params and {spec} for the gradient"
                )
        with torch.no_grad():
            for param, grad in zip(self.leaves, leaves):
                if not param.requires_grad:
                    # A frozen parameter: backward() leaves its .grad alone (None), so an
                    # optimizer skips it; writing one would make optimizer.step() move it.
                    continue
                if grad.shape != param.shape:
                    raise ValueError(f"{operator}: out=into_grad(params): a gradient of shape {tuple(grad.shape)} for a parameter of shape {tuple(param.shape)}")
                current = param.grad
                if current is None:
                    # A fresh result the caller does not hold elsewhere: adopt it, no copy. A view
                    # (an expanded gradient of a sum, say) is copied: later adds must not alias.
                    if maybe_view(grad) or not grad.is_contiguous() or grad.dtype != param.dtype:
                        grad = grad.to(param.dtype, memory_format=torch.contiguous_format, copy=True)
                    param.grad = grad
                elif self.accumulate:
                    current.add_(grad)
                else:
                    current.copy_(grad)
        if self.keys is not None:
            return dict(zip(self.keys, [param.grad for param in self.leaves]))
        return pytree.tree_unflatten([param.grad for param in self.leaves], self.spec)


def into_grad(params: Any, accumulate: bool = True) -> IntoGrad:
    """An ``out=`` target for ``gradient``/``value_and_gradient``: each parameter's ``.grad``.

    For each tensor ``p`` of ``params`` (the pytree passed as ``x``), the gradient goes into
    whatever ``p.grad`` is at call time: when it is ``None`` (after
    ``optimizer.zero_grad()``) the computed tensor becomes ``p.grad``; otherwise it is added to
    it (``accumulate=True``, what ``loss.backward()`` does) or copied over it
    (``accumulate=False``). Gradient accumulation over micro-batches is therefore the
    ``backward()`` loop with ``loss.backward()`` replaced, with no copy per micro-batch.

    Frozen parameters (``requires_grad=False``) are left alone, as ``backward()`` leaves them:
    their ``.grad`` stays what it was (``None``), so the optimizer does not move them, and the
    operator returns that ``.grad`` for them. To skip computing their gradient as well, leave
    them out of ``x``: ``{n: p for n, p in model.named_parameters() if p.requires_grad}`` (a
    ``functional_call`` with a partial dict uses the module's own tensors for the rest).

    Args:
        params: the parameters, with the structure of ``x`` (e.g. ``dict(model.named_parameters())``).
        accumulate: add into existing ``.grad`` tensors (``True``) or overwrite them.

    Returns:
        An ``IntoGrad`` to pass as ``out=``; the operator then returns the ``.grad`` tensors.

    Example::

        >>> model = torch.nn.Linear(3, 1)
        >>> params = dict(model.named_parameters())
        >>> loss = lambda p, batch: torch.func.functional_call(model, p, (batch,)).pow(2).mean()
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> optimizer.zero_grad()                    # .grad is None: the first result becomes it
        >>> for micro_batch in torch.randn(4, 2, 3):  # accumulates, as loss.backward() would
        ...     _ = torchdi.gradient(loss, torchdi.AutoAutograd(), params, torchdi.Constant(micro_batch),
        ...                          out=torchdi.into_grad(params))
        >>> model.weight.grad.shape
        torch.Size([1, 3])
        >>> optimizer.step()
    """
    return IntoGrad(params, accumulate)
