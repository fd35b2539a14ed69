"""The README's and the guides' ``AutoXLA`` code blocks, run on torch-xla's PJRT CPU client.

``tests/test_docs.py`` skips them in the main environment (no torch-xla there); this module runs
the same blocks, with the blocks above them in their file, through the same machinery.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("torchdi_docs_blocks", Path(__file__).resolve().parents[1] / "test_docs.py")
assert _spec is not None and _spec.loader is not None
docs = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = docs  # dataclasses look their module up while the class is built
_spec.loader.exec_module(docs)

XLA_BLOCKS = [b for b in docs.ALL_BLOCKS if b.directive == ("requires-backend", "AutoXLA")]


def test_the_docs_have_xla_blocks() -> None:
    assert {b.path.name for b in XLA_BLOCKS} >= {"README.md", "compiled-and-xla.md"}


@pytest.mark.parametrize("block", XLA_BLOCKS, ids=lambda b: b.id)
def test_xla_block_runs(block, monkeypatch: pytest.MonkeyPatch) -> None:
    if docs.skip_reason(block):
        pytest.skip(docs.skip_reason(block))
    monkeypatch.setattr(docs.torchdi, "AutoCompile", docs._aot_eager_compile)  # as in tests/test_docs.py
    docs.test_code_block_runs(block, None, monkeypatch)
