"""Where a TorchEngine decode step spends its time on a GPU (a diagnostic, not a target benchmark).

    python benchmarks/gpu/profile_decode.py --random-config qwen2-0.5b --batch 128

Times with CUDA events, at the engine's own shapes: the model forward alone, ``sample()`` alone per
sampling mode, the eager decode step and the CUDA-graph replay; then prints the top kernels of one
eager step from torch.profiler. Prints JSON (the table goes to stderr).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from agentloop.engine.base import SamplingParams
from agentloop.engine.torch import _fused_sampling
from agentloop.engine.torch._sampling import sample
from agentloop.engine.torch.engine import TorchEngine
from benchmarks import result_file
from benchmarks.gpu.random_model import RANDOM_CONFIGS, build_random_model


def cuda_ms(fn: Callable[[], Any], reps: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


async def warm(engine: TorchEngine, batch: int, tokens: int) -> None:
    prompt = list(range(10, 50))
    sp = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=tokens, ignore_eos=True)
    await asyncio.gather(*[engine.generate(prompt, sp.model_copy(update={"seed": i})) for i in range(batch)])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--random-config", choices=sorted(RANDOM_CONFIGS), default="qwen2-0.5b")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--kv-len", type=int, default=256)
    args = ap.parse_args()
    dev = torch.device("cuda")
    path = build_random_model(args.random_config)
    engine = TorchEngine(path, device="cuda", max_batch_size=args.batch)
    asyncio.run(warm(engine, args.batch, 8))
    asyncio.run(engine.stop())
    runner, b = engine._runner, args.batch
    runner._ints[1, :b] = torch.arange(b, device=dev) % 200 + 40  # positions
    runner._ints[0, :b] = 100
    runner._floats[0, :b], runner._floats[1, :b] = 0.7, 0.9
    result: dict[str, Any] = {"batch": b, "kv_len": args.kv_len}  # the card: in the header
    with torch.inference_mode():
        ids, pos = runner._ints[0, :b, None], runner._ints[1, :b, None]
        mask = (runner._arange[: args.kv_len][None, :] <= pos)[:, None, None, :]

        def forward() -> Any:
            engine._cache.set_decode(pos[:, 0], args.kv_len)
            return engine._model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True,
                                 logits_to_keep=1, **{engine._cache_kw: engine._cache})  # fmt: skip

        logits = forward().logits[:, -1].float()
        result["model_forward_ms"] = round(cuda_ms(forward), 3)
        i, f = runner._ints[:, :b], runner._floats[:, :b]
        for mode in ("greedy", "plain", "top_p", "top_k"):
            result[f"sample_{mode}_ms"] = round(
                cuda_ms(lambda m=mode: sample(logits, f[0], i[2], f[1], i[3], m, True, False)), 3
            )
        result["log_softmax_gather_ms"] = round(
            cuda_ms(lambda: torch.log_softmax(logits, -1).gather(1, i[0][:, None])), 3
        )
        result["eager_step_top_p_ms"] = round(
            cuda_ms(lambda: runner._forward(b, args.kv_len, "top_p", False)), 3
        )
        key = (b, args.kv_len, "top_p", False)
        runner._graph_step(key, b)
        graph = runner._graphs[key][0]
        result["graph_replay_top_p_ms"] = round(cuda_ms(graph.replay), 3)
        runner._floats[0, :b] = 1.0  # plain sampling (temperature 1, no top-p): torch ops vs one kernel
        raw = forward().logits[:, -1]
        if _fused_sampling.available(dev):
            result["sample_plain_fused_ms"] = round(
                cuda_ms(lambda: _fused_sampling.fused_sample(raw, f[0], i[3], "plain", False)), 3
            )
        for fused in (False, True):
            if fused and not _fused_sampling.available(dev):
                continue
            runner.fused_sampling = fused
            runner.drop_graphs()
            name = "fused" if fused else "torch"
            result[f"eager_step_plain_{name}_ms"] = round(
                cuda_ms(lambda: runner._forward(b, args.kv_len, "plain", False)), 3
            )
            key = (b, args.kv_len, "plain", False)
            runner._graph_step(key, b)
            result[f"graph_replay_plain_{name}_ms"] = round(cuda_ms(runner._graphs[key][0].replay), 3)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                runner._forward(b, args.kv_len, "plain", False)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40), file=sys.stderr)
    print(
        json.dumps(
            result_file.result(
                result_file.header("profile_decode", gpu=torch.cuda.get_device_name()), result
            ),
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
