"""torchdi: one differentiation interface for PyTorch.

Write ``f(x, *contexts)`` once; get gradients, jacobians, hessians, HVPs, pullbacks and
pushforwards from eager ``torch.autograd``, ``torch.func``, ``torch.compile``, XLA devices or
finite differences, with a prepare-once / run-many split.
"""

from torchdi import (
    distributed as distributed,  # td.distributed.all_reduce_ (a submodule: documented on its own page)
)

# Imported for their registrations: every engine (torchdi.runners.register_engine) and every
# generic fallback (torchdi.runners.register_fallback), whatever a user imports first.
from torchdi import engines as engines
from torchdi import operators as operators
from torchdi.backends import (
    AutoAutograd,
    AutoCompile,
    AutoFiniteDiff,
    AutoFunc,
    AutoSparse,
    AutoXLA,
    MixedMode,
    SecondOrder,
    check_available,
)
from torchdi.contexts import Cache, Constant, State
from torchdi.differentiate_with import DifferentiateWith
from torchdi.errors import BackendUnavailableError, UnsupportedOperatorError
from torchdi.families import (
    DerivativeResult,
    GradientResult,
    HessianResult,
    HvpResult,
    JacobianResult,
    PullbackResult,
    PushforwardResult,
    SecondDerivativeResult,
)
from torchdi.into_grad import into_grad
from torchdi.operators import (
    derivative,
    gradient,
    gradient_and_hvp,
    hessian,
    hvp,
    jacobian,
    prepare_derivative,
    prepare_gradient,
    prepare_hessian,
    prepare_hvp,
    prepare_hvp_same_point,
    prepare_jacobian,
    prepare_pullback,
    prepare_pullback_same_point,
    prepare_pushforward,
    prepare_pushforward_same_point,
    prepare_second_derivative,
    pullback,
    pushforward,
    second_derivative,
    value_and_derivative,
    value_and_gradient,
    value_and_jacobian,
    value_and_pullback,
    value_and_pushforward,
    value_derivative_and_second_derivative,
    value_gradient_and_hessian,
)
from torchdi.prep import Prep, PreparationMismatchError
from torchdi.sparsity import (
    DenseSparsity,
    GreedyColoring,
    KnownColoring,
    KnownSparsity,
    TracerSparsity,
)
from torchdi.translate import Static, copyfrom, copyto_, to_device_tensor

__version__ = "0.1.0"

__all__ = [
    "DerivativeResult",
    "GradientResult",
    "HessianResult",
    "HvpResult",
    "JacobianResult",
    "PullbackResult",
    "PushforwardResult",
    "SecondDerivativeResult",
    "AutoAutograd",
    "AutoCompile",
    "AutoFiniteDiff",
    "AutoFunc",
    "AutoSparse",
    "AutoXLA",
    "BackendUnavailableError",
    "Cache",
    "Constant",
    "DenseSparsity",
    "DifferentiateWith",
    "GreedyColoring",
    "KnownColoring",
    "KnownSparsity",
    "MixedMode",
    "Prep",
    "PreparationMismatchError",
    "SecondOrder",
    "State",
    "Static",
    "TracerSparsity",
    "UnsupportedOperatorError",
    "check_available",
    "copyfrom",
    "copyto_",
    "derivative",
    "gradient",
    "gradient_and_hvp",
    "hessian",
    "hvp",
    "into_grad",
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
    "to_device_tensor",
    "value_and_derivative",
    "value_and_gradient",
    "value_and_jacobian",
    "value_and_pullback",
    "value_and_pushforward",
    "value_derivative_and_second_derivative",
    "value_gradient_and_hessian",
]
