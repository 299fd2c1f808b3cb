"""The Actor: logprob definition shared with the engine, micro-batch accumulation, a real update."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch

from agentloop.engine.base import SamplingParams
from agentloop.engine.torch.engine import TorchEngine
from agentloop.types import Triplet
from tests.trainer.samples import actor_config, small_batch, small_triplets
from trainer.algorithms import entropy_from_logits, logprobs_from_logits
from trainer.batch import build_batch
from trainer.model.actor import Actor


def test_response_logprobs_match_the_full_forward(tiny_model_dir: Path) -> None:
    """The head on response positions only (trainer/model/head.py) gives the full forward's logprobs and entropy."""
    actor = Actor(actor_config(tiny_model_dir), tiny_model_dir, "cpu")
    batch = small_batch()
    p, r = batch.prompt_length, batch.response_length
    full = actor.model(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
    ).logits[:, p - 1 : p + r - 1]
    logprobs, entropy = actor._forward(actor.model, batch, entropy=True)
    # fp32 bounds for the same statistics computed in another order. M = logit range + log2 V bounds every
    # |z - max| and |log p|; p = exp(z - lse) carries a relative error up to eps * M and a sum over the
    # V = 49152 logits adds log2(V) * eps of its terms' size (pairwise summation)
    eps, log2_v = torch.finfo(torch.float32).eps, full.shape[-1].bit_length()
    mag = float(full.max() - full.min()) + log2_v
    lp_atol = eps * (2 * mag + log2_v)  # logit - logsumexp: two values up to M rounded, lse's sum
    ent_atol = eps * mag * (mag + log2_v)  # logsumexp - sum(p * z): |z| <= M times p's error, and the sum
    torch.testing.assert_close(logprobs, logprobs_from_logits(full, batch.responses), atol=lp_atol, rtol=0)
    assert entropy is not None
    torch.testing.assert_close(entropy, entropy_from_logits(full), atol=ent_atol, rtol=0)


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
    actor = Actor(actor_config(tiny_model_dir), tiny_model_dir, "cpu")
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
    # the engine's forward has other shapes (one-token decode after a prefill): each logit comes out of ~1150
    # fp32 products summed along the tiny model's path (2 layers x (4 x 64 + T + 2 x 64 + 128) + 64 in the
    # head), typical error sqrt(1150) * eps * |logit|, |logit| <= 20, divided by T; a log-prob moves twice that
    lp_atol = 2 * 1150**0.5 * torch.finfo(torch.float32).eps * 20 / 0.7
    torch.testing.assert_close(
        actor.compute_logprobs(batch)[0, : len(response)], torch.tensor(engine_logprobs), atol=lp_atol, rtol=0
    )


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batches_accumulate_to_the_full_batch(tiny_model_dir: Path, agg: str) -> None:
    batch = small_batch()
    weights = []
    for budget in (10_000, 8):  # one micro-batch vs one sample per micro-batch
        actor = Actor(
            actor_config(tiny_model_dir, loss_agg_mode=agg, ppo_max_token_len_per_gpu=budget),
            tiny_model_dir,
            "cpu",
        )
        # plain SGD: the weight change is the (clipped) gradient itself, without Adam's sign-like noise
        actor.optimizer = torch.optim.SGD(actor.model.parameters(), lr=1.0)
        actor.update(batch)
        weights.append(actor.model.lm_head.weight.detach().clone())
    # w - g: the clipped gradient (terms up to grad_clip = 1) sums the batch's n tokens, each back-propagated
    # through sums over the V = 49152 logits, in other orders: typical error (sqrt(n) + sqrt(V)) * eps * 1;
    # each run rounds w once (1 ulp <= eps * |w|)
    eps = torch.finfo(torch.float32).eps
    g_atol = (int(batch.attention_mask.sum()) ** 0.5 + 49152**0.5) * eps * 1.0
    torch.testing.assert_close(weights[0], weights[1], atol=g_atol, rtol=2 * eps)


def test_update_moves_weights_only_with_a_signal(tiny_model_dir: Path) -> None:
    batch = small_batch()
    actor = Actor(actor_config(tiny_model_dir), tiny_model_dir, "cpu")
    before = actor.model.lm_head.weight.detach().clone()
    metrics = actor.update(batch)
    assert not torch.equal(before, actor.model.lm_head.weight)
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    assert metrics["actor/grad_norm"] > 0

    flat = [t.model_copy(update={"reward": 1.0}) for t in small_triplets()]  # equal rewards: zero advantage
    batch, _ = build_batch(flat, max_prompt_length=32, max_response_length=16)
    actor = Actor(actor_config(tiny_model_dir), tiny_model_dir, "cpu")
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
        actor_config(tiny_model_dir, use_engine_logprobs=True, engine_logprob_gap_limit=0.1),
        tiny_model_dir,
        "cpu",
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


def _shared_prompt_triplets() -> list[Triplet]:
    """Two GRPO groups of three attempts: each group shares its prompt (one shorter, so left-padded);
    responses of different lengths, one with masked tool tokens between two calls."""
    prompts = [[1, 5, 9, 13, 17, 21, 25], [2, 6, 10, 14]]
    responses = [
        [30, 31, 32, 33, 34],
        [40, 41],
        [50, 51, 52, 53, 54, 55, 56],
        [60, 61, 62],
        [70],
        [80, 81, 82, 83],
    ]
    triplets = []
    for i, response in enumerate(responses):
        mask = [1] * len(response)
        if len(response) == 7:
            mask[2:4] = [0, 0]  # a tool result between two calls
        triplets.append(
            Triplet(
                prompt_ids=prompts[i // 3],
                response_ids=response,
                response_mask=mask,
                reward=float(i % 3 == 0) + 0.5 * (i == 4),
                metadata={"group_id": i // 3, "temperature": 0.7},
            )
        )
    return triplets


def test_shared_prompt_forward_equals_the_plain_forward(tiny_model_dir: Path) -> None:
    """Each distinct prompt runs once, its keys and values shared by its rows; the log-probs, entropy
    and gradients are those of the plain forward, and the prompt's tokens go through the model once."""
    batch, _ = build_batch(_shared_prompt_triplets(), max_prompt_length=32, max_response_length=16)
    shared = Actor(actor_config(tiny_model_dir), tiny_model_dir, "cpu")
    plain = Actor(actor_config(tiny_model_dir, shared_prompt_forward=False), tiny_model_dir, "cpu")
    assert shared.shared_prompts and not plain.shared_prompts
    seen: list[int] = []  # tokens through the embedding, per forward
    hook = shared.model.get_input_embeddings().register_forward_hook(
        lambda m, i, o: seen.append(i[0].numel())
    )
    results = []
    for actor in (shared, plain):
        logprobs, entropy = actor._forward(actor.model, batch, entropy=True)
        assert entropy is not None
        (logprobs * batch.response_mask).sum().backward()
        grads = {n: p.grad.clone() for n, p in actor.model.named_parameters() if p.grad is not None}
        results.append((logprobs * batch.response_mask, entropy * batch.response_mask, grads))
    hook.remove()
    p, r = batch.prompt_length, batch.response_length
    assert seen == [2 * p, 6 * (r - 1)]  # two distinct prompts, then the responses on their cache
    eps = torch.finfo(torch.float32).eps
    # the same fp32 sums taken in another order (attention over a cache vs one sequence): each hidden state
    # sums ~1150 products (see test_trainer_logprobs_equal_the_engines) and a log-prob moves ~2x its logit
    # (|logit| <= 20, / T 0.7); the entropy as in test_response_logprobs_match_the_full_forward, at M ~ 60
    lp_atol = 2 * 1150**0.5 * eps * 20 / 0.7
    torch.testing.assert_close(results[0][0], results[1][0], atol=lp_atol, rtol=0)
    torch.testing.assert_close(results[0][1], results[1][1], atol=lp_atol * 60, rtol=0)
    assert results[0][2].keys() == results[1][2].keys()
    for name, grad in results[0][2].items():
        # a gradient sums the batch's ~60 tokens' contributions, each carrying the forward's error
        scale = float(results[1][2][name].abs().max())
        torch.testing.assert_close(
            grad, results[1][2][name], atol=lp_atol * 60**0.5 * max(scale, 1.0), rtol=0
        )


def test_shared_prompt_update_takes_the_plain_step(tiny_model_dir: Path) -> None:
    """A whole update with shared prompts moves the weights as the plain forward's update does."""
    batch, _ = build_batch(_shared_prompt_triplets(), max_prompt_length=32, max_response_length=16)
    weights = []
    for flag in (True, False):
        actor = Actor(actor_config(tiny_model_dir, shared_prompt_forward=flag), tiny_model_dir, "cpu")
        actor.optimizer = torch.optim.SGD(actor.model.parameters(), lr=1.0)
        metrics = actor.update(batch)
        assert metrics["actor/grad_norm"] > 0
        weights.append(actor.model.lm_head.weight.detach().clone())
    # as test_micro_batches_accumulate_to_the_full_batch: a clipped gradient summed in another order
    eps = torch.finfo(torch.float32).eps
    g_atol = (int(batch.attention_mask.sum()) ** 0.5 + 49152**0.5) * eps * 1.0
    torch.testing.assert_close(weights[0], weights[1], atol=g_atol, rtol=2 * eps)


def test_shared_prompt_forward_is_off_where_it_is_not_exact(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe turns the shortcut off for a model whose cached forward differs, or that keeps no cache."""
    import trainer.model.hidden as hidden_module

    real = hidden_module.shared_prompt_hidden

    def off_by_a_bit(*args: object, **kwargs: object) -> torch.Tensor | None:
        hidden = real(*args, **kwargs)  # type: ignore[arg-type]
        return None if hidden is None else hidden * 1.05

    monkeypatch.setattr(hidden_module, "shared_prompt_hidden", off_by_a_bit)
    assert not Actor(actor_config(tiny_model_dir), tiny_model_dir, "cpu").shared_prompts
    monkeypatch.setattr(hidden_module, "shared_prompt_hidden", real)
    config = actor_config(tiny_model_dir)
    config.actor_rollout_ref.model.enable_gradient_checkpointing = True
    assert not Actor(config, tiny_model_dir, "cpu").shared_prompts
    assert Actor(actor_config(tiny_model_dir), tiny_model_dir, "cpu").shared_prompts
