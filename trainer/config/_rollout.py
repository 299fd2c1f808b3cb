"""The ``actor_rollout_ref.rollout`` section: sampling, the inference engine, agent concurrency and
validation sampling; ``engine_kwargs`` turns it into ``load_engine`` arguments."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from agentloop.engine.base import WeightUpdatePolicy
from trainer.config._keys import _Section


class ValKwargsConfig(_Section):
    """How validation samples (verl's ``actor_rollout_ref.rollout.val_kwargs``): greedy by default, so
    the same model on the same tasks scores the same."""

    temperature: float = Field(default=0.0, ge=0, description="Validation temperature; 0 is greedy.")
    top_p: float = Field(default=1.0, gt=0, le=1, description="Validation nucleus sampling mass.")
    top_k: int = Field(default=-1, ge=-1, description="Validation top-k; -1 (or 0) disables it.")
    n: int = Field(default=1, ge=1, description="Attempts per validation task; the means count each.")
    do_sample: bool = Field(default=False, description="False: greedy, whatever temperature says.")

    def sampling(self) -> dict[str, Any]:
        """The LLM sampling defaults a validation rollout runs with."""
        out: dict[str, Any] = {"temperature": self.temperature if self.do_sample else 0.0}
        out["top_p"] = self.top_p
        out["top_k"] = max(self.top_k, 0)  # the engine's 0 is verl's -1: no top-k
        return out


class RolloutConfig(_Section):
    n: int = Field(default=4, ge=1, description="Responses sampled per prompt (the GRPO group size).")
    temperature: float = Field(
        default=1.0, ge=0, description="Sampling temperature; 0 is greedy (no exploration)."
    )
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling mass.")
    max_staleness: int = Field(
        default=0, ge=0, description="Weight versions a batch may lag behind; 0 is synchronous."
    )
    weight_update_policy: WeightUpdatePolicy = Field(
        default="drain",
        description="How the engine takes new weights with requests in flight: drain (they finish on "
        "the old), abort, or inflight (they go on with the new; tokens record their version).",
    )
    max_num_seqs: int | None = Field(
        default=None,
        ge=1,
        description="Most requests one engine decodes at once; None: the engine's default.",
    )
    max_model_len: int | None = Field(
        default=None,
        ge=2,
        description="Most tokens (prompt + response) of one sequence in the engine (its max_context); "
        "None: the model's own limit (max_position_embeddings).",
    )
    replicas: int = Field(default=1, ge=1, description="Inference engine replicas.")
    proxy_workers: int = Field(
        default=0,
        ge=0,
        description="Processes serving the agents' calls (Proxy(workers=N)): parsing, templating and recording "
        "off the engine's process; 0: in it. Needs the default SQLite store.",
    )
    engine_backend: Literal["torch", "vllm"] = Field(
        default="torch", description="Inference engine implementation."
    )
    idle_graph_capture: bool = Field(
        default=True,
        description="TorchEngine on a GPU: while it has no request (0.5 s of quiet), capture the decode CUDA "
        "graphs of the smaller batch sizes it may meet next; false: only when a step needs one.",
    )
    gpu_memory_utilization: float = Field(
        default=0.5, gt=0, le=1, description="vLLM only: share of GPU memory its engine may take."
    )
    concurrency: int = Field(default=16, ge=1, description="Agent rollouts a runner runs at once.")
    # a hung agent (a tool that never answers, a graph that loops) is cancelled and retried, never waited on
    agent_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="Wall time one agent attempt may take; then it times out and is retried.",
    )
    val_kwargs: ValKwargsConfig = Field(
        default_factory=ValKwargsConfig, description="Validation sampling (greedy by default, as verl)."
    )


def engine_kwargs(rollout: RolloutConfig) -> dict[str, Any]:
    """``load_engine`` keyword arguments for the configured backend."""
    kwargs: dict[str, Any] = {
        "backend": rollout.engine_backend,
        "weight_update_policy": rollout.weight_update_policy,
    }
    if rollout.max_num_seqs is not None:
        kwargs["max_batch_size"] = rollout.max_num_seqs
    if rollout.max_model_len is not None:
        kwargs["max_context"] = rollout.max_model_len
    if rollout.engine_backend == "vllm":
        kwargs["gpu_memory_utilization"] = rollout.gpu_memory_utilization
    else:
        kwargs["idle_graph_capture"] = rollout.idle_graph_capture
    return kwargs
