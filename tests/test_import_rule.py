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
        ("agentloop/cli.py", "async def main():\n    import trainer.demos.arithmetic\n", False),
        ("agentloop/commands/inspect.py", "class C:\n    def f(self):\n        import trainer\n", False),
        ("agentloop/adapter.py", "import trainers\nfrom .trainer import x\nfrom trainer_x import y\n", False),
    ],
)
def test_the_check_itself(relative: str, source: str, broken: bool) -> None:
    assert bool(violations(source, relative)) is broken, violations(source, relative)


# ---------------------------------------------------------------- trainer/'s folders, bottom to top

TRAINER = ROOT / "trainer"
# Each folder of trainer/ is one concept and imports only the folders before it in this list (and itself):
# the RL math and the config at the bottom, the loops that drive everything at the top. A new folder goes
# where its imports put it (docs/architecture.md, "trainer/ in layers").
TRAINER_LAYERS = (
    "algorithms",  # registries, advantage estimators, policy and value losses, KL, rollout correction
    "config",  # TrainerConfig and its sections (names checked against the registries)
    "batch",  # triplets -> padded Batch, splits, advantages of a batch
    "run_folder",  # checkpoints, the run's identity and what changed, metric sinks, the report
    "model",  # loading, LoRA, compile, hidden-state and head forwards, Actor, Critic
    "distributed",  # FSDP2 ranks, placement, the trainer worker, weight sync
    "fit",  # Trainer.fit: steps, validation, waiting, stopping, the result
    "online",  # training beside `agentloop serve`
    "sft",  # supervised fine-tuning
    "demos",  # `agentloop demo`
)
TRAINER_TOP_LEVEL = {"__init__.py"}  # trainer/'s own modules: only the package's public names
TRAINER_RULE = (
    "trainer/'s folders import only the folders below them (TRAINER_LAYERS in tests/test_import_rule.py), "
    "and a _private module only from its own folder; move the piece down, or make the name public in its "
    "folder"
)


def _trainer_folder(module: str) -> str | None:
    """``trainer.model.actor`` -> ``model``; ``trainer`` (the package's ``__init__``) -> None."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def trainer_layer_violations(modules: dict[str, str], packages: set[str]) -> list[str]:
    """What in ``modules`` (dotted name -> source, the modules of trainer/) breaks TRAINER_RULE."""
    from tests.test_import_cycles import imports_of

    rank = {folder: i for i, folder in enumerate(TRAINER_LAYERS)}
    out = []
    for name, source in sorted(modules.items()):
        folder = _trainer_folder(name)
        if folder is None:
            continue  # trainer/__init__.py re-exports the public names from any folder
        if folder not in rank:
            out.append(f"{name}: folder trainer/{folder}/ is not in TRAINER_LAYERS")
            continue
        for target in sorted(imports_of(name, source, modules, name in packages)):
            to = _trainer_folder(target)
            if to is None:
                out.append(
                    f"{name} imports trainer (the package): import from the module that defines the name"
                )
            elif to not in rank or rank[to] > rank[folder]:
                out.append(f"{name} imports {target}: {folder}/ is below {to}/")
            elif to != folder and target.rpartition(".")[2].startswith("_"):
                out.append(f"{name} imports {target}: a private module of {to}/")
    return out


def test_trainer_folders_import_only_downward() -> None:
    from tests.test_import_cycles import module_name

    paths = sorted(TRAINER.rglob("*.py"))
    modules = {module_name(p.relative_to(ROOT)): p.read_text() for p in paths}
    packages = {module_name(p.relative_to(ROOT)) for p in paths if p.name == "__init__.py"}
    assert len(modules) > 50, f"expected the trainer package under {TRAINER}, found {len(modules)} modules"
    found = trainer_layer_violations(modules, packages)
    assert not found, f"{TRAINER_RULE}:\n" + "\n".join(found)


def test_trainer_top_level_holds_only_the_package() -> None:
    top = {p.name for p in TRAINER.glob("*.py")}
    assert top <= TRAINER_TOP_LEVEL, (
        f"modules at trainer/'s top level: {sorted(top - TRAINER_TOP_LEVEL)}; each belongs in the folder of "
        f"its concept ({', '.join(TRAINER_LAYERS)})"
    )
    folders = {p.name for p in TRAINER.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(TRAINER_LAYERS), f"trainer/'s folders {sorted(folders)} != TRAINER_LAYERS"


@pytest.mark.parametrize(
    ("modules", "broken"),
    [
        ({"trainer.model.actor": "from trainer.batch import Batch\n"}, False),
        ({"trainer.model.actor": "from trainer.fit.trainer import Trainer\n"}, True),  # upward
        ({"trainer.model.actor": "def f():\n    import trainer.demos.tools\n"}, True),  # lazily upward
        ({"trainer.model.actor": "from trainer.config._actor import OptimConfig\n"}, True),  # private, across
        ({"trainer.model.actor": "from trainer.model._lora import wrap_lora\n"}, False),  # private, its own
        ({"trainer.model.actor": "from trainer import TrainerConfig\n"}, True),  # the package
        ({"trainer.extra.x": "import os\n"}, True),  # a folder not in the list
        ({"trainer": "from trainer.demos.tools import main\n"}, False),
    ],
)
def test_the_layer_check_itself(modules: dict[str, str], broken: bool) -> None:
    known = {
        **modules,
        **{m: "" for m in ("trainer", "trainer.batch", "trainer.fit.trainer", "trainer.demos.tools")},
        **{m: "" for m in ("trainer.config", "trainer.config._actor", "trainer.model._lora")},
    }
    known.update(modules)
    found = trainer_layer_violations(known, {"trainer", "trainer.batch", "trainer.config"})
    assert bool(found) is broken, found
