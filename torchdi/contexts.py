"""Contexts: arguments of ``f`` that are not differentiated.

``f(x, *contexts)`` receives the unwrapped values, in the order the contexts were given.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import torch
from torch.utils import _pytree as pytree

__all__ = ["Cache", "Constant", "Context", "State", "bind_contexts", "context_kinds", "unwrap_contexts"]

T = TypeVar("T")


class Context(Generic[T]):
    """Base class of the context wrappers; holds ``value``."""

    __slots__ = ("value",)

    def __init__(self, value: T) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.value!r})"


class Constant(Context[T]):
    """A value that ``f`` reads and never mutates; it may change between calls.

    Example::

        >>> f = lambda x, c: (c * x**2).sum()
        >>> torchdi.gradient(f, torchdi.AutoFunc(), torch.ones(2), torchdi.Constant(3.0))
        tensor([6., 6.])
    """

    __slots__ = ()


class Cache(Context[T]):
    """Scratch space that ``f`` may overwrite; its initial value does not matter.

    Every backend hands ``f`` scratch of the same structure, dtype and shape as ``value`` but
    created inside the differentiated function, so that in-place writes into it work under
    ``torch.func`` transforms and ``torch.compile`` as well as in eager autograd. The contents
    of the user's ``value`` are therefore never relied upon (nor, in practice, written).

    Example::

        >>> def f(x, buf):
        ...     buf.copy_(x * 2)
        ...     return (buf**2).sum()
        >>> torchdi.gradient(f, torchdi.AutoFunc(), torch.ones(2), torchdi.Cache(torch.empty(2)))
        tensor([8., 8.])
    """

    __slots__ = ()


class State(Context[T]):
    """Tensors that ``f`` reads and updates in place, whose updates must persist: module buffers
    such as BatchNorm running statistics and ``num_batches_tracked``, step counters.

    ``value`` is a tensor or a pytree (dict/list/tuple) of tensors. A State is not
    differentiated. Each operator call applies ``f``'s update to these very tensors exactly
    once, as an eager training step would: eager backends run ``f`` on them, compiled graphs
    write into them in place. Preparation leaves them (and the global RNG) as it found them.
    Supported by ``gradient``/``value_and_gradient`` (the training operators) on
    ``AutoAutograd``, ``AutoFunc`` and ``AutoCompile``; elsewhere it raises
    ``UnsupportedOperatorError`` (operators that evaluate ``f`` more than once or under
    ``vmap``, and backends that run ``f`` on copies, cannot apply an update exactly once).

    Example::

        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
        >>> params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
        >>> def loss(params, buffers, batch):
        ...     return torch.func.functional_call(model, (params, buffers), (batch,)).pow(2).sum()
        >>> g = torchdi.gradient(loss, torchdi.AutoFunc(), params, torchdi.State(buffers), torchdi.Constant(torch.randn(8, 3)))
        >>> int(buffers["1.num_batches_tracked"])  # the running statistics were updated once
        1
    """

    __slots__ = ()


def context_kinds(contexts: Sequence[Any]) -> tuple[str, ...]:
    """The wrapper of each context by name (``"Constant"``, ``"Cache"`` or ``"State"``)."""
    return tuple(["Cache" if isinstance(c, Cache) else "State" if isinstance(c, State) else "Constant" for c in contexts])


def unwrap_contexts(contexts: Sequence[Any], operator: str, first_position: int) -> tuple[tuple[Any, ...], tuple[bool, ...]]:
    """Split ``contexts`` into their values and a mask saying which are ``Cache``.

    Raises ``TypeError`` naming the position of anything that is not a ``Constant``/``Cache``/``State``.
    """
    values = []
    cache_mask = []
    for i, context in enumerate(contexts):
        if not isinstance(context, Context) or type(context) is Context:
            # Named as everywhere else: x, tx/ty, context 1..n (first_position: the 0-based
            # position of the first context among the operator's arguments).
            tangents_hint = (
                f" (a tuple of tangents? {operator} takes none: tangents belong to pushforward, pullback and hvp)"
                if isinstance(context, tuple) and first_position == 3
                else ""
            )
            raise TypeError(
                f"{operator}: context {i + 1} (argument {first_position + i + 1}) must be wrapped in "
                f"torchdi.Constant(...), torchdi.Cache(...) or torchdi.State(...), got {type(context).__name__}{tangents_hint}. "
                "Contexts come after x (and after the tangents), in the order f takes them."
            )
        values.append(context.value)
        cache_mask.append(isinstance(context, Cache))
    return tuple(values), tuple(cache_mask)


def fresh_scratch(value: Any) -> Any:
    """New scratch with the layout of a ``Cache`` value: tensors become ``empty_like`` copies."""
    return pytree.tree_map(lambda leaf: torch.empty_like(leaf) if isinstance(leaf, torch.Tensor) else leaf, value)


def bind_contexts(f: Callable[..., Any], cache_mask: tuple[bool, ...]) -> Callable[[Any, tuple[Any, ...]], Any]:
    """``f(x, *contexts)`` as ``g(x, context_values)`` that creates fresh scratch for each ``Cache``.

    The scratch is created inside ``g``, i.e. inside whatever transform differentiates ``g``:
    ``torch.func`` forbids in-place writes into tensors captured from outside a transform.
    """
    if not any(cache_mask):
        def call(x: Any, context_values: tuple[Any, ...]) -> Any:
            return f(x, *context_values)
    else:
        def call(x: Any, context_values: tuple[Any, ...]) -> Any:
            args = [fresh_scratch(v) if is_cache else v for v, is_cache in zip(context_values, cache_mask)]
            return f(x, *args)
    call.function_name = getattr(f, "__qualname__", None) or repr(f)  # type: ignore[attr-defined]
    return call
