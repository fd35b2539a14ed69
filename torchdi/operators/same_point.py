"""Same-point preparations (DifferentiationInterface.jl's ``prepare_*_same_point``).

A same-point ``Prep`` serves one ``x`` and one set of context values, and keeps what it computed
there: the primal, a ``vjp`` closure (pullback), a linearization (pushforward, HVP: the tangent
part of the computation only, ``torch.func.linearize``). Each call with new tangents then costs
only the tangent work: Newton-Krylov and Newton-CG solvers ask for many tangents at one point.

The check that the call is at that point is identity and version counter of every tensor of
``x`` and of the contexts (O(1) per tensor), and that nothing else ``f`` reads changed (its
globals, closure cells, attributes, closed-over tensors: ``torchdi.reads``), made on every call
whatever ``strict`` says: a same-point ``Prep`` never serves a stale result. Unlike other
preparations it keeps what it computed at its point alive (DESIGN rule 4's exception).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
from torch.func import grad, linearize, vjp, vmap
from torch.fx.experimental.const_fold import split_const_subgraphs
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from torchdi._fence import tensor_version
from torchdi.backends import AutoAutograd, AutoCompile, AutoFunc, Backend
from torchdi.contexts import Context
from torchdi.engines._compiled import CompiledRunner
from torchdi.engines.base import like_primal
from torchdi.operators._core import prepare_operator
from torchdi.operators._guards import snapshot, written_since
from torchdi.prep import Prep, PreparationMismatchError
from torchdi.reads import Reads
from torchdi.runners import BoundFunction, Runner, Spec, build_runner

__all__ = ["prepare_hvp_same_point", "prepare_pullback_same_point", "prepare_pushforward_same_point"]


def prepare_pushforward_same_point(
    f: Callable[..., Any], backend: Backend, x: Any, tx: tuple[Any, ...], *contexts: Context[Any], strict: bool = True,
    has_aux: bool = False,
) -> Prep:
    """Prepare ``pushforward`` and ``value_and_pushforward`` of ``f`` at this very ``x`` and these
    context values, for any number of calls with new tangents of ``tx``'s layout.

    ``AutoFunc`` and ``AutoCompile`` keep ``f``'s linearization at ``x`` (only the tangent part
    runs per call), ``AutoAutograd`` the graph of ``f`` at ``x``; other backends run their
    ordinary pushforward. Calls with another ``x`` or context tensor, or one modified in place
    since, raise ``PreparationMismatchError``.

    Example::

        >>> x = torch.tensor([1.0, 2.0])
        >>> prep = torchdi.prepare_pushforward_same_point(torch.sin, torchdi.AutoFunc(), x, (x,))
        >>> torchdi.pushforward(torch.sin, torchdi.AutoFunc(), x, (torch.ones(2),), prep=prep)
        (tensor([ 0.5403, -0.4161]),)
    """
    return _prepare_same_point("pushforward", "prepare_pushforward_same_point", f, backend, x, tx, contexts, strict, has_aux)


def prepare_pullback_same_point(
    f: Callable[..., Any], backend: Backend, x: Any, ty: tuple[Any, ...], *contexts: Context[Any], strict: bool = True,
    has_aux: bool = False,
) -> Prep:
    """Prepare ``pullback`` and ``value_and_pullback`` of ``f`` at this very ``x`` and these
    context values: ``AutoFunc``/``AutoCompile`` keep the ``vjp`` closure, ``AutoAutograd`` the
    graph, so each call runs only the backward pass for its cotangents.

    Example::

        >>> x = torch.tensor([1.0, 2.0])
        >>> prep = torchdi.prepare_pullback_same_point(torch.sin, torchdi.AutoFunc(), x, (x,))
        >>> torchdi.pullback(torch.sin, torchdi.AutoFunc(), x, (torch.ones(2),), prep=prep)
        (tensor([ 0.5403, -0.4161]),)
    """
    return _prepare_same_point("pullback", "prepare_pullback_same_point", f, backend, x, ty, contexts, strict, has_aux)


def prepare_hvp_same_point(
    f: Callable[..., Any], backend: Backend, x: Any, tx: tuple[Any, ...], *contexts: Context[Any], strict: bool = True,
    has_aux: bool = False,
) -> Prep:
    """Prepare ``hvp`` and ``gradient_and_hvp`` of the scalar ``f`` at this very ``x`` and these
    context values: ``AutoFunc``/``AutoCompile`` keep the gradient's linearization at ``x`` (each
    HVP runs only the tangent part), ``AutoAutograd`` the gradient's graph.

    Example::

        >>> x = torch.tensor([1.0, 2.0])
        >>> f = lambda x: (x**3).sum()
        >>> prep = torchdi.prepare_hvp_same_point(f, torchdi.AutoFunc(), x, (x,))
        >>> torchdi.hvp(f, torchdi.AutoFunc(), x, (torch.ones(2),), prep=prep)
        (tensor([ 6., 12.]),)
    """
    return _prepare_same_point("hvp", "prepare_hvp_same_point", f, backend, x, tx, contexts, strict, has_aux)


def _prepare_same_point(
    family: str, operator: str, f: Callable[..., Any], backend: Backend, x: Any, tangents: Any,
    contexts: tuple[Any, ...], strict: bool, has_aux: bool,
) -> Prep:
    point = _Point(x, [c.value if isinstance(c, Context) else c for c in contexts], operator, Reads.of(f))
    prep = prepare_operator(
        family, operator, f, backend, x, tangents, contexts, strict, has_aux=has_aux, runner_factory=_same_point_runner
    )
    prep.point = point
    return prep


class _Point:
    """The tensors a same-point ``Prep`` was prepared at: weak references and version counters."""

    def __init__(self, x: Any, values: list[Any], operator: str, reads: Reads | None) -> None:
        self.operator = operator
        self.x = self._watch(x)
        self.contexts = [self._watch(v) for v in values]
        # What f reads besides x and the contexts (torchdi.reads): the linearization was of f as
        # it read them. None: more than reads.MAX_PLACES places, not checked.
        self.reads = reads

    @staticmethod
    def _watch(tree: Any) -> list[tuple[weakref.ref[torch.Tensor], tuple[int | None, torch.Tensor | None]]]:
        # (without the version counter, fence: a copy of the values, compared on every call)
        return [(weakref.ref(t), snapshot(t)) for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]

    def check(self, x: Any, values: tuple[Any, ...]) -> None:
        problem = self._compare("x", self.x, x)
        for i, (watched, value) in enumerate(zip(self.contexts, values)):
            problem = problem or self._compare(f"context {i + 1}", watched, value)
        if not problem and self.reads is not None and self.reads.changed():
            problem = (
                "what f reads besides x and the contexts changed since preparation (a global, a closure cell, an "
                "attribute, a helper function, a tensor written in place), so what it computed there is of another f"
            )
        if problem:
            raise PreparationMismatchError(
                f"{self.operator.replace('prepare_', '').replace('_same_point', '')}: this prep from {self.operator} serves "
                f"only the x and context tensors it was prepared at, unmodified; {problem}. Prepare again at the new "
                f"point, or use {self.operator.replace('_same_point', '')} for a preparation that serves any point."
            )

    @staticmethod
    def _compare(name: str, watched: list[tuple[weakref.ref[torch.Tensor], tuple[int | None, torch.Tensor | None]]], tree: Any) -> str | None:
        tensors = [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]
        if len(tensors) != len(watched):
            return f"{name} has {len(tensors)} tensors, {len(watched)} at preparation"
        for i, ((ref, taken), t) in enumerate(zip(watched, tensors)):
            where = name if len(tensors) == 1 else f"{name} (tensor {i})"
            if ref() is not t:
                return f"{where} is another tensor than at preparation"
            if written_since(t, taken):
                version = taken[0]
                change = "its values changed" if version is None else f"version {version} -> {tensor_version(t)}"
                return f"{where} was modified in place since preparation ({change})"
        return None


def _same_point_runner(backend: Backend, family: str, f: BoundFunction, spec: Spec, x: Any, tangents: Any, values: tuple[Any, ...]) -> Runner | None:
    """The runner that keeps what ``family`` computes at ``x`` (``None``: the ordinary one)."""
    real = not any(d.is_complex for d in (*spec.x.dtypes, *spec.y.dtypes))
    if spec.has_aux or not real:
        return None
    if type(backend) is AutoFunc:
        return _func_runner(family, f, spec, x, values)
    if isinstance(backend, AutoCompile) and type(backend.inner) is AutoFunc and backend.mode != "reduce-overhead":
        folded = _folded_runner(build_runner(backend.inner, family, f, spec), x, tangents, values)
        runner = CompiledRunner(folded, backend, family, getattr(f, "function_name", repr(f)))
        with torch.no_grad():
            runner.warm_up(x, tangents, values)
        return cast(Runner, runner)
    if type(backend) is AutoAutograd:
        return _autograd_runner(family, f, spec, x, values)
    return None


@contextlib.contextmanager
def _quiet_folding() -> Iterator[None]:
    """Constant folding (``linearize``'s and ours) warns about the folded attributes it inserts
    itself, on every preparation: nothing a user can act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Attempted to insert a get_attr Node with no underlying reference")
        yield


def _func_runner(family: str, f: BoundFunction, spec: Spec, x: Any, values: tuple[Any, ...]) -> Runner:
    """``torch.func``: the vjp closure (pullback) or the linearization (pushforward, HVP) at ``x``."""
    if family == "pullback":
        y, vjp_fn = cast(tuple[Any, Any], vjp(lambda x_: f(x_, values), x))
        batched = vmap(vjp_fn)

        def pullback(_: Any, ty: Any, __: tuple[Any, ...]) -> tuple[Any, Any]:
            return y, batched(ty)[0]

        return pullback
    if family == "pushforward":
        with _quiet_folding():
            y, jvp_fn = linearize(lambda x_: f(x_, values), x)

        batched_jvp = vmap(jvp_fn)

        def pushforward(_: Any, tx: Any, __: tuple[Any, ...]) -> tuple[Any, Any]:
            return y, like_primal(batched_jvp(tx), y)

        return pushforward
    def scalar(x_: Any) -> torch.Tensor:
        return cast(torch.Tensor, f(x_, values)).reshape(())

    with _quiet_folding():
        g, hvp_fn = linearize(grad(scalar), x)
    batched_hvp = vmap(hvp_fn)

    def hvp(_: Any, tx: Any, __: tuple[Any, ...]) -> tuple[Any, Any]:
        return g, batched_hvp(tx)

    return hvp


def _folded_runner(runner: Runner, x: Any, tangents: Any, values: tuple[Any, ...]) -> Runner:
    """``runner`` at this ``x`` and these contexts as a graph of the tangents alone: traced with
    ``make_fx`` (the point as constants) and with every tangent-free subgraph (the primal, the
    forward and backward passes at ``x``) evaluated once by constant folding, as
    ``torch.func.linearize`` does. This graph is what ``AutoCompile`` compiles (dynamo cannot
    trace ``linearize``'s own closure)."""
    value = runner(x, tangents, values)[0]
    t_leaves, t_spec = pytree.tree_flatten(tangents)
    out_spec: list[Any] = []

    def tangent_part(*flat: torch.Tensor) -> list[Any]:
        result = runner(x, pytree.tree_unflatten(list(flat), t_spec), values)[1]
        leaves, spec = pytree.tree_flatten(result)
        out_spec[:] = [spec]
        return leaves

    graph = make_fx(tangent_part)(*t_leaves)
    with _quiet_folding():
        folded = split_const_subgraphs(graph)
    folded.run_folding()  # evaluate the tangent-free part now, eagerly, once

    def run(_: Any, tangents_now: Any, __: tuple[Any, ...]) -> tuple[Any, Any]:
        return value, pytree.tree_unflatten(list(folded(*pytree.tree_leaves(tangents_now))), out_spec[0])

    return run


def _autograd_runner(family: str, f: BoundFunction, spec: Spec, x: Any, values: tuple[Any, ...]) -> Runner:
    """Eager autograd: the graph at ``x`` is kept (``retain_graph``) and only backward passes run."""
    leaves, x_spec = pytree.tree_flatten(x)
    tracked = [leaf.detach().requires_grad_() for leaf in leaves]
    with torch.enable_grad():
        y = f(pytree.tree_unflatten(tracked, x_spec), values)
        y_leaves, y_spec = pytree.tree_flatten(y)
        if family == "hvp":
            (y_scalar,) = y_leaves
            outputs = list(torch.autograd.grad(y_scalar.reshape(()), tracked, create_graph=True, allow_unused=True, materialize_grads=True))
            value: Any = pytree.tree_unflatten([g.detach() for g in outputs], x_spec)
            inputs, out_spec = tracked, x_spec
        elif family == "pullback":
            outputs, inputs, out_spec = y_leaves, tracked, x_spec
            value = pytree.tree_unflatten([leaf.detach() for leaf in y_leaves], y_spec)
        else:  # pushforward by double backward: the vjp is linear in its cotangent u
            cotangents = [torch.zeros_like(leaf, requires_grad=True) for leaf in y_leaves]
            outputs = list(torch.autograd.grad(y_leaves, tracked, cotangents, create_graph=True, allow_unused=True, materialize_grads=True))
            inputs, out_spec = cotangents, y_spec
            value = pytree.tree_unflatten([leaf.detach() for leaf in y_leaves], y_spec)

    def run(_: Any, tangents: Any, __: tuple[Any, ...]) -> tuple[Any, Any]:
        t_leaves = pytree.tree_leaves(tangents)
        count = t_leaves[0].shape[0]
        rows = []
        with torch.enable_grad():
            for k in range(count):
                pairs = [(o, t[k]) for o, t in zip(outputs, t_leaves) if o.requires_grad]
                if not pairs:
                    rows.append([torch.zeros_like(i) for i in inputs])
                    continue
                grads = torch.autograd.grad(
                    [o for o, _ in pairs], inputs, [c for _, c in pairs], retain_graph=True, allow_unused=True, materialize_grads=True
                )
                rows.append([g.detach() for g in grads])
        stacked = [torch.stack([row[j] for row in rows]) for j in range(len(inputs))]
        return value, pytree.tree_unflatten(stacked, out_spec)

    return run
