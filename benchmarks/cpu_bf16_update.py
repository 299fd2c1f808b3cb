"""The trainer's CPU update in fp32 against bf16 autocast: time per forward+backward and the log-prob gap.

    python benchmarks/cpu_bf16_update.py --out benchmarks/results/cpu_bf16_update.json

One micro-batch the size of ``make demo``'s (``--batch`` sequences of ``--length`` tokens) through
SmolLM2-135M-Instruct in training mode: the token log-probs (log_softmax over the vocabulary, gathered
at the next token, as the actor computes them) and their mean's backward. The two modes alternate,
after one warm-up each, so a machine that gets busier mid-run slows both. The log-prob gap (bf16
autocast against fp32, same weights and tokens) is what a PPO ratio would see as noise if the update
ran in bf16 while the engine's behaviour log-probs stay fp32. Whether bf16 pays depends on the CPU:
AMX or AVX512-BF16 run bf16 matmuls natively; AVX2-only CPUs emulate them. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import result_file


def cpu_flags() -> list[str]:
    """The bf16-relevant flags of this CPU (Linux only; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next(
        (line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []
    )
    return sorted(f for f in set(flags) if f in {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})


def token_logprobs(model: Any, ids: torch.Tensor, bf16: bool) -> torch.Tensor:
    """(B, T-1) log-probs of each next token, the logits' softmax taken in fp32."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = model(input_ids=ids).logits[:, :-1]  # (B, T-1, V)
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def timed_step(model: Any, ids: torch.Tensor, bf16: bool) -> float:
    t0 = time.perf_counter()
    loss = -token_logprobs(model, ids, bf16).mean()
    loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--batch", type=int, default=4, help="sequences per micro-batch")
    ap.add_argument("--length", type=int, default=448, help="tokens per sequence (prompt + response)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from agentloop.engine.models import resolve_model

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(resolve_model("smollm2-135m-instruct"), dtype=torch.float32)
    model.train()
    ids = torch.randint(0, int(model.config.vocab_size), (args.batch, args.length))
    with torch.no_grad():
        gap = (token_logprobs(model, ids, True) - token_logprobs(model, ids, False)).abs()
    times: dict[str, list[float]] = {"fp32": [], "bf16": []}
    for mode in ("fp32", "bf16"):  # warm-up
        timed_step(model, ids, mode == "bf16")
    for _ in range(args.repeats):
        for mode in ("fp32", "bf16"):
            times[mode].append(timed_step(model, ids, mode == "bf16"))
    fp32, bf16 = statistics.median(times["fp32"]), statistics.median(times["bf16"])
    figures = {
        "what": "CPU update step (forward + backward of token log-probs), fp32 vs bf16 autocast",
        "model": "SmolLM2-135M-Instruct",
        "threads": torch.get_num_threads(),
        "batch": args.batch,
        "length": args.length,
        "seconds": {k: [round(v, 3) for v in vs] for k, vs in times.items()},
        "median_s": {"fp32": round(fp32, 3), "bf16": round(bf16, 3)},
        "speedup_bf16": round(fp32 / bf16, 3),
        "logprob_gap": {
            "mean": float(gap.mean()),
            "p99": float(gap.flatten().quantile(0.99)),
            "max": float(gap.max()),
        },
    }
    document = result_file.result(
        result_file.header("cpu_bf16_update", gpu=None, cpu_flags=cpu_flags()), figures
    )
    if args.out is not None:
        result_file.write(args.out, document)
    print(json.dumps(document, indent=2))


if __name__ == "__main__":
    main()
