"""The forward shortcuts' probes (trainer/model/hidden.py): the LM head on the response positions only, taken
where ``decoder(x) @ head.weight.T`` is the model's logits up to float rounding; each distinct prompt run
once, taken where the cached forward equals the plain one, sliding windows included."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from agentloop.types import Triplet
from tests.trainer.samples import actor_config
from trainer.batch import build_batch
from trainer.model.actor import Actor
from trainer.model.hidden import head_rounding_bound, head_shortcut_is_exact

EPS32 = torch.finfo(torch.float32).eps
TINY = dict(  # the test models' shape: vocabulary 256, 2 layers of width 32
    vocab_size=256,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def test_head_rounding_bound_by_hand() -> None:
    """h = (1, -2), head rows (3, 1) and (0.5, 0.25): logits 1 and 0, products' absolute sums 5 and 1;
    the bound is u_out |logit| + 2 sqrt(d) u32 (1 + u_out) x that sum, d = 2."""
    hidden = torch.tensor([[1.0, -2.0]])
    weight = torch.tensor([[3.0, 1.0], [0.5, 0.25]])
    u32 = 2.0**-24
    for dtype, u_out in ((torch.float32, u32), (torch.bfloat16, 2.0**-8)):
        shortcut, bound = head_rounding_bound(hidden, weight, dtype)
        assert shortcut.tolist() == [[1.0, 0.0]]
        rounding = 2 * math.sqrt(2) * u32 * (1 + u_out)
        want = torch.tensor([[u_out * 1 + rounding * 5, rounding * 1]])
        torch.testing.assert_close(bound, want, rtol=4 * EPS32, atol=0)


def _granite(path: Path, logits_scaling: float) -> nn.Module:
    """A tiny Granite: its logits are ``head(h) / logits_scaling``, a logit scale no common config key names."""
    from transformers import AutoModelForCausalLM, GraniteConfig

    config = GraniteConfig(logits_scaling=logits_scaling, tie_word_embeddings=False, **TINY)  # type: ignore[arg-type]
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("logits_scaling", "exact"),
    # 1 / 0.9901 = 1.00999 and 1 / 1.0099 = 0.99020: logits 0.99% off, which the probe's former
    # tolerance (1e-2 of the largest logit) let through; the comment said 1% failed
    [(1.0, True), (0.9901, False), (1.0099, False)],
)
def test_head_probe_catches_a_one_percent_logit_scale(
    tmp_path: Path, dtype: torch.dtype, logits_scaling: float, exact: bool
) -> None:
    """A 1% scale moves a logit 1.6e5 float32 unit roundoffs, and 2.6 bf16 ones (bf16 logits then round
    twice, in the head and in the division, which leaves 1% - 2 x 0.39% at worst and 2.6 u on most
    logits): caught in both dtypes, while the unscaled model passes in both."""
    model = _granite(tmp_path, logits_scaling).to(dtype)
    assert head_shortcut_is_exact(model, torch.device("cpu")) is exact


def test_head_probe_takes_an_exact_head_that_sums_in_another_order(tiny_model_dir: Path) -> None:
    """Another CPU's (AVX2, AVX-512) or a GPU's kernel sums a logit's d products in its own order: a head
    that adds its two halves' products separately is still exact, in float32 (one rounding per sum) and
    on the tiny SmolLM2-shaped model in bf16."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    head = model.get_output_embeddings()
    half = head.weight.shape[1] // 2

    def two_halves(x: torch.Tensor) -> torch.Tensor:
        w = head.weight
        return x[..., half:] @ w[:, half:].T + x[..., :half] @ w[:, :half].T

    assert head_shortcut_is_exact(model, torch.device("cpu"))
    head.forward = two_halves  # type: ignore[method-assign]
    assert type(head) is nn.Linear and head_shortcut_is_exact(model, torch.device("cpu"))
    del head.forward
    assert head_shortcut_is_exact(model.to(torch.bfloat16), torch.device("cpu"))


# ------------------------------------------------------------ sliding windows and the shared prompt


def _sliding(kind: str, window: int | None) -> Any:
    from transformers import Gemma2Config, MistralConfig, Qwen2Config

    if kind == "mistral":
        return MistralConfig(sliding_window=window, **TINY)  # type: ignore[arg-type]
    if kind == "qwen2":  # every layer slides (max_window_layers=0)
        on = window is not None
        return Qwen2Config(use_sliding_window=on, sliding_window=window, max_window_layers=0, **TINY)  # type: ignore[arg-type]
    # local (sliding) and global layers in turn; no soft-capping of the logits, so the head shortcut holds
    return Gemma2Config(sliding_window=window or 4096, head_dim=8, final_logit_softcapping=None, **TINY)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["mistral", "qwen2", "gemma2"])
def test_shared_prompts_stay_on_for_sliding_windows_and_equal_the_plain_forward(
    tmp_path: Path, kind: str
) -> None:
    """The decision: sliding-window models keep the shared-prompt forward. The probe's rows are 11 tokens,
    so a real window (4096, 512) never slides in it; a window of 4 does, and so do these batches'
    sequences of up to 21 tokens (prompts of 12 and 9 tokens, the 9 left-padded, shared by 3 rows each):
    log-probs, entropies and gradients equal the plain forward's, and the window does change them."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (12, 9)]
    triplets = [
        Triplet(
            prompt_ids=prompts[i // 3],
            response_ids=[rng.randrange(3, 256) for _ in range(4 + i)],
            reward=float(i % 2),
            metadata={"group_id": i // 3},
        )
        for i in range(6)
    ]
    batch, _ = build_batch(triplets, max_prompt_length=16, max_response_length=16)
    from transformers import AutoModelForCausalLM

    results = {}
    for window, shared in ((4, True), (4, False), (None, False)):
        folder = tmp_path / f"{window}"
        if not folder.exists():
            torch.manual_seed(0)  # the same weights with and without a window
            AutoModelForCausalLM.from_config(_sliding(kind, window)).float().save_pretrained(folder)
        actor = Actor(actor_config(folder, shared_prompt_forward=shared), folder, "cpu")
        assert actor.fused_head and actor.shared_prompts is shared  # the probe keeps the shortcut
        logprobs, entropy = actor._forward(actor.model, batch, entropy=True)
        assert entropy is not None
        (logprobs * batch.response_mask).sum().backward()
        grads = {n: p.grad for n, p in actor.model.named_parameters() if p.grad is not None}
        results[window, shared] = (
            (logprobs * batch.response_mask).detach(),
            entropy * batch.response_mask,
            grads,
        )
    # as tests/trainer/model/test_actor.py: the same fp32 sums in another order (attention over a cache). A hidden
    # state sums layers x (6 d + T + d_ff) + d products (2 x (192 + 21 + 64) + 32 = 586), a log-prob moves
    # ~2x its logit's error, of size M at most; the entropy, a sum of p x log p, up to M times that
    mag = float(results[4, False][0].abs().max()) + 8  # M: the largest |log p| + log2 V (V = 256)
    lp_atol = 2 * 586**0.5 * EPS32 * mag
    shared_lp, shared_ent, shared_grads = results[4, True]
    plain_lp, plain_ent, plain_grads = results[4, False]
    torch.testing.assert_close(shared_lp, plain_lp, atol=lp_atol, rtol=0)
    torch.testing.assert_close(shared_ent, plain_ent, atol=lp_atol * mag, rtol=0)
    assert shared_grads.keys() == plain_grads.keys()
    tokens = int(batch.response_mask.sum())
    for name, grad in shared_grads.items():  # a gradient sums the tokens' contributions, each as off
        scale = max(float(plain_grads[name].abs().max()), 1.0)
        torch.testing.assert_close(grad, plain_grads[name], atol=lp_atol * tokens**0.5 * scale, rtol=0)
    # the window is exercised: without it the same weights score the tokens far apart
    assert float((results[None, False][0] - plain_lp).abs().max()) > 1000 * lp_atol
