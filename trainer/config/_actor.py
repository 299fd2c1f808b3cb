"""The ``actor_rollout_ref`` section: the policy model (LoRA), the PPO/GRPO update (optimizer, clipping,
losses, FSDP2) and the reference model; its ``rollout`` part lives in trainer/config/_rollout.py."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from trainer.algorithms import KLKind, LossAggMode, known_policy_losses
from trainer.config._keys import _Section
from trainer.config._rollout import RolloutConfig


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


class OptimConfig(_Section):
    lr: float = Field(
        default=1e-6, gt=0, description="AdamW learning rate (verl's default; tiny models want ~1e-5)."
    )
    weight_decay: float = Field(default=0.01, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field(default=(0.9, 0.999), description="AdamW betas.")
    lr_warmup_steps: int = Field(default=0, ge=0, description="Linear warm-up steps from 0 to lr.")


_CLIP_KEYS = ("clip_ratio_low", "clip_ratio_high")


# verl's names (verl.utils.torch_dtypes.PrecisionType) for the two dtypes FSDP2 runs here
_DTYPE_NAMES = {"fp32": "fp32", "float32": "fp32", "32": "fp32", "bf16": "bf16", "bfloat16": "bf16"}


def _dtype_name(v: Any, allowed: tuple[str, ...]) -> str:
    name = _DTYPE_NAMES.get(str(v).lower()) if isinstance(v, str | int) and not isinstance(v, bool) else None
    if name is not None and name in allowed:
        return name
    aliases = ", ".join(k for k, n in _DTYPE_NAMES.items() if n in allowed and k not in allowed)
    expected = f"{' or '.join(allowed)} (verl's names {aliases} too)"
    why = ""
    if str(v).lower() in ("fp16", "float16", "16"):
        why = "; fp16 is not supported: it needs loss scaling"
    elif len(allowed) == 1:
        why = "; FSDP2 has no buffer cast, so buffers keep their own float32"
    raise ValueError(f"must be {expected}; got {v!r}{why}")


class MixedPrecisionConfig(_Section):
    """The dtypes FSDP2 gathers parameters and reduces gradients in (verl's fsdp_config.mixed_precision;
    verl defaults param_dtype to bf16, we keep fp32 so that one rank and N ranks take the same step).
    The master weights and AdamW state stay float32 either way; so do the gradients the optimizer
    reads. Only with several ranks: one process (the plain Actor) has no FSDP2 and ignores the keys."""

    param_dtype: Literal["fp32", "bf16"] = Field(
        default="fp32",
        description="fp32 or bf16: the dtype each layer's parameters are all-gathered and run in. bf16 "
        "halves the all-gathers' bytes and runs the layers with bf16 weights (HF's RMSNorm still takes "
        "its statistics in fp32), where CUDA autocast keeps fp32 weights outside the matmuls: a small "
        "change of the numerics.",
    )
    reduce_dtype: Literal["fp32", "bf16"] = Field(
        default="fp32",
        description="fp32 or bf16: the dtype gradients cross the ranks in (reduce-scatter, all-reduce). "
        "bf16 halves those bytes and rounds each rank's gradient, and the partial sums on the way, to "
        "8 significant bits before the fp32 optimizer step. With grad_sync_per_micro_batch=false FSDP2 "
        "also keeps the unsynced gradient in bf16, so the micro-batches add up in bf16 too.",
    )
    buffer_dtype: Literal["fp32"] = Field(
        default="fp32",
        description="verl's key, read for its configs: buffers (the rotary frequencies) stay float32; "
        "FSDP2 has no buffer cast, so only fp32 is accepted.",
    )

    @field_validator("param_dtype", "reduce_dtype", mode="before")
    @classmethod
    def _dtype(cls, v: Any) -> str:
        return _dtype_name(v, ("fp32", "bf16"))

    @field_validator("buffer_dtype", mode="before")
    @classmethod
    def _buffer_dtype(cls, v: Any) -> str:
        return _dtype_name(v, ("fp32",))


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
        "memory of a full-size gradient of the model on every rank (fp32; bf16 with "
        "mixed_precision.reduce_dtype=bf16). The same step either way.",
    )
    fsdp_size: int = Field(
        default=-1,
        description="Ranks that share one copy of the model (verl's fsdp_size): -1 or at least the number "
        "of ranks shards it over all of them (FSDP); a divisor k of the ranks shards it within groups of k and "
        "replicates it across the groups (HSDP, gradients all-reduced between them); 1 replicates it on "
        "every rank (plain data parallelism: no parameter all-gathers, one gradient all-reduce, the "
        "whole model, gradients and AdamW state on every rank). The same step either way.",
    )
    mixed_precision: MixedPrecisionConfig = Field(
        default_factory=MixedPrecisionConfig,
        description="Dtypes of the parameter all-gathers and the gradient reductions (fp32 or bf16).",
    )
    layers_per_unit: int = Field(
        default=1,
        ge=1,
        description="Consecutive decoder layers that form one FSDP unit: all-gathered, and their gradients "
        "reduced, in one collective each. More layers a unit mean fewer, larger collectives and fewer of "
        "FSDP's per-unit hooks on the CPU, at the memory of that many layers gathered at once and less "
        "overlap of communication with compute. The same step either way.",
    )

    skip_fsdp_when_replicated: bool = Field(
        default=False,
        description="When every rank holds the whole model (fsdp_size resolves to 1, or one rank), train "
        "each rank's copy as the single-device actor does, without FSDP2, and sum the gradients over the "
        "ranks before each step, one all-reduce per 256 MiB bucket (in mixed_precision.reduce_dtype): "
        "none of FSDP2's per-unit hooks, parameter copies or DTensor dispatch. On one H200 in one call, "
        "one rank's 32-row update took 0.205 s without FSDP2 against 0.253 s under it "
        "(benchmarks/results/trainer_ray_overhead_1gpu.json). With param_dtype=bf16 FSDP2 stays (its "
        "bf16 parameter copies). The same step either way.",
    )

    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _null_mixed_precision(cls, v: Any) -> Any:
        return {} if v is None else v  # verl writes mixed_precision: null for "the defaults"

    @field_validator("fsdp_size")
    @classmethod
    def _fsdp_size(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError(f"must be -1 (all ranks) or a number of ranks >= 1, got {v}")
        return v

    def replicated_without_fsdp(self, ranks: int) -> bool:
        """Whether ``ranks`` trainer ranks train whole copies without FSDP2: ``skip_fsdp_when_replicated``,
        one rank a copy, and fp32 parameters (bf16 ones are FSDP2's copies)."""
        return (
            self.skip_fsdp_when_replicated
            and self.mixed_precision.param_dtype == "fp32"
            and shard_group_size(self.fsdp_size, ranks) == 1
        )


def shard_group_size(fsdp_size: int, ranks: int) -> int:
    """How many of ``ranks`` trainer ranks share one copy of the model under ``fsdp_config.fsdp_size``:
    all of them for -1 or at least ``ranks`` (as verl reads it), else ``fsdp_size``, which must divide
    ``ranks`` (ValueError otherwise)."""
    ranks = max(ranks, 1)
    if fsdp_size == -1 or fsdp_size >= ranks:
        return ranks
    if fsdp_size < 1 or ranks % fsdp_size:
        raise ValueError(
            f"actor_rollout_ref.actor.fsdp_config.fsdp_size={fsdp_size} must divide the trainer's "
            f"{ranks} ranks (or be -1, or at least {ranks}: shard over all of them)"
        )
    return fsdp_size


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
    on_policy_old_logprobs: bool = Field(
        default=True,
        description="One epoch of one mini-batch: old logprobs from the loss's own forward, no pass of their own.",
    )
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
