"""The decoder's attention mask built on the device, so that a training forward reads nothing back.

Given a 2D padding mask, transformers decides whether SDPA may skip the mask by reading it back
(``masking_utils._ignore_causal_mask_sdpa``: ``padding_mask.sum() == numel``, twice a forward). On a
GPU each read-back makes the host wait for every queued kernel (the previous micro-batch's backward),
and the GPU then idles while the host queues the next forward. The trainer knows on the host whether a
micro-batch holds padding (``Batch.fully_real``); when it does, it passes the 4D boolean mask that
transformers would have built (causal and key padding), which transformers uses as it is. Compiled
layers always get padding (``compiled.model_inputs``), so their forwards read nothing back.
"""

from __future__ import annotations

import torch
from torch import nn


def attention_mask_for(model: nn.Module, attention_mask: torch.Tensor, fully_real: bool) -> torch.Tensor:
    """The attention mask to hand ``model``'s forward for (b, T) rows that hold all T positions (no KV
    cache), given their (b, T) padding mask:

    - padding, under plain causal SDPA: the (b, 1, T, T) boolean mask, True where a query attends to a
      key (an earlier or the same position that is not padding), which transformers uses as it is and
      reads nothing back;
    - ``fully_real`` (no padding) or another kind of attention (a sliding window, eager): the 2D mask.
      Without padding transformers reads the mask back once, finds no padding and takes SDPA's causal
      path (a faster kernel than a masked one); passing no mask would not spare the read-back, as
      transformers then checks the positions for packed sequences.
    """
    if fully_real or not _plain_causal_sdpa(model):
        return attention_mask
    width = attention_mask.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=attention_mask.device).tril()  # (T, T)
    return causal & attention_mask.bool()[:, None, None, :]  # (b, 1, T, T)


# decoders whose SDPA layers take a prepared 4D mask as the one they would build from a 2D mask,
# checked bit for bit (tests/trainer/model/test_attention_mask.py); others (composite models such as Gemma 3,
# ALiBi, sliding windows) keep the 2D mask
EXACT_4D_MASK_MODELS = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma", "phi3", "olmo2", "smollm3", "granite"}
)


def _plain_causal_sdpa(model: nn.Module) -> bool:
    """Whether ``model`` is a decoder of ``EXACT_4D_MASK_MODELS`` whose every layer runs SDPA over a plain
    causal mask: no sliding window, no chunked attention (those layers build masks of their own, which a
    prepared 4D mask would replace)."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) not in EXACT_4D_MASK_MODELS:
        return False
    if getattr(cfg, "_attn_implementation", None) != "sdpa":
        return False
    if getattr(cfg, "sliding_window", None) or getattr(cfg, "attention_chunk_size", None):
        return False
    layer_types = getattr(cfg, "layer_types", None)
    return layer_types is None or all(kind == "full_attention" for kind in layer_types)
