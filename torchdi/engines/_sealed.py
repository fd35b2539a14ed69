"""Sealed programs: a persisted AOTInductor preparation loaded and run without dynamo.

A warm re-run of ``AutoCompile(compiler="aot_inductor", cache_dir=...)`` otherwise imports dynamo
(1.1-1.5 s of a 1.5 s first result on the MLP) only to trace ``f`` again and rebuild its guards.
A *seal* is what dynamo decided, written down where it can be read back without dynamo: every
guard dynamo installed for the preparation's one graph (``torch.compile``'s public
``guard_filter_fn`` hands each one over, with the object it guards), translated into a check
torchdi evaluates itself, the sources of the graph's inputs, how the result is built from the
program's outputs, and the keys of the AOTInductor programs. A later preparation with the same
key loads the seal, evaluates every guard's source in this process and compares what it finds
with what the seal describes (``describe_object``: a module by name; torch's and torchdi's
objects by qualified name, pinned by the versions every cache entry carries; a user's function,
class or object by ``torchdi.fingerprint`` of its code and everything it reads), and from then
on runs the program after checking every guard on every call, as dynamo would (rule 7). A check
that fails hands the call to dynamo (a compilation, counted and logged with the failed check),
which traces, guards and loads the program as before: never a stale result.

What is sealed, and what is not (a refusal only means the preparation goes through dynamo):

- one graph without breaks, every program an AOTInductor one (``_aoti_private``: pure graphs of
  plain CPU tensors), whose transformed bytecode calls that graph once and stores nothing
  (``STORE_ATTR``, ``STORE_GLOBAL`` and the like: a side effect dynamo would replay);
- every guard of a kind in ``_CHECKS`` and every source in the grammar of ``_parse`` (locals,
  the entry point's globals, modules, attributes, constant subscripts, ``type()``, a dict's n-th
  key); any other guard, a symbolic shape guard (a float context's) among them, is not sealed;
- a global state dynamo guards, read back with public functions or C++ objects that need no
  dynamo: ``torch._C._dynamo.guards.GlobalStateGuard`` (grad mode, autocast, deterministic
  algorithms, default dtype, threads ...; its ``__getstate__``/``__setstate__``), the functorch
  interpreter stack (empty), the torch-function mode stack (empty), the forward-AD level, the
  saved-tensors hooks (none) and the default device.

The global state's private internals are fenced in ``engines/_dynamo.py`` (``"sealed_programs"``); dynamo's guard
entries' fields (``guard_type``, ``name``, ``value``, ``derived_guard_types``, ``orig_guard.
create_fn``) and its graph inputs' ``grapharg`` sources are read here, and any that a torch
lacks makes the seal's record fail: nothing is sealed, the preparation goes through dynamo.
"""

from __future__ import annotations

import ast
import dis
import importlib
import json
import logging
import math
import operator
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from torchdi.engines._dynamo import global_state, global_state_check
from torchdi.fingerprint import SIMPLE_TYPES, fingerprint, trusted_module

__all__ = ["SEAL_FORMAT", "Sealed", "SealRecorder", "Unsealable", "describe_object", "dumps", "loads", "tensor_layout"]

logger = logging.getLogger("torchdi")

#: The seal's layout version (a cache entry of another is ignored).
SEAL_FORMAT = 1

# Where torch's and torchdi's code lives (a place there is pinned by their versions).
_PACKAGE_ROOTS = {
    "torch": str(Path(torch.__file__ or ".").resolve().parent) + "/",
    "torchdi": str(Path(__file__).resolve().parent.parent) + "/",
}

# The attributes torch._dynamo.mark_dynamic and its kin set on a tensor (TENSOR_MATCH's hasattr guards).
_DYNAMIC_MARKS = ("_dynamo_dynamic_indices", "_dynamo_weak_dynamic_indices", "_dynamo_unbacked_indices",
                  "_dynamo_strict_unbacked_indices", "_dynamo_static_indices")

# The entry-point globals dynamo adds for a globals dict it reached without a source.
_UNNAMED_SCOPE = "___unnamed_scope"

# Bytecode the transformed entry point may hold besides its one call of the graph: loads, the
# result's containers, stack shuffles. Anything else (a store into an object, an import, a
# second call) is a side effect or logic the seal does not replay.
_PURE_OPNAMES = frozenset({
    "RESUME", "NOP", "CACHE", "LOAD_GLOBAL", "LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_AND_CLEAR", "LOAD_FAST_LOAD_FAST",
    "LOAD_CONST", "LOAD_SMALL_INT", "LOAD_ATTR", "LOAD_DEREF", "BINARY_SUBSCR", "BUILD_TUPLE", "BUILD_LIST", "BUILD_MAP",
    "BUILD_CONST_KEY_MAP", "LIST_EXTEND", "LIST_APPEND", "UNPACK_SEQUENCE", "STORE_FAST", "DELETE_FAST", "COPY", "SWAP",
    "POP_TOP", "RETURN_VALUE", "RETURN_CONST", "PUSH_NULL", "PRECALL", "CALL", "KW_NAMES", "COPY_FREE_VARS", "MAKE_CELL",
    "EXTENDED_ARG", "BINARY_OP",
})
_CALL_OPNAMES = frozenset({"CALL", "CALL_FUNCTION", "CALL_FUNCTION_EX", "CALL_KW"})


class Unsealable(Exception):
    """Raised while recording or loading a seal: what stops it (the preparation uses dynamo)."""


# -- describing an object across processes -----------------------------------------------------

def _resolve(module: str, qualname: str) -> Any:
    found: Any = sys.modules.get(module)
    for part in qualname.split("."):
        if found is None or part == "<locals>":
            return None
        found = getattr(found, part, None)
    return found


def _pinned(module: Any) -> bool:
    """Whether a module's objects are pinned by name: torch's, numpy's, torchdi's or the standard
    library's (torch's version, and torchdi's source digest with Python's version in it, key
    every cache entry)."""
    return isinstance(module, str) and (trusted_module(module) or module.split(".")[0] in sys.stdlib_module_names)


def _code_place(code: types.CodeType) -> list[Any] | None:
    """Where torch's or torchdi's ``code`` is: its file under the package, qualified name and line
    (pinned by the versions in every cache entry), or ``None`` for anyone else's code."""
    filename = str(Path(code.co_filename).resolve()) if code.co_filename and not code.co_filename.startswith("<") else ""
    for name, root in _PACKAGE_ROOTS.items():
        if filename.startswith(root):
            return [name, filename[len(root):], code.co_qualname, code.co_firstlineno]
    return None


def describe_object(obj: Any) -> dict[str, Any]:
    """What identifies ``obj`` across processes, for a guard that compares it by identity.

    A module by name; an object reached by its module and qualified name (``torch.tanh``,
    ``torch.utils._pytree.tree_map``) by those, plus its fingerprint when the module is a user's;
    a closure of torch's or torchdi's by where its code is; an instance of one of their types by
    that type; anything else by ``torchdi.fingerprint`` (code, closure, what it reads; tensors by
    metadata). Raises ``Unsealable`` when none applies (a C extension's object).

    Example::

        >>> import torch
        >>> describe_object(torch.nn.functional.relu)
        {'named': ['torch.nn.functional', 'relu']}
    """
    if isinstance(obj, types.ModuleType):
        if sys.modules.get(obj.__name__) is not obj:
            raise Unsealable(f"module {obj.__name__} is not the one imported under its name")
        return {"module": obj.__name__}
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str) and _resolve(module, qualname) is obj:
        if _pinned(module):
            return {"named": [module, qualname]}
        digest = fingerprint(obj, tensor_values=False)
        if digest is None:
            raise Unsealable(f"{module}.{qualname} cannot be fingerprinted")
        return {"named": [module, qualname], "fingerprint": digest}
    if isinstance(obj, type) and _pinned(module):
        alias = next((name for name, value in vars(types).items() if value is obj), None)
        if alias is not None:  # NoneType, FunctionType ...: builtins' types named by the types module
            return {"named": ["types", alias]}
    if isinstance(obj, types.FunctionType):
        place = _code_place(obj.__code__)
        if place is not None:
            return {"code": place}
    elif isinstance(obj, (types.BuiltinFunctionType, types.MethodDescriptorType, types.WrapperDescriptorType, types.ClassMethodDescriptorType)):
        bound_to = getattr(obj, "__self__", None)  # (tuple.__new__: a builtin bound to its type)
        owner = getattr(obj, "__objclass__", None) or (bound_to if isinstance(bound_to, type) else None)
        module = module if isinstance(module, str) else getattr(owner, "__module__", None)
        if _pinned(module):  # torch.tanh, len, Tensor.add: by name, pinned by the versions
            return {"builtin": [type(obj).__name__, module, qualname, getattr(obj, "__name__", None), getattr(owner, "__qualname__", None)]}
    elif _pinned(type(obj).__module__) and not isinstance(obj, (torch.Tensor, torch.nn.Module)):
        # An object of torch's or torchdi's own (an operator, pytree's leaf spec), reached through
        # their modules: by type, and by its repr where that names it (not an address).
        text = repr(obj)
        return {"instance": [type(obj).__module__, type(obj).__qualname__, None if "0x" in text else text[:200]]}
    digest = fingerprint(obj, tensor_values=False)
    if digest is None and isinstance(obj, types.FunctionType):
        # A function whose globals cannot be keyed (a namedtuple's generated __new__): by its code
        # alone. What the trace read through it (its globals, its cells) has guards of its own.
        digest = fingerprint(obj.__code__, tensor_values=False)
        if digest is not None:
            return {"code_of": [obj.__qualname__, digest]}
    if digest is None:
        raise Unsealable(f"a {type(obj).__qualname__} that cannot be fingerprinted")
    return {"fingerprint": digest}


def _literal(value: Any) -> str:
    """``value`` written so that ``ast.literal_eval`` gives it back (simple values and tuples/lists of them)."""
    text = repr(value)
    try:
        back = ast.literal_eval(text)
    except (ValueError, SyntaxError) as error:
        raise Unsealable(f"the value {text[:60]} cannot be written down") from error
    if type(back) is not type(value) or back != value:
        raise Unsealable(f"the value {text[:60]} does not read back as itself")
    return text


def _simple(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(map(_simple, value))
    return isinstance(value, SIMPLE_TYPES) and not (isinstance(value, float) and not math.isfinite(value))


# -- sources: dynamo's names of places, parsed into steps -----------------------------------

# A step: ("L", name) a local; ("G", key) the entry point's global; ("module", name); then
# ("attr", name), ("item", constant), ("type", None), ("dict", None), ("key_at", index),
# ("value_at", index) from the step before.
Step = tuple[str, Any]


def _parse(name: str, locals_: tuple[str, ...]) -> tuple[Step, ...]:
    """The steps of dynamo's source ``name`` (``"G['runner'].__closure__[0].cell_contents"``)."""
    try:
        tree = ast.parse(name, mode="eval").body
    except SyntaxError as error:
        raise Unsealable(f"source {name!r} does not parse") from error
    return tuple(_steps(tree, locals_, name))


def _keys_of_dict(node: ast.AST) -> ast.AST | None:
    """``X`` where ``node`` is ``list(dict.keys(X))``, else ``None``."""
    if (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "list" and len(node.args) == 1
        and isinstance(node.args[0], ast.Call) and ast.unparse(node.args[0].func) == "dict.keys" and len(node.args[0].args) == 1
    ):
        return node.args[0].args[0]
    return None


def _constant(node: ast.AST, name: str) -> Any:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, str)) and not isinstance(node.value, bool):
        return node.value
    raise Unsealable(f"source {name!r}: a subscript that is not a constant")


def _steps(node: ast.AST, locals_: tuple[str, ...], name: str) -> list[Step]:
    if isinstance(node, ast.Name) and node.id in locals_:
        return [("L", node.id)]
    if isinstance(node, ast.Subscript):
        if isinstance(node.value, ast.Name) and node.value.id in ("L", "G"):
            return [(node.value.id, _constant(node.slice, name))]
        keys_of = _keys_of_dict(node.value)
        if keys_of is not None:  # list(dict.keys(X))[i]: the i-th key of the dict X
            return [*_steps(keys_of, locals_, name), ("key_at", _constant(node.slice, name))]
        if isinstance(node.slice, ast.Subscript):  # X[list(dict.keys(X))[i]]: the value at X's i-th key
            keys_of = _keys_of_dict(node.slice.value)
            if keys_of is not None and ast.unparse(keys_of) == ast.unparse(node.value):
                return [*_steps(node.value, locals_, name), ("value_at", _constant(node.slice.slice, name))]
        return [*_steps(node.value, locals_, name), ("item", _constant(node.slice, name))]
    if isinstance(node, ast.Attribute):
        return [*_steps(node.value, locals_, name), ("attr", node.attr)]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) == 1 and not node.keywords:
        if node.func.id == "__import__":
            return [("module", _constant(node.args[0], name))]
        if node.func.id == "type":
            return [*_steps(node.args[0], locals_, name), ("type", None)]
        if node.func.id == "dict":  # (a class's namespace, read as a plain dict)
            return [*_steps(node.args[0], locals_, name), ("dict", None)]
    raise Unsealable(f"source {name!r} is outside what a seal evaluates")


def _global_root(key: Any, entry_globals: dict[str, Any]) -> Step:
    """What the entry point's global ``key`` is, said so that another process finds it again."""
    if key == "runner":
        return ("G", "runner")
    value = entry_globals.get(key)
    if isinstance(key, str) and key.startswith("__import_") and isinstance(value, types.ModuleType):
        if sys.modules.get(value.__name__) is not value:
            raise Unsealable(f"global {key}: module {value.__name__} is not the one imported under its name")
        return ("module", value.__name__)
    if isinstance(key, str) and key.startswith("__builtins_dict") and value is vars(sys.modules["builtins"]):
        return ("builtins", None)
    raise Unsealable(f"global {key!r} of the entry point")


def _getter(step: Step, runner: Any) -> Callable[[Any], Any]:
    """The step as one call on the object before it (a root's: on the frame of arguments by name;
    ``runner``: what ``("G", "runner")`` is)."""
    kind, argument = step
    if kind == "L":
        return operator.itemgetter(argument)
    if kind == "G":
        return lambda frame: runner
    if kind == "module":
        modules = sys.modules
        return lambda frame: modules[argument]
    if kind == "builtins":
        namespace = vars(sys.modules["builtins"])
        return lambda frame: namespace
    if kind == "attr":
        return operator.attrgetter(argument)
    if kind == "item":
        return operator.itemgetter(argument)
    if kind == "type":
        return type
    if kind == "dict":
        return dict
    if kind == "key_at":
        return lambda value: list(value)[argument]
    if kind == "value_at":
        return lambda value: list(value.values())[argument]
    raise Unsealable(f"step {kind}")


def _identity_pattern(tensors: tuple[Any, ...]) -> tuple[int, ...]:
    """Which of ``tensors`` are one object: each one's first position among them."""
    first: dict[int, int] = {}
    return tuple(first.setdefault(id(tensor), n) for n, tensor in enumerate(tensors))


# -- checks -------------------------------------------------------------------------------------

def tensor_layout(t: Any) -> list[Any]:
    """What a tensor guard compares: type, dtype, device, shape, strides, offset, grad and layout."""
    return [type(t).__module__ + "." + type(t).__qualname__, str(t.dtype), str(t.device), list(t.shape), list(t.stride()),
            t.storage_offset(), bool(t.requires_grad), t.layout == torch.strided, bool(t.is_inference())]


_IDENTITY = frozenset({"ID_MATCH", "CLOSURE_MATCH", "FUNCTION_MATCH", "BUILTIN_MATCH", "MODULE_MATCH", "CLASS_MATCH", "NN_MODULE"})
_LENGTH = frozenset({"SEQUENCE_LENGTH", "LIST_LENGTH", "TUPLE_ITERATOR_LEN", "DICT_LENGTH"})
_KEYS = frozenset({"DICT_KEYS_MATCH", "MAPPING_KEYS_CHECK", "DICT_KEYS"})
# One key's presence (the guard's own argument: dynamo's create_fn is a partial that names it).
_CONTAINS = {
    "DICT_CONTAINS": ("key", True), "DICT_NOT_CONTAINS": ("key", False), "SET_CONTAINS": ("key", True), "SET_NOT_CONTAINS": ("key", False),
    "NOT_PRESENT_IN_GENERIC_DICT": ("attr", False), "HASATTR": ("attr", True),
}
_VALUE = frozenset({"EQUALS_MATCH", "CONSTANT_MATCH"})
# Implied by the other checks: each source's object is compared by identity or by metadata, and
# the identity pattern of every tensor is compared as a whole (``_identity_pattern``).
_COVERED = frozenset({"NO_TENSOR_ALIASING", "BACKEND_MATCH", "GRAD_MODE", "DETERMINISTIC_ALGORITHMS"})
_GLOBAL = frozenset({"GLOBAL_STATE", "FUNCTORCH_STACK_MATCH", "TORCH_FUNCTION_STATE", "DUAL_LEVEL", "AUTOGRAD_SAVED_TENSORS_HOOKS", "DEFAULT_DEVICE", "SHAPE_ENV"})
# Sub-guards a guard installs that its own check implies (a constant's type and value).
# (DICT_VERSION under DICT_KEYS_MATCH: no change to the dict at all, which the keys check
# compares as keys and each value's identity.)
_DERIVED = frozenset({"BOOL_MATCH", "NONE_MATCH", "DICT_VERSION"})
_CHECKS = _IDENTITY | _LENGTH | _KEYS | set(_CONTAINS) | _VALUE | _COVERED | _GLOBAL | {"TENSOR_MATCH", "TYPE_MATCH", "DUPLICATE_INPUT"}


def _describe_key(key: Any) -> dict[str, Any]:
    return {"value": _literal(key)} if _simple(key) else describe_object(key)


def _key_object(described: dict[str, Any]) -> Any:
    """The object a key's description names, in this process (``Unsealable``: none)."""
    if "value" in described:
        return ast.literal_eval(described["value"])
    if "module" in described and described["module"] in sys.modules:
        return sys.modules[described["module"]]
    if "named" in described and describe_object(found := _resolve(*described["named"])) == described:
        return found
    raise Unsealable(f"a key described as {described} is not found here")


def _import_modules_of(described: list[dict[str, Any]]) -> None:
    """Import torch's modules that define keys a seal recorded and this process lacks: pytree's
    registry (``SUPPORTED_NODES``) fills as torch's modules are imported, and dynamo's import
    had registered ``torch.distributed.tensor``'s types in the process that made the seal."""
    for key in described:
        module = key.get("named", [None])[0]
        if isinstance(module, str) and trusted_module(module) and module.split(".")[0] == "torch" and module not in sys.modules:
            try:
                importlib.import_module(module)
            except ImportError:
                return


# -- recording ------------------------------------------------------------------------------

class SealRecorder:
    """Collects, while a preparation compiles, what a seal needs: dynamo's guard entries
    (``guard_filter``, given to ``torch.compile``) and, per graph, its inputs' sources and its
    programs' keys (``graph``). Holds the guarded objects only until ``record`` (rule 4)."""

    def __init__(self) -> None:
        self.entries: list[list[Any]] = []
        self.graphs: list[list[str] | None] = []

    def guards(self, entries: Any, keep: list[bool]) -> None:
        self.entries.append([entry for entry, kept in zip(entries, keep) if kept])

    def graph(self, graph: torch.fx.GraphModule) -> None:
        names: list[str] | None = []
        for node in graph.graph.nodes:
            if node.op != "placeholder":
                continue
            source = getattr(node.meta.get("grapharg"), "source", None)
            if source is None or names is None:
                names = None
                continue
            name = getattr(source, "name", None)  # (a method before torch 2.13, a property since)
            name = name() if callable(name) else name
            if not isinstance(name, str):
                names = None
                continue
            names.append(name)
        self.graphs.append(names)

    def _scope_owner(self, scope: Any, locals_: tuple[str, ...], entry_globals: dict[str, Any]) -> tuple[Step, ...]:
        """The steps to a globals dict dynamo reached without a source (its "unnamed scope": the
        globals of a namedtuple's generated ``__new__``, such as forward mode's
        ``UnpackedDualTensor``), through a guarded function or class whose globals it is."""
        for guard in self.entries[0] if self.entries else ():
            value = getattr(guard, "value", None) if getattr(guard, "has_value", False) else None
            for attributes in (("__globals__",), ("__new__", "__globals__")):
                found = value
                for attribute in attributes:
                    found = getattr(found, attribute, None)
                if found is scope and scope is not None and not str(guard.name).startswith(("G['" + _UNNAMED_SCOPE, "___")):
                    steps = _parse(guard.name, locals_)
                    if steps[0][0] == "G":
                        steps = (_global_root(steps[0][1], entry_globals), *steps[1:])
                    return (*steps, *(("attr", attribute) for attribute in attributes))
        raise Unsealable("a globals dict dynamo reached without a source")

    def record(self, entry: types.FunctionType, transformed: types.FunctionType, program_keys: list[str], frame: dict[str, Any], spied: tuple[list[Any], list[Any], Any]) -> dict[str, Any]:
        """The seal of a preparation that compiled one graph (``Unsealable`` otherwise).

        Args:
            entry: the entry point dynamo compiled (its globals hold what its guards name).
            transformed: dynamo's transformed code of its one cache entry.
            program_keys: the AOTInductor programs' keys (the graph's, then its value-free copy's).
            frame: the entry point's arguments by name, as they were compiled.
            spied: the arguments the graph was called with, its outputs and the entry's result,
                from one call of ``transformed``.
        """
        if len(self.entries) != 1 or len(self.graphs) != 1 or self.graphs[0] is None:
            raise Unsealable(f"{len(self.entries)} guard sets and {len(self.graphs)} graphs (one of each is sealed)")
        _check_bytecode(transformed.__code__)
        locals_ = tuple(frame)
        runner = entry.__globals__["runner"]
        nodes: dict[tuple[Step, ...], int] = {}
        paths: list[list[Any]] = []  # [parent node or -1, kind, argument], parents first
        found: list[Any] = []

        def node_of(name: str) -> int:
            steps = _parse(name, locals_)
            if steps[0][0] == "G" and str(steps[0][1]).startswith(_UNNAMED_SCOPE):
                steps = (*self._scope_owner(entry.__globals__.get(steps[0][1]), locals_, entry.__globals__), *steps[1:])
            elif steps[0][0] == "G":
                steps = (_global_root(steps[0][1], entry.__globals__), *steps[1:])
            parent = -1
            for depth in range(1, len(steps) + 1):
                prefix = steps[:depth]
                if prefix not in nodes:
                    kind, argument = prefix[-1]
                    value = _getter(prefix[-1], runner)(frame if parent < 0 else found[parent])
                    nodes[prefix] = len(paths)
                    paths.append([parent, kind, argument])
                    found.append(value)
                parent = nodes[prefix]
            return parent

        checks: list[list[Any]] = []
        for guard in self.entries[0]:
            kind = guard.guard_type
            if kind not in _CHECKS:
                raise Unsealable(f"a {kind} guard")
            extra = set(getattr(guard, "derived_guard_types", ()) or ()) - _CHECKS - _DERIVED
            if extra:
                raise Unsealable(f"a {kind} guard deriving {sorted(extra)}")
            if kind in _GLOBAL or kind in _COVERED:
                if kind == "SHAPE_ENV" and getattr(guard.orig_guard, "code_list", None):
                    raise Unsealable("symbolic shape guards (a float context's)")
                continue
            index = node_of(guard.name)
            value = found[index]
            if guard.has_value and value is not guard.value and not (_simple(value) and value == guard.value):
                raise Unsealable(f"source {guard.name!r} evaluates to another object than dynamo's")
            if kind in _IDENTITY:
                if _root_kind(paths, index) == "L" and not isinstance(value, (type, types.ModuleType, types.BuiltinFunctionType)):
                    raise Unsealable(f"an identity guard on an argument ({guard.name}): a seal keeps no argument (rule 4)")
                checks.append([index, "is", describe_object(value)])
            elif kind == "TYPE_MATCH":
                checks.append([index, "type", describe_object(type(value))])
            elif kind == "TENSOR_MATCH":
                if not isinstance(value, torch.Tensor):
                    raise Unsealable(f"a tensor guard on a {type(value).__name__}")
                checks.append([index, "tensor", tensor_layout(value)])
            elif kind in _VALUE:
                if type(value) in (set, frozenset):  # (its items described one by one: types, functions, values)
                    checks.append([index, "value", [type(value).__name__, None, [_describe_key(item) for item in sorted(value, key=repr)]]])
                    continue
                if not _simple(value):
                    raise Unsealable(f"a value guard on a {type(value).__name__}")
                checks.append([index, "value", [type(value).__name__, _literal(value)]])
            elif kind in _LENGTH:
                checks.append([index, "type", describe_object(type(value))])
                checks.append([index, "len", len(value)])
            elif kind == "DUPLICATE_INPUT":  # two sources, one object
                other = (getattr(guard.orig_guard.create_fn, "keywords", None) or {}).get("source_b")
                other_name = getattr(other, "name", None)
                other_name = other_name() if callable(other_name) else other_name
                if not isinstance(other_name, str):
                    raise Unsealable("a DUPLICATE_INPUT guard that does not name its other source")
                other_index = node_of(other_name)
                if found[other_index] is not value:
                    raise Unsealable("a DUPLICATE_INPUT guard that does not hold")
                checks.append([index, "same", other_index])
            elif kind in _CONTAINS:
                argument, present = _CONTAINS[kind]
                key = (getattr(guard.orig_guard.create_fn, "keywords", None) or {}).get(argument)
                if key is None:
                    raise Unsealable(f"a {kind} guard that does not name its {argument}")
                if (key in (vars(value) if argument == "attr" else value)) is not present:
                    raise Unsealable(f"a {kind} guard that does not hold")
                checks.append([index, "contains" if argument == "key" else "attribute", [_describe_key(key), present]])
            else:  # _KEYS: the whole key set, in order
                checks.append([index, "type", describe_object(type(value))])
                checks.append([index, "keys", [_describe_key(key) for key in value]])
        unique: list[list[Any]] = []
        for check in checks:  # (dynamo repeats a guard per place it was met)
            if check not in unique:
                unique.append(check)
        checks = unique
        args, outputs, result = spied
        inputs = [node_of(name) for name in self.graphs[0] or ()]
        if len(inputs) != len(args) or any(found[i] is not arg for i, arg in zip(inputs, args)):
            raise Unsealable("the graph's inputs are not what their sources hold")
        for i, arg in zip(inputs, args):
            if isinstance(arg, torch.Tensor) and not any(c[0] == i and c[1] == "tensor" for c in checks):
                checks.append([i, "tensor", tensor_layout(arg)])
        leaves, spec = pytree.tree_flatten(result)
        built = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                at = next((i for i, out in enumerate(outputs) if out is leaf), None)
                if at is None:
                    raise Unsealable("the result holds a tensor that is not one of the program's outputs")
                built.append(["output", at])
            elif _simple(leaf):
                built.append(["value", _literal(leaf)])
            else:
                raise Unsealable(f"the result holds a {type(leaf).__name__}")
        try:
            treespec = pytree.treespec_dumps(spec)
        except Exception as error:
            raise Unsealable(f"the result's structure cannot be written down ({error})") from error
        return {
            "format": SEAL_FORMAT, "locals": list(locals_), "paths": paths, "checks": checks, "inputs": inputs,
            "result": {"spec": treespec, "leaves": built, "outputs": len(outputs)}, "programs": program_keys,
            "global": global_state(Unsealable),
        }


def _root_kind(paths: list[list[Any]], index: int) -> str:
    while paths[index][0] >= 0:
        index = paths[index][0]
    return str(paths[index][1])


def _check_bytecode(code: types.CodeType) -> None:
    calls = 0
    for instruction in dis.get_instructions(code):
        if instruction.opname not in _PURE_OPNAMES:
            raise Unsealable(f"the transformed code does {instruction.opname}")
        if instruction.opname in _CALL_OPNAMES:
            calls += 1
        if instruction.opname == "BINARY_OP" and instruction.argrepr not in ("[]",):
            raise Unsealable(f"the transformed code computes ({instruction.argrepr})")
    if calls != 1:
        raise Unsealable(f"the transformed code makes {calls} calls (one, the graph's, is sealed)")
    names = [name for name in code.co_names if name.startswith("__compiled_fn")]
    if len(names) != 1:
        raise Unsealable("the transformed code names more than one graph")


# -- loading and running -------------------------------------------------------------------

class Sealed:
    """A loaded seal: its checks bound to this process's objects, and its programs.

    Args:
        seal: what ``SealRecorder.record`` wrote.
        runner: the entry point's ``runner`` (the inner backend's runner of this preparation).
        frame: this preparation's arguments by name (to evaluate the guards' sources once now).
        programs: the AOTInductor programs' ``run`` functions, as ``seal["programs"]`` lists them.

    Raises:
        Unsealable: a source that does not evaluate, or finds another object than the seal's.
    """

    def __init__(self, seal: dict[str, Any], runner: Any, frame: dict[str, Any], programs: list[Callable[[list[Any]], list[Any]]]) -> None:
        if seal.get("format") != SEAL_FORMAT or list(frame) != seal["locals"]:
            raise Unsealable("another seal format or signature")
        self.runner = runner
        self.programs = programs
        self.nodes: list[tuple[int, Step]] = [(int(parent), (str(kind), argument)) for parent, kind, argument in seal["paths"]]
        # values[0] is the frame, node i is values[i + 1]: a root is a step from the frame.
        self.getters = [(parent + 1, _getter(step, runner)) for parent, step in self.nodes]
        self.inputs: list[int] = [int(i) + 1 for i in seal["inputs"]]
        self.global_holds = global_state_check(seal["global"])
        values = self.evaluate(frame)
        if values is None:
            raise Unsealable("a guard's source does not evaluate here")
        self.checks: list[tuple[int, str, Any]] = []
        for node, kind, payload in seal["checks"]:
            index = int(node) + 1
            value = values[index]
            if kind == "is":
                if describe_object(value) != payload:
                    raise Unsealable(f"the object at {self._name(index)} is another one")
                self.checks.append((index, kind, value))
                if isinstance(value, types.FunctionType) and "fingerprint" in payload:
                    # A user's function: a new __code__ is a change too (stricter than dynamo's
                    # identity guard; torch's and torchdi's functions are left as dynamo leaves them).
                    self.checks.append((index, "code", value.__code__))
            elif kind == "type":
                if describe_object(type(value)) != payload:
                    raise Unsealable(f"the type at {self._name(index)} is another one")
                self.checks.append((index, kind, type(value)))
            elif kind == "value":
                if payload[0] in ("set", "frozenset"):
                    expected = (set if payload[0] == "set" else frozenset)(map(_key_object, payload[2]))
                else:
                    expected = ast.literal_eval(payload[1])
                self.checks.append((index, kind, (type(expected), expected)))
            elif kind == "keys":
                if [_describe_key(key) for key in value] != payload:
                    _import_modules_of(payload)  # (a registry filled by an import the seal's process had made)
                    if [_describe_key(key) for key in value] != payload:
                        raise Unsealable(f"the keys at {self._name(index)} are others")
                self.checks.append((index, kind, (tuple(value), tuple(value.values()))))
            elif kind in ("contains", "attribute"):
                self.checks.append((index, kind, (_key_object(payload[0]), bool(payload[1]))))
            elif kind == "same":
                self.checks.append((index, kind, int(payload) + 1))
            elif kind == "tensor":
                self.checks.append((index, kind, _tensor_check(payload)))
            else:  # len
                self.checks.append((index, kind, payload))
        self.tensor_sources = _picker(sorted({index for index, kind, _ in self.checks if kind == "tensor"}))
        self.aliasing = _identity_pattern(self.tensor_sources(values))
        result = seal["result"]
        self.treespec = pytree.treespec_loads(result["spec"])
        self.leaves = [(kind, int(at) if kind == "output" else ast.literal_eval(at)) for kind, at in result["leaves"]]
        self.num_outputs = int(result["outputs"])
        self.failed = ""
        self.holds = self._grouped_checks()
        if self.miss(values) is not None or not self.holds(values):
            raise Unsealable(f"a guard fails here: {self.failed}")
        self.pick_inputs = _picker(self.inputs)
        plain = pytree.tree_flatten(tuple(range(len(self.leaves))))[1]
        self.plain_tuple = self.treespec == plain and all(kind == "output" for kind, _ in self.leaves)

    def _name(self, index: int) -> str:
        steps = []
        index -= 1  # (values[0] is the frame)
        while index >= 0:
            parent, step = self.nodes[index]
            steps.append(f"{step[0]}:{step[1]}")
            index = parent
        return ".".join(reversed(steps))

    def evaluate(self, frame: dict[str, Any]) -> list[Any] | None:
        """Every source's object for this call (``frame`` first, then node by node), or ``None``
        (one does not evaluate: a change)."""
        values: list[Any] = [frame]
        append = values.append
        try:
            for parent, get in self.getters:
                append(get(values[parent]))
        except (AttributeError, KeyError, IndexError, TypeError, ValueError):
            return None
        return values

    def _grouped_checks(self) -> Callable[[list[Any]], bool]:
        """``miss`` as a few calls at C speed: the identity, type, value and length checks each
        compared as one tuple, the rest one by one. (A small MLP's sealed gradient: 36 us a call
        with one Python comparison per check, 23 us grouped; 12 us behind dynamo's C++ guards.)"""
        groups: dict[str, list[tuple[int, Any]]] = {}
        for index, kind, expected in self.checks:
            groups.setdefault(kind, []).append((index, expected))
        is_, global_holds = operator.is_, self.global_holds

        def pair(kind: str) -> tuple[Callable[[list[Any]], tuple[Any, ...]], tuple[Any, ...]]:
            found = groups.get(kind, [])
            return _picker([index for index, _ in found]), tuple(expected for _, expected in found)

        same, same_expected = pair("is")
        code, code_expected = pair("code")
        typed, typed_expected = pair("type")
        valued, valued_expected = pair("value")
        value_types = tuple(kind for kind, _ in valued_expected)
        value_values = tuple(value for _, value in valued_expected)
        sized, sized_expected = pair("len")
        get_code = operator.attrgetter("__code__")
        rest = [(index, kind, expected) for index, kind, expected in self.checks if kind in ("keys", "contains", "attribute", "tensor")]
        tensors = [(index, check) for index, kind, check in rest if kind == "tensor"]
        others = [(index, kind, expected) for index, kind, expected in rest if kind != "tensor"]
        same_pairs = [(index, expected) for index, kind, expected in self.checks if kind == "same"]
        tensor_sources, aliasing = self.tensor_sources, self.aliasing

        def holds(values: list[Any]) -> bool:
            if not global_holds():
                return False
            if not all(map(is_, same(values), same_expected)) or not all(map(is_, map(get_code, code(values)), code_expected)):
                return False
            if not all(map(is_, map(type, typed(values)), typed_expected)):
                return False
            found = valued(values)
            if not all(map(is_, map(type, found), value_types)) or found != value_values:
                return False
            if tuple(map(len, sized(values))) != sized_expected:
                return False
            for index, check in tensors:
                if not check(values[index]):
                    return False
            for index, kind, expected in others:
                if not _other_holds(values[index], kind, expected):
                    return False
            for index, other in same_pairs:
                if values[index] is not values[other]:
                    return False
            return _identity_pattern(tensor_sources(values)) == aliasing

        return holds

    def miss(self, values: list[Any]) -> str | None:
        """The first check that fails for these sources' objects (``None``: all hold)."""
        if not self.global_holds():
            self.failed = "the global state (grad mode, autocast, default dtype, a transform or mode ...)"
            return self.failed
        for index, kind, expected in self.checks:
            value = values[index]
            if kind == "is":
                held = value is expected
            elif kind == "code":
                held = getattr(value, "__code__", None) is expected
            elif kind == "type":
                held = type(value) is expected
            elif kind == "value":
                held = type(value) is expected[0] and value == expected[1]
            elif kind == "len":
                held = len(value) == expected
            elif kind == "same":
                held = value is values[expected]
            elif kind == "tensor":
                held = expected(value)
            else:
                held = _other_holds(value, kind, expected)
            if not held:
                self.failed = f"the guard on {self._name(index)} ({kind})"
                return self.failed
        if _identity_pattern(self.tensor_sources(values)) != self.aliasing:
            self.failed = "which tensors are one and the same"
            return self.failed
        return None

    def __call__(self, frame: dict[str, Any], program: int = 0) -> tuple[bool, Any]:
        """``(True, result)`` after every check held, else ``(False, None)`` (``failed`` says why)."""
        values = self.evaluate(frame)
        if values is None:
            self.failed = "a guard's source no longer evaluates"
            return False, None
        if not self.holds(values):
            if self.miss(values) is None:  # (the grouped checks failed: say which one)
                self.failed = "a guard (the grouped checks)"
            return False, None
        outputs = self.programs[program](list(self.pick_inputs(values)))
        if len(outputs) != self.num_outputs:
            self.failed = "the program's outputs"
            return False, None
        if self.plain_tuple:
            return True, tuple(outputs[at] for _, at in self.leaves)
        leaves = [outputs[at] if kind == "output" else at for kind, at in self.leaves]
        return True, pytree.tree_unflatten(leaves, self.treespec)


def _picker(indices: list[int]) -> Callable[[list[Any]], tuple[Any, ...]]:
    """``values`` at ``indices``, as a tuple (``operator.itemgetter`` gives a bare item for one)."""
    if not indices:
        return lambda values: ()
    if len(indices) == 1:
        only = indices[0]
        return lambda values: (values[only],)
    return operator.itemgetter(*indices)


def _tensor_check(expected: list[Any]) -> Callable[[Any], bool]:
    """``tensor_layout(t) == expected`` without building the layout: torch's own objects compared
    (1.9 -> 0.8 us a tensor)."""
    kind, dtype_name, device_name, shape, stride, offset, requires_grad, strided, inference = expected
    tensor_type: Any = _resolve(*kind.rsplit(".", 1)) if "." in kind else None
    dtype, device = getattr(torch, str(dtype_name).replace("torch.", ""), None), torch.device(device_name)
    layout = torch.strided if strided else None
    shape, stride = torch.Size(shape), tuple(stride)
    if not isinstance(tensor_type, type) or not isinstance(dtype, torch.dtype) or layout is None:
        return lambda t: isinstance(t, torch.Tensor) and tensor_layout(t) == expected and not any(hasattr(t, mark) for mark in _DYNAMIC_MARKS)

    def tensor_holds(t: Any) -> bool:
        return (
            isinstance(t, torch.Tensor) and type(t) is tensor_type and t.dtype is dtype and t.shape == shape and t.stride() == stride
            and t.storage_offset() == offset and t.requires_grad is requires_grad and t.device == device
            and t.layout is layout and t.is_inference() is inference and not any(hasattr(t, mark) for mark in _DYNAMIC_MARKS)
        )

    return tensor_holds


def _other_holds(value: Any, kind: str, expected: Any) -> bool:
    if kind == "keys":
        return tuple(value) == expected[0] and all(map(operator.is_, value.values(), expected[1]))
    if kind == "contains":
        return (expected[0] in value) is expected[1]
    return (expected[0] in vars(value)) is expected[1]  # attribute


def dumps(seal: dict[str, Any]) -> bytes:
    return json.dumps(seal, sort_keys=True).encode()


def loads(payload: bytes) -> dict[str, Any] | None:
    try:
        seal = json.loads(payload)
    except (ValueError, UnicodeDecodeError):
        return None
    return seal if isinstance(seal, dict) and seal.get("format") == SEAL_FORMAT else None

