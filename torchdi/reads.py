"""What ``f`` reads besides its arguments, and whether any of it changed since it was recorded.

A preparation that keeps something it learned from running ``f`` outside any compiled program's
guards (``AutoSparse``'s sparsity pattern and colouring, traced once from ``f``) must notice
when what ``f`` reads changes: a global rebound (``SHIFT = 2``), a closure cell set, an attribute
of a module or object replaced, a helper function redefined, a tensor ``f`` closes over written
in place (the tracer reads such tensors' zeros). ``Reads.of(f)`` walks ``f`` the way
``torchdi.fingerprint`` does (code, defaults, closure cells, the globals its code names, helper
functions, classes and instances, ``nn.Module`` included, recursively; torch's, numpy's and the
standard library's modules count by name) and records each place it read and what it found
there; ``changed()`` reads every place again. A global, attribute or closure cell's object is
compared by identity (a simple value such as an int or a float by value, so rebinding an equal
number is no change), a tensor also by its version counter (``_fence.tensor_version``: every
in-place write bumps it), a numpy array by its values (it has no version counter), a list or
dict by its length, keys and the identity of its items (one check per container, at C speed: an
equal number rebound inside one counts as a change, which only costs a new trace), a set by
value.

Cost: one Python comparison per place read (a function's code, defaults and keyword defaults
are one place). ``changed()`` on the heat equation of ``benchmarks/sparse.py`` (3 places,
through torchdi's wrapper of ``f``) takes about 0.5 us (0.78 us as 5 places, before a function's
three attributes shared one check), against a ``torchdi.fingerprint`` of it at about 18 us
(SHA-256 over a repr per object); on an ``nn.Sequential`` of ten ``Linear``/``Tanh`` pairs (358
places) about 37 us.

Limits, said where they matter (``AutoSparse``'s docstring): a write through ``tensor.data``
(or ``set_``) bumps no version counter and is not seen, as autograd does not see it (write under
``torch.no_grad()`` instead); an object the walk does not know (a C extension object, one with
``__slots__``) is compared by identity only, so a change inside it is not seen; with more than
``MAX_PLACES`` places nothing is recorded (``Reads.of`` returns ``None``).
"""

from __future__ import annotations

import builtins
import functools
import operator
import os
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from torchdi._fence import tensor_version
from torchdi.fingerprint import CLASS_NOISE, SIMPLE_TYPES, code_names, trusted_module

__all__ = ["MAX_PLACES", "Reads"]

MAX_PLACES = 20_000
_MISSING = object()
_TORCHDI_DIR = str(Path(__file__).resolve().parent) + os.sep


class _TooMany(Exception):
    pass


def _same(found: Any, expected: Any) -> bool:
    """Whether ``found`` is what was recorded: simple values by type and value, others by identity."""
    if found is expected:
        return True
    return isinstance(expected, SIMPLE_TYPES) and type(found) is type(expected) and found == expected


def _entry_check(mapping: Any, key: Any, value: Any) -> Callable[[], bool]:
    """A check that ``mapping`` (a dict, a class namespace) still holds ``value`` at ``key``
    (``_MISSING``: still holds nothing there)."""
    return lambda: _same(mapping.get(key, _MISSING), value)


def _read(owner: Any, name: str) -> Any:
    """``getattr(owner, name)``, or ``_MISSING`` (an empty closure cell raises ValueError)."""
    try:
        return getattr(owner, name, _MISSING)
    except ValueError:
        return _MISSING


class Reads:
    """The places ``f`` reads and what was found there (``Reads.of``); ``changed()`` compares.

    Example::

        >>> shift = 1
        >>> def f(x):
        ...     return x * x.roll(shift)
        >>> reads = Reads.of(f)
        >>> reads.changed()
        False
        >>> shift = 2
        >>> reads.changed()
        True
    """

    def __init__(self) -> None:
        # Each check returns True while its place holds what was recorded.
        self.checks: list[Callable[[], bool]] = []
        self.seen: set[int] = set()
        self.keep: list[Any] = []  # (ids in seen stay unique while the walk runs)

    @staticmethod
    def of(f: Any) -> Reads | None:
        """The places ``f`` reads, recorded now; ``None`` when there are more than ``MAX_PLACES``."""
        reads = Reads()
        try:
            reads._walk(f)
        except _TooMany:
            return None
        reads.seen.clear()
        reads.keep.clear()
        return reads

    def changed(self) -> bool:
        """Whether any place ``f`` read holds something else now (a rebinding, an in-place write)."""
        for check in self.checks:  # noqa: SIM110  (a loop: no generator frame per call)
            if not check():
                return True
        return False

    def __len__(self) -> int:
        return len(self.checks)

    # -- recording ---------------------------------------------------------------------------
    def _add(self, check: Callable[[], bool]) -> None:
        self.checks.append(check)
        if len(self.checks) > MAX_PLACES:
            raise _TooMany

    def _attribute(self, owner: Any, name: str) -> None:
        value = _read(owner, name)
        self._add(lambda: _same(_read(owner, name), value))
        if value is not _MISSING:
            self._walk(value)

    def _walk(self, obj: Any, names: set[str] | None = None) -> None:
        if isinstance(obj, (*SIMPLE_TYPES, torch.dtype, torch.device, torch.layout, torch.memory_format, torch.Size)):
            return  # immutable: the place that held it is what is compared
        if id(obj) in self.seen:
            return
        self.seen.add(id(obj))
        self.keep.append(obj)
        if isinstance(obj, torch.Tensor):
            version = tensor_version(obj)
            if version is not None:
                self._add(lambda: tensor_version(obj) == version)
            else:  # (a torch without version counters, _fence: a copy of the values)
                values = obj.detach().clone()
                self._add(lambda: obj.shape == values.shape and obj.dtype == values.dtype and bool(torch.equal(obj.detach(), values)))
        elif isinstance(obj, np.ndarray):
            copy = obj.copy()
            self._add(lambda: obj.shape == copy.shape and obj.dtype == copy.dtype and bool(np.array_equal(obj, copy)))
        elif isinstance(obj, tuple):
            for item in obj:
                self._walk(item)
        elif isinstance(obj, list):
            items = tuple(obj)
            self._add((lambda: not obj) if not items else (lambda: len(obj) == len(items) and all(map(operator.is_, obj, items))))
            for item in items:
                self._walk(item)
        elif isinstance(obj, dict):
            # One check per dict, its keys and the identity of each value at C speed (a module
            # has a dozen dicts: one closure per entry cost 204 us per check on a 20-layer MLP,
            # 1113 places). An equal value rebound (a float recomputed) counts as a change here:
            # the pattern is traced again, never served stale.
            keys, held = tuple(obj), tuple(obj.values())
            if not keys:  # (most of a module's hook dicts: the cheapest check)
                self._add(lambda: not obj)
                return
            self._add(lambda: len(obj) == len(keys) and tuple(obj) == keys and all(map(operator.is_, obj.values(), held)))
            for value in held:
                self._walk(value)
        elif isinstance(obj, types.MappingProxyType):  # a class's namespace
            self._namespace(obj)
        elif isinstance(obj, (set, frozenset)):
            if isinstance(obj, set):
                frozen = frozenset(obj)
                self._add(lambda: obj == frozen)
            for item in obj:
                self._walk(item)
        elif isinstance(obj, types.FunctionType):
            self._function(obj)
        elif isinstance(obj, types.MethodType):
            self._walk(obj.__func__)
            self._walk(obj.__self__)
        elif isinstance(obj, functools.partial):
            self._walk(obj.func)
            self._walk(obj.args)
            self._walk(obj.keywords)
        elif isinstance(obj, types.ModuleType):
            if not trusted_module(obj.__name__):
                for name in sorted(names or ()):
                    if hasattr(obj, name):
                        self._attribute(obj, name)
        elif isinstance(obj, type):
            self._class(obj)
        elif isinstance(obj, types.CellType):
            self._attribute(obj, "cell_contents")
        elif (hasattr(obj, "__dict__") and not trusted_module(type(obj).__module__)) or isinstance(obj, torch.nn.Module):
            self._walk(type(obj))
            if hasattr(obj, "__dict__"):
                self._walk(vars(obj))
        # Anything else (torch's and numpy's functions and objects, C extension objects): the
        # place that held it compares it by identity.

    def _function(self, fn: types.FunctionType) -> None:
        module = fn.__module__
        if fn.__code__.co_filename.startswith(_TORCHDI_DIR):
            # torchdi's own functions (the wrapper that binds f to its contexts) hold what
            # matters in their closure cells: f itself. (By file: a doctest's function claims
            # torchdi's module name.)
            for cell in fn.__closure__ or ():
                self._walk(cell)
            return
        if trusted_module(module) and module.split(".")[0] != "torchdi":
            return  # torch's own Python functions: pinned by torch's version
        # One check for the three (one call per place costs more than the comparisons in it);
        # by identity, as _same compares a code object, a tuple and a dict.
        code, defaults, kwdefaults = fn.__code__, fn.__defaults__, fn.__kwdefaults__
        self._add(lambda: fn.__code__ is code and fn.__defaults__ is defaults and fn.__kwdefaults__ is kwdefaults)
        for value in (defaults, kwdefaults):
            self._walk(value)
        for cell in fn.__closure__ or ():
            self._walk(cell)
        names = code_names(fn.__code__)
        scope = fn.__globals__
        for name in sorted(names):
            if name in scope:
                value = scope[name]
                self._add(_entry_check(scope, name, value))
                self._walk(value, names)
            elif hasattr(builtins, name):  # a global defined later would shadow the builtin
                self._add(_entry_check(scope, name, _MISSING))

    def _class(self, cls: type) -> None:
        if trusted_module(cls.__module__):
            return
        self._attribute(cls, "__bases__")
        # The class's own namespace, raw: getattr would bind a classmethod anew on every read.
        self._walk(cls.__dict__)

    def _namespace(self, namespace: types.MappingProxyType[str, Any]) -> None:
        for name, raw in namespace.items():
            if name in CLASS_NOISE:
                continue
            self._add(_entry_check(namespace, name, raw))
            if isinstance(raw, (staticmethod, classmethod)):
                self._walk(raw.__func__)
            elif isinstance(raw, property):
                self._walk((raw.fget, raw.fset, raw.fdel))
            else:
                self._walk(raw)
