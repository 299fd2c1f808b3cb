"""The sections that say how the loop runs: ``data`` (batch size, length limits), ``trainer`` (steps,
logging, checkpoints, devices, deadlines), ``adapter`` (spans to samples) and ``placement`` (GPUs,
store and proxy addresses for remote runners)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from agentloop.adapter import Strategy
from agentloop.cpu_binding import CpuBinding
from agentloop.http_limits import is_loopback
from agentloop.keys import KeyRef
from trainer.config._keys import _Section

LoggerName = Literal["console", "jsonl", "tensorboard", "wandb"]


class DataConfig(_Section):
    train_batch_size: int = Field(
        default=8, ge=1, description="Prompts per training step (each gives rollout.n samples)."
    )
    max_prompt_length: int = Field(
        default=1024,
        ge=1,
        description="A call with a longer prompt is not trained; its attempt keeps its vote (counted).",
    )
    max_response_length: int = Field(
        default=1024, ge=1, description="Longer samples are truncated (kept, flagged); max_tokens per call."
    )
    max_trajectory_length: int | None = Field(
        default=None,
        ge=1,
        description="Most tokens of one merged row (adapter.trajectory); None: max_prompt + max_response.",
    )

    @model_validator(mode="after")
    def _row_fits_a_call(self) -> DataConfig:
        one_call = self.max_prompt_length + self.max_response_length
        if self.max_trajectory_length is not None and self.max_trajectory_length < one_call:
            raise ValueError(
                f"data.max_trajectory_length ({self.max_trajectory_length}) must be at least "
                f"max_prompt_length + max_response_length ({one_call}): one call must fit a row; "
                "raise it or leave it out"
            )
        return self

    @property
    def row_tokens(self) -> int:
        """The most tokens of one batch row: a merged trajectory's budget, or one call's."""
        return self.max_trajectory_length or self.max_prompt_length + self.max_response_length


class TimeoutsConfig(_Section):
    """Deadlines of the training loop's waits: none can wait forever; each ends in a
    TrainerTimeoutError that names what it waited for. Generous: they catch hangs, not slow steps."""

    rollouts_s: float = Field(
        default=1800.0, gt=0, description="A batch's rollouts may go this long without one finishing."
    )
    runner_s: float = Field(default=120.0, gt=0, description="The local runner must stop within this.")
    engine_s: float = Field(
        default=1800.0, gt=0, description="Loading the engine or the trainer worker's model, or a checkpoint."
    )
    update_s: float = Field(default=7200.0, gt=0, description="One policy update (all its mini-batches).")
    weight_sync_s: float = Field(default=1800.0, gt=0, description="New weights into the engine.")
    save_s: float = Field(default=1800.0, gt=0, description="Writing a checkpoint or the final model.")


class RunConfig(_Section):
    total_epochs: int = Field(default=1, ge=1, description="Passes over the training dataset.")
    total_training_steps: int | None = Field(
        default=None, ge=1, description="Stop after this many steps; None: epochs."
    )
    save_freq: int = Field(default=-1, ge=-1, description="Checkpoint every N steps; -1 or 0: never.")
    save_last: bool = Field(
        default=True,
        description="Checkpoint the last step too, so a finished run can go on (agentloop train --more-steps); "
        "false saves the disk (weights + AdamW state: ~1.6 GB for SmolLM2-135M).",
    )
    critic_warmup: int = Field(
        default=0, ge=0, description="Steps that train only the critic before the actor starts updating."
    )
    test_freq: int = Field(default=-1, ge=-1, description="Validate every N steps; -1 or 0: never.")
    max_steps_without_signal: int = Field(
        default=3,
        ge=1,
        description="A step with no usable attempt (no reward, agent raised, prompt too long, empty) is not "
        "counted; this many in a row stop the fit with an EmptyBatchError.",
    )
    val_before_train: bool = Field(
        default=True,
        description="Validate once before the first step (if val data); the last step always validates.",
    )
    logger: list[LoggerName] = Field(default=["console", "jsonl"], description="Metric sinks.")
    project_name: str = Field(
        default="agentloop", min_length=1, description="Groups runs (W&B project, run folder)."
    )
    experiment_name: str = Field(default="default", min_length=1, description="Names this run.")
    default_local_dir: str | None = Field(
        default=None,
        description="Run folder (checkpoints, metrics.jsonl, plots); None: runs/<project>/<experiment>.",
    )
    resume: str = Field(
        default="auto",
        min_length=1,
        description="auto: continue this config's run in the run folder (or return it if finished); "
        "disable: never; or a checkpoint path. A folder holding another run is never appended to.",
    )
    on_config_change: Literal["new_folder", "error", "resume"] = Field(
        default="new_folder",
        description="When the run folder holds a run of other settings: new_folder (the first free <folder>-N), "
        "error (stop, naming the keys that differ) or resume (continue that run if only steps, learning "
        "rates, logging or validation differ; trainer/run_folder/changes.py).",
    )
    n_gpus_per_node: int = Field(default=1, ge=1, description="GPUs the trainer uses per node.")
    nnodes: int = Field(default=1, ge=1, description="Nodes the trainer uses.")
    ray_address: str | None = Field(default=None, description="Ray cluster to join; None starts a local Ray.")
    device: str = Field(default="auto", description="auto (cuda when available), cpu, cuda or cuda:N.")
    seed: int = Field(default=0, description="Seeds data order, sampling and initialisation.")
    timeouts: TimeoutsConfig = Field(
        default_factory=TimeoutsConfig, description="Deadlines of the loop's waits (seconds)."
    )

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", v):
            raise ValueError(f"must be auto, cpu, cuda or cuda:N; got {v!r}")
        return v

    @field_validator("logger")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        return list(dict.fromkeys(v))

    @property
    def run_dir(self) -> Path:
        """Where this run writes checkpoints, metrics and plots."""
        if self.default_local_dir:
            return Path(self.default_local_dir)
        return Path("runs") / self.project_name / self.experiment_name


class AdapterConfig(_Section):
    credit_assignment: Strategy = Field(
        default="identical",
        description="identical: every call gets the final reward; per_call: its own reward.",
    )
    trajectory: bool = Field(
        default=False, description="Merge the calls of one attempt into one sample when they extend."
    )


class PlacementConfig(_Section):
    train_ranks: int | None = Field(
        default=None,
        ge=1,
        description="Data-parallel trainer ranks; None: trainer.nnodes x trainer.n_gpus_per_node.",
    )
    colocate: bool = Field(
        default=True, description="Engine replica i shares trainer rank i's GPU; False: a GPU each."
    )
    store_server: bool = Field(
        default=False, description="Serve the store over HTTP so `agentloop runner` processes can join."
    )
    store_host: str = Field(
        default="127.0.0.1", description="Bind address of the store server (0.0.0.0: all)."
    )
    store_port: int = Field(default=0, ge=0, le=65535, description="Port of the store server; 0 picks one.")
    store_api_key: KeyRef = Field(
        default=None,
        description="Bearer token the store server requires: env:NAME, file:PATH or the key (kept secret).",
    )
    proxy_host: str = Field(
        default="127.0.0.1", description="Bind address of the proxy (remote runners need 0.0.0.0)."
    )
    proxy_advertise_host: str | None = Field(
        default=None,
        description="Address remote runners call the proxy at; None: proxy_host, or this machine's "
        "address when proxy_host is 0.0.0.0 or ::.",
    )
    local_runner: bool = Field(
        default=True, description="Run agents in the trainer process too; False: remote runners only."
    )
    cpu_binding: CpuBinding = Field(
        default="none",
        description="CPUs of the data-parallel trainer ranks and the replica pool's engines (GPU runs placed "
        "by placement.*): none (the OS picks), numa (their GPU's NUMA node) or exclusive (a disjoint share "
        "of the node's cores per GPU); see agentloop/cpu_binding.py.",
    )

    @model_validator(mode="after")
    def _key_off_loopback(self) -> PlacementConfig:
        if self.store_server and self.store_api_key is None and not is_loopback(self.store_host):
            raise ValueError(
                f"placement.store_host={self.store_host!r} is not a loopback address and "
                "placement.store_api_key is not set; set it (env:NAME or file:PATH) so only your runners "
                "can use the store"
            )
        return self
