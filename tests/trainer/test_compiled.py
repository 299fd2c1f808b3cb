"""Compiled decoder layers: the warm-up pays every compile, so no update recompiles mid-run.

Runs dynamo with its "eager" backend: the same guards and recompiles as inductor on a GPU, without
generating kernels (fast on a CPU)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from agentloop.types import Triplet
from tests.trainer.samples import actor_config, small_batch
from trainer import compiled
from trainer.actor import Actor
from trainer.batch import Batch, build_batch


@pytest.fixture
def eager_dynamo(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(compiled, "BACKEND", "eager")
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _compiled_actor(model_dir: Path) -> Actor:
    """An Actor on the CPU whose layers and head are compiled as on a GPU (Actor compiles on CUDA only)."""
    actor = Actor(actor_config(model_dir), model_dir, "cpu")
    actor.compiled = True
    actor.shared_prompts = False  # as a compiled Actor has it (the per-layer cache recompiles)
    compiled.compile_layers(actor.model)
    return actor


def _graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


def _unpadded(rows: int, prompt: int, response: int) -> Batch:
    """``rows`` samples of one prompt and response length each: no token of the batch is padding."""
    triplets = [
        Triplet(
            prompt_ids=[3 + i + j for j in range(prompt)],
            response_ids=[40 + i + j for j in range(response)],
            reward=float(i % 2),
            metadata={"group_id": 0},
        )
        for i in range(rows)
    ]
    batch, _ = build_batch(triplets, max_prompt_length=32, max_response_length=32)
    return batch


def _runs(actor: Actor) -> None:
    """What updates bring: padded and unpadded micro-batches of one row and of several, log-probs
    (no grad) and forward + backward (grad)."""
    for batch in (
        small_batch(),
        _unpadded(1, 5, 7),
        _unpadded(2, 9, 4),
        _unpadded(1, 11, 13),
        _unpadded(4, 6, 6),
    ):
        actor.compute_logprobs(batch)  # eval mode, no grad
        actor.model.train()  # as Actor.update
        logprobs, entropy = actor._forward(actor.model, batch, True)
        (logprobs.sum() + (entropy.sum() if entropy is not None else 0.0)).backward()
    actor.model.zero_grad(set_to_none=True)


@pytest.mark.usefixtures("eager_dynamo")
def test_no_update_compiles_after_the_warm_up(tiny_model_dir: Path) -> None:
    actor = _compiled_actor(tiny_model_dir)
    passes = compiled.warm_up(actor._forward, actor.model, actor.device)
    warmed = _graphs()
    assert passes == 8 and warmed > 0, "the warm-up compiled nothing: the test would prove nothing"
    _runs(actor)
    assert _graphs() == warmed, f"{_graphs() - warmed} graphs compiled after the warm-up"
    assert all(p.grad is None for p in actor.model.parameters())  # the warm-up's gradients are gone


@pytest.mark.usefixtures("eager_dynamo")
def test_without_the_warm_up_updates_compile(tiny_model_dir: Path) -> None:
    """The other side of the test above: the same runs compile when nothing warmed the layers up."""
    actor = _compiled_actor(tiny_model_dir)
    _runs(actor)
    first = _graphs()
    assert first > 0
    torch._dynamo.reset()
    counters.clear()
    actor = _compiled_actor(tiny_model_dir)
    compiled.warm_up(actor._forward, actor.model, actor.device)
    assert _graphs() >= first  # the warm-up compiles at least what the runs needed


@pytest.mark.usefixtures("eager_dynamo")
def test_the_padding_column_leaves_the_logprobs(tiny_model_dir: Path) -> None:
    """A micro-batch with no padding gets one more (masked) column for the compiled layers; the
    response log-probs stay the same up to float rounding."""
    actor = Actor(actor_config(tiny_model_dir, shared_prompt_forward=False), tiny_model_dir, "cpu")
    batch = _unpadded(2, 9, 6)
    assert bool(batch.attention_mask.all())
    padded = compiled.model_inputs(batch)
    assert padded.input_ids.shape[1] == batch.input_ids.shape[1] + 1
    assert not bool(padded.attention_mask[:, -1].any())
    padded_already = small_batch()
    assert compiled.model_inputs(padded_already) is padded_already
    plain = actor.compute_logprobs(batch)
    actor.compiled = True  # model_inputs on, the layers left uncompiled: only the column differs
    with_column = actor.compute_logprobs(batch)
    # fp32 on the CPU: another matmul shape may round differently, ~1e-6 on log-probs of order 10
    torch.testing.assert_close(with_column, plain, rtol=0, atol=1e-4)
