"""Operators under outer transforms (DESIGN rule 10): what makes torchdi compose like a torch function.

An operator normally runs its runner on detached inputs with grad mode off: the fastest way to
compute a derivative nobody differentiates again. When an outer transform is active, that would
hand the outer transform a detached result, a derivative silently dropped. Outer transforms are:

- a ``torch.func`` transform (``vmap``, ``grad``, ``vjp``, ``jvp``, ``jacrev``, ``jacfwd``,
  ``hessian``): a functorch level is active;
- ``torch.compile`` tracing the call (dynamo; a compiled torchdi backend whose function calls an
  eager operator is one);
- ``torch.autograd``: grad mode is on and ``x``, a tangent, a context tensor, or a tensor ``f`` reads
  from its closure (seen once, at preparation) requires grad, and the call has no ``out=`` (``out=`` buffers
  are written without a graph, as ``.grad`` tensors are: the training loop's fast path).

Detection is a handful of O(1) checks on the call path. Then the operator runs *transparently*:
``x``, tangents and contexts are passed as they are (wrapped tensors, tensors that require grad),
grad mode stays the caller's, ``AutoAutograd`` builds its graphs with ``create_graph=True`` (it
reads the caller's grad mode), ``torch.func`` transforms nest in the outer ones, and finite
differences are plain arithmetic on ``f``'s values. ``torch.autograd.grad`` cannot run inside a
``torch.func`` transform (``requires_grad_`` is refused there) nor be traced whole by dynamo, so
under those transforms an ``AutoAutograd`` (also inside ``SecondOrder``) computes with
``torch.func`` instead: the same derivative, by the transform that composes.

Under ``torch.autograd`` alone ``AutoFunc``'s gradient is computed by ``torch.autograd.grad``
(``autograd_native``): the outer backward then walks one plain graph, not torch.func's wrapped one.

Compiled backends (``AutoCompile``, ``AutoXLA``, ``AutoSparse`` over them, ``SecondOrder`` with a
compiled member) and ``AutoSparse``'s sparse results cannot be differentiated again nor batched
by a ``torch.func`` transform or dynamo: under one they raise ``UnsupportedOperatorError`` at
once, naming the backends that compose. Under ``torch.autograd`` alone an ``AutoCompile`` result
is the compiled one, connected to the tracked inputs by ``_ThroughEager``, whose backward
recomputes it with the eager ``inner`` backend and differentiates that (``through_eager``); where
that cannot be done (``f`` draws random numbers, updates a ``State``, or reads tracked tensors
from its closure, which a recomputation could not reach; the other compiled backends) the
backward raises (``backward_refusal``), or the call itself when no input requires grad to connect
to. They never return a result the outer transform would see as a constant.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch.utils import _pytree as pytree

from torchdi.backends import (
    AutoAutograd,
    AutoCompile,
    AutoFiniteDiff,
    AutoFunc,
    AutoSparse,
    Backend,
    SecondOrder,
)
from torchdi.engines._dynamo import functorch_level, functorch_unwrapped
from torchdi.errors import UnsupportedOperatorError

__all__ = [
    "backward_refusal",
    "eager_of_compiled",
    "through_eager",
    "reads_tracked_besides",
    "composes",
    "functorch_safe",
    "outer_transform_active",
    "refuse_under_outer_transform",
    "tracked",
    "unwrapped",
]

_maybe_current_level: Callable[[], int | None] = functorch_level
_is_compiling: Callable[[], bool] = torch.compiler.is_compiling

# The families whose AutoSparse result is a sparse CSR tensor (the others are the dense backend's).
_SPARSE_FAMILIES = frozenset({"jacobian", "hessian"})

COMPOSING_BACKENDS = (
    "AutoFunc(), AutoAutograd(), AutoFiniteDiff(), SecondOrder(AutoFunc(), AutoFunc()), "
    "SecondOrder(AutoAutograd(), AutoFunc()), SecondOrder(AutoAutograd(), AutoAutograd())"
)


def tracked(tree: Any) -> bool:
    """Whether a tensor leaf of ``tree`` (``x`` or a context value) requires grad.

    Plain tensors, tuples, lists and dicts are walked without a pytree round trip; modules and
    other objects are not walked (what ``f`` reads from them is seen at preparation, like any
    closure).
    """
    kind = type(tree)
    if kind is torch.Tensor or isinstance(tree, torch.Tensor):
        return bool(tree.requires_grad)
    if kind is tuple or kind is list:
        for item in tree:  # noqa: SIM110  (a loop, not any(...): no generator object on every call)
            if tracked(item):
                return True
        return False
    if kind is dict:
        for item in tree.values():  # noqa: SIM110
            if tracked(item):
                return True
        return False
    if kind in pytree.SUPPORTED_NODES:
        return any(tracked(leaf) for leaf in pytree.tree_leaves(tree))
    return False


def outer_transform_active(x: Any, values: tuple[Any, ...] | None, reads_tracked: bool, detached: bool, tangents: Any = None) -> bool:
    """Whether a ``torch.func`` transform, dynamo, or ``torch.autograd`` may differentiate or batch
    this call's result (see the module docstring). O(1) plus a look at ``x``'s, the contexts' and
    the tangents' tensors (``x`` or ``values`` ``None``: the caller knows they hold no tensor that
    requires grad)."""
    if _is_compiling() or _maybe_current_level() is not None:  # (dynamo cannot call the latter)
        return True
    if detached or not torch.is_grad_enabled():
        return False
    return (
        reads_tracked
        or (x is not None and tracked(x))
        or (values is not None and tracked(values))
        or (tangents is not None and tracked(tangents))
    )


def composes(backend: Backend, family: str) -> bool:
    """Whether ``backend``'s ``family`` runner gives results an outer transform sees through."""
    if isinstance(backend, (AutoAutograd, AutoFunc, AutoFiniteDiff)):
        return True
    if isinstance(backend, SecondOrder):
        return composes(backend.outer, family) and composes(backend.inner, family)
    if isinstance(backend, AutoSparse):
        return family not in _SPARSE_FAMILIES and composes(backend.dense, family)
    return False  # AutoCompile, AutoXLA


def refuse_under_outer_transform(backend: Backend, family: str, operator: str) -> None:
    """Raise ``UnsupportedOperatorError`` when ``backend``'s result cannot be seen through."""
    if composes(backend, family):
        return
    # While dynamo traces, a dataclass repr (its recursion guard reads the thread id) would break
    # the graph before the message is raised: name the backend by its type then.
    shown = type(backend).__name__ if _is_compiling() else repr(backend)
    if isinstance(backend, AutoSparse) and family in _SPARSE_FAMILIES:
        why = (
            "its result is a sparse CSR tensor assembled from compressed passes, which outer transforms "
            "can neither batch nor differentiate"
        )
        instead = f"a dense backend: AutoSparse's dense backend (when it is eager), or {COMPOSING_BACKENDS}"
    else:
        why = (
            "a compiled program (torch.compile, torch-xla) can be neither differentiated again nor batched from "
            "outside, so the outer transform would see a constant"
        )
        instead = (
            f"{COMPOSING_BACKENDS}; or compile the whole computation instead: AutoCompile() as the OUTER backend "
            "traces eager operators called inside f into one program (torchdi.gradient(loss, torchdi.AutoCompile(), "
            "params) where loss calls torchdi.hvp(u, torchdi.AutoFunc(), x, ...)), and torchdi.DifferentiateWith(f, "
            f"{shown}) gives a compiled f whose derivatives outer transforms see"
        )
    raise UnsupportedOperatorError(
        f"{operator} with {shown} was called under an outer transform (a torch.func transform such as vmap or "
        "grad, torch.compile, or torch.autograd: grad mode is on and x, a context tensor or a tensor f reads "
        f"requires grad): {why}. Backends that compose: {instead}. If the result is not to be differentiated, "
        "pass x.detach() and detached contexts, call it under torch.no_grad(), or pass out=."
    )


def functorch_safe(backend: Backend) -> Backend:
    """``backend`` with every ``AutoAutograd`` replaced by ``AutoFunc()``: what runs under a
    ``torch.func`` transform or dynamo, where ``torch.autograd.grad`` cannot."""
    if isinstance(backend, AutoAutograd):
        return AutoFunc()
    if isinstance(backend, SecondOrder):
        return SecondOrder(functorch_safe(backend.outer), functorch_safe(backend.inner))
    if isinstance(backend, AutoSparse):
        return replace(backend, dense=functorch_safe(backend.dense))
    return backend


# The runners a call under an outer transform may run (``_core._run_transparent``): the prepared
# backend's own, the one with torch.func instead of torch.autograd.grad (``functorch_safe``),
# the one built on torch.autograd's own graph (``autograd_native``), or a compiled backend's eager
# inner backend, whose runner torch.autograd differentiates through (``through_eager``).
AS_IS, FUNCTORCH_SAFE, AUTOGRAD, EAGER = "as_is", "functorch_safe", "autograd", "eager"
VARIANTS = (AS_IS, FUNCTORCH_SAFE, AUTOGRAD, EAGER)

# The families whose AutoFunc runner an outer torch.autograd differentiates faster when they are
# computed by torch.autograd.grad(create_graph=True): torch.func's grad wraps every tensor f
# touches and unwraps its results, and outer autograd then walks that wrapped graph (measured,
# benchmarks/composition.py: a gradient penalty cost 1.6x the torch.autograd step by
# torch.func.grad, raw or through torch.func, 1.0x by torch.autograd.grad).
_AUTOGRAD_NATIVE_FAMILIES = frozenset({"gradient"})


def autograd_native(backend: Backend, family: str, has_aux: bool) -> Backend | None:
    """The backend that computes ``backend``'s ``family`` on ``torch.autograd``'s own graph when
    ``torch.autograd`` alone differentiates the result (no ``torch.func`` transform, no dynamo):
    ``AutoAutograd()`` for ``AutoFunc()``'s gradient, the same derivative by the system that
    differentiates it next; ``None`` where the backend's own runner is kept. (``has_aux``: AutoFunc
    returns aux from its own transform, AutoAutograd would evaluate f once more: kept.)"""
    if type(backend) is AutoFunc and family in _AUTOGRAD_NATIVE_FAMILIES and not has_aux:
        return AutoAutograd()
    return None


def variant(backend: Backend, family: str, has_aux: bool) -> str:
    """Which runner (``VARIANTS``) serves a call of ``backend``'s ``family`` under an outer transform
    now. A few O(1) checks: it runs on every such call."""
    if _is_compiling():  # (under dynamo, torch.func: see _core's rebuild)
        return FUNCTORCH_SAFE
    if _maybe_current_level() is not None:
        return FUNCTORCH_SAFE if needs_functorch_safe(backend) else AS_IS
    return AUTOGRAD if autograd_native(backend, family, has_aux) is not None else AS_IS


def needs_functorch_safe(backend: Backend) -> bool:
    """Whether ``backend`` runs ``torch.autograd.grad`` somewhere (see ``functorch_safe``)."""
    return functorch_safe(backend) != backend


def under_functorch_or_dynamo() -> bool:
    """Whether a ``torch.func`` transform is active or dynamo is tracing."""
    return _is_compiling() or _maybe_current_level() is not None


def unwrapped(t: torch.Tensor) -> torch.Tensor | None:
    """The plain tensor under ``torch.func``'s wrappers (all batch entries of a ``vmap``ped tensor):
    what a value comparison may read without a batching rule (``None``: this torch cannot unwrap)."""
    return functorch_unwrapped(t)


class _RefuseBackward(torch.autograd.Function):
    """The results of a compiled backend, connected to the tracked inputs they depend on, whose
    backward raises: ``torch.autograd`` may still read them (a training loop without ``out=``),
    but never differentiates through them to a silent zero."""

    @staticmethod
    def forward(ctx: Any, message: str, count: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.message = message
        return tuple(t.view_as(t) for t in tensors[:count])

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise UnsupportedOperatorError(ctx.message)


def eager_of_compiled(backend: Backend) -> Backend | None:
    """The eager backend whose derivatives ``torch.autograd`` takes through ``backend``'s results:
    ``AutoCompile``'s ``inner`` (its closure, run eagerly); ``None`` for the backends that refuse
    (``AutoXLA``: another device; ``AutoSparse`` and ``SecondOrder`` over compiled backends)."""
    return backend.inner if isinstance(backend, AutoCompile) else None


class _ThroughEager(torch.autograd.Function):
    """A compiled backend's results under ``torch.autograd`` alone: the forward hands them out as
    they are; the backward recomputes them with the eager inner backend on the saved inputs (the
    tracked leaves of ``x``, the tangents and the contexts), transparently, and differentiates that
    (like ``torch.utils.checkpoint``). With ``create_graph=True`` the recomputation is recorded, so
    double backward works too."""

    @staticmethod
    def forward(ctx: Any, recompute: Callable[[list[torch.Tensor]], list[torch.Tensor]], count: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.recompute = recompute
        ctx.count = count
        ctx.save_for_backward(*tensors[count:])
        return tuple(t.view_as(t) for t in tensors[:count])

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        inputs = list(ctx.saved_tensors)
        create_graph = torch.is_grad_enabled()  # (backward(create_graph=True): keep the chain to the inputs)
        with torch.enable_grad():
            run_inputs = inputs if create_graph else [t.detach().requires_grad_() for t in inputs]
            outs = ctx.recompute(run_inputs)
            pairs = [(o, g) for o, g in zip(outs, grads, strict=True) if g is not None and o.requires_grad]
            got: tuple[torch.Tensor | None, ...]
            if pairs:
                got = torch.autograd.grad(
                    [o for o, _ in pairs], run_inputs, [g for _, g in pairs], allow_unused=True, create_graph=create_graph
                )
            else:
                got = (None,) * len(inputs)
        return (None, None, *([None] * ctx.count), *got)


def _float_positions(leaves: list[Any]) -> list[int]:
    return [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and (leaf.is_floating_point() or leaf.is_complex())]


def through_eager(
    runner: Callable[..., Any], arguments: tuple[Any, Any, tuple[Any, ...]], operator: str
) -> Callable[[Any], Any] | None:
    """For a compiled backend's call under ``torch.autograd`` alone: a function that connects its
    results to the tensors that require grad among ``arguments`` (``(x, tangents, contexts)`` as the
    runner takes them, not detached) through ``_ThroughEager``, whose backward differentiates
    ``runner`` (the eager inner backend's runner) at the same arguments. ``None`` when no argument
    requires grad (only a closure does: nothing to connect to)."""
    leaves, spec = pytree.tree_flatten(arguments)
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
    if not positions:
        return None

    def attach(result: Any) -> Any:
        result_leaves, result_spec = pytree.tree_flatten(result)
        chosen = _float_positions(result_leaves)
        dropped = [i for i, part in enumerate(result) if part is None] if isinstance(result, tuple) else []

        def recompute(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
            args = list(leaves)
            for i, t in zip(positions, inputs):
                args[i] = t
            eager = runner(*pytree.tree_unflatten(args, spec))
            if dropped and isinstance(eager, tuple):  # (the compiled call skipped a value the eager one computes)
                eager = tuple(None if i in dropped else part for i, part in enumerate(eager))
            eager_leaves, eager_spec = pytree.tree_flatten(eager)
            if eager_spec != result_spec or _float_positions(eager_leaves) != chosen:
                raise UnsupportedOperatorError(
                    f"{operator}: the eager recomputation of a compiled result for torch.autograd has another "
                    "structure than the compiled result; compute it with the eager backend (AutoFunc()) instead."
                )
            return [eager_leaves[i] for i in chosen]

        outputs = _ThroughEager.apply(recompute, len(chosen), *(result_leaves[i] for i in chosen), *(leaves[i] for i in positions))
        for i, out in zip(chosen, outputs):
            result_leaves[i] = out
        return pytree.tree_unflatten(result_leaves, result_spec)

    return attach


def backward_refusal(backend: Backend, family: str, operator: str, x: Any, values: tuple[Any, ...], why: str | None = None) -> Callable[[Any], Any]:
    """For a backend that does not compose called with grad mode on and ``x`` or a context tensor
    that requires grad (``torch.autograd`` is the only outer system): a function that connects the
    results to those tensors through a node whose backward raises ``UnsupportedOperatorError``.
    Raises at once instead when no such tensor is there to connect to (``f`` reads tracked tensors
    from its closure) or when the result is a sparse tensor."""
    inputs = [leaf for leaf in pytree.tree_leaves((x, values)) if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
    if not inputs or (isinstance(backend, AutoSparse) and family in _SPARSE_FAMILIES):
        refuse_under_outer_transform(backend, family, operator)
    try:
        refuse_under_outer_transform(backend, family, operator)
    except UnsupportedOperatorError as error:
        message = str(error).replace("was called under an outer transform", "was differentiated by torch.autograd", 1)
        if why:
            message += f" ({why})"

    def attach(result: Any) -> Any:
        leaves, spec = pytree.tree_flatten(result)
        positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and (leaf.is_floating_point() or leaf.is_complex())]
        outputs = _RefuseBackward.apply(message, len(positions), *(leaves[i] for i in positions), *inputs)
        for i, out in zip(positions, outputs):
            leaves[i] = out
        return pytree.tree_unflatten(leaves, spec)

    return attach


def reads_tracked_besides(y: Any, probes: set[int]) -> list[Any]:
    """Weak references to the tensors that require grad, other than the probes (``x``'s leaves at
    preparation), that ``y``'s autograd graph reaches: a context or a tensor ``f`` closes over.
    Walked once, at preparation. The caller checks which are still alive once ``y`` is dropped:
    leaves ``f`` made itself (an ``f`` calling ``torch.autograd.grad`` on a detached copy, an inner
    ``AutoAutograd`` operator) die with ``y``'s graph; what ``f`` reads from outside stays."""
    found: list[Any] = []
    stack = []
    for leaf in pytree.tree_leaves(y):
        if not isinstance(leaf, torch.Tensor) or not leaf.requires_grad:
            continue
        if leaf.grad_fn is None:
            if id(leaf) not in probes:
                found.append(weakref.ref(leaf))
            continue
        stack.append(leaf.grad_fn)
    # The nodes themselves, not their ids: torch may hand out a new Python object for a node at
    # each next_functions access (torch 2.11 does), and a freed one's id is reused by the next,
    # which an id set would take as seen and stop the walk early (a closed-over parameter missed).
    seen: set[Any] = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for child, _ in node.next_functions:
            if child is None:
                continue
            variable = getattr(child, "variable", None)
            if variable is not None:  # AccumulateGrad: a leaf that requires grad
                if id(variable) not in probes:
                    found.append(weakref.ref(variable))
            else:
                stack.append(child)
    return found
