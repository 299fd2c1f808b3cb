"""The public names of DESIGN.md are a contract: each one must resolve and be in __all__."""

from __future__ import annotations

import subprocess
import sys

import agentloop as al

# The names DESIGN.md's "Public API" section gives (a copy: CI has no ../shared).
DESIGN_NAMES = [
    "rollout", "LLM", "ProxyLLM", "Agent", "emit_reward", "Triplet", "RolloutConfig",
    "MemoryStore", "SQLiteStore", "StoreServer", "StoreClient", "Runner", "load_engine", "Proxy",
    "openai_client", "async_openai_client", "function_tool", "BaseTool", "ToolResponse", "ToolAgent",
]  # fmt: skip


def test_design_names_are_exported() -> None:
    missing = [n for n in DESIGN_NAMES if n not in al.__all__]
    assert missing == []


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


def test_cli_version_and_help() -> None:
    out = subprocess.run([sys.executable, "-m", "agentloop.cli", "version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == f"agentloop {al.__version__}"
    out = subprocess.run([sys.executable, "-m", "agentloop.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "usage: agentloop" in out.stdout
