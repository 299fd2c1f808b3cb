"""No import cycles between the modules of agentloop/, trainer/ and integrations/.

The check reads the source (AST) and counts every import statement anywhere in a module: at the
top, inside functions (lazy imports), under ``if TYPE_CHECKING:`` and in ``try`` blocks. A lazy or
type-only import still says "this module needs that one"; a cycle of them means a piece sits in the
wrong file (move it down into a module both sides can import).

How an import becomes an arrow of the graph:

- ``import a.b.c`` -> ``a.b.c``; ``from a.b import c`` -> ``a.b.c`` when that is a module, else ``a.b``
  (``c`` is a name defined in ``a/b/__init__.py``); relative imports resolve against the importing
  module's package first (``from . import x``, ``from ..store import sqlite``).
- Importing ``a.b.c`` also runs ``a/__init__.py`` and ``a/b/__init__.py``, but that implied arrow
  is *not* drawn: otherwise every package whose ``__init__`` re-exports its submodules would be one
  big cycle, and re-exports through ``__init__`` are the public API (``from agentloop import Runner``).
- The one rule about packages therefore reads: a module may name its own package (``from agentloop
  import X``, ``from . import X`` where X is not a module) only when that ``__init__`` does not import
  it back, directly or through other modules. That *is* a cycle here, and the fix is to import X from
  the module that defines it.
- A module importing itself (``python -m agentloop.cli``'s ``__main__`` block) is not a cycle.

Anything outside the three packages (the standard library, torch, ...) is not part of the graph.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("agentloop", "trainer", "integrations")


def module_name(relative: Path) -> str:
    """``agentloop/store/__init__.py`` -> ``agentloop.store``; ``trainer/model/actor.py`` -> ``trainer.model.actor``."""
    parts = list(relative.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def find_modules(root: Path = ROOT) -> dict[str, str]:
    """Every module of the three packages: dotted name -> source."""
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            found[module_name(path.relative_to(root))] = path.read_text()
    return found


def imports_of(name: str, source: str, modules: Iterable[str], is_package: bool = False) -> set[str]:
    """The modules of ``modules`` that the module ``name`` imports anywhere in ``source``."""
    known = set(modules)
    package = name if is_package else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(source, filename=name)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # from . import x (level 1: this package), from ..y import z (level 2: its parent)
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in known:  # import a.b.c where only a.b is ours: the nearest module
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def build_graph(modules: Mapping[str, str], packages: Iterable[str] = ()) -> dict[str, set[str]]:
    """Module -> the modules it imports; ``packages`` names the modules that are ``__init__.py`` files."""
    is_package = set(packages)
    return {name: imports_of(name, source, modules, name in is_package) for name, source in modules.items()}


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterable[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found)


def describe(component: list[str], graph: Mapping[str, set[str]]) -> str:
    """One cycle of the component as ``a -> b -> a``, then every arrow inside it."""
    members = set(component)
    path = [component[0]]
    seen = {component[0]}
    while True:  # walk arrows inside the component until a module repeats: that closes a cycle
        step = sorted(graph[path[-1]] & members)[0]
        if step in seen:
            loop = [*path[path.index(step) :], step]
            break
        path.append(step)
        seen.add(step)
    arrows = ", ".join(f"{a} -> {b}" for a in component for b in sorted(graph[a] & members))
    return f"{' -> '.join(loop)} (all arrows: {arrows})"


def _project_graph() -> dict[str, set[str]]:
    modules = find_modules()
    packages = [
        module_name(p.relative_to(ROOT))
        for package in PACKAGES
        for p in (ROOT / package).rglob("__init__.py")
    ]
    return build_graph(modules, packages)


def test_no_import_cycles() -> None:
    graph = _project_graph()
    assert len(graph) > 100, f"expected the three packages under {ROOT}, found {len(graph)} modules"
    found = cycles(graph)
    assert not found, (
        f"{len(found)} import cycle(s) (lazy and TYPE_CHECKING imports count; move the shared piece into a "
        "module both sides can import):\n" + "\n".join(describe(c, graph) for c in found)
    )


def test_version_comes_from_a_leaf() -> None:
    """``agentloop/__init__`` gets ``__version__`` from ``_version.py``, which imports nothing of ours."""
    graph = _project_graph()
    assert "agentloop._version" in graph["agentloop"]
    assert graph["agentloop._version"] == set()


_FAKE = {
    "p": "from p.b import B\n",
    "p.a": "def f():\n    from p import B\n",  # names the package whose __init__ imports p.b -> p.a
    "p.b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import f\n",
    "p.c": "import p.d.x\nfrom . import d\n",
    "p.d": "",
    "p.d.x": "from ..c import y\n",
}


@pytest.mark.parametrize(
    ("modules", "expected"),
    [
        (_FAKE, [["p", "p.a", "p.b"], ["p.c", "p.d.x"]]),
        ({"p": "", "p.a": "from p import b\n", "p.b": "import os\nimport p.a.z\n"}, [["p.a", "p.b"]]),
        ({"p": "from p.a import f\n", "p.a": "import p.b\n", "p.b": "import torch\n"}, []),
        ({"p": "", "p.a": "if __name__ == '__main__':\n    from p.a import main\n"}, []),
    ],
)
def test_the_check_itself(modules: dict[str, str], expected: list[list[str]]) -> None:
    graph = build_graph(modules, packages=[n for n in modules if n in {"p", "p.d"}])
    assert cycles(graph) == expected, graph
