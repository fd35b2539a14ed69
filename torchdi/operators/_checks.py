"""Argument checks shared by every operator (and by ``DifferentiateWith``): each raises a clear
error naming the argument and what was expected, and none modifies its input.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from torchdi.backends import _BACKEND_TYPES, Backend
from torchdi.composition import state_refusal
from torchdi.families import FAMILIES, Family
from torchdi.runners import BoundFunction, TreeMeta
from torchdi.translate import overlaps_itself

__all__ = [
    "canonical_x",
    "check_backend",
    "check_out",
    "check_output",
    "check_state",
    "check_tangents",
    "grad_probes",
    "x_unused",
]


def check_backend(backend: Any, operator: str, examples: str = "torchdi.AutoAutograd() or torchdi.AutoFunc()") -> None:
    """Raise ``TypeError`` unless ``backend`` is a torchdi backend (``examples`` name some)."""
    if not isinstance(backend, _BACKEND_TYPES):
        raise TypeError(f"{operator}: backend must be a torchdi backend such as {examples}, got {type(backend).__name__}")


def canonical_x(x: Any, family: str, operator: str, detach: bool = True) -> Any:
    """``x`` as runners take it: detached from any outer graph (unless ``detach=False``: an outer
    transform differentiates the result), scalars as 0-d tensors."""
    row = FAMILIES[family]
    if row.scalar_x:
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
        if not x.is_contiguous() and overlaps_itself(x):
            x = x.contiguous()
        return x.detach() if detach and x.requires_grad else x
    if row.tensor_x:
        raise TypeError(f"{operator}: x must be a tensor, got {type(x).__name__}")
    if type(x) is dict and x and all(
        isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()) and v.is_contiguous() for v in x.values()
    ):
        # A flat dict of contiguous tensors (module parameters): the hot case, without a pytree
        # round trip (a contiguous tensor never overlaps itself; other layouts take the walk below).
        return {k: v.detach() for k, v in x.items()} if detach and any(v.requires_grad for v in x.values()) else x
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
    if any(not leaf.is_contiguous() and overlaps_itself(leaf) for leaf in leaves):
        leaves = [leaf.contiguous() if overlaps_itself(leaf) else leaf for leaf in leaves]
        x = pytree.tree_unflatten(leaves, spec)
    if detach and any(leaf.requires_grad for leaf in leaves):
        return pytree.tree_unflatten([leaf.detach() for leaf in leaves], spec)
    return x



def check_tangents(tangents: Any, like: TreeMeta, like_name: str, operator: str, name: str) -> None:
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


def check_state(family: str, backend: Backend, values: tuple[Any, ...], kinds: tuple[str, ...], operator: str) -> None:
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
    refusal = state_refusal(family, backend, operator)
    if refusal is not None:
        raise refusal


def check_out(result: Any, out: Any, operator: str) -> None:
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



def check_output(y: Any, row: Family, operator: str) -> None:
    """``f(x)`` as the family needs it: tensors (one tensor, a scalar one) of floating dtype."""
    y_leaves = pytree.tree_leaves(y)
    if not y_leaves or not all(isinstance(leaf, torch.Tensor) for leaf in y_leaves):
        hint = (
            "; if f writes its output into its first argument, f(y, x, *contexts), pass y= (pushforward, "
            "pullback, derivative, jacobian)"
            if y is None
            else ""
        )
        raise TypeError(f"{operator}: f must return a tensor (or a pytree of tensors), got {type(y).__name__}{hint}")
    if row.single_y and not isinstance(y, torch.Tensor):
        raise TypeError(f"{operator}: f must return a single tensor, got {type(y).__name__}")
    if row.scalar_y and y.numel() != 1:
        raise ValueError(
            f"{operator}: f must return a scalar (one-element) tensor, got shape {tuple(y.shape)}; "
            "use jacobian or pullback for non-scalar outputs"
        )
    if not all(leaf.is_floating_point() or leaf.is_complex() for leaf in y_leaves):
        raise TypeError(f"{operator}: f must return floating-point tensors, got dtypes {[leaf.dtype for leaf in y_leaves]}")
    # A gradient (an HVP, the hessian of a one-element f) is that of a real f: torch.autograd.grad
    # and torch.func.grad refuse a complex output, and without this check backends differed (an
    # error from inside torch or dynamo, or silently the derivative of the real part).
    of_gradient = row.scalar_y or (row.name == "hessian" and isinstance(y, torch.Tensor) and y.numel() == 1)
    if of_gradient and y.is_complex():
        raise TypeError(
            f"{operator}: f must return a real scalar, got dtype {y.dtype}; a gradient is defined for a "
            "real-valued f (as for torch.autograd.grad and torch.func.grad): return y.real, y.abs() ** 2 "
            "or the like, or use jacobian for the derivative of a complex output"
        )


def grad_probes(x: Any) -> tuple[Any, set[int]] | None:
    """``x`` with its floating-point leaves replaced by detached aliases that require grad, and
    their ids; ``None`` when ``x`` has no such leaf."""
    flat, spec = pytree.tree_flatten(x)
    probes = [
        leaf.detach().requires_grad_() if isinstance(leaf, torch.Tensor) and (leaf.is_floating_point() or leaf.is_complex()) else leaf
        for leaf in flat
    ]
    wanted = {id(p) for p, leaf in zip(probes, flat) if p is not leaf}
    return (pytree.tree_unflatten(probes, spec), wanted) if wanted else None


def x_unused(y: Any, wanted: set[int], f: BoundFunction, x: Any, values: tuple[Any, ...]) -> bool:
    """Whether ``f``'s output ``y`` (computed from the probes ``wanted``) does not depend on ``x``.

    The classic slip is a loss that calls ``model(batch)`` instead of
    ``functional_call(model, params, (batch,))``: ``x`` (the parameters dict) is never used and
    every derivative is silently zero, where ``torch.autograd.grad`` would raise. ``y``'s autograd
    graph is walked for ``x``'s leaves (the model's own parameters may give it a graph); when
    none is reached, ``f`` may still hide ``x`` from autograd (numpy inside, for finite
    differences): it is then evaluated at a moved ``x``, and only an unchanged output counts.
    """
    outs = [t for t in pytree.tree_leaves(y) if isinstance(t, torch.Tensor)]
    if any(id(t) in wanted for t in outs):  # f returns x itself
        return False
    roots: list[Any] = [t.grad_fn for t in outs if t.grad_fn is not None]
    seen: set[Any] = set()
    while roots:  # down to the leaves the graph accumulates into
        node = roots.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if id(getattr(node, "variable", None)) in wanted:
            return False
        roots.extend(child for child, _ in node.next_functions)
    flat, spec = pytree.tree_flatten(x)
    if any(isinstance(leaf, torch.Tensor) and leaf.is_meta for leaf in flat):
        return False  # no values to compare
    generator = torch.Generator().manual_seed(0)  # not the global RNG: preparation leaves it alone
    moved = [
        leaf + 0.01 * (leaf.abs() + 1) * torch.randn(leaf.shape, generator=generator, dtype=torch.float64).to(leaf.device, leaf.dtype)
        if isinstance(leaf, torch.Tensor) and (leaf.is_floating_point() or leaf.is_complex())
        else leaf
        for leaf in flat
    ]
    try:
        with torch.no_grad():
            again = pytree.tree_leaves(f(pytree.tree_unflatten(moved, spec), values))
    except Exception:
        return False
    return len(again) == len(outs) and all(
        isinstance(a, torch.Tensor) and a.shape == b.shape and torch.equal(a, b.detach()) for a, b in zip(again, outs)
    )
