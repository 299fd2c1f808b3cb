"""The public API is a contract (docs/architecture.md, "Public API"): the design's names are exported,
``__all__`` and that page's list hold the same names (both ways), every name resolves and is typed for
IDEs/mypy, and the whole error tree is exported."""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

import agentloop as al
from agentloop import errors

ROOT = Path(__file__).resolve().parents[1]

# The names the design gives its public API (docs/architecture.md; tests outside the repository use them).
DESIGN_NAMES = [
    "rollout", "LLM", "ProxyLLM", "Agent", "emit_reward", "Triplet", "RolloutConfig",
    "MemoryStore", "SQLiteStore", "StoreServer", "StoreClient", "Runner", "load_engine", "Proxy",
    "openai_client", "async_openai_client", "function_tool", "BaseTool", "ToolResponse", "ToolAgent",
]  # fmt: skip


def test_design_names_are_exported() -> None:
    missing = [n for n in DESIGN_NAMES if n not in al.__all__]
    assert missing == []


ARCHITECTURE = ROOT / "docs" / "architecture.md"


def _documented_names() -> set[str]:
    """The names docs/architecture.md's "Public API" section lists (written as `al.NAME`)."""
    text = ARCHITECTURE.read_text()
    _, found, rest = text.partition("## Public API\n")
    assert found, "docs/architecture.md lost its '## Public API' section"
    section = re.split(r"^#", rest, maxsplit=1, flags=re.M)[0]
    return set(re.findall(r"`al\.(\w+)", section))


def test_the_architecture_page_lists_exactly_the_exported_names() -> None:
    documented, exported = _documented_names(), set(al.__all__)
    assert sorted(documented - exported) == [], "in docs/architecture.md's Public API but not in __all__"
    assert sorted(exported - documented) == [], "in agentloop.__all__ but not in the Public API of the page"
    assert len(al.__all__) == len(exported), "a name is in __all__ twice"


def test_every_name_is_typed_for_type_checkers() -> None:
    """Lazy names are imported under TYPE_CHECKING from the module __getattr__ loads them from; the
    error tree is imported as it is."""
    tree = ast.parse((ROOT / "agentloop" / "__init__.py").read_text())
    typed: dict[str, str] = {}
    for node in tree.body:
        body = node.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING" else [node]
        for stmt in body:
            if isinstance(stmt, ast.ImportFrom) and stmt.module and stmt.module.startswith("agentloop"):
                typed.update({alias.asname or alias.name: stmt.module for alias in stmt.names})
    assert sorted(set(al.__all__) - {"__version__"} - set(typed)) == [], "exported but not typed"
    assert sorted(set(typed) - set(al.__all__)) == [], "typed but not exported"
    lazy = al._LAZY  # type: ignore[attr-defined]
    assert {n: m for n, m in typed.items() if n in lazy} == lazy, "TYPE_CHECKING imports and _LAZY differ"
    assert sorted(set(lazy) | set(errors.__all__) | {"__version__"}) == sorted(al.__all__)


def test_the_whole_error_tree_is_exported() -> None:
    tree = {
        name
        for name, obj in inspect.getmembers(errors, inspect.isclass)
        if issubclass(obj, errors.AgentLoopError) and obj.__module__ == errors.__name__
    }
    assert sorted(errors.__all__) == sorted(tree)
    for name in tree:
        assert getattr(al, name) is getattr(errors, name) and name in al.__all__
        assert name in (errors.__doc__ or ""), f"{name} is not drawn in agentloop/errors.py's tree"


def test_every_exported_name_resolves() -> None:
    unresolved = []
    for name in al.__all__:
        try:
            getattr(al, name)
        except (AttributeError, ImportError) as exc:
            unresolved.append(f"{name}: {exc}")
    assert unresolved == []


def test_unknown_name_raises_attribute_error() -> None:
    try:
        al.NoSuchThing  # noqa: B018
    except AttributeError as exc:
        assert "NoSuchThing" in str(exc)
    else:
        raise AssertionError("expected AttributeError")


@pytest.mark.e2e
def test_cli_version_and_help() -> None:
    out = subprocess.run([sys.executable, "-m", "agentloop.cli", "version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == f"agentloop {al.__version__}"
    out = subprocess.run([sys.executable, "-m", "agentloop.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "usage: agentloop" in out.stdout
