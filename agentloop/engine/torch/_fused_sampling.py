"""Greedy and plain-temperature sampling of a decode step in one Triton kernel (CUDA only).

``_sampling.sample`` spends ~15 passes over the (B, V) logits in plain mode: the fp32 cast, the
division by the temperature, the noise hash (one int64 tensor per integer op), the argmax, and a
``log_softmax`` + ``gather`` for the logprob; at batch 128 and Qwen2's 152k vocabulary that is
~2.3 ms of a ~7 ms CUDA-graph step. Here one program per row streams its logits once, in blocks,
and keeps per-lane running maxima: ``argmax(logits / T + g)`` (the same counter-based Gumbel noise
``g(key, token)``, bit for bit) and an online log-sum-exp for the logprob. The result matches
``sample(..., mode, exact_static=True)``: the same scores (``x.float() / T`` with T clamped as
there), the same noise bits (the hash in uint32 arithmetic equals the int64 one masked to 32 bits),
the same tie rule (the lowest token id); the logprob differs only in fp32 summation order.

The noise takes ``log`` from libdevice (``logf``, as torch's CUDA kernels): ``u`` near 1 is where
the largest Gumbel values come from, and an approximate ``lg2`` would be off by far more than an
ulp there. ``available()`` says whether Triton and a CUDA device are present; top-k / top-p stay
on the torch path.
"""

from __future__ import annotations

from typing import Any

import torch

from agentloop.engine.torch._sampling import _GOLDEN, _MIN_TEMPERATURE, _MIX1, _MIX2

try:  # Triton ships with CUDA builds of torch; absent on CPU-only installs
    import triton
    import triton.language as tl

    try:
        from triton.language.extra import libdevice
    except ImportError:  # older Triton
        from triton.language.extra.cuda import libdevice  # type: ignore[no-redef]
except ImportError:  # pragma: no cover - exercised where Triton is missing
    triton = None  # type: ignore[assignment]

_BLOCK = 2048


def available(device: torch.device) -> bool:
    """Whether :func:`fused_sample` can run on ``device``."""
    return triton is not None and device.type == "cuda"


if triton is not None:
    _K_GOLDEN = tl.constexpr(_GOLDEN)  # the hash's constants: _sampling.gumbel's
    _K_MIX1 = tl.constexpr(_MIX1)
    _K_MIX2 = tl.constexpr(_MIX2)

    @triton.jit
    def _uniform(key, ids):
        """Per token, the uniform in (0, 1) that the Gumbel noise is drawn from: ``_sampling.gumbel``'s
        hash of (key, token id), in uint32 arithmetic. Inlined into the kernel."""
        h = key ^ (ids.to(tl.uint32) * _K_GOLDEN)
        h = h * _K_MIX1
        h ^= h >> 15
        h = h * _K_MIX2
        h ^= h >> 13
        h = h * _K_MIX1
        h ^= h >> 16
        return ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)

    @triton.jit
    def _lowest_argmax(best, best_id):
        """The id of the largest of the lanes' ``best`` values; on ties the lowest id. Inlined."""
        top = tl.max(best, axis=0)
        return tl.min(tl.where(best == top, best_id, 2147483647), axis=0)

    @triton.jit
    def _sample_kernel(
        logits_ptr,
        row_stride,
        temp_ptr,
        key_ptr,
        out_tok_ptr,
        out_lp_ptr,
        vocab,
        min_temp,
        NOISE: tl.constexpr,
        GREEDY_ROWS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        base = logits_ptr + row.to(tl.int64) * row_stride
        t = tl.load(temp_ptr + row).to(tl.float32)
        if NOISE:
            divisor = tl.where(t > 0, tl.maximum(t, min_temp), 1.0)
            key = tl.load(key_ptr + row).to(tl.uint32)
        else:
            divisor = tl.full([], 1.0, tl.float32)
        lanes = tl.arange(0, BLOCK)
        best = tl.full([BLOCK], float("-inf"), tl.float32)  # per lane: the largest (noisy) score
        best_id = tl.zeros([BLOCK], tl.int32)
        raw_best = tl.full([BLOCK], float("-inf"), tl.float32)  # greedy rows: the largest score
        raw_id = tl.zeros([BLOCK], tl.int32)
        run_max = tl.full([BLOCK], float("-inf"), tl.float32)  # online log-sum-exp per lane
        run_sum = tl.zeros([BLOCK], tl.float32)
        for start in range(0, vocab, BLOCK):
            ids = start + lanes
            inside = ids < vocab
            x = tl.load(base + ids, mask=inside, other=float("-inf")).to(tl.float32)
            s = libdevice.div_rn(x, divisor)  # IEEE division, as torch's
            if NOISE:
                u = _uniform(key, ids)
                noisy = tl.where(inside, s - libdevice.log(-libdevice.log(u)), float("-inf"))
            else:
                noisy = s
            take = noisy > best  # strictly: a lane keeps its first (lowest) id on ties
            best = tl.where(take, noisy, best)
            best_id = tl.where(take, ids, best_id)
            if GREEDY_ROWS:
                take_raw = s > raw_best
                raw_best = tl.where(take_raw, s, raw_best)
                raw_id = tl.where(take_raw, ids, raw_id)
            new_max = tl.maximum(run_max, s)
            scale = tl.where(new_max == float("-inf"), 0.0, tl.exp(run_max - new_max))
            term = tl.where(inside, tl.exp(s - new_max), 0.0)
            run_sum = run_sum * scale + term
            run_max = new_max
        token = _lowest_argmax(best, best_id)
        if GREEDY_ROWS:
            raw_token = _lowest_argmax(raw_best, raw_id)
            token = tl.where(t > 0, token, raw_token)
        m = tl.max(run_max, axis=0)
        total = tl.sum(run_sum * tl.exp(run_max - m), axis=0)
        picked = libdevice.div_rn(tl.load(base + token).to(tl.float32), divisor)
        tl.store(out_tok_ptr + row, token.to(tl.int64))
        tl.store(out_lp_ptr + row, picked - m - libdevice.log(total))


def fused_sample(
    logits: torch.Tensor, temperature: torch.Tensor, key: torch.Tensor, mode: str, greedy_rows: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample()`` of ``mode`` "greedy" or "plain" in one kernel: ``(tokens (B,) int64, logprobs (B,)
    fp32)``. ``logits`` (B, V) of any float dtype with unit stride along V (bf16 straight from the
    head is fine: it is read as ``.float()``); ``temperature`` (B,) float; ``key`` (B,) int64."""
    if mode not in ("greedy", "plain"):
        raise ValueError(f"fused_sample serves modes 'greedy' and 'plain', got {mode!r}")
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be (B, V) with unit stride along V, got {tuple(logits.shape)}")
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.long, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    noise = mode == "plain"
    grid: Any = (rows,)
    _sample_kernel[grid](
        logits, logits.stride(0), temperature, key, tokens, logprobs, vocab, _MIN_TEMPERATURE,
        NOISE=noise, GREEDY_ROWS=noise and greedy_rows, BLOCK=_BLOCK, num_warps=8,
    )  # fmt: skip
    return tokens, logprobs
