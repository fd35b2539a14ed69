"""Sparsity detection and colouring for ``AutoSparse``.

Detectors (one rule set per module): ``TracerSparsity`` (``tracer.py``: global, from ``f``'s
aten graph), ``DenseSparsity`` (``dense.py``: local, from a dense matrix at the preparation
point), ``KnownSparsity`` (``known.py``: given). Colouring: ``GreedyColoring`` (``coloring.py``), or
``KnownColoring`` (``known.py``: a pattern and colouring computed before, as plain data).
Index sets (``index_sets.py``) are the boolean CSR matrices they all exchange.
"""

from torchdi.sparsity.coloring import GreedyColoring
from torchdi.sparsity.dense import DenseSparsity
from torchdi.sparsity.known import KnownColoring, KnownSparsity
from torchdi.sparsity.tracer import TracerSparsity

__all__ = ["DenseSparsity", "GreedyColoring", "KnownColoring", "KnownSparsity", "TracerSparsity"]
