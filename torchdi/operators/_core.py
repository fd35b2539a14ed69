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

from torchdi.backends import _BACKEND_TYPES, Backend, require_available
from torchdi.contexts import bind_contexts, unwrap_contexts
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


def _received(x: Any, tangents: Any, values: tuple[Any, ...], mask: tuple[bool, ...], keep_static: bool) -> tuple[Any, ...]:
    head = (describe(x, keep_static),) if tangents is None else (describe(x, keep_static), describe(tangents))
    return head + describe_contexts(values, mask, keep_static)


@contextlib.contextmanager
def _refuse_mutation(x: Any, values: tuple[Any, ...], mask: tuple[bool, ...], operator: str) -> Iterator[None]:
    """Raise when ``f`` writes into ``x`` or a ``Constant`` (module buffers included), after
    restoring the module buffers it wrote.

    Writes are seen through tensors' version counters. Backends disagree on such writes (eager
    autograd performs them, ``torch.func`` refuses them, a compiled graph replays them), so
    they are refused instead of silently diverging: BatchNorm's running statistics are the
    common case.
    """
    watched: list[tuple[str, torch.Tensor]] = [(f"x{_path(p)}", t) for p, t in _tensor_leaves(x)]
    modules: list[tuple[str, torch.nn.Module]] = []
    for i, (value, is_cache) in enumerate(zip(values, mask)):
        if is_cache:
            continue
        for path, leaf in pytree.tree_flatten_with_path(value)[0]:
            name = f"context {i + 1} (Constant){_path(path)}"
            if isinstance(leaf, torch.Tensor):
                watched.append((name, leaf))
            elif isinstance(leaf, torch.nn.Module):
                modules.append((name, leaf))
    buffers = [(f"{name}, buffer {b}", t) for name, m in modules for b, t in m.named_buffers()]
    versions = [t._version for _, t in watched + buffers]
    saved = [t.detach().clone() for _, t in buffers]
    yield
    written = [name for (name, t), v in zip(watched + buffers, versions) if t._version != v]
    if not written:
        return
    with torch.no_grad():
        for (_, t), before in zip(buffers, saved):
            t.copy_(before)
    raise ValueError(
        f"{operator}: f wrote in place into {', '.join(written)}. Inputs and Constants must not be "
        "modified (backends would disagree: eager autograd writes, torch.func refuses, a compiled "
        "graph replays). Use a Cache for scratch space. For modules that update buffers in forward "
        "(BatchNorm running statistics): call model.eval() to use fixed statistics, or "
        "torch.func.replace_all_batch_norm_modules_(model) to use batch statistics without "
        "tracking, or pass the buffers as a Cache and update the statistics outside torchdi."
    )


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
    """
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
    x = _without_inference_tensors(x)
    values = _without_inference_tensors(values)
    x_run = _canonical_x(x, family, operator)
    bound = bind_contexts(f, mask)
    engine = engine_for(backend)
    # f sees at preparation what it will see in the engine's program (numpy arrays as tensors...).
    seen_by_f = getattr(engine, "contexts_seen_by_f", None)
    try:
        with torch.no_grad(), _refuse_mutation(x, values, mask, operator):
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
    spec = Spec(x_meta, y_meta, n_tangents)
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
                return _built(backend, family, bound, lean_spec, x_now, tangents_now, values_now)
    expected = _received(x, tangents, values, mask, engine.keeps_static)
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


def _without_inference_tensors(tree: Any) -> Any:
    """``tree`` with tensors made under ``torch.inference_mode`` copied into ordinary tensors.

    Inference tensors have no version counter and cannot be saved for backward, so no backend
    could differentiate through them; the copy is only made when one is present.
    """
    if isinstance(tree, torch.Tensor):
        return tree.clone() if tree.is_inference() else tree
    if type(tree) is tuple and not tree:  # no contexts: the common case, without a pytree walk
        return tree
    if type(tree) is dict and all(isinstance(v, torch.Tensor) for v in tree.values()):  # parameters
        if not any(v.is_inference() for v in tree.values()):
            return tree
        return {k: v.clone() if v.is_inference() else v for k, v in tree.items()}
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
        values, mask = unwrap_contexts(contexts, operator, first_position=4 if tangents is not None else 3)
        if prep.strict:
            names = _argument_names(_tangent_name(family, tangents), len(values))
            prep.check(family, f, backend, _received(x, tangents, values, mask, prep.keep_static), names)
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
