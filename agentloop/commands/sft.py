"""``agentloop sft STORE --config X.yaml``: supervised fine-tuning on a store's good rollouts (warm-start).

``STORE`` is a training run folder (its ``store.db``), a store file, or a folder holding one. The
config file holds the trainer's config sections (verl keys, as for ``agentloop train``) and an optional
``sft:`` section; an ``agentloop train`` job file works as it is (its agent and data keys are not
used). Paths in the file are relative to the file. The flags override the ``sft:`` section::

    agentloop sft runs/calc_x --config sft.yaml --min-reward 1.0
    agentloop train job.yaml --set actor_rollout_ref.model.path=runs/agentloop/sft/final_model
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from agentloop.commands.train import CONFIG_SECTIONS, JOB_KEYS, apply_overrides, plural, resolve_paths
from agentloop.errors import UsageError

EPILOG = """\
The config file (paths relative to it; every key optional):

  actor_rollout_ref: {model: {path: smollm2-135m-instruct}, actor: {optim: {lr: 1e-5}}}
  data: {train_batch_size: 8, max_prompt_length: 1024, max_response_length: 1024}
  trainer: {total_epochs: 3, save_freq: 10, test_freq: 5, default_local_dir: runs/sft}
  sft: {min_reward: 1.0, modes: [train], include_failed: false, val_fraction: 0.1}

data.train_batch_size counts attempts per optimizer step; the run folder gets metrics.jsonl,
loss_curve.png, checkpoints/ (resumed by running the same command again) and final_model/, the
model to start RL from: actor_rollout_ref.model.path=<run folder>/final_model.
"""


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "sft",
        help="supervised fine-tuning on a store's good rollouts (only model tokens), to warm-start RL",
        description="Fine-tune the model on the recorded token ids of chosen rollouts (reward >= a threshold).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("store", type=Path, metavar="STORE", help="a run folder (store.db) or a store file")
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="X.yaml",
        help="trainer config sections and sft: (see below)",
    )
    p.add_argument(
        "--min-reward",
        type=float,
        default=None,
        help="train on attempts whose total reward is at least this (default: sft.min_reward, 1.0)",
    )
    p.add_argument("--any-reward", action="store_true", help="no reward threshold (sft.min_reward: null)")
    p.add_argument(
        "--mode",
        choices=("train", "val", "any"),
        default=None,
        help="rollouts of this mode (default: sft.modes, train)",
    )
    p.add_argument(
        "--include-failed",
        action="store_true",
        default=None,
        help="also attempts that did not succeed whose reward passes (default: succeeded only)",
    )
    p.add_argument("--val-fraction", type=float, default=None, help="share of tasks held out (default 0.1)")
    p.add_argument("--run-dir", type=Path, default=None, help="the run folder (trainer.default_local_dir)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set trainer.total_epochs=3 or --set sft.val_fraction=0 (repeatable)",
    )
    p.set_defaults(func=run)


def read_config(path: Path | None) -> dict[str, Any]:
    """The config file's sections (job keys dropped), paths made relative to the file."""
    if path is None:
        return {}
    if not path.is_file():
        where = "is a folder, not a file" if path.is_dir() else "does not exist"
        raise UsageError(f"config file {str(path)!r} {where} (working folder: {Path.cwd()})")
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise UsageError(f"{path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise UsageError(f"{path} must hold a YAML mapping of config sections, got a {type(doc).__name__}")
    allowed = (*CONFIG_SECTIONS, "sft")
    unknown = [k for k in doc if k not in allowed and k not in JOB_KEYS]
    if unknown:
        raise UsageError(f"{path}: unknown top-level keys {unknown}; allowed: {', '.join(allowed)}")
    doc = {k: v for k, v in doc.items() if k in allowed}
    return resolve_paths(doc, path.resolve().parent)


def build_configs(args: argparse.Namespace) -> tuple[Any, Any]:
    """TrainerConfig and SFTConfig from the file, ``--set`` and the flags; a UsageError names a bad key."""
    from agentloop.errors import ConfigError
    from trainer.sft import load_configs  # the CLI is the one place agentloop reaches the trainer

    doc = read_config(args.config)
    sft: dict[str, Any] = dict(doc.pop("sft", None) or {})
    rest: list[str] = []
    for item in args.overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--set {item!r} must look like KEY=VALUE, e.g. --set trainer.total_epochs=3")
        if key.strip().startswith("sft."):
            try:
                sft[key.strip().removeprefix("sft.")] = yaml.safe_load(raw)
            except yaml.YAMLError as exc:
                raise UsageError(f"--set {item!r}: the value is not valid YAML ({exc})") from None
        else:
            rest.append(item)
    if args.any_reward and args.min_reward is not None:
        raise UsageError("--any-reward and --min-reward exclude each other; give one")
    if args.any_reward:
        sft["min_reward"] = None
    elif args.min_reward is not None:
        sft["min_reward"] = args.min_reward
    if args.mode is not None:
        sft["modes"] = ["train", "val"] if args.mode == "any" else [args.mode]
    if args.include_failed:
        sft["include_failed"] = True
    if args.val_fraction is not None:
        sft["val_fraction"] = args.val_fraction
    doc = apply_overrides(doc, rest, Path.cwd())  # paths given with --set are the working folder's
    try:
        cfg, sft_cfg = load_configs(doc, sft)
        if args.run_dir is not None:
            cfg.trainer.default_local_dir = str(args.run_dir.resolve())
    except ConfigError as exc:
        where = f"{args.config}: " if args.config is not None else ""
        raise UsageError(f"{where}{exc}") from None
    return cfg, sft_cfg


def run(args: argparse.Namespace) -> int:
    import anyio

    from agentloop.commands.inspect_store import InspectError, ReadOnlyStore, locate
    from agentloop.errors import ConfigError, EmptyBatchError, ModelResolutionError
    from trainer.sft import run_sft

    try:
        db = locate(args.store)
        anyio.run(ReadOnlyStore(db).close)  # a file that is not an agentloop store: said here
    except InspectError as exc:
        raise UsageError(str(exc)) from None
    cfg, sft_cfg = build_configs(args)
    try:
        result = run_sft(db, cfg, sft_cfg)
    except (EmptyBatchError, ConfigError, ModelResolutionError, FileNotFoundError) as exc:
        raise UsageError(f"{db}: {exc}") from None
    sys.stdout.write(
        f"trained {plural(result.steps, 'step')} on {plural(result.train_attempts, 'attempt')} "
        f"({result.val_attempts} held out)"
        + (f"; val NLL {result.metrics['val/nll']:.4f}" if "val/nll" in result.metrics else "")
        + f"\nrun folder: {result.run_dir}\nmodel: {result.model_dir}\n"
        f"warm-start RL from it: --set actor_rollout_ref.model.path={result.model_dir}\n"
    )
    return 0
