"""``AutoFunc``: ``torch.func`` transforms, with tangents batched by ``vmap``.

These runners are pure functions of their arguments, which is what ``AutoCompile`` and
``AutoXLA`` compile: contexts are arguments of the runner, never closed over.
"""

from __future__ import annotations

from typing import Any, ClassVar, cast

import torch
from torch.func import grad, grad_and_value, jacfwd, jacrev, jvp, vjp, vmap
from torch.utils import _pytree as pytree

from torchdi.backends import AutoFunc
from torchdi.engines.base import ALL_FAMILIES
from torchdi.engines.base import like_primal as _like_primal
from torchdi.runners import register_engine

__all__ = ["FuncEngine"]

# vmap's out_dims for (value, per-tangent result): the value does not depend on the tangent.
_SHARED_VALUE: Any = (None, 0)
# Random operations in f (dropout) draw once for all tangents: one evaluation of f shared by
# every tangent, as AutoAutograd computes (vmap's default refuses random operations).
_RANDOMNESS = "same"


def _jvp(fn: Any, primals: tuple[Any, ...], tangents: tuple[Any, ...]) -> tuple[Any, Any]:
    """``torch.func.jvp`` without ``has_aux``: always ``(value, tangent)``."""
    return cast(tuple[Any, Any], jvp(fn, primals, tangents))


def _jvp_through_contexts(f: Any, x: Any, tx: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any]:
    """``jvp`` of ``x -> f(x, contexts)`` along ``tx``, with the contexts' floating tensors as
    primals whose tangents are explicit zeros.

    Closed over by nested jvps, a context tensor gets an "efficient zero" tangent, which inductor
    reuses as an output buffer and writes into: a segfault (``sin(t * a)`` with a tensor Constant
    ``a``, differentiated twice in forward mode). Explicit zeros cost one zero tangent per
    context tensor, so only runners nested in forward mode take this path.
    """
    leaves, context_spec = pytree.tree_flatten(contexts)
    positions = [
        i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and (leaf.is_floating_point() or leaf.is_complex())
    ]
    if not positions:
        return _jvp(lambda x_: f(x_, contexts), (x,), (tx,))

    def with_contexts(x_: Any, *tensors: torch.Tensor) -> Any:
        inner = list(leaves)
        for i, tensor in zip(positions, tensors):
            inner[i] = tensor
        return f(x_, pytree.tree_unflatten(inner, context_spec))

    tensors = tuple(leaves[i] for i in positions)
    return _jvp(with_contexts, (x, *tensors), (tx, *(torch.zeros_like(t) for t in tensors)))


def _first(tree: Any) -> Any:
    return pytree.tree_map(lambda t: t[0], tree)


def _add_batch(tree: Any) -> Any:
    return pytree.tree_map(lambda t: t.unsqueeze(0), tree)


def _scalar(y: torch.Tensor) -> torch.Tensor:
    """A one-element output as the 0-d tensor ``torch.func.grad`` requires (the contract allows any shape)."""
    return y.reshape(())


class FuncEngine:
    """Runners for ``AutoFunc``: every family natively."""

    native: ClassVar[frozenset[str]] = ALL_FAMILIES
    keeps_static: ClassVar[bool] = False

    def __init__(self, backend: AutoFunc) -> None:
        self.chunk_size = backend.chunk_size

    def build(self, family: str, f: Any, spec: Any) -> Any:
        if family in ("jacobian", "hessian") and any(d.is_complex for d in (*spec.x.dtypes, *spec.y.dtypes)):
            return None  # jacrev/jacfwd refuse complex tensors: the generic fallback takes columns by jvp
        return getattr(self, f"_{family}")(f, spec)

    def _pullback(self, f: Any, spec: Any) -> Any:
        single = spec.n_tangents == 1

        def run(x: Any, ty: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any]:
            y, vjp_fn = cast(tuple[Any, Any], vjp(lambda x_: f(x_, contexts), x))
            if single:
                (dx,) = vjp_fn(_first(ty))
                return y, _add_batch(dx)
            (dx,) = vmap(vjp_fn, randomness=_RANDOMNESS)(ty)
            return y, dx

        return run

    def _pushforward(self, f: Any, spec: Any) -> Any:
        single = spec.n_tangents == 1

        def run(x: Any, tx: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any]:
            def along(t: Any) -> tuple[Any, Any]:
                y, dy = _jvp(lambda x_: f(x_, contexts), (x,), (t,))
                return y, _like_primal(dy, y)

            if single:
                y, dy = along(_first(tx))
                return y, _add_batch(dy)
            y, dy = vmap(along, out_dims=_SHARED_VALUE, randomness=_RANDOMNESS)(tx)
            return y, dy

        return run

    def _gradient(self, f: Any, spec: Any) -> Any:
        y_shape = spec.y.shapes[0]

        # The contexts are arguments of the transformed function, not captured: f may then update
        # a State in place (torch.func refuses in-place writes into captured tensors).
        def run(x: Any, _: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any]:
            g, y = grad_and_value(lambda x_, c: _scalar(f(x_, c)))(x, contexts)
            return y.reshape(y_shape), g

        def run_without_value(x: Any, _: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any]:
            return None, grad(lambda x_, c: _scalar(f(x_, c)))(x, contexts)

        return run if spec.needs_value else run_without_value

    def _derivative(self, f: Any, spec: Any) -> Any:
        def run(x: torch.Tensor, _: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any]:
            if spec.inside_forward_mode:  # the inner derivative of a second derivative
                y, dy = _jvp_through_contexts(f, x, torch.ones_like(x), contexts)
            else:
                y, dy = _jvp(lambda x_: f(x_, contexts), (x,), (torch.ones_like(x),))
            return y, _like_primal(dy, y)

        return run

    def _second_derivative(self, f: Any, spec: Any) -> Any:
        def run(x: torch.Tensor, _: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any, Any]:
            one = torch.ones_like(x)

            def value_and_derivative(x_: torch.Tensor, contexts_: tuple[Any, ...]) -> tuple[Any, Any]:
                y_, dy_ = _jvp_through_contexts(f, x_, one, contexts_)
                return y_, _like_primal(dy_, y_)

            (y, dy), (_, d2y) = _jvp_through_contexts(value_and_derivative, x, one, contexts)
            return y, dy, _like_primal(d2y, y)

        return run

    def _jacobian(self, f: Any, spec: Any) -> Any:
        # Reverse mode builds one row per output, forward mode one column per input.
        forward = spec.x.numel < spec.y.numel

        def run(x: torch.Tensor, _: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any]:
            def with_value(x_: torch.Tensor) -> tuple[Any, Any]:
                y = f(x_, contexts)
                return y, y

            if forward:
                jac, y = jacfwd(with_value, has_aux=True, randomness=_RANDOMNESS)(x)
            else:
                jac, y = jacrev(with_value, has_aux=True, chunk_size=self.chunk_size)(x)
            return y, jac

        return run

    def _hvp(self, f: Any, spec: Any) -> Any:
        single = spec.n_tangents == 1

        def run(x: Any, tx: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any]:
            gradient_of = grad(lambda x_: _scalar(f(x_, contexts)))

            def along(t: Any) -> tuple[Any, Any]:
                return _jvp(gradient_of, (x,), (t,))

            if single:
                g, hv = along(_first(tx))
                return g, _add_batch(hv)
            return vmap(along, out_dims=_SHARED_VALUE, randomness=_RANDOMNESS)(tx)

        return run

    def _hessian(self, f: Any, spec: Any) -> Any:
        y_shape = spec.y.shapes[0]

        def run(x: torch.Tensor, _: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any, Any]:
            def gradient_with_value(x_: torch.Tensor) -> tuple[Any, Any]:
                g, y = grad_and_value(lambda x__: _scalar(f(x__, contexts)))(x_)
                return g, (g, y)

            if self.chunk_size is None:
                hess, (g, y) = jacfwd(gradient_with_value, has_aux=True, randomness=_RANDOMNESS)(x)
            else:
                hess, (g, y) = jacrev(gradient_with_value, has_aux=True, chunk_size=self.chunk_size)(x)
            return y.reshape(y_shape), g, hess

        return run


register_engine(AutoFunc, FuncEngine)
