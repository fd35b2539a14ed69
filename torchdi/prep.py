"""Preparations: what ``prepare_*`` builds once, and the strict check that guards its reuse.

A ``Prep`` holds compiled or built callables and *signatures* of the arguments it was prepared
with: structure, type, shape, dtype and device of every leaf, never the values themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np
import torch
from torch.utils import _pytree as pytree

from torchdi.errors import PreparationMismatchError
from torchdi.runners import Publishes, checked_entry, implements, num_compilations, runner_path
from torchdi.translate import IMMUTABLE_STATIC, to_device_tensor

__all__ = ["PreparationMismatchError", "Prep", "describe", "describe_contexts"]


def _static_key(obj: Any) -> Any:
    """How a static leaf is compared across calls, without keeping the user's object alive.

    Immutable values (ints, strings, ``Static`` wrappers ...) are compared by value. Any other
    object is described by its type only: comparing it with ``==`` may be ambiguous (tensors
    inside a dataclass) and remembering it would keep it alive; what a compiled program reads
    from it is watched by the compiler's own guards, which recompile (counted and logged)
    rather than run a stale program.
    """
    if isinstance(obj, IMMUTABLE_STATIC):
        return obj
    return _ANY_VALUE


class _AnyValue:
    """The static key of a mutable object: any value of its type."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<any value>"


_ANY_VALUE = _AnyValue()


def _translates(kind: type) -> bool:
    """Whether a user registered ``kind`` with ``to_device_tensor`` (it is then traced, not static)."""
    return to_device_tensor.dispatch(kind) is not to_device_tensor.dispatch(object)


def describe(obj: Any, keep_static: bool = False) -> Any:
    """A hashable description of ``obj`` that is equal across calls iff a ``Prep`` may be reused.

    Tensors are described by type, shape, dtype and device; numpy arrays by shape and dtype;
    Python/numpy scalars by type (their values are free to change); containers (every
    registered pytree node: dict, ``OrderedDict``, list, tuple, namedtuple, user nodes) by type,
    keys and the descriptions of their items; a type registered with ``to_device_tensor`` by
    the description of its translation. Other leaves are static: with ``keep_static`` an
    immutable value (int, str, ``Static(value)`` ...) is part of the description, since a compiled
    program bakes it in; other objects are described by their type.

    Example::

        >>> describe(torch.ones(2)) == describe(torch.zeros(2))
        True
    """
    if isinstance(obj, torch.Tensor):
        return (type(obj), obj.shape, obj.dtype, obj.device)
    kind = type(obj)
    if kind is dict:
        # (list comprehensions: a generator costs a frame per call, and this runs on every call)
        return (dict, tuple([(key, describe(value, keep_static)) for key, value in obj.items()]))
    if kind is tuple or kind is list or (isinstance(obj, tuple) and hasattr(obj, "_fields")):
        return (kind, tuple([describe(item, keep_static) for item in obj]))
    if isinstance(obj, (float, complex, np.generic)) and not isinstance(obj, (bool, np.bool_)):
        return (kind,)
    if isinstance(obj, np.ndarray):
        return (np.ndarray, obj.shape, obj.dtype)
    if isinstance(obj, dict) and kind in pytree.SUPPORTED_NODES:  # OrderedDict, defaultdict
        return (kind, tuple((key, describe(value, keep_static)) for key, value in obj.items()))
    node = pytree.SUPPORTED_NODES.get(kind)
    if node is not None:  # a user-registered container (or deque ...): its children, in order
        children, context = node.flatten_fn(obj)
        return (kind, tuple(describe(child, keep_static) for child in children), _context_key(context))
    if _translates(kind):
        translated = to_device_tensor(obj, None)
        if translated is not obj:  # a user type made traced; Static and the like stay static
            return (kind, "translated", describe(translated, keep_static))
    if keep_static:
        return (kind, _static_key(obj))
    return (kind,)


def _context_key(context: Any) -> Any:
    """A pytree node's flatten context, compared safely (it must hold no tensors)."""
    try:
        hash(context)
    except TypeError:
        return repr(context)
    return context if not isinstance(context, torch.Tensor) else _ANY_VALUE


def describe_contexts(values: tuple[Any, ...], kinds: tuple[str, ...], keep_static: bool) -> tuple[Any, ...]:
    """One description per context: its wrapper (``context_kinds``) and its value's description."""
    return tuple([(kind, describe(value, keep_static)) for value, kind in zip(values, kinds)])


def format_description(desc: Any) -> str:
    """A readable rendering of a ``describe`` result."""
    kind = desc[0]
    if isinstance(kind, type) and issubclass(kind, torch.Tensor):
        _, shape, dtype, device = desc
        return f"{kind.__name__}(shape={tuple(shape)}, dtype={dtype}, device={device})"
    if isinstance(kind, type) and issubclass(kind, dict) and len(desc) == 2:
        items = "{" + ", ".join(f"{key!r}: {format_description(d)}" for key, d in desc[1]) + "}"
        return f"dict{items}" if kind is dict else f"{kind.__name__}({items})"
    if isinstance(kind, type) and issubclass(kind, (tuple, list)) and len(desc) == 2 and isinstance(desc[1], tuple):
        inner = ", ".join(format_description(d) for d in desc[1])
        return f"{kind.__name__}({inner})" if kind not in (tuple, list) else ("[" + inner + "]" if kind is list else "(" + inner + ")")
    if kind is np.ndarray:
        return f"ndarray(shape={desc[1]}, dtype={desc[2]})"
    if kind in ("Constant", "Cache", "State"):
        return f"{kind}({format_description(desc[1])})"
    name = kind.__name__ if isinstance(kind, type) else str(kind)
    if len(desc) == 3 and desc[1] == "translated":
        return f"{name}(translated to {format_description(desc[2])})"
    if len(desc) == 3:  # a registered pytree node
        return f"{name}(" + ", ".join(format_description(d) for d in desc[1]) + ")"
    if len(desc) == 2:
        value = desc[1]
        return f"{name}(any value)" if value is _ANY_VALUE else f"{name}(static value {value!r})"
    return f"{name}(any value)"


def _shorten(text: str, limit: int = 400) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Prep:
    """The result of ``prepare_<operator>``: reusable while the arguments keep their signatures.

    A ``Prep`` may be reused while ``f`` and ``backend`` are the same and ``x``, the tangents
    and each context keep their pytree structure, type, shape, dtype and device; values may
    change freely. It keeps no reference to the user's ``x``, tangents or context values.
    A ``Prep`` is not thread-safe: use one per thread.

    With ``strict=False`` a call whose ``x`` or tangents have another structure, shape, dtype or
    device than at preparation is served by a preparation made again for them (kept in
    ``variants``, at most ``MAX_VARIANTS``, for later calls like it), or refused with
    ``PreparationMismatchError`` where the backend cannot prepare again soundly (an ``AutoSparse``
    pattern is per shape of ``x``): what the prepared runners hold for one signature (seeds, bases,
    step sizes, a sparsity pattern) never serves another.

    Attributes:
        operator: the operator family it serves (``"gradient"`` serves ``gradient`` and
            ``value_and_gradient``).
        backend: the backend it was prepared for.
        strict: whether each call checks the arguments' signatures (``False``: those of ``x`` and
            the tangents only, see above).
        num_compilations: how many graphs a compiler compiled for this preparation (0 for
            eager backends). It does not grow over calls that satisfy the rules (one program
            serves the operator and its ``value_`` variant), except when one of the compiler's
            own guards fails (a global, a closure cell, the grad mode ... changed), exactly where
            raw ``torch.compile`` would recompile. A ``strict=False`` preparation counts those of
            the preparations it made again for other ``x`` too.
        output_shape: shape of ``f(x, ...)`` at preparation (``None`` for pytree outputs).
    """

    __slots__ = (
        "__weakref__",
        "_expected",
        "_names",
        "backend",
        "call",
        "f",
        "f_needs_grad",
        "has_aux",
        "keep_static",
        "lean_call",
        "learned",
        "loose_key",
        "operator",
        "output_shape",
        "point",
        "reads_tracked",
        "rebuild",
        "recompute_refusal",
        "retired_compilations",
        "runner",
        "strict",
        "transparent_runners",
        "variants",
    )

    MAX_VARIANTS = 8  # (dynamo's own default recompile limit per code object)

    def __init__(
        self,
        operator: str,
        f: Callable[..., Any],
        backend: Any,
        expected: tuple[Any, ...],
        names: tuple[str, ...],
        runner: Callable[..., Any],
        strict: bool,
        keep_static: bool,
        output_shape: torch.Size | None,
    ) -> None:
        self.operator = operator
        self.f = f
        self.backend = backend
        self._expected = expected
        self._names = names
        self.runner = runner
        # One runner serves the plain operator and its value_ variant (rule 2: nothing compiles
        # after preparation; the plain operator drops the value).
        self.call = _entry(runner, strict)
        # What the plain operator runs when the runner has a cheaper value-free way (a compiled
        # gradient's second copy of its program), else None (it runs call). Set by prepare_operator.
        self.lean_call: Callable[..., Any] | None = None
        self.strict = strict
        self.keep_static = keep_static
        self.output_shape = output_shape
        # Rule 10 (torchdi.operators._transparent): whether f read a tensor that requires grad
        # besides x at preparation, and the runners that serve calls under outer transforms when
        # this one does not fit (torch.autograd.grad under torch.func transforms and dynamo, the
        # plain gradient without its value, AutoFunc's gradient under torch.autograd alone):
        # rebuild(variant, lean), built on first use (variants: _transparent.VARIANTS).
        self.reads_tracked = False
        self.rebuild: Callable[[str, bool], Callable[..., Any]] | None = None
        self.transparent_runners: dict[tuple[str, bool], Callable[..., Any]] = {}
        # f calls torch.autograd itself and its backend evaluates f as it is (rule 10): the plain
        # call runs with grad mode on and detaches its results. Set by prepare_operator.
        self.f_needs_grad = False
        # Why torch.autograd cannot differentiate a compiled result by recomputing it eagerly in
        # backward (f draws random numbers, a State context), or None. Set by prepare_operator.
        self.recompute_refusal: str | None = None
        # f returns (y, aux) (has_aux=True): set by prepare_operator, checked on every call.
        self.has_aux = False
        # A same-point preparation's point (prepare_*_same_point): checked on every call.
        self.point: Any = None
        # What a preparation under a torch.func transform learned about f's output, which later
        # one-shot calls there reuse (torchdi.operators._one_shot), or None. Set by prepare_operator.
        self.learned: Any = None
        # strict=False: the descriptions of x (and the tangents) at preparation, which every call
        # still compares (strict=False skips the contexts' signatures only: set by prepare_operator),
        # the preparations made again for other ones (oldest first), and the compilations of those
        # dropped beyond MAX_VARIANTS (num_compilations never goes down).
        self.loose_key: tuple[Any, ...] = expected[:1]
        self.variants: dict[Any, Prep] = {}
        self.retired_compilations = 0

    def __getattr__(self, name: str) -> Any:
        # What a runner publishes about its preparation (AutoSparse: sparsity_pattern, ncolors, ...).
        try:
            runner = object.__getattribute__(self, "runner")
        except AttributeError:  # during unpickling or before __init__
            runner = None
        published = runner.published if implements(runner, Publishes) else {}
        if name in published:
            return published[name]
        raise AttributeError(f"'Prep' object has no attribute {name!r}")

    @property
    def num_compilations(self) -> int:
        count = num_compilations(self.runner)
        if self.variants or self.retired_compilations:
            count += self.retired_compilations + sum(variant.num_compilations for variant in self.variants.values())
        return count

    def keep_variant(self, key: Any, variant: Prep) -> None:
        """Keep ``variant``, prepared again for a ``strict=False`` call whose ``x`` (and tangents)
        are described by ``key``, dropping the oldest beyond ``MAX_VARIANTS`` (an ``x`` whose shape
        changes at every call must not keep a compiled program per shape alive)."""
        if len(self.variants) >= self.MAX_VARIANTS:
            oldest = next(iter(self.variants))
            self.retired_compilations += self.variants.pop(oldest).num_compilations
        self.variants[key] = variant

    def refuse_x(self, operator: str, received: Any, why: str) -> NoReturn:
        """Raise ``PreparationMismatchError`` for a ``strict=False`` call whose ``x`` (described by
        ``received``) this preparation cannot serve, nor prepare again for; ``why`` says what works."""
        expected = self.loose_key[0]
        raise PreparationMismatchError(
            f"{operator}: prep (prepared for {self.operator!r}, backend {self.backend!r}, strict=False) cannot serve this call:\n"
            f"  x: mismatch: expected {_shorten(format_description(expected))}, "
            f"received {_shorten(format_description(received))}{_hint(expected, received)}\n"
            f"  {why}"
        )

    def __repr__(self) -> str:
        # Engines with more than one way to run (AutoXLA: traced once, or its lazy fallback) say which.
        path = runner_path(self.runner)
        shown = "" if path is None else f", path={path!r}"
        return (
            f"Prep(operator={self.operator!r}, backend={self.backend!r}, strict={self.strict}, "
            f"num_compilations={self.num_compilations}{shown})"
        )

    def serves(self, operator: str, f: Callable[..., Any], backend: Any, received: tuple[Any, ...]) -> bool:
        """Whether a call with these arguments' descriptions may use this preparation."""
        return (
            received == self._expected
            and operator == self.operator
            and (f is self.f or f == self.f)
            and (backend is self.backend or backend == self.backend)
        )

    def check(
        self,
        operator: str,
        f: Callable[..., Any],
        backend: Any,
        received: tuple[Any, ...] | None,
        names: tuple[str, ...] | None = None,
    ) -> None:
        """Raise ``PreparationMismatchError`` unless the call matches the preparation.

        ``received`` holds the descriptions of ``x``, the tangents and the contexts, named by
        ``names`` (the public names ``x``, ``tx``/``ty``, ``context 1..n``; default: the names
        given at preparation). ``None`` checks only the operator, ``f`` and the backend (what a
        ``strict=False`` Prep checks besides the signatures of ``x`` and the tangents).
        """
        same_f = f is self.f or f == self.f
        same_backend = backend is self.backend or backend == self.backend
        if (received is None or received == self._expected) and operator == self.operator and same_f and same_backend:
            return
        lines = [f"prep (prepared for {self.operator!r}, backend {self.backend!r}) cannot serve this call:"]
        lines.append(
            f"  operator: {'ok' if operator == self.operator else f'mismatch: expected {self.operator!r}, received {operator!r}'}"
        )
        lines.append(
            "  f: " + ("ok" if same_f else f"mismatch: expected {self.f!r}, received {f!r} (prepare again for a new function)")
        )
        lines.append("  backend: " + ("ok" if same_backend else f"mismatch: expected {self.backend!r}, received {backend!r}"))
        if received is None:
            lines.append("  arguments: not checked (strict=False)")
            raise PreparationMismatchError("\n".join(lines))
        if len(received) != len(self._expected):
            lines.append(
                f"  arguments: mismatch: prepared with {len(self._expected)} ({', '.join(self._names)}), "
                f"received {len(received)}"
            )
        got = dict(zip(self._names if names is None else names, received))
        for name, expected in zip(self._names, self._expected):
            if name not in got:
                lines.append(f"  {name}: mismatch: expected {_shorten(format_description(expected))}, received nothing")
            elif got[name] == expected:
                lines.append(f"  {name}: ok")
            else:
                lines.append(
                    f"  {name}: mismatch: expected {_shorten(format_description(expected))}, "
                    f"received {_shorten(format_description(got[name]))}{_hint(expected, got[name])}"
                )
        for name in got:
            if name not in self._names:
                lines.append(f"  {name}: mismatch: not present at preparation, received {_shorten(format_description(got[name]))}")
        raise PreparationMismatchError("\n".join(lines))


def _entry(runner: Callable[..., Any], strict: bool) -> Callable[..., Any]:
    """What a call runs: a strict-checked call may take the runner's faster path, if it has one."""
    return checked_entry(runner) if strict else runner


def _hint(expected: Any, received: Any) -> str:
    """Say which dimension changed when only a tensor's shape differs (e.g. a last batch)."""
    e_kind, r_kind = expected[0], received[0]
    if e_kind in ("Constant", "Cache", "State") and r_kind == e_kind:
        return _hint(expected[1], received[1])
    if isinstance(e_kind, type) and issubclass(e_kind, dict) and r_kind is e_kind and len(expected) == 2:
        # items are (key, description) pairs
        pairs = [(f"key {ek!r}", ed, rd) for (ek, ed), (rk, rd) in zip(expected[1], received[1]) if ek == rk]
    elif e_kind in (tuple, list) and r_kind is e_kind and len(expected[1]) == len(received[1]):
        pairs = [(f"item {i}", ed, rd) for i, (ed, rd) in enumerate(zip(expected[1], received[1]))]
    else:
        pairs = None
    if pairs is not None:
        for where, ed, rd in pairs:
            if ed != rd:
                hint = _hint(ed, rd)
                return f" (in {where}){hint}" if hint else f" (first difference in {where})"
        return ""
    if not (isinstance(e_kind, type) and issubclass(e_kind, torch.Tensor) and e_kind is r_kind):
        return ""
    _, e_shape, e_dtype, e_device = expected
    _, r_shape, r_dtype, r_device = received
    if len(e_shape) == len(r_shape) and e_dtype == r_dtype and e_device == r_device:
        dims = [d for d in range(len(e_shape)) if e_shape[d] != r_shape[d]]
        changes = ", ".join(f"dim {d}: {e_shape[d]} -> {r_shape[d]}" for d in dims)
        advice = (
            " — a smaller last batch? use drop_last=True in the DataLoader, or prepare a second Prep for that shape"
            if dims == [0]
            else " — prepare again for the new shape"
        )
        return f" [shape changed at {changes}{advice}]"
    return ""
