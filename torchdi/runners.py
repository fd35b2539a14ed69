"""Runners: what engines and operators share.

Each operator family ("gradient", "jacobian", ...) is computed by a *runner*: a pure function
``runner(x, tangents, context_values) -> full result`` built once per preparation by the
backend's engine (or by the generic fallback of the family when the engine has no native
version). ``tangents`` are batched: one pytree shaped like ``x`` (or ``y``) with a leading
dimension, one entry per tangent. The full result of each family holds everything the
``value_and_*`` variant returns; the plain operator drops the value.

Engines import this module, never ``torchdi.operators`` (which registers its generic fallbacks
in ``FALLBACKS`` when the package is imported): no import cycles.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.utils import _pytree as pytree

from torchdi.backends import (
    AutoAutograd,
    AutoCompile,
    AutoFiniteDiff,
    AutoFunc,
    AutoXLA,
    Backend,
    SecondOrder,
)
from torchdi.errors import UnsupportedOperatorError

__all__ = [
    "FALLBACKS",
    "BoundFunction",
    "Runner",
    "Spec",
    "TreeMeta",
    "build_runner",
    "jacobian_uses_forward",
    "outer_inner",
    "replace_spec",
    "unbatch",
    "zero_runner",
]

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


@dataclass(frozen=True)
class Spec:
    """What a runner builder may rely on: layouts of ``x`` and ``y``, the number of tangents,
    whether the caller uses the value (``False``: a runner may return ``None`` in its place),
    whether the runner runs inside an outer forward-mode transform (the inner derivative of a
    generic second derivative), and the positions of the ``State`` contexts (whose in-place
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


def outer_inner(backend: Backend) -> tuple[Backend, Backend]:
    """The (outer, inner) pair of a second-order computation; a plain backend plays both roles.

    Raises ``UnsupportedOperatorError`` for pairs PyTorch cannot compose: ``torch.func``
    transforms cannot differentiate through ``torch.autograd.grad``.
    """
    if not isinstance(backend, SecondOrder):
        return backend, backend
    outer, inner = backend.outer, backend.inner
    if isinstance(inner, (AutoCompile, AutoXLA)) and not isinstance(outer, (AutoCompile, AutoXLA, AutoFiniteDiff)):
        raise UnsupportedOperatorError(
            f"{backend!r}: eager {type(outer).__name__} cannot differentiate a compiled inner backend "
            "(torch.compile's graphs support neither double backward nor torch.func transforms from eager code). "
            "Backends that can: AutoCompile() (forward over reverse of torch.func, compiled as one program), "
            "SecondOrder(AutoCompile(), AutoFunc()), SecondOrder(AutoFiniteDiff(), AutoCompile())"
        )
    if _base(outer) is AutoFunc and _base(inner) is AutoAutograd:
        raise UnsupportedOperatorError(
            f"{backend!r}: torch.func transforms cannot differentiate torch.autograd.grad calls. "
            "Backends that can: SecondOrder(AutoFunc(), AutoFunc()), SecondOrder(AutoAutograd(), AutoAutograd()), "
            "SecondOrder(AutoAutograd(), AutoFunc()), SecondOrder(AutoFiniteDiff(), <any>)"
        )
    if _base(inner) is AutoFiniteDiff and _base(outer) is not AutoFiniteDiff:
        raise UnsupportedOperatorError(
            f"{backend!r}: finite differences of the inner backend are not differentiable by an AD outer backend. "
            "Backends that can: SecondOrder(AutoFiniteDiff(), AutoFiniteDiff()), SecondOrder(AutoFiniteDiff(), AutoFunc()), "
            "SecondOrder(AutoFunc(), AutoFunc()), AutoAutograd()"
        )
    return outer, inner


def _base(backend: Backend) -> type:
    """The eager backend type a (possibly compiled) backend runs."""
    while isinstance(backend, (AutoCompile, AutoXLA)):
        backend = backend.inner
    return type(backend)


# Families that AutoAutograd computes by double backward (forward mode included).
_DOUBLE_BACKWARD = frozenset({"pushforward", "hvp", "hessian", "second_derivative"})


def jacobian_uses_forward(native: frozenset[str], spec: Spec) -> bool:
    """Whether the generic jacobian takes columns (pushforwards) rather than rows (pullbacks).

    Forward mode when the engine has no native reverse mode, when it has both and the input is
    smaller than the output, and always for complex ``x`` or ``y``: a column is the derivative
    along a real basis direction, which every backend computes alike (see the README's complex
    convention), while a reverse-mode row is its conjugate only for holomorphic ``f``.
    """
    complex_ = any(d.is_complex for d in (*spec.x.dtypes, *spec.y.dtypes))
    return "pullback" not in native or ("pushforward" in native and (spec.x.numel < spec.y.numel or complex_))


def _refuse_compiled_double_backward(backend: Backend, family: str, spec: Spec) -> None:
    """``AutoCompile(inner=AutoAutograd())`` cannot run what needs double backward: AOTAutograd
    does not support it, and torch raises from inside the compiled graph at preparation."""
    if not (isinstance(backend, AutoCompile) and _base(backend) is AutoAutograd):
        return
    from torchdi.engines.autograd import AutogradEngine

    if family in _DOUBLE_BACKWARD or (family == "jacobian" and jacobian_uses_forward(AutogradEngine.native, spec)):
        raise UnsupportedOperatorError(
            f"{backend!r}: {family} needs double backward (or forward mode built on it), which torch.compile's "
            "AOTAutograd does not support. Backends that can: AutoCompile() (inner=AutoFunc(), the default), "
            "AutoAutograd(), SecondOrder(AutoFiniteDiff(), AutoCompile(inner=AutoAutograd(), fullgraph=False))"
        )


# family -> generic builder(backend, f, spec); filled by the operator modules.
FALLBACKS: dict[str, Callable[[Backend, BoundFunction, Spec], Runner]] = {}


def build_runner(backend: Backend, family: str, f: BoundFunction, spec: Spec) -> Runner:
    """The runner of ``family`` for ``backend``: the engine's native one, else the generic fallback."""
    from torchdi.engines import engine_for

    _refuse_compiled_double_backward(backend, family, spec)
    runner = engine_for(backend).build(family, f, spec)
    if runner is None:
        runner = FALLBACKS[family](backend, f, spec)
    return runner


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
