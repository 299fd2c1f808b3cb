"""Log-probs and entropy of the response tokens straight from the final hidden states, chunked.

The LM head of a 150k-vocabulary model turns ``(N, d)`` hidden states into ``(N, V)`` logits: at
12k response tokens that is 3.7 GB in bf16 and 7.5 GB as fp32, and the plain path
(``head(hidden)`` -> log_softmax -> gather, entropy, and autograd saving all of it) makes a dozen
passes over such tensors in the forward and again in the backward. Here the head runs on
``chunk_tokens`` rows at a time; the forward keeps only ``(N,)`` statistics (logsumexp, the
sampled token's logprob, the entropy) and the backward recomputes each chunk's logits and turns
them straight into the gradient of the hidden states and of the head weight. The logits never
exist for more than one chunk, and with ``compile=True`` (CUDA) the per-chunk statistics are one
fused kernel instead of a chain of memory-bound passes.

Same numerics as ``head(hidden).float()`` -> ``logprobs_from_logits`` / ``entropy_from_logits``
(trainer/algorithms/__init__.py): the matmul in ``compute_dtype``, everything after it in fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from trainer.model import compiled

DEFAULT_CHUNK_TOKENS = 4096

StatsFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
GradFn = Callable[..., torch.Tensor]


def _chunk_stats(z: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits (c, V) and token ids (c,) -> logsumexp, log-prob of the id, entropy; each (c,) fp32."""
    z = z.float()
    m = z.max(dim=-1, keepdim=True).values  # shift so large logits do not cancel in fp32
    zs = z - m
    lse_s = torch.logsumexp(zs, dim=-1)  # (c,)
    p = torch.exp(zs - lse_s[:, None])
    entropy = lse_s - (p * zs).sum(-1)
    lse = lse_s + m[:, 0]
    picked = z.gather(1, ids[:, None])[:, 0]
    return lse, picked - lse, entropy


def _chunk_grad(
    z: torch.Tensor, ids: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor,
    g_lp: torch.Tensor, g_ent: torch.Tensor, dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """d(loss)/d(logits) (c, V) in ``dtype``. With p = softmax(z):
    d logp_y / dz = onehot(y) - p;  d H / dz = -p * (log p + H)."""
    logp = z.float() - lse[:, None]
    p = torch.exp(logp)
    gz = -p * (g_lp[:, None] + g_ent[:, None] * (logp + entropy[:, None]))
    gz = gz.scatter_add(1, ids[:, None], g_lp[:, None])
    return gz.to(dtype)


_COMPILED: dict[str, tuple[Any, Any]] = {}  # by torch.compile backend


def _kernels(compile: bool) -> tuple[StatsFn, GradFn]:
    if not compile:
        return _chunk_stats, _chunk_grad
    backend = compiled.BACKEND
    if backend not in _COMPILED:
        _COMPILED[backend] = (
            torch.compile(_chunk_stats, dynamic=True, backend=backend),
            torch.compile(_chunk_grad, dynamic=True, backend=backend),
        )
    return _COMPILED[backend]


class _HeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor,
        compute_dtype: torch.dtype, chunk: int, compile: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        stats, _ = _kernels(compile)
        n = hidden.shape[0]
        h = hidden.to(compute_dtype)
        w = weight.to(compute_dtype)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        logprobs, entropy = torch.empty_like(lse), torch.empty_like(lse)
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            lse[s:e], logprobs[s:e], entropy[s:e] = stats(h[s:e] @ w.T, ids[s:e])
        ctx.save_for_backward(h, w, ids, lse, entropy)
        ctx.meta = (hidden.dtype, weight.dtype, compute_dtype, chunk, compile)
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(ctx: Any, g_lp: torch.Tensor | None, g_ent: torch.Tensor | None) -> tuple[Any, ...]:
        h, w, ids, lse, entropy = ctx.saved_tensors
        hidden_dtype, weight_dtype, compute_dtype, chunk, compile = ctx.meta
        _, grad_fn = _kernels(compile)
        g_lp = torch.zeros_like(lse) if g_lp is None else g_lp.float()
        g_ent = torch.zeros_like(lse) if g_ent is None else g_ent.float()
        grad_h = (
            torch.empty(h.shape, dtype=hidden_dtype, device=h.device) if ctx.needs_input_grad[0] else None
        )
        grad_w = (
            torch.zeros(w.shape, dtype=torch.float32, device=w.device) if ctx.needs_input_grad[1] else None
        )
        for s in range(0, h.shape[0], chunk):
            e = min(h.shape[0], s + chunk)
            gz = grad_fn(h[s:e] @ w.T, ids[s:e], lse[s:e], entropy[s:e], g_lp[s:e], g_ent[s:e], compute_dtype)
            if grad_h is not None:
                grad_h[s:e] = gz @ w
            if grad_w is not None:
                grad_w += (gz.T @ h[s:e]).float()
        grad_w = grad_w.to(weight_dtype) if grad_w is not None else None
        return grad_h, grad_w, None, None, None, None


def head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    *,
    compute_dtype: torch.dtype = torch.float32,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    compile: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies (b, R) fp32 of ``ids`` (b, R) under the logits ``hidden @ weight.T``.

    ``hidden`` (b, R, d) are the final hidden states at the positions that score ``ids``; ``weight``
    (V, d) is the LM head (no bias). Differentiable in ``hidden`` and ``weight``; the entropy's
    gradient flows only when the entropy is used in the loss.
    """
    if hidden.dim() != 3 or ids.shape != hidden.shape[:2]:
        raise ValueError(
            f"hidden (b, R, d) and ids (b, R) disagree: {tuple(hidden.shape)}, {tuple(ids.shape)}"
        )
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    b, r, d = hidden.shape
    flat = hidden.reshape(b * r, d)
    logprobs, entropy = _HeadLogprobs.apply(
        flat, weight, ids.reshape(-1).long(), compute_dtype, chunk_tokens, compile
    )
    return logprobs.view(b, r), entropy.view(b, r)
