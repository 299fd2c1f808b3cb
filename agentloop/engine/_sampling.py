"""Batched sampling with one ``torch.Generator`` per request.

Each row draws its own uniform number from its own generator and picks its token by inverse
CDF over its own filtered distribution, so a request's tokens depend only on its logits and its
seed, never on which requests share the batch. Logprobs follow base.py: the raw-logit
log-softmax of the sampled token, before temperature / top-k / top-p.
"""

from __future__ import annotations

import torch

from agentloop.engine.base import SamplingParams

_NUCLEUS_CANDIDATES = 512  # top-p looks at the 512 most likely tokens first; full sort only if they miss


def sample_batch(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> tuple[list[int], list[float]]:
    """Sample one token per row of ``logits`` (n, V) fp32; returns token ids and their logprobs."""
    vocab = logits.shape[1]
    tokens = torch.argmax(logits, dim=-1)  # (n,) greedy rows keep this
    rows = [i for i, p in enumerate(params) if p.temperature > 0]
    if rows:
        idx = torch.tensor(rows, device=logits.device)
        temp = torch.tensor([params[i].temperature for i in rows], device=logits.device, dtype=logits.dtype)
        scores = logits.index_select(0, idx) / temp[:, None]  # (r, V)
        top_k = [params[i].top_k for i in rows]
        if any(k > 0 for k in top_k):
            k_max = min(max(top_k), vocab)
            kth = torch.topk(scores, k_max, dim=-1).values  # (r, k_max), sorted descending
            k_idx = torch.tensor(
                [min(k, vocab) - 1 if k > 0 else k_max - 1 for k in top_k], device=logits.device
            )
            thresh = kth.gather(1, k_idx[:, None])
            thresh[torch.tensor([k == 0 for k in top_k], device=logits.device)] = -float("inf")
            scores = scores.masked_fill(scores < thresh, -float("inf"))
        probs = torch.softmax(scores, dim=-1)  # (r, V)
        top_p = [params[i].top_p for i in rows]
        if any(p < 1.0 for p in top_p):
            probs = _nucleus(probs, torch.tensor(top_p, device=logits.device, dtype=probs.dtype))
        # One uniform in (0, 1] per row from the row's own generator (CPU generators, moved once).
        u = torch.cat([1.0 - torch.rand(1, generator=generators[i], dtype=torch.float64) for i in rows])
        cdf = probs.double().cumsum(dim=-1)  # (r, V)
        target = (u.to(cdf.device) * cdf[:, -1])[:, None]
        picked = torch.searchsorted(cdf, target).clamp_(max=vocab - 1)[:, 0]
        tokens[idx] = picked
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]
    return tokens.tolist(), logprobs.tolist()  # one device->host sync per step


def _nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p`` (per row)."""
    k = min(_NUCLEUS_CANDIDATES, probs.shape[-1])
    vals, ids = torch.topk(probs, k, dim=-1)  # (r, k) sorted descending
    if bool((vals.sum(-1) < top_p).any()):  # some nucleus is wider than the candidates: sort all
        vals, ids = torch.sort(probs, dim=-1, descending=True)
    before = vals.cumsum(-1) - vals  # mass strictly before each token
    keep = before < top_p[:, None]
    return torch.zeros_like(probs).scatter_(1, ids, vals * keep)
