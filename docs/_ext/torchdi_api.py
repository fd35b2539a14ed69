"""Reference pages generated from the code: one page per name in ``torchdi.__all__``.

The reference follows ``torchdi.__all__`` instead of a hand-kept list, so a public name added to
the package gets its page (and its place in the reference index) without editing the docs.
Names are grouped by the module that defines them; a module not listed in ``SECTIONS`` lands in
"Other names" until it is given a section. Submodules with their own namespace
(``torchdi.testing``, ``torchdi.distributed``) get one page each when they import, and the
command line gets a page built from its argparse parser.

Pages are written under ``docs/reference/api/`` (not tracked by git) when the builder starts, and
only when their text changed, so incremental builds stay incremental.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

API_DIR = Path(__file__).resolve().parent.parent / "reference" / "api"


@dataclass
class Section:
    """A group of the reference index: the public names defined in ``modules``."""

    title: str
    intro: str
    modules: tuple[str, ...]
    names: list[str] = field(default_factory=list)


def _sections() -> list[Section]:
    return [
        Section("Backends", "Frozen, hashable dataclasses that hold settings only.", ("torchdi.backends",)),
        Section(
            "Contexts",
            "Arguments of ``f`` that are not differentiated; they come after ``x`` (and after the "
            "tangents), in the order ``f`` takes them.",
            ("torchdi.contexts",),
        ),
        Section(
            "Operators",
            "Each ``prepare_<op>`` serves both ``<op>`` and its ``value_and_<op>`` variant.",
            ("torchdi.operators",),
        ),
        Section(
            "Results",
            "What the ``value_and_<op>`` variants return: NamedTuples, so ``y, g = ...`` unpacks them "
            "and ``.gradient`` names a field.",
            ("torchdi.families",),
        ),
        Section("Preparation", "What ``prepare_*`` returns.", ("torchdi.prep",)),
        Section(
            "Sparse jacobians and hessians",
            "Colour-compressed jacobians and hessians, sparsity detectors and colourings.",
            ("torchdi.engines.sparse", "torchdi.sparsity"),
        ),
        Section(
            "Mixing backends",
            "Derivatives of one piece of a function computed by another backend.",
            ("torchdi.differentiate_with",),
        ),
        Section(
            "Translation hook and buffer helpers",
            "What compiled backends trace, and copies into and out of preallocated buffers.",
            ("torchdi.translate",),
        ),
        Section(
            "Training",
            "Writing gradients where ``torch.optim`` reads them (see also ``torchdi.distributed``).",
            ("torchdi.into_grad",),
        ),
        Section("Errors", "All importable from ``torchdi``.", ("torchdi.errors",)),
    ]


OTHER = "Other names"
SUBMODULES = ("torchdi.testing", "torchdi.distributed")


def _module_of(obj: Any) -> str:
    return getattr(obj, "__module__", None) or ""


def _in(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def group_public_names() -> list[Section]:
    """Every name of ``torchdi.__all__`` in exactly one section (empty sections dropped)."""
    import torchdi

    sections = _sections()
    errors = next(s for s in sections if s.title == "Errors")
    other = Section(OTHER, "Public names not yet given a section of their own.", ())
    for name in torchdi.__all__:
        obj = getattr(torchdi, name)
        if inspect.isclass(obj) and issubclass(obj, Exception):
            errors.names.append(name)  # PreparationMismatchError lives in prep.py, but is an error
            continue
        module = _module_of(obj)
        home = next((s for s in sections if _in(module, s.modules)), other)
        home.names.append(name)
    return [s for s in [*sections, other] if s.names]


def _directive(name: str, obj: Any) -> str:
    target = f"torchdi.{name}"
    if inspect.isclass(obj) and issubclass(obj, BaseException):
        return f".. autoexception:: {target}\n   :show-inheritance:\n"
    if inspect.isclass(obj):
        bases = "   :show-inheritance:\n" if obj.__bases__ != (object,) else ""  # no "Bases: object"
        return f".. autoclass:: {target}\n   :members:\n{bases}"
    if callable(obj):
        return f".. autofunction:: {target}\n"
    return f".. autodata:: {target}\n   :no-value:\n"


def _family(name: str) -> str:
    """The operator family of ``name`` (``torchdi.operators.gradient`` -> ``gradient``)."""
    import torchdi

    module = _module_of(getattr(torchdi, name))
    return module.rsplit(".", 1)[-1]


def name_page(name: str) -> str:
    """The MyST source of the page documenting ``torchdi.<name>``."""
    import torchdi

    obj = getattr(torchdi, name)
    lines = [f"# torchdi.{name}", "", "```{eval-rst}", _directive(name, obj).rstrip(), "```", ""]
    if _module_of(obj).startswith("torchdi.operators."):
        family = _family(name)
        siblings = [n for n in torchdi.__all__ if n != name and _module_of(getattr(torchdi, n)) == _module_of(obj)]
        if siblings:
            links = ", ".join(f"[`{n}`]({n}.md)" for n in siblings)
            lines += [f"Same operator family (`{family}`, one preparation for all): {links}.", ""]
        lines += ["See the [preparation guide](../../guides/preparation.md) for what a `Prep` may be reused with.", ""]
    return "\n".join(lines)


def submodule_page(module: str) -> str:
    return "\n".join(
        [
            f"# {module}",
            "",
            "```{eval-rst}",
            f".. automodule:: {module}",
            "   :members:",
            "```",
            "",
        ]
    )


def cli_page() -> str:
    """``python -m torchdi`` from its own parser: the help of the program and of each command."""
    import argparse

    from torchdi.__main__ import build_parser

    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "80"  # argparse wraps to the terminal; pages must not depend on it
    try:
        parser = build_parser()
        parts = ["# Command line", "", "`python -m torchdi` benchmarks and checks the backends installed here.", "",
                 "Generated from the program's own argument parser (`torchdi/__main__.py`).", "",
                 "```text", parser.format_help().rstrip(), "```", ""]
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for command, sub in action.choices.items():
                    parts += [f"## `python -m torchdi {command}`", "", "```text", sub.format_help().rstrip(), "```", ""]
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old
    parts += ["Exit status: 0 when every row is correct, 1 when a result is wrong or a backend fails, "
              "2 for an unknown backend or operator (the message lists the valid names).", ""]
    return "\n".join(parts)


def available_submodules() -> list[str]:
    found = []
    for module in SUBMODULES:
        try:
            spec = importlib.util.find_spec(module)
        except ModuleNotFoundError:
            spec = None
        if spec is not None:
            importlib.import_module(module)
            found.append(module)
    return found


# Operator families in the order of DESIGN.md's table; a family not listed here comes last.
FAMILIES = ("pushforward", "pullback", "derivative", "gradient", "jacobian", "second_derivative", "hvp", "hessian")


def _operator_order(name: str) -> tuple[int, int, str]:
    family = _family(name)
    rank = FAMILIES.index(family) if family in FAMILIES else len(FAMILIES)
    return (rank, 0 if name.startswith("prepare_") else 1, name)


def _summary_table(names: list[str]) -> list[str]:
    return ["```{eval-rst}", ".. autosummary::", "", *[f"   torchdi.{n}" for n in names], "```", ""]


def index_section_text() -> str:
    """The body of the reference index: one table per section and the hidden toctree."""
    lines: list[str] = []
    pages: list[str] = []
    for section in group_public_names():
        lines += [f"## {section.title}", "", section.intro, ""]
        if section.title == "Operators":
            section.names.sort(key=_operator_order)
            families: dict[str, list[str]] = {}
            for name in section.names:
                families.setdefault(_family(name), []).append(name)
            for family, names in families.items():
                lines += [f"### {family}", "", *_summary_table(names)]
        else:
            lines += _summary_table(section.names)
        pages += [f"api/{name}" for name in section.names]
    modules = available_submodules()
    lines += ["## Modules and command line", "", "```{eval-rst}", ".. autosummary::", ""]
    lines += [f"   {m}" for m in modules]
    lines += ["```", "", "- [The command line, `python -m torchdi`](api/cli.md)", ""]
    pages += [f"api/{m}" for m in modules] + ["api/cli"]
    lines += ["```{toctree}", ":hidden:", "", *pages, "```", ""]
    return "\n".join(lines)


BENCHMARK_SUITES = {
    "raw_overhead": "the interface's per-call cost against hand-written torch code",
    "compile_overhead": "AutoCompile against calling torch.compile (and jax.jit) directly",
}


def benchmark_suites_text(root: Path | None = None) -> str:
    """The tables the suite scripts wrote (``--markdown benchmarks/<suite>.md``), or how to get them."""
    root = root or Path(__file__).resolve().parents[2]
    parts = []
    for suite, what in BENCHMARK_SUITES.items():
        table = root / "benchmarks" / f"{suite}.md"
        if table.is_file():
            parts.append(table.read_text().rstrip() + "\n")
        else:
            parts.append(
                f"### `benchmarks/{suite}.py`\n\n{what.capitalize()}: not measured in this checkout; "
                f"`python -m torchdi bench --suite {suite.replace('_', '-')} --markdown benchmarks/{suite}.md` "
                "writes the table this page shows.\n"
            )
    return "\n".join(parts)


def all_pages() -> dict[str, str]:
    """``{file name under reference/api: MyST text}`` for every generated page."""
    import torchdi

    pages = {f"{name}.md": name_page(name) for name in torchdi.__all__}
    pages.update({f"{m}.md": submodule_page(m) for m in available_submodules()})
    pages["cli.md"] = cli_page()
    pages["_index.md"] = index_section_text()
    pages["_benchmark_suites.md"] = benchmark_suites_text()
    return pages


def write_pages(directory: Path = API_DIR) -> list[Path]:
    """Write every page whose text changed; remove pages of names that left ``__all__``."""
    directory.mkdir(parents=True, exist_ok=True)
    pages = all_pages()
    for stale in directory.glob("*.md"):
        if stale.name not in pages:
            stale.unlink()
    written = []
    for file_name, text in pages.items():
        path = directory / file_name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            written.append(path)
    return written


def _on_builder_inited(app: Any) -> None:
    write_pages()


def setup(app: Any) -> dict[str, Any]:
    app.connect("builder-inited", _on_builder_inited)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
