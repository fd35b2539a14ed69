"""The floors of torchdi/ import only downward: no import cycle, counting every import.

An ``ast`` walk records every torchdi import of every module of the package, those inside
function bodies included (an import deferred into a function hides a cycle from Python, not
from the reader), and fails on any strongly connected component of more than one module,
naming its modules and the imports that close it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import torchdi

PACKAGE = Path(torchdi.__file__).parent


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(root: Path) -> dict[str, dict[str, int]]:
    """``{module: {imported module: line of the first such import}}`` for every module under
    ``root`` (a package directory), counting imports anywhere in the module."""
    paths = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    packages = {name for name, p in paths.items() if p.name == "__init__.py"}
    top = root.name
    graph: dict[str, dict[str, int]] = {}
    for name, path in paths.items():
        edges: dict[str, int] = {}
        own_package = name if name in packages else name.rpartition(".")[0]

        def add(target: str, line: int, name: str = name, edges: dict[str, int] = edges) -> None:
            # Importing a.b.c runs the __init__ of a.b first, unless the importer lives inside a.b
            # (then that package is already being imported): count those parents too. The root
            # package is always imported before any of its modules: never an edge.
            while target and target != top:
                if target in paths and target != name:
                    edges.setdefault(target, line)
                target = target.rpartition(".")[0]
                if target and (name == target or name.startswith(target + ".")):
                    break

        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == top or alias.name.startswith(top + "."):
                        add(alias.name, node.lineno)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = own_package.split(".")
                    base = base[: len(base) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                if not (module == top or module.startswith(top + ".")):
                    continue
                for alias in node.names:
                    submodule = f"{module}.{alias.name}"
                    add(submodule if submodule in paths else module, node.lineno)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def describe(graph: dict[str, dict[str, int]], component: list[str]) -> str:
    members = set(component)
    edges = [f"{a} -> {b} (line {line})" for a in component for b, line in graph[a].items() if b in members]
    return f"{len(component)} modules: {', '.join(component)}\n    " + "\n    ".join(edges)


def test_no_import_cycle() -> None:
    graph = import_graph(PACKAGE)
    assert len(graph) > 30 and "torchdi.runners" in graph
    found = cycles(graph)
    assert not found, "import cycles in torchdi/ (every import counted, function bodies included):\n" + "\n".join(
        describe(graph, c) for c in found
    )


def test_the_walk_sees_imports_in_function_bodies(tmp_path: Path) -> None:
    # A two-module cycle closed by a deferred import is found, and named.
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.b import g\n\ndef f():\n    return g()\n")
    (package / "b.py").write_text("def g():\n    from pkg.a import f\n    return f\n")
    (package / "c.py").write_text("import pkg.a\n")
    graph = import_graph(package)
    assert graph["pkg.b"] == {"pkg.a": 2}
    assert cycles(graph) == [["pkg.a", "pkg.b"]]
    assert "pkg.b -> pkg.a (line 2)" in describe(graph, ["pkg.a", "pkg.b"])


def test_a_package_init_counts_for_modules_outside_it(tmp_path: Path) -> None:
    # pkg.low importing pkg.sub.x runs pkg/sub/__init__.py, which imports pkg.low: a cycle.
    # pkg.sub.x importing its sibling pkg.sub.y does not re-run pkg/sub/__init__.py: none.
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "low.py").write_text("from pkg.sub.x import X\n")
    (package / "sub" / "__init__.py").write_text("from pkg.sub import x, y\nimport pkg.low\n")
    (package / "sub" / "x.py").write_text("from pkg.sub.y import Y\nX = Y\n")
    (package / "sub" / "y.py").write_text("Y = 1\n")
    graph = import_graph(package)
    assert graph["pkg.sub.x"] == {"pkg.sub.y": 1}
    assert cycles(graph) == [["pkg.low", "pkg.sub"]]


def test_import_torchdi_loads_no_heavy_module() -> None:
    """``import torchdi`` imports torch and torchdi, not dynamo, inductor, sympy, scipy or
    torch.distributed's FSDP/DTensor (each loads on first use: a compiled preparation, a
    DataParallel call). Measured in a fresh process."""
    import subprocess
    import sys

    heavy = ["torch._dynamo", "torch._inductor", "sympy", "scipy", "torch.distributed.fsdp", "torch.distributed.tensor",
             "torch.distributed._functional_collectives", "torch_xla", "transformers"]
    code = f"import sys, torchdi; print([m for m in {heavy!r} if m in sys.modules])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=PACKAGE.parent)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"import torchdi loads {done.stdout.strip()}"


def test_implements_agrees_with_isinstance() -> None:
    """``runners.implements`` (the fast protocol check) gives ``isinstance``'s answer for every
    runner protocol, on runners with and without the optional parts and on engines."""
    import torch

    import torchdi as td
    from torchdi import runners

    protocols = [
        runners.WarmsUp, runners.HasCheckedCall, runners.CountsCompilations, runners.Publishes, runners.HasPath,
        runners.ServesEmpty, runners.TranslatesContexts, runners.Engine,
    ]
    x = torch.ones(3)
    objects: list[object] = [lambda x, t, c: (x,), object()]
    for backend in (td.AutoAutograd(), td.AutoCompile(compiler="aot_eager"), td.AutoSparse(td.AutoFunc())):
        objects.append(runners.engine_for(backend))
    objects.append(td.prepare_gradient(lambda x: (x**2).sum(), td.AutoCompile(compiler="aot_eager"), x).runner)
    objects.append(td.prepare_jacobian(lambda x: x**2, td.AutoSparse(td.AutoFunc()), x).runner)
    for obj in objects:
        for protocol in protocols:
            assert runners.implements(obj, protocol) is isinstance(obj, protocol), (obj, protocol)
    assert any(runners.implements(obj, runners.WarmsUp) for obj in objects)
    assert any(runners.implements(obj, runners.Publishes) for obj in objects)
