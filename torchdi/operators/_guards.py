"""Guards around the evaluations of ``f`` (shared by every operator and by ``DifferentiateWith``):
refusing writes into ``x`` and ``Constant`` contexts, undoing what preparation did to the RNG
and ``State`` tensors, copying tensors made under ``inference_mode``, and the note that explains
which context values a compiled ``f`` receives traced.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from torchdi._fence import tensor_version
from torchdi.operators._transparent import unwrapped
from torchdi.translate import to_device_tensor

__all__ = [
    "path_text",
    "refuse_mutation",
    "restore_rng_states",
    "rng_states",
    "same_rng_states",
    "same_values",
    "snapshot",
    "tensor_leaves",
    "translation_note",
    "without_inference_tensors",
    "without_side_effects",
    "written_since",
]


@contextlib.contextmanager
def refuse_mutation(x: Any, values: tuple[Any, ...], kinds: tuple[str, ...], operator: str) -> Iterator[None]:
    """Raise when ``f`` writes into ``x`` or a ``Constant`` (module buffers included), after
    restoring what it wrote.

    Writes are seen by value, not only through version counters: some kernels write without
    bumping them (``F.batch_norm`` updates running statistics that way). Backends disagree on
    such writes (eager autograd performs them, ``torch.func`` may refuse them, a compiled graph
    replays them), so they are refused instead of silently diverging; values that ``f`` must
    update go in a ``State``. ``torch.func``'s wrappers keep version counters of their own:
    values are compared under the wrappers (every batch entry of a ``vmap``). While dynamo
    traces there are no values: the compiled program's functionalization sees writes instead.
    """
    if torch.compiler.is_compiling():
        yield
        return
    # (context label, leaf path (or the argument's tree: the path is found only for a message),
    # tensor, type of the module owning it or None)
    watched: list[tuple[str, Any, torch.Tensor, str | None]] = [
        ("x", x, t, None) for t in pytree.tree_leaves(x) if isinstance(t, torch.Tensor)
    ]
    for i, (value, kind) in enumerate(zip(values, kinds)):
        if kind != "Constant":
            continue
        label = f"context {i + 1} (Constant)"
        leaves = pytree.tree_leaves(value)
        if not any(isinstance(leaf, torch.nn.Module) for leaf in leaves):
            watched.extend((label, value, leaf, None) for leaf in leaves if isinstance(leaf, torch.Tensor))
            continue
        for path, leaf in pytree.tree_flatten_with_path(value)[0]:
            if isinstance(leaf, torch.Tensor):
                watched.append((label, path_text(path), leaf, None))
            elif isinstance(leaf, torch.nn.Module):
                for prefix, module in leaf.named_modules():
                    for name, buffer in module.named_buffers(recurse=False):
                        if buffer is not None:
                            where = f"{path_text(path)}.{prefix}.{name}" if prefix else f"{path_text(path)}.{name}"
                            watched.append((label, where.lstrip("."), buffer, type(module).__name__))
    if "State" in kinds:
        # The model's own buffers are usually the very tensors passed as a State: those may change.
        state_ids = {id(leaf) for value, kind in zip(values, kinds) if kind == "State" for leaf in pytree.tree_leaves(value)}
        watched = [entry for entry in watched if id(entry[2]) not in state_ids]
    versions = [tensor_version(t) for _, _, t, _ in watched]
    # The values under torch.func's wrappers (what _same_plain_values compares): copied without a trip
    # through every transform level (a PINN's inner operator under grad: ~0.5 ms less per call).
    plains = [unwrapped(t) for _, _, t, _ in watched]
    with torch.no_grad():
        saved = [(t if plain is None else plain).clone() for (_, _, t, _), plain in zip(watched, plains)]
    yield
    written = [
        (entry, plain, before)
        for entry, version, plain, before in zip(watched, versions, plains, saved)
        if tensor_version(entry[2]) != version or not _same_plain_values(entry[2], plain, before)
    ]
    if not written:
        return
    with torch.no_grad():
        for (_, _, t, _), plain, before in written:
            (t if plain is None else plain).copy_(before)
    entries = [(label, _path_in(where, t), t, owner) for (label, where, t, owner), _, _ in written]
    raise ValueError(
        f"{operator}: f wrote in place into {_summarize_writes(entries)}. Inputs and "
        "Constants must not be modified (backends would disagree: eager autograd writes, torch.func "
        "refuses, a compiled graph replays). Values that f updates and that must persist (BatchNorm "
        "running statistics, counters) go in a torchdi.State: pass td.State(dict(model.named_buffers())) "
        "and call torch.func.functional_call(model, (params, buffers), (x,)) in f; every backend then "
        "updates them exactly once per call. Scratch space goes in a Cache. Or call model.eval() to use "
        "fixed statistics, or torch.func.replace_all_batch_norm_modules_(model) to use batch statistics "
        "without tracking."
    )


def same_values(now: torch.Tensor, before: torch.Tensor) -> bool:
    """Whether ``now`` holds the values ``before`` holds (NaN equal to NaN); ``True`` where they
    cannot be compared (meta tensors, a wrapper this torch cannot unwrap)."""
    before_plain = unwrapped(before)
    if before_plain is None:  # a torch that cannot unwrap (fence): the version counter decides
        return True
    return _same_plain_values(now, unwrapped(now), before_plain)


def snapshot(tensor: torch.Tensor) -> tuple[int | None, torch.Tensor | None]:
    """What ``written_since`` compares ``tensor`` with later: its version counter, or a copy of its
    values where this torch does not expose the counter (``_fence.tensor_version``)."""
    version = tensor_version(tensor)
    return version, (tensor.detach().clone() if version is None else None)


def written_since(tensor: torch.Tensor, taken: tuple[int | None, torch.Tensor | None]) -> bool:
    """Whether ``tensor`` was written in place since ``snapshot`` took ``taken``."""
    version, copy = taken
    return not same_values(tensor, copy) if copy is not None else tensor_version(tensor) != version


def _path_in(where: Any, t: torch.Tensor) -> str:
    """The path of ``t`` in the tree ``where`` (or ``where`` itself when it is the path already)."""
    if isinstance(where, str):
        return where
    return next((path_text(path) for path, leaf in tensor_leaves(where) if leaf is t), "")


def _same_plain_values(now: torch.Tensor, plain: torch.Tensor | None, before: torch.Tensor) -> bool:
    """Whether ``now`` still holds the values ``before`` (a copy of ``plain``, its tensor under
    ``torch.func``'s wrappers, taken before ``f`` ran)."""
    if now.is_meta:  # no values to compare: the version counter alone decides
        return True
    if plain is None:  # a torch that cannot unwrap (fence): the version counter decides
        return True
    now = plain
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


@contextlib.contextmanager
def without_side_effects(state_values: Sequence[Any]) -> Iterator[None]:
    """Undo what preparation's evaluations of ``f`` did to the global RNG and to ``State`` tensors:
    a training loop prepared before its first step then runs exactly as the eager loop would.
    While dynamo traces (an operator inside a compiled function) there is nothing to restore."""
    if torch.compiler.is_compiling():
        yield
        return
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


def rng_states() -> tuple[torch.Tensor, ...]:
    """The global RNG states (CPU, and CUDA once initialized): compared before and after an
    evaluation of ``f``, they tell whether ``f`` draws random numbers."""
    cpu = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return (cpu, *torch.cuda.get_rng_state_all())
    return (cpu,)


def restore_rng_states(states: tuple[torch.Tensor, ...]) -> None:
    """Set the global RNG states back to ``states`` (from ``rng_states``)."""
    torch.set_rng_state(states[0])
    if len(states) > 1:
        torch.cuda.set_rng_state_all(states[1:])


def same_rng_states(before: tuple[torch.Tensor, ...], after: tuple[torch.Tensor, ...]) -> bool:
    return len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))


def tensor_leaves(tree: Any) -> list[tuple[Any, torch.Tensor]]:
    return [(p, t) for p, t in pytree.tree_flatten_with_path(tree)[0] if isinstance(t, torch.Tensor)]


def path_text(path: Any) -> str:
    return "".join(str(k) for k in path)


def translation_note(values: tuple[Any, ...]) -> str | None:
    """Say which context values a compiled ``f`` receives traced (``to_device_tensor``) and how
    to keep one static: errors from Python-level use of them (``arr.astype``, ``range(int(c))``)
    otherwise read like unrelated tracing failures."""
    traced = []
    for i, value in enumerate(values):
        for path, leaf in pytree.tree_flatten_with_path(value)[0]:
            if isinstance(leaf, torch.Tensor):
                continue
            name = f"context {i + 1}{path_text(path)} ({type(leaf).__name__})"
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


def without_inference_tensors(tree: Any) -> Any:
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
