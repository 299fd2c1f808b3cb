"""TorchEngine's batched sampling (agentloop.engine.torch._sampling) and its static-shape decode path.

The CUDA-graph path cannot run here; what it relies on can: bucketed batch shapes whose padding
rows write into other slots' future positions, and top-k / top-p by radix select (no host sync).
``graph_shapes`` / ``static_sampling`` switch those on for the CPU engine.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import anyio
import pytest
import torch

from agentloop.engine.base import SamplingParams
from agentloop.engine.torch._sampling import _threshold_radix, _threshold_sorted, row_key, sample
from tests.engine.conftest import make_engine

V = 3000


def _reference_keep(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The kept set by a full sort: top-k, then the smallest prefix whose mass reaches top_p."""
    vals, ids = probs.sort(-1, descending=True)
    in_k = torch.arange(probs.shape[-1])[None] < torch.where(top_k > 0, top_k, probs.shape[-1])[:, None]
    kept = vals * in_k
    before = kept.cumsum(-1) - kept
    keep = in_k & ((before < (top_p * kept.sum(-1))[:, None]) | (top_p[:, None] >= 1))
    return torch.zeros_like(probs, dtype=torch.bool).scatter(1, ids, keep)


@pytest.mark.parametrize("scale", [0.3, 3.0, 10.0], ids=["flat", "medium", "peaked"])
def test_thresholds_match_a_full_sort(scale: float) -> None:
    torch.manual_seed(0)
    probs = (torch.randn(32, V) * scale).softmax(-1)
    top_k = torch.tensor([0, 5, 50, 0] * 8)
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.3] * 8)
    ref = _reference_keep(probs, top_k, top_p)
    tau = _threshold_radix(probs, top_k, top_p, "top_k")
    assert torch.equal(probs >= tau[:, None], ref)
    vals = probs.sort(-1, descending=True).values
    tau_sorted, covered = _threshold_sorted(vals, probs.sum(-1), top_k, top_p, V)
    assert bool(covered.all()) and torch.equal(probs >= tau_sorted[:, None], ref)


@pytest.mark.parametrize("mode, top_p", [("plain", 1.0), ("top_p", 0.7)])
def test_sampling_follows_the_filtered_distribution(mode: str, top_p: float) -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0, 0.5]]).repeat(2000, 1)
    n = logits.shape[0]
    args = (torch.ones(n), torch.zeros(n, dtype=torch.long), torch.full((n,), top_p))
    keys = torch.tensor([row_key(s, 0) for s in range(n)])
    eager, _ = sample(logits, *args, keys, mode, exact_static=False)  # type: ignore[arg-type]
    static, _ = sample(logits, *args, keys, mode, exact_static=True)  # type: ignore[arg-type]
    assert torch.equal(eager, static)  # both paths pick the same token for the same logits
    expected = logits[0].softmax(-1)
    if top_p < 1:
        expected = (
            expected
            * _reference_keep(expected[None], torch.zeros(1, dtype=torch.long), torch.tensor([top_p]))[0]
        )
    expected = expected / expected.sum()
    freq = torch.bincount(eager, minlength=5).float() / n
    assert torch.allclose(freq, expected, atol=0.035), (freq, expected)


@pytest.mark.parametrize("exact_static", [False, True], ids=["eager", "static"])
def test_sampling_is_batch_invariant_and_logprobs_are_the_policys(exact_static: bool) -> None:
    torch.manual_seed(1)
    logits = torch.randn(20, V) * 4
    temp = torch.tensor([0.0, 0.7, 1.0, 1.5, 1e-7] * 4)  # 1e-7: below _MIN_TEMPERATURE, taken as 1e-5
    top_k = torch.tensor([0, 0, 20, 0, 0] * 4)
    top_p = torch.tensor([1.0, 0.9, 0.8, 1.0, 1.0] * 4)
    keys = torch.tensor([row_key(7, i) for i in range(20)])
    tokens, logprobs = sample(logits, temp, top_k, top_p, keys, "top_k", exact_static=exact_static)
    for i in (0, 6, 12, 18, 19):
        alone, _ = sample(logits[i : i + 1], temp[i : i + 1], top_k[i : i + 1], top_p[i : i + 1],
                          keys[i : i + 1], "top_k", exact_static=exact_static)  # fmt: skip
        assert alone.item() == tokens[i].item()
    assert torch.equal(tokens[::5], logits[::5].argmax(-1))  # temperature 0 rows are greedy
    # the sampling policy's logprob, row by row: log_softmax(logits / T), raw logits at T = 0, the
    # top-k / top-p rows not renormalised
    t = torch.where(temp > 0, temp.clamp(min=1e-5), 1.0)
    ref = torch.stack([(logits[i] / t[i]).log_softmax(-1)[tokens[i]] for i in range(20)])
    # Same fp32 quotients on both sides (IEEE division is exact-rounded); the log-sum-exp over V
    # positive terms may be summed in another order (batched vs one row, vector width): its relative
    # error is at most (V - 1) eps in any order, plus an ulp for exp and log, i.e. (V + 1) eps in
    # the log domain, and the final subtraction rounds at eps * |logprob|.
    eps = torch.finfo(torch.float32).eps
    tol = (V + 1) * eps + 2 * eps * ref.abs()
    assert bool(((logprobs - ref).abs() <= tol).all()), (logprobs - ref).abs().max()
    raw = logits.log_softmax(-1).gather(1, tokens[:, None])[:, 0]
    assert (logprobs - raw).abs()[1::5].min() > 1e-2  # not the raw-logit logprobs of the old contract
    assert row_key(7, 0) == row_key(7, 0) != row_key(7, 1) != row_key(8, 1)


def test_greedy_batches_report_raw_logprobs() -> None:
    """An all-greedy batch (mode "greedy") takes the argmax and the raw logits' log_softmax, whatever
    the (unused) top-k / top-p values."""
    torch.manual_seed(3)
    logits = torch.randn(4, V) * 4
    n = logits.shape[0]
    args = (torch.zeros(n), torch.full((n,), 5), torch.full((n,), 0.5), torch.zeros(n, dtype=torch.long))
    tokens, logprobs = sample(logits, *args, "greedy", exact_static=False)
    assert torch.equal(tokens, logits.argmax(-1))
    eps = torch.finfo(torch.float32).eps
    ref = torch.stack([logits[i].log_softmax(-1)[tokens[i]] for i in range(n)])
    assert bool(((logprobs - ref).abs() <= (V + 1) * eps + 2 * eps * ref.abs()).all())  # as above


async def test_graph_shapes_give_the_same_tokens(tiny_model_dir: Path, chat_prompt: list[int]) -> None:
    """Bucketed decode batches (padding rows land on slots prefilled in the same step) and
    radix-select sampling produce what the plain CPU path produces."""
    prompts = [chat_prompt[: len(chat_prompt) - i % 4] + [900 + i] * (i % 3) for i in range(11)]
    params = [
        SamplingParams(
            temperature=[0.0, 0.8, 1.0][i % 3],
            top_p=[1.0, 0.9, 0.95][i % 3],
            top_k=[0, 0, 30][i % 3],
            max_tokens=12 + i,
            seed=i,
            ignore_eos=True,
        )
        for i in range(len(prompts))
    ]
    outs = []
    for static in (False, True):
        eng = make_engine("torch", tiny_model_dir, max_batch_size=16, max_context=512)
        eng._runner.graph_shapes = eng._runner.static_sampling = static
        try:
            with anyio.fail_after(60):
                # 3 running rows pad to a batch of 4, whose padding row is slot 3: the first request
                # admitted while they run, prefilled in that very step
                first = [
                    asyncio.ensure_future(eng.generate(p, sp))
                    for p, sp in zip(prompts[:3], params[:3], strict=True)
                ]
                while not eng.stats().get("decode_steps"):
                    await asyncio.sleep(0.005)
                rest = await asyncio.gather(
                    *[eng.generate(p, sp) for p, sp in zip(prompts[3:], params[3:], strict=True)]
                )
                outs.append([*[await f for f in first], *rest])
        finally:
            await eng.stop()
    plain, bucketed = outs
    assert [o.token_ids for o in bucketed] == [o.token_ids for o in plain]
    for a, b in zip(plain, bucketed, strict=True):
        assert a.logprobs is not None and b.logprobs is not None
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)


def test_radix_threshold_handles_ties_zeros_and_top_p_mode() -> None:
    """Equal probabilities at the edge are kept together, zero-probability tokens never are, and
    the top-p-only mode (no count pass) agrees with the full sort."""
    probs = torch.tensor([[0.25, 0.25, 0.25, 0.25, 0.0], [0.5, 0.2, 0.2, 0.1, 0.0]])
    top_p = torch.tensor([0.3, 0.75])
    top_k = torch.zeros(2, dtype=torch.long)
    tau = _threshold_radix(probs, top_k, top_p, "top_p")
    assert (probs >= tau[:, None]).tolist() == [[True] * 4 + [False], [True] * 3 + [False] * 2]
    torch.manual_seed(1)
    flat = (torch.randn(16, V) * 0.3).softmax(-1)
    p = torch.linspace(0.05, 0.99, 16)
    k0 = torch.zeros(16, dtype=torch.long)
    assert torch.equal(flat >= _threshold_radix(flat, k0, p, "top_p")[:, None], _reference_keep(flat, k0, p))


def test_eager_candidate_tiers_pick_the_exact_token() -> None:
    """Rows whose kept set fits in 64 candidates, in 512, or only in the full sort (peaked, medium
    and flat logits in one batch) get the same token as the exact radix path."""
    torch.manual_seed(2)
    vocab = 4096
    scale = torch.tensor([12.0, 3.0, 0.3] * 8)[:, None]  # kept sets of ~1, ~100s and ~1000s tokens
    logits = torch.randn(24, vocab) * scale
    n = logits.shape[0]
    temp, top_p = torch.full((n,), 0.8), torch.full((n,), 0.9)
    top_k = torch.tensor([0, 0, 0, 40] * 6)
    keys = torch.tensor([row_key(11, i) for i in range(n)])
    for mode in ("top_p", "top_k"):
        k = top_k if mode == "top_k" else torch.zeros(n, dtype=torch.long)
        eager, _ = sample(logits, temp, k, top_p, keys, mode, exact_static=False, greedy_rows=False)
        static, _ = sample(logits, temp, k, top_p, keys, mode, exact_static=True, greedy_rows=False)
        assert torch.equal(eager, static), mode
