"""Engines: one module per backend, each implementing the runners it does natively and well.

An engine's ``build(family, f, spec)`` returns a runner for the operator family, or ``None``
to let the generic fallback in ``torchdi.operators`` build it from other runners.
"""

from __future__ import annotations

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
from torchdi.engines.base import Engine

__all__ = ["Engine", "engine_for"]


def engine_for(backend: Backend) -> Engine:
    """The engine that runs ``backend``."""
    if isinstance(backend, AutoAutograd):
        from torchdi.engines.autograd import AutogradEngine

        return AutogradEngine(backend)
    if isinstance(backend, AutoFunc):
        from torchdi.engines.func import FuncEngine

        return FuncEngine(backend)
    if isinstance(backend, AutoFiniteDiff):
        from torchdi.engines.finitediff import FiniteDiffEngine

        return FiniteDiffEngine(backend)
    if isinstance(backend, SecondOrder):
        from torchdi.engines.second_order import SecondOrderEngine

        return SecondOrderEngine(backend)
    if isinstance(backend, AutoCompile):
        from torchdi.engines.compile import CompileEngine

        return CompileEngine(backend)
    if isinstance(backend, AutoXLA):
        from torchdi.engines.xla import XLAEngine

        return XLAEngine(backend)
    if isinstance(backend, AutoSparse):
        from torchdi.engines.sparse import SparseEngine

        return SparseEngine(backend)
    if isinstance(backend, DataParallel):
        from torchdi.engines.data_parallel import DataParallelEngine

        return DataParallelEngine(backend)
    raise TypeError(f"not a torchdi backend: {backend!r}")
