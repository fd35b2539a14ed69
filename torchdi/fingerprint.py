"""Keys of persisted preparations: a digest of everything that can change what ``f`` computes.

``fingerprint(obj)`` walks a function the way its behaviour depends on it: its code object
(bytecode, constants including nested code objects, names), its defaults, the contents of its
closure cells, and the globals its code (and nested code) names, recursively through helper
functions, ``functools.partial``, bound methods, classes and instances (``nn.Module`` included:
type, methods' code, attributes, parameters and buffers). Tensors and arrays count by dtype,
shape, device and *values* (a global tensor's values may decide a sparsity pattern); modules of
torch, numpy and the standard library count by name (the key also holds torch's and torchdi's
versions). Anything the walk does not know how to key (a C extension object, a generator, a
file, more than ``MAX_NODES`` objects) makes the whole fingerprint ``None``: the caller then
prepares from scratch, it never guesses.
"""

from __future__ import annotations

import builtins
import functools
import hashlib
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["CLASS_NOISE", "MAX_NODES", "SIMPLE_TYPES", "code_names", "fingerprint", "source_digest", "trusted_module"]

MAX_NODES = 20_000
# Modules keyed by name alone: their behaviour is pinned by the versions in every key.
_TRUSTED_ROOTS = frozenset({
    "torch", "numpy", "math", "cmath", "operator", "functools", "itertools", "builtins", "collections",
    "typing", "torchdi", "abc", "enum", "dataclasses", "scipy", "_operator", "_functools", "numbers",
})
# Immutable values keyed (and, in torchdi.reads, compared) by value.
SIMPLE_TYPES = (type(None), bool, int, float, complex, str, bytes, type(Ellipsis), type(NotImplemented))
# Attributes every class has that say nothing about behaviour.
CLASS_NOISE = frozenset({"__dict__", "__weakref__", "__module__", "__doc__", "__qualname__", "__annotations__",
                          "__firstlineno__", "__static_attributes__", "__orig_bases__", "__parameters__"})


class _Unkeyable(Exception):
    """Raised inside the walk: something was met that cannot be keyed soundly."""


def trusted_module(module_name: str | None) -> bool:
    """Whether a module (by name) counts by name alone: torch's, numpy's, the standard library's,
    torchdi's (their behaviour is pinned by the versions in every key)."""
    return bool(module_name) and module_name.split(".")[0] in _TRUSTED_ROOTS  # type: ignore[union-attr]


def code_names(code: types.CodeType) -> set[str]:
    """The global and attribute names ``code`` and the code nested in it read."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= code_names(const)
    return names


class _Walker:
    def __init__(self, meta_only: set[int], tensor_values: bool = True) -> None:
        self.tensor_values = tensor_values
        self.hash = hashlib.sha256()
        self.seen: dict[int, int] = {}
        self.keep: list[Any] = []  # ids stay unique while the walk runs
        self.meta_only = meta_only
        self.nodes = 0

    def token(self, *parts: Any) -> None:
        self.hash.update(repr(parts).encode())
        self.hash.update(b"\0")

    def walk(self, obj: Any, names: set[str] | None = None) -> None:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise _Unkeyable(f"more than {MAX_NODES} objects")
        if isinstance(obj, SIMPLE_TYPES):
            self.token(type(obj).__name__, obj)
            return
        if isinstance(obj, (torch.dtype, torch.device, torch.layout, torch.memory_format, torch.Size)):
            self.token(type(obj).__name__, str(obj))
            return
        marker = self.seen.get(id(obj))
        if marker is not None:  # a cycle or a shared object: its position is enough
            self.token("ref", marker)
            return
        self.seen[id(obj)] = len(self.seen)
        self.keep.append(obj)
        if isinstance(obj, torch.Tensor):
            self.tensor(obj)
        elif isinstance(obj, np.ndarray):
            if obj.dtype.hasobject:
                raise _Unkeyable("an object array")
            self.token("ndarray", str(obj.dtype), obj.shape)
            self.hash.update(np.ascontiguousarray(obj).tobytes())
        elif isinstance(obj, np.generic):
            self.token("npscalar", str(obj.dtype), obj.item())
        elif isinstance(obj, (tuple, list)):
            self.token(type(obj).__name__, len(obj))
            for item in obj:
                self.walk(item)
        elif isinstance(obj, dict):
            self.token(type(obj).__name__, len(obj))
            for k, v in obj.items():  # insertion order: a different order may change behaviour
                self.walk(k)
                self.walk(v)
        elif isinstance(obj, (set, frozenset)):
            parts = []
            for item in obj:
                sub = _Walker(self.meta_only, self.tensor_values)
                sub.walk(item)
                parts.append(sub.hash.hexdigest())
            self.token(type(obj).__name__, sorted(parts))
        elif isinstance(obj, types.CodeType):
            self.code(obj)
        elif isinstance(obj, types.FunctionType):
            self.function(obj)
        elif isinstance(obj, types.MethodType):
            self.token("method")
            self.walk(obj.__func__)
            self.walk(obj.__self__)
        elif isinstance(obj, functools.partial):
            self.token("partial")
            self.walk(obj.func)
            self.walk(obj.args)
            self.walk(obj.keywords)
        elif isinstance(obj, types.ModuleType):
            self.module(obj, names or set())
        elif isinstance(obj, type):
            self.cls(obj)
        elif isinstance(obj, types.CellType):
            try:
                self.walk(obj.cell_contents)
            except ValueError:  # an empty cell
                self.token("empty cell")
        elif callable(obj) and trusted_module(getattr(obj, "__module__", None)) and (
            isinstance(obj, (types.BuiltinFunctionType, types.BuiltinMethodType)) or type(obj).__module__.startswith("torch._ops")
        ):
            # torch.sin, math.exp, torch.ops.aten.add.Tensor: pinned by the versions.
            self.token("builtin", getattr(obj, "__module__", None), getattr(obj, "__qualname__", None) or repr(obj))
        elif isinstance(obj, (types.MethodDescriptorType, types.WrapperDescriptorType, types.ClassMethodDescriptorType)) and trusted_module(
            getattr(obj.__objclass__, "__module__", None)
        ):  # torch.Tensor.add, str.join: pinned by the versions
            self.token("descriptor", obj.__objclass__.__module__, obj.__qualname__)
        elif (hasattr(obj, "__dict__") and not trusted_module(type(obj).__module__)) or isinstance(obj, torch.nn.Module):
            self.instance(obj)
        else:
            raise _Unkeyable(f"an object of type {type(obj).__module__}.{type(obj).__qualname__}")

    def tensor(self, t: torch.Tensor) -> None:
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided or t.device.type == "meta":
            raise _Unkeyable(f"a {type(t).__name__} with layout {t.layout}")
        self.token("tensor", str(t.dtype), tuple(t.shape), t.device.type, t.requires_grad)
        if id(t) in self.meta_only or not self.tensor_values:
            return
        data = t.detach().cpu().contiguous().reshape(-1)
        if data.numel():
            self.hash.update(data.view(torch.uint8).numpy().tobytes())

    def code(self, code: types.CodeType) -> None:
        self.token("code", code.co_code, code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars,
                   code.co_argcount, code.co_kwonlyargcount, code.co_flags)
        for const in code.co_consts:
            self.walk(const)

    def function(self, fn: types.FunctionType) -> None:
        module = fn.__module__
        if trusted_module(module) and module.split(".")[0] != "torchdi":
            self.token("function", module, fn.__qualname__)  # torch's own Python functions: by version
            return
        self.token("function", fn.__qualname__)
        self.code(fn.__code__)
        self.walk(fn.__defaults__)
        self.walk(fn.__kwdefaults__)
        for cell in fn.__closure__ or ():
            self.walk(cell)
        names = code_names(fn.__code__)
        scope = fn.__globals__
        for name in sorted(names):
            if name in scope:
                self.token("global", name)
                self.walk(scope[name], names)
            elif hasattr(builtins, name):
                self.token("builtin name", name)

    def module(self, module: types.ModuleType, names: set[str]) -> None:
        self.token("module", module.__name__)
        if trusted_module(module.__name__):
            return
        # A user module: what the code reads from it (an attribute named in the code).
        for name in sorted(names):
            if hasattr(module, name):
                self.token("attribute", name)
                self.walk(getattr(module, name), names)

    def cls(self, cls: type) -> None:
        self.token("class", cls.__module__, cls.__qualname__)
        if trusted_module(cls.__module__):
            return
        for base in cls.__bases__:
            self.walk(base)
        for name, value in vars(cls).items():
            if name in CLASS_NOISE:
                continue
            self.token("class attribute", name)
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if isinstance(value, property):
                for part in (value.fget, value.fset, value.fdel):
                    self.walk(part)
                continue
            self.walk(value)

    def instance(self, obj: Any) -> None:
        self.token("instance")
        self.walk(type(obj))
        if hasattr(obj, "__slots__") and not hasattr(obj, "__dict__"):
            raise _Unkeyable(f"a {type(obj).__qualname__} with __slots__")
        self.walk(dict(vars(obj)))


def fingerprint(obj: Any, meta_only: tuple[torch.Tensor, ...] = (), *, tensor_values: bool = True) -> str | None:
    """A hex digest of ``obj`` and everything it reads (see the module docstring), or ``None``
    when some part of it cannot be keyed soundly.

    Args:
        obj: a function (or any object) to key.
        meta_only: tensors to key by dtype, shape and device only (values a preparation never
            reads, such as a context's).
        tensor_values: ``False`` keys every tensor by dtype, shape and device only (a key that
            only has to tell programs apart, not prove them equal: no pass over a model's weights).

    Returns:
        64 hex digits, equal across processes for equal code and data; ``None``: not keyable.

    Example::

        >>> import torch
        >>> scale = 2.0
        >>> def f(x):
        ...     return scale * x.sin()
        >>> a = fingerprint(f)
        >>> scale = 3.0
        >>> a != fingerprint(f)
        True
    """
    walker = _Walker({id(t) for t in meta_only}, tensor_values)
    try:
        walker.walk(obj)
    except Exception:  # _Unkeyable, or an object whose attributes cannot be read: not keyed
        return None
    return walker.hash.hexdigest()


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """A digest of torchdi's own source files: entries from another checkout of the same
    version number (a development tree) never meet this one's."""
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parent
    for path in sorted(root.rglob("*.py")):
        try:
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
        except OSError:
            digest.update(b"unreadable")
    digest.update(sys.version.encode())
    return digest.hexdigest()[:16]
