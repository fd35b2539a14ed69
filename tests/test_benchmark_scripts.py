"""The README's generated tables: each suite that update_readme.py regenerates has its markers."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _update_readme():
    spec = importlib.util.spec_from_file_location("torchdi_update_readme", ROOT / "benchmarks" / "update_readme.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_splice_replaces_only_the_text_between_its_markers():
    update = _update_readme()
    text = "head\n<!-- a:start -->\nold\n<!-- a:end -->\n<!-- b:start -->\nkeep\n<!-- b:end -->\ntail"
    spliced = update.splice(text, "new table", "<!-- a:start -->", "<!-- a:end -->")
    assert spliced == "head\n<!-- a:start -->\nnew table\n<!-- a:end -->\n<!-- b:start -->\nkeep\n<!-- b:end -->\ntail"
    with pytest.raises(SystemExit, match="no <!-- c:start -->"):
        update.splice(text, "x", "<!-- c:start -->", "<!-- c:end -->")


def test_every_regenerated_suite_has_its_markers_and_script_in_this_checkout():
    update = _update_readme()
    readme = (ROOT / "README.md").read_text()
    assert update.START in readme and update.END in readme
    for suite, (script, _, _) in update.SUITES.items():
        assert f"<!-- torchdi-{suite}:start -->" in readme and f"<!-- torchdi-{suite}:end -->" in readme
        assert (ROOT / "benchmarks" / script).is_file()
