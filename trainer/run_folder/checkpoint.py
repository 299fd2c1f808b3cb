"""Checkpoints that a crash cannot tear, the data cursor they record, the run folder's identity, and
the trained model as a Hugging Face folder.

A run folder (``trainer.default_local_dir``, default ``runs/<project>/<experiment>``)::

    run.json                        this run: its identity (config + data), status, step, outputs
    config.json  metrics.jsonl  store.db  log.txt (every event, Ray workers' output, warnings)
    report.md  curves.png  summary.json   written when the run finishes (trainer/run_folder/report.py)
    checkpoints/global_step_4/model.safetensors    the policy's weights (LoRA: base + adapter, peft names)
    checkpoints/global_step_4/optimizer.pt         optimizer state, actor step, LoRA rank
    checkpoints/global_step_4/trainer_state.json   step, data cursor (epoch, position, seed)
    checkpoints/latest              the step of the last *complete* checkpoint
    final_model/                    the trained weights: safetensors + config + tokenizer + chat template
    final_adapter/                  LoRA runs: the peft adapter (final_model/ holds it merged)

``latest`` is replaced atomically after the step's files are on disk, so a process killed while saving
leaves the previous checkpoint as the latest one. "On disk" means fsynced: every file of the step
folder and the folder itself are fsynced before ``latest`` names the step, and the folder holding
``latest`` after its rename, so a power loss cannot leave ``latest`` pointing at weights the disk never
got (``commit``; the writers fsync their own files too). Checkpoints of older versions (one ``actor.pt``)
still load.

One run, one folder (``plan_run``): a new run never appends to another run's files. With
``trainer.resume=auto`` a folder whose run has this config and data is continued from its latest
checkpoint, or, when it finished, returned as it is; any other run's folder is left alone and the run
goes to the first free sibling (``<name>-2``, ``<name>-3``, ...), or, as ``trainer.on_config_change``
says, stops naming the keys that differ or continues that run with them (trainer/run_folder/changes.py). The log
says which.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from agentloop.errors import ConfigError
from agentloop.private_files import private_dir, tighten_tree
from trainer.run_folder.changes import Change, changes, describe

WEIGHTS_FILE = "model.safetensors"  # in a checkpoint step folder
CRITIC_DIR = "critic"  # a step folder's value model (PPO with gae): its weights and optimizer
OPTIMIZER_FILE = "optimizer.pt"
LEGACY_FILE = "actor.pt"  # model + optimizer in one torch.save (checkpoints before issue 15)
RUN_FILE = "run.json"
FINAL_MODEL = "final_model"
FINAL_ADAPTER = "final_adapter"


class DataCursor:
    """Walks a dataset in batches, reshuffled each epoch from (seed, epoch); its state is two ints."""

    def __init__(self, size: int, batch_size: int, seed: int) -> None:
        if batch_size < 1 or size < batch_size:
            raise ValueError(f"a dataset of {size} tasks cannot fill a batch of {batch_size}")
        self.size, self.batch_size, self.seed = size, batch_size, seed
        self.epoch, self.position = 0, 0

    @property
    def batches_per_epoch(self) -> int:
        return self.size // self.batch_size  # the incomplete tail batch of an epoch is skipped

    def _order(self) -> list[int]:
        order = list(range(self.size))
        random.Random(self.seed * 100_003 + self.epoch).shuffle(order)
        return order

    def next_batch(self, data: list[Any]) -> list[tuple[int, Any]]:
        """The next ``batch_size`` (index, task) pairs, moving to the next epoch when this one is used up."""
        if self.position + self.batch_size > self.size:
            self.epoch, self.position = self.epoch + 1, 0
        order = self._order()[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return [(i, data[i]) for i in order]

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state(self, state: dict[str, int]) -> None:
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(f"checkpoint was written with seed {state['seed']}, this run uses {self.seed}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


class CheckpointManager:
    """Creates step folders and publishes the latest complete one."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def begin(self, step: int) -> Path:
        path = self.root / f"global_step_{step}"
        path.mkdir(parents=True, exist_ok=True, mode=0o700)  # the run's owner only (write_run)
        return path

    def commit(self, step: int, state: dict[str, Any]) -> None:
        """Publish step ``step``: its files (whoever wrote them) and folder fsynced, then its
        trainer_state.json, then ``latest`` (each written atomically and fsynced with its folder)."""
        path = self.root / f"global_step_{step}"
        tighten_tree(path)  # the workers' files: the run's owner only
        fsync_tree(path)
        fsync_dir(self.root)  # the step folder's own entry
        _atomic_write(path / "trainer_state.json", json.dumps(state))
        _atomic_write(self.root / "latest", str(step))

    def latest(self) -> tuple[Path, dict[str, Any]] | None:
        marker = self.root / "latest"
        if not marker.exists():
            return None
        return self.load_path(self.root / f"global_step_{int(marker.read_text().strip())}")

    def load_path(self, path: Path) -> tuple[Path, dict[str, Any]]:
        state_file = path / "trainer_state.json"
        weights = (path / WEIGHTS_FILE).exists() and (path / OPTIMIZER_FILE).exists()
        if not state_file.exists() or not (weights or (path / LEGACY_FILE).exists()):
            raise FileNotFoundError(
                f"{path} is not a complete checkpoint (needs {WEIGHTS_FILE}, {OPTIMIZER_FILE} and "
                "trainer_state.json)"
            )
        return path, json.loads(state_file.read_text())


# ---------------------------------------------------------------- the policy's files


def save_policy(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, lora_rank: int, path: Path
) -> None:
    """A checkpoint's weights (safetensors; tied tensors stored once) and optimizer state."""
    from safetensors.torch import save_model

    save_model(model, str(path / WEIGHTS_FILE))
    torch.save(
        {"optimizer": optimizer.state_dict(), "step": step, "lora_rank": lora_rank}, path / OPTIMIZER_FILE
    )
    for name in (WEIGHTS_FILE, OPTIMIZER_FILE):  # on disk before the trainer publishes the step
        fsync_file(path / name)


def untied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` detached and contiguous, each tensor that shares storage with an earlier one copied
    (tied weights: safetensors wants each tensor in storage of its own)."""
    seen: set[int] = set()
    out = {}
    for name, tensor in state.items():
        ptr = tensor.untyped_storage().data_ptr()
        out[name] = tensor.detach().clone().contiguous() if ptr in seen else tensor.detach().contiguous()
        seen.add(ptr)
    return out


def save_policy_state(
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any],
    step: int,
    lora_rank: int,
    path: Path,
) -> None:
    """``save_policy``'s files from full state dicts (data-parallel ranks gather them to rank 0)."""
    from safetensors.torch import save_file

    save_file(untied(model_state), str(path / WEIGHTS_FILE))
    torch.save({"optimizer": optimizer_state, "step": step, "lora_rank": lora_rank}, path / OPTIMIZER_FILE)
    for name in (WEIGHTS_FILE, OPTIMIZER_FILE):
        fsync_file(path / name)


def read_policy_state(path: Path) -> dict[str, Any]:
    """A checkpoint as full state dicts on the CPU: ``{"model", "optimizer", "step"}`` (older ``actor.pt``
    checkpoints too), for ``ShardedActor.load_state``."""
    if not (path / WEIGHTS_FILE).exists():
        legacy: dict[str, Any] = torch.load(path / LEGACY_FILE, map_location="cpu", weights_only=True)
        return legacy
    from safetensors.torch import load_file

    state: dict[str, Any] = torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
    return {
        "model": load_file(str(path / WEIGHTS_FILE)),
        "optimizer": state["optimizer"],
        "step": state["step"],
    }


def read_critic_state(path: Path) -> dict[str, Any]:
    """The critic of a checkpoint's step folder as full state dicts (``critic/``); a clear error when the
    checkpoint was written by a run without one."""
    if not (path / CRITIC_DIR / WEIGHTS_FILE).exists():
        raise ValueError(
            f"the checkpoint {path} has no critic (it was written by a run without a value model); "
            "resume with the same algorithm.adv_estimator, or start afresh with trainer.resume=disable"
        )
    return read_policy_state(path / CRITIC_DIR)


def load_policy_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, lora_rank: int, path: Path, device: torch.device
) -> int | dict[str, Any]:
    """Load a checkpoint written by ``save_policy`` into ``model`` and ``optimizer``; returns the actor
    step. An older checkpoint (``actor.pt``) is returned as its state dict for ``Actor.load_state``."""
    if not (path / WEIGHTS_FILE).exists():
        legacy: dict[str, Any] = torch.load(path / LEGACY_FILE, map_location=device, weights_only=True)
        return legacy
    from safetensors.torch import load_model

    state = torch.load(path / OPTIMIZER_FILE, map_location=device, weights_only=True)
    saved = int(state.get("lora_rank", 0))
    if saved != lora_rank:
        raise ValueError(
            f"the checkpoint was written with actor_rollout_ref.model.lora_rank={saved}, this run has "
            f"{lora_rank}; resume with the same lora_rank, or start afresh with trainer.resume=disable"
        )
    load_model(model, str(path / WEIGHTS_FILE), device=str(device))
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])


def export_hf_model(weights: dict[str, torch.Tensor], model_path: str | Path, out_dir: Path) -> Path:
    """Write ``weights`` (the base model's names, LoRA merged) as a Hugging Face folder that
    ``AutoModelForCausalLM.from_pretrained`` and ``agentloop serve --model`` load: safetensors, the
    config and generation config of ``model_path``, its tokenizer and chat template."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    config = AutoConfig.from_pretrained(str(model_path))
    dtype = next(iter(weights.values())).dtype
    with torch.device("meta"):  # a skeleton without memory; the trained tensors are assigned into it
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    result = model.load_state_dict(weights, strict=False, assign=True)
    if result.missing_keys:
        raise ValueError(f"the trained weights lack {result.missing_keys[:5]} of the model in {model_path}")
    model.tie_weights()
    model.save_pretrained(str(tmp), safe_serialization=True)
    AutoTokenizer.from_pretrained(str(model_path)).save_pretrained(str(tmp))  # + chat_template.jinja
    if (Path(model_path) / "generation_config.json").exists():
        shutil.copy(Path(model_path) / "generation_config.json", tmp / "generation_config.json")
    fsync_tree(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)  # a crash leaves the old folder or none, never half of one
    fsync_dir(out_dir.parent)
    return out_dir


# ---------------------------------------------------------------- one run, one folder

_NOT_IDENTITY = {  # keys that do not change what a run computes: a re-run may differ in them
    "trainer": {"resume", "logger", "default_local_dir", "save_freq", "test_freq", "val_before_train"}
    | {"ray_address", "timeouts", "max_steps_without_signal", "save_last", "on_config_change"},
    "placement": None,  # None: the whole section
}


def identity_view(config: dict[str, Any]) -> dict[str, Any]:
    """The part of a config (``model_dump(mode="json")``) that makes a run's identity."""
    kept = {k: v for k, v in config.items() if k not in _NOT_IDENTITY or _NOT_IDENTITY[k] is not None}
    for section, keys in _NOT_IDENTITY.items():
        if keys is not None and isinstance(kept.get(section), dict):
            kept[section] = {k: v for k, v in kept[section].items() if k not in keys}
    rollout = kept.get("actor_rollout_ref", {}).get("rollout", {})
    if isinstance(rollout, dict):
        rollout = {k: v for k, v in rollout.items() if k != "concurrency"}
        kept["actor_rollout_ref"] = {**kept["actor_rollout_ref"], "rollout": rollout}
    return kept


def run_identity(config: dict[str, Any], *datasets: Any) -> str:
    """A digest of what a run computes: its config (less logging, placement and checkpoint cadence)
    and its data. Two runs with one identity produce the same model."""
    text = json.dumps([identity_view(config), list(datasets)], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass
class RunPlan:
    """Where a run writes and what it does there."""

    run_dir: Path
    action: Literal["new", "resume", "finished"]
    checkpoint: tuple[Path, dict[str, Any]] | None = None  # resume: the step folder and its state
    note: str = ""  # why this folder (for the log)
    record: dict[str, Any] | None = None  # finished, or resumed with changes: the run's run.json
    changed_from: Path | None = None  # the folder whose run differs from this one (None: none did)
    changes: list[Change] = field(default_factory=list)  # what differs from changed_from's run

    @property
    def step(self) -> int:
        return int(self.checkpoint[1]["step"]) if self.checkpoint else 0


def read_run(run_dir: Path) -> dict[str, Any] | None:
    try:
        record: dict[str, Any] = json.loads((run_dir / RUN_FILE).read_text())
        return record
    except (OSError, ValueError):
        return None


def write_run(run_dir: Path, record: dict[str, Any]) -> None:
    """Write run.json; the run folder and everything in it (config, store, checkpoints, metrics, logs)
    are made its owner's only (folders 0700, files 0600: they hold the tasks and every rollout)."""
    private_dir(run_dir)
    _atomic_write(run_dir / RUN_FILE, json.dumps(record, indent=2, default=str))
    tighten_tree(run_dir)


def _holds_run(path: Path) -> bool:
    return path.exists() and (not path.is_dir() or any(path.iterdir()))


def _same_run(path: Path, identity: str, config: dict[str, Any]) -> bool:
    record = read_run(path)
    if record is not None:
        return bool(record.get("identity") == identity)
    try:  # a folder from before run.json: its config.json is all there is (its data is not known)
        old = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return run_identity(old) == run_identity(config)


# How plan_run's errors name the two ways out (the CLI passes its flags instead).
CONFIG_OPTIONS = {
    "resume": "trainer.on_config_change=resume",
    "new_folder": "trainer.on_config_change=new_folder",
}


def plan_run(
    run_dir: Path,
    resume: str,
    identity: str,
    config: dict[str, Any],
    *,
    inputs: dict[str, str] | None = None,
    on_change: str = "new_folder",
    options: dict[str, str] | None = None,
) -> RunPlan:
    """Decide the folder of a run (module docstring): resume, return a finished run, or start anew in
    ``run_dir`` or its first free sibling. When ``run_dir`` holds a run of another identity, the plan
    names what differs (``changes``; ``inputs`` are this run's ``changes.input_digests``) and
    ``on_change`` decides: ``new_folder`` (the sibling), ``error`` or ``resume`` (a ConfigError saying
    what differs and how to go on, ``options`` naming the ways, unless the run can continue)."""
    if resume not in ("auto", "disable"):  # an explicit checkpoint: continue from it, in run_dir
        found = CheckpointManager(run_dir).load_path(Path(resume))
        return RunPlan(run_dir, "resume", found, note=f"trainer.resume names {resume}")
    why = ""
    other: Path | None = None  # the first folder holding a run of another identity
    for i in range(1, 10_000):
        path = run_dir if i == 1 else run_dir.with_name(f"{run_dir.name}-{i}")
        if not _holds_run(path):
            note = f"{run_dir} {why}" if why else ""
            plan = RunPlan(path, "new", note=note)
            if other is not None:
                plan.changed_from = other
                plan.changes = _changes(other, config, inputs)
                plan.note = f"{other} holds another run ({describe(plan.changes)})"
                if on_change != "new_folder":
                    return _continue_with_changes(plan, config, on_change, options or CONFIG_OPTIONS)
            return plan
        if resume == "auto" and _same_run(path, identity, config):
            record = read_run(path)
            if record is not None and record.get("status") == "finished":
                return RunPlan(path, "finished", record=record, note="this config's run finished here")
            latest = CheckpointManager(path / "checkpoints").latest()
            if latest is not None:
                return RunPlan(path, "resume", latest, note="this config's run stopped here")
            why = why or "holds this config's run, stopped before its first checkpoint"
        elif not why:
            why = "holds another run" if resume == "auto" else "holds a run (trainer.resume=disable)"
            if resume == "auto":
                other = path
    raise FileExistsError(f"no free run folder next to {run_dir}")


def _changes(path: Path, config: dict[str, Any], inputs: dict[str, str] | None) -> list[Change]:
    try:
        old: dict[str, Any] | None = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        old = None
    record = read_run(path) or {}
    return changes(old, config, record.get("inputs"), inputs or {}, identity_view)


def _continue_with_changes(
    plan: RunPlan, config: dict[str, Any], on_change: str, options: dict[str, str]
) -> RunPlan:
    """``on_change`` error: raise, saying what differs; resume: the plan that continues the other
    folder's run from its latest checkpoint, if every change may be taken on (changes.RESUMABLE)."""
    assert plan.changed_from is not None
    other, found = plan.changed_from, plan.changes
    fresh = f"start a new run in {plan.run_dir} with {options['new_folder']}"
    if on_change != "resume":
        raise ConfigError(
            f"{other} holds a run of other settings: {describe(found)}; continue that run with these "
            f"changes with {options['resume']}, or {fresh}"
        )
    refused = (
        [c.key for c in found if not c.resumable] if found else ["(unknown: the run.json predates them)"]
    )
    if refused:
        raise ConfigError(
            f"cannot continue the run in {other} with {', '.join(refused)} changed: a continued run may "
            f"change only its steps, learning rates, logging and validation ({describe(found)}); {fresh}"
        )
    latest = CheckpointManager(other / "checkpoints").latest()
    if latest is None:
        raise ConfigError(
            f"cannot continue the run in {other}: it has no checkpoint (it ran with trainer.save_last=false "
            f"and no trainer.save_freq, or stopped before its first); {fresh}"
        )
    total = (config.get("trainer") or {}).get("total_training_steps")
    step = int(latest[1]["step"])
    if total is not None and step > total:
        raise ConfigError(
            f"cannot continue the run in {other} to trainer.total_training_steps={total}: it is at step "
            f"{step} already; ask for more steps than that, or {fresh}"
        )
    return RunPlan(
        other,
        "resume",
        latest,
        note=f"continued with changes: {describe(found)}",
        record=read_run(other),
        changed_from=other,
        changes=found,
    )


def keep_metrics_until(path: Path, step: int) -> int:
    """Drop the lines of a metrics.jsonl past ``step`` (a resumed run writes them again); returns how
    many were dropped. A torn last line goes too."""
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            dropped += 1
            continue
        if int(row.get("step", 0)) <= step:
            kept.append(line)
        else:
            dropped += 1
    _atomic_write(path, "".join(k + "\n" for k in kept))
    return dropped


def fsync_file(path: Path) -> None:
    """Flush ``path``'s data to the disk (any process's writes to it: the page cache is shared)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Flush a folder's entries (a file created or renamed in it survives a power loss)."""
    if os.name != "nt":  # Windows cannot open a folder to fsync it (NTFS journals its entries)
        fsync_file(path)


def fsync_tree(path: Path) -> None:
    """fsync every file under ``path``, then every folder, deepest first, ``path`` last."""
    folders = [path]
    for sub in sorted(path.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if sub.is_symlink():
            continue
        if sub.is_file():
            fsync_file(sub)
        elif sub.is_dir():
            folders.insert(-1, sub)
    for folder in folders:
        fsync_dir(folder)


def _atomic_write(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all: a temporary file fsynced, renamed over it, the folder fsynced."""
    tmp = path.with_name(path.name + ".tmp")
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
