"""The tiny test model: a randomly initialised Llama of SmolLM2's shape with the real SmolLM2 tokenizer
and chat template (the ``tiny_model_dir`` fixture; benchmarks that need a small real model use it too)."""

from __future__ import annotations

from pathlib import Path

from agentloop.engine.models import _fix_tokenizer, smollm2_tokenizer_dir


def build_tiny_model(dir: Path, seed: int = 0) -> Path:
    """Save a tiny randomly initialised Llama of SmolLM2's shape + the real SmolLM2 tokenizer.

    2 layers, hidden 64, 4 heads / 2 kv heads, the full 49152 vocab, tied embeddings. The larger
    ``initializer_range`` makes the next-token distribution peaked, so greedy choices are not
    near-ties that float noise could flip (tests compare tokens exactly).
    """
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    tok = _fix_tokenizer(AutoTokenizer.from_pretrained(smollm2_tokenizer_dir()))
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,  # type: ignore[call-arg]
        tie_word_embeddings=True,
        initializer_range=0.5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float()
    model.save_pretrained(dir, safe_serialization=True)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(dir)
    tok.save_pretrained(dir)
    return dir
