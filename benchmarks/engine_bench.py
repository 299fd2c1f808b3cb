"""Generated tokens/s of an agentloop engine against its baseline on the same workload, in one run.

``--backend torch``: TorchEngine (continuous batching) vs Hugging Face ``model.generate`` with left
padding (N chat prompts x M new tokens, sampling, eos ignored so both produce exactly N*M tokens).
``--backend vllm``: agentloop's VLLMEngine vs raw vLLM ``AsyncLLM`` (N random-token prompts x M new
tokens, logprobs on), both warm in one process, timed alternately (see benchmarks/gpu/vllm_bench.py).
``--random-config qwen2-0.5b`` builds a random-weight Qwen2-0.5B-shaped bf16 model locally (no hub)
with the SmolLM2 tokenizer. Prints JSON (and writes it to ``--out``).

    python benchmarks/engine_bench.py [--model smollm2-135m-instruct] [--device cpu] [--prompts 32] [--new-tokens 128]
    python benchmarks/engine_bench.py --device cuda --random-config qwen2-0.5b --prompts 128 --new-tokens 128
    python benchmarks/engine_bench.py --quick            # CPU smoke run: 8 prompts x 16 tokens

Both sides warm up on the full batch (4 tokens) before the timed run; the engine's counters
(ms per decode step, prefill seconds, CUDA graph captures / replays) come with the result.
    python benchmarks/engine_bench.py --backend vllm --random-config qwen2-0.5b --prompts 128 --new-tokens 128
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from typing import Any

import torch

from agentloop.engine.base import SamplingParams
from agentloop.engine.models import pick_device, resolve_model
from agentloop.engine.torch_engine import TorchEngine

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu"))
from random_model import RANDOM_CONFIGS, build_random_model

QUESTIONS = [
    "What is the capital of France?",
    "Explain photosynthesis in one paragraph.",
    "Write a haiku about the sea.",
    "How do I reverse a list in Python?",
    "What is 17 times 23?",
    "Give me three tips for better sleep.",
    "Summarise the plot of Romeo and Juliet.",
    "Why is the sky blue?",
]


def prompts(tokenizer: Any, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        q = QUESTIONS[i % len(QUESTIONS)] + (" Please answer carefully." * (i % 4))
        ids = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        out.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
    return out


def bench_hf(model: Any, tok: Any, batch: list[list[int]], new_tokens: int, sp: SamplingParams) -> float:
    tok.padding_side = "left"
    enc = tok.pad({"input_ids": batch}, return_tensors="pt").to(model.device)
    kw = dict(do_sample=True, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k or None)
    with torch.inference_mode():
        model.generate(**enc, max_new_tokens=4, min_new_tokens=4, **kw)  # warm-up
        t0 = time.perf_counter()
        out = model.generate(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        dt = time.perf_counter() - t0
    n = (out.shape[1] - enc["input_ids"].shape[1]) * out.shape[0]
    assert n == len(batch) * new_tokens, (n, len(batch), new_tokens)
    return n / dt


async def bench_engine(
    engine: TorchEngine, batch: list[list[int]], new_tokens: int, sp: SamplingParams
) -> tuple[float, dict[str, Any]]:
    warm = sp.model_copy(update={"max_tokens": 4})  # warm-up on the full batch, as bench_hf does
    await asyncio.gather(
        *[engine.generate(p, warm.model_copy(update={"seed": -1 - i})) for i, p in enumerate(batch)]
    )
    engine._prefix.clear()  # measure without the warm-up's prefix
    before = engine.stats()
    t0 = time.perf_counter()
    outs = await asyncio.gather(
        *[engine.generate(p, sp.model_copy(update={"seed": i})) for i, p in enumerate(batch)]
    )
    dt = time.perf_counter() - t0
    n = sum(len(o.token_ids) for o in outs)
    assert n == len(batch) * new_tokens, (n, len(batch), new_tokens)
    after = engine.stats()
    steps = after["decode_steps"] - before["decode_steps"]
    decode_s = (
        after["decode_ms_per_step"] * after["decode_steps"]
        - before["decode_ms_per_step"] * before["decode_steps"]
    )
    stats = {
        "decode_steps": steps,
        "mean_decode_batch": round((after["decode_rows"] - before["decode_rows"]) / max(steps, 1), 1),
        "ms_per_decode_step": round(decode_s / max(steps, 1), 2),
        "prefill_s": round(after["prefill_s"] - before["prefill_s"], 3),
        "prefill_batches": after.get("prefill_batches", 0) - before.get("prefill_batches", 0),
        "wall_s": round(dt, 3),
        "cuda_graphs": after["cuda_graphs"],
        "graph_captures_in_timed_run": after["graph_captures"] - before["graph_captures"],
        "graph_replays_in_timed_run": after["graph_replays"] - before["graph_replays"],
    }
    return n / dt, stats


def machine_info(device: str) -> dict[str, Any]:
    machine: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }
    if device.startswith("cuda"):
        machine["gpu"] = torch.cuda.get_device_name(0)
    return machine


def emit(result: dict[str, Any], out: str | None) -> None:
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=["torch", "vllm"], default="torch")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--random-config", choices=sorted(RANDOM_CONFIGS), default=None)
    ap.add_argument("--model-dir", default=None, help="where --random-config builds its model")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=128, help="vllm backend: random prompt length")
    ap.add_argument("--reps", type=int, default=3, help="vllm backend: timed rounds per engine")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--quick", action="store_true", help="smoke run: 8 prompts x 16 new tokens")
    ap.add_argument("--no-cuda-graphs", action="store_true", help="TorchEngine without CUDA graphs (A/B)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.new_tokens = 8, 16
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.random_config:
        path = build_random_model(args.random_config, args.model_dir)
        args.model = f"random:{args.random_config}"
    else:
        path = resolve_model(args.model)
    if args.backend == "vllm":
        from vllm_bench import bench_vllm

        result = await bench_vllm(path, args)
        result["machine"] = machine_info("cuda")
        emit(result, args.out)
        return
    device = pick_device(args.device)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    tok = AutoTokenizer.from_pretrained(path)
    batch = prompts(tok, args.prompts)
    sp = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        max_tokens=args.new_tokens,
        ignore_eos=True,
        logprobs=True,
    )
    engine = TorchEngine(
        path,
        device=device,
        dtype=dtype,
        max_batch_size=max(args.prompts, 1),
        cuda_graphs=not args.no_cuda_graphs,
    )
    load = {"start": round(os.getloadavg()[0], 2)}  # other users of the machine skew CPU figures
    engine_tps, engine_stats = await bench_engine(engine, batch, args.new_tokens, sp)
    load["after_engine"] = round(os.getloadavg()[0], 2)
    await engine.stop()
    del engine
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    hf_tps = bench_hf(hf, tok, batch, args.new_tokens, sp)
    load["after_hf"] = round(os.getloadavg()[0], 2)
    result = {
        "model": args.model,
        "device": device,
        "dtype": str(dtype).removeprefix("torch."),
        "workload": {
            "prompts": args.prompts,
            "new_tokens": args.new_tokens,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "ignore_eos": True,
            "prompt_tokens_min_max": [min(map(len, batch)), max(map(len, batch))],
        },
        "torch_engine_tokens_per_s": round(engine_tps, 1),
        "hf_generate_left_padding_tokens_per_s": round(hf_tps, 1),
        "ratio": round(engine_tps / hf_tps, 2),
        "torch_engine_stats": engine_stats,
        "machine": {**machine_info(device), "load_avg_1m": load},
    }
    emit(result, args.out)


if __name__ == "__main__":
    asyncio.run(main())
