"""``AutoFiniteDiff``: finite differences of ``f``, treated as a black box.

Only the pushforward (a directional difference) and the second derivative are native; the
gradient, pullback, jacobian and hessian come from the generic fallbacks over input bases, so
they cost ``O(numel(x))`` evaluations of ``f``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch.utils import _pytree as pytree

from torchdi.backends import AutoFiniteDiff
from torchdi.engines._dynamo import is_functorch_wrapped
from torchdi.errors import UnsupportedOperatorError
from torchdi.runners import FALLBACKS, register_engine

__all__ = ["FiniteDiffEngine"]


def _max_abs(tree: Any) -> float:
    return max(float(leaf.detach().abs().max()) if leaf.numel() else 0.0 for leaf in pytree.tree_leaves(tree))


def _magnitude_along(x: Any, direction: Any) -> float:
    """``max_i |x_i d_i|``: the size of the coordinates of ``x`` that ``direction`` moves.

    For a basis direction this is ``|x_i|``, so each coordinate gets a step relative to its own
    magnitude (one step scaled by ``max |x|`` would drown ``x = [1e6, 0.01]``'s second
    coordinate in truncation error).
    """
    return max(
        (float((a.detach().abs() * d.detach().abs()).max()) if a.numel() else 0.0 for a, d in zip(pytree.tree_leaves(x), pytree.tree_leaves(direction))),
        default=0.0,
    )


def _batched(tree: Any) -> bool:
    """Whether a leaf of ``tree`` is wrapped by ``torch.func`` (under ``vmap`` its values differ per
    batch entry, so a step size read with ``float()`` cannot be taken: ``.item()`` is refused)."""
    if torch.compiler.is_compiling():  # dynamo: a float() of a value would break the graph
        return True
    return any(is_functorch_wrapped(leaf) for leaf in pytree.tree_leaves(tree))


def _magnitude_along_tensor(x: Any, direction: Any) -> torch.Tensor:
    """``_magnitude_along`` as a 0-d tensor (per batch entry under ``vmap``)."""
    parts = [(a.detach().abs() * d.detach().abs()).amax() for a, d in zip(pytree.tree_leaves(x), pytree.tree_leaves(direction)) if a.numel()]
    return torch.stack(parts).amax()


def _axpy(x: Any, step: float | torch.Tensor, direction: Any) -> Any:
    return pytree.tree_map(lambda a, d: a + step * d, x, direction)


class FiniteDiffEngine:
    """Runners for ``AutoFiniteDiff``."""

    native: ClassVar[frozenset[str]] = frozenset({"pushforward", "second_derivative"})
    keeps_static: ClassVar[bool] = False

    def __init__(self, backend: AutoFiniteDiff) -> None:
        self.method = backend.method
        self.step = backend.step

    def build(self, family: str, f: Any, spec: Any) -> Any:
        if family in ("hvp", "hessian") and self.step is None:
            # Differences of differences: each level's rounding error is divided by the other
            # level's step, so both levels need the second-order step (with the first-order one,
            # forward-over-forward differences have an O(1) error).
            dtype = max(spec.x.dtypes, key=lambda d: torch.finfo(d).eps)
            nested = AutoFiniteDiff(self.method, self._relative_step(dtype, order=2))
            return FALLBACKS[family](nested, f, spec)
        builder = getattr(self, f"_{family}", None)
        return None if builder is None else builder(f)

    def _relative_step(self, dtype: torch.dtype, order: int) -> float:
        if self.step is not None:
            return float(self.step)
        eps = torch.finfo(dtype).eps
        # Truncation vs rounding error: O(h^2) vs eps/h (central), O(h) vs eps/h (one-sided),
        # and eps/h^2 for second differences (O(h^2) central, O(h) one-sided truncation).
        if order == 2:
            return float(eps**0.25 if self.method == "central" else eps ** (1 / 3))
        return float(eps ** (1 / 3) if self.method == "central" else eps**0.5)

    def _pushforward(self, f: Any) -> Any:
        def run(x: Any, tx: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any]:
            leaves = pytree.tree_leaves(x)
            if any(leaf.is_meta for leaf in leaves):
                # (the step size reads x's values: torch would fail in .item() with no hint)
                raise UnsupportedOperatorError(
                    "AutoFiniteDiff: x is on the meta device, which holds no values to take differences "
                    "of; AutoAutograd() or AutoFunc() give derivatives of meta tensors (their shapes and dtypes)"
                )
            relative = self._relative_step(leaves[0].dtype, order=1)
            y = f(x, contexts)
            count = pytree.tree_leaves(tx)[0].shape[0]
            columns = []
            for i in range(count):
                direction = pytree.tree_map(lambda t, i=i: t[i], tx)
                if _batched(x) or _batched(direction):
                    # The same step rule per batch entry of a vmap, as tensors (.item() is refused).
                    norm_t = torch.stack([d.detach().abs().amax() for d in pytree.tree_leaves(direction) if d.numel()]).amax()
                    safe = torch.where(norm_t == 0, torch.ones_like(norm_t), norm_t)
                    h_t = relative * (1.0 + _magnitude_along_tensor(x, direction) / safe) / safe
                    quotient = self._difference(f, x, y, direction, h_t, contexts)
                    zero = norm_t == 0
                    columns.append(pytree.tree_map(lambda q, zero=zero: torch.where(zero, torch.zeros_like(q), q), quotient))
                    continue
                norm = _max_abs(direction)
                if norm == 0.0:
                    columns.append(pytree.tree_map(torch.zeros_like, y))
                    continue
                h = relative * (1.0 + _magnitude_along(x, direction) / norm) / norm
                columns.append(self._difference(f, x, y, direction, h, contexts))
            return y, pytree.tree_map(lambda *cs: torch.stack(cs), *columns)

        return run

    def _difference(self, f: Any, x: Any, y: Any, direction: Any, h: float | torch.Tensor, contexts: tuple[Any, ...]) -> Any:
        """The difference quotient of ``f`` at ``x`` along ``direction`` with step ``h``."""
        if self.method == "central":
            plus, minus = f(_axpy(x, h, direction), contexts), f(_axpy(x, -h, direction), contexts)
            return pytree.tree_map(lambda p, m: (p - m) / (2 * h), plus, minus)
        if self.method == "forward":
            return pytree.tree_map(lambda p, y0: (p - y0) / h, f(_axpy(x, h, direction), contexts), y)
        return pytree.tree_map(lambda y0, m: (y0 - m) / h, y, f(_axpy(x, -h, direction), contexts))

    def _second_derivative(self, f: Any) -> Any:
        first = self._pushforward(f)

        def run(x: torch.Tensor, _: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any, Any]:
            y, dy = first(x, torch.ones((1,), dtype=x.dtype, device=x.device), contexts)
            size = x.detach().abs() if _batched(x) else float(x.abs())  # per batch entry under vmap
            h = self._relative_step(x.dtype, order=2) * (1.0 + size)
            offsets = {"central": (1.0, 0.0, -1.0), "forward": (2.0, 1.0, 0.0), "backward": (0.0, -1.0, -2.0)}
            a, b, c = (f(x + o * h, contexts) for o in offsets[self.method])
            return y, dy[0], (a - 2 * b + c) / (h * h)

        return run


register_engine(AutoFiniteDiff, FiniteDiffEngine)
