"""The policy's causal LM loaded from a Hugging Face folder: what the Actor trains and the Critic's value
model starts from (``trainer.model.critic.load_value_model``), in a module both import."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


def load_policy(path: str | Path, device: torch.device) -> nn.Module:
    """A causal LM from a Hugging Face folder with fp32 master weights (bf16 compute comes from autocast:
    AdamW steps of ~1e-6 would vanish in bf16 weights)."""
    from transformers import AutoModelForCausalLM

    if not Path(path).exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist; give a Hugging Face model folder")
    # nn.Module: transformers types its wrapped .to() as taking the model itself
    model: nn.Module = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return model.to(device)
