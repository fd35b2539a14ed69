"""``has_aux=True``: ``f`` returns ``(y, aux)``; ``aux`` comes back untouched, not differentiated.

Where the engine can carry ``aux`` through its own transform (``torch.func``'s ``has_aux``, and
so ``AutoCompile`` over ``AutoFunc``: ``aux`` is an output of the one compiled program), the
runner returns ``(y, aux)`` in its value slot. Elsewhere the runner differentiates ``y`` alone
and ``aux`` is read from one more evaluation of ``f`` at ``x``, with the global RNG replayed so
that random operations (dropout) draw what the differentiated evaluation drew.
"""

from __future__ import annotations

from typing import Any

import torch

from torchdi.backends import AutoCompile, AutoFunc, Backend
from torchdi.runners import BoundFunction, Runner

__all__ = ["AuxRunner", "native_aux", "split_aux", "without_aux"]

# The families AutoFunc computes with torch.func's own has_aux.
_FUNC_AUX_FAMILIES = frozenset({"gradient", "pullback", "pushforward", "jacobian", "derivative"})


def split_aux(out: Any, operator: str) -> tuple[Any, Any]:
    """``(y, aux)`` from what ``f`` returned, or a ``TypeError`` saying what ``has_aux`` expects."""
    if not (isinstance(out, tuple) and len(out) == 2):
        got = f"a tuple of length {len(out)}" if isinstance(out, tuple) else type(out).__name__
        raise TypeError(
            f"{operator}: with has_aux=True, f must return a pair (y, aux) (aux is returned untouched, "
            f"not differentiated), got {got}"
        )
    return out[0], out[1]


def native_aux(backend: Backend, family: str) -> bool:
    """Whether ``backend``'s runner of ``family`` returns ``aux`` itself (``Spec.has_aux``)."""
    inner = backend.inner if isinstance(backend, AutoCompile) else backend
    return type(inner) is AutoFunc and family in _FUNC_AUX_FAMILIES


def without_aux(f: BoundFunction, operator: str) -> BoundFunction:
    """``f`` returning ``y`` only."""

    def y_only(x: Any, contexts: tuple[Any, ...]) -> Any:
        return split_aux(f(x, contexts), operator)[0]

    y_only.function_name = getattr(f, "function_name", repr(f))  # type: ignore[attr-defined]
    return y_only


class AuxRunner:
    """A runner of ``y`` alone, with ``aux`` from one more evaluation of ``f`` at ``x``.

    The global RNG is replayed for that evaluation (and left where the runner left it), so that
    ``aux`` comes from the draws the derivatives saw. What the inner runner publishes
    (``num_compilations``, ``published``, ...) reads through.
    """

    def __init__(self, inner: Runner, f: BoundFunction, operator: str) -> None:
        self.inner = inner
        self.f = f
        self.operator = operator
        checked = getattr(inner, "checked_call", None)
        if checked is not None:
            self.checked_call = self._wrap(checked)

    def _wrap(self, call: Runner) -> Runner:
        def run(x: Any, tangents: Any, contexts: tuple[Any, ...]) -> tuple[Any, ...]:
            return self._with_aux(call, x, tangents, contexts)

        return run

    def _with_aux(self, call: Runner, x: Any, tangents: Any, contexts: tuple[Any, ...]) -> tuple[Any, ...]:
        before = torch.get_rng_state()
        result = call(x, tangents, contexts)
        after = torch.get_rng_state()
        torch.set_rng_state(before)
        try:
            with torch.no_grad():
                _, aux = split_aux(self.f(x, contexts), self.operator)
        finally:
            torch.set_rng_state(after)
        return ((result[0], aux), *result[1:])

    def __call__(self, x: Any, tangents: Any, contexts: tuple[Any, ...]) -> tuple[Any, ...]:
        return self._with_aux(self.inner, x, tangents, contexts)

    def __getattr__(self, name: str) -> Any:
        if name in ("inner", "f", "operator", "checked_call"):
            raise AttributeError(name)
        return getattr(self.inner, name)
