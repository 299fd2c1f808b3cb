"""Weight sync into a colocated vLLM engine, and the engine/trainer logprob gap after it.

A random-weight Qwen2-0.5B-shaped model (``--random-config``) is served by VLLMEngine (bf16) while
the "trainer" holds the same model in fp32 on the same GPU (as trainer/model/actor.py does). The trainer
perturbs its weights; ``engine.update_weights(trainer.state_dict())`` is timed (median of
``--reps``, after one warm-up), the engine's output must change, and the logprobs of sampled
responses are compared with the trainer's bf16-autocast forward (``logprob_gap``). Prints JSON and
writes it to ``--out``. Needs vLLM and a GPU.

    python benchmarks/weight_sync_bench.py --random-config qwen2-0.5b --out weight_sync_gpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu"))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from random_model import RANDOM_CONFIGS, build_random_model

from agentloop.engine.base import SamplingParams
from agentloop.engine.factory import load_engine
from agentloop.engine.vllm_engine import logprob_gap, reference_logprobs
from benchmarks import result_file


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--random-config", choices=sorted(RANDOM_CONFIGS), default="qwen2-0.5b")
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--gap-prompts", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    path = build_random_model(args.random_config, args.model_dir)
    engine = load_engine(
        str(path), device="cuda", backend="vllm", dtype="bfloat16", gpu_memory_utilization=0.4
    )
    await engine.start()
    trainer = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).cuda().eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 49152) for _ in range(64)] for _ in range(args.gap_prompts)]
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    try:
        before = [o.token_ids for o in await asyncio.gather(*[engine.generate(p, greedy) for p in prompts])]
        times, parts = [], []
        for rep in range(args.reps + 1):
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(torch.randn_like(p), alpha=0.02)  # an "optimizer step"
            state = trainer.state_dict()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            version = await engine.update_weights(state)
            dt = time.perf_counter() - t0
            if rep > 0:  # the first one is a warm-up
                times.append(dt)
                parts.append(dict(engine.last_update))
        after = [o.token_ids for o in await asyncio.gather(*[engine.generate(p, greedy) for p in prompts])]
        sampled = SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True, seed=3)
        outs = await asyncio.gather(*[engine.generate(p, sampled) for p in prompts])
        gaps = [
            logprob_gap(o.logprobs or [], reference_logprobs(trainer, p, o.token_ids))
            for p, o in zip(prompts, outs, strict=True)
        ]
    finally:
        await engine.stop()
    n_params = sum(p.numel() for p in trainer.parameters())
    med = statistics.median(times)
    result = {
        "model": f"random:{args.random_config}",
        "params": n_params,
        "engine": "VLLMEngine (colocated, CUDA IPC via collective_rpc, drain policy)",
        "engine_dtype": "bfloat16",
        "trainer_dtype": "float32",
        "bytes_sent": parts[-1]["bytes"],
        "tensors_sent": parts[-1]["tensors"],
        "sync_s_median": round(med, 4),
        "sync_s_all": [round(t, 4) for t in times],
        "pack_s_median": round(statistics.median(p["pack_s"] for p in parts), 4),
        "load_s_median": round(statistics.median(p["load_s"] for p in parts), 4),
        "effective_GB_per_s": round(parts[-1]["bytes"] / med / 1e9, 2),
        "target_s": 1.0,
        "weights_version_after": version,
        "greedy_output_changed": sum(a != b for a, b in zip(after, before, strict=True)),
        "of_prompts": len(prompts),
        "logprob_gap_vs_trainer_bf16": {
            "mean_abs": round(statistics.mean(g["mean_abs"] for g in gaps), 5),
            "max_abs": round(max(g["max_abs"] for g in gaps), 5),
            "mean": round(statistics.mean(g["mean"] for g in gaps), 5),
            "ratio_mean_abs": round(statistics.mean(g["ratio_mean_abs"] for g in gaps), 5),
            "tokens": sum(len(o.token_ids) for o in outs),
        },
        "torch": torch.__version__,
        "vllm": __import__("vllm").__version__,
    }
    document = result_file.result(
        result_file.header("weight_sync_bench", gpu=torch.cuda.get_device_name(0)), result
    )
    print(json.dumps(document, indent=2))
    if args.out:
        result_file.write(args.out, document)


if __name__ == "__main__":
    asyncio.run(main())
