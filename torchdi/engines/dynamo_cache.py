"""Calling a ``torch.compile``d function through dynamo's own cache entries, guards included.

Dynamo keeps, per code object, a list of cache entries: a guard manager (every guard it
installed while tracing: arguments, globals, closure cells, attributes, helper functions, the
grad mode and the rest of the global state) and the transformed bytecode it runs when those
guards pass. Frame evaluation does exactly this: find the first entry whose guards pass, run its
bytecode, else compile a new entry. ``DynamoCache.lookup`` does the same first step from Python,
without ``torch.compile``'s per-call wrapper; a miss is the caller's cue to call through
``torch.compile``, which recompiles where raw ``torch.compile`` would.

The compiled engines (``compile``, ``xla``) give each preparation a code object of its own
(``fresh_entry_point``): dynamo's cache and recompile limit are then the preparation's own, and
``release`` frees everything dynamo holds for it when the preparation is dropped.
"""

from __future__ import annotations

import itertools
import types
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch

__all__ = ["RECOMPILE_LIMITS", "DynamoCache", "fresh_entry_point", "release"]

# A preparation recompiles only when a guard fails (a static value, a global, the grad mode...).
# Its cache is its own, so dynamo's per-code limit (8) would only turn a correct recompilation
# into a crash (fullgraph=True) or a silent fall back to eager (fullgraph=False). The dynamo
# settings every call through ``torch.compile`` of a preparation's entry point runs under:
RECOMPILE_LIMITS = {"recompile_limit": 1024, "accumulated_recompile_limit": 1024}

# Dynamo keeps automatic-dynamic and profile state by (file, line, name) of a code object: a
# number never reused (unlike id()) keeps a new preparation from inheriting a dead one's.
_preparation_numbers = itertools.count(1)


def fresh_entry_point(template: Callable[..., Any], prefix: str, names: dict[str, Any]) -> types.FunctionType:
    """``template``'s code under a name, file and globals of its own.

    Args:
        template: a function whose body reads only its arguments and the globals in ``names``.
        prefix: the start of the new function's name (a preparation number is appended).
        names: the new function's globals (``__builtins__`` is added).

    Returns:
        A function dynamo sees as a new code object: its own cache entries, recompile count and
        globals (where dynamo installs the compiled graphs, so they die with it).
    """
    function = cast(types.FunctionType, template)
    name = f"{prefix}_{next(_preparation_numbers)}"
    code = function.__code__.replace(co_name=name, co_qualname=name, co_filename=f"<torchdi {name}>")
    # __name__: the template's module. Dynamo (torch 2.9) resolves the frame's module through
    # sys.modules and silently caches nothing on a frame whose module it cannot find.
    scope = {**names, "__builtins__": __builtins__, "__name__": function.__module__, "__torchdi_names__": tuple(names)}
    return types.FunctionType(code, scope, name)


class DynamoCache:
    """Dynamo's cache entries for one entry point: their guard checks and transformed code.

    Args:
        function: the entry point passed to ``torch.compile`` (from ``fresh_entry_point``).

    Attributes:
        entries: ``(guard check, transformed code)`` per cache entry, newest first.
        fast: whether ``lookup`` may be used. The transformed code of a graph with breaks calls
            resume functions that only dynamo's frame evaluation compiles: then every call must
            go through ``torch.compile``.
        in_flight: the arguments by name of the call now going through ``call`` (``None``
            between calls: a preparation keeps no user data), for ``recompile_cause``.
    """

    def __init__(self, function: types.FunctionType) -> None:
        self.function = function
        self.entries: tuple[tuple[Any, Any], ...] = ()
        self.fast = False
        self.in_flight: dict[str, Any] | None = None

    def refresh(self) -> None:
        """Read the current cache entries (after a compilation added one)."""
        fast = []
        for entry in self._current_entries():
            names = entry.code.co_names
            one_graph = sum(name.startswith("__compiled_fn") for name in names) == 1
            if not one_graph or any(name.startswith("__resume") for name in names):
                self.entries, self.fast = (), False
                return
            transformed = types.FunctionType(entry.code, self.function.__globals__, self.function.__code__.co_name)
            fast.append((entry.guard_manager.check, transformed))
        self.entries, self.fast = tuple(fast), bool(fast)

    def lookup(self, frame_locals: dict[str, Any]) -> Any:
        """The transformed code of the first entry whose guards pass for ``frame_locals`` (the
        entry point's arguments by name), or ``None``: dynamo would then compile."""
        for check, transformed in self.entries:
            if check(frame_locals):
                return transformed
        return None

    def call(
        self, compiled: Callable[..., Any], args: tuple[Any, ...], frame_locals: dict[str, Any], settings: Mapping[str, Any]
    ) -> Any:
        """Call ``compiled`` (``torch.compile`` of the entry point) through dynamo's frame
        evaluation: its guards, and a recompilation where none of its entries' pass.

        Args:
            compiled: what ``torch.compile(entry point)`` returned.
            args: its arguments.
            frame_locals: the same arguments as the entry point's frame names them (what its
                guards read); ``recompile_cause`` reads them while the call runs.
            settings: ``torch._dynamo.config`` values the call runs under.

        Returns:
            The entry point's result. The entries are read again when the call compiled one.
        """
        before = self._transformed_codes()
        self.in_flight = frame_locals
        try:
            with torch._dynamo.config.patch(dict(settings)):
                result = compiled(*args)
        finally:
            self.in_flight = None
        if self._transformed_codes() != before:
            self.refresh()
        return result

    def _current_entries(self) -> list[Any]:
        """Dynamo's cache entries on the entry point's code object now, newest first."""
        return list(torch._C._dynamo.eval_frame._debug_get_cache_entry_list(self.function.__code__))

    def _transformed_codes(self) -> tuple[types.CodeType, ...]:
        return tuple(entry.code for entry in self._current_entries())

    def recompile_cause(self) -> str:
        """Why the call in flight recompiles: dynamo's words for the guard of the newest cache
        entry that fails for its arguments (asked from the compiler, before the new entry exists)."""
        if self.in_flight is None:
            return "of a change"
        entries = self._current_entries()
        if not entries:
            return "dynamo's cache for it was emptied (torch._dynamo.reset())"
        try:
            info = entries[0].guard_manager.check_verbose(self.in_flight)
            parts = [" ".join(part.split()) for part in info.verbose_code_parts if part.strip()]
        except Exception:  # a guard that cannot say why: the recompilation still happens
            parts = []
        return ("this guard failed: " + "; ".join(parts)) if parts else "one of dynamo's guards failed"


def release(backend_key: int, holder: list[types.FunctionType]) -> None:
    """Free what dynamo holds for a dropped preparation.

    Dynamo keeps its backend in a module-level cache (by ``id``), and keeps the globals of a
    compiled frame (where it installs the compiled graphs, next to the runner and so ``f``)
    alive through a cleanup hook tied to the cache entry on the frame's code object: a cycle
    through C-level state that the garbage collector cannot see. Emptying the cache and dropping
    the entry point's globals breaks it (dynamo's own hooks remove the names it installed).

    Args:
        backend_key: ``id`` of the backend object passed to ``torch.compile``.
        holder: a list holding the entry point, if it was made (filled after the finalizer was
            registered, so that the finalizer does not keep the preparation alive).
    """
    from torch._dynamo import eval_frame

    eval_frame.cached_backends.pop(backend_key, None)
    if holder:
        torch._C._dynamo.eval_frame.reset_code(holder[0].__code__)
        scope = holder[0].__globals__
        for name in scope.get("__torchdi_names__", ()):  # ours: dynamo's hooks remove its own
            scope.pop(name, None)
