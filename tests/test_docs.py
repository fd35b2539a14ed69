"""Every ```python block of the README and of the docs runs, and the reference covers the API.

The blocks of one Markdown file run in order in one namespace, as a reader would paste them.
A block is preceded, optionally, by an HTML comment (invisible on GitHub and on the site):

- ``<!-- docs-test: skip REASON -->``: never run (a fragment that cannot run on its own);
- ``<!-- docs-test: requires-backend NAME -->``: run only where ``check_available(torchdi.NAME())``;
- ``<!-- docs-test: requires torchdi.NAME -->``: run only once ``torchdi.NAME`` exists (names of
  DESIGN.md that are not merged yet).

A function named ``test_*`` that a block defines is called too (the README shows one).
``AutoCompile()`` runs with the ``aot_eager`` compiler here, which keeps every torch.compile step
but inductor's code generation (minutes on a 2-core CI box); set ``TORCHDI_DOCS_INDUCTOR=1`` to
run the blocks exactly as written.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import torchdi
from torchdi import backends as backends_module

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
GENERATED = DOCS / "reference" / "api"

_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>[^\n`]*)$")
_DIRECTIVE = re.compile(r"<!--\s*docs-test:\s*(?P<kind>skip|requires-backend|requires)\s*(?P<arg>.*?)\s*-->")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    source: str
    directive: tuple[str, str] | None

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def python_blocks(path: Path) -> list[Block]:
    """The fenced ```python blocks of a Markdown file, with the directive just above each."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, info = opening["fence"], opening["info"].strip()
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        if info.split(" ")[0] in ("python", "py", "{code-block} python"):
            above = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            found = _DIRECTIVE.search(above)
            directive = (found["kind"], found["arg"]) if found else None
            indent = len(opening["indent"])
            body = "\n".join(line[indent:] for line in lines[i + 1 : end])
            blocks.append(Block(path, i + 1, body + "\n", directive))
        i = end + 1
    return blocks


def markdown_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
    return [p for p in files if GENERATED not in p.parents and "_build" not in p.parts]


ALL_BLOCKS = [block for path in markdown_files() for block in python_blocks(path)]


def skip_reason(block: Block) -> str | None:
    if block.directive is None:
        return None
    kind, arg = block.directive
    if kind == "skip":
        return f"{block.id}: marked skip ({arg or 'no reason given'})"
    if kind == "requires":
        name = arg.removeprefix("torchdi.")
        return None if hasattr(torchdi, name) else f"{block.id}: needs torchdi.{name}, not in this build of torchdi"
    backend = getattr(torchdi, arg)()
    reason = backends_module.unavailable_reason(backend)
    return None if reason is None else f"{block.id}: needs {arg} ({reason})"


def _aot_eager_compile(*args: Any, **kwargs: Any) -> Any:
    kwargs.setdefault("compiler", "aot_eager")
    return backends_module.AutoCompile(*args, **kwargs)


class _FileRun:
    """The namespace of one Markdown file and how far its blocks have run."""

    def __init__(self, path: Path) -> None:
        # A real module: torch.compile looks the function's module up in sys.modules.
        name = "torchdi_docs_" + re.sub(r"\W", "_", str(path.relative_to(ROOT)))
        module = sys.modules.setdefault(name, types.ModuleType(name))
        self.namespace: dict[str, Any] = module.__dict__
        self.done: set[int] = set()
        self.failed: dict[int, BaseException] = {}


_RUNS: dict[Path, _FileRun] = {}


def _run(block: Block, state: _FileRun) -> None:
    filename = f"<{block.id}>"
    code = compile(block.source, filename, "exec")
    exec(code, state.namespace)  # the documented code itself, run as a reader would
    for name, obj in list(state.namespace.items()):
        code_obj = getattr(obj, "__code__", None)
        if name.startswith("test_") and code_obj is not None and code_obj.co_filename == filename:
            obj()


@pytest.fixture
def compile_without_inductor(monkeypatch: pytest.MonkeyPatch) -> None:
    if os.environ.get("TORCHDI_DOCS_INDUCTOR") != "1":
        monkeypatch.setattr(torchdi, "AutoCompile", _aot_eager_compile)


@pytest.mark.parametrize("block", ALL_BLOCKS, ids=lambda b: b.id)
def test_code_block_runs(block: Block, compile_without_inductor: None, monkeypatch: pytest.MonkeyPatch) -> None:
    reason = skip_reason(block)
    if reason:
        pytest.skip(reason)
    monkeypatch.chdir(ROOT)
    state = _RUNS.setdefault(block.path, _FileRun(block.path))
    # The blocks above this one first (once per file), as a reader would have run them.
    for earlier in python_blocks(block.path):
        if earlier.line >= block.line:
            break
        if earlier.line in state.done or skip_reason(earlier):
            continue
        if earlier.line in state.failed:
            pytest.fail(f"an earlier block of this file failed: {earlier.id}: {state.failed[earlier.line]!r}")
        try:
            _run(earlier, state)
        except BaseException as err:
            state.failed[earlier.line] = err
            raise
        state.done.add(earlier.line)
    if block.line not in state.done:
        try:
            _run(block, state)
        except BaseException as err:
            state.failed[block.line] = err
            raise
        state.done.add(block.line)


def test_blocks_are_found() -> None:
    """The extraction sees the README's blocks (a broken parser would pass every test above)."""
    readme = [b for b in ALL_BLOCKS if b.path.name == "README.md"]
    assert len(readme) >= 4
    assert any("prepare_gradient" in b.source for b in readme)
    guides = {b.path.name for b in ALL_BLOCKS if "guides" in b.path.parts}
    assert {"preparation.md", "training.md", "compiled-and-xla.md"} <= guides


def test_block_parser_on_a_sample(tmp_path: Path) -> None:
    sample = tmp_path / "sample.md"
    sample.write_text(
        "text\n\n```python\na = 1\n```\n\n```sh\nmake\n```\n\n"
        "<!-- docs-test: skip needs a TPU -->\n```python\nb = 2\n```\n\n````text\n```python\nnot code\n```\n````\n"
    )
    blocks = python_blocks(sample)
    assert [(b.line, b.source, b.directive) for b in blocks] == [
        (3, "a = 1\n", None),
        (12, "b = 2\n", ("skip", "needs a TPU")),
    ]


def _docs_ext() -> Any:
    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        import torchdi_api
    finally:
        sys.path.remove(str(DOCS / "_ext"))
    return torchdi_api


def test_every_public_name_has_a_reference_page() -> None:
    """The reference follows ``torchdi.__all__``: each name, one page, one section of the index."""
    api = _docs_ext()
    pages = api.all_pages()
    sections = api.group_public_names()
    listed = [name for section in sections for name in section.names]
    assert sorted(listed) == sorted(torchdi.__all__)  # each name in exactly one section
    for name in torchdi.__all__:
        page = pages[f"{name}.md"]
        assert f"torchdi.{name}" in page and ".. auto" in page
        assert f"api/{name}\n" in pages["_index.md"]
    assert "api/torchdi.testing" in pages["_index.md"]
    assert "python -m torchdi bench" in pages["cli.md"] and "--markdown" in pages["cli.md"]


def test_new_names_get_a_page_in_an_other_section(monkeypatch: pytest.MonkeyPatch) -> None:
    """A name merged into ``__all__`` from a module the docs do not know still gets a page."""
    api = _docs_ext()

    def brand_new_operator(x: Any) -> Any:
        """A stand-in for a future public name."""
        return x

    brand_new_operator.__module__ = "torchdi.some_future_module"
    monkeypatch.setattr(torchdi, "brand_new_operator", brand_new_operator, raising=False)
    monkeypatch.setattr(torchdi, "__all__", [*torchdi.__all__, "brand_new_operator"])
    other = [s for s in api.group_public_names() if s.title == api.OTHER]
    assert other and other[0].names == ["brand_new_operator"]
    assert ".. autofunction:: torchdi.brand_new_operator" in api.all_pages()["brand_new_operator.md"]


def test_benchmark_suite_tables_are_included_when_written(tmp_path: Path) -> None:
    """The benchmarks page shows what ``raw_overhead.py --markdown`` wrote, or how to write it."""
    api = _docs_ext()
    (tmp_path / "benchmarks").mkdir()
    missing = api.benchmark_suites_text(tmp_path)
    assert "--suite raw-overhead --markdown benchmarks/raw_overhead.md" in missing

    spec = importlib.util.spec_from_file_location("torchdi_bench_raw_overhead", ROOT / "benchmarks" / "raw_overhead.py")
    assert spec is not None and spec.loader is not None
    raw_overhead = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(raw_overhead)
    assert raw_overhead.main(["--rounds", "1", "--markdown", str(tmp_path / "benchmarks" / "raw_overhead.md")]) == 0
    shown = api.benchmark_suites_text(tmp_path)
    assert "| hvp-1000 hvp | torchdi AutoFunc |" in shown and "not measured" in shown  # compile_overhead still missing
    assert "raw_overhead.md" not in shown.split("### `benchmarks/compile_overhead.py`")[0]
