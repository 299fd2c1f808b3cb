"""The ``sft`` config section and the trainer config SFT runs with (trainer/sft/__init__.py's docstring says
what each RL key means here)."""

from __future__ import annotations

import json
from typing import Any, Literal

import structlog
from pydantic import Field, ValidationError

from agentloop.errors import ConfigError
from trainer.config import TrainerConfig, _Section, format_validation_error

log = structlog.get_logger("agentloop.trainer.sft")


class SFTConfig(_Section):
    """Which recorded attempts SFT trains on, and the held-out split (the ``sft`` section)."""

    min_reward: float | None = Field(
        default=1.0, description="Train on attempts whose total reward is at least this; None: any reward."
    )
    modes: list[Literal["train", "val"]] = Field(
        default=["train"], min_length=1, description="Rollout modes to take attempts from."
    )
    include_failed: bool = Field(
        default=False,
        description="Also attempts that did not succeed (a retried rollout's earlier ones) whose reward "
        "passes; False: the succeeded attempt of each succeeded rollout only.",
    )
    val_fraction: float = Field(
        default=0.1, ge=0, lt=1, description="Share of the tasks held out for validation NLL (whole tasks)."
    )


class _SFTRoot(_Section):
    sft: SFTConfig = Field(default_factory=SFTConfig, description="The sft section (errors name sft.KEY).")


def load_configs(
    config: dict[str, Any] | TrainerConfig | None, sft: dict[str, Any] | SFTConfig | None = None
) -> tuple[TrainerConfig, SFTConfig]:
    """The trainer config and the ``sft`` section, from one dict (``sft`` as a key in it) or two."""
    data = json.loads(json.dumps(config)) if isinstance(config, dict) else config
    section = data.pop("sft", None) if isinstance(data, dict) else None
    if isinstance(data, dict) and isinstance(data.get("data"), dict) and "train_batch_size" in data["data"]:
        # RL's mini-batch must divide its batch; SFT has one optimizer step per batch: one mini-batch
        actor = data.setdefault("actor_rollout_ref", {}).setdefault("actor", {})
        if isinstance(actor, dict):
            actor.setdefault("ppo_mini_batch_size", data["data"]["train_batch_size"])
    if sft is None:
        sft = section
    elif section is not None:
        raise ConfigError("the sft section is given twice: in the config dict and as sft=; give it once")
    cfg = TrainerConfig.from_dict(data)
    if not isinstance(sft, SFTConfig):
        try:
            sft = _SFTRoot.model_validate({"sft": sft or {}}).sft
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, _SFTRoot)) from None
    if "experiment_name" not in cfg.trainer.model_fields_set:  # not RL's runs/<project>/default
        cfg = cfg.model_copy(deep=True)
        cfg.trainer.experiment_name = "sft"
    return cfg, sft


def sft_trainer_config(config: TrainerConfig) -> TrainerConfig:
    """``config`` as the SFT actor uses it: no critic, no reference model, no KL term."""
    out = config.model_copy(deep=True)
    arr = out.actor_rollout_ref
    dropped = [
        name
        for name, on in (
            ("critic", config.uses_critic),
            ("actor_rollout_ref.actor.use_kl_loss", arr.actor.use_kl_loss),
            ("algorithm.use_kl_in_reward", out.algorithm.use_kl_in_reward),
        )
        if on
    ]
    if dropped:
        log.warning("sft.ignores", keys=dropped, why="SFT trains the policy alone")
    out.critic.enable = False
    arr.actor.use_kl_loss = False
    out.algorithm.use_kl_in_reward = False
    return out
