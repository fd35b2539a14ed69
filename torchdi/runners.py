"""Runners: what engines and operators share.

Each operator family ("gradient", "jacobian", ...) is computed by a *runner*: a pure function
``runner(x, tangents, context_values) -> full result`` built once per preparation by the
backend's engine (or by the generic fallback of the family when the engine has no native
version). ``tangents`` are batched: one pytree shaped like ``x`` (or ``y``) with a leading
dimension, one entry per tangent. The full result of each family holds everything the
``value_and_*`` variant returns; the plain operator drops the value.

This module also holds the typed protocols (``Engine``, the optional parts of a runner) and
the two registries: engines (``register_engine``, called by each module of ``torchdi/engines/``)
and generic fallbacks (``register_fallback``, called by each module of ``torchdi/operators/``).
Engines and operators import this module, never each other: an engine that needs another
backend's runner calls ``build_runner``. ``torchdi/__init__.py`` imports both packages, so the
registries are full whatever a user imports first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeGuard, TypeVar, runtime_checkable

import torch
from torch.utils import _pytree as pytree

from torchdi.backends import _BACKEND_TYPES, Backend
from torchdi.errors import PreparationMismatchError
from torchdi.families import FAMILIES

__all__ = [
    "FALLBACKS",
    "BoundFunction",
    "Composed",
    "CountsCompilations",
    "DropsValue",
    "Engine",
    "HasCheckedCall",
    "HasPath",
    "Publishes",
    "Runner",
    "RunnerFunction",
    "Spec",
    "ServesEmpty",
    "TranslatesContexts",
    "TreeMeta",
    "WarmsUp",
    "build_runner",
    "check_output_shapes",
    "checked_entry",
    "composed",
    "engine_for",
    "implements",
    "num_compilations",
    "output_shape_error",
    "register_engine",
    "register_fallback",
    "replace_spec",
    "runner_path",
    "unbatch",
    "warm_up",
    "zero_runner",
]

# A runner: ``runner(x, batched_tangents, context_values) -> full result`` (a closure, or an
# object with some of the optional parts below).
Runner = Callable[[Any, Any, tuple[Any, ...]], tuple[Any, ...]]
BoundFunction = Callable[[Any, tuple[Any, ...]], Any]


@dataclass(frozen=True)
class TreeMeta:
    """Structure, shapes and dtypes of a tensor pytree (no values)."""

    spec: pytree.TreeSpec
    shapes: tuple[torch.Size, ...]
    dtypes: tuple[torch.dtype, ...]

    @staticmethod
    def of(tree: Any) -> TreeMeta:
        leaves, spec = pytree.tree_flatten(tree)
        return TreeMeta(spec, tuple(leaf.shape for leaf in leaves), tuple(leaf.dtype for leaf in leaves))

    @property
    def is_tensor(self) -> bool:
        return self.spec.is_leaf()

    @property
    def numel(self) -> int:
        return sum(int(torch.Size(s).numel()) for s in self.shapes)

    def basis(self, like: Any) -> Any:
        """The standard basis of this space, batched: leaf ``i`` has shape ``(numel, *shape_i)``.

        ``like`` is a tensor pytree of this structure whose device the basis takes.
        """
        leaves = pytree.tree_leaves(like)
        eye = torch.eye(self.numel, dtype=leaves[0].dtype, device=leaves[0].device)
        pieces = torch.split(eye, [int(torch.Size(s).numel()) for s in self.shapes], dim=1)
        return pytree.tree_unflatten(
            [p.reshape(self.numel, *s).to(d) for p, s, d in zip(pieces, self.shapes, self.dtypes)], self.spec
        )


def check_output_shapes(y: Any, shapes: tuple[torch.Size, ...]) -> None:
    """Refuse an ``f(x)`` whose tensors no longer have the shapes a runner was built for.

    Rule 1 compares ``x``, the tangents and the contexts' layouts, but the shape of ``f(x)`` can
    also follow a context's value (``x[:k]``), a global or a closure cell. A runner that holds
    ``f(x)``'s shape (a jacobian's basis and size, a pullback's cotangents, an ``AutoSparse``
    pattern) would then fail deep inside torch or, worse, return a matrix of the old size. This is
    the one check those runners make: a tuple comparison of shapes per call (dtypes are left
    free: autocast may change them and every runner follows them).

    Args:
        y: ``f(x)`` as the runner received it (a tensor or a pytree of tensors).
        shapes: the shapes the runner was built for, one per leaf of ``y``.

    Raises:
        PreparationMismatchError: naming the shapes received and prepared, and what to do.
    """
    leaves = (y,) if isinstance(y, torch.Tensor) else tuple(pytree.tree_leaves(y))
    received = tuple(leaf.shape for leaf in leaves if isinstance(leaf, torch.Tensor))
    if received != shapes:
        raise output_shape_error(received, shapes)


def output_shape_error(received: tuple[torch.Size, ...], shapes: tuple[torch.Size, ...]) -> PreparationMismatchError:
    """The ``PreparationMismatchError`` of ``check_output_shapes``: ``f(x)`` returned ``received``
    shapes where the runner was built for ``shapes``."""

    def text(found: tuple[torch.Size, ...]) -> str:
        return ", ".join(str(tuple(shape)) for shape in found) or "no tensor"

    return PreparationMismatchError(
        f"f(x) returned shape {text(received)} where this preparation's f(x) had shape {text(shapes)}. "
        f"The preparation holds f(x)'s shape (a jacobian's size and basis, a pullback's cotangents, an AutoSparse "
        f"pattern, a gradient's one element); something f reads besides x (a context's value, a global, a closure cell, an attribute) changed "
        f"it, which the argument check cannot see. Prepare again with the arguments that give the new shape: one "
        f"preparation per shape of f(x)."
    )


@dataclass(frozen=True)
class Spec:
    """What a runner builder may rely on: layouts of ``x`` and ``y``, the number of tangents,
    whether the caller uses the value (``False``: a runner may return ``None`` in its place),
    whether the runner runs inside an outer forward-mode transform (the inner derivative of a
    generic second derivative, or an operator traced by dynamo under an outer transform: context
    tensors then enter forward mode as explicit primals), and the positions of the ``State`` contexts (whose in-place
    updates by ``f`` must reach the caller's tensors)."""

    x: TreeMeta
    y: TreeMeta
    n_tangents: int
    needs_value: bool = True
    inside_forward_mode: bool = False
    state_contexts: tuple[int, ...] = ()
    # f returns (y, aux) and the runner returns (y, aux) as its value (has_aux=True, engines
    # that carry aux through their own transforms).
    has_aux: bool = False


# --------------------------------------------------------------------------------------------
# The runner protocol


class RunnerFunction(Protocol):
    """What every runner is: ``runner(x, batched_tangents, context_values) -> full result``."""

    def __call__(self, x: Any, tangents: Any, contexts: tuple[Any, ...], /) -> tuple[Any, ...]: ...


# The optional parts of a runner, each a protocol of its own (a plain closure is a runner with
# none of them). Read them with implements (isinstance's test, faster), never with getattr: a
# typo is then a type error.

P = TypeVar("P")
T = TypeVar("T", bound=type)
_MEMBERS: dict[Any, tuple[str, ...]] = {}


def checkable(protocol: T) -> T:
    """``typing.runtime_checkable``, and the protocol's members recorded for ``implements``.

    Recorded here, at import, not on the first ``implements``: that first check can run while
    dynamo traces an operator (``torch.compile(fullgraph=True)`` around the user's first torchdi
    call), where filling a dict and then reading the protocol's ``__dict__`` is a graph break."""
    names = {**vars(protocol), **vars(protocol).get("__annotations__", {})}
    _MEMBERS[protocol] = tuple(sorted(name for name in names if not name.startswith("_")))
    return runtime_checkable(protocol)


@checkable
class WarmsUp(Protocol):
    """A runner with work to do once, at preparation, on the preparation's arguments
    (compiling a program, detecting a sparsity pattern)."""

    def warm_up(self, x: Any, tangents: Any, contexts: tuple[Any, ...], /) -> None: ...


@checkable
class HasCheckedCall(Protocol):
    """A runner with a faster entry for calls whose strict check has passed (the compiled
    engines then skip their own guards)."""

    def checked_call(self, x: Any, tangents: Any, contexts: tuple[Any, ...], /) -> tuple[Any, ...]: ...


@checkable
class DropsValue(Protocol):
    """A runner with a cheaper way to run when the caller drops the value (a compiled gradient:
    the value-free copy of its program, compiled at preparation beside it)."""

    def without_value(self) -> Any: ...


@checkable
class CountsCompilations(Protocol):
    """A runner that compiles: ``num_compilations`` is what ``Prep.num_compilations`` sums."""

    @property
    def num_compilations(self) -> int: ...


@checkable
class Publishes(Protocol):
    """A runner whose preparation has facts to show as ``Prep`` attributes (``AutoSparse``:
    ``sparsity_pattern``, ``ncolors``, ...)."""

    @property
    def published(self) -> dict[str, Any]: ...


@checkable
class HasPath(Protocol):
    """A runner with more than one way to run (``AutoXLA``: traced once, or its lazy fallback)."""

    @property
    def path(self) -> str | None: ...


def implements(obj: object, protocol: Callable[..., P]) -> TypeGuard[P]:
    """``isinstance(obj, protocol)`` for the runtime-checkable protocols of this module: whether
    ``obj`` has each of the protocol's members.

    The same test as ``isinstance``, whose check of a protocol walks the protocol's classes on
    every call: 21 us a check on Python 3.11 (measured with ``timeit``), several per preparation;
    this one reads the members ``checkable`` recorded when the protocol was defined.

    Example::

        >>> implements(lambda x, t, c: (x,), WarmsUp)
        False
    """
    return all(hasattr(obj, name) for name in _MEMBERS[protocol])  # (KeyError: not declared @checkable)


def warm_up(runner: Runner, x: Any, tangents: Any, contexts: tuple[Any, ...]) -> None:
    """Run ``runner``'s preparation-time work, if it has any."""
    if implements(runner, WarmsUp):
        runner.warm_up(x, tangents, contexts)


def num_compilations(runner: Runner | None) -> int:
    """How many programs ``runner`` compiled (0 for runners that do not compile)."""
    return int(runner.num_compilations) if implements(runner, CountsCompilations) else 0


def runner_path(runner: Runner | None) -> str | None:
    """Which way ``runner`` runs, for engines with more than one (``HasPath``), else ``None``."""
    return runner.path if implements(runner, HasPath) else None


def checked_entry(runner: Runner) -> Runner:
    """What a call whose strict check has passed runs."""
    return runner.checked_call if implements(runner, HasCheckedCall) else runner


# --------------------------------------------------------------------------------------------
# Engines and their registry


@checkable
class Engine(Protocol):
    """What ``torchdi.operators`` asks of a backend's engine.

    Attributes:
        native: the operator families the engine builds itself; the others come from the
            generic fallbacks (which use this set to pick forward or reverse mode).
        keeps_static: whether static leaves (ints, strings, objects) are baked into what the
            engine builds, so that the strict check must compare their values.
    """

    @property
    def native(self) -> frozenset[str]: ...

    @property
    def keeps_static(self) -> bool: ...

    def build(self, family: str, f: BoundFunction, spec: Spec) -> Runner | None:
        """A runner ``(x, batched_tangents, context_values) -> full result``, or ``None`` to let
        the generic fallback of ``family`` build it from other runners."""
        ...


@checkable
class ServesEmpty(Protocol):
    """An engine whose runners of ``builds_empty`` also serve an empty ``x`` or ``f(x)`` (its own
    result layout and prep attributes), instead of the generic zero map."""

    @property
    def builds_empty(self) -> frozenset[str]: ...


@checkable
class TranslatesContexts(Protocol):
    """An engine whose program sees context values translated (``to_device_tensor``): ``f``
    sees the same at preparation."""

    def contexts_seen_by_f(self, values: tuple[Any, ...], /) -> tuple[Any, ...]: ...


_ENGINE_TYPES: dict[type, Callable[[Any], Engine]] = {}
# Engines cached per backend (backends are frozen, hashable dataclasses): a SecondOrder or
# AutoSparse engine builds its parts' engines once. Bounded: backends built in a loop must not
# pile up.
_ENGINES: dict[Backend, Engine] = {}
_ENGINE_CACHE_SIZE = 256


def register_engine(backend_type: type, engine_type: Callable[[Any], Engine]) -> None:
    """Make ``engine_type(backend)`` the engine of every backend of ``backend_type``.

    Each module of ``torchdi/engines/`` registers its engine when imported;
    ``torchdi/engines/__init__.py`` imports them all.
    """
    _ENGINE_TYPES[backend_type] = engine_type
    _ENGINES.clear()


def engine_for(backend: Backend) -> Engine:
    """The engine that runs ``backend``."""
    try:
        engine = _ENGINES.get(backend)
    except TypeError:  # an unhashable value inside the backend (a user's options dict...)
        engine = None
        hashable = False
    else:
        hashable = True
    if engine is not None:
        return engine
    make = _ENGINE_TYPES.get(type(backend))
    if make is None:
        if not isinstance(backend, _BACKEND_TYPES):
            raise TypeError(f"not a torchdi backend: {backend!r}")
        raise RuntimeError(
            f"no engine registered for {type(backend).__name__}: import torchdi (torchdi.engines registers them all)"
        )
    engine = make(backend)
    if hashable:
        if len(_ENGINES) >= _ENGINE_CACHE_SIZE:
            _ENGINES.clear()
        _ENGINES[backend] = engine
    return engine


# family -> generic builder(backend, f, spec); filled by the operator modules at import
# (torchdi/operators/__init__.py imports them all, and torchdi/__init__.py imports it).
FALLBACKS: dict[str, Callable[[Backend, BoundFunction, Spec], Runner]] = {}


def register_fallback(family: str, builder: Callable[[Backend, BoundFunction, Spec], Runner]) -> None:
    """Make ``builder(backend, f, spec)`` the generic runner of ``family`` for engines that do
    not build it natively."""
    if family not in FAMILIES:
        raise ValueError(f"unknown operator family {family!r}; valid families: {', '.join(FAMILIES)}")
    FALLBACKS[family] = builder


def build_runner(backend: Backend, family: str, f: BoundFunction, spec: Spec) -> Runner:
    """The runner of ``family`` for ``backend``: the engine's native one, else the generic fallback."""
    runner = engine_for(backend).build(family, f, spec)
    if runner is None:
        try:
            fallback = FALLBACKS[family]
        except KeyError:
            raise RuntimeError(
                f"no generic {family} runner registered: import torchdi (torchdi.operators registers them all)"
            ) from None
        runner = fallback(backend, f, spec)
    return runner


class Composed:
    """A runner a generic fallback composed of other runners (``parts``) that compile.

    A compiled runner nested in a composition that is not itself one compiled program (finite
    differences over a compiled gradient, the hessian's loop of a compiled HVP beside its
    gradient) compiles on its first call: ``warm_up`` makes that call at preparation, so that the
    first call after it compiles nothing (rule 2), and ``num_compilations`` counts the parts'
    compilations, which ``Prep.num_compilations`` reports.

    Args:
        run: the composed runner.
        parts: the runners it calls (directly or through the functions it differentiates).
    """

    def __init__(self, run: Runner, parts: tuple[Runner, ...]) -> None:
        self.run = run
        self.parts = parts

    def __call__(self, x: Any, tangents: Any, contexts: tuple[Any, ...]) -> Any:
        return self.run(x, tangents, contexts)

    def warm_up(self, x: Any, tangents: Any, contexts: tuple[Any, ...]) -> None:
        self.run(x, tangents, contexts)  # (each nested compiled runner compiles on this first call)

    @property
    def num_compilations(self) -> int:
        return sum(num_compilations(part) for part in self.parts)


def composed(run: Runner, *parts: Runner) -> Runner:
    """``run`` as a ``Composed`` runner when one of ``parts`` compiles and ``run`` does not count
    it itself (a compiled program that traces the parts is its own count), else ``run`` as it is."""
    if implements(run, CountsCompilations) or not any(implements(part, CountsCompilations) for part in parts):
        return run
    return Composed(run, parts)


def zero_runner(family: str, f: BoundFunction, spec: Spec) -> Runner:
    """The runner of ``family`` when ``x`` or ``f(x)`` has no elements: the derivative is the zero
    map, so every result is zeros of its usual shape (empty, except a pushforward with an empty
    ``x`` or a pullback with an empty ``f(x)``)."""

    def zeros(meta: TreeMeta, device: torch.device, batch: tuple[int, ...] = ()) -> Any:
        return pytree.tree_unflatten(
            [torch.zeros((*batch, *s), dtype=d, device=device) for s, d in zip(meta.shapes, meta.dtypes)], meta.spec
        )

    k = spec.n_tangents

    def run(x: Any, _: Any, contexts: tuple[Any, ...]) -> tuple[Any, ...]:
        device = pytree.tree_leaves(x)[0].device
        if family == "hvp":
            return zeros(spec.x, device), zeros(spec.x, device, (k,))
        y = f(x, contexts)
        if family == "pushforward":
            return y, zeros(spec.y, device, (k,))
        if family == "pullback":
            return y, zeros(spec.x, device, (k,))
        if family == "gradient":
            return y, zeros(spec.x, device)
        if family == "jacobian":
            return y, torch.zeros((*spec.y.shapes[0], *spec.x.shapes[0]), dtype=spec.y.dtypes[0], device=device)
        if family == "hessian":
            x_shape = tuple(spec.x.shapes[0])
            if torch.Size(spec.y.shapes[0]).numel() != 1:  # a non-scalar f: its jacobian and y-by-x-by-x zeros
                y_shape = tuple(spec.y.shapes[0])
                return (
                    y,
                    torch.zeros(y_shape + x_shape, dtype=spec.y.dtypes[0], device=device),
                    torch.zeros(y_shape + x_shape + x_shape, dtype=spec.y.dtypes[0], device=device),
                )
            return y, zeros(spec.x, device), torch.zeros(x_shape + x_shape, dtype=spec.x.dtypes[0], device=device)
        if family == "derivative":
            return y, torch.zeros_like(y)
        return y, torch.zeros_like(y), torch.zeros_like(y)  # second_derivative

    return run


def unbatch(tree: Any, count: int) -> tuple[Any, ...]:
    """Split a pytree whose leaves have a leading batch dimension into ``count`` pytrees."""
    leaves, spec = pytree.tree_flatten(tree)
    columns = [leaf.unbind(0) for leaf in leaves]
    return tuple(pytree.tree_unflatten([column[i] for column in columns], spec) for i in range(count))


def replace_spec(spec: Spec, **changes: Any) -> Spec:
    """``spec`` with some fields changed (for runners built on top of other runners)."""
    return replace(spec, **changes)
