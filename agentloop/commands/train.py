"""``agentloop train CONFIG.yaml``: train any agent, named by import path, with a YAML config.

The YAML file::

    agent: examples.calc_x.agent:agent      # module:attribute, an al.Agent or @al.rollout function
    train_data: data/train.jsonl            # a JSONL file of tasks, or module:attribute (list or function)
    val_data: data/val.jsonl                # optional
    trainer:                                # TrainerConfig keys (verl names)
      data: {train_batch_size: 8}
      actor_rollout_ref: {model: {path: smollm2-135m-instruct}}

``--set key=value`` overrides a TrainerConfig key (``--set actor_rollout_ref.actor.optim.lr=1e-5``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Any

import yaml

ALLOWED_KEYS = {"agent", "train_data", "val_data", "trainer"}


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("train", help="train an agent from a YAML config (agent import path + trainer keys)")
    p.add_argument("config", type=Path, help="YAML file with agent, train_data, val_data, trainer")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.set_defaults(func=run)


def import_object(path: str, what: str) -> Any:
    """``module:attribute`` (or ``module.attribute``) -> the object, with an error naming what failed."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{what} must look like 'package.module:name', got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{what}: cannot import module {module_name!r} ({exc})") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"{what}: module {module_name!r} has no attribute {attr!r}") from None


def load_tasks(spec: str, base: Path, what: str) -> list[Any]:
    """Tasks from a JSONL file (relative to the config) or from ``module:attribute``."""
    path = (base / spec) if not Path(spec).is_absolute() else Path(spec)
    if path.suffix == ".jsonl" or path.exists():
        if not path.exists():
            raise ValueError(f"{what}: file {str(path)!r} does not exist")
        rows = []
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{what}: {path}:{n} is not valid JSON ({exc.msg})") from None
        return rows
    obj = import_object(spec, what)
    data = obj() if callable(obj) else obj
    if not isinstance(data, list):
        raise ValueError(f"{what}: {spec} must be (or return) a list of tasks, got {type(data).__name__}")
    return data


def parse_config(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise ValueError(f"config file {str(path)!r} does not exist")
    doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(doc, dict):
        raise ValueError(f"{path} must hold a YAML mapping with keys {sorted(ALLOWED_KEYS)}")
    unknown = set(doc) - ALLOWED_KEYS
    if unknown:
        raise ValueError(f"{path}: unknown top-level keys {sorted(unknown)}; allowed: {sorted(ALLOWED_KEYS)}")
    for key in ("agent", "train_data"):
        if not isinstance(doc.get(key), str):
            raise ValueError(f"{path}: '{key}' is required and must be a string")
    return doc


def run(args: argparse.Namespace) -> int:
    from trainer import Trainer, TrainerConfig  # the CLI is the one place agentloop reaches the trainer

    try:
        doc = parse_config(args.config)
        base = args.config.parent
        sys.path.insert(0, str(Path.cwd()))
        agent = import_object(doc["agent"], "agent")
        train = load_tasks(doc["train_data"], base, "train_data")
        val = load_tasks(doc["val_data"], base, "val_data") if doc.get("val_data") else None
        config = TrainerConfig.from_dict(doc.get("trainer") or {}).with_overrides(args.overrides)
    except ValueError as exc:
        sys.stderr.write(f"agentloop train: {exc}\n")
        return 2
    result = Trainer(config).fit(agent, train, val)
    sys.stdout.write(f"trained {result.steps} steps; run folder: {result.run_dir}\n")
    return 0
