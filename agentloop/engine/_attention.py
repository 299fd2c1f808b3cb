"""TorchEngine's attention: SDPA over the KV heads, without copying keys and values per query head.

With grouped-query attention (Qwen2-0.5B: 14 query heads on 2 KV heads) and an explicit mask,
transformers' ``sdpa`` path repeats every cached key and value once per query head
(``repeat_kv``) in each layer of each step: at batch 128 and 256 cached positions that is 60 MB per
tensor per layer, the largest cost of a decode step on an H100. Here the ``g`` query heads that
share a KV head are folded into the query-length axis instead, ``(b, h, q, d) -> (b, h_kv, g*q, d)``,
and the mask (shared by all heads) is tiled the same way, so SDPA reads each cached key once.
Registered as the attention implementation ``"agentloop_sdpa"``; the engine always passes a 4D mask.

On CUDA the engine also turns off SDPA's cuDNN backend (:func:`avoid_cudnn_attention`): cuDNN
builds an execution plan per new shape, and an engine's prefills come in new shapes all the time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import structlog
import torch
import torch.nn.functional as F

log = structlog.get_logger(__name__)

NAME = "agentloop_sdpa"


def grouped_sdpa(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``query`` (b, h, q, d), ``key``/``value`` (b, h_kv, k, d), ``attention_mask`` (b|1, 1, q, k) bool
    or additive; returns ``(b, q, h, d)`` as transformers' attention functions do."""
    if kwargs.get("softcap") is not None:
        raise ValueError("agentloop_sdpa does not support attention soft-capping")
    b, h, q, d = query.shape
    h_kv = key.shape[1]
    g = h // h_kv
    if g > 1:
        query = query.reshape(b, h_kv, g * q, d)  # head i*g + j uses KV head i (as repeat_kv orders them)
        if attention_mask is not None:
            m = attention_mask
            attention_mask = (
                m[:, :, None]
                .expand(m.shape[0], m.shape[1], g, q, m.shape[-1])
                .reshape(m.shape[0], m.shape[1], g * q, m.shape[-1])
            )
    causal = attention_mask is None and q > 1
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=causal
    )  # (b, h_kv, g*q, d)
    return out.reshape(b, h, q, value.shape[-1]).transpose(1, 2).contiguous(), None


def use_grouped_sdpa(model: Any) -> bool:
    """Switch ``model`` to :func:`grouped_sdpa` when it uses grouped-query attention through the
    standard attention interface; returns whether it did (older transformers: leave it as is)."""
    cfg = model.config
    n_heads = getattr(cfg, "num_attention_heads", None)
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_heads
    if not n_heads or n_kv == n_heads or getattr(cfg, "_attn_implementation", None) != "sdpa":
        return False
    try:
        from transformers import AttentionInterface
    except ImportError:
        return False
    AttentionInterface.register(NAME, grouped_sdpa)
    try:
        from transformers import AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask

        AttentionMaskInterface.register(NAME, sdpa_mask)
    except ImportError:
        pass
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(NAME)
    else:
        cfg._attn_implementation = NAME
    return True


def avoid_cudnn_attention() -> None:
    """Turn off SDPA's cuDNN backend for this process (``torch.backends.cuda.enable_cudnn_sdp(False)``);
    SDPA then picks the memory-efficient (or flash) kernel.

    Why: cuDNN's attention builds and caches an execution plan per input shape, and a prefill's
    shape (group size, prompt length after the prefix-cache hit, KV length) is new nearly every
    time. Measured on an H100 (torch 2.11, Qwen2-0.5B shape, 20 prefills of new shapes): 77-105 ms
    median per prefill with cuDNN allowed (up to 750 ms), 24-36 ms with the memory-efficient kernel,
    23-31 ms with cuDNN on shapes it had already planned. It is process-wide, as the GIL switch
    interval is; a trainer colocated in the same process, whose batch shapes vary too, is spared
    the same plan builds. A decode step's CUDA graph is captured with cuDNN allowed again
    (:func:`cudnn_attention`): its shape is fixed per graph, so the plan is built once, and the
    step was ~5% faster with it (3.84 vs 4.06 ms and 4.32 vs 4.52 ms, batch 128, two A/B pairs).
    """
    if torch.backends.cuda.cudnn_sdp_enabled():
        torch.backends.cuda.enable_cudnn_sdp(False)
        log.info("engine.cudnn_attention_off")


@contextlib.contextmanager
def cudnn_attention() -> Iterator[None]:
    """Allow SDPA's cuDNN backend inside the block (a CUDA-graph capture), then restore the setting."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
