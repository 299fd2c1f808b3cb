"""The Actor: logprob definition shared with the engine, micro-batch accumulation, a real update."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch

from agentloop.engine.base import SamplingParams
from agentloop.engine.torch_engine import TorchEngine
from agentloop.types import Triplet
from tests.trainer.samples import small_batch, small_triplets
from trainer.actor import Actor
from trainer.algorithms import entropy_from_logits, logprobs_from_logits
from trainer.batch import build_batch
from trainer.config import TrainerConfig


def _config(model_dir: Path, **actor: object) -> TrainerConfig:
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


def test_response_logprobs_match_the_full_forward(tiny_model_dir: Path) -> None:
    """The head on response positions only (trainer/head.py) gives the full forward's logprobs and entropy."""
    actor = Actor(_config(tiny_model_dir), tiny_model_dir, "cpu")
    batch = small_batch()
    p, r = batch.prompt_length, batch.response_length
    full = actor.model(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
    ).logits[:, p - 1 : p + r - 1]
    logprobs, entropy = actor._forward(actor.model, batch, entropy=True)
    torch.testing.assert_close(logprobs, logprobs_from_logits(full, batch.responses))
    assert entropy is not None
    torch.testing.assert_close(entropy, entropy_from_logits(full))


def test_trainer_logprobs_equal_the_engines(tiny_model_dir: Path) -> None:
    """The engine's logprob (log-softmax of logits / T at the sampled token) is what the trainer computes
    at the temperature the call recorded (the adapter copies it into the triplet's metadata)."""

    async def generate() -> tuple[list[int], list[int], list[float]]:
        engine = TorchEngine(tiny_model_dir, device="cpu")
        prompt = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi there"}], add_generation_prompt=True, return_dict=False
        )
        out = await engine.generate(list(prompt), SamplingParams(temperature=0.7, max_tokens=8, seed=3))
        await engine.stop()
        return list(prompt), out.token_ids, out.logprobs or []

    prompt, response, engine_logprobs = anyio.run(generate)
    actor = Actor(_config(tiny_model_dir), tiny_model_dir, "cpu")
    batch, _ = build_batch(
        [
            Triplet(
                prompt_ids=prompt,
                response_ids=response,
                response_logprobs=engine_logprobs,
                reward=1.0,
                metadata={"temperature": 0.7},
            )
        ],
        max_prompt_length=64,
        max_response_length=16,
    )
    torch.testing.assert_close(
        actor.compute_logprobs(batch)[0, : len(response)], torch.tensor(engine_logprobs), atol=1e-4, rtol=0
    )


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batches_accumulate_to_the_full_batch(tiny_model_dir: Path, agg: str) -> None:
    batch = small_batch()
    weights = []
    for budget in (10_000, 8):  # one micro-batch vs one sample per micro-batch
        actor = Actor(
            _config(tiny_model_dir, loss_agg_mode=agg, ppo_max_token_len_per_gpu=budget),
            tiny_model_dir,
            "cpu",
        )
        # plain SGD: the weight change is the (clipped) gradient itself, without Adam's sign-like noise
        actor.optimizer = torch.optim.SGD(actor.model.parameters(), lr=1.0)
        actor.update(batch)
        weights.append(actor.model.lm_head.weight.detach().clone())
    torch.testing.assert_close(weights[0], weights[1], atol=1e-6, rtol=1e-5)


def test_update_moves_weights_only_with_a_signal(tiny_model_dir: Path) -> None:
    batch = small_batch()
    actor = Actor(_config(tiny_model_dir), tiny_model_dir, "cpu")
    before = actor.model.lm_head.weight.detach().clone()
    metrics = actor.update(batch)
    assert not torch.equal(before, actor.model.lm_head.weight)
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    assert metrics["actor/grad_norm"] > 0

    flat = [t.model_copy(update={"reward": 1.0}) for t in small_triplets()]  # equal rewards: zero advantage
    batch, _ = build_batch(flat, max_prompt_length=32, max_response_length=16)
    actor = Actor(_config(tiny_model_dir), tiny_model_dir, "cpu")
    before = actor.model.lm_head.weight.detach().clone()
    metrics = actor.update(batch)
    assert metrics["actor/grad_norm"] == 0.0
    assert torch.equal(before, actor.model.lm_head.weight)


@pytest.mark.parametrize("shift, recomputed", [(0.0, False), (0.5, True)])
def test_engine_logprobs_are_used_until_their_gap_is_too_large(
    tiny_model_dir: Path, shift: float, recomputed: bool
) -> None:
    """use_engine_logprobs: a probe measures the gap; past engine_logprob_gap_limit the batch is recomputed."""
    actor = Actor(
        _config(tiny_model_dir, use_engine_logprobs=True, engine_logprob_gap_limit=0.1), tiny_model_dir, "cpu"
    )
    plain = small_batch()
    policy = actor.compute_logprobs(plain)  # what the engine would report with exactly these weights
    triplets = [
        t.model_copy(update={"response_logprobs": (policy[i, : len(t.response_ids)] + shift).tolist()})
        for i, t in enumerate(small_triplets())
    ]
    batch, _ = build_batch(triplets, max_prompt_length=32, max_response_length=16)
    metrics: dict[str, float] = {}
    used = actor._old_logprobs(batch, metrics) * batch.response_mask  # what update() trains against
    assert metrics["actor/old_logprobs_recomputed"] == float(recomputed)
    assert metrics["actor/engine_logprob_gap_mean"] == pytest.approx(shift, abs=1e-4)
    expected = (policy + (0.0 if recomputed else shift)) * batch.response_mask
    torch.testing.assert_close(used, expected, atol=1e-4, rtol=0)
    assert actor.update(batch)["actor/old_logprobs_recomputed"] == float(recomputed)
