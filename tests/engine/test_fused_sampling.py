"""The one-kernel greedy / plain sampler (engine/torch/_fused_sampling.py) against ``sample()``.

The kernel needs Triton and a CUDA device: those tests run on the GPU machine and are skipped
elsewhere with a visible reason; the argument checks and the CPU fallback run everywhere.
"""

from __future__ import annotations

import math
from pathlib import Path

import anyio
import pytest
import torch

from agentloop.engine.base import SamplingParams
from agentloop.engine.torch import _fused_sampling
from agentloop.engine.torch._decode import ModelRunner
from agentloop.engine.torch._sampling import row_key, sample
from tests.engine.conftest import make_engine

CUDA = torch.device("cuda")
EPS = torch.finfo(torch.float32).eps
needs_kernel = pytest.mark.skipif(
    not (torch.cuda.is_available() and _fused_sampling.available(CUDA)),
    reason="the fused sampler needs Triton and a CUDA device (runs on the GPU machine)",
)


def _logprob_tol(
    logits: torch.Tensor, temp: torch.Tensor, tokens: torch.Tensor, ref: torch.Tensor
) -> torch.Tensor:
    """Per row, how far two fp32 computations of ``log_softmax(logits / T)[token]`` may sit apart.

    Each side rounds two subtractions of magnitude <= |picked| + |max| + |lp| (1 eps each), and its
    log(total) errs by total's relative error plus one ulp of log(total) <= log V. The kernel's lanes
    each fold ceil(V / BLOCK) terms, every step perturbing the running sum by a rescale (1 eps), its
    approximate exp (2 ulp) and an add (1 eps), each new term by its own exp (2 ulp); then log2(BLOCK) + 3
    in the cross-lane sum. torch's tree sum: <= log2(V) + 4. Worst cases, so the bound holds on any GPU
    (for V = 152k and T = 1 about 5e-5, mostly the kernel's 75 steps a lane).
    """
    t = torch.where(temp > 0, temp.clamp(min=1e-5), 1.0)  # the samplers' divisor
    scores = logits.float() / t[:, None]
    top = scores.max(-1).values.abs()
    picked = scores.gather(1, tokens[:, None])[:, 0].abs()
    vocab, block = logits.shape[-1], _fused_sampling._BLOCK
    kernel = 4 * math.ceil(vocab / block) + 2 + math.log2(block) + 3
    sums = kernel + math.log2(vocab) + 4 + 2 * math.log(vocab)  # + torch's sum + the two logs' ulps
    return EPS * (2 * (picked + top + ref.abs()) + sums)


def _assert_logprobs_close(lp: torch.Tensor, ref: torch.Tensor, tol: torch.Tensor) -> None:
    excess = (lp - ref).abs() - tol
    i = int(excess.argmax())
    assert float(excess[i]) <= 0, f"row {i}: {float(lp[i])} vs {float(ref[i])} (bound {float(tol[i])})"


def _inputs(rows: int, vocab: int, seed: int, greedy_every: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(CUDA)
    temp = torch.rand(rows, generator=g) * 1.5 + 0.05
    if greedy_every:
        temp[::greedy_every] = 0.0
    temp[1] = 1e-7  # below the clamp: taken as 1e-5 by both
    keys = torch.tensor([row_key(seed + r, r) for r in range(rows)], dtype=torch.long)
    return logits, temp.to(CUDA), keys.to(CUDA)


@needs_kernel
@pytest.mark.parametrize("vocab", [151936, 49152, 2049, 7])
@pytest.mark.parametrize("greedy_every", [0, 3])
def test_plain_matches_sample_token_for_token(vocab: int, greedy_every: int) -> None:
    logits, temp, keys = _inputs(64, vocab, seed=vocab + greedy_every, greedy_every=greedy_every)
    unused = torch.zeros(64, dtype=torch.long, device=CUDA)
    ones = torch.ones(64, device=CUDA)
    ref_tok, ref_lp = sample(logits, temp, unused, ones, keys, "plain", True, greedy_every > 0)
    tok, lp = _fused_sampling.fused_sample(logits, temp, keys, "plain", greedy_every > 0)
    assert torch.equal(tok, ref_tok)
    _assert_logprobs_close(lp, ref_lp, _logprob_tol(logits, temp, ref_tok, ref_lp))


@needs_kernel
def test_bf16_logits_are_read_as_their_fp32_cast() -> None:
    logits, temp, keys = _inputs(32, 151936, seed=5)
    low = logits.to(torch.bfloat16)
    tok, lp = _fused_sampling.fused_sample(low, temp, keys, "plain")
    ref_tok, ref_lp = _fused_sampling.fused_sample(low.float(), temp, keys, "plain")
    assert torch.equal(tok, ref_tok)
    # another compiled variant (2-byte loads) may sum the lanes in another order: within the same bound
    _assert_logprobs_close(lp, ref_lp, _logprob_tol(low, temp, tok, ref_lp))


@needs_kernel
def test_noise_is_the_hash_bit_for_bit() -> None:
    """Flat logits: the token is the argmax of the noise alone, so any difference in a noise value
    (an approximate log near u = 1, a hash bit) shows as another token in some of 256 rows."""
    logits = torch.zeros(256, 151936, device=CUDA)
    temp = torch.ones(256, device=CUDA)
    keys = torch.tensor([row_key(7, r) for r in range(256)], dtype=torch.long, device=CUDA)
    unused = torch.zeros(256, dtype=torch.long, device=CUDA)
    ref_tok, _ = sample(logits, temp, unused, temp, keys, "plain", True, False)
    tok, lp = _fused_sampling.fused_sample(logits, temp, keys, "plain", False)
    assert torch.equal(tok, ref_tok)
    # total = 151936 exactly (a sum of ones, exp(0) = 1); the two logs of it differ by <= 1 ulp each
    log_v = float(torch.log(torch.tensor(151936.0)))
    torch.testing.assert_close(lp, torch.full_like(lp, -log_v), rtol=0, atol=2 * EPS * log_v)


@needs_kernel
def test_greedy_mode_is_argmax_with_raw_logprobs() -> None:
    logits, _, keys = _inputs(48, 151936, seed=11)
    logits[3, 17] = logits[3, 90] = logits[3].max() + 1  # a tie: the lowest id wins, as torch.argmax
    temp = torch.zeros(48, device=CUDA)
    tok, lp = _fused_sampling.fused_sample(logits, temp, keys, "greedy")
    assert torch.equal(tok, logits.argmax(-1))
    assert int(tok[3]) == 17
    ref = torch.log_softmax(logits, -1).gather(1, tok[:, None])[:, 0]
    _assert_logprobs_close(lp, ref, _logprob_tol(logits, temp, tok, ref))


def test_rejects_modes_and_layouts_it_does_not_serve() -> None:
    logits = torch.zeros(4, 10)
    temp, keys = torch.ones(4), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="modes 'greedy' and 'plain', got 'top_p'"):
        _fused_sampling.fused_sample(logits, temp, keys, "top_p")
    with pytest.raises(ValueError, match="unit stride along V"):
        _fused_sampling.fused_sample(logits.t(), temp, keys, "plain")


def test_cpu_runner_keeps_the_torch_sampler() -> None:
    assert not _fused_sampling.available(torch.device("cpu"))
    runner = ModelRunner(None, _NoCache(), "past_key_values", 4, 64, torch.device("cpu"), False, False)
    assert runner.fused_sampling is False


class _NoCache:
    generation = 0
    capacity = 64


async def test_a_failing_kernel_falls_back_to_the_torch_sampler(
    tiny_model_dir: Path, chat_prompt: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel that cannot run (no compiler for the GPU, say) costs no request: the step samples with
    sample() and the runner stops trying the kernel; the tokens are the torch sampler's."""
    calls = []

    def broken(*args: object, **kwargs: object) -> None:
        calls.append(1)
        raise RuntimeError("no kernel for this device")

    sp = SamplingParams(temperature=1.0, max_tokens=6, seed=3, ignore_eos=True)
    reference = make_engine("torch", tiny_model_dir)
    try:
        expected = await reference.generate(chat_prompt, sp)
    finally:
        await reference.stop()
    monkeypatch.setattr(_fused_sampling, "fused_sample", broken)
    engine = make_engine("torch", tiny_model_dir)
    engine._runner.fused_sampling = True  # as on a CUDA device with Triton
    try:
        with anyio.fail_after(60):
            out = await engine.generate(chat_prompt, sp)
    finally:
        await engine.stop()
    assert calls == [1] and engine._runner.fused_sampling is False
    assert out.token_ids == expected.token_ids and out.finish_reason == "length"
