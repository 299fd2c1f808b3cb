"""The trainer's config: one pydantic model whose keys follow verl's names.

A verl user's ``actor_rollout_ref.actor.optim.lr`` means the same thing here. Unknown keys are
rejected with the closest valid name; bad values name the dotted key and what is allowed::

    cfg = TrainerConfig.from_dict({"data": {"train_batch_size": 16}})
    cfg = cfg.with_overrides(["actor_rollout_ref.actor.optim.lr=1e-5", "trainer.logger=[console,jsonl]"])

As in verl, ``data.train_batch_size`` and ``actor.ppo_mini_batch_size`` count *prompts*; each prompt
gives ``rollout.n`` samples. ``ppo_micro_batch_size_per_gpu`` counts samples.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

# `X as X` re-exports: the sections live in trainer/config/_*.py; `from trainer.config import X`
# works for every name it did before they moved there
from agentloop.adapter import Strategy as Strategy
from agentloop.engine.base import WeightUpdatePolicy as WeightUpdatePolicy
from agentloop.errors import ConfigError
from agentloop.http_limits import is_loopback as is_loopback
from agentloop.keys import KeyRef as KeyRef
from trainer.algorithms import GROUP_ESTIMATORS
from trainer.algorithms import KLKind as KLKind
from trainer.algorithms import LossAggMode as LossAggMode
from trainer.algorithms import known_adv_estimators as known_adv_estimators
from trainer.algorithms import known_policy_losses as known_policy_losses
from trainer.algorithms.rollout_correction import RolloutCorrectionConfig as RolloutCorrectionConfig
from trainer.config._actor import _CLIP_KEYS as _CLIP_KEYS
from trainer.config._actor import ActorConfig as ActorConfig
from trainer.config._actor import ActorRolloutRefConfig as ActorRolloutRefConfig
from trainer.config._actor import FSDPConfig as FSDPConfig
from trainer.config._actor import MixedPrecisionConfig as MixedPrecisionConfig
from trainer.config._actor import ModelConfig as ModelConfig
from trainer.config._actor import OptimConfig as OptimConfig
from trainer.config._actor import RefConfig as RefConfig
from trainer.config._actor import shard_group_size as shard_group_size
from trainer.config._algorithm import AlgorithmConfig as AlgorithmConfig
from trainer.config._algorithm import KLCtrlConfig as KLCtrlConfig
from trainer.config._critic import CriticConfig as CriticConfig
from trainer.config._critic import CriticModelConfig as CriticModelConfig
from trainer.config._keys import _closest as _closest
from trainer.config._keys import _dotted as _dotted
from trainer.config._keys import _Section as _Section
from trainer.config._keys import _submodel as _submodel
from trainer.config._rollout import RolloutConfig as RolloutConfig
from trainer.config._rollout import ValKwargsConfig as ValKwargsConfig
from trainer.config._rollout import engine_kwargs as engine_kwargs
from trainer.config._run import AdapterConfig as AdapterConfig
from trainer.config._run import DataConfig as DataConfig
from trainer.config._run import LoggerName as LoggerName
from trainer.config._run import PlacementConfig as PlacementConfig
from trainer.config._run import RunConfig as RunConfig
from trainer.config._run import TimeoutsConfig as TimeoutsConfig


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
