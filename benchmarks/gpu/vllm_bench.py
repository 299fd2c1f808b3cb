"""agentloop's VLLMEngine vs raw vLLM ``AsyncLLM`` on one workload, both warm in one process.

Both engines get the same settings (bf16, prefix caching on, raw logprobs of the sampled token,
FINAL_ONLY outputs) and the same work: N fresh random-token prompts x M new tokens, eos ignored,
temperature 1. Rounds alternate raw / agentloop so clock or thermal drift hits both; every round
draws fresh prompts so the prefix cache never helps. Reported: median tokens/s of each and the ratio.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from pathlib import Path
from typing import Any

GPU_MEM = 0.25  # each engine's share of the GPU; three fit on one card
VOCAB = 151936  # the random Qwen2-0.5B shape's


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, min(vocab, 49152)) for _ in range(length)] for _ in range(n)]


def _raw_engine(path: Path, gpu_memory_utilization: float) -> Any:
    """Raw vLLM ``AsyncLLM`` as every baseline here runs it: bf16, prefix caching on, raw logprobs."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM.from_engine_args(
        AsyncEngineArgs(
            model=str(path), dtype="bfloat16", gpu_memory_utilization=gpu_memory_utilization,
            enable_prefix_caching=True, logprobs_mode="raw_logprobs", max_logprobs=1, seed=0,
            generation_config="vllm", max_num_seqs=256, max_model_len=4096, disable_log_stats=True,
        )
    )  # fmt: skip


def _raw_params(max_tokens: int, logprobs: int | None) -> Any:
    """vLLM sampling at temperature 1, eos ignored, token ids only, the final output only."""
    from vllm import SamplingParams as VSamplingParams
    from vllm.sampling_params import RequestOutputKind

    return VSamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs,
                           detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)  # fmt: skip


async def _raw_round(raw: Any, vsp: Any, n: int, prompt_len: int, seed: int) -> float:
    """``n`` fresh random prompts through raw vLLM at once; generated tokens/s. Every request must make
    ``vsp.max_tokens`` tokens, with logprobs when ``vsp`` asks for them."""
    from vllm.inputs import TokensPrompt

    async def one(rid: str, p: list[int]) -> int:
        final = None
        async for out in raw.generate(TokensPrompt(prompt_token_ids=p), vsp, request_id=rid):
            final = out
        assert final is not None and (vsp.logprobs is None or final.outputs[0].logprobs is not None)
        return len(final.outputs[0].token_ids)

    m = vsp.max_tokens
    batch = _prompts(n, prompt_len, VOCAB, seed)
    t = time.perf_counter()
    counts = await asyncio.gather(*[one(f"raw-{seed}-{i}", p) for i, p in enumerate(batch)])
    dt = time.perf_counter() - t
    assert sum(counts) == n * m, (sum(counts), n * m)
    return n * m / dt


async def bench_vllm(path: Path, args: Any) -> dict[str, Any]:
    from agentloop.engine.base import SamplingParams
    from agentloop.engine.factory import load_engine

    n, m = args.prompts, args.new_tokens
    t0 = time.perf_counter()
    raw = _raw_engine(path, GPU_MEM)
    raw_init = time.perf_counter() - t0
    t0 = time.perf_counter()
    ours = load_engine(str(path), device="cuda", backend="vllm", dtype="bfloat16",
                       gpu_memory_utilization=GPU_MEM, max_batch_size=256)  # fmt: skip
    await ours.start()
    ours_init = time.perf_counter() - t0
    live = load_engine(str(path), device="cuda", backend="vllm", dtype="bfloat16",
                       gpu_memory_utilization=GPU_MEM, max_batch_size=256, live_stats=True)  # fmt: skip
    await live.start()
    vsp = _raw_params(m, 0)
    sp = SamplingParams(temperature=1.0, max_tokens=m, ignore_eos=True, logprobs=True)
    vocab = VOCAB

    async def raw_round(seed: int) -> float:
        return await _raw_round(raw, vsp, n, args.prompt_len, seed)

    async def ours_round(seed: int, eng: Any = None) -> float:
        eng = eng or ours
        batch = _prompts(n, args.prompt_len, vocab, seed)
        t = time.perf_counter()
        outs = await asyncio.gather(*[eng.generate(p, sp) for p in batch])
        dt = time.perf_counter() - t
        assert sum(len(o.token_ids) for o in outs) == n * m
        assert all(o.logprobs is not None and len(o.logprobs) == m for o in outs)
        return n * m / dt

    raw_tps: list[float] = []
    ours_tps: list[float] = []
    live_tps: list[float] = []
    try:
        await raw_round(1)  # warm-up (compile / graphs are captured at init; this warms the rest)
        await ours_round(2)
        await ours_round(3, live)
        for r in range(args.reps):
            raw_tps.append(await raw_round(100 + 3 * r))
            ours_tps.append(await ours_round(101 + 3 * r))
            live_tps.append(await ours_round(102 + 3 * r, live))
        # one short check of the contract on this model: logprobs are finite and <= 0
        probe = await ours.generate(_prompts(1, 16, vocab, 7)[0], sp.model_copy(update={"max_tokens": 8}))
        assert probe.logprobs is not None and all(lp <= 0 for lp in probe.logprobs)
    finally:
        raw.shutdown()
        await ours.stop()
        await live.stop()
    raw_med, ours_med = statistics.median(raw_tps), statistics.median(ours_tps)
    return {
        "backend": "vllm",
        "model": args.model,
        "dtype": "bfloat16",
        "workload": {
            "prompts": n,
            "prompt_len": args.prompt_len,
            "new_tokens": m,
            "temperature": 1.0,
            "logprobs": True,
            "ignore_eos": True,
            "rounds": args.reps,
        },
        "raw_vllm_async_tokens_per_s": round(raw_med, 1),
        "agentloop_vllm_engine_tokens_per_s": round(ours_med, 1),
        "ratio": round(ours_med / raw_med, 3),
        "target_ratio": 0.9,
        "rounds_raw": [round(x, 1) for x in raw_tps],
        "rounds_agentloop": [round(x, 1) for x in ours_tps],
        "agentloop_live_stats_tokens_per_s": round(statistics.median(live_tps), 1),
        "live_stats_ratio": round(statistics.median(live_tps) / raw_med, 3),
        "rounds_agentloop_live_stats": [round(x, 1) for x in live_tps],
        "init_s": {"raw": round(raw_init, 1), "agentloop": round(ours_init, 1)},
        "vllm": __import__("vllm").__version__,
    }


async def bench_torch_vs_vllm(path: Path, args: Any) -> dict[str, Any]:
    """TorchEngine against raw vLLM ``AsyncLLM`` without and with logprobs, warm in one process.

    The same work each way and round: N fresh random-token prompts of ``--prompt-len`` x M new tokens,
    eos ignored, temperature 1 (TorchEngine's plain Gumbel-max sampling; vLLM's default sampler),
    bf16. TorchEngine always returns the sampled token's logprob; raw vLLM runs once with
    ``logprobs=None`` and once with ``logprobs=0``. Rounds rotate raw / raw+logprobs / torch.
    """
    import torch

    from agentloop.engine.base import SamplingParams
    from agentloop.engine.torch.engine import TorchEngine

    n, m, vocab = args.prompts, args.new_tokens, VOCAB
    raw = _raw_engine(path, 0.4)
    torch_engine = TorchEngine(path, device="cuda", dtype=torch.bfloat16, max_batch_size=n)
    kinds = {lp: _raw_params(m, lp) for lp in (None, 0)}
    sp = SamplingParams(temperature=1.0, max_tokens=m, ignore_eos=True, logprobs=True)

    async def raw_round(seed: int, logprobs: int | None) -> float:
        return await _raw_round(raw, kinds[logprobs], n, args.prompt_len, seed)

    async def torch_round(seed: int) -> float:
        batch = _prompts(n, args.prompt_len, vocab, seed)
        t = time.perf_counter()
        outs = await asyncio.gather(
            *[
                torch_engine.generate(p, sp.model_copy(update={"seed": seed * n + i}))
                for i, p in enumerate(batch)
            ]
        )
        dt = time.perf_counter() - t
        assert sum(len(o.token_ids) for o in outs) == n * m
        assert all(o.logprobs is not None and len(o.logprobs) == m for o in outs)
        return n * m / dt

    rounds: dict[str, list[float]] = {"vllm": [], "vllm_logprobs": [], "torch": []}
    try:
        await raw_round(1, None)  # warm-up: the rest of vLLM's lazy init, TorchEngine's graph captures
        await raw_round(2, 0)
        await torch_round(3)
        for r in range(args.reps):
            rounds["vllm"].append(await raw_round(100 + 3 * r, None))
            rounds["vllm_logprobs"].append(await raw_round(101 + 3 * r, 0))
            rounds["torch"].append(await torch_round(102 + 3 * r))
        stats = torch_engine.stats()
    finally:
        raw.shutdown()
        await torch_engine.stop()
    med = {k: statistics.median(v) for k, v in rounds.items()}
    return {
        "model": args.model,
        "dtype": "bfloat16",
        "workload": {
            "prompts": n,
            "prompt_len": args.prompt_len,
            "new_tokens": m,
            "temperature": 1.0,
            "ignore_eos": True,
            "rounds": args.reps,
        },
        "raw_vllm_tokens_per_s": round(med["vllm"], 1),
        "raw_vllm_logprobs_tokens_per_s": round(med["vllm_logprobs"], 1),
        "torch_engine_tokens_per_s": round(med["torch"], 1),
        "ratio_vs_vllm": round(med["torch"] / med["vllm"], 3),
        "ratio_vs_vllm_logprobs": round(med["torch"] / med["vllm_logprobs"], 3),
        "targets": {"ratio_vs_vllm": 0.75, "ratio_vs_vllm_logprobs": 1.2},
        "rounds": {k: [round(x, 1) for x in v] for k, v in rounds.items()},
        "torch_engine_decode_ms_per_step": stats.get("decode_ms_per_step"),
        "vllm": __import__("vllm").__version__,
    }
