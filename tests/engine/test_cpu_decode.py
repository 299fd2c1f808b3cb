"""The hand-written CPU decode step (agentloop/engine/torch/_cpu_decode.py) reproduces transformers' forward."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from agentloop.engine.base import SamplingParams
from agentloop.engine.models import cache_argument
from agentloop.engine.torch._cpu_decode import CpuDecoder, PackedLinear, supports
from agentloop.engine.torch._decode import ModelRunner
from agentloop.engine.torch._kv import SlotKVCache
from agentloop.engine.torch.engine import TorchEngine

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _linears(bias: list[bool], seed: int = 0) -> list[torch.nn.Linear]:
    torch.manual_seed(seed)
    return [torch.nn.Linear(16, out, bias=b) for out, b in zip((8, 4, 4), bias, strict=True)]


@pytest.mark.parametrize("n", [1, 3, 4, 7, 8, 9, 20])
@pytest.mark.parametrize("bias", [[False] * 3, [True, True, False]])
def test_packed_linear_equals_the_modules_it_fuses(n: int, bias: list[bool]) -> None:
    """Rows == 8 use the packed GEMM, 4..7 are zero-padded to 8, fewer or more fall back."""
    lins = _linears(bias)
    fused = PackedLinear(lins, rows=8)
    x = torch.randn(n, 16)
    with torch.no_grad():
        ref = torch.cat([lin(x) for lin in lins], dim=-1)
    torch.testing.assert_close(fused(x), ref, atol=1e-5, rtol=1e-5)


def test_packed_linear_refresh_follows_in_place_weight_changes() -> None:
    lins = _linears([True, False, True])
    fused = PackedLinear(lins, rows=4)
    x = torch.randn(4, 16)
    with torch.no_grad():
        lins[1].weight.mul_(3.0)
        lins[2].bias.add_(1.0)
        ref = torch.cat([lin(x) for lin in lins], dim=-1)
    assert not torch.allclose(fused(x), ref)  # still the old, packed copy
    fused.refresh()
    torch.testing.assert_close(fused(x), ref, atol=1e-5, rtol=1e-5)


def _tiny_qwen2() -> Any:
    """A random Qwen2 (grouped-query attention with q/k/v biases) with non-zero biases."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, use_sliding_window=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model


def _tiny_llama(tiny_model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa").float().eval()


def _decode_logits_both_ways(model: Any, rows: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill ``batch`` prompts of different lengths with transformers, then one decode step with
    CpuDecoder and the same step with transformers' forward over the same cache."""
    cache = SlotKVCache.for_model(model, rows, 256, torch.float32, torch.device("cpu"))
    kw = cache_argument(model)  # transformers' name for it differs across versions
    runner = ModelRunner(model, cache, kw, rows, 256, torch.device("cpu"), cuda_graphs=False)
    assert runner.decoder is not None
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    prompts = [torch.randint(0, vocab, (5 + 3 * i,), generator=g).tolist() for i in range(batch)]
    with torch.inference_mode():
        runner.prefill(0, prompts, [0] * batch)
        ids = torch.randint(0, vocab, (batch,), generator=g)
        pos = torch.tensor([len(p) for p in prompts])
        kv_len = int(pos.max()) + 1
        fast = runner.decoder.forward(ids, pos, kv_len)
        cache.set_decode(pos, kv_len)
        mask = (torch.arange(kv_len)[None, :] <= pos[:, None])[:, None, None, :]
        out = model(input_ids=ids[:, None], position_ids=pos[:, None], attention_mask=mask, use_cache=True,
                    **{kw: cache})  # fmt: skip
    return fast, out.logits[:, -1].float()


@pytest.mark.parametrize("batch", [1, 3, 4])  # 1: plain GEMMs; 3: padded to the packed 4 rows; 4: packed
def test_llama_decode_step_matches_transformers(tiny_model_dir: Path, batch: int) -> None:
    fast, ref = _decode_logits_both_ways(_tiny_llama(tiny_model_dir), rows=4, batch=batch)
    torch.testing.assert_close(fast, ref, atol=1e-4, rtol=1e-4)


def test_qwen2_decode_step_with_biases_matches_transformers() -> None:
    model = _tiny_qwen2()
    assert supports(model)
    fast, ref = _decode_logits_both_ways(model, rows=4, batch=4)
    torch.testing.assert_close(fast, ref, atol=1e-4, rtol=1e-4)


def test_unsupported_models_keep_transformers_forward() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    assert not supports(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)))
    windowed = _tiny_qwen2()
    windowed.config.use_sliding_window, windowed.config.sliding_window = True, 16
    assert not supports(windowed)
    with pytest.raises(ValueError, match="does not support"):
        CpuDecoder(
            windowed, SlotKVCache.for_model(windowed, 2, 64, torch.float32, torch.device("cpu")), rows=2
        )


async def test_engine_output_after_a_weight_update_matches_transformers_forward(
    tiny_model_dir: Path, chat_prompt: list[int]
) -> None:
    """update_weights re-packs the decoder's copies: the fast and the plain engine stay identical."""
    fast = TorchEngine(tiny_model_dir, max_batch_size=4)
    plain = TorchEngine(tiny_model_dir, max_batch_size=4, cpu_decoder=False)
    assert fast._runner.decoder is not None and plain._runner.decoder is None
    torch.manual_seed(3)
    names = ["model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight", "lm_head.weight"]
    update = {
        n: torch.randn_like(dict(fast.model.named_parameters(remove_duplicate=False))[n]) for n in names
    }
    try:
        before = await fast.generate(chat_prompt, GREEDY)
        for eng in (fast, plain):
            await eng.update_weights(update)
        got, want = await fast.generate(chat_prompt, GREEDY), await plain.generate(chat_prompt, GREEDY)
    finally:
        await fast.stop()
        await plain.stop()
    assert got.token_ids == want.token_ids != before.token_ids
    assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True)) < 1e-3
