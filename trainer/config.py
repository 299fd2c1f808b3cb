"""The trainer's config: one pydantic model whose keys follow verl's names.

A verl user's ``actor_rollout_ref.actor.optim.lr`` means the same thing here. Unknown keys are
rejected with the closest valid name; bad values name the dotted key and what is allowed::

    cfg = TrainerConfig.from_dict({"data": {"train_batch_size": 16}})
    cfg = cfg.with_overrides(["actor_rollout_ref.actor.optim.lr=1e-5", "trainer.logger=[console,jsonl]"])

As in verl, ``data.train_batch_size`` and ``actor.ppo_mini_batch_size`` count *prompts*; each prompt
gives ``rollout.n`` samples. ``ppo_micro_batch_size_per_gpu`` counts samples.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from agentloop.adapter import Strategy
from agentloop.engine.base import WeightUpdatePolicy
from agentloop.errors import ConfigError
from agentloop.http_limits import is_loopback
from agentloop.keys import KeyRef
from trainer.algorithms import (
    GROUP_ESTIMATORS,
    KLKind,
    LossAggMode,
    known_adv_estimators,
    known_policy_losses,
)
from trainer.rollout_correction import RolloutCorrectionConfig

LoggerName = Literal["console", "jsonl", "tensorboard", "wandb"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# ---------------------------------------------------------------- algorithm


class KLCtrlConfig(_Section):
    type: Literal["fixed"] = Field(
        default="fixed", description="KL controller; only a fixed coefficient for now."
    )
    kl_coef: float = Field(
        default=0.001, ge=0, description="beta of the KL penalty in the reward (use_kl_in_reward)."
    )


class AlgorithmConfig(_Section):
    adv_estimator: str = Field(
        default="grpo", description="Advantage estimator: grpo, rloo, reinforce_plus_plus, ..."
    )
    norm_adv_by_std_in_grpo: bool = Field(
        default=True, description="Divide GRPO advantages by the group std."
    )
    use_kl_in_reward: bool = Field(
        default=False, description="Subtract kl_ctrl.kl_coef * KL(pi||ref) from rewards."
    )
    kl_penalty: KLKind = Field(default="kl", description="KL estimator used in the reward.")
    kl_ctrl: KLCtrlConfig = Field(default_factory=KLCtrlConfig, description="KL-in-reward coefficient.")
    gamma: float = Field(default=1.0, ge=0, le=1, description="Discount for reinforce_plus_plus and gae.")
    lam: float = Field(default=1.0, ge=0, le=1, description="GAE lambda.")
    gae_std_floor: float = Field(
        default=0.1,
        ge=0,
        description="GAE advantages are divided by their std, but never by less (reward units): a batch "
        "where every attempt failed holds only the critic's noise, which whitening would train on at full "
        "strength.",
    )
    rollout_correction: RolloutCorrectionConfig = Field(
        default_factory=RolloutCorrectionConfig,
        description="Truncated importance sampling and rejection masks against the engine's log-probs.",
    )
    overlong_filter: bool = Field(
        default=False,
        description="Mask the loss of truncated samples but keep them in group statistics (DAPO).",
    )

    @field_validator("adv_estimator")
    @classmethod
    def _known_estimator(cls, v: str) -> str:
        if v not in known_adv_estimators():
            raise ValueError(f"must be one of {', '.join(known_adv_estimators())}; got {v!r}")
        return v


# ---------------------------------------------------------------- data


class DataConfig(_Section):
    train_batch_size: int = Field(
        default=8, ge=1, description="Prompts per training step (each gives rollout.n samples)."
    )
    max_prompt_length: int = Field(
        default=1024, ge=1, description="An attempt with a longer prompt leaves the batch whole (counted)."
    )
    max_response_length: int = Field(
        default=1024, ge=1, description="Longer samples are truncated (kept, flagged); max_tokens per call."
    )


# ---------------------------------------------------------------- actor / rollout / ref


class ModelConfig(_Section):
    path: str = Field(
        default="smollm2-135m-instruct", description="Model alias, local Hugging Face folder or hub id."
    )
    enable_gradient_checkpointing: bool = Field(
        default=False, description="Recompute activations to save memory (GPU)."
    )
    lora_rank: int = Field(default=0, ge=0, description="LoRA rank through peft; 0 trains all weights.")
    lora_alpha: int = Field(default=16, ge=1, description="LoRA alpha (scale = alpha / rank).")
    target_modules: str | list[str] = Field(
        default="all-linear", description="Modules LoRA adapts (peft's syntax)."
    )

    @field_validator("lora_rank", "lora_alpha", mode="before")
    @classmethod
    def _lora_int(cls, v: Any) -> Any:
        if isinstance(v, bool):  # YAML's `true` would silently become rank 1
            raise ValueError(f"must be an integer, got {v!r}")
        return v

    @field_validator("target_modules", mode="before")
    @classmethod
    def _lora_targets(cls, v: Any) -> Any:
        ok = (isinstance(v, str) and v.strip()) or (
            isinstance(v, list | tuple) and v and all(isinstance(x, str) and x.strip() for x in v)
        )
        if not ok:
            raise ValueError(
                "must be 'all-linear', a regex over module names, or a non-empty list of module names "
                f"such as [q_proj, v_proj]; got {v!r}"
            )
        return list(v) if isinstance(v, tuple) else v


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
    if rollout.engine_backend == "vllm":
        kwargs["gpu_memory_utilization"] = rollout.gpu_memory_utilization
    return kwargs


class OptimConfig(_Section):
    lr: float = Field(
        default=1e-6, gt=0, description="AdamW learning rate (verl's default; tiny models want ~1e-5)."
    )
    weight_decay: float = Field(default=0.01, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field(default=(0.9, 0.999), description="AdamW betas.")
    lr_warmup_steps: int = Field(default=0, ge=0, description="Linear warm-up steps from 0 to lr.")


_CLIP_KEYS = ("clip_ratio_low", "clip_ratio_high")


class FSDPConfig(_Section):
    """How FSDP2 shards the actor (and critic) when the trainer spans several ranks (verl's fsdp_config)."""

    reshard_after_forward: bool = Field(
        default=True,
        description="Free each layer's gathered parameters after its forward (all-gathered again for the "
        "backward); False keeps them from forward to backward: one all-gather per layer and micro-batch "
        "instead of two, at the memory of the whole unsharded model on every rank.",
    )
    grad_sync_per_micro_batch: bool = Field(
        default=True,
        description="Reduce-scatter the gradients after every micro-batch's backward; False accumulates "
        "them unsharded on each rank and reduce-scatters once per optimizer step (in the mini-batch's last "
        "backward): one reduce-scatter per layer and mini-batch instead of one per micro-batch, at the "
        "memory of a full-size fp32 gradient of the model on every rank. The same step either way.",
    )


class ActorConfig(_Section):
    ppo_mini_batch_size: int = Field(
        default=8, ge=1, description="Prompts per optimizer step (x rollout.n samples)."
    )
    ppo_micro_batch_size_per_gpu: int | None = Field(
        default=None,
        ge=1,
        description="Samples per forward/backward; None: split by ppo_max_token_len_per_gpu.",
    )
    ppo_max_token_len_per_gpu: int = Field(
        default=16384, ge=1, description="Token budget of one micro-batch."
    )
    ppo_epochs: int = Field(default=1, ge=1, description="Passes over each batch.")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="Optimizer settings.")
    clip_ratio: float = Field(
        default=0.2, gt=0, lt=1, description="Default for clip_ratio_low and clip_ratio_high."
    )
    clip_ratio_low: float = Field(
        default=0.2, gt=0, lt=1, description="Ratio lower bound 1 - low; unset: clip_ratio."
    )
    clip_ratio_high: float = Field(
        default=0.2, gt=0, description="Ratio upper bound 1 + high; unset: clip_ratio."
    )
    clip_ratio_c: float = Field(
        default=3.0, gt=1, description="Dual-clip cap on the loss for negative advantages."
    )
    loss_agg_mode: LossAggMode = Field(
        default="token-mean", description="How token losses become one number."
    )
    entropy_coeff: float = Field(default=0.0, ge=0, description="Weight of the entropy bonus.")
    use_kl_loss: bool = Field(
        default=False, description="Add kl_loss_coef * KL(pi||ref) to the loss (needs a ref model)."
    )
    kl_loss_coef: float = Field(default=0.001, ge=0, description="Weight of the KL loss.")
    kl_loss_type: KLKind = Field(default="low_var_kl", description="KL estimator used in the loss.")
    grad_clip: float = Field(default=1.0, gt=0, description="Max global gradient norm.")
    policy_loss: str = Field(default="vanilla", description="Policy loss: vanilla (PPO clip), gspo or pg.")
    shared_prompt_forward: bool = Field(
        default=True,
        description="Run each distinct prompt of a micro-batch once (a GRPO group's attempts share it); "
        "exact, checked once per model, off where it does not hold; one device, no torch.compile "
        "(compiled layers recompile per cache state), no gradient checkpointing, not under FSDP.",
    )
    use_engine_logprobs: bool = Field(default=False, description="Use the engine's logprobs as old logprobs.")
    engine_logprob_gap_limit: float = Field(
        default=0.05,
        gt=0,
        description="With use_engine_logprobs: recompute old logprobs when the probed mean gap exceeds this.",
    )
    use_torch_compile: bool = Field(
        default=True, description="torch.compile the decoder layers and LM-head statistics (CUDA only)."
    )
    fsdp_config: FSDPConfig = Field(
        default_factory=FSDPConfig, description="FSDP2 settings of a data-parallel (multi-rank) update."
    )

    @model_validator(mode="before")
    @classmethod
    def _drop_null_clips(cls, data: Any) -> Any:
        if isinstance(data, dict):  # verl configs write clip_ratio_low: null for "use clip_ratio"
            data = {k: v for k, v in data.items() if not (k in _CLIP_KEYS and v is None)}
        return data

    @model_validator(mode="after")
    def _clip_defaults(self) -> ActorConfig:
        for key in _CLIP_KEYS:  # as in verl, an unset bound follows clip_ratio
            if key not in self.model_fields_set:
                self.__dict__[key] = self.clip_ratio
        return self

    @field_validator("policy_loss", mode="before")
    @classmethod
    def _known_policy_loss(cls, v: Any) -> Any:
        if isinstance(v, dict) and set(v) == {"loss_mode"}:  # verl's nested form policy_loss.loss_mode
            v = v["loss_mode"]
        if v not in known_policy_losses():
            raise ValueError(f"must be one of {', '.join(known_policy_losses())}; got {v!r}")
        return v


class RefConfig(_Section):
    log_prob_micro_batch_size_per_gpu: int | None = Field(
        default=None, ge=1, description="Samples per reference forward; None: the actor's token budget."
    )


class ActorRolloutRefConfig(_Section):
    model: ModelConfig = Field(default_factory=ModelConfig, description="The policy model.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Sampling and the engine.")
    actor: ActorConfig = Field(default_factory=ActorConfig, description="The PPO/GRPO update.")
    ref: RefConfig = Field(default_factory=RefConfig, description="The frozen reference model (KL only).")


# ---------------------------------------------------------------- trainer / adapter


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
    critic_warmup: int = Field(
        default=0, ge=0, description="Steps that train only the critic before the actor starts updating."
    )
    test_freq: int = Field(default=-1, ge=-1, description="Validate every N steps; -1 or 0: never.")
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

    @model_validator(mode="after")
    def _key_off_loopback(self) -> PlacementConfig:
        if self.store_server and self.store_api_key is None and not is_loopback(self.store_host):
            raise ValueError(
                f"placement.store_host={self.store_host!r} is not a loopback address and "
                "placement.store_api_key is not set; set it (env:NAME or file:PATH) so only your runners "
                "can use the store"
            )
        return self


# ---------------------------------------------------------------- the whole config


class CriticModelConfig(_Section):
    path: str | None = Field(
        default=None,
        description="Value model's backbone; None: the actor's model (with a scalar value head).",
    )
    enable_gradient_checkpointing: bool = Field(
        default=False, description="Recompute the critic's activations in backward (less memory)."
    )


class CriticConfig(_Section):
    """A value model (PPO's critic) trained beside the actor; ``algorithm.adv_estimator=gae`` uses its
    values. The batch keys default to the actor's (None)."""

    enable: bool | None = Field(
        default=None, description="Train a critic; None: exactly when algorithm.adv_estimator is gae."
    )
    model: CriticModelConfig = Field(default_factory=CriticModelConfig, description="The value model.")
    optim: OptimConfig = Field(
        default_factory=lambda: OptimConfig(lr=1e-5), description="The critic's optimizer (its own state)."
    )
    ppo_epochs: int | None = Field(
        default=None, ge=1, description="Passes over each batch; None: the actor's."
    )
    ppo_mini_batch_size: int | None = Field(
        default=None, ge=1, description="Prompts per critic optimizer step; None: the actor's."
    )
    ppo_max_token_len_per_gpu: int | None = Field(
        default=None, ge=1, description="Tokens per critic micro-batch; None: the actor's."
    )
    cliprange_value: float = Field(
        default=0.5,
        gt=0,
        description="Value clipping: a prediction moves at most this far from the old value.",
    )
    loss_agg_mode: LossAggMode = Field(default="token-mean", description="How the value loss is averaged.")
    grad_clip: float = Field(default=1.0, gt=0, description="Max global gradient norm of the critic.")


class TrainerConfig(_Section):
    """Everything the embedded trainer needs; keys follow verl's names."""

    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="Advantages and KL.")
    data: DataConfig = Field(default_factory=DataConfig, description="Batch size and length limits.")
    actor_rollout_ref: ActorRolloutRefConfig = Field(
        default_factory=ActorRolloutRefConfig, description="Model, rollout, actor and reference settings."
    )
    trainer: RunConfig = Field(default_factory=RunConfig, description="Loop, logging, checkpoints, devices.")
    adapter: AdapterConfig = Field(default_factory=AdapterConfig, description="Spans to training samples.")
    critic: CriticConfig = Field(default_factory=CriticConfig, description="The value model (PPO with gae).")
    placement: PlacementConfig = Field(
        default_factory=PlacementConfig, description="GPUs for training and rollout; remote runners."
    )

    @model_validator(mode="after")
    def _cross_field(self) -> TrainerConfig:
        actor, n = self.actor_rollout_ref.actor, self.actor_rollout_ref.rollout.n
        tbs, mbs = self.data.train_batch_size, actor.ppo_mini_batch_size
        if tbs % mbs:
            fit = max(d for d in range(1, min(tbs, mbs) + 1) if tbs % d == 0)
            if mbs > tbs:
                why = (
                    f"a step's {tbs} prompts ({tbs * n} samples with rollout.n={n}) cannot fill one "
                    f"mini-batch of {mbs} prompts ({mbs * n} samples)"
                )
            else:
                why = (
                    f"a step's {tbs} prompts ({tbs * n} samples with rollout.n={n}) would split into "
                    f"{tbs // mbs} mini-batch(es) of {mbs} prompts ({mbs * n} samples) and {tbs % mbs} left over"
                )
            raise ValueError(
                f"data.train_batch_size ({tbs}) must be divisible by actor_rollout_ref.actor.ppo_mini_batch_size "
                f"({mbs}); both count prompts: {why}; set ppo_mini_batch_size to a divisor of {tbs}, such as {fit}"
            )
        micro = actor.ppo_micro_batch_size_per_gpu
        if micro is not None and (mbs * n) % micro:
            raise ValueError(
                f"a mini-batch of {mbs * n} samples (ppo_mini_batch_size {mbs} x rollout.n {n}) must be divisible "
                f"by actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu ({micro})"
            )
        est = self.algorithm.adv_estimator
        if est == "gae" and self.critic.enable is False:
            raise ValueError(
                "algorithm.adv_estimator='gae' estimates advantages with a value model: set critic.enable "
                "to true (or leave it out), or pick an estimator without one (grpo, rloo, reinforce_plus_plus)"
            )
        if est != "gae" and self.critic.enable:
            raise ValueError(
                f"critic.enable is true but algorithm.adv_estimator={est!r} does not use a value model; "
                "set algorithm.adv_estimator=gae to train with the critic, or leave critic.enable out"
            )
        critic_mbs = self.critic.ppo_mini_batch_size
        if critic_mbs is not None and tbs % critic_mbs:
            raise ValueError(
                f"data.train_batch_size ({tbs}) must be divisible by critic.ppo_mini_batch_size ({critic_mbs})"
            )
        if est in GROUP_ESTIMATORS and n < 2:
            raise ValueError(
                f"algorithm.adv_estimator={est!r} compares the responses to one prompt: "
                f"actor_rollout_ref.rollout.n must be >= 2, got {n}"
            )
        return self

    @property
    def uses_critic(self) -> bool:
        """Whether a value model trains beside the actor (``critic.enable``, or gae when it is None)."""
        return self.algorithm.adv_estimator == "gae" if self.critic.enable is None else self.critic.enable

    def rollout_is_level(self) -> str | None:
        """The rollout correction's IS level after resolving ``auto``: token-level truncated IS whenever
        the policy that sampled can differ from the one the PPO ratio starts at (a vLLM engine, a
        batch that may lag the weights, or the engine's log-probs taken as old log-probs)."""
        level = self.algorithm.rollout_correction.rollout_is
        if level != "auto":
            return level
        rollout, actor = self.actor_rollout_ref.rollout, self.actor_rollout_ref.actor
        off_policy = (
            rollout.engine_backend == "vllm" or rollout.max_staleness > 0 or actor.use_engine_logprobs
        )
        return "token" if off_policy else None

    # ------------------------------------------------------------ constructors

    @classmethod
    def from_dict(cls, d: dict[str, Any] | TrainerConfig | None) -> TrainerConfig:
        """Validate a nested dict; raises ConfigError naming every bad key."""
        if isinstance(d, TrainerConfig):
            return d
        if d is None:
            d = {}
        if not isinstance(d, dict):
            raise ConfigError(f"a trainer config must be a dict or TrainerConfig, got {type(d).__name__}")
        try:
            return cls.model_validate(d)
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, cls)) from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> TrainerConfig:
        """Load a YAML file of nested keys."""
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        data = yaml.safe_load(p.read_text())
        if data is not None and not isinstance(data, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of keys, got {type(data).__name__}")
        return cls.from_dict(data)

    def with_overrides(self, overrides: list[str]) -> TrainerConfig:
        """A new config with ``dotted.key=value`` overrides applied; each value is parsed as YAML."""
        if isinstance(overrides, str):
            raise ConfigError("overrides must be a list of 'dotted.key=value' strings, got one string")
        d = self.model_dump(exclude_unset=True)  # unset fields keep following their defaults
        for item in overrides:
            key, sep, raw = item.partition("=")
            parts = key.strip().split(".")
            if not sep or not all(parts):
                raise ConfigError(f"override {item!r} must look like dotted.key=value")
            node: Any = d
            model: type[BaseModel] | None = type(self)
            for i, part in enumerate(parts[:-1]):
                if model is not None and part in model.model_fields and _submodel(model, part) is None:
                    where = ".".join(parts[: i + 1])
                    raise ConfigError(f"override {item!r}: {where!r} is a value, not a section")
                model = _submodel(model, part)
                node = node.setdefault(part, {})
            try:
                node[parts[-1]] = yaml.safe_load(raw)
            except yaml.YAMLError as exc:
                raise ConfigError(f"override {item!r}: the value is not valid YAML ({exc})") from None
        return type(self).from_dict(d)


# ---------------------------------------------------------------- error messages


def _submodel(model: type[BaseModel] | None, key: str | int) -> type[BaseModel] | None:
    """The pydantic model class of field ``key`` in ``model`` (None when it is not a section)."""
    if model is None or not isinstance(key, str) or key not in model.model_fields:
        return None
    ann = model.model_fields[key].annotation
    inner = [a for a in get_args(ann) if a is not type(None)]
    if len(inner) == 1 and len(get_args(ann)) == 2:  # an optional section, `X | None`: X
        ann = inner[0]
    return ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None


def _closest(name: str, valid: list[str]) -> list[str]:
    """The valid name that ``name`` most likely meant: an abbreviation (learning_rate -> lr), else difflib."""
    initials = "".join(w[0] for w in name.split("_") if w)
    abbrev = [v for v in valid if len(name.split("_")) > 1 and v == initials]
    return abbrev or difflib.get_close_matches(name, valid, n=1, cutoff=0.6)


def _dotted(loc: tuple[str | int, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def format_validation_error(exc: ValidationError, root: type[BaseModel] = TrainerConfig) -> str:
    """One line per problem: the dotted key, what is allowed, and what came."""
    lines: list[str] = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        key = _dotted(loc)
        if err["type"] == "extra_forbidden":
            parent: type[BaseModel] | None = root
            for part in loc[:-1]:
                parent = _submodel(parent, part)
            valid = sorted(parent.model_fields) if parent is not None else []
            close = _closest(str(loc[-1]), valid)
            hint = f"did you mean {close[0]!r}?" if close else f"valid keys here: {', '.join(valid)}"
            lines.append(f"unknown key {key!r}; {hint}")
            continue
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] in ("value_error", "assertion_error"):  # our validators' messages say what came
            lines.append(f"{key}: {msg}" if loc else msg)  # without loc: a cross-field rule naming its keys
        elif err["type"] == "missing":
            lines.append(f"{key}: required")
        else:
            lines.append(f"{key}: {msg}; got {err.get('input')!r}")
    return "invalid trainer config:\n  " + "\n  ".join(lines) if len(lines) > 1 else lines[0]
