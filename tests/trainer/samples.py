"""Small hand-made samples shared by the trainer tests."""

from __future__ import annotations

from agentloop.types import Triplet
from trainer.batch import Batch, build_batch


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
