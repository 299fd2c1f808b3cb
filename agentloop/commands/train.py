"""``agentloop train JOB.yaml``: train any agent, named by import path or file, with a YAML job file.

The job file holds the agent, its tasks and the trainer's config sections, all at the top level;
every path in it is relative to the file, so ``agentloop train capitals/job.yaml`` works from anywhere::

    agent: agent.py:agent                     # file.py:name or package.module:name (an al.Agent or @al.rollout)
    train_data: data/train.jsonl              # a JSONL file of tasks, or module:name (a list or a function)
    val_data: data/val.jsonl                  # optional
    data: {train_batch_size: 8}               # TrainerConfig sections (verl keys) from here on
    actor_rollout_ref: {model: {path: smollm2-135m-instruct}}
    trainer: {total_training_steps: 20}
    reward: {judge: {rubric: "...", on_failure: skip}}   # optional: an LLM judge rewards the attempts

A run writes to ``runs/<job file's name>/`` beside the job file (``runs/<experiment_name>/`` when the
job names one; ``trainer.default_local_dir`` to choose). Run again, the job continues its run there (or
returns it, finished); when the folder's run has other settings, the command names the keys that differ
and stops: ``--resume-with-changes`` continues that run with them (steps, learning rates, logging and
validation may change), ``--fresh`` starts a new run in ``<folder>-2``. ``--more-steps N`` trains a run N
steps past where it stopped.

``reward.judge`` (``agentloop.judge.config.JudgeConfig``) makes ``fit(reward=...)``'s RewardJudge: the
served model judges unless it names a ``base_url`` and ``model``. ``--set KEY=VALUE`` overrides a key of the job file, dotted as it is nested in the file
(``--set trainer.total_training_steps=2``); a path given with ``--set`` is relative to the working
folder, as on any command line. The older form, with the whole config nested under ``trainer:``,
is still read (with a note).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from agentloop.commands.runner import load_object
from agentloop.errors import UsageError

JOB_KEYS = ("agent", "train_data", "val_data", "reward")
VERIFIERS = "verifiers:"  # agent: verifiers:SPEC, a verifiers environment (integrations/verifiers.py)
# TrainerConfig's top-level sections, named here so that `agentloop train --help` does not import torch;
# tests/commands/test_train_cmd.py checks this list against TrainerConfig.
CONFIG_SECTIONS = ("algorithm", "data", "actor_rollout_ref", "critic", "trainer", "adapter", "placement")

EPILOG = f"""\
The job file (every path in it is relative to the file):

  agent: agent.py:agent                 # file.py:name or package.module:name; verifiers:MODULE[:name] for a
                                        # verifiers environment (then train_data defaults to its tasks)
  train_data: train.jsonl               # JSONL of tasks, or module:name (a list or a function)
  val_data: val.jsonl                   # optional
  data: {{train_batch_size: 8}}           # the trainer's config sections, verl keys:
  actor_rollout_ref: {{model: {{path: smollm2-135m-instruct}}, actor: {{optim: {{lr: 1e-6}}}}}}
  trainer: {{total_training_steps: 20, save_freq: 5}}
  reward: {{judge: {{rubric: "...", base_url: null, model: null}}}}   # optional LLM judge; null URL: the served model

  Top-level keys: {", ".join(JOB_KEYS + CONFIG_SECTIONS)}.

--set KEY=VALUE overrides a job-file key, dotted as it is nested in the file; the value is YAML:
  agentloop train job.yaml --set trainer.total_training_steps=2 --set actor_rollout_ref.actor.optim.lr=1e-5

The run folder is runs/<job file's name>/ beside the job file (trainer.default_local_dir to choose).
Run again, a job continues its run there; if the folder's run has other settings, the keys that differ
are named and nothing starts: --resume-with-changes continues that run with them, --fresh starts anew.
  agentloop train job.yaml --more-steps 10      # the run, 10 steps past where it stopped
"""

# How the trainer's run-folder errors name the two ways on (trainer/run_folder/checkpoint.py plan_run).
RUN_OPTIONS = {"resume": "--resume-with-changes", "new_folder": "--fresh"}


def plural(n: int, word: str) -> str:
    """``1 step``, ``2 steps``, ``0 steps``: a count with its noun (nouns that take an s)."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "train",
        help="train an agent from a YAML job file (agent, train_data, config sections)",
        description="Train an agent with RL from a YAML job file.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", type=Path, metavar="JOB.yaml", help="the job file (see below)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a job-file key, e.g. --set trainer.total_training_steps=2 (repeatable)",
    )
    when = p.add_mutually_exclusive_group()
    when.add_argument(
        "--resume-with-changes",
        action="store_true",
        help="the run folder's run has other settings: continue it with them (steps, learning rates, logging "
        "and validation may change)",
    )
    when.add_argument(
        "--fresh",
        action="store_true",
        help="the run folder's run has other settings: start a new run in the first free <folder>-N",
    )
    when.add_argument(
        "--more-steps",
        type=int,
        metavar="N",
        help="continue the run in the run folder and train N steps past where it stopped",
    )
    p.set_defaults(func=run)


@dataclass
class Job:
    """A job file read, checked and resolved: what ``Trainer.fit`` needs."""

    agent: Any
    train: list[Any]
    val: list[Any] | None
    config: Any  # TrainerConfig (the trainer is imported only when a job is loaded)
    reward: Any = None  # the RewardJudge of reward.judge, or None: the agent's own rewards


# ---------------------------------------------------------------- reading the file


def read_job_file(path: Path) -> tuple[dict[str, Any], list[str]]:
    """The job file as a flat mapping (the nested ``trainer:`` form unfolded) and any notes."""
    if not path.is_file():
        where = "is a folder, not a file" if path.is_dir() else "does not exist"
        raise UsageError(f"job file {str(path)!r} {where} (working folder: {Path.cwd()})")
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UsageError(f"{path} is not valid YAML: {problem}{where}") from None
    if not isinstance(doc, dict):
        got = "an empty file" if doc is None else f"a {type(doc).__name__}"
        raise UsageError(f"{path} must hold a YAML mapping with keys such as agent and train_data, got {got}")
    notes: list[str] = []
    nested = doc.get("trainer")
    if isinstance(nested, dict) and set(nested) & set(CONFIG_SECTIONS):
        beside = sorted(set(doc) & set(CONFIG_SECTIONS) - {"trainer"})
        if beside:
            raise UsageError(
                f"{path}: 'trainer:' holds the whole config (the old form) while {beside} sit at the top "
                f"level; put every section ({', '.join(CONFIG_SECTIONS)}) at the top level"
            )
        stray = sorted(set(nested) - set(CONFIG_SECTIONS))
        if stray:
            raise UsageError(
                f"{path}: 'trainer:' mixes config sections with keys {stray}; put the sections at the top "
                f"level and those keys under 'trainer:'"
            )
        doc = {k: v for k, v in doc.items() if k != "trainer"} | nested
        notes.append(
            f"note: {path} nests the config under 'trainer:', which is deprecated; move "
            f"{', '.join(sorted(nested))} to the top level of the file"
        )
    unknown = [k for k in doc if k not in JOB_KEYS + CONFIG_SECTIONS]
    if unknown:
        raise UsageError(
            f"{path}: unknown top-level keys {unknown}; allowed: {', '.join(JOB_KEYS + CONFIG_SECTIONS)}"
        )
    return doc, notes


def apply_overrides(doc: dict[str, Any], items: list[str], base: Path) -> dict[str, Any]:
    """``doc`` with ``--set key=value`` items applied (values are YAML; paths relative to ``base``)."""
    out = dict(doc)
    for item in items:
        key, sep, raw = item.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            raise UsageError(
                f"--set {item!r} must look like KEY=VALUE with a dotted job-file key, "
                "e.g. --set trainer.total_training_steps=2"
            )
        if parts[0] not in JOB_KEYS + CONFIG_SECTIONS:
            raise UsageError(
                f"--set {item!r}: unknown key {parts[0]!r}; --set keys are the job file's keys, starting "
                f"with one of {', '.join(JOB_KEYS + CONFIG_SECTIONS)}"
            )
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise UsageError(f"--set {item!r}: the value is not valid YAML ({exc})") from None
        single: dict[str, Any] = {}
        node = single
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
        _merge(out, resolve_paths(single, base), item)
    return out


def _merge(into: dict[str, Any], new: dict[str, Any], item: str, where: str = "") -> None:
    for key, value in new.items():
        here = f"{where}.{key}" if where else key
        old = into.get(key)
        if isinstance(value, dict) and old is not None and not isinstance(old, dict):
            raise UsageError(f"--set {item!r}: {here!r} is a value ({old!r}), not a section")
        if isinstance(value, dict) and isinstance(old, dict):
            into[key] = dict(old)
            _merge(into[key], value, item, here)
        else:
            into[key] = value


# ---------------------------------------------------------------- paths


def _looks_like_path(value: str) -> bool:
    return value.startswith(("./", "../", "~", "/")) or value.endswith((".jsonl", ".json", ".py"))


def _resolve(value: Any, base: Path, *, always: bool) -> Any:
    """``value`` made absolute against ``base`` when it is a relative path (``always``: any string)."""
    if not isinstance(value, str) or not value.strip():
        return value
    p = Path(value).expanduser()
    if p.is_absolute():
        return str(p)
    if always or _looks_like_path(value) or (base / p).exists():
        return str((base / p).resolve())
    return value


def resolve_paths(doc: dict[str, Any], base: Path) -> dict[str, Any]:
    """A copy of ``doc`` whose paths (agent file, tasks, model folder, run folder) are relative to ``base``.

    Names that are not paths stay: ``package.module:name`` specs, model aliases and hub ids
    (``smollm2-135m-instruct``, ``Qwen/Qwen2.5-0.5B-Instruct``) unless such a folder exists next to
    the file, and ``resume: auto|disable``.
    """
    out = dict(doc)
    agent = out.get("agent")
    if isinstance(agent, str):
        prefix = VERIFIERS if agent.startswith(VERIFIERS) else ""
        file, sep, attr = agent.removeprefix(prefix).rpartition(":")
        if sep and file.endswith(".py"):
            out["agent"] = f"{prefix}{_resolve(file, base, always=True)}:{attr}"
    for key in ("train_data", "val_data"):
        spec = out.get(key)
        if isinstance(spec, str) and (_looks_like_path(spec) or "/" in spec or (base / spec).exists()):
            out[key] = _resolve(spec, base, always=True)
    section = out.get("actor_rollout_ref")
    if isinstance(section, dict) and isinstance(section.get("model"), dict) and "path" in section["model"]:
        model = section["model"]
        out["actor_rollout_ref"] = {
            **section,
            "model": {**model, "path": _resolve(model["path"], base, always=False)},
        }
    run = out.get("trainer")
    if isinstance(run, dict):
        run = dict(run)
        if run.get("default_local_dir"):
            run["default_local_dir"] = _resolve(run["default_local_dir"], base, always=True)
        if run.get("resume") not in (None, "auto", "disable"):
            run["resume"] = _resolve(run["resume"], base, always=True)
        out["trainer"] = run
    reward = out.get("reward")
    if isinstance(reward, dict) and isinstance(reward.get("judge"), dict):
        judge = dict(reward["judge"])
        spec = judge.get("task_text")
        if isinstance(spec, str) and spec.rpartition(":")[0].endswith(".py"):
            file, _, attr = spec.rpartition(":")
            judge["task_text"] = f"{_resolve(file, base, always=True)}:{attr}"
        if judge.get("cache_file"):
            judge["cache_file"] = _resolve(judge["cache_file"], base, always=True)
        out["reward"] = {**reward, "judge": judge}
    return out


# ---------------------------------------------------------------- loading


def load_tasks(spec: str, what: str, base: Path | None = None) -> list[Any]:
    """Tasks from a JSONL file (an absolute path by now) or from ``module:name``."""
    path = Path(spec)
    if path.is_absolute():
        if not path.is_file():
            raise UsageError(f"{what}: file {spec!r} does not exist")
        rows = []
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise UsageError(f"{what}: {path}:{n} is not valid JSON ({exc.msg})") from None
        if not rows:
            raise UsageError(f"{what}: {path} holds no tasks (one JSON object per line)")
        return rows
    obj = load_object(spec, what, base=base)
    data = obj() if callable(obj) else obj
    if not isinstance(data, list):
        raise UsageError(f"{what}: {spec} must be (or return) a list of tasks, got {type(data).__name__}")
    return data


def load_reward(value: Any, path: Path, base: Path) -> Any:
    """The RewardJudge the job file's ``reward`` section describes (None without a judge); a bad key
    is a UsageError naming it (``reward.judge.KEY``)."""
    from pydantic import ValidationError

    from agentloop.judge.config import RewardSection
    from trainer.config import format_validation_error

    try:
        section = RewardSection.model_validate({"reward": value}).reward
    except ValidationError as exc:
        raise UsageError(f"{path}: {format_validation_error(exc, RewardSection)}") from None
    if section is None or section.judge is None:
        return None
    task_text = None
    if section.judge.task_text is not None:
        task_text = load_object(section.judge.task_text, "reward.judge.task_text", base=base)
        if not callable(task_text):
            raise UsageError(
                f"reward.judge.task_text: {section.judge.task_text} must name a function task -> text, "
                f"got a {type(task_text).__name__}"
            )
    return section.judge.build(task_text)


def _config_hint(message: str) -> str:
    """The fix for the usual trap: a section written under ``trainer.`` (the old nesting)."""
    for section in CONFIG_SECTIONS:
        if f"unknown key 'trainer.{section}" in message:
            return (
                f"{message} (the config sections sit at the top level of the job file: write "
                f"{section}.<key>, not trainer.{section}.<key>)"
            )
    return message


def load_job(
    path: Path, overrides: list[str] | None = None, note: Callable[[str], None] | None = None
) -> Job:
    """Read, resolve and check a job file; every problem is a UsageError saying how to fix it.

    ``note`` receives one-line remarks (the deprecated nested form) as soon as they are known, so they
    print even when a later check fails.
    """
    from agentloop.errors import ConfigError, ModelResolutionError
    from trainer import TrainerConfig  # the CLI is the one place agentloop reaches the trainer

    doc, notes = read_job_file(path)
    for line in notes:
        if note is not None:
            note(line)
    doc = resolve_paths(doc, path.resolve().parent)  # before --set: paths on the command line are the cwd's
    doc = apply_overrides(doc, list(overrides or []), Path.cwd())
    run = doc.get("trainer", {}) if isinstance(doc.get("trainer", {}), dict) else None
    if run is not None and not run.get("default_local_dir"):  # the job's own folder, not the cwd's runs/
        name = run.get("experiment_name") or path.stem
        doc["trainer"] = {**run, "default_local_dir": str(path.resolve().parent / "runs" / str(name))}
    from_env = isinstance(doc.get("agent"), str) and doc["agent"].strip().startswith(VERIFIERS)
    for key in ("agent",) if from_env else ("agent", "train_data"):
        if not isinstance(doc.get(key), str) or not doc[key].strip():
            raise UsageError(f"{path}: '{key}' is required and must be a string (see agentloop train --help)")
    if doc.get("val_data") is not None and not isinstance(doc["val_data"], str):
        raise UsageError(f"{path}: 'val_data' must be a string (a JSONL file or module:name)")
    try:
        config = TrainerConfig.from_dict({k: v for k, v in doc.items() if k in CONFIG_SECTIONS})
    except ConfigError as exc:
        raise UsageError(f"{path}: {_config_hint(str(exc))}") from None
    model = config.actor_rollout_ref.model.path
    if Path(model).is_absolute():  # a folder named in the file: check it before anything starts
        from agentloop.engine.models import resolve_model

        try:
            resolve_model(model)
        except ModelResolutionError as exc:
            raise UsageError(f"actor_rollout_ref.model.path: {exc}") from None
    base = path.resolve().parent
    reward = load_reward(doc.get("reward"), path, base)
    if from_env:
        return Job(*_verifiers_job(doc, base), config=config, reward=reward)
    for key in ("train_data", "val_data"):
        if str(doc.get(key) or "").strip().startswith(VERIFIERS):
            raise UsageError(f"{path}: '{key}: {doc[key]}' takes its tasks from a verifiers environment, so "
                             f"'agent' must name one (agent: verifiers:MODULE), got {doc['agent']!r}")  # fmt: skip
    agent = load_object(doc["agent"], "agent", base=base)
    train = load_tasks(doc["train_data"], "train_data", base)
    val = load_tasks(doc["val_data"], "val_data", base) if doc.get("val_data") else None
    return Job(agent=agent, train=train, val=val, config=config, reward=reward)


def _verifiers_job(doc: dict[str, Any], base: Path) -> tuple[Any, list[Any], list[Any] | None]:
    """``agent: verifiers:SPEC`` (integrations/verifiers.py): the environment's agent and, where
    ``train_data``/``val_data`` are omitted or ``verifiers:``, the environment's own tasks."""
    try:
        from integrations.verifiers import VerifiersAgent, train_tasks, val_tasks

        agent = VerifiersAgent(doc["agent"], base=base)
    except (ImportError, ValueError) as exc:  # ImportObjectError is an ImportError, ConfigError a ValueError
        raise UsageError(f"agent: {doc['agent']}: {exc}") from None
    tasks: dict[str, list[Any] | None] = {}
    for key, own in (("train_data", train_tasks), ("val_data", val_tasks)):
        spec = doc.get(key)
        if spec is None or str(spec).strip() == VERIFIERS:
            tasks[key] = own(agent.env)
        else:
            tasks[key] = load_tasks(spec, key, base)
    if not tasks["train_data"]:
        raise UsageError(f"agent: {doc['agent']}: the environment's taskset holds no tasks")
    return agent, tasks["train_data"] or [], tasks["val_data"]


def run(args: argparse.Namespace) -> int:
    from trainer import Trainer
    from trainer.run_folder.changes import describe

    def note(line: str) -> None:
        sys.stderr.write(f"agentloop train: {line}\n")

    job = load_job(args.config, args.overrides, note=note)
    trainer = Trainer(_on_config_change(job.config, args))
    plan = _plan(trainer, job)
    if plan.action == "resume" and plan.changes:
        note(f"continuing the run in {plan.run_dir} from step {plan.step} with {describe(plan.changes)}")
    result = trainer.fit(job.agent, job.train, job.val, reward=job.reward)
    sys.stdout.write(
        f"trained {plural(result.steps, 'step')}; run folder: {result.run_dir} "
        "(report.md, curves.png, metrics.jsonl, log.txt, final_model/)\n"
    )
    return 0


def _on_config_change(config: Any, args: argparse.Namespace) -> Any:
    """``config`` with what the run does when its folder holds a run of other settings: as the flags
    say; by default stop and name the keys (unless the job file sets trainer.on_config_change)."""
    from trainer.run_folder.checkpoint import read_run

    if args.more_steps is not None:
        if args.more_steps < 1:
            raise UsageError(f"--more-steps must be at least 1, got {args.more_steps}")
        run_dir = config.trainer.run_dir
        record = read_run(run_dir)
        if record is None:
            raise UsageError(
                f"--more-steps: {run_dir} holds no run to continue; train it first: agentloop train {args.config}"
            )
        config.trainer.total_training_steps = int(record.get("step", 0)) + args.more_steps
    if args.resume_with_changes or args.more_steps is not None:
        config.trainer.on_config_change = "resume"
    elif args.fresh:
        config.trainer.on_config_change = "new_folder"
    elif "on_config_change" not in config.trainer.model_fields_set:
        config.trainer.on_config_change = "error"
    return config


def _plan(trainer: Any, job: Job) -> Any:
    """The run's plan before anything loads: a run folder that stops the run is a one-line error."""
    from agentloop.errors import ConfigError

    try:
        return trainer.plan(job.train, job.val, reward=job.reward, options=RUN_OPTIONS)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
