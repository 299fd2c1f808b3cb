"""What fit checks and sets before it starts: its datasets, its reward, the console's defaults."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from trainer.config import TrainerConfig


def check_dataset(data: Sequence[Any] | None, name: str) -> list[Any]:
    """``data`` as a list, if it is a non-empty sequence of JSON-serialisable tasks."""
    if data is None or isinstance(data, str | bytes) or not isinstance(data, Sequence):
        raise TypeError(f"{name} must be a list of JSON tasks, got {type(data).__name__}")
    if len(data) == 0:
        raise ValueError(f"{name} is empty; give at least one task")
    for i, task in enumerate(data):
        try:
            json.dumps(task)
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"{name}[{i}] is not JSON-serialisable ({exc}); tasks travel through the store"
            ) from None
    return list(data)


def check_reward(reward: Any) -> Any:
    """``reward`` if it is a RewardJudge or None, else a TypeError."""
    from agentloop.judge import RewardJudge

    if reward is not None and not isinstance(reward, RewardJudge):
        raise TypeError(
            f"reward must be al.judge_reward(...) (a RewardJudge) or None, got {type(reward).__name__}; "
            "a reward the agent computes itself is returned by the agent"
        )
    return reward


def quiet_defaults(config: TrainerConfig) -> None:
    """A quiet console unless the user configured otherwise: agentloop's logging at INFO (per-rollout
    lines are debug) and no token-auth notice from a local Ray (its mode is set explicitly, as Ray's
    own default: token)."""
    from agentloop import logging as al_logging

    if getattr(al_logging, "_configured", None) is None:
        al_logging.configure_logging()
    # Ray reads the mode once, when it is imported: set after that, the GCS it starts (which reads it
    # from the environment) would want a token its own client does not send ("Failed to start GCS")
    if config.trainer.ray_address is None and "ray" not in sys.modules:
        os.environ.setdefault("RAY_AUTH_MODE", "token")
