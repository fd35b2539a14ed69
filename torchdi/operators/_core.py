"""What every operator shares: preparation, the strict check, tangents, ``out=``.

Runners (what an operator family computes) and their construction live in ``torchdi.runners``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch.utils import _pytree as pytree

from torchdi.backends import (
    _BACKEND_TYPES,
    AutoAutograd,
    AutoCompile,
    AutoFunc,
    AutoXLA,
    Backend,
    DataParallel,
    require_available,
)
from torchdi.contexts import State, bind_contexts, context_kinds, unwrap_contexts
from torchdi.distributed import refuse_data_parallel
from torchdi.errors import UnsupportedOperatorError
from torchdi.into_grad import IntoGrad
from torchdi.prep import Prep, describe, describe_contexts
from torchdi.runners import BoundFunction, Runner, Spec, TreeMeta, build_runner, zero_runner
from torchdi.translate import copyto_, to_device_tensor

__all__ = ["prepare_operator", "run_operator", "write_out"]


# Which argument the tangents are shaped like, per family (None: the family takes no tangents).
TANGENTS_LIKE = {
    "pushforward": "x",
    "pullback": "y",
    "hvp": "x",
    "derivative": None,
    "gradient": None,
    "jacobian": None,
    "second_derivative": None,
    "hessian": None,
}
SCALAR_X = {"derivative", "second_derivative"}
TENSOR_X = {"jacobian", "hessian"}
SCALAR_Y = {"gradient", "hvp", "hessian"}
# Families whose plain operator gets a runner of its own on compiled engines (Spec.needs_value).
LEAN_FAMILIES = {"gradient"}


def _check_backend(backend: Any, operator: str) -> None:
    if not isinstance(backend, _BACKEND_TYPES):
        raise TypeError(
            f"{operator}: backend must be a torchdi backend such as torchdi.AutoAutograd() or "
            f"torchdi.AutoFunc(), got {type(backend).__name__}"
        )


def _canonical_x(x: Any, family: str, operator: str) -> Any:
    """``x`` as runners take it: detached from any outer graph, scalars as 0-d tensors."""
    if family in SCALAR_X:
        if isinstance(x, (bool, complex)) or not isinstance(x, (int, float, torch.Tensor)):
            raise TypeError(f"{operator}: x must be a real Python number or a 0-d tensor, got {type(x).__name__}")
        if isinstance(x, torch.Tensor):
            if x.dim() != 0:
                raise ValueError(f"{operator}: x must be a scalar (0-d tensor), got a tensor of shape {tuple(x.shape)}")
        else:
            return torch.tensor(float(x), dtype=torch.get_default_dtype())
    if isinstance(x, torch.Tensor):
        if not (x.is_floating_point() or x.is_complex()):
            raise TypeError(f"{operator}: x must have a floating-point or complex dtype, got {x.dtype}")
        return x.detach() if x.requires_grad else x
    if family in TENSOR_X:
        raise TypeError(f"{operator}: x must be a tensor, got {type(x).__name__}")
    if type(x) is dict and x and all(isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()) for v in x.values()):
        # A flat dict of tensors (module parameters): the hot case, without a pytree round trip.
        return {k: v.detach() for k, v in x.items()} if any(v.requires_grad for v in x.values()) else x
    leaves, spec = pytree.tree_flatten(x)
    if not leaves:
        raise ValueError(f"{operator}: x must contain at least one tensor, got {x!r}")
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor) or not (leaf.is_floating_point() or leaf.is_complex()):
            raise TypeError(
                f"{operator}: x must be a tensor or a dict/list/tuple of floating-point tensors; "
                f"found a leaf of type {type(leaf).__name__}"
                + (f" and dtype {leaf.dtype}" if isinstance(leaf, torch.Tensor) else "")
            )
    if any(leaf.requires_grad for leaf in leaves):
        return pytree.tree_unflatten([leaf.detach() for leaf in leaves], spec)
    return x


def _batch_tangents(tangents: tuple[Any, ...]) -> Any:
    if len(tangents) == 1:
        return pytree.tree_map(lambda t: t.detach().unsqueeze(0), tangents[0])
    return pytree.tree_map(lambda *ts: torch.stack([t.detach() for t in ts]), tangents[0], *tangents[1:])


def _check_tangents(tangents: Any, like: TreeMeta, like_name: str, operator: str, name: str) -> None:
    if not isinstance(tangents, tuple):
        raise TypeError(
            f"{operator}: {name} must be a tuple of tangents, one entry per tangent (e.g. ({name[1:]}1,)), "
            f"got {type(tangents).__name__}"
        )
    if not tangents:
        raise ValueError(f"{operator}: {name} must hold at least one tangent, got an empty tuple")
    for i, tangent in enumerate(tangents):
        leaves, spec = pytree.tree_flatten(tangent)
        if any(not isinstance(leaf, torch.Tensor) for leaf in leaves):
            raise TypeError(f"{operator}: {name}[{i}] must be made of tensors, got {tangent!r}")
        got = (spec, tuple(leaf.shape for leaf in leaves), tuple(leaf.dtype for leaf in leaves))
        if got != (like.spec, like.shapes, like.dtypes):
            raise ValueError(
                f"{operator}: {name}[{i}] must have the structure, shapes and dtypes of {like_name} "
                f"(shapes {[tuple(s) for s in like.shapes]}, dtypes {list(like.dtypes)}), "
                f"got shapes {[tuple(s) for s in got[1]]}, dtypes {list(got[2])}"
            )


def _tangent_name(family: str, tangents: Any) -> str | None:
    """The public name of the tangents a call passed (``tx``/``ty``), or ``None``."""
    if tangents is None:
        return None
    return "ty" if TANGENTS_LIKE[family] == "y" else "tx"


def _argument_names(tangent_name: str | None, n_contexts: int) -> tuple[str, ...]:
    names = ["x"] + ([tangent_name] if tangent_name else [])
    return (*names, *(f"context {i + 1}" for i in range(n_contexts)))


def _received(x: Any, tangents: Any, values: tuple[Any, ...], kinds: tuple[str, ...], keep_static: bool) -> tuple[Any, ...]:
    head = (describe(x, keep_static),) if tangents is None else (describe(x, keep_static), describe(tangents))
    return head + describe_contexts(values, kinds, keep_static)


@contextlib.contextmanager
def _refuse_mutation(x: Any, values: tuple[Any, ...], kinds: tuple[str, ...], operator: str) -> Iterator[None]:
    """Raise when ``f`` writes into ``x`` or a ``Constant`` (module buffers included), after
    restoring what it wrote.

    Writes are seen by value, not only through version counters: some kernels write without
    bumping them (``F.batch_norm`` updates running statistics that way). Backends disagree on
    such writes (eager autograd performs them, ``torch.func`` may refuse them, a compiled graph
    replays them), so they are refused instead of silently diverging; values that ``f`` must
    update go in a ``State``.
    """
    # (context label, leaf path, tensor, type of the module owning it or None)
    watched: list[tuple[str, str, torch.Tensor, str | None]] = [("x", _path(p), t, None) for p, t in _tensor_leaves(x)]
    for i, (value, kind) in enumerate(zip(values, kinds)):
        if kind != "Constant":
            continue
        label = f"context {i + 1} (Constant)"
        for path, leaf in pytree.tree_flatten_with_path(value)[0]:
            if isinstance(leaf, torch.Tensor):
                watched.append((label, _path(path), leaf, None))
            elif isinstance(leaf, torch.nn.Module):
                for prefix, module in leaf.named_modules():
                    for name, buffer in module.named_buffers(recurse=False):
                        if buffer is not None:
                            where = f"{_path(path)}.{prefix}.{name}" if prefix else f"{_path(path)}.{name}"
                            watched.append((label, where.lstrip("."), buffer, type(module).__name__))
    # The model's own buffers are usually the very tensors passed as a State: those may change.
    state_ids = {id(leaf) for value, kind in zip(values, kinds) if kind == "State" for leaf in pytree.tree_leaves(value)}
    watched = [entry for entry in watched if id(entry[2]) not in state_ids]
    versions = [t._version for _, _, t, _ in watched]
    saved = [t.detach().clone() for _, _, t, _ in watched]
    yield
    written = [
        (entry, before)
        for entry, version, before in zip(watched, versions, saved)
        if entry[2]._version != version or not _same_values(entry[2], before)
    ]
    if not written:
        return
    with torch.no_grad():
        for (_, _, t, _), before in written:
            t.copy_(before)
    raise ValueError(
        f"{operator}: f wrote in place into {_summarize_writes([entry for entry, _ in written])}. Inputs and "
        "Constants must not be modified (backends would disagree: eager autograd writes, torch.func "
        "refuses, a compiled graph replays). Values that f updates and that must persist (BatchNorm "
        "running statistics, counters) go in a torchdi.State: pass td.State(dict(model.named_buffers())) "
        "and call torch.func.functional_call(model, (params, buffers), (x,)) in f; every backend then "
        "updates them exactly once per call. Scratch space goes in a Cache. Or call model.eval() to use "
        "fixed statistics, or torch.func.replace_all_batch_norm_modules_(model) to use batch statistics "
        "without tracking."
    )


def _same_values(now: torch.Tensor, before: torch.Tensor) -> bool:
    if now.is_meta:  # no values to compare: the version counter alone decides
        return True
    if torch.equal(now, before):
        return True
    if now.is_floating_point() or now.is_complex():  # NaN == NaN for this purpose
        return bool(((now == before) | (now.isnan() & before.isnan())).all())
    return False


def _summarize_writes(written: list[tuple[str, str, torch.Tensor, str | None]]) -> str:
    """One phrase per argument: its leaves, or its module buffers counted by module type."""
    phrases = []
    for label in dict.fromkeys(entry[0] for entry in written):
        entries = [e for e in written if e[0] == label]
        plain = [path for _, path, _, owner in entries if owner is None]
        owned: dict[str, list[str]] = {}
        for _, path, _, owner in entries:
            if owner is not None:
                owned.setdefault(owner, []).append(path.rsplit(".", 1)[-1])
        parts = []
        named = [p for p in plain if p]  # an empty path: the argument is the tensor itself
        if named:
            shown = ", ".join(named[:3]) + (f" and {len(named) - 3} more" if len(named) > 3 else "")
            parts.append(shown)
        for owner, names in owned.items():
            kinds = ", ".join(dict.fromkeys(names))
            parts.append(f"{len(names)} buffer{'s' if len(names) > 1 else ''} of {owner} modules ({kinds})")
        phrases.append(f"{label}: " + "; ".join(parts) if parts else label)
    return "; ".join(phrases)


# The family that evaluates f exactly once per call, outside vmap, with the contexts passed as
# arguments of the transform on the backends below: where a State update happens exactly once.
_STATE_FAMILIES = ("gradient",)


def _check_state(family: str, backend: Backend, values: tuple[Any, ...], kinds: tuple[str, ...], operator: str) -> None:
    """Refuse ``State`` where its update would not happen exactly once on the user's tensors."""
    if "State" not in kinds:
        return
    for i, (value, kind) in enumerate(zip(values, kinds)):
        if kind != "State":
            continue
        leaves = pytree.tree_leaves(value)
        if not all(isinstance(leaf, torch.Tensor) for leaf in leaves):  # empty: nothing to update
            raise TypeError(
                f"{operator}: context {i + 1} (State) must be a tensor or a dict/list/tuple of tensors "
                f"(e.g. dict(model.named_buffers())), got {value!r:.200}"
            )
    if isinstance(backend, DataParallel):  # each process updates its own State, as FSDP2 and DDP's forward do
        backend = backend.backend
    inner = backend.inner if isinstance(backend, (AutoCompile, AutoXLA)) else backend
    compiled_in_place = not isinstance(backend, AutoCompile) or backend.mode != "reduce-overhead"
    if family not in _STATE_FAMILIES or not isinstance(inner, (AutoAutograd, AutoFunc)) or not compiled_in_place:
        raise UnsupportedOperatorError(
            f"{operator} with {backend!r}: a torchdi.State context is updated exactly once per call only by "
            "gradient and value_and_gradient on AutoAutograd(), AutoFunc(), and AutoCompile() and AutoXLA() "
            "with inner=AutoAutograd() or AutoFunc(), not with mode='reduce-overhead' (other operators "
            "evaluate f several times or under vmap; CUDA graphs run f on copies of the tensors). "
            "Pass the values as a Constant with fixed statistics (model.eval()) for other operators."
        )


@contextlib.contextmanager
def _without_side_effects(state_values: Sequence[Any]) -> Iterator[None]:
    """Undo what preparation's evaluations of ``f`` did to the global RNG and to ``State`` tensors:
    a training loop prepared before its first step then runs exactly as the eager loop would."""
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    states = [leaf for value in state_values for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]
    saved = [t.detach().clone() for t in states]
    try:
        yield
    finally:
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        with torch.no_grad():
            for t, before in zip(states, saved):
                t.copy_(before)


def _tensor_leaves(tree: Any) -> list[tuple[Any, torch.Tensor]]:
    return [(p, t) for p, t in pytree.tree_flatten_with_path(tree)[0] if isinstance(t, torch.Tensor)]


def _path(path: Any) -> str:
    return "".join(str(k) for k in path)


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
    with _without_side_effects([c.value for c in contexts if isinstance(c, State)]):
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
    from torchdi.engines import engine_for

    if torch.is_inference_mode_enabled():
        # The user's outer context, not a request to drop derivatives: under inference_mode
        # autograd records nothing and every derivative would silently be zero.
        with torch.inference_mode(False):
            return prepare_operator(family, operator, f, backend, x, tangents, contexts, strict, value)
    if not callable(f):
        raise TypeError(f"{operator}: f must be callable, got {type(f).__name__}")
    _check_backend(backend, operator)
    require_available(backend)
    tangent_name = {"x": "tx", "y": "ty", None: None}[TANGENTS_LIKE[family]]
    values, mask = unwrap_contexts(contexts, operator, first_position=4 if tangent_name else 3)
    kinds = context_kinds(contexts)
    _check_state(family, backend, values, kinds, operator)
    x = _without_inference_tensors(x)
    values = _without_inference_tensors(values)
    x_run = _canonical_x(x, family, operator)
    bound = bind_contexts(f, mask)
    engine = engine_for(backend)
    # f sees at preparation what it will see in the engine's program (numpy arrays as tensors...).
    seen_by_f = getattr(engine, "contexts_seen_by_f", None)
    try:
        with torch.no_grad(), _refuse_mutation(x, values, kinds, operator), refuse_data_parallel(operator):
            y = bound(x_run, values if seen_by_f is None else seen_by_f(values))
    except Exception as error:
        note = None if seen_by_f is None else _translation_note(values)
        if note:
            error.add_note(note)
        raise
    y_leaves = pytree.tree_leaves(y)
    if not y_leaves or not all(isinstance(leaf, torch.Tensor) for leaf in y_leaves):
        raise TypeError(f"{operator}: f must return a tensor (or a pytree of tensors), got {type(y).__name__}")
    if (family in SCALAR_Y or family in ("jacobian", "derivative", "second_derivative")) and not isinstance(y, torch.Tensor):
        raise TypeError(f"{operator}: f must return a single tensor, got {type(y).__name__}")
    if family in SCALAR_Y and y.numel() != 1:
        raise ValueError(
            f"{operator}: f must return a scalar (one-element) tensor, got shape {tuple(y.shape)}; "
            "use jacobian or pullback for non-scalar outputs"
        )
    if not all(leaf.is_floating_point() or leaf.is_complex() for leaf in y_leaves):
        raise TypeError(f"{operator}: f must return floating-point tensors, got dtypes {[leaf.dtype for leaf in y_leaves]}")
    x_meta, y_meta = TreeMeta.of(x_run), TreeMeta.of(y)
    n_tangents = 0
    if tangent_name is not None:
        like, like_name = (x_meta, "x") if TANGENTS_LIKE[family] == "x" else (y_meta, "f(x)")
        _check_tangents(tangents, like, like_name, operator, tangent_name)
        n_tangents = len(tangents)  # type: ignore[arg-type]
    elif tangents is not None:
        raise TypeError(f"{operator} takes no tangents")
    del y, y_leaves
    spec = Spec(x_meta, y_meta, n_tangents, state_contexts=tuple(i for i, kind in enumerate(kinds) if kind == "State"))
    batched = None if tangents is None else _batch_tangents(tangents)
    # A compiled gradient that need not return f's value can drop its final reduction (1.4x on
    # a bandwidth-bound function): the plain operator gets that variant, compiled on its first
    # use (a training loop that only calls value_and_gradient never compiles it).
    lean_spec = replace(spec, needs_value=False) if family in LEAN_FAMILIES and engine.keeps_static else None
    lean = None
    if spec.x.numel == 0 or spec.y.numel == 0:
        # No derivative to compute (an empty x or an empty f(x)): the zero map, on every
        # backend, instead of each engine's failure on empty bases and stacks.
        runner = zero_runner(family, bound, spec)
    else:
        runner = _built(backend, family, bound, lean_spec if value is False and lean_spec else spec, x_run, batched, values)
        if lean_spec is not None and value is None:
            def lean(x_now: Any, tangents_now: Any, values_now: tuple[Any, ...]) -> Runner:
                # Built on the plain operator's first call: its compilation must not touch States either.
                with _without_side_effects([v for v, kind in zip(values_now, kinds) if kind == "State"]):
                    return _built(backend, family, bound, lean_spec, x_now, tangents_now, values_now)
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
        lean,
    )


def _built(backend: Backend, family: str, f: BoundFunction, spec: Spec, x: Any, tangents: Any, values: tuple[Any, ...]) -> Runner:
    """The runner, compiled for these arguments when the engine compiles (``warm_up``)."""
    runner = build_runner(backend, family, f, spec)
    warm_up = getattr(runner, "warm_up", None)
    if warm_up is not None:
        try:
            with torch.no_grad():  # calls run under no_grad too: the compiled program guards on it
                warm_up(x, tangents, values)
        except Exception as error:
            note = _translation_note(values)
            if note:
                error.add_note(note)
            raise
    return runner


def _translation_note(values: tuple[Any, ...]) -> str | None:
    """Say which context values a compiled ``f`` receives traced (``to_device_tensor``) and how
    to keep one static: errors from Python-level use of them (``arr.astype``, ``range(int(c))``)
    otherwise read like unrelated tracing failures."""
    traced = []
    for i, value in enumerate(values):
        for path, leaf in pytree.tree_flatten_with_path(value)[0]:
            if isinstance(leaf, torch.Tensor):
                continue
            name = f"context {i + 1}{_path(path)} ({type(leaf).__name__})"
            if type(leaf) is float:
                traced.append(f"{name} as a traced (symbolic) float")
            elif isinstance(to_device_tensor(leaf, None), torch.Tensor):
                traced.append(f"{name} as torch.Tensor")
    if not traced:
        return None
    return (
        f"torchdi note: the compiled function received {', '.join(traced)}: compiled backends trace "
        "numpy arrays, numpy scalars and Python floats (torchdi.to_device_tensor) so that a new value "
        "does not recompile. Use torch operations on them (tensor methods rather than numpy's), or keep "
        "the value static (baked into the program; a new value needs a new preparation): pass "
        "torchdi.Static(value) and read .value in f, pass an int or str, or register your own type with "
        "torchdi.to_device_tensor to return it unchanged."
    )


def _may_hold_inference_tensors(tree: Any) -> bool:
    """False when ``tree`` is plain tensors, scalars and tuples/lists/dicts of them, none made
    under ``inference_mode``; True when one is, or when another container must be walked."""
    kind = type(tree)
    if kind is torch.Tensor or isinstance(tree, torch.Tensor):
        return tree.is_inference()
    if kind is tuple or kind is list:
        return any(_may_hold_inference_tensors(item) for item in tree)
    if kind is dict:
        return any(_may_hold_inference_tensors(item) for item in tree.values())
    # Anything pytree does not flatten (a module, a scalar, an array) is a leaf that is not a
    # tensor: nothing to copy. Other containers (OrderedDict, namedtuple, user nodes) are walked.
    return kind in pytree.SUPPORTED_NODES or isinstance(tree, (tuple, dict))


def _without_inference_tensors(tree: Any) -> Any:
    """``tree`` with tensors made under ``torch.inference_mode`` copied into ordinary tensors.

    Inference tensors have no version counter and cannot be saved for backward, so no backend
    could differentiate through them; the copy is only made when one is present.
    """
    if isinstance(tree, torch.Tensor):
        return tree.clone() if tree.is_inference() else tree
    if not _may_hold_inference_tensors(tree):  # the common case, without a pytree walk
        return tree
    leaves, spec = pytree.tree_flatten(tree)
    if not any(isinstance(leaf, torch.Tensor) and leaf.is_inference() for leaf in leaves):
        return tree
    return pytree.tree_unflatten(
        [leaf.clone() if isinstance(leaf, torch.Tensor) and leaf.is_inference() else leaf for leaf in leaves], spec
    )


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
    x = _without_inference_tensors(x)
    values = _without_inference_tensors(values)
    x_run = _canonical_x(x, family, operator)
    batched = None if tangents is None else _batch_tangents(tangents)
    call = prep.call if value else prep.plain_call(x_run, batched, values)
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
    _check_out(result, out, operator)
    try:
        with torch.no_grad():
            return copyto_(out, result)
    except ValueError as error:
        raise ValueError(f"{operator}: out= must have the structure and shapes of the result: {error}") from None


def _check_out(result: Any, out: Any, operator: str) -> None:
    """PyTorch's ``out=`` rule: the result may only be cast to a dtype it casts to safely
    (``torch.can_cast``: a float result never truncates into an integer ``out=``, a complex one
    never loses its imaginary part) and must be on ``out``'s device."""
    results, outs = pytree.tree_leaves(result), pytree.tree_leaves(out)
    if len(results) != len(outs):
        return  # copyto_ reports the structure mismatch
    several = len(results) > 1
    for i, (r, o) in enumerate(zip(results, outs)):
        if not (isinstance(r, torch.Tensor) and isinstance(o, torch.Tensor)):
            continue
        where = f" (leaf {i})" if several else ""
        if not torch.can_cast(r.dtype, o.dtype):
            raise RuntimeError(
                f"{operator}: the result{where} has dtype {r.dtype}, which cannot be cast safely to the "
                f"out= dtype {o.dtype} (torch.can_cast is False); pass out= of dtype {r.dtype}"
            )
        if r.device != o.device:
            raise RuntimeError(
                f"{operator}: the result{where} is on device {r.device} but out= is on device {o.device}; "
                f"pass out= on {r.device}"
            )
