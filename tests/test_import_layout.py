"""The package has no import circles: every module of `coat` is read with `ast` (nothing is imported), its imports of
coat modules form a graph, and a circle in that graph fails the test, which prints the circle with the import
lines that make it.

What counts as an import, from module M of coat to module T:
- every ``import`` and ``from ... import`` statement anywhere in M: at module level, in a function or method, under
  ``if`` or ``try``. An import inside a function runs later, but it ties M to T all the same, and a layer that
  imports the one above it lazily is still upside down. Names looked up in ``sys.modules`` or through importlib are
  no import.
- T is the module the statement names: ``import coat.a.b`` and ``from coat.a import b`` (b a submodule) give T =
  coat.a.b; ``from coat.a import name`` (a name defined or re-exported in coat/a/__init__.py) gives T = coat.a;
  relative imports are resolved against M's package.
- Parent packages are no edge. Python initialises coat and coat.a before coat.a.b, but a submodule that imports a
  sibling (``from coat.nn.config import FP8Config``) depends on that sibling, not on its package: a package's
  __init__ that imports its submodules makes no circle with them. A submodule that imports a name from its own
  package's __init__ (``from coat.nn import Linear`` inside coat.nn) depends on that __init__, which is a circle
  wherever the __init__ imports the submodule back.

The other tests hold the layout of coat.ops that docs/design.md describes: one module per kernel family, importing
only the shared checks below them, and coat.ops re-exporting every family's public names.
"""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "coat"


def module_names(package_dir: Path) -> dict[str, Path]:
    """Dotted name -> file of every module of the package rooted at ``package_dir``."""
    base = package_dir.parent
    names = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _package_of(module: str, path: Path) -> str:
    """The package a relative import of ``module`` resolves against: itself for an __init__."""
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[tuple[int, str]]:
    """(line, imported module) for each import of a module of ``modules`` anywhere in ``path``, in line order."""
    root = next(iter(modules)).split(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names if alias.name.split(".")[0] == root]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = _package_of(module, path).split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base.split(".")[0] != root:
                continue
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.append((submodule if submodule in modules else base, node.lineno))
    return sorted((line, target) for target, line in found if target in modules and target != module)


def import_graph(package_dir: Path) -> dict[str, dict[str, int]]:
    """module -> {imported module: line of its first import} over the package."""
    modules = module_names(package_dir)
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        edges = graph.setdefault(module, {})
        for line, target in imports_of(module, path, modules):
            edges.setdefault(target, line)
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One circle [a, b, ..., a] through each group of modules that import each other, in or out of turn (each
    strongly connected component of more than one module, Tarjan's algorithm); the circle starts at the group's
    first module by name and is the shortest back to it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(set(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return sorted(_circle_in(graph, component) for component in components)


def _circle_in(graph: dict[str, dict[str, int]], component: set[str]) -> list[str]:
    """The shortest circle from the component's first module back to itself."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node]):
                if target == start:
                    return paths[node] + [start]
                if target in component and target not in paths:
                    paths[target] = paths[node] + [target]
                    following.append(target)
        frontier = following
    raise AssertionError(f"no circle through {start} in {sorted(component)}")


def describe(graph: dict[str, dict[str, int]], circle: list[str], package_dir: Path) -> str:
    """The circle and, for each of its steps, the line that imports."""
    modules = module_names(package_dir)
    return " -> ".join(circle) + "\n" + "\n".join(
        f"    {a} imports {b} at {modules[a].relative_to(package_dir.parent)}:{graph[a][b]}"
        for a, b in zip(circle, circle[1:])
    )


def test_the_package_has_no_import_circles():
    graph = import_graph(PACKAGE)
    assert len(graph) > 20 and sum(len(edges) for edges in graph.values()) > 40  # the walk saw the package
    found = circles(graph)
    assert not found, "import circles in coat:\n" + "\n".join(describe(graph, c, PACKAGE) for c in found)


OPS_FAMILIES = [name for name in module_names(PACKAGE) if name.startswith("coat.ops.") and "._" not in name]


def test_the_ops_families_import_only_what_lies_below_them():
    """A family of coat.ops imports the shared checks and the native extension, not another family: what two
    families share goes into coat/ops/_checks.py (docs/design.md, adding a kernel)."""
    graph = import_graph(PACKAGE)
    assert len(OPS_FAMILIES) >= 6, OPS_FAMILIES
    for family in OPS_FAMILIES:
        assert set(graph[family]) <= {"coat._native", "coat.ops._checks"}, (family, graph[family])
    assert set(graph["coat.ops._checks"]) == set(), graph["coat.ops._checks"]


@pytest.mark.parametrize("family", OPS_FAMILIES)
def test_coat_ops_re_exports_every_public_name_of_a_family(family):
    ops = importlib.import_module("coat.ops")
    module = importlib.import_module(family)
    assert module.__all__, family
    for name in module.__all__:
        assert name in ops.__all__ and getattr(ops, name) is getattr(module, name), f"coat.ops lacks {family}.{name}"


def test_coat_ops_names_only_what_it_has():
    ops = importlib.import_module("coat.ops")
    assert len(set(ops.__all__)) == len(ops.__all__)
    assert [name for name in ops.__all__ if not hasattr(ops, name)] == []


# The walk itself, on small packages written for it: it finds the circles it must and none where there is none.


def write_package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_a_circle_is_found_and_printed_with_its_import_lines(tmp_path):
    package = write_package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg.b import thing\n",
        "pkg/b.py": "def f():\n    from pkg import c\n",  # inside a function: still an edge
        "pkg/c.py": "import pkg.a\n",
        "pkg/d.py": "from pkg import a\n",  # imports into the circle, is not on it
    })
    graph = import_graph(package)
    assert circles(graph) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]
    text = describe(graph, circles(graph)[0], package)
    assert "pkg.b imports pkg.c at pkg/b.py:2" in text and "pkg.c imports pkg.a at pkg/c.py:1" in text


def test_relative_imports_resolve_against_the_package(tmp_path):
    package = write_package(tmp_path, {
        "pkg/__init__.py": "from .sub import x\n",
        "pkg/sub/__init__.py": "from .mod import x\nfrom . import other\n",
        "pkg/sub/mod.py": "from ..top import y\n",
        "pkg/sub/other.py": "",
        "pkg/top.py": "from .sub import mod\n",
    })
    graph = import_graph(package)
    assert graph["pkg"] == {"pkg.sub": 1}
    assert graph["pkg.sub"] == {"pkg.sub.mod": 1, "pkg.sub.other": 2}
    assert graph["pkg.sub.mod"] == {"pkg.top": 1}
    assert circles(graph) == [["pkg.sub.mod", "pkg.top", "pkg.sub.mod"]]


def test_a_package_importing_its_submodules_is_no_circle_unless_one_imports_the_package(tmp_path):
    files = {
        "pkg/__init__.py": "from pkg.sub import helper\nfrom pkg import other\n",
        "pkg/sub.py": "from pkg.other import value\n",  # a sibling, not the package
        "pkg/other.py": "value = 1\n",
    }
    assert circles(import_graph(write_package(tmp_path / "fine", files))) == []
    files["pkg/other.py"] = "from pkg import helper\n"  # a name of the package's __init__
    assert circles(import_graph(write_package(tmp_path / "circle", files))) == [["pkg", "pkg.other", "pkg"]]
