"""The embedded trainer: GRPO/PPO on the triplets the agents produced."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trainer.batch.advantages import sample_advantages
from trainer.config import TrainerConfig

__all__ = ["FitResult", "Trainer", "TrainerConfig", "sample_advantages"]


def __getattr__(name: str) -> Any:
    # Trainer pulls in ray, transformers and the proxy: import it on first use.
    if name in ("Trainer", "FitResult"):
        from trainer.fit import trainer as fit_trainer

        return getattr(fit_trainer, name)
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")


if TYPE_CHECKING:
    from trainer.fit.trainer import FitResult, Trainer
