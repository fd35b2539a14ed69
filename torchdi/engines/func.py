"""``AutoFunc``: ``torch.func`` transforms, with tangents batched by ``vmap``.

These runners are pure functions of their arguments, which is what ``AutoCompile`` and
``AutoXLA`` compile: contexts are arguments of the runner, never closed over.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch.compiler import is_compiling
from torch.func import grad, grad_and_value, jacfwd, jacrev, jvp, vjp, vmap
from torch.utils import _pytree as pytree

from torchdi.backends import AutoFunc
from torchdi.engines._dynamo import functorch_level
from torchdi.engines.base import ALL_FAMILIES
from torchdi.engines.base import like_primal as _like_primal
from torchdi.runners import register_engine
from torchdi.translate import overlaps_itself

__all__ = ["FuncEngine", "in_output_shape", "scalar_output"]

# Random operations in f (dropout) draw once for all tangents: one evaluation of f shared by
# every tangent, as AutoAutograd computes (vmap's default refuses random operations).
_RANDOMNESS = "same"


def _jvp(fn: Any, primals: tuple[Any, ...], tangents: tuple[Any, ...]) -> tuple[Any, Any]:
    """``torch.func.jvp`` without ``has_aux``: always ``(value, tangent)``."""
    # jvp's defaults passed, and no typing.cast: what compiled runners trace through here is
    # guarded on every call, each default and each module global read (a guard apiece).
    result: Any = jvp(fn, primals, tangents, strict=False, has_aux=False)
    return result


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

    # (an expanded context tensor cannot be a primal: see overlaps_itself)
    tensors = tuple(leaves[i].contiguous() if overlaps_itself(leaves[i]) else leaves[i] for i in positions)
    return _jvp(with_contexts, (x, *tensors), (tx, *(torch.zeros_like(t) for t in tensors)))


def _vmap_shared_value(along: Any, tangents: Any) -> tuple[Any, Any]:
    """``vmap(along)(tangents)`` for ``along`` returning ``(value, per-tangent result)`` where the
    value does not depend on the tangent: returned once (``out_dims=None``). Under an outer
    ``torch.func`` transform (DESIGN rule 10) functorch may still wrap that value at the inner
    level, which ``out_dims=None`` refuses: it is then batched and its first entry taken."""
    if is_compiling() or functorch_level() is None:
        # The value once, the results per tangent. A local tuple and vmap's defaults passed, as in
        # _jvp (the same tuple as a module constant was six guards).
        shared_value: Any = (None, 0)
        result: Any = vmap(along, in_dims=0, out_dims=shared_value, randomness=_RANDOMNESS, chunk_size=None)(tangents)
        return result
    value, result = vmap(along, randomness=_RANDOMNESS)(tangents)
    return _first(value), result


def _first(tree: Any) -> Any:
    return pytree.tree_map(lambda t: t[0], tree)


def _add_batch(tree: Any) -> Any:
    return pytree.tree_map(lambda t: t.unsqueeze(0), tree)


def scalar_output(y: torch.Tensor) -> torch.Tensor:
    """A one-element output as the 0-d tensor ``torch.func.grad`` requires (the contract allows any shape).
    A 0-d output is returned as it is: a reshape would add a view to the graph of every
    transform level (four of them in a PINN step's inner HVP under the training step's grad)."""
    return y if y.dim() == 0 else y.reshape(())


def in_output_shape(y: torch.Tensor, shape: Any) -> torch.Tensor:
    """``y`` (the 0-d value of ``scalar_output``) back in ``f``'s output shape, without a view when it has it."""
    return y if y.shape == shape else y.reshape(shape)


class FuncEngine:
    """Runners for ``AutoFunc``: every family natively."""

    native: ClassVar[frozenset[str]] = ALL_FAMILIES
    keeps_static: ClassVar[bool] = False

    def __init__(self, backend: AutoFunc) -> None:
        self.chunk_size = backend.chunk_size
        self.mode = backend.mode

    def build(self, family: str, f: Any, spec: Any) -> Any:
        if family in ("jacobian", "hessian") and any(d.is_complex for d in (*spec.x.dtypes, *spec.y.dtypes)):
            return None  # jacrev/jacfwd refuse complex tensors: the generic fallback takes columns by jvp
        if getattr(spec, "has_aux", False):
            return getattr(self, f"_{family}_with_aux")(f, spec)
        return getattr(self, f"_{family}")(f, spec)

    # has_aux=True: f returns (y, aux); torch.func's own has_aux carries aux out of the
    # transform, and the runner returns (y, aux) as its value.

    def _pullback_with_aux(self, f: Any, spec: Any) -> Any:
        def run(x: Any, ty: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any]:
            pulled: Any = vjp(lambda x_: f(x_, contexts), x, has_aux=True)  # (no typing.cast traced: see _jvp)
            y, vjp_fn, aux = pulled
            (dx,) = vmap(vjp_fn, randomness=_RANDOMNESS)(ty)
            return (y, aux), dx

        return run

    def _pushforward_with_aux(self, f: Any, spec: Any) -> Any:
        def run(x: Any, tx: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any]:
            def along(t: Any) -> tuple[Any, Any, Any]:
                pushed: Any = jvp(lambda x_: f(x_, contexts), (x,), (t,), has_aux=True)
                y, dy, aux = pushed
                return y, _like_primal(dy, y), aux

            out_dims: Any = (None, 0, None)
            y, dy, aux = vmap(along, out_dims=out_dims, randomness=_RANDOMNESS)(tx)
            return (y, aux), dy

        return run

    def _derivative_with_aux(self, f: Any, spec: Any) -> Any:
        def run(x: torch.Tensor, _: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any]:
            pushed: Any = jvp(lambda x_: f(x_, contexts), (x,), (torch.ones_like(x),), has_aux=True)
            y, dy, aux = pushed
            return (y, aux), _like_primal(dy, y)

        return run

    def _gradient_with_aux(self, f: Any, spec: Any) -> Any:
        y_shape = spec.y.shapes[0]

        def scalar_and_aux(x_: Any, c: tuple[Any, ...]) -> tuple[Any, Any]:
            y, aux = f(x_, c)
            return scalar_output(y), aux

        def run(x: Any, _: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any]:
            g, (y, aux) = grad_and_value(scalar_and_aux, has_aux=True)(x, contexts)
            return (in_output_shape(y, y_shape), aux), g

        return run

    def _pullback(self, f: Any, spec: Any) -> Any:
        single = spec.n_tangents == 1

        def run(x: Any, ty: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any]:
            pulled: Any = vjp(lambda x_: f(x_, contexts), x)  # (no typing.cast traced: see _jvp)
            y, vjp_fn = pulled
            if single:
                (dx,) = vjp_fn(_first(ty))
                return y, _add_batch(dx)
            (dx,) = vmap(vjp_fn, randomness=_RANDOMNESS)(ty)
            return y, dx

        return run

    def _pushforward(self, f: Any, spec: Any) -> Any:
        single = spec.n_tangents == 1
        inside_forward_mode, tensor_y = spec.inside_forward_mode, spec.y.is_tensor

        def run(x: Any, tx: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any]:
            def along(t: Any) -> tuple[Any, Any]:
                if inside_forward_mode:  # see _hvp
                    y, dy = _jvp_through_contexts(f, x, t, contexts)
                else:
                    y, dy = _jvp(lambda x_: f(x_, contexts), (x,), (t,))
                if tensor_y:  # _like_primal without its pytree walk (what it reads is guarded)
                    return y, dy if dy.dtype == y.dtype else dy.to(y.dtype)
                return y, _like_primal(dy, y)

            if single:
                y, dy = along(_first(tx))
                return y, _add_batch(dy)
            y, dy = _vmap_shared_value(along, tx)
            return y, dy

        return run

    def _gradient(self, f: Any, spec: Any) -> Any:
        y_shape = spec.y.shapes[0]

        # The contexts are arguments of the transformed function, not captured: f may then update
        # a State in place (torch.func refuses in-place writes into captured tensors).
        def run(x: Any, _: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any]:
            g, y = grad_and_value(lambda x_, c: scalar_output(f(x_, c)))(x, contexts)
            return in_output_shape(y, y_shape), g

        def run_without_value(x: Any, _: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any]:
            return None, grad(lambda x_, c: scalar_output(f(x_, c)))(x, contexts)

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
        # Reverse mode builds one row per output, forward mode one column per input; the
        # backend's mode= forces one.
        forward = spec.x.numel < spec.y.numel if self.mode is None else self.mode == "forward"
        with_aux = spec.has_aux

        def run(x: torch.Tensor, _: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any]:
            def with_value(x_: torch.Tensor) -> tuple[Any, Any]:
                out = f(x_, contexts)  # (y, aux) with has_aux: the value the runner returns
                return (out[0] if with_aux else out), out

            if forward:
                jac, value = jacfwd(with_value, has_aux=True, randomness=_RANDOMNESS)(x)
            else:
                jac, value = jacrev(with_value, has_aux=True, chunk_size=self.chunk_size)(x)
            return value, jac

        return run

    _jacobian_with_aux = _jacobian  # f's aux rides in the value jacrev/jacfwd already carry out

    def _hvp(self, f: Any, spec: Any) -> Any:
        single = spec.n_tangents == 1

        def run(x: Any, tx: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any]:
            gradient_of = grad(lambda x_: scalar_output(f(x_, contexts)))

            def along(t: Any) -> tuple[Any, Any]:
                if spec.inside_forward_mode:
                    # Nested in an outer transform that dynamo compiles (a PINN's Laplacian under
                    # AutoCompile's gradient): efficient-zero tangents of closed-over contexts reach
                    # inductor, which writes into them ("ZeroTensors are immutable").
                    return _jvp_through_contexts(lambda x_, c: grad(lambda x__: scalar_output(f(x__, c)))(x_), x, t, contexts)
                return _jvp(gradient_of, (x,), (t,))

            if single:
                g, hv = along(_first(tx))
                return g, _add_batch(hv)
            return _vmap_shared_value(along, tx)

        return run

    def _hessian(self, f: Any, spec: Any) -> Any:
        y_shape = spec.y.shapes[0]
        # The outer level differentiates the gradient (or jacobian): forward mode unless the
        # backend asks for reverse mode or bounds the batch with chunk_size (jacrev's option).
        outer_reverse = self.mode == "reverse" or (self.mode is None and self.chunk_size is not None)
        if torch.Size(y_shape).numel() != 1:
            return self._hessian_of_vector(f, spec, outer_reverse)

        def run(x: torch.Tensor, _: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any, Any]:
            def gradient_with_value(x_: torch.Tensor) -> tuple[Any, Any]:
                g, y = grad_and_value(lambda x__: scalar_output(f(x__, contexts)))(x_)
                return g, (g, y)

            if not outer_reverse:
                hess, (g, y) = jacfwd(gradient_with_value, has_aux=True, randomness=_RANDOMNESS)(x)
            else:
                hess, (g, y) = jacrev(gradient_with_value, has_aux=True, chunk_size=self.chunk_size)(x)
            return in_output_shape(y, y_shape), g, hess

        return run

    def _hessian_of_vector(self, f: Any, spec: Any, outer_reverse: bool) -> Any:
        """``torch.func.hessian`` of a non-scalar ``f``: ``jacfwd(jacrev(f))``, one batched program,
        shape ``y.shape + x.shape + x.shape``; the "gradient" is the jacobian."""

        def run(x: torch.Tensor, _: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any, Any]:
            def with_value(x_: torch.Tensor) -> tuple[Any, Any]:
                y = f(x_, contexts)
                return y, y

            def jacobian_with_value(x_: torch.Tensor) -> tuple[Any, Any]:
                jac, y = jacrev(with_value, has_aux=True, chunk_size=self.chunk_size)(x_)
                return jac, (jac, y)

            if not outer_reverse:
                hess, (jac, y) = jacfwd(jacobian_with_value, has_aux=True, randomness=_RANDOMNESS)(x)
            else:
                hess, (jac, y) = jacrev(jacobian_with_value, has_aux=True, chunk_size=self.chunk_size)(x)
            return y, jac, hess

        return run


register_engine(AutoFunc, FuncEngine)
