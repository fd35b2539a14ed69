"""The operator families as data: the one place that knows them.

A *family* is what one preparation computes (``prepare_gradient`` prepares the ``"gradient"``
family, served to both ``gradient`` and ``value_and_gradient``). Everything the rest of torchdi
needs to know about a family (which argument the tangents are shaped like, what ``x`` and
``f(x)`` must be, the fields of the full result, whether a ``State`` context is supported, the
names of its two public operators) is one row of ``FAMILIES`` below; argument checks, engines,
fallbacks and the testing tables read it instead of keeping string sets of their own.

Adding a family means one row here, one module in ``torchdi/operators/`` (its public functions
and its generic fallback, registered with ``torchdi.runners.register_fallback``), and the
engines that compute it natively.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

__all__ = [
    "ALL_FAMILIES",
    "FAMILIES",
    "FIRST_ORDER",
    "MATRIX_FAMILIES",
    "SECOND_ORDER",
    "DerivativeResult",
    "Family",
    "GradientResult",
    "HessianResult",
    "HvpResult",
    "JacobianResult",
    "PullbackResult",
    "PushforwardResult",
    "SecondDerivativeResult",
    "family",
]


# The full result of each family (what the value_ variant returns). The public value_ variants
# return these NamedTuples on every backend (``value_and_gradient(...).gradient``; unpacking as a
# tuple works as before). Runners inside return plain tuples in this order (compiled programs
# return tuples, tangents batched); the value_ operator wraps them.
class PushforwardResult(NamedTuple):
    """What ``value_and_pushforward`` returns: ``(value, dy)``, ``dy`` a tuple of JVPs, one per tangent."""

    value: Any
    dy: Any


class PullbackResult(NamedTuple):
    """What ``value_and_pullback`` returns: ``(value, dx)``, ``dx`` a tuple of VJPs, one per tangent."""

    value: Any
    dx: Any


class DerivativeResult(NamedTuple):
    """What ``value_and_derivative`` returns: ``(value, derivative)``."""

    value: Any
    derivative: Any


class GradientResult(NamedTuple):
    """What ``value_and_gradient`` returns: ``(value, gradient)``.

    Example::

        >>> y, g = torchdi.value_and_gradient(lambda x: (x**2).sum(), torchdi.AutoFunc(), torch.ones(2))
        >>> torchdi.value_and_gradient(lambda x: (x**2).sum(), torchdi.AutoFunc(), torch.ones(2)).gradient
        tensor([2., 2.])"""

    value: Any
    gradient: Any


class JacobianResult(NamedTuple):
    """What ``value_and_jacobian`` returns: ``(value, jacobian)``."""

    value: Any
    jacobian: Any


class SecondDerivativeResult(NamedTuple):
    """What ``value_derivative_and_second_derivative`` returns: ``(value, derivative, second_derivative)``."""

    value: Any
    derivative: Any
    second_derivative: Any


class HvpResult(NamedTuple):
    """What ``gradient_and_hvp`` returns: ``(gradient, hvp)``, ``hvp`` a tuple, one per tangent."""

    gradient: Any
    hvp: Any


class HessianResult(NamedTuple):
    """What ``value_gradient_and_hessian`` returns: ``(value, gradient, hessian)``."""

    value: Any
    gradient: Any
    hessian: Any


@dataclass(frozen=True)
class Family:
    """One operator family.

    Attributes:
        name: the family's name (``"gradient"``), also the suffix of ``prepare_<name>``.
        operator: the plain operator's public name (``"gradient"``).
        value_operator: the variant that also returns the value (``"value_and_gradient"``).
        tangents_like: what the tangents are shaped like: ``"x"`` (``tx``), ``"y"`` (``ty``),
            or ``None`` (the family takes no tangents).
        scalar_x: ``x`` must be a real scalar (a Python number or a 0-d tensor).
        tensor_x: ``x`` must be one tensor (no pytree).
        scalar_y: ``f`` must return a one-element tensor.
        single_y: ``f`` must return one tensor (no pytree).
        order: 1 or 2.
        result: the NamedTuple of the full result (the value_ variant's fields, in order).
        state: whether a ``State`` context is updated exactly once per call (the family
            evaluates ``f`` once, outside ``vmap``), on the backends ``torchdi.composition``
            names.
        matrix: the result is a matrix that ``AutoSparse`` computes from compressed passes.
        drops_value: a one-shot call of the plain operator (no ``prep``) may build a runner
            that skips the value (``Spec.needs_value=False``: a compiled gradient then drops
            f's final reduction). A preparation always builds the one runner serving both.
    """

    name: str
    operator: str
    value_operator: str
    tangents_like: Literal["x", "y"] | None
    scalar_x: bool
    tensor_x: bool
    scalar_y: bool
    single_y: bool
    order: Literal[1, 2]
    result: type[tuple[Any, ...]]
    state: bool = False
    matrix: bool = False
    drops_value: bool = False

    @property
    def tangent_name(self) -> str | None:
        """The public name of the tangents argument (``"tx"``/``"ty"``), or ``None``."""
        return None if self.tangents_like is None else f"t{self.tangents_like}"


_ROWS = (
    Family("pushforward", "pushforward", "value_and_pushforward", "x", False, False, False, False, 1, PushforwardResult),
    Family("pullback", "pullback", "value_and_pullback", "y", False, False, False, False, 1, PullbackResult),
    Family("derivative", "derivative", "value_and_derivative", None, True, False, False, True, 1, DerivativeResult),
    Family("gradient", "gradient", "value_and_gradient", None, False, False, True, True, 1, GradientResult, state=True, drops_value=True),
    Family("jacobian", "jacobian", "value_and_jacobian", None, False, False, False, False, 1, JacobianResult, matrix=True),
    Family(
        "second_derivative",
        "second_derivative",
        "value_derivative_and_second_derivative",
        None,
        True,
        False,
        False,
        True,
        2,
        SecondDerivativeResult,
    ),
    Family("hvp", "hvp", "gradient_and_hvp", "x", False, False, True, True, 2, HvpResult),
    Family("hessian", "hessian", "value_gradient_and_hessian", None, False, False, False, False, 2, HessianResult, matrix=True),
)

#: Every family by name, in the order of DESIGN.md.
FAMILIES: dict[str, Family] = {row.name: row for row in _ROWS}
ALL_FAMILIES: frozenset[str] = frozenset(FAMILIES)
FIRST_ORDER: frozenset[str] = frozenset(name for name, row in FAMILIES.items() if row.order == 1)
SECOND_ORDER: frozenset[str] = ALL_FAMILIES - FIRST_ORDER
#: The NamedTuples the value_ variants return.
RESULT_TYPES: tuple[type[tuple[Any, ...]], ...] = tuple(row.result for row in _ROWS)


def as_plain_tuple(result: Any) -> Any:
    """``result`` as a plain tuple when it is a family's NamedTuple (else unchanged): pytree
    comparisons then match a plain tuple of the same fields."""
    return tuple(result) if isinstance(result, RESULT_TYPES) else result


#: The families whose result is a matrix (``AutoSparse`` computes them sparse).
MATRIX_FAMILIES: frozenset[str] = frozenset(name for name, row in FAMILIES.items() if row.matrix)


def family(name: str) -> Family:
    """The row of family ``name``; ``KeyError`` names the valid ones."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise KeyError(f"unknown operator family {name!r}; valid families: {', '.join(FAMILIES)}") from None
