"""The Actor's policy is the sampling policy: temperature per token, the LM-head shortcut only where
it equals the model's forward, and metrics averaged over the tokens that trained."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from agentloop.types import Triplet
from tests.trainer.samples import actor_config
from trainer.algorithms import entropy_from_logits, logprobs_from_logits
from trainer.batch import build_batch
from trainer.model.actor import Actor

# fp32 log-softmax over V=49152 logits of magnitude <= ~30 (the tiny model's peaked init): the
# chunked head and the full forward sum in different orders, each term rounding at ~30 * 2^-24 and
# the logsumexp over V adding ~log2(V) ~ 16 such roundings: ~3e-5; 2e-4 leaves room for any x86 CPU.
ATOL = 2e-4


def _mixed_temperature_batch() -> tuple[list[Triplet], list[float]]:
    temps = [0.7, 1.3, 0.0, 1.0]  # 0.0: a greedy call, whose log-probs are the raw logits'
    triplets = [
        Triplet(
            prompt_ids=[1, 5, 9, 13][: 2 + i % 3],
            response_ids=[20, 21, 22, 23][: 4 - i % 2],
            reward=float(i % 2),
            metadata={"group_id": i // 2, "temperature": t},
        )
        for i, t in enumerate(temps)
    ]
    return triplets, temps


def test_logprobs_and_entropy_are_those_of_each_calls_temperature(tiny_model_dir: Path) -> None:
    actor = Actor(actor_config(tiny_model_dir), tiny_model_dir, "cpu")
    assert actor.fused_head  # a Llama's logits are hidden @ head.T: the chunked head path is used
    triplets, temps = _mixed_temperature_batch()
    batch, _ = build_batch(triplets, max_prompt_length=32, max_response_length=16)
    p, r = batch.prompt_length, batch.response_length
    with torch.no_grad():
        full = actor.model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
        ).logits[:, p - 1 : p + r - 1]
        divisor = torch.tensor([t if t > 0 else 1.0 for t in temps])[:, None, None]
        logprobs, entropy = actor._forward(actor.model, batch, entropy=True)
    m = batch.response_mask.bool()
    expected = logprobs_from_logits(full / divisor, batch.responses)
    torch.testing.assert_close(logprobs[m], expected[m], atol=ATOL, rtol=0)
    assert entropy is not None
    torch.testing.assert_close(entropy[m], entropy_from_logits(full / divisor)[m], atol=ATOL, rtol=0)
    # and they are not the T=1 policy's: the 0.7 and 1.3 rows differ from the raw log-probs
    raw = logprobs_from_logits(full, batch.responses)
    assert (logprobs[:2][m[:2]] - raw[:2][m[:2]]).abs().max() > 100 * ATOL


def _tiny(kind: str, path: Path) -> Path:
    from transformers import AutoModelForCausalLM, GraniteConfig, Qwen2Config

    common = dict(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    if kind == "granite":  # logits = head(h) / logits_scaling: not hidden @ head.T
        config = GraniteConfig(logits_scaling=8.0, tie_word_embeddings=False, **common)  # type: ignore[arg-type]
    else:
        config = Qwen2Config(tie_word_embeddings=True, **common)  # type: ignore[arg-type]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize(("kind", "shortcut"), [("granite", False), ("qwen2", True)])
def test_lm_head_shortcut_only_where_it_equals_the_forward(kind: str, shortcut: bool, tmp_path: Path) -> None:
    model_dir = _tiny(kind, tmp_path / kind)
    actor = Actor(actor_config(model_dir), model_dir, "cpu")
    assert actor.fused_head is shortcut
    triplets = [
        Triplet(prompt_ids=[3, 4, 5], response_ids=[6, 7, 8], reward=1.0, metadata={"temperature": 0.7})
    ]
    batch, _ = build_batch(triplets, max_prompt_length=8, max_response_length=8)
    with torch.no_grad():
        full = actor.model(input_ids=batch.input_ids).logits[:, 2:5] / 0.7
    torch.testing.assert_close(
        actor.compute_logprobs(batch), logprobs_from_logits(full, batch.responses), atol=ATOL, rtol=0
    )


def test_clip_frac_and_approx_kl_average_over_the_tokens_that_trained(tiny_model_dir: Path) -> None:
    """Old log-probs 0.1 above the policy's on every token: approx_kl = mean(old - new) = 0.1 on the
    first step, although one group (all rewards equal) has zero advantages and is skipped."""
    cfg = actor_config(tiny_model_dir, use_engine_logprobs=True, engine_logprob_gap_limit=1.0)
    actor = Actor(cfg, tiny_model_dir, "cpu")
    triplets = [
        Triplet(prompt_ids=[1, 5, 9], response_ids=[20, 21, 22], reward=r, metadata={"group_id": g})
        for g, r in ((0, 0.0), (0, 1.0), (1, 1.0), (1, 1.0))
    ]
    batch, _ = build_batch(triplets, max_prompt_length=32, max_response_length=16)
    batch.engine_logprobs = (actor.compute_logprobs(batch) + 0.1) * batch.response_mask
    metrics = actor.update(batch)
    assert metrics["actor/active_samples"] == 2.0
    assert metrics["actor/approx_kl"] == pytest.approx(0.1, abs=1e-4)


def test_head_probe_survives_a_non_linear_head(tiny_model_dir: Path) -> None:
    actor = Actor(actor_config(tiny_model_dir), tiny_model_dir, "cpu")
    from trainer.model.hidden import head_shortcut_is_exact

    actor.model.lm_head = nn.Sequential(actor.model.lm_head)  # type: ignore[assignment]
    assert head_shortcut_is_exact(actor.model, actor.device) is False
