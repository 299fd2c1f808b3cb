"""The import rule (docs/architecture.md, "Who imports whom": nothing in agentloop/ imports trainer/): the
SDK stays installable and importable without the trainer. The one exception is the CLI that runs
training: ``agentloop/cli.py`` and ``agentloop/commands/*.py`` may import ``trainer`` inside a function
(lazily, when the command runs).

The check reads the source (AST), so it also sees imports on paths no test happens to run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "agentloop"
RULE = (
    "nothing in agentloop/ imports trainer/, except inside a function of agentloop/cli.py or "
    "agentloop/commands/*.py (the CLI that runs training); move the code into agentloop/ or import "
    "lazily in the command"
)


def _lazy_allowed(relative: str) -> bool:
    parts = Path(relative).parts
    return relative == "agentloop/cli.py" or (len(parts) == 3 and parts[:2] == ("agentloop", "commands"))


def _trainer_imports(tree: ast.AST) -> list[tuple[int, bool, str]]:
    """(line, inside a function, module) of each import of ``trainer`` or ``trainer.*``."""
    found: list[tuple[int, bool, str]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.Import | ast.ImportFrom):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                names = [node.module] if node.level == 0 and node.module else []
            for name in names:
                if name == "trainer" or name.startswith("trainer."):
                    found.append((node.lineno, in_function, name))
        inner = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, False)
    return found


def violations(source: str, relative: str) -> list[str]:
    """What in ``source`` (the module at ``relative``, e.g. ``agentloop/cli.py``) breaks the rule."""
    out = []
    for line, in_function, name in _trainer_imports(ast.parse(source, filename=relative)):
        if not in_function:
            out.append(f"{relative}:{line}: imports {name} at module level")
        elif not _lazy_allowed(relative):
            out.append(f"{relative}:{line}: imports {name} (only the CLI commands may, lazily)")
    return out


def test_agentloop_imports_trainer_only_lazily_in_the_cli() -> None:
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 20, f"expected the agentloop package under {PACKAGE}, found {len(modules)} modules"
    found = [v for path in modules for v in violations(path.read_text(), path.relative_to(ROOT).as_posix())]
    assert not found, f"{RULE}:\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("relative", "source", "broken"),
    [
        ("agentloop/adapter.py", "from trainer.batch import build_batch\n", True),
        ("agentloop/adapter.py", "import trainer\n", True),
        ("agentloop/adapter.py", "import trainer.batch as b\n", True),
        (
            "agentloop/adapter.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import trainer\n",
            True,
        ),
        ("agentloop/adapter.py", "def f():\n    from trainer import Trainer\n", True),
        ("agentloop/adapter.py", "class C:\n    import trainer\n", True),
        ("agentloop/commands/train.py", "from trainer import Trainer\n", True),
        ("agentloop/cli.py", "try:\n    import trainer\nexcept ImportError:\n    pass\n", True),
        ("agentloop/commands/train.py", "def run():\n    from trainer import Trainer\n", False),
        ("agentloop/cli.py", "async def main():\n    import trainer.demo\n", False),
        ("agentloop/commands/inspect.py", "class C:\n    def f(self):\n        import trainer\n", False),
        ("agentloop/adapter.py", "import trainers\nfrom .trainer import x\nfrom trainer_x import y\n", False),
    ],
)
def test_the_check_itself(relative: str, source: str, broken: bool) -> None:
    assert bool(violations(source, relative)) is broken, violations(source, relative)
