"""What a one-shot call (no ``prep``) under a ``torch.func`` transform learns once about ``f``.

A PINN loss calls ``td.hvp(u, AutoFunc(), points, ...)`` without a ``prep`` inside the training
step's ``grad``: every step would prepare again, and preparation evaluates ``f`` once more only
to learn the layout of its output (a Laplacian step paid ~10% for it). What that evaluation
teaches, for an eager backend whose runners are plain ``torch.func`` transforms, is only
metadata: the ``Spec`` (layouts of ``x`` and ``f(x)``) and the pytree flattening. It is kept per
``f`` (weakly: it dies with ``f``, and it holds no tensor, no ``f`` and no argument value) and per
signature of the arguments (the strict check's descriptions), and later one-shot calls build
their runner from it at once.

Nothing is checked less on such a call (``_core._run_learned``):

- ``f``'s output is checked at *every* evaluation inside the runner against the layout learned
  (``checking``): a function whose output changed (a global, a closed-over shape) is never run
  with a stale layout; it is prepared again from scratch.
- the input-mutation check wraps the runner's evaluations of ``f`` (``refuse_mutation``), and so
  does the refusal of data-parallel modules whenever one can run (an initialized process group:
  DDP and FSDP2 modules cannot be built without one).
- any failure inside the runner (the changed output, an error of ``f``) is not reported from
  there: the RNG is restored and the call takes the ordinary path (preparation, then the call),
  so errors and messages are the ones a call without the learned layout gives.

Only backends whose runners under a ``torch.func`` transform are ``torch.func`` transforms of
``f`` qualify (``AutoFunc``, ``AutoAutograd``, ``SecondOrder`` of them), only with ``Constant``
and ``Cache`` contexts (a ``State`` would be updated by a failed attempt), without ``has_aux``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import torch

from torchdi.backends import AutoAutograd, AutoFunc, Backend, SecondOrder
from torchdi.operators._trees import Flattening
from torchdi.runners import BoundFunction, Spec, TreeMeta

__all__ = ["Learned", "StaleOutput", "checking", "eligible", "forget", "learned", "remember"]

# Per f, at most this many argument signatures (shapes change rarely inside a training step).
_PER_FUNCTION = 8


class Learned(NamedTuple):
    """What a preparation under a ``torch.func`` transform learned from evaluating ``f``."""

    spec: Spec
    flattening: Flattening | None
    y: TreeMeta  # f's own output (before any flattening): checked at every evaluation


class StaleOutput(Exception):
    """``f`` returned another layout than the one learned: the call is prepared again."""


_LEARNED: weakref.WeakKeyDictionary[Any, dict[Hashable, Learned]] = weakref.WeakKeyDictionary()


def eligible(backend: Backend) -> bool:
    """Whether ``backend``'s runners under a ``torch.func`` transform are ``torch.func`` transforms
    of ``f`` (what the learned layout describes)."""
    if type(backend) is AutoFunc or type(backend) is AutoAutograd:
        return True
    return type(backend) is SecondOrder and eligible(backend.outer) and eligible(backend.inner)


def learned(f: Callable[..., Any], key: Hashable) -> Learned | None:
    """What was learned about ``f`` for arguments described by ``key``, or ``None``."""
    try:
        return _LEARNED.get(f, {}).get(key)
    except TypeError:  # f (or a value in key) cannot be hashed or weakly referenced
        return None


def remember(f: Callable[..., Any], key: Hashable, what: Learned) -> None:
    try:
        entries = _LEARNED.get(f)
        if entries is None:
            entries = _LEARNED[f] = {}
        if len(entries) >= _PER_FUNCTION:
            entries.clear()
        entries[key] = what
    except TypeError:  # not hashable or not weakly referenceable: nothing kept
        pass


def forget(f: Callable[..., Any], key: Hashable) -> None:
    with contextlib.suppress(TypeError):
        _LEARNED.get(f, {}).pop(key, None)


def checking(bound: BoundFunction, meta: TreeMeta) -> BoundFunction:
    """``bound`` that raises ``StaleOutput`` when ``f``'s output does not have the layout ``meta``
    (O(1) for a tensor output; shapes are the logical ones under ``vmap``)."""
    if meta.is_tensor:
        shape, dtype = meta.shapes[0], meta.dtypes[0]

        def check_tensor(x: Any, contexts: tuple[Any, ...]) -> Any:
            y = bound(x, contexts)
            if not isinstance(y, torch.Tensor) or y.shape != shape or y.dtype != dtype:
                raise StaleOutput
            return y

        check_tensor.function_name = getattr(bound, "function_name", repr(bound))  # type: ignore[attr-defined]
        return check_tensor

    def check_tree(x: Any, contexts: tuple[Any, ...]) -> Any:
        y = bound(x, contexts)
        try:
            same = TreeMeta.of(y) == meta
        except AttributeError:  # a leaf that is not a tensor
            same = False
        if not same:
            raise StaleOutput
        return y

    check_tree.function_name = getattr(bound, "function_name", repr(bound))  # type: ignore[attr-defined]
    return check_tree
