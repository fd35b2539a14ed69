"""Which backends compose, and how: torchdi's capability traits, in one table.

Three kinds of facts live here and nowhere else:

- ``SECOND_ORDER_REFUSALS``: the (outer, inner) pairs of a second-order computation that
  PyTorch cannot compose, each with its reason and the backends that do work; ``outer_inner``
  raises from this table, so every such error names what works.
- the traits of the eager backends that the generic fallbacks choose by
  (``jacobian_uses_forward``, ``DOUBLE_BACKWARD``: what AutoAutograd computes by double backward),
  and the compiled-backend refusal built on them (``refuse_compiled_double_backward``);
- where a ``State`` context is updated exactly once per call (``state_refusal``).

Fallbacks and engines ask these functions; they never test which backend class they hold.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torchdi.backends import (
    AutoAutograd,
    AutoCompile,
    AutoFiniteDiff,
    AutoFunc,
    AutoSparse,
    AutoXLA,
    Backend,
    DataParallel,
    SecondOrder,
)
from torchdi.errors import UnsupportedOperatorError
from torchdi.families import FAMILIES
from torchdi.runners import Spec, engine_for

__all__ = [
    "DOUBLE_BACKWARD",
    "SECOND_ORDER_REFUSALS",
    "STATE_BACKENDS",
    "Refusal",
    "base_type",
    "evaluates_f_plainly",
    "jacobian_uses_forward",
    "outer_inner",
    "refuse_compiled_double_backward",
    "state_refusal",
]


def base_type(backend: Backend) -> type:
    """The eager backend type a (possibly compiled) backend runs: ``AutoCompile(inner=AutoFunc())``
    runs ``AutoFunc``."""
    while isinstance(backend, (AutoCompile, AutoXLA)):
        backend = backend.inner
    return type(backend)


_COMPILED = (AutoCompile, AutoXLA)


@dataclass(frozen=True)
class Refusal:
    """A second-order pair PyTorch cannot compose.

    Attributes:
        applies: ``applies(outer, inner)`` is true for the refused pairs.
        reason: why, in one sentence (the error message's middle; ``{outer}`` and ``{inner}``
            stand for the backends' class names).
        works: backends that compute the same derivatives (the error message's end).
    """

    applies: Callable[[Backend, Backend], bool]
    reason: str
    works: tuple[str, ...]

    def error(self, backend: SecondOrder) -> UnsupportedOperatorError:
        reason = self.reason.format(outer=type(backend.outer).__name__, inner=type(backend.inner).__name__)
        return UnsupportedOperatorError(f"{backend!r}: {reason}. Backends that can: {', '.join(self.works)}")


SECOND_ORDER_REFUSALS: tuple[Refusal, ...] = (
    Refusal(
        lambda outer, inner: isinstance(inner, _COMPILED) and not isinstance(outer, (*_COMPILED, AutoFiniteDiff)),
        "eager {outer} cannot differentiate a compiled inner backend (torch.compile's graphs support neither "
        "double backward nor torch.func transforms from eager code)",
        (
            "AutoCompile() (forward over reverse of torch.func, compiled as one program)",
            "SecondOrder(AutoCompile(), AutoFunc())",
            "SecondOrder(AutoFiniteDiff(), AutoCompile())",
        ),
    ),
    Refusal(
        lambda outer, inner: base_type(outer) is AutoFunc and base_type(inner) is AutoAutograd,
        "torch.func transforms cannot differentiate torch.autograd.grad calls",
        (
            "SecondOrder(AutoFunc(), AutoFunc())",
            "SecondOrder(AutoAutograd(), AutoAutograd())",
            "SecondOrder(AutoAutograd(), AutoFunc())",
            "SecondOrder(AutoFiniteDiff(), <any>)",
        ),
    ),
    Refusal(
        lambda outer, inner: base_type(inner) is AutoFiniteDiff and base_type(outer) is not AutoFiniteDiff,
        "finite differences of the inner backend are not differentiable by an AD outer backend",
        (
            "SecondOrder(AutoFiniteDiff(), AutoFiniteDiff())",
            "SecondOrder(AutoFiniteDiff(), AutoFunc())",
            "SecondOrder(AutoFunc(), AutoFunc())",
            "AutoAutograd()",
        ),
    ),
)


def outer_inner(backend: Backend) -> tuple[Backend, Backend]:
    """The (outer, inner) pair of a second-order computation; a plain backend plays both roles.

    Raises ``UnsupportedOperatorError`` for pairs PyTorch cannot compose (``SECOND_ORDER_REFUSALS``),
    naming the backends that work.
    """
    if not isinstance(backend, SecondOrder):
        return backend, backend
    outer, inner = backend.outer, backend.inner
    for refusal in SECOND_ORDER_REFUSALS:
        if refusal.applies(outer, inner):
            raise refusal.error(backend)
    return outer, inner


def evaluates_f_plainly(backend: Backend) -> bool:
    """Whether ``backend``'s runners evaluate ``f`` as it is, under the grad mode of the call (off on
    the plain path): finite differences, also as the inner backend of ``SecondOrder`` or as
    ``AutoSparse``'s dense one. An ``f`` that calls ``torch.autograd`` itself (DESIGN rule 10) needs
    grad mode there; ``AutoAutograd`` turns it on itself, and ``torch.func`` transforms refuse such
    an ``f`` whatever the grad mode."""
    if isinstance(backend, AutoFiniteDiff):
        return True
    if isinstance(backend, SecondOrder):
        return evaluates_f_plainly(backend.inner)
    if isinstance(backend, AutoSparse):
        return evaluates_f_plainly(backend.dense)
    return False


# Families that AutoAutograd computes by double backward (forward mode included).
DOUBLE_BACKWARD = frozenset(name for name, row in FAMILIES.items() if row.order == 2) | {"pushforward"}

_COMPILED_DOUBLE_BACKWARD_WORKS = (
    "AutoCompile() (inner=AutoFunc(), the default)",
    "AutoAutograd()",
    "SecondOrder(AutoFiniteDiff(), AutoCompile(inner=AutoAutograd(), fullgraph=False))",
)


def jacobian_uses_forward(native: frozenset[str], spec: Spec) -> bool:
    """Whether the generic jacobian takes columns (pushforwards) rather than rows (pullbacks).

    Forward mode when the engine has no native reverse mode, when it has both and the input is
    smaller than the output, and always for complex ``x`` or ``y``: a column is the derivative
    along a real basis direction, which every backend computes alike (see the README's complex
    convention), while a reverse-mode row is its conjugate only for holomorphic ``f``.
    """
    complex_ = any(d.is_complex for d in (*spec.x.dtypes, *spec.y.dtypes))
    return "pullback" not in native or ("pushforward" in native and (spec.x.numel < spec.y.numel or complex_))


def refuse_compiled_double_backward(backend: Backend, family: str, spec: Spec) -> None:
    """``AutoCompile(inner=AutoAutograd())`` cannot run what needs double backward: AOTAutograd
    does not support it, and torch raises from inside the compiled graph at preparation."""
    if not (isinstance(backend, AutoCompile) and base_type(backend) is AutoAutograd):
        return
    autograd_native = engine_for(AutoAutograd()).native
    if family in DOUBLE_BACKWARD or (family == "jacobian" and jacobian_uses_forward(autograd_native, spec)):
        raise UnsupportedOperatorError(
            f"{backend!r}: {family} needs double backward (or forward mode built on it), which torch.compile's "
            f"AOTAutograd does not support. Backends that can: {', '.join(_COMPILED_DOUBLE_BACKWARD_WORKS)}"
        )


# Where a State context is updated exactly once per call: the families whose row says so
# (f evaluated once, outside vmap, contexts passed as arguments of the transform), on these
# eager backends or compiled ones running them, and not under CUDA graphs (which run f on
# copies of the tensors).
STATE_BACKENDS: tuple[type, ...] = (AutoAutograd, AutoFunc)
_STATE_WORKS = "AutoAutograd(), AutoFunc(), and AutoCompile() and AutoXLA() with inner=AutoAutograd() or AutoFunc()"


def state_refusal(family: str, backend: Backend, operator: str) -> UnsupportedOperatorError | None:
    """The error for a ``State`` context where its update would not happen exactly once, or ``None``."""
    if isinstance(backend, AutoSparse) and not FAMILIES[family].matrix:
        return state_refusal(family, backend.dense, operator)  # AutoSparse hands these to its dense backend
    if isinstance(backend, DataParallel):  # each process updates its own State, as FSDP2 and DDP's forward do
        return state_refusal(family, backend.backend, operator)
    inner = backend.inner if isinstance(backend, _COMPILED) else backend
    compiled_in_place = not isinstance(backend, AutoCompile) or backend.mode != "reduce-overhead"
    if FAMILIES[family].state and isinstance(inner, STATE_BACKENDS) and compiled_in_place:
        return None
    families = " and ".join(
        f"{row.operator} and {row.value_operator}" for row in FAMILIES.values() if row.state
    )
    return UnsupportedOperatorError(
        f"{operator} with {backend!r}: a torchdi.State context is updated exactly once per call only by "
        f"{families} on {_STATE_WORKS}, not with mode='reduce-overhead' (other operators "
        "evaluate f several times or under vmap; CUDA graphs run f on copies of the tensors). "
        "Pass the values as a Constant with fixed statistics (model.eval()) for other operators."
    )
