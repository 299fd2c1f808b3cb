"""grouped_sdpa (agentloop/engine/torch/_attention.py) equals SDPA over repeated KV heads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from agentloop.engine.torch._attention import (
    avoid_cudnn_attention,
    cudnn_attention,
    grouped_sdpa,
    use_grouped_sdpa,
)


@pytest.mark.parametrize("q", [1, 5])
def test_grouped_equals_repeated_heads(q: int) -> None:
    g = torch.Generator().manual_seed(0)
    b, h, h_kv, k, d = 3, 6, 2, 9, 4
    query = torch.randn(b, q, h, d, generator=g).transpose(1, 2)  # non-contiguous, as models pass it
    key, value = torch.randn(b, h_kv, k, d, generator=g), torch.randn(b, h_kv, k, d, generator=g)
    pos = torch.tensor([[4, 6, 8], [2, 3, 4], [8, 8, 8]])[:, :1] + torch.arange(q)  # (b, q)
    mask = (torch.arange(k)[None, None, :] <= pos[:, :, None])[:, None]  # (b, 1, q, k)
    out, _ = grouped_sdpa(None, query, key, value, mask, scaling=0.5)
    ref = F.scaled_dot_product_attention(
        query,
        key.repeat_interleave(h // h_kv, 1),
        value.repeat_interleave(h // h_kv, 1),
        attn_mask=mask,
        scale=0.5,
    ).transpose(1, 2)
    assert out.shape == (b, q, h, d)
    torch.testing.assert_close(out, ref)


def test_model_logits_are_unchanged(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa")
    grouped = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa")
    assert plain.config.num_key_value_heads < plain.config.num_attention_heads  # the tiny model uses GQA
    assert use_grouped_sdpa(grouped)
    ids = torch.randint(0, 1000, (2, 7))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    with torch.no_grad():
        a = plain(input_ids=ids, attention_mask=mask).logits
        b = grouped(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(a[0, 2:], b[0, 2:])
    torch.testing.assert_close(a[1], b[1])


def test_avoid_cudnn_attention_turns_the_backend_off_once() -> None:
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        avoid_cudnn_attention()
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        avoid_cudnn_attention()  # already off: stays off
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def test_cudnn_attention_allows_it_inside_and_restores_the_setting() -> None:
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(False)
        with cudnn_attention():
            assert torch.backends.cuda.cudnn_sdp_enabled()
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        with pytest.raises(RuntimeError), cudnn_attention():
            raise RuntimeError("a failed capture")
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the CUDA flash path of chunk_attention needs a GPU"
)
@pytest.mark.parametrize("cached", [0, 300])
def test_chunk_attention_on_cuda_equals_the_masked_attention(cached: int) -> None:
    """A prefill chunk of 200 new tokens after ``cached`` ones, 14 query heads on 2 KV heads, bf16: the two
    flash passes merged by log-sum-exp against SDPA with the dense mask, both from the same bf16 inputs.
    bf16 keeps 8 bits: outputs of size ~1 agree to a few bf16 ulps (2^-8 each), the merge adds one more."""
    from agentloop.engine.torch._attention import _sdpa, chunk_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    q_len, k_len = 200, cached + 200
    query = torch.randn(1, 14, q_len, 64, device="cuda", generator=g).bfloat16()
    key = torch.randn(1, 2, k_len, 64, device="cuda", generator=g).bfloat16()
    value = torch.randn(1, 2, k_len, 64, device="cuda", generator=g).bfloat16()
    causal = torch.ones(q_len, q_len, dtype=torch.bool, device="cuda").tril()
    mask = torch.cat([causal.new_ones(q_len, cached), causal], dim=-1)[None, None]
    want = _sdpa(query, key, value, mask, 0.0, None).float()
    got = chunk_attention(query, key, value, None).float()
    assert got.shape == want.shape == (1, 14, q_len, 64)
    torch.testing.assert_close(got, want, atol=4 * 2**-8, rtol=4 * 2**-8)
