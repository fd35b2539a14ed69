"""Engines: one module per backend, each implementing the runners it does natively and well.

An engine's ``build(family, f, spec)`` returns a runner for the operator family, or ``None``
to let the generic fallback in ``torchdi.operators`` build it from other runners. Each engine
module registers its engine with ``torchdi.runners.register_engine`` when imported; this
package imports them all, so the registry is full once ``torchdi.engines`` is imported.
"""

from __future__ import annotations

from torchdi.engines import (  # noqa: F401  (imported for their registration)
    autocompile,
    autograd,
    data_parallel,
    finitediff,
    func,
    mixed,
    second_order,
    sparse,
    xla,
)
from torchdi.runners import Engine, engine_for

__all__ = ["Engine", "engine_for"]
