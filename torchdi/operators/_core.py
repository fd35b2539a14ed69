"""What every operator shares, as orchestration only: the path of a preparation and of a call.

Argument checks live in ``_checks.py``, the guards around ``f``'s evaluations in ``_guards.py``,
runners and their construction in ``torchdi.runners``, the family facts in ``torchdi.families``.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch.utils import _pytree as pytree

from torchdi.backends import AutoSparse, Backend, require_available
from torchdi.composition import evaluates_f_plainly
from torchdi.contexts import Cache, Constant, State, bind_contexts, context_kinds, unwrap_contexts
from torchdi.distributed import process_group_initialized, refuse_data_parallel
from torchdi.engines._dynamo import set_grad_enabled
from torchdi.errors import UnsupportedOperatorError, user_stacklevel
from torchdi.families import FAMILIES
from torchdi.into_grad import IntoGrad
from torchdi.operators import _one_shot, _transparent
from torchdi.operators._aux import AuxRunner, native_aux, split_aux, without_aux
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
    restore_rng_states,
    rng_states,
    same_rng_states,
    translation_note,
    without_inference_tensors,
    without_side_effects,
)
from torchdi.operators._trees import Flattening, needs_flattening
from torchdi.prep import (
    Prep,
    PreparationMismatchError,
    describe,
    describe_contexts,
    format_description,
)
from torchdi.runners import (
    BoundFunction,
    DropsValue,
    Runner,
    ServesEmpty,
    Spec,
    TranslatesContexts,
    TreeMeta,
    build_runner,
    engine_for,
    implements,
    output_shape_error,
    warm_up,
    zero_runner,
)
from torchdi.sparsity.known import KnownColoring, TracedColoring
from torchdi.translate import copyto_

__all__ = ["prepare_operator", "run_operator", "with_aux_result", "write_out"]

logger = logging.getLogger("torchdi")


def _batch_tangents(tangents: tuple[Any, ...], detach: bool = True) -> Any:
    if not detach:  # an outer transform differentiates (or batches) through the tangents too
        if len(tangents) == 1:
            return pytree.tree_map(lambda t: t.unsqueeze(0), tangents[0])
        return pytree.tree_map(lambda *ts: torch.stack(ts), tangents[0], *tangents[1:])
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
    has_aux: bool = False,
    runner_factory: Callable[..., Runner | None] | None = None,
) -> Prep:
    """Validate the arguments, build the runner for ``backend`` and compile it if needed.

    ``value`` says which variant a one-shot call needs (``None``: both, as ``prepare_*`` does).
    ``has_aux``: ``f`` returns ``(y, aux)``; the runner's value is then ``(y, aux)``.
    ``runner_factory(backend, family, f, spec, x, tangents, values)``: a runner of its own
    (same-point preparations), or ``None`` for the ordinary one.
    Preparation has no side effect a user can see: the global RNG state and every ``State``
    tensor are restored once it is done (its evaluations of ``f`` would otherwise shift dropout
    masks and update running statistics).
    """
    with without_side_effects([c.value for c in contexts if isinstance(c, State)]):
        return _prepare_operator(family, operator, f, backend, x, tangents, contexts, strict, value, has_aux, runner_factory)


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
    has_aux: bool = False,
    runner_factory: Callable[..., Runner | None] | None = None,
) -> Prep:
    compiling = torch.compiler.is_compiling()  # dynamo traces this call: see _transparent
    if not compiling and torch.is_inference_mode_enabled():
        # The user's outer context, not a request to drop derivatives: under inference_mode
        # autograd records nothing and every derivative would silently be zero.
        with torch.inference_mode(False):
            return prepare_operator(family, operator, f, backend, x, tangents, contexts, strict, value, has_aux, runner_factory)
    if not callable(f):
        raise TypeError(f"{operator}: f must be callable, got {type(f).__name__}")
    if not isinstance(has_aux, bool):
        raise TypeError(f"{operator}: has_aux must be True or False, got {has_aux!r}")
    check_backend(backend, operator)
    require_available(backend)
    row = FAMILIES[family]
    tangent_name = row.tangent_name
    values, mask = unwrap_contexts(contexts, operator, first_position=4 if tangent_name else 3)
    kinds = context_kinds(contexts)
    check_state(family, backend, values, kinds, operator)
    if not compiling:  # (no inference tensors reach a trace)
        x = without_inference_tensors(x)
        values = without_inference_tensors(values)
    if _transparent.under_functorch_or_dynamo():
        # Under a torch.func transform or dynamo: refused at once, before anything compiles.
        _transparent.refuse_under_outer_transform(backend, family, operator)
    x_run = canonical_x(x, family, operator)
    bound = bind_contexts(f, mask)
    engine = engine_for(backend)
    # f sees at preparation what it will see in the engine's program (numpy arrays as tensors...).
    seen_by_f = engine.contexts_seen_by_f if implements(engine, TranslatesContexts) else None
    # The first evaluation also tells whether f's output uses x at all (x_unused): x's leaves
    # require grad in it. Where autograd refuses that (f writes into x, calls x.numpy()), f is
    # evaluated again as before, under no_grad, and reports its own error.
    seen = values if seen_by_f is None else seen_by_f(values)
    # (under torch.func transforms requires_grad_ is refused: no probe; calls there are transparent anyway)
    probing = None if _transparent.under_functorch_or_dynamo() else grad_probes(x_run)
    rng_before = None if compiling else rng_states()
    if probing is not None:
        try:
            with torch.enable_grad(), refuse_mutation(x, values, kinds, operator), refuse_data_parallel(operator):
                y = bound(probing[0], seen)
        except Exception:
            probing = None
    if probing is None:
        try:
            with torch.no_grad(), refuse_mutation(x, values, kinds, operator), _unless(compiling, refuse_data_parallel, operator):
                y = bound(x_run, seen)
        except Exception as error:
            note = None if seen_by_f is None else translation_note(values)
            if note:
                error.add_note(note)
            raise
    # Whether f draws random numbers (dropout): then a recomputation of its derivatives (a compiled
    # result differentiated by torch.autograd) would see other draws. (The RNG is restored after
    # preparation: see without_side_effects.)
    draws_random = rng_before is not None and not same_rng_states(rng_before, rng_states())
    f_needs_grad = False
    if probing is not None and evaluates_f_plainly(backend):
        # Rule 10: f may call torch.autograd itself (a gradient penalty, a PINN residual). This
        # backend's runners evaluate f as it is, and the plain call runs them under no_grad: one
        # more evaluation, under no_grad, tells whether f needs grad mode (then the call keeps it on).
        try:
            with torch.no_grad(), refuse_mutation(x, values, kinds, operator), refuse_data_parallel(operator):
                bound(x_run, seen)
        except Exception:
            f_needs_grad = True
    with_aux, tensor_aux = bound, True
    if has_aux:
        y, aux = split_aux(y, operator)
        # torch.func carries only tensors out of a transform: other aux leaves take the generic path.
        tensor_aux = all(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(aux))
        del aux
        bound = without_aux(bound, operator)
    check_output(y, row, operator)
    # A one-shot call under a torch.func transform (a PINN's inner hvp) is prepared at every step:
    # what this evaluation teaches is kept for the next ones (see _one_shot).
    learning = (
        not compiling
        and _transparent.under_functorch_or_dynamo()
        and _one_shot.eligible(backend)
        and not has_aux
        and "State" not in kinds
        and runner_factory is None
        and seen_by_f is None
    )
    y_learned = TreeMeta.of(y) if learning else None
    # Whether f reads a tensor that requires grad besides x (a context, a closed-over parameter):
    # then its derivatives depend on it and outer autograd must see them (rule 10).
    # (context tensors are not counted: every call looks at its own contexts; no probe while dynamo
    # traces, which on torch 2.11 cannot trace id() of a tensor made inside the graph)
    reached = []
    if probing is not None:
        contexts_seen = {id(leaf) for leaf in pytree.tree_leaves((values, seen)) if isinstance(leaf, torch.Tensor)}
        reached = _transparent.reads_tracked_besides(y, probing[1] | contexts_seen)
    if probing is not None and x_unused(y, probing[1], bound, x_run, seen):
        warnings.warn(
            f"{operator}: f's output does not depend on x (no operation of f uses x), so every derivative "
            "is zero. If f evaluates a model, pass the parameters through it: "
            "torch.func.functional_call(model, params, (batch,)) instead of model(batch).",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
    x_meta, y_meta = TreeMeta.of(x_run), TreeMeta.of(y)
    output_shape = torch.Size(y_meta.shapes[0]) if y_meta.is_tensor else None
    flattening = None
    _refuse_sparse_vector_hessian(backend, family, y, operator)
    if needs_flattening(family, x_run, y):
        # jacobian/hessian of a pytree x or y: the engine differentiates the raveled function.
        _refuse_sparse_trees(backend, family, x_run, y, operator)
        flattening = Flattening(family, x_run, y, operator)
        bound = flattening.function(bound)
        x_run = flattening.flat_x(x_run)
        x_meta, y_meta = TreeMeta.of(x_run), TreeMeta.of(flattening.flat_y(y))
    n_tangents = 0
    if tangent_name is not None:
        like, like_name = (x_meta, "x") if row.tangents_like == "x" else (y_meta, "f(x)")
        check_tangents(tangents, like, like_name, operator, tangent_name)
        n_tangents = len(tangents)  # type: ignore[arg-type]
    elif tangents is not None:
        raise TypeError(f"{operator} takes no tangents")
    del y
    spec = Spec(x_meta, y_meta, n_tangents, state_contexts=tuple(i for i, kind in enumerate(kinds) if kind == "State"))
    aux_natively = (
        has_aux and tensor_aux and flattening is None and native_aux(backend, family) and spec.x.numel > 0 and spec.y.numel > 0
    )
    if aux_natively:  # the engine's own transform carries aux out (one evaluation of f)
        bound, spec = with_aux, replace(spec, has_aux=True)
    elif has_aux and "State" in kinds:
        raise UnsupportedOperatorError(
            f"{operator} with {backend!r} and has_aux=True: aux is read from one more evaluation of f, which "
            "would update the State twice. Backends that return aux from the differentiated evaluation: "
            "AutoFunc() and AutoCompile() (inner=AutoFunc()) for gradient, pullback, pushforward, "
            "derivative and jacobian."
        )
    batched = None if tangents is None else _batch_tangents(tangents)
    # Rule 2 without exception: one runner, compiled here, serves the plain operator and its
    # value_ variant; nothing compiles on a later call. A runner that can drop the value (a
    # compiled gradient: DropsValue) is asked for its value-free way before it compiles (_built):
    # one dynamo trace, one set of guards, and the traced graph compiled twice, with and without
    # the value, so that the plain gradient skips f's final reduction (see engines/_compiled.py).
    # A one-shot call (no prep: value is False or True) compiles only what it needs.
    if value is False and row.drops_value and engine.keeps_static and not has_aux:
        spec = replace(spec, needs_value=False)
    if (spec.x.numel == 0 or spec.y.numel == 0) and not (implements(engine, ServesEmpty) and family in engine.builds_empty):
        # No derivative to compute (an empty x or an empty f(x)): the zero map, on every
        # backend, instead of each engine's failure on empty bases and stacks.
        runner, lean_call = zero_runner(family, bound, spec), None
    else:
        own = None if runner_factory is None else runner_factory(backend, family, bound, spec, x_run, batched, values)
        runner, lean_call = (own, None) if own is not None else _built(backend, family, bound, spec, x_run, batched, values)
    bare = runner
    if flattening is not None:
        runner = flattening.runner(runner)
    if has_aux and not aux_natively:
        runner = AuxRunner(runner, with_aux, operator)
    if runner is not bare:  # the value-free way is the bare runner's: never past a wrapper it would skip
        lean_call = None
    expected = _received(x, tangents, values, kinds, engine.keeps_static)
    prep = Prep(
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
    prep.loose_key = expected[: 1 if tangents is None else 2]
    prep.has_aux = has_aux
    prep.f_needs_grad = f_needs_grad
    prep.lean_call = lean_call
    if y_learned is not None and spec.x.numel and spec.y.numel:
        prep.learned = _one_shot.Learned(spec, flattening, y_learned)
    if draws_random:
        prep.recompute_refusal = "f draws random numbers, which an eager recomputation in backward would draw anew"
    elif "State" in kinds:
        prep.recompute_refusal = "f updates a State context, which an eager recomputation in backward would update again"
    del probing  # y and the probes are gone: what f made dies with them, what it reads stays
    prep.reads_tracked = any(ref() is not None for ref in reached)
    if spec.x.numel and spec.y.numel:
        # Runners for calls under outer transforms, built on the first such call: under torch.func
        # transforms and dynamo, torch.autograd.grad cannot run (the same derivative from
        # torch.func instead); the plain gradient skips its value (torch.func.grad, not grad_and_value).
        plain_spec = replace(spec, needs_value=False) if row.drops_value else spec

        def rebuild(variant: str, lean: bool) -> Runner:
            # Under dynamo and torch.func (functorch_safe), context tensors enter forward mode as
            # explicit primals: see Spec.inside_forward_mode and FuncEngine._hvp.
            chosen = plain_spec if lean else spec
            if variant in (_transparent.FUNCTORCH_SAFE, _transparent.AS_IS):
                rebuilt = _runner_under_transform(backend, family, bound, chosen, variant)
            elif variant == _transparent.AUTOGRAD:
                native = _transparent.autograd_native(backend, family, has_aux)
                rebuilt = build_runner(native if native is not None else backend, family, bound, chosen)
            elif variant == _transparent.EAGER:
                eager = _transparent.eager_of_compiled(backend)
                rebuilt = build_runner(eager if eager is not None else backend, family, bound, chosen)
                if seen_by_f is not None:  # f sees the contexts as in the compiled program (numpy as tensors...)
                    rebuilt = _seeing_contexts(rebuilt, seen_by_f)
            else:
                raise ValueError(f"unknown runner variant {variant!r}")
            # The same wrapping as the prepared runner: pytree nesting and aux.
            if flattening is not None:
                rebuilt = flattening.runner(rebuilt)
            if has_aux and not aux_natively:
                rebuilt = AuxRunner(rebuilt, with_aux, operator)
            return rebuilt

        prep.rebuild = rebuild
    return prep


def _runner_under_transform(backend: Backend, family: str, bound: BoundFunction, spec: Spec, variant: str) -> Runner:
    """The runner of a call under an outer transform for the variant ``AS_IS`` (the backend's own)
    or ``FUNCTORCH_SAFE`` (torch.func instead of torch.autograd.grad; context tensors enter forward
    mode as explicit primals: see Spec.inside_forward_mode and FuncEngine._hvp)."""
    if variant == _transparent.FUNCTORCH_SAFE:
        return build_runner(_transparent.functorch_safe(backend), family, bound, replace(spec, inside_forward_mode=True))
    return build_runner(backend, family, bound, spec)


def _seeing_contexts(runner: Runner, seen_by_f: Callable[[tuple[Any, ...]], tuple[Any, ...]]) -> Runner:
    def run(x: Any, tangents: Any, values: tuple[Any, ...]) -> Any:
        return runner(x, tangents, seen_by_f(values))

    return run


def _unless(skip: bool, manager: Callable[[str], contextlib.AbstractContextManager[None]], operator: str) -> contextlib.AbstractContextManager[None]:
    """``manager(operator)``, or nothing while dynamo traces (a global module hook is no graph op)."""
    return contextlib.nullcontext() if skip else manager(operator)


def _refuse_sparse_vector_hessian(backend: Backend, family: str, y: Any, operator: str) -> None:
    """``AutoSparse`` hessians are the sparse matrix of a scalar ``f``."""
    if isinstance(backend, AutoSparse) and family == "hessian" and isinstance(y, torch.Tensor) and y.numel() != 1:
        raise UnsupportedOperatorError(
            f"{operator} with {backend!r}: a sparse hessian is the matrix of a scalar f, but f returns shape "
            f"{tuple(y.shape)}. The dense backend {backend.dense!r} computes the hessian of a non-scalar f "
            "(shape y.shape + x.shape + x.shape); or take the sparse hessian of each output's scalar function."
        )


def _refuse_sparse_trees(backend: Backend, family: str, x: Any, y: Any, operator: str) -> None:
    """``AutoSparse`` returns one sparse matrix: a nested result of sparse blocks has no use."""
    if isinstance(backend, AutoSparse):
        what = "x" if not isinstance(x, torch.Tensor) else "f(x)"
        raise TypeError(
            f"{operator} with {backend!r}: {what} is a {type(x if what == 'x' else y).__name__}, but a sparse "
            f"{family} is one sparse matrix of a tensor x (and a tensor f(x)). Ravel the pytree into one "
            "tensor (torch.cat([t.reshape(-1) for t in leaves])) inside f, or use the dense backend "
            f"{backend.dense!r}, which nests the {family} as torch.func does."
        )


def _built(
    backend: Backend, family: str, f: BoundFunction, spec: Spec, x: Any, tangents: Any, values: tuple[Any, ...]
) -> tuple[Runner, Runner | None]:
    """The runner, compiled for these arguments when the engine compiles (``warm_up``), and what
    the plain operator runs instead when the runner has a value-free way (asked for before the
    runner compiles, which then compiles it too) or ``None``."""
    runner = build_runner(backend, family, f, spec)
    lean = runner.without_value() if FAMILIES[family].drops_value and spec.needs_value and implements(runner, DropsValue) else None
    try:
        with torch.no_grad():  # calls run under no_grad too: the compiled program guards on it
            # (and with plain contexts: see run_operator)
            warm_up(runner, x, tangents, _detached_values(values))
    except Exception as error:
        note = translation_note(values)
        if note:
            error.add_note(note)
        raise
    return runner, lean


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
    detached: bool = False,
    has_aux: bool = False,
) -> tuple[Any, ...]:
    """Run ``family`` through ``prep`` (prepared on the spot when ``None``): the full result.

    With ``value=False`` the value part may be ``None`` (the caller drops it). ``detached=True``
    (an ``out=`` call) says the result is not differentiated by outer autograd. With
    ``has_aux`` the value part is ``(value, aux)``.
    """
    if torch.compiler.is_compiling():  # dynamo traces f's call of this operator: no bookkeeping
        return _run_traced(family, operator, f, backend, x, tangents, contexts, prep, value, has_aux)
    if torch.is_inference_mode_enabled():
        with torch.inference_mode(False):  # see prepare_operator
            return run_operator(family, operator, f, backend, x, tangents, contexts, prep, value, detached, has_aux)
    if prep is None:
        key = None
        if _transparent.under_functorch_or_dynamo():  # refused at once, before anything compiles
            _transparent.refuse_under_outer_transform(backend, family, operator)
            if not has_aux and _one_shot.eligible(backend):  # (dynamo took the branch above)
                key, result = _run_learned(family, operator, f, backend, x, tangents, contexts, value)
                if result is not None:
                    return result
        prep = prepare_operator(family, operator, f, backend, x, tangents, contexts, strict=False, value=value, has_aux=has_aux)
        values = tuple(c.value for c in contexts)
        x_matched = False
        if key is not None and prep.learned is not None:
            _one_shot.remember(f, key, prep.learned)
    else:
        if not isinstance(prep, Prep):
            raise TypeError(f"{operator}: prep must be a torchdi Prep from prepare_{family}, got {type(prep).__name__}")
        unwrapped = _unwrapped_described(x, tangents, contexts, prep.keep_static) if prep.strict else None
        if unwrapped is None:
            values, _ = unwrap_contexts(contexts, operator, first_position=4 if tangents is not None else 3)
        else:
            values = unwrapped[0]
        if prep.strict:
            received = _received(x, tangents, values, context_kinds(contexts), prep.keep_static) if unwrapped is None else unwrapped[1]
            if not prep.serves(family, f, backend, received):  # the names only matter for the message
                prep.check(family, f, backend, received, _argument_names(_tangent_name(family, tangents), len(values)))
        elif prep.operator != family or not (f is prep.f or f == prep.f) or not (backend is prep.backend or backend == prep.backend):
            prep.check(family, f, backend, None)  # strict=False skips only the argument signatures
        if prep.has_aux is not has_aux:  # the result's layout depends on it: checked even without strict
            _refuse_aux_mismatch(prep, has_aux, operator)
        if prep.point is not None:  # a same-point preparation: never a stale result, whatever strict says
            prep.point.check(x, values)
        elif not prep.strict:
            prep = _loose(prep, family, operator, f, x, tangents, contexts)
        # x's description (type, shape, dtype) is the one prepared: the strict check's, or _loose's.
        x_matched = prep.strict or prep.point is None
    # One look at the leaves for the common case (tensors that neither require grad nor were made
    # under inference_mode): then there is nothing to copy, and outer autograd sees no context.
    plain_x, plain_values = _plain(x), (not values or _plain(values))
    if not plain_x:
        x = without_inference_tensors(x)
    if not plain_values:
        values = without_inference_tensors(values)
    attach = None
    if _transparent.outer_transform_active(None if plain_x else x, None if plain_values else values, prep.reads_tracked, detached, tangents):
        if _transparent.composes(prep.backend, family) or _transparent.under_functorch_or_dynamo():
            return _run_transparent(family, operator, prep, x, tangents, values, value)
        # torch.autograd alone, on a backend that does not compose: the plain results, whose backward
        # recomputes them with the eager inner backend of AutoCompile and differentiates that; on the
        # others (or when it cannot), whose backward raises (or a refusal at once when they cannot be
        # connected to what requires grad).
        if prep.rebuild is not None and not prep.reads_tracked and prep.recompute_refusal is None and _transparent.eager_of_compiled(prep.backend) is not None:
            attach = _through_eager(prep, family, operator, x, tangents, values)
        if attach is None:
            attach = _transparent.backward_refusal(prep.backend, family, operator, (x, tangents), values, prep.recompute_refusal)
    if prep.keep_static and not plain_values and _transparent.tracked(values):
        # A compiled program is prepared for plain contexts (see _built): one that requires grad
        # would fail its guards and recompile.
        values = _detached_values(values)
    # A plain contiguous tensor of the prepared description is what canonical_x would return
    # (its dtype was checked at preparation): 0.3 us a call less.
    x_run = x if x_matched and plain_x and type(x) is torch.Tensor and x.is_contiguous() else canonical_x(x, family, operator)
    batched = None if tangents is None else _batch_tangents(tangents)
    call = prep.call if value or prep.lean_call is None else prep.lean_call
    grad_enabled = torch.is_grad_enabled()
    f_needs_grad = prep.f_needs_grad
    set_grad_enabled(f_needs_grad)  # torch.no_grad() without its object: ~1 us per call less
    try:
        result = call(x_run, batched, values)
    except Exception as error:
        _refuse_changed_output(prep, f, x, values, contexts, error)
        raise
    finally:
        set_grad_enabled(grad_enabled)
    if f_needs_grad:  # (the graph f built for its own torch.autograd calls is not the caller's)
        result = pytree.tree_map(_detached, result)
    return result if attach is None else attach(result)


def _refuse_changed_output(prep: Prep, f: Callable[..., Any], x: Any, values: tuple[Any, ...], contexts: Sequence[Any], error: Exception) -> None:
    """After a runner failed: when ``f(x)`` no longer has the shape the preparation holds, raise
    the ``PreparationMismatchError`` that says so (``output_shape_error``), from ``error``.

    Rule 1 cannot see a context's value, a global or a closure cell that changes the shape of
    ``f(x)``; the runners that hold it then fail inside torch (a cotangent or basis of the old
    shape, a gather at the old pattern's positions) with errors that do not say why. ``f`` is
    evaluated once more to tell, on this failing path only (never on a successful call, so it
    costs nothing there), and not when it would update a ``State`` a second time, nor in a process
    group (f may issue collectives that ranks without the failure would not match). Runners whose
    result would otherwise be silently of the old size check on every call instead."""
    if prep.output_shape is None or "State" in context_kinds(contexts) or process_group_initialized():
        return
    try:
        with torch.set_grad_enabled(prep.f_needs_grad):
            out = f(x, *values)
    except Exception:  # f itself fails here: the runner's error is the one to see
        return
    y = out[0] if prep.has_aux and isinstance(out, tuple) else out
    if isinstance(y, torch.Tensor) and y.shape != prep.output_shape:
        raise output_shape_error((y.shape,), (prep.output_shape,)) from error


def _loose_key(prep: Prep, x: Any, tangents: Any) -> tuple[Any, ...]:
    """What a ``strict=False`` call still compares with the preparation: the descriptions of ``x``
    and the tangents (``_received``'s head)."""
    return (describe(x, prep.keep_static),) if tangents is None else (describe(x, prep.keep_static), describe(tangents))


def _loose(prep: Prep, family: str, operator: str, f: Callable[..., Any], x: Any, tangents: Any, contexts: Sequence[Any]) -> Prep:
    """The preparation that serves a ``strict=False`` call: ``prep`` itself when ``x`` and the
    tangents have the signatures it was prepared with, else one prepared again for theirs (kept
    for later calls like it).

    ``strict=False`` skips the contexts' signatures (a compiled program's own guards watch them,
    rule 7), not x's: what a runner holds for x's signature (AutoSparse's colour seeds, the basis
    of a jacobian over torch.autograd, a finite-difference step for x's dtype, a pytree's layout)
    served an x of another dtype with a result of the prepared dtype, and one of another shape
    with an error from deep inside torch or dynamo. The comparison costs what the strict check
    costs for x alone: 0.46 us per call on a tensor x (timeit, load average 8 on 2 cores), beside
    about 150 us for the prepared AutoFunc gradient of a 16-element x."""
    key = _loose_key(prep, x, tangents)
    if key == prep.loose_key:
        return prep
    variant = prep.variants.get(key)
    if variant is None:
        variant = _prepared_again(prep, family, operator, f, x, tangents, contexts, key)
        # One prepared under a torch.func transform saw no grad probe (reads_tracked stays False):
        # kept, it would drop a closed-over parameter's derivative in a later plain call.
        if not _transparent.under_functorch_or_dynamo():
            prep.keep_variant(key, variant)
    return variant


def _prepared_again(
    prep: Prep, family: str, operator: str, f: Callable[..., Any], x: Any, tangents: Any, contexts: Sequence[Any], key: tuple[Any, ...]
) -> Prep:
    """``prep`` prepared again (``strict=False``) for a call whose ``x`` or tangents (``key``)
    differ from the preparation's, or ``PreparationMismatchError`` where that is not sound: an
    ``AutoSparse`` jacobian or hessian keeps its sparsity pattern and colouring (prepared again
    for another dtype or device with them, as a ``KnownColoring``: no detection, while the
    pattern is current: ``prep.pattern_current``), and these are per shape of ``x``."""
    backend = prep.backend
    if isinstance(backend, AutoSparse) and family in ("jacobian", "hessian"):
        expected, received = prep.loose_key[0], key[0]
        if received[:2] != expected[:2]:  # a tensor's (type, shape)
            prep.refuse_x(
                operator,
                received,
                f"An AutoSparse {family}'s sparsity pattern and colouring are per shape of x, and strict=False lets x "
                f"change only its dtype or device: prepare again for this x (prepare_{family}(f, backend, x)), one "
                "preparation per shape.",
            )
        known = getattr(prep, "known_coloring", None)  # (none for an empty x or f(x): nothing to keep)
        current = getattr(prep, "pattern_current", None)
        if known is not None and current is not None:
            values, _ = unwrap_contexts(contexts, operator, first_position=4 if tangents is not None else 3)
            if not current(values):  # what f reads changed since prep traced it: the variant traces its own
                known = None
        if known is not None:
            # A colouring torchdi traced stays watched in the variant (what f reads may change);
            # a user's KnownColoring stays the user's promise.
            user_given = isinstance(backend.coloring, KnownColoring) and not isinstance(backend.coloring, TracedColoring)
            traced = known if user_given else TracedColoring(known, getattr(backend.coloring, "coloring", backend.coloring))
            backend = replace(backend, coloring=traced)
    variant = prepare_operator(family, operator, f, backend, x, tangents, contexts, strict=False, has_aux=prep.has_aux)
    if not torch.compiler.is_compiling():
        compiled = variant.num_compilations
        logger.log(
            logging.WARNING if compiled else logging.INFO,
            "torchdi: the strict=False preparation of the %s of %s was called with %s instead of %s: prepared again "
            "for it (compilations: %d), and kept for later calls like it. Prepare for this signature (or pass "
            "strict=True to be told of such calls) if the change is meant.",
            prep.operator,
            getattr(prep.f, "__name__", repr(prep.f)),
            _signature_text(prep, key),
            _signature_text(prep, prep.loose_key),
            compiled,
        )
    return variant


def _signature_text(prep: Prep, key: tuple[Any, ...]) -> str:
    names = ("x", FAMILIES[prep.operator].tangent_name or "tangents")
    return ", ".join(f"{name} {format_description(desc)}" for name, desc in zip(names, key))


def _run_learned(
    family: str, operator: str, f: Callable[..., Any], backend: Backend, x: Any, tangents: tuple[Any, ...] | None, contexts: Sequence[Any], value: bool
) -> tuple[Any, tuple[Any, ...] | None]:
    """A one-shot call under a ``torch.func`` transform from what an earlier one learned about
    ``f`` (``_one_shot``): ``(key, result)``; ``result`` is ``None`` when nothing was learned for
    this key (or ``key`` too when the arguments have none: nothing to learn), or when the runner
    failed. The call then takes the ordinary path, which prepares again (and reports errors as
    it always does)."""
    values, mask = unwrap_contexts(contexts, operator, first_position=4 if tangents is not None else 3)
    kinds = context_kinds(contexts)
    if "State" in kinds:
        return None, None
    x = without_inference_tensors(x)
    values = without_inference_tensors(values)
    key = (family, backend, mask, _received(x, tangents, values, kinds, False))
    learned = _one_shot.learned(f, key)
    if learned is None:
        return key, None
    x_run = canonical_x(x, family, operator, detach=False)
    bound = _one_shot.checking(bind_contexts(f, mask), learned.y)
    if learned.flattening is not None:
        bound = learned.flattening.function(bound)
    spec = replace(learned.spec, needs_value=False) if not value and FAMILIES[family].drops_value else learned.spec
    runner = _runner_under_transform(backend, family, bound, spec, _transparent.variant(backend, family, False))
    if learned.flattening is not None:
        runner = learned.flattening.runner(runner)
    batched = None if tangents is None else _batch_tangents(tangents, detach=False)
    rng_before = rng_states()
    failed = False
    # The checks preparation puts around its evaluation of f, around the runner's evaluations. The
    # data-parallel refusal hooks every module call (its global hook takes modules off their fast
    # path: ~5% of a PINN's inner HVP): needed only where a DDP or FSDP2 module can run at all,
    # which takes an initialized process group (the first call's preparation checked f anyway).
    with refuse_mutation(x, values, kinds, operator), _unless(not process_group_initialized(), refuse_data_parallel, operator):
        try:
            result = runner(x_run, batched, values)
        except Exception:  # a changed output (StaleOutput), an error of f: prepared again, see above
            failed = True
    if not failed:
        return key, result
    _one_shot.forget(f, key)
    restore_rng_states(rng_before)  # the ordinary path draws what this attempt drew
    return key, None


_CONTEXT_KINDS = {Constant: "Constant", Cache: "Cache", State: "State"}


def _unwrapped_described(x: Any, tangents: Any, contexts: Sequence[Any], keep_static: bool) -> tuple[tuple[Any, ...], tuple[Any, ...]] | None:
    """The context values and the strict check's description of the call (``_received``), in one
    pass over the contexts; ``None`` when a context is not exactly a ``Constant``, ``Cache`` or
    ``State`` (``unwrap_contexts`` then names it or unwraps a subclass)."""
    if not contexts:  # the common case: x alone (what _received returns, without its tuples)
        return (), ((describe(x, keep_static),) if tangents is None else (describe(x, keep_static), describe(tangents)))
    values, kinds = [], []
    for context in contexts:
        kind = _CONTEXT_KINDS.get(type(context))
        if kind is None:
            return None
        values.append(context.value)
        kinds.append(kind)
    return tuple(values), _received(x, tangents, tuple(values), tuple(kinds), keep_static)


def _plain(tree: Any) -> bool:
    """Whether ``tree`` is a tensor, a scalar, or a tuple/list/dict of them, with no tensor that
    requires grad or was made under ``inference_mode`` (``False``: look closer, with
    ``without_inference_tensors`` and ``_transparent.tracked``)."""
    kind = type(tree)
    if kind is torch.Tensor:
        return not (tree.requires_grad or tree.is_inference())
    if kind is tuple or kind is list:
        for item in tree:  # noqa: SIM110  (a loop, not all(...): no generator frame on every call)
            if not _plain(item):
                return False
        return True
    if kind is dict:
        for item in tree.values():  # noqa: SIM110
            if not _plain(item):
                return False
        return True
    return kind in _SCALARS


_SCALARS = frozenset({int, float, bool, str, type(None)})


def _detached(leaf: Any) -> Any:
    return leaf.detach() if isinstance(leaf, torch.Tensor) else leaf


def _detached_values(values: tuple[Any, ...]) -> tuple[Any, ...]:
    """The contexts with each tensor detached once: a tensor passed twice stays one tensor, as
    dynamo's guards saw it (two detached copies would fail its duplicate-input guard at the next
    call and recompile: GPT-2's input_ids passed as its labels too)."""
    memo: dict[int, torch.Tensor] = {}
    traced: list[tuple[torch.Tensor, torch.Tensor]] = []  # while dynamo traces: by identity
    compiling = torch.compiler.is_compiling()

    def detach_once(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        if compiling:  # (dynamo on torch 2.11 cannot trace id() of a tensor made in the graph)
            for seen, detached in traced:
                if seen is leaf:
                    return detached
            traced.append((leaf, leaf.detach()))
            return traced[-1][1]
        if id(leaf) not in memo:
            memo[id(leaf)] = leaf.detach()
        return memo[id(leaf)]

    return tuple(pytree.tree_map(detach_once, value) for value in values)


def _through_eager(prep: Prep, family: str, operator: str, x: Any, tangents: Any, values: tuple[Any, ...]) -> Callable[[Any], Any] | None:
    """``_transparent.through_eager`` with the prepared eager runner (built on first use) at this call's
    arguments as an eager runner takes them (not detached)."""
    runner = _rebuilt_runner(prep, (_transparent.EAGER, False))  # (the value too: the compiled call may return it)
    x_run = canonical_x(x, family, operator, detach=False)
    batched = None if tangents is None else _batch_tangents(tangents, detach=False)
    return _transparent.through_eager(runner, (x_run, batched, values), operator)


def _run_traced(
    family: str,
    operator: str,
    f: Callable[..., Any],
    backend: Backend,
    x: Any,
    tangents: Any,
    contexts: Sequence[Any],
    prep: Prep | None,
    value: bool,
    has_aux: bool = False,
) -> tuple[Any, ...]:
    """``run_operator`` while dynamo traces it (``torch.compile`` of a function that calls an
    operator, or a compiled torchdi backend whose ``f`` calls one): the runner, traced into the
    caller's graph with nothing that would break it (inference-mode checks, value comparisons,
    side-effect restores); the argument checks and the strict check are plain Python that
    dynamo evaluates once, at trace time."""
    _transparent.refuse_under_outer_transform(backend, family, operator)
    if prep is None:
        prep = prepare_operator(family, operator, f, backend, x, tangents, contexts, strict=False, has_aux=has_aux)
        values = tuple(c.value for c in contexts)
    else:
        values, _ = unwrap_contexts(contexts, operator, first_position=4 if tangents is not None else 3)
        received = _received(x, tangents, values, context_kinds(contexts), prep.keep_static) if prep.strict else None
        if received is None or not prep.serves(family, f, backend, received):
            prep.check(family, f, backend, received, _argument_names(_tangent_name(family, tangents), len(values)))
        if prep.has_aux is not has_aux:
            _refuse_aux_mismatch(prep, has_aux, operator)
        if prep.point is None and not prep.strict:
            key = _loose_key(prep, x, tangents)
            if key != prep.loose_key:  # (one more preparation, traced into the caller's graph, not kept)
                prep = prep.variants.get(key) or _prepared_again(prep, family, operator, f, x, tangents, contexts, key)
    # A view as a scalar x (t[0] of the caller's tensor) given to forward mode trips a torch internal
    # assert in AOTAutograd ("has_fw_view"; it also leaks the dual level, breaking every later jvp
    # of the process): the runner sees a copy, differentiable like the view (one element; asking
    # whether it is a view would break the graph).
    if FAMILIES[family].scalar_x and isinstance(x, torch.Tensor):
        x = x.clone()
    return _run_transparent(family, operator, prep, x, tangents, values, value)


def _run_transparent(
    family: str, operator: str, prep: Prep, x: Any, tangents: Any, values: tuple[Any, ...], value: bool = True
) -> tuple[Any, ...]:
    """Run so that an outer transform sees through the result (DESIGN rule 10, ``_transparent``):
    nothing detached, the caller's grad mode kept (eager runners then build differentiable graphs)."""
    _transparent.refuse_under_outer_transform(prep.backend, family, operator)
    runner = prep.runner
    if prep.rebuild is not None:
        # (under dynamo always rebuilt: see rebuild)
        key = (_transparent.variant(prep.backend, family, prep.has_aux), not value and FAMILIES[family].drops_value)
        if key != (_transparent.AS_IS, False):
            runner = _rebuilt_runner(prep, key)
    x_run = canonical_x(x, family, operator, detach=False)
    batched = None if tangents is None else _batch_tangents(tangents, detach=False)
    return runner(x_run, batched, values)


def _rebuilt_runner(prep: Prep, key: tuple[str, bool]) -> Runner:
    """The prep's runner rebuilt for ``key`` (variant, lean), built on first use and kept."""
    runner = prep.transparent_runners.get(key)
    if runner is None:
        assert prep.rebuild is not None
        runner = prep.transparent_runners[key] = prep.rebuild(*key)
    return runner


def _refuse_aux_mismatch(prep: Prep, has_aux: bool, operator: str) -> None:
    raise PreparationMismatchError(
        f"{operator}: prep (prepared for {prep.operator!r}, backend {prep.backend!r}) cannot serve this call:\n"
        f"  has_aux: mismatch: expected {prep.has_aux}, received {has_aux} (pass has_aux={prep.has_aux} as at "
        "preparation, or prepare again)"
    )


def with_aux_result(derivative: Any, result: tuple[Any, ...], has_aux: bool) -> Any:
    """What a plain operator returns: its derivative, paired with ``aux`` when ``has_aux``."""
    return (derivative, result[0][1]) if has_aux else derivative


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

