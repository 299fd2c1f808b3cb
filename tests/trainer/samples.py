"""Small hand-made samples shared by the trainer tests."""

from __future__ import annotations

from pathlib import Path

from agentloop.types import Triplet
from trainer.batch import Batch, build_batch
from trainer.config import TrainerConfig


def actor_config(model_dir: Path, **actor: object) -> TrainerConfig:
    """A CPU config for an Actor on ``model_dir``: 2 prompts x 2 samples, lr 1e-3; ``actor`` overrides."""
    return TrainerConfig.from_dict(
        {
            "data": {"train_batch_size": 2, "max_prompt_length": 32, "max_response_length": 16},
            "actor_rollout_ref": {
                "model": {"path": str(model_dir)},
                "rollout": {"n": 2},
                "actor": {"ppo_mini_batch_size": 2, "optim": {"lr": 1e-3, "weight_decay": 0.0}, **actor},
            },
            "trainer": {"device": "cpu"},
        }
    )


def small_triplets() -> list[Triplet]:
    """Two GRPO groups of two samples with different prompt and response lengths and rewards 0 / 1."""
    return [
        Triplet(
            prompt_ids=[1, 5, 9, 13][: 2 + i % 3],
            response_ids=[20, 21, 22, 23][: 4 - i % 2],
            reward=float(i % 2),
            metadata={"group_id": i // 2},
        )
        for i in range(4)
    ]


def small_batch() -> Batch:
    """``small_triplets`` as a Batch (prompts up to 32 tokens, responses up to 16)."""
    batch, _ = build_batch(small_triplets(), max_prompt_length=32, max_response_length=16)
    return batch
