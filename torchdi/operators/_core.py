"""What every operator shares, as orchestration only: the path of a preparation and of a call.

Argument checks live in ``_checks.py``, the guards around ``f``'s evaluations in ``_guards.py``,
runners and their construction in ``torchdi.runners``, the family facts in ``torchdi.families``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch.utils import _pytree as pytree

from torchdi.backends import Backend, require_available
from torchdi.contexts import State, bind_contexts, context_kinds, unwrap_contexts
from torchdi.distributed import refuse_data_parallel
from torchdi.errors import user_stacklevel
from torchdi.families import FAMILIES
from torchdi.into_grad import IntoGrad
from torchdi.operators._checks import (
    canonical_x,
    check_backend,
    check_out,
    check_output,
    check_state,
    check_tangents,
    grad_probes,
    x_unused,
)
from torchdi.operators._guards import (
    refuse_mutation,
    translation_note,
    without_inference_tensors,
    without_side_effects,
)
from torchdi.prep import Prep, describe, describe_contexts
from torchdi.runners import (
    BoundFunction,
    Runner,
    ServesEmpty,
    Spec,
    TranslatesContexts,
    TreeMeta,
    build_runner,
    engine_for,
    warm_up,
    zero_runner,
)
from torchdi.translate import copyto_

__all__ = ["prepare_operator", "run_operator", "write_out"]


def _batch_tangents(tangents: tuple[Any, ...]) -> Any:
    if len(tangents) == 1:
        return pytree.tree_map(lambda t: t.detach().unsqueeze(0), tangents[0])
    return pytree.tree_map(lambda *ts: torch.stack([t.detach() for t in ts]), tangents[0], *tangents[1:])


def _tangent_name(family: str, tangents: Any) -> str | None:
    """The public name of the tangents a call passed (``tx``/``ty``), or ``None``."""
    if tangents is None:
        return None
    return FAMILIES[family].tangent_name


def _argument_names(tangent_name: str | None, n_contexts: int) -> tuple[str, ...]:
    names = ["x"] + ([tangent_name] if tangent_name else [])
    return (*names, *(f"context {i + 1}" for i in range(n_contexts)))


def _received(x: Any, tangents: Any, values: tuple[Any, ...], kinds: tuple[str, ...], keep_static: bool) -> tuple[Any, ...]:
    head = (describe(x, keep_static),) if tangents is None else (describe(x, keep_static), describe(tangents))
    return head + describe_contexts(values, kinds, keep_static)


def prepare_operator(
    family: str,
    operator: str,
    f: Callable[..., Any],
    backend: Backend,
    x: Any,
    tangents: tuple[Any, ...] | None,
    contexts: Sequence[Any],
    strict: bool,
    value: bool | None = None,
) -> Prep:
    """Validate the arguments, build the runner for ``backend`` and compile it if needed.

    ``value`` says which variant a one-shot call needs (``None``: both, as ``prepare_*`` does).
    Preparation has no side effect a user can see: the global RNG state and every ``State``
    tensor are restored once it is done (its evaluations of ``f`` would otherwise shift dropout
    masks and update running statistics).
    """
    with without_side_effects([c.value for c in contexts if isinstance(c, State)]):
        return _prepare_operator(family, operator, f, backend, x, tangents, contexts, strict, value)


def _prepare_operator(
    family: str,
    operator: str,
    f: Callable[..., Any],
    backend: Backend,
    x: Any,
    tangents: tuple[Any, ...] | None,
    contexts: Sequence[Any],
    strict: bool,
    value: bool | None,
) -> Prep:
    if torch.is_inference_mode_enabled():
        # The user's outer context, not a request to drop derivatives: under inference_mode
        # autograd records nothing and every derivative would silently be zero.
        with torch.inference_mode(False):
            return prepare_operator(family, operator, f, backend, x, tangents, contexts, strict, value)
    if not callable(f):
        raise TypeError(f"{operator}: f must be callable, got {type(f).__name__}")
    check_backend(backend, operator)
    require_available(backend)
    row = FAMILIES[family]
    tangent_name = row.tangent_name
    values, mask = unwrap_contexts(contexts, operator, first_position=4 if tangent_name else 3)
    kinds = context_kinds(contexts)
    check_state(family, backend, values, kinds, operator)
    x = without_inference_tensors(x)
    values = without_inference_tensors(values)
    x_run = canonical_x(x, family, operator)
    bound = bind_contexts(f, mask)
    engine = engine_for(backend)
    # f sees at preparation what it will see in the engine's program (numpy arrays as tensors...).
    seen_by_f = engine.contexts_seen_by_f if isinstance(engine, TranslatesContexts) else None
    # The first evaluation also tells whether f's output uses x at all (x_unused): x's leaves
    # require grad in it. Where autograd refuses that (f writes into x, calls x.numpy()), f is
    # evaluated again as before, under no_grad, and reports its own error.
    seen = values if seen_by_f is None else seen_by_f(values)
    probing = grad_probes(x_run)
    if probing is not None:
        try:
            with torch.enable_grad(), refuse_mutation(x, values, kinds, operator), refuse_data_parallel(operator):
                y = bound(probing[0], seen)
        except Exception:
            probing = None
    if probing is None:
        try:
            with torch.no_grad(), refuse_mutation(x, values, kinds, operator), refuse_data_parallel(operator):
                y = bound(x_run, seen)
        except Exception as error:
            note = None if seen_by_f is None else translation_note(values)
            if note:
                error.add_note(note)
            raise
    check_output(y, row, operator)
    if probing is not None and x_unused(y, probing[1], bound, x_run, seen):
        warnings.warn(
            f"{operator}: f's output does not depend on x (no operation of f uses x), so every derivative "
            "is zero. If f evaluates a model, pass the parameters through it: "
            "torch.func.functional_call(model, params, (batch,)) instead of model(batch).",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
    x_meta, y_meta = TreeMeta.of(x_run), TreeMeta.of(y)
    n_tangents = 0
    if tangent_name is not None:
        like, like_name = (x_meta, "x") if row.tangents_like == "x" else (y_meta, "f(x)")
        check_tangents(tangents, like, like_name, operator, tangent_name)
        n_tangents = len(tangents)  # type: ignore[arg-type]
    elif tangents is not None:
        raise TypeError(f"{operator} takes no tangents")
    del y
    spec = Spec(x_meta, y_meta, n_tangents, state_contexts=tuple(i for i, kind in enumerate(kinds) if kind == "State"))
    batched = None if tangents is None else _batch_tangents(tangents)
    # Rule 2 without exception: one runner, compiled here, serves the plain operator and its
    # value_ variant; nothing compiles on a later call. The alternative, a second program without
    # the value for the plain operator (it lets the compiler drop f's final reduction), would cost
    # a second compilation at every prepare_gradient, paid even by loops that only call
    # value_and_gradient. Measured (benchmarks/compile_overhead.py, one thread, prepared gradient
    # / raw torch.compile(grad(f))): Rosenbrock 1e6 0.78 -> 0.93 (it pays the final reduction),
    # the two MLPs within noise; still at or below raw on all three.
    # A one-shot call (no prep: value is False or True) compiles only what it needs.
    if value is False and row.drops_value and engine.keeps_static:
        spec = replace(spec, needs_value=False)
    if (spec.x.numel == 0 or spec.y.numel == 0) and not (isinstance(engine, ServesEmpty) and family in engine.builds_empty):
        # No derivative to compute (an empty x or an empty f(x)): the zero map, on every
        # backend, instead of each engine's failure on empty bases and stacks.
        runner = zero_runner(family, bound, spec)
    else:
        runner = _built(backend, family, bound, spec, x_run, batched, values)
    expected = _received(x, tangents, values, kinds, engine.keeps_static)
    output_shape = torch.Size(y_meta.shapes[0]) if y_meta.is_tensor else None
    return Prep(
        family,
        f,
        backend,
        expected,
        _argument_names(tangent_name, len(values)),
        runner,
        strict,
        engine.keeps_static,
        output_shape,
    )


def _built(backend: Backend, family: str, f: BoundFunction, spec: Spec, x: Any, tangents: Any, values: tuple[Any, ...]) -> Runner:
    """The runner, compiled for these arguments when the engine compiles (``warm_up``)."""
    runner = build_runner(backend, family, f, spec)
    try:
        with torch.no_grad():  # calls run under no_grad too: the compiled program guards on it
            warm_up(runner, x, tangents, values)
    except Exception as error:
        note = translation_note(values)
        if note:
            error.add_note(note)
        raise
    return runner


def run_operator(
    family: str,
    operator: str,
    f: Callable[..., Any],
    backend: Backend,
    x: Any,
    tangents: tuple[Any, ...] | None,
    contexts: Sequence[Any],
    prep: Prep | None,
    value: bool = True,
) -> tuple[Any, ...]:
    """Run ``family`` through ``prep`` (prepared on the spot when ``None``): the full result.

    With ``value=False`` the value part may be ``None`` (the caller drops it).
    """
    if torch.is_inference_mode_enabled():
        with torch.inference_mode(False):  # see prepare_operator
            return run_operator(family, operator, f, backend, x, tangents, contexts, prep, value)
    if prep is None:
        prep = prepare_operator(family, operator, f, backend, x, tangents, contexts, strict=False, value=value)
        values = tuple(c.value for c in contexts)
    else:
        if not isinstance(prep, Prep):
            raise TypeError(f"{operator}: prep must be a torchdi Prep from prepare_{family}, got {type(prep).__name__}")
        values, _ = unwrap_contexts(contexts, operator, first_position=4 if tangents is not None else 3)
        if prep.strict:
            received = _received(x, tangents, values, context_kinds(contexts), prep.keep_static)
            if not prep.serves(family, f, backend, received):  # the names only matter for the message
                prep.check(family, f, backend, received, _argument_names(_tangent_name(family, tangents), len(values)))
        elif prep.operator != family or not (f is prep.f or f == prep.f) or not (backend is prep.backend or backend == prep.backend):
            prep.check(family, f, backend, None)  # strict=False skips only the argument signatures
    x = without_inference_tensors(x)
    values = without_inference_tensors(values)
    x_run = canonical_x(x, family, operator)
    batched = None if tangents is None else _batch_tangents(tangents)
    call = prep.call
    grad_enabled = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)  # torch.no_grad() without its object: ~1 us per call less
    try:
        return call(x_run, batched, values)
    finally:
        torch._C._set_grad_enabled(grad_enabled)


def write_out(result: Any, out: Any, operator: str) -> Any:
    """Copy ``result`` into the user's ``out=`` buffers (when given) and return what to hand back."""
    if out is None:
        return result
    if isinstance(out, IntoGrad):
        return out.write(result, operator)
    check_out(result, out, operator)
    try:
        with torch.no_grad():
            return copyto_(out, result)
    except ValueError as error:
        raise ValueError(f"{operator}: out= must have the structure and shapes of the result: {error}") from None

