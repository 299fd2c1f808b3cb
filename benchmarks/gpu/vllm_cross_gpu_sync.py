"""Weight sync into a vLLM engine on ANOTHER GPU than the trainer's weights (needs 2 GPUs and vLLM).

    python benchmarks/gpu/vllm_cross_gpu_sync.py --out $OUT/vllm_cross_gpu_sync.json

VLLMEngine runs on cuda:0; a bf16 copy of the same model, perturbed, sits on cuda:1 (the trainer's
GPU). ``update_weights`` packs those tensors into one buffer on cuda:1, hands its CUDA IPC handle to
vLLM's worker through ``collective_rpc``, and the worker loads them GPU to GPU (no host round trip).
In the same run, as baselines: the same update from tensors on cuda:0 (colocated) and from CPU
tensors. Checks that greedy output changes, a vLLM parameter equals what was sent, and the weights
version advances. Prints JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from agentloop.engine.base import SamplingParams
from benchmarks import result_file
from benchmarks.gpu.random_model import RANDOM_CONFIGS, build_random_model


async def timed_updates(engine: Any, named: dict[str, torch.Tensor], reps: int) -> dict[str, Any]:
    totals, loads = [], []
    for _ in range(reps):
        await engine.update_weights(named)
        totals.append(engine.last_update["total_s"])
        loads.append(engine.last_update["load_s"])
    return {
        "source_device": str(next(iter(named.values())).device),
        "total_s_median": round(statistics.median(totals), 4),
        "load_s_median": round(statistics.median(loads), 4),
        "total_s": [round(t, 4) for t in totals],
        "bytes": engine.last_update["bytes"],
        "tensors": engine.last_update["tensors"],
    }


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--random-config", choices=sorted(RANDOM_CONFIGS), default="qwen2-0.5b")
    ap.add_argument("--model-dir", default="/tmp/qwen05")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit(f"needs 2 GPUs, found {torch.cuda.device_count()}")
    from transformers import AutoModelForCausalLM

    from agentloop.engine.vllm_engine import VLLMEngine

    path = build_random_model(args.random_config, args.model_dir)
    engine = VLLMEngine(path, gpu_memory_utilization=0.4, max_batch_size=64)
    await engine.start()
    trainer = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda:1")
    g = torch.Generator(device="cuda:1").manual_seed(0)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn(p.shape, generator=g, device=p.device, dtype=p.dtype) * 0.02)
    on_trainer_gpu = {k: v.detach() for k, v in trainer.state_dict().items()}
    prompt = list(range(100, 140))
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    before = await engine.generate(prompt, greedy)
    cross = await timed_updates(engine, on_trainer_gpu, args.reps)
    after = await engine.generate(prompt, greedy)
    sent = float(on_trainer_gpu["model.norm.weight"].float().sum())
    loaded = await engine.param_sum("model.norm.weight")
    colocated = await timed_updates(engine, {k: v.to("cuda:0") for k, v in on_trainer_gpu.items()}, args.reps)
    host = await timed_updates(engine, {k: v.cpu() for k, v in on_trainer_gpu.items()}, args.reps)
    import vllm

    result = {
        "model": f"random:{args.random_config}",
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "engine_gpu": 0,
        "trainer_gpu": 1,
        "cross_gpu_ipc": cross,
        "colocated_ipc_baseline": colocated,
        "from_host_baseline": host,
        "greedy_output_changed": before.token_ids != after.token_ids,
        "param_check": {
            "sent_sum": sent,
            "vllm_sum": loaded,
            "ok": abs(sent - loaded) <= 1e-2 * max(1.0, abs(sent)),
        },
        "weights_version": engine.weights_version,
        "target_s": 1.0,
        "vllm": vllm.__version__,
        "torch": torch.__version__,
    }
    await engine.stop()
    document = result_file.result(result_file.header("vllm_cross_gpu_sync"), result)
    print(json.dumps(document, indent=2))
    if args.out:
        result_file.write(args.out, document)
    ok = result["greedy_output_changed"] and result["param_check"]["ok"]
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    asyncio.run(main())
