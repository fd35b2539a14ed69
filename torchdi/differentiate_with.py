"""``DifferentiateWith(f, backend)``: one piece of a PyTorch program differentiated by another backend.

The counterpart of DifferentiationInterface.jl's ``DifferentiateWith``. ``g = DifferentiateWith(f,
backend)`` computes ``f(x, *contexts)``; when eager autograd (``loss.backward()``,
``torch.autograd.grad``) or a ``torch.func`` transform differentiates through ``g``, the derivative
of ``f`` comes from ``backend``: a finite-difference black box (numpy, scipy) inside a model, a
compiled subroutine inside eager code, a piece run on XLA.

How: each derivative ``g`` may be asked for is a ``torch.autograd.Function`` whose forward runs a
prepared torchdi operator, and whose own derivatives are the next ones in the chain:

    value   f(x)            backward -> pullback            jvp -> pushforward
    pullback  J(x)^T u      backward -> hvp, pushforward    jvp -> hvp + pullback
    pushforward  J(x) v     backward -> hvp, pullback       jvp -> unsupported (second directional derivative)
    hvp  ∇²<u, f>(x) v      backward, jvp -> unsupported (third order)

so second-order derivatives (``torch.func.hessian``, ``torchdi.hvp`` with an outer backend, double
backward) come from ``backend``'s HVPs. Every Function has a ``vmap`` rule, so ``torch.func.vmap``,
``jacrev`` and ``jacfwd`` compose with it: batched tangents (a jacobian's basis) go to the backend as
one call with several tangents; a batched ``x`` is looped over, since ``f`` may be a black box.
torch's own batched autograd (``is_grads_batched=True``, ``vectorize=True``,
``check_batched_grad=True``: its legacy vmap) reaches the backends the same way: its batched
cotangents are unbatched into one call with several tangents (``_legacy_batch``).

The primal value is ``f``'s eager call (as in DI); the derivatives run ``prepare_*`` results kept in
a small cache keyed by argument signatures (never values), so a training loop prepares (and compiles,
on compiled backends) once per signature.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from torchdi.backends import Backend, require_available
from torchdi.contexts import Constant, Context, State, bind_contexts, context_kinds, unwrap_contexts
from torchdi.engines._dynamo import (
    apply_function,
    forward_ad_level,
    is_legacy_batched,
    jvp_nests_in_dual_level,
    legacy_rebatch,
    legacy_unbatch,
    outside_legacy_vmap,
    transforms_active,
)
from torchdi.errors import UnsupportedOperatorError
from torchdi.operators import (
    hvp,
    prepare_hvp,
    prepare_pullback,
    prepare_pushforward,
    pullback,
    pushforward,
)
from torchdi.operators._checks import check_backend
from torchdi.operators._guards import snapshot, written_since
from torchdi.prep import Prep, describe, describe_contexts
from torchdi.runners import engine_for

__all__ = ["DifferentiateWith"]

# How many preparations each DifferentiateWith keeps per operator family (least recently used dropped).
CACHE_SIZE = 8


class DifferentiateWith:
    """A callable with the value of ``f`` whose derivatives are computed by ``backend``.

    ``g = DifferentiateWith(f, backend)`` returns ``f(x, *values)`` for ``g(x, *contexts)``. When
    ``loss.backward()``, ``torch.autograd.grad`` or a ``torch.func`` transform (``grad``, ``vjp``,
    ``jvp``, ``vmap``, ``jacrev``, ``jacfwd``, ``hessian``) differentiates through ``g``, the
    derivatives of ``f`` are ``backend``'s pullback, pushforward and (for second order) HVP of
    ``f``. Only ``x`` is differentiated: contexts are wrapped as ``Constant``/``Cache``, as for
    every operator, and a context tensor that the outer system wants a gradient for is refused.

    Preparations are made on first use for each signature of the arguments (structure, shape,
    dtype, device; see ``torchdi.Prep``) and kept in a small cache that holds no user data, so a
    training loop prepares, and compiles on compiled backends, once. Like a ``Prep``, an instance
    is not thread-safe: use one per thread.

    Args:
        f: the function ``f(x, *contexts) -> y``; ``x`` a tensor or pytree of floating-point tensors,
            ``y`` a floating-point tensor or pytree of them. It may be a black box (numpy, scipy)
            when ``backend`` does not trace it (``AutoFiniteDiff``).
        backend: the torchdi backend that differentiates ``f``; ``SecondOrder(outer, inner)`` picks
            how second-order derivatives through ``g`` are computed.

    Attributes:
        num_preparations: how many ``prepare_*`` calls were made (one per operator family and
            signature while the cache holds them).
        num_compilations: compilations of the cached preparations (0 on eager backends).

    Example::

        >>> import numpy as np, scipy.special
        >>> erfcx = torchdi.DifferentiateWith(
        ...     lambda x: torch.from_numpy(scipy.special.erfcx(x.detach().numpy())), torchdi.AutoFiniteDiff())
        >>> x = torch.tensor([0.5, 1.0], dtype=torch.float64, requires_grad=True)
        >>> erfcx(x).sum().backward()  # x.grad: finite differences of the scipy function
    """

    def __init__(self, f: Callable[..., Any], backend: Backend) -> None:
        if not callable(f):
            raise TypeError(f"DifferentiateWith: f must be callable, got {type(f).__name__}")
        check_backend(backend, "DifferentiateWith", "torchdi.AutoFiniteDiff() or torchdi.AutoCompile()")
        require_available(backend)
        hidden = _trainable_state_of(f)
        if hidden:
            warnings.warn(
                f"DifferentiateWith: f holds tensors that require grad ({', '.join(hidden[:5])}"
                f"{', ...' if len(hidden) > 5 else ''}). Only x is differentiated through DifferentiateWith: "
                "these get no gradient from it. To train them, pass them in x (e.g. a dict of parameters "
                "with torch.func.functional_call); to silence this, freeze them (requires_grad_(False)).",
                stacklevel=2,
            )
        self.f = f
        self.backend = backend
        self._keeps_static = engine_for(backend).keeps_static
        self._preps: dict[str, OrderedDict[Any, Prep]] = {}
        self.num_preparations = 0
        # sum_i <u_i, f(x)_i>: its HVPs along v are the second-order terms of the chain above.
        self._contracted = _contraction(f)

    def __repr__(self) -> str:
        name = getattr(self.f, "__qualname__", None) or repr(self.f)
        return f"DifferentiateWith({name}, {self.backend!r})"

    @property
    def num_compilations(self) -> int:
        return sum(prep.num_compilations for cache in self._preps.values() for prep in cache.values())

    def __call__(self, x: Any, *contexts: Context[Any]) -> Any:
        """``f(x, *values)``, differentiable with respect to ``x`` through ``backend``."""
        _refuse_state(contexts, self.backend)
        values, mask = unwrap_contexts(contexts, "DifferentiateWith", first_position=1)  # 0-based: g(x, *contexts)
        kinds = tuple(type(c) for c in contexts)
        x_leaves, x_spec = _x_leaves(x)
        context_spec: pytree.TreeSpec | None
        if all(isinstance(value, torch.Tensor) for value in values):  # the common case, without pytree
            context_leaves, context_spec, owners = list(values), None, list(range(1, len(values) + 1))
        else:
            context_leaves, context_spec = pytree.tree_flatten(values)
            owners = [i + 1 for i, value in enumerate(values) for _ in pytree.tree_leaves(value)]
        slots = tuple(i for i, leaf in enumerate(context_leaves) if isinstance(leaf, torch.Tensor))
        layout = _Layout(
            self,
            x_spec,
            len(x_leaves),
            context_spec,
            [None if i in slots else leaf for i, leaf in enumerate(context_leaves)],
            slots,
            mask,
            kinds,
            tuple(owners[slot] for slot in slots),
        )
        tensors = (*x_leaves, *(context_leaves[i] for i in slots))
        if _differentiable(tensors):
            outputs = _apply(_Value, layout, *tensors)
        else:  # nothing can differentiate this call: no Function, no graph
            outputs = _evaluate(layout, tensors)
        assert layout.y_spec is not None
        return pytree.tree_unflatten(list(outputs), layout.y_spec)

    # The backend's operators, each through a cached preparation.

    def _prepared(self, family: str, f: Callable[..., Any], x: Any, tangents: tuple[Any, ...], contexts: tuple[Context[Any], ...]) -> Prep:
        values = tuple(c.value for c in contexts)
        key = (
            describe(x, self._keeps_static),
            describe(tangents),
            describe_contexts(values, context_kinds(contexts), self._keeps_static),
        )
        cache = self._preps.setdefault(family, OrderedDict())
        prep = cache.get(key)
        if prep is not None:
            cache.move_to_end(key)
            return prep
        prepare = _PREPARE[family]
        prep = prepare(f, self.backend, x, tangents, *contexts, strict=False)  # the key is the check
        self.num_preparations += 1
        cache[key] = prep
        if len(cache) > CACHE_SIZE:
            cache.popitem(last=False)
        return prep

    def _pullback(self, x: Any, ty: tuple[Any, ...], contexts: tuple[Context[Any], ...]) -> tuple[Any, ...]:
        with _backend_jvp_nests():
            prep = self._prepared("pullback", self.f, x, ty, contexts)
            return pullback(self.f, self.backend, x, ty, *contexts, prep=prep)

    def _pushforward(self, x: Any, tx: tuple[Any, ...], contexts: tuple[Context[Any], ...]) -> tuple[Any, ...]:
        with _backend_jvp_nests():
            prep = self._prepared("pushforward", self.f, x, tx, contexts)
            return pushforward(self.f, self.backend, x, tx, *contexts, prep=prep)

    def _hvp(self, x: Any, u: Any, tx: tuple[Any, ...], contexts: tuple[Context[Any], ...]) -> tuple[Any, ...]:
        all_contexts = (Constant(u), *contexts)
        with _backend_jvp_nests():
            prep = self._prepared("hvp", self._contracted, x, tx, all_contexts)
            return hvp(self._contracted, self.backend, x, tx, *all_contexts, prep=prep)


def _refuse_state(contexts: tuple[Any, ...], backend: Backend) -> None:
    """A ``State`` is updated by ``f`` exactly once per call; ``g`` evaluates ``f`` once for its value
    and the backend evaluates it again for each derivative, so the update would repeat. Refused at
    the call, before ``f`` runs and touches the state."""
    for i, context in enumerate(contexts):
        if isinstance(context, State):
            raise UnsupportedOperatorError(
                f"DifferentiateWith({backend!r}): context {i + 1} is a torchdi.State, which DifferentiateWith "
                "does not take: g evaluates f for its value and the backend evaluates f again for each "
                "derivative, so the state would be updated more than once per call. Pass it as a "
                "torchdi.Constant (read only) and update the state outside g, or differentiate f directly "
                "with torchdi.gradient/value_and_gradient, which take a State (updated exactly once per call)."
            )


# Let the backend's torch.func.jvp (AutoFunc, AutoCompile over it) run inside the user's eager
# dual level (fwAD.dual_level), as it nests under torch.func.jvp (see the fence's docstring).
_backend_jvp_nests = jvp_nests_in_dual_level


_PREPARE: dict[str, Callable[..., Prep]] = {
    "pullback": prepare_pullback,
    "pushforward": prepare_pushforward,
    "hvp": prepare_hvp,
}


def _trainable_state_of(f: Callable[..., Any]) -> list[str]:
    """Tensors requiring grad that ``f`` carries (a module's parameters, a bound method's module,
    closure cells): the outer system cannot reach them, since ``f`` runs without a graph."""
    owner = getattr(f, "__self__", None) if not isinstance(f, torch.nn.Module) else f
    found = []
    if isinstance(owner, torch.nn.Module):
        found += [f"parameter {name!r}" for name, p in owner.named_parameters() if p.requires_grad]
    code = getattr(f, "__code__", None)
    for name, cell in zip(getattr(code, "co_freevars", ()), getattr(f, "__closure__", None) or ()):
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, torch.Tensor) and value.requires_grad:
            found.append(f"closure variable {name!r}")
        elif isinstance(value, torch.nn.Module) and any(p.requires_grad for p in value.parameters()):
            found.append(f"parameters of closure variable {name!r}")
    return found


def _contraction(f: Callable[..., Any]) -> Callable[..., torch.Tensor]:
    def contracted(x: Any, u: Any, *contexts: Any) -> torch.Tensor:
        products = [(w * y).sum() for w, y in zip(pytree.tree_leaves(u), pytree.tree_leaves(f(x, *contexts)))]
        return torch.stack(products).sum()

    contracted.__qualname__ = f"<u, {getattr(f, '__qualname__', 'f')}(x)>"
    return contracted


def _x_leaves(x: Any) -> tuple[list[torch.Tensor], pytree.TreeSpec]:
    leaves, spec = pytree.tree_flatten(x)
    if not leaves:
        raise ValueError(f"DifferentiateWith: x must contain at least one tensor, got {x!r}")
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor) or not leaf.is_floating_point():
            raise TypeError(
                "DifferentiateWith: x must be a real floating-point tensor or a dict/list/tuple of them "
                "(complex x is not supported yet); "
                f"found a leaf of type {type(leaf).__name__}"
                + (f" and dtype {leaf.dtype}" if isinstance(leaf, torch.Tensor) else "")
                + ". Pass other arguments as torchdi.Constant(...) contexts."
            )
    return leaves, spec


class _Layout:
    """The non-tensor argument of the Functions: the owner and how to rebuild ``x``, the contexts and ``y``.

    The Functions take ``(layout, *x_leaves, *context_tensors, *extra)`` where ``extra`` is the
    cotangent or tangent leaves. Non-tensor context leaves (floats, modules, numpy arrays) stay here.
    """

    __slots__ = (
        "context_leaves",
        "context_of_slot",
        "context_spec",
        "kinds",
        "mask",
        "n_context",
        "n_x",
        "n_y",
        "owner",
        "slots",
        "x_spec",
        "y_spec",
    )

    def __init__(
        self,
        owner: DifferentiateWith,
        x_spec: pytree.TreeSpec,
        n_x: int,
        context_spec: pytree.TreeSpec | None,
        context_leaves: list[Any],
        slots: tuple[int, ...],
        mask: tuple[bool, ...],
        kinds: tuple[type[Context[Any]], ...],
        context_of_slot: tuple[int, ...],
    ) -> None:
        self.owner = owner
        self.x_spec = x_spec
        self.n_x = n_x
        self.context_spec = context_spec
        self.context_leaves = context_leaves
        self.slots = slots
        self.mask = mask
        # The wrapper of each context, to hand the backend the same kinds the user gave.
        self.kinds = kinds
        self.context_of_slot = context_of_slot  # which context (1-based) each tensor slot belongs to
        self.n_context = len(slots)
        self.y_spec: pytree.TreeSpec | None = None
        self.n_y = 0

    def x(self, tensors: tuple[torch.Tensor, ...]) -> Any:
        return pytree.tree_unflatten(list(tensors[: self.n_x]), self.x_spec)

    def values(self, tensors: tuple[torch.Tensor, ...]) -> tuple[Any, ...]:
        leaves = list(self.context_leaves)
        for slot, tensor in zip(self.slots, tensors[self.n_x : self.n_x + self.n_context]):
            leaves[slot] = tensor
        if self.context_spec is None:  # every context is a tensor
            return tuple(leaves)
        return tuple(pytree.tree_unflatten(leaves, self.context_spec))

    def contexts(self, tensors: tuple[torch.Tensor, ...]) -> tuple[Context[Any], ...]:
        return tuple(kind(v) for v, kind in zip(self.values(tensors), self.kinds))

    def y_tree(self, leaves: tuple[torch.Tensor, ...]) -> Any:
        assert self.y_spec is not None
        return pytree.tree_unflatten(list(leaves), self.y_spec)

    def x_tree(self, leaves: tuple[torch.Tensor, ...]) -> Any:
        return pytree.tree_unflatten(list(leaves), self.x_spec)

    @property
    def n_primal(self) -> int:
        return self.n_x + self.n_context


def _contiguous(tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """What the backend gets: cotangents from autograd are often expanded (``y.sum().backward()``)
    or transposed, and a compiled backend guards on strides; one layout means one compilation."""
    return tuple(t.contiguous() for t in tensors)


def _flat(tree: Any) -> tuple[torch.Tensor, ...]:
    return tuple(pytree.tree_leaves(tree))


def _zeros_for_none(tangents: tuple[Any, ...], like: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(torch.zeros_like(p) if t is None else t for t, p in zip(tangents, like))


def _no_materialized_zeros(ctx: Any, output: tuple[torch.Tensor, ...]) -> None:
    """Keep absent tangents absent (``None``) instead of torch's materialized zeros.

    A forward-mode transform passes a tangent for every input, zeros for those it does not
    differentiate (a Constant's tensor): with zeros, a Constant could not be told from a
    differentiated context. Cotangents of unused outputs come as ``None`` too; backward fills
    them in from the outputs' metadata kept here.
    """
    ctx.set_materialize_grads(False)
    ctx.output_meta = tuple((o.shape, o.dtype, o.device) for o in output)


def _zeros_for_missing(ctx: Any, grads: tuple[Any, ...]) -> tuple[torch.Tensor, ...]:
    """The output cotangents, with zeros for the ones autograd left out (``None``)."""
    if all(g is not None for g in grads):
        return grads
    return tuple(
        torch.zeros(shape, dtype=dtype, device=device) if g is None else g for g, (shape, dtype, device) in zip(grads, ctx.output_meta)
    )


def _legacy_batch(
    layout: _Layout, fixed: tuple[torch.Tensor, ...], grads: tuple[torch.Tensor, ...]
) -> tuple[tuple[torch.Tensor, ...], tuple[tuple[int, int], ...], int] | None:
    """Cotangents batched by torch's legacy vmap, as plain tensors with the batch in front.

    ``torch.autograd.grad(is_grads_batched=True)``, ``torch.autograd.functional.jacobian/hessian(
    vectorize=True)`` and ``gradcheck(check_batched_grad=True)`` run a backward once on batched
    cotangents (torch's legacy vmap, not ``torch.func.vmap``), and a backend cannot take those (a
    compiled program, a prepared buffer, numpy). Unbatched, they are the tangents of one backend
    call (``_BatchedLayout``), as under ``torch.func.vmap``; the caller batches the results back
    (``legacy_rebatch``). ``None`` when nothing is batched. Refused clearly when ``x``, the
    contexts or the other tangents are batched too (``fixed``), or this torch lacks the internals.
    """
    if not any(is_legacy_batched(g) for g in grads):
        return None
    unbatched = None
    if not any(is_legacy_batched(t) for t in fixed):
        unbatched = legacy_unbatch(grads)
    if unbatched is None:
        raise UnsupportedOperatorError(
            f"DifferentiateWith({layout.owner.backend!r}): torch's legacy vmap (torch.autograd.grad(..., "
            "is_grads_batched=True), torch.autograd.functional.jacobian/hessian(vectorize=True), "
            "gradcheck(check_batched_grad=True)) batched more than the cotangents here (x, a context or a "
            "tangent), which cannot pass through DifferentiateWith. Use "
            "torch.func.jacrev/jacfwd/vmap (batched tangents reach the backend as one call), "
            "vectorize=False / is_grads_batched=False, or a torchdi operator (torchdi.jacobian) on f."
        )
    return unbatched


def _legacy_rows(
    layout: _Layout, size: int, other: tuple[torch.Tensor, ...], plain: tuple[torch.Tensor, ...]
) -> tuple[_BatchedLayout, tuple[torch.Tensor, ...] | None, tuple[torch.Tensor, ...], int | None]:
    """One backend call for ``size`` unbatched cotangents of a pullback or pushforward.

    Returns the layout of that call, the other tangent per row (``None``: one shared by every
    row), the cotangent rows, and ``k``: ``None`` for a plain ``layout``; for a layout already
    batched by ``torch.func`` (``jacrev(g)`` under ``is_grads_batched=True``), its ``k`` tangents
    times ``size`` rows make one batch of ``size * k`` (``_unfold`` splits the results)."""
    if not isinstance(layout, _BatchedLayout):
        return _BatchedLayout(layout, size), None, plain, None
    k = layout.count
    rows = tuple(t.reshape(size * k, *t.shape[2:]) for t in plain)
    others = tuple(t.unsqueeze(0).expand(size, *t.shape).reshape(size * k, *t.shape[1:]) for t in other)
    return _BatchedLayout(layout.inner, size * k), others, rows, k


def _unfold(outputs: tuple[torch.Tensor, ...], size: int, k: int | None, shared: bool) -> tuple[torch.Tensor, ...]:
    """Rows of ``_legacy_rows``'s call back as ``(size, k, ...)``; summed over ``k`` for ``x``'s
    terms (``shared``: ``x`` is one for the ``k`` tangents)."""
    if k is None:
        return outputs
    folded = tuple(t.reshape(size, k, *t.shape[1:]) for t in outputs)
    return tuple(t.sum(1) for t in folded) if shared else folded


def _rebatch(outputs: tuple[torch.Tensor, ...], levels: tuple[tuple[int, int], ...]) -> tuple[torch.Tensor, ...]:
    return tuple(legacy_rebatch(t, levels) for t in outputs)


def _refuse_context_derivative(layout: _Layout, needs: tuple[bool, ...] | None, what: str) -> None:
    """Contexts are not differentiated: refuse instead of returning a silent zero."""
    if needs is None:
        return
    for context, need in zip(layout.context_of_slot, needs):
        if need:
            raise ValueError(
                f"DifferentiateWith({layout.owner.backend!r}): a {what} was asked for a tensor in context "
                f"{context} ({layout.kinds[context - 1].__name__}), but only x is "
                "differentiated. Put that tensor into x (a dict or tuple of tensors) or pass it detached."
            )


def _loop_vmap(function: Any, info: Any, in_dims: tuple[Any, ...], layout: _Layout, *tensors: torch.Tensor) -> tuple[Any, Any]:
    """A ``vmap`` rule for any of the Functions: one call per batch entry (``f`` may be a black box)."""
    dims = in_dims[1:]
    results = []
    for b in range(info.batch_size):
        sliced = tuple(t if d is None else t.select(d, b) for t, d in zip(tensors, dims))
        results.append(_apply(function, layout, *sliced))
    outputs = tuple(torch.stack(column) for column in zip(*results))
    return outputs, (0,) * len(outputs)


def _tangent_batch_vmap(
    function: Any, info: Any, in_dims: tuple[Any, ...], layout: _Layout, tensors: tuple[torch.Tensor, ...], n_fixed: int
) -> tuple[Any, Any] | None:
    """When only the tangent arguments (after the first ``n_fixed`` tensors) are batched: one call
    of ``function`` with a batch of tangents (``layout.tangents``), i.e. one backend call."""
    dims = in_dims[1:]
    if any(d is not None for d in dims[:n_fixed]) or isinstance(layout, _BatchedLayout):
        return None
    size = info.batch_size
    tangents = tuple(
        t.unsqueeze(0).expand(size, *t.shape) if d is None else t.movedim(d, 0) for t, d in zip(tensors[n_fixed:], dims[n_fixed:])
    )
    outputs = _apply(function, _BatchedLayout(layout, size), *tensors[:n_fixed], *tangents)
    return outputs, (0,) * len(outputs)


class _BatchedLayout(_Layout):
    """A layout whose tangent arguments carry a leading batch of ``count`` tangents."""

    __slots__ = ("count", "inner")

    def __init__(self, layout: _Layout, count: int) -> None:
        super().__init__(
            layout.owner,
            layout.x_spec,
            layout.n_x,
            layout.context_spec,
            layout.context_leaves,
            layout.slots,
            layout.mask,
            layout.kinds,
            layout.context_of_slot,
        )
        self.y_spec = layout.y_spec
        self.n_y = layout.n_y
        self.inner = layout
        self.count = count


def _split_tangents(layout: _Layout, leaves: tuple[torch.Tensor, ...], rebuild: Callable[[tuple[torch.Tensor, ...]], Any]) -> tuple[Any, ...]:
    """Tangent leaves as the tuple of tangents torchdi operators take (several for a batched layout)."""
    if isinstance(layout, _BatchedLayout):
        return tuple(rebuild(tuple(leaf[i] for leaf in leaves)) for i in range(layout.count))
    return (rebuild(leaves),)


def _join_results(layout: _Layout, results: tuple[Any, ...]) -> tuple[torch.Tensor, ...]:
    """The operator's per-tangent results as the Function's output leaves."""
    if isinstance(layout, _BatchedLayout):
        return tuple(torch.stack(column) for column in zip(*(_flat(r) for r in results)))
    return _flat(results[0])


def _read_only(layout: _Layout, tensors: tuple[torch.Tensor, ...]) -> list[tuple[str, torch.Tensor]]:
    """The tensors ``f`` must not write into, named: ``x``'s leaves and the ``Constant``s' tensors."""
    watched = [(f"x (leaf {i})" if layout.n_x > 1 else "x", t) for i, t in enumerate(tensors[: layout.n_x])]
    for context, t in zip(layout.context_of_slot, tensors[layout.n_x : layout.n_primal]):
        if layout.kinds[context - 1] is Constant:
            watched.append((f"context {context} (Constant)", t))
    return watched


def _unsupported(what: str, layout: _Layout) -> UnsupportedOperatorError:
    return UnsupportedOperatorError(
        f"DifferentiateWith({layout.owner.backend!r}): {what} through DifferentiateWith is not supported "
        "(it provides first-order derivatives and the second-order ones built from the backend's HVPs: "
        "torch.func.hessian, hvp, double backward). Differentiate f directly with a torchdi operator instead."
    )


def _evaluate(layout: _Layout, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """``f``'s output leaves, without a graph; records ``y``'s structure in ``layout``."""
    bound = bind_contexts(layout.owner.f, layout.mask)
    watched = _read_only(layout, tensors)
    taken = [snapshot(t) for _, t in watched]
    with torch.no_grad():
        y = bound(layout.x(tensors), layout.values(tensors))
    written = [name for (name, t), before in zip(watched, taken) if written_since(t, before)]
    if written:
        raise ValueError(
            f"DifferentiateWith: f wrote in place into {', '.join(written)}. x and Constants must not "
            "be modified (the backend evaluates f again to differentiate it); use a Cache for scratch space."
        )
    leaves, spec = pytree.tree_flatten(y)
    if not leaves or not all(isinstance(leaf, torch.Tensor) and leaf.is_floating_point() for leaf in leaves):
        raise TypeError(
            "DifferentiateWith: f must return a real floating-point tensor or a pytree of them "
            f"(complex outputs are not supported yet), got {type(y).__name__}"
            + (f" with dtypes {[getattr(leaf, 'dtype', type(leaf).__name__) for leaf in leaves]}" if leaves else "")
        )
    layout.y_spec, layout.n_y = spec, len(leaves)
    return tuple(leaves)


def _differentiable(tensors: tuple[torch.Tensor, ...]) -> bool:
    """Whether anything may differentiate a call on ``tensors``: a torch.func transform, forward-mode
    AD, or eager autograd with an input that requires grad."""
    if transforms_active() or forward_ad_level() >= 0:
        return True
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


# ``function.apply(*args)``, without Function.apply's Python argument binding where torch allows.
_apply = apply_function


class _Value(torch.autograd.Function):
    """``f(x, *contexts)``; backward: the backend's pullback, jvp: its pushforward."""

    @staticmethod
    def forward(layout: _Layout, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outputs = _evaluate(layout, tensors)
        # An output that is an input (f = identity) must be a new tensor for autograd.
        inputs = {id(t) for t in tensors}
        return tuple(leaf.clone() if id(leaf) in inputs else leaf for leaf in outputs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.layout = inputs[0]
        ctx.save_for_backward(*inputs[1:])
        ctx.save_for_forward(*inputs[1:])
        _no_materialized_zeros(ctx, output)

    @staticmethod
    def backward(ctx: Any, *cotangents: torch.Tensor) -> tuple[Any, ...]:
        layout: _Layout = ctx.layout
        _refuse_context_derivative(layout, tuple(ctx.needs_input_grad[1 + layout.n_x :]), "gradient")
        primals = ctx.saved_tensors
        cotangents = _zeros_for_missing(ctx, cotangents)
        batch = _legacy_batch(layout, primals, cotangents)
        if batch is None:
            dx = _apply(_Pullback, layout, *primals, *cotangents)
        else:  # a batch of cotangents: one pullback call with several tangents
            plain, levels, size = batch
            with outside_legacy_vmap():
                dx = _apply(_Pullback, _BatchedLayout(layout, size), *primals, *plain)
            dx = _rebatch(dx, levels)
        return (None, *dx, *(None,) * layout.n_context)

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> tuple[torch.Tensor, ...]:
        layout: _Layout = ctx.layout
        _refuse_context_derivative(layout, tuple(t is not None for t in tangents[1 + layout.n_x :]), "forward-mode derivative")
        primals = ctx.saved_tensors
        tx = _zeros_for_none(tangents[1 : 1 + layout.n_x], primals[: layout.n_x])
        return tuple(_apply(_Pushforward, layout, *primals, *tx))

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], layout: _Layout, *tensors: torch.Tensor) -> tuple[Any, Any]:
        return _loop_vmap(_Value, info, in_dims, layout, *tensors)


class _Pullback(torch.autograd.Function):
    """``J(x)^T u`` by the backend; backward: its HVP and pushforward, jvp: HVP plus pullback."""

    @staticmethod
    def forward(layout: _Layout, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        tensors = _contiguous(tensors)
        n = layout.n_primal
        ty = _split_tangents(layout, tensors[n:], layout.y_tree)
        results = layout.owner._pullback(layout.x(tensors), ty, layout.contexts(tensors))
        return _join_results(layout, results)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.layout = inputs[0]
        ctx.save_for_backward(*inputs[1:])
        ctx.save_for_forward(*inputs[1:])
        _no_materialized_zeros(ctx, output)

    @staticmethod
    def backward(ctx: Any, *w: torch.Tensor) -> tuple[Any, ...]:
        layout: _Layout = ctx.layout
        w = _zeros_for_missing(ctx, w)
        saved = ctx.saved_tensors
        n = layout.n_primal
        primals, u = saved[:n], saved[n:]
        batch = _legacy_batch(layout, saved, w)
        if batch is not None:  # a batch of w for one u: rows ∇²<u, f>(x) w_i, one pushforward call
            plain, levels, size = batch
            rows, u_rows, w_rows, k = _legacy_rows(layout, size, u, plain)
            with outside_legacy_vmap():
                dx = _hvp_terms(rows, primals, u if u_rows is None else u_rows, w_rows, shared_u=u_rows is None)
                du = _apply(_Pushforward, rows, *primals, *w_rows)
            dx, du = _unfold(dx, size, k, shared=True), _unfold(du, size, k, shared=False)
            return (None, *_rebatch(dx, levels), *(None,) * layout.n_context, *_rebatch(du, levels))
        # d<w, J^T u>/dx = ∇²<u, f>(x) w ; d<w, J^T u>/du = J w
        dx = _hvp_terms(layout, primals, u, w)
        if isinstance(layout, _BatchedLayout):
            dx = tuple(d.sum(0) for d in dx)  # x is shared by the batch
        du = _apply(_Pushforward, layout, *primals, *w)
        return (None, *dx, *(None,) * layout.n_context, *du)

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> tuple[torch.Tensor, ...]:
        layout: _Layout = ctx.layout
        n = layout.n_primal
        _refuse_context_derivative(layout, tuple(t is not None for t in tangents[1 + layout.n_x : 1 + n]), "forward-mode derivative")
        saved = ctx.saved_tensors
        primals, u = saved[:n], saved[n:]
        tx, tu = tangents[1 : 1 + layout.n_x], tangents[1 + n :]
        terms = []
        if any(t is not None for t in tx):
            terms.append(_hvp_terms(layout, primals, u, _zeros_for_none(tx, primals[: layout.n_x]), shared_v=True))
        if any(t is not None for t in tu):
            terms.append(_apply(_Pullback, layout, *primals, *_zeros_for_none(tu, u)))
        if not terms:
            return tuple(torch.zeros_like(p) for p in primals[: layout.n_x])
        return tuple(sum(column) for column in zip(*terms))

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], layout: _Layout, *tensors: torch.Tensor) -> tuple[Any, Any]:
        batched = _tangent_batch_vmap(_Pullback, info, in_dims, layout, tensors, layout.n_primal)
        return batched if batched is not None else _loop_vmap(_Pullback, info, in_dims, layout, *tensors)


def _hvp_terms(
    layout: _Layout,
    primals: tuple[torch.Tensor, ...],
    u: tuple[torch.Tensor, ...],
    v: tuple[torch.Tensor, ...],
    shared_u: bool = False,
    shared_v: bool = False,
) -> tuple[torch.Tensor, ...]:
    """``∇²<u, f>(x) v`` for a plain layout; for a batched one, the batch of ``∇²<u_i, f>(x) v_i``
    (``shared_u``/``shared_v``: one ``u``/``v`` for every row)."""
    if not isinstance(layout, _BatchedLayout):
        return tuple(_apply(_Hvp, layout, *primals, *u, *v))
    base = layout.inner
    rows = [
        _apply(
            _Hvp,
            base,
            *primals,
            *(u if shared_u else tuple(leaf[i] for leaf in u)),
            *(v if shared_v else tuple(leaf[i] for leaf in v)),
        )
        for i in range(layout.count)
    ]
    return tuple(torch.stack(column) for column in zip(*rows))


class _Pushforward(torch.autograd.Function):
    """``J(x) v`` by the backend; backward: its HVP and pullback."""

    @staticmethod
    def forward(layout: _Layout, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        tensors = _contiguous(tensors)
        n = layout.n_primal
        tx = _split_tangents(layout, tensors[n:], layout.x_tree)
        results = layout.owner._pushforward(layout.x(tensors), tx, layout.contexts(tensors))
        return _join_results(layout, results)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.layout = inputs[0]
        ctx.save_for_backward(*inputs[1:])
        _no_materialized_zeros(ctx, output)

    @staticmethod
    def backward(ctx: Any, *u: torch.Tensor) -> tuple[Any, ...]:
        layout: _Layout = ctx.layout
        u = _zeros_for_missing(ctx, u)
        saved = ctx.saved_tensors
        n = layout.n_primal
        primals, v = saved[:n], saved[n:]
        batch = _legacy_batch(layout, saved, u)
        if batch is not None:  # a batch of u for one v: rows ∇²<u_i, f>(x) v, one pullback call
            plain, levels, size = batch
            rows, v_rows, u_rows, k = _legacy_rows(layout, size, v, plain)
            with outside_legacy_vmap():
                dx = _hvp_terms(rows, primals, u_rows, v if v_rows is None else v_rows, shared_v=v_rows is None)
                dv = _apply(_Pullback, rows, *primals, *u_rows)
            dx, dv = _unfold(dx, size, k, shared=True), _unfold(dv, size, k, shared=False)
            return (None, *_rebatch(dx, levels), *(None,) * layout.n_context, *_rebatch(dv, levels))
        # d<u, J v>/dx = ∇²<u, f>(x) v ; d<u, J v>/dv = J^T u
        if isinstance(layout, _BatchedLayout):
            dx = _hvp_terms(layout, primals, u, v)
            dx = tuple(d.sum(0) for d in dx)  # x is shared by the batch
        else:
            dx = tuple(_apply(_Hvp, layout, *primals, *u, *v))
        dv = _apply(_Pullback, layout, *primals, *u)
        return (None, *dx, *(None,) * layout.n_context, *dv)

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        raise _unsupported("forward-over-forward differentiation (e.g. jacfwd(jacfwd(g)))", ctx.layout)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], layout: _Layout, *tensors: torch.Tensor) -> tuple[Any, Any]:
        batched = _tangent_batch_vmap(_Pushforward, info, in_dims, layout, tensors, layout.n_primal)
        return batched if batched is not None else _loop_vmap(_Pushforward, info, in_dims, layout, *tensors)


class _Hvp(torch.autograd.Function):
    """``∇²<u, f>(x) v`` by the backend's ``hvp``; not differentiable further."""

    @staticmethod
    def forward(layout: _Layout, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        tensors = _contiguous(tensors)
        n = layout.n_primal
        u = layout.y_tree(tensors[n : n + layout.n_y])
        (hv,) = layout.owner._hvp(layout.x(tensors), u, (layout.x_tree(tensors[n + layout.n_y :]),), layout.contexts(tensors))
        return _flat(hv)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.layout = inputs[0]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        raise _unsupported("third-order differentiation", ctx.layout)

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        raise _unsupported("third-order differentiation", ctx.layout)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], layout: _Layout, *tensors: torch.Tensor) -> tuple[Any, Any]:
        return _loop_vmap(_Hvp, info, in_dims, layout, *tensors)
