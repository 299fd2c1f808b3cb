"""The ``critic`` section: the value model PPO's gae estimator trains beside the actor."""

from __future__ import annotations

from pydantic import Field

from trainer.algorithms import LossAggMode
from trainer.config._actor import OptimConfig
from trainer.config._keys import _Section


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
