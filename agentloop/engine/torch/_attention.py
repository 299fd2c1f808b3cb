"""TorchEngine's attention: SDPA over the KV heads, without copying keys and values per query head.

With grouped-query attention (Qwen2-0.5B: 14 query heads on 2 KV heads) and an explicit mask,
transformers' ``sdpa`` path repeats every cached key and value once per query head
(``repeat_kv``) in each layer of each step: at batch 128 and 256 cached positions that is 60 MB per
tensor per layer, the largest cost of a decode step on an H100. Here the ``g`` query heads that
share a KV head are folded into the query-length axis instead, ``(b, h, q, d) -> (b, h_kv, g*q, d)``,
and the mask (shared by all heads) is tiled the same way, so SDPA reads each cached key once.
Registered as the attention implementation ``"agentloop_sdpa"``; the engine always passes a 4D mask.
A prefill of one sequence passes no mask at all (:func:`chunk_attention`).

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


# The engine's prefill of one sequence passes this keyword (transformers hands a model's extra keywords
# down to the attention function) and a zero-width 4D mask, ``(1, 1, q, 0)``: transformers takes a 4D
# mask as it is, and should the keyword not arrive, SDPA refuses that mask instead of attending
# without one. The shapes say the rest (chunk_attention).
CHUNK_KW = "agentloop_chunk"

# CPU flash attention that also returns the log-sum-exp of each query's scores (private in torch
# 2.x; the public SDPA does not return it). Without it chunk_attention builds the full mask instead.
_cpu_flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
# its CUDA sibling (fp16/bf16; query and key heads equal): the same two mask-free passes on a GPU
_cuda_flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention", None)


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
    or additive; returns ``(b, q, h, d)`` as transformers' attention functions do. With ``CHUNK_KW``
    the mask covers only the last ``q`` keys (:func:`chunk_attention`)."""
    if kwargs.get("softcap") is not None:
        raise ValueError("agentloop_sdpa does not support attention soft-capping")
    if kwargs.get(CHUNK_KW):  # the mask is a zero-width placeholder: the shapes say it all
        return chunk_attention(query, key, value, scaling).transpose(1, 2).contiguous(), None
    return _sdpa(query, key, value, attention_mask, dropout, scaling).transpose(1, 2).contiguous(), None


def _sdpa(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
    dropout: float = 0.0, scaling: float | None = None,
) -> torch.Tensor:  # fmt: skip
    """SDPA over the KV heads; returns ``(b, h, q, d)``."""
    b, h, q, d = query.shape
    h_kv = key.shape[1]
    g = h // h_kv
    if g > 1 and q > 1 and (query.device.type == "cpu" or attention_mask is None):
        # a CPU prefill: SDPA's own grouped-query path reads each KV head once too, and the mask is
        # not copied g times (a decode step's query of 1 is folded: one bigger GEMM per KV head).
        # Without a mask (a plain causal forward of the model) folding is wrong anywhere: is_causal
        # would count the folded rows as positions
        causal = attention_mask is None
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=causal,
            enable_gqa=True,
        )  # fmt: skip
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
    return out.reshape(b, h, q, value.shape[-1])


def chunk_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None
) -> torch.Tensor:
    """Attention of a prefill chunk of one sequence: ``query`` (b, h, q, d) holds the new tokens at
    positions ``p..p+q-1``, ``key``/``value`` (b, h_kv, p+q, d) the ``p`` cached ones before them and
    the new ones; every cached key is visible to every new query, the new ones causally. Returns
    ``(b, h, q, d)``.

    Why: a dense mask over the whole context is ``q x (p+q)`` per forward, converted and tiled per
    layer (a 12k-token prompt: 150 M mask entries, ~60% of the prefill's time on a CPU), and SDPA
    with a mask cannot skip the masked half. On a CPU this runs two mask-free flash attentions, the
    cached keys (no mask) and the new ones (causal, square), and merges them by their log-sum-exps:
    ``out = sum_i exp(lse_i - lse) out_i``, ``lse = logaddexp(lse_1, lse_2)``; exact up to rounding.
    On a GPU in fp16/bf16 the same two passes run on CUDA's flash kernel (the keys and values repeated
    per query head: that kernel takes equal heads); a dense mask there took SDPA off flash attention
    and made a 32k prefill 6x slower than transformers' causal forward (H200). Elsewhere (fp32 on a
    GPU, a torch without the kernels) it builds the full mask and calls SDPA.
    """
    q = query.shape[-2]
    p = key.shape[-2] - q
    if query.device.type == "cpu" and _cpu_flash is not None:
        # the kernel's own grouped-query path (query heads i*g..i*g+g-1 on KV head i): measured faster
        # here than folding the query heads into the length axis
        def cpu(k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
            out, lse = _cpu_flash(query, k, v, 0.0, causal, scale=scaling)[:2]
            return out, lse

        return _two_passes(query, key, value, p, cpu)
    if (
        query.device.type == "cuda"
        and query.dtype in (torch.float16, torch.bfloat16)
        and _cuda_flash is not None
    ):
        g = query.shape[1] // key.shape[1]
        if g > 1:  # (b, h_kv, k, d) -> (b, h, k, d): head i*g + j uses KV head i, as repeat_kv orders them
            key, value = key.repeat_interleave(g, dim=1), value.repeat_interleave(g, dim=1)

        def cuda(k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
            out, lse = _cuda_flash(query, k, v, 0.0, causal, False, scale=scaling)[:2]
            return out, lse

        return _two_passes(query, key, value, p, cuda)
    causal = torch.ones(q, q, dtype=torch.bool, device=query.device).tril()
    full = torch.cat([causal.new_ones(q, p), causal], dim=-1)[None, None]  # (1, 1, q, p + q)
    return _sdpa(query, key, value, full, 0.0, scaling)


def _two_passes(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, p: int, flash: Any
) -> torch.Tensor:
    """The new keys causally and the ``p`` cached ones without a mask, merged by log-sum-exp
    (``flash(k, v, causal) -> (out (b, h, q, d), lse (b, h, q))``)."""
    new, lse_new = flash(key[:, :, p:], value[:, :, p:], True)
    if p == 0:
        return new
    old, lse_old = flash(key[:, :, :p], value[:, :, :p], False)
    lse = torch.logaddexp(lse_old, lse_new)  # (b, h, q) fp32
    w_old, w_new = (lse_old - lse).exp_()[..., None], (lse_new - lse).exp_()[..., None]
    return (old.float() * w_old + new.float() * w_new).to(query.dtype)


def use_grouped_sdpa(model: Any) -> bool:
    """Switch ``model`` to :func:`grouped_sdpa` when it runs SDPA through the standard attention
    interface (grouped-query or not: the chunked prefill needs it too); returns whether it did
    (older transformers, other attention implementations: left as they are, and the engine passes
    full masks)."""
    cfg = model.config
    if not getattr(cfg, "num_attention_heads", None) or getattr(cfg, "_attn_implementation", None) != "sdpa":
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
