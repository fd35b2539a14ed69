"""What every module fencing private torch internals shares: probing, and one warning per fast path.

A fence module (``engines/_dynamo.py`` for dynamo, functorch and autograd, ``engines/_xla_private.py``
for torch-xla, ``_distributed_private.py`` for ``torch.distributed``, ``sparsity/_private.py`` for
aten's operator objects) probes each private internal once, keeps it in a module attribute (which
the fence tests set to "missing" in turn) and gives a public fallback for it. This module sits on
the lowest floor (it imports only torch), so that fences below the engines can use it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Fence", "probe"]

logger = logging.getLogger("torchdi")


def probe(getter: Callable[[], Any]) -> Any:
    """``getter()``, or ``None`` when what it reaches for does not exist in this torch."""
    try:
        return getter()
    except (AttributeError, ImportError, TypeError):
        return None


class Fence:
    """The fast paths of one fence module, and the one warning each gets when it is off.

    Args:
        fast_paths: name -> what the private internal behind it does for torchdi.
        costs: name -> what the public path costs instead, where it is more than time.
        what: the software whose internals these are (named in the warning).
    """

    def __init__(self, fast_paths: dict[str, str], costs: dict[str, str] | None = None, what: str = "torch") -> None:
        self.fast_paths = fast_paths
        self.costs = costs or {}
        self.what = what
        self.warned: set[str] = set()

    def warn_off(self, name: str, detail: str = "") -> None:
        """Log once per process that the fast path ``name`` is off in this torch (slower, still right)."""
        if name in self.warned:
            return
        self.warned.add(name)
        logger.warning(
            "torchdi: %s (torch %s) lacks the internal behind a fast path (%s: %s)%s; torchdi uses the "
            "public path instead, %s.",
            self.what,
            torch.__version__,
            name,
            self.fast_paths[name],
            f" ({detail})" if detail else "",
            self.costs.get(name, "which is slower but gives the same results"),
        )
