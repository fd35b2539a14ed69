"""``AutoAutograd``: eager ``torch.autograd``, the reference every other backend is compared with.

Reverse mode with ``torch.autograd.grad`` (one backward per cotangent, graph retained),
forward mode by double backward (dual tensors for ``derivative``), second order with double backward. Tangents are looped over:
the reference favours the plainest computation over speed.

When ``x`` already carries autograd or forward-AD state (an outer backend differentiates this
one, as in ``SecondOrder(AutoAutograd(), AutoAutograd())``), the runners build differentiable
graphs (``create_graph=True``) instead of detaching.
"""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar

import torch
import torch.autograd.forward_ad as fwAD
from torch.utils import _pytree as pytree

from torchdi.backends import AutoAutograd
from torchdi.engines._dynamo import forward_ad_level
from torchdi.engines.base import like_primal
from torchdi.runners import register_engine

__all__ = ["AutogradEngine"]


def _is_tracked(leaf: torch.Tensor) -> bool:
    if leaf.requires_grad:
        return True
    # Only inside a dual level can a tensor carry a forward-mode tangent (unpacking costs a call).
    return forward_ad_level() >= 0 and fwAD.unpack_dual(leaf).tangent is not None


def _track(x: Any, outer: bool) -> tuple[Any, list[torch.Tensor], bool]:
    """``x`` with leaves that require grad, those leaves, and whether an outer transform is active.

    ``outer`` is the caller's grad mode: operators call runners with grad mode off unless an outer
    transform differentiates the result (DESIGN rule 10), for instance through a context or a
    tensor ``f`` closes over while ``x`` itself is untracked; graphs are then built with
    ``create_graph=True`` too.
    """
    if isinstance(x, torch.Tensor):  # the common case, without pytree round trips
        if _is_tracked(x):
            tracked = x if x.requires_grad else x.clone().requires_grad_()
            return tracked, [tracked], True
        tracked = x.detach().requires_grad_()
        return tracked, [tracked], outer
    leaves = list(x.values()) if _tensor_dict(x) else pytree.tree_leaves(x)
    if any(_is_tracked(leaf) for leaf in leaves):
        leaves = [leaf if leaf.requires_grad else leaf.clone().requires_grad_() for leaf in leaves]
        return _like_x(x, leaves), leaves, True
    leaves = [leaf.detach().requires_grad_() for leaf in leaves]
    return _like_x(x, leaves), leaves, outer


def _tensor_dict(x: Any) -> bool:
    """Whether ``x`` is a plain dict of tensors (a parameter dict): its leaves are its values, in
    order, without a pytree round trip (measured: ~10% of a small MAML inner step)."""
    return type(x) is dict and all(isinstance(v, torch.Tensor) for v in x.values())


def _like_x(x: Any, leaves: list[torch.Tensor]) -> Any:
    """``leaves`` in the structure of ``x``."""
    if isinstance(x, torch.Tensor):
        return leaves[0]
    if _tensor_dict(x):
        return dict(zip(x, leaves, strict=True))
    return pytree.tree_unflatten(leaves, pytree.tree_structure(x))


def _grad(outputs: list[torch.Tensor], inputs: list[torch.Tensor], cotangents: list[torch.Tensor], create_graph: bool, retain_graph: bool) -> list[torch.Tensor]:
    """``torch.autograd.grad`` that returns zeros for outputs or inputs outside the graph."""
    pairs = [(o, c) for o, c in zip(outputs, cotangents) if o.requires_grad]
    if not pairs:
        return [torch.zeros_like(leaf) for leaf in inputs]
    grads = torch.autograd.grad(
        [o for o, _ in pairs],
        inputs,
        [c for _, c in pairs],
        create_graph=create_graph,
        retain_graph=retain_graph or create_graph,
        allow_unused=True,
    )
    return _materialized(grads, inputs)


def _materialized(grads: tuple[torch.Tensor | None, ...], inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Zeros for the inputs outside the graph: ``materialize_grads=True`` by hand (that flag costs
    ~9 us per call, a tenth of a small gradient)."""
    return [torch.zeros_like(leaf) if g is None else g for g, leaf in zip(grads, inputs)]


def _grad_mode_on(outer: bool) -> contextlib.AbstractContextManager[Any]:
    """``torch.enable_grad()``, or nothing when grad mode is already on (under an outer
    ``torch.autograd``: the context manager costs ~8 us per call)."""
    return contextlib.nullcontext() if outer else torch.enable_grad()


def _maybe_detach(tree: Any, nested: bool) -> Any:
    if nested:
        return tree
    return tree.detach() if isinstance(tree, torch.Tensor) else pytree.tree_map(lambda t: t.detach(), tree)


class AutogradEngine:
    """Runners for ``AutoAutograd``."""

    native: ClassVar[frozenset[str]] = frozenset(
        {"pullback", "pushforward", "gradient", "hvp", "derivative", "second_derivative"}
    )
    keeps_static: ClassVar[bool] = False

    def __init__(self, backend: AutoAutograd) -> None:
        self.backend = backend

    def build(self, family: str, f: Any, spec: Any) -> Any:
        builder = getattr(self, f"_{family}", None)
        return None if builder is None else builder(f)

    def _pullback(self, f: Any) -> Any:
        def run(x: Any, ty: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any]:
            outer = torch.is_grad_enabled()
            with torch.enable_grad():
                x_in, leaves, nested = _track(x, outer)
                y = f(x_in, contexts)
                y_leaves = pytree.tree_leaves(y)
                ty_leaves = pytree.tree_leaves(ty)
                count = ty_leaves[0].shape[0]
                rows = [
                    _grad(y_leaves, leaves, [t[i] for t in ty_leaves], nested, retain_graph=i < count - 1)
                    for i in range(count)
                ]
            dx = [torch.stack([row[j] for row in rows]) for j in range(len(leaves))]
            return _maybe_detach(y, nested), _like_x(x, dx)

        return run

    def _pushforward(self, f: Any) -> Any:
        # Forward mode by double backward rather than dual tensors: the VJP is linear in its
        # cotangent u, so differentiating it with respect to u along dx gives J dx. Unlike dual
        # tensors this composes with any inner backend, torch.func's jvp included (PyTorch
        # does not nest forward-mode levels), which SecondOrder(AutoAutograd(), inner) needs.
        def run(x: Any, tx: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any]:
            outer = torch.is_grad_enabled()
            with torch.enable_grad():
                x_in, leaves, nested = _track(x, outer)
                y = f(x_in, contexts)
                y_leaves, y_spec = pytree.tree_flatten(y)
                cotangents = [torch.zeros_like(leaf, requires_grad=True) for leaf in y_leaves]
                vjps = _grad(y_leaves, leaves, cotangents, create_graph=True, retain_graph=True)
                tx_leaves = pytree.tree_leaves(tx)
                columns = [
                    _grad(vjps, cotangents, [t[i] for t in tx_leaves], nested, retain_graph=True)
                    for i in range(tx_leaves[0].shape[0])
                ]
            dy = [torch.stack([column[j] for column in columns]) for j in range(len(y_leaves))]
            return _maybe_detach(y, nested), pytree.tree_unflatten(dy, y_spec)

        return run

    def _gradient(self, f: Any) -> Any:
        def run(x: Any, _: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any]:
            outer = torch.is_grad_enabled()
            with _grad_mode_on(outer):
                x_in, leaves, nested = _track(x, outer)
                y = f(x_in, contexts)
                _refuse_non_scalar(y)
                if y.requires_grad:  # a 0-d output needs no explicit cotangent
                    grads = _materialized(
                        torch.autograd.grad(y, leaves, None if y.dim() == 0 else torch.ones_like(y), create_graph=nested, allow_unused=True),
                        leaves,
                    )
                else:
                    grads = [torch.zeros_like(leaf) for leaf in leaves]
            return _maybe_detach(y, nested), _like_x(x, grads)

        return run

    def _hvp(self, f: Any) -> Any:
        def run(x: Any, tx: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any]:
            outer = torch.is_grad_enabled()
            with torch.enable_grad():
                x_in, leaves, nested = _track(x, outer)
                y = f(x_in, contexts)
                _refuse_non_scalar(y)
                grads = _grad([y], leaves, [torch.ones_like(y)], create_graph=True, retain_graph=True)
                tx_leaves = pytree.tree_leaves(tx)
                count = tx_leaves[0].shape[0]
                columns = [
                    _grad(grads, leaves, [t[i] for t in tx_leaves], nested, retain_graph=i < count - 1)
                    for i in range(count)
                ]
            hvps = [
                columns[0][j].unsqueeze(0) if count == 1 else torch.stack([column[j] for column in columns])
                for j in range(len(leaves))
            ]
            return _maybe_detach(_like_x(x, grads), nested), _like_x(x, hvps)

        return run

    def _derivative(self, f: Any) -> Any:
        def run(x: torch.Tensor, _: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any]:
            with fwAD.dual_level():
                y = f(fwAD.make_dual(x, torch.ones_like(x)), contexts)
                primal, tangent = fwAD.unpack_dual(y)
            return primal, torch.zeros_like(primal) if tangent is None else like_primal(tangent, primal)

        return run

    def _second_derivative(self, f: Any) -> Any:
        def run(x: torch.Tensor, _: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any, Any]:
            outer = torch.is_grad_enabled()
            with torch.enable_grad():
                x_in, (leaf,), nested = _track(x, outer)
                y = f(x_in, contexts)
                dy = _jvp_by_double_vjp(y, leaf, create_graph=True)
                d2y = _jvp_by_double_vjp(dy, leaf, create_graph=nested)
            return _maybe_detach(y, nested), _maybe_detach(dy, nested), d2y

        return run


def _refuse_non_scalar(y: torch.Tensor) -> None:
    """A gradient's or HVP's ``f(x)`` must have one element: with a cotangent of ones,
    ``torch.autograd.grad`` would differentiate ``y.sum()`` instead (preparation checks this once;
    a context's value or a global can change it later, see ``check_output_shapes``)."""
    if y.numel() != 1:
        raise ValueError(f"f must return a scalar (one-element) tensor, got shape {tuple(y.shape)}")


def _jvp_by_double_vjp(y: torch.Tensor, x: torch.Tensor, create_graph: bool) -> torch.Tensor:
    """``dy/dx`` for a scalar ``x`` in reverse mode: the VJP is linear in its cotangent ``u``, so
    differentiating it with respect to ``u`` yields the JVP, and the result stays differentiable."""
    if not y.requires_grad:
        return torch.zeros_like(y)
    u = torch.zeros_like(y, requires_grad=True)
    (vjp,) = torch.autograd.grad(y, x, u, create_graph=True, allow_unused=True, materialize_grads=True)
    if not vjp.requires_grad:
        return torch.zeros_like(y)
    (jvp,) = torch.autograd.grad(vjp, u, torch.ones_like(x), create_graph=create_graph, allow_unused=True, materialize_grads=True)
    return jvp


register_engine(AutoAutograd, AutogradEngine)
