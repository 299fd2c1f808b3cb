"""Random-weight models of real shapes, built locally (the GPU machine has no hub)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

QWEN2_05B: dict[str, Any] = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)
# the same body with the SmolLM2 tokenizer's vocabulary: every id it samples decodes (the proxy refuses
# ids outside the tokenizer, so agents that go through it need this one)
QWEN2_05B_SMOL_VOCAB: dict[str, Any] = {**QWEN2_05B, "vocab_size": 49152}
RANDOM_CONFIGS = {"qwen2-0.5b": QWEN2_05B, "qwen2-0.5b-smol-vocab": QWEN2_05B_SMOL_VOCAB}


def build_random_model(name: str, out: str | Path | None = None, seed: int = 0) -> Path:
    """Save a random bf16 Qwen2 of ``RANDOM_CONFIGS[name]``'s shape with the SmolLM2 tokenizer (its
    ids fit the larger vocab) to ``out`` (default: a folder under the temp dir); reused if present."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from agentloop.engine.models import _fix_tokenizer, smollm2_tokenizer_dir

    if name not in RANDOM_CONFIGS:
        raise ValueError(f"unknown random config {name!r}; expected one of {sorted(RANDOM_CONFIGS)}")
    path = Path(out or Path(tempfile.gettempdir()) / f"agentloop-random-{name}")
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return path
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**RANDOM_CONFIGS[name])).to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(tmp, safe_serialization=True)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(tmp)
    _fix_tokenizer(AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())).save_pretrained(tmp)
    del model
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    return path
