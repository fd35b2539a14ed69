"""The operators: one module per family, each with its ``prepare_*``, its variants and its fallback."""

from torchdi.operators.derivative import derivative, prepare_derivative, value_and_derivative
from torchdi.operators.gradient import gradient, prepare_gradient, value_and_gradient
from torchdi.operators.hessian import hessian, prepare_hessian, value_gradient_and_hessian
from torchdi.operators.hvp import gradient_and_hvp, hvp, prepare_hvp
from torchdi.operators.jacobian import jacobian, prepare_jacobian, value_and_jacobian
from torchdi.operators.pullback import prepare_pullback, pullback, value_and_pullback
from torchdi.operators.pushforward import prepare_pushforward, pushforward, value_and_pushforward
from torchdi.operators.same_point import (
    prepare_hvp_same_point,
    prepare_pullback_same_point,
    prepare_pushforward_same_point,
)
from torchdi.operators.second_derivative import (
    prepare_second_derivative,
    second_derivative,
    value_derivative_and_second_derivative,
)

__all__ = [
    "derivative",
    "gradient",
    "gradient_and_hvp",
    "hessian",
    "hvp",
    "jacobian",
    "prepare_derivative",
    "prepare_gradient",
    "prepare_hessian",
    "prepare_hvp",
    "prepare_hvp_same_point",
    "prepare_jacobian",
    "prepare_pullback",
    "prepare_pullback_same_point",
    "prepare_pushforward",
    "prepare_pushforward_same_point",
    "prepare_second_derivative",
    "pullback",
    "pushforward",
    "second_derivative",
    "value_and_derivative",
    "value_and_gradient",
    "value_and_jacobian",
    "value_and_pullback",
    "value_and_pushforward",
    "value_derivative_and_second_derivative",
    "value_gradient_and_hessian",
]
