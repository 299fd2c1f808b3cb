"""One TorchEngine in one process, the same kind of wave again and again: how much a wave's engine time
varies with no Ray and no other replica (a diagnostic for scale_bench's 4-replica rollout spread, where
the same 64 x 128-token wave took 0.57-0.99 s of engine step time by replica and wave).

    python benchmarks/gpu/engine_waves.py --waves 8 > waves.json

Builds the random-weight Qwen2-0.5B body (random_model.py), starts a TorchEngine with 64 slots and runs
``--waves`` waves of 64 concurrent requests (64 random prompt tokens, 128 new tokens, temperature 1, EOS
ignored), as scale_bench's rollout does, back to back after one warm-up wave. Prints JSON: per wave its
wall time, the engine's step / prefill / decode / idle-capture seconds and graph captures in it, and the
GPU's SM clock, temperature and power right after it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from random_model import build_random_model

from agentloop.engine.base import SamplingParams
from agentloop.engine.factory import load_engine
from benchmarks import result_file

_COUNTERS = ("step_s", "prefill_s", "decode_s", "idle_capture_s", "decode_steps", "graph_captures")


def _gpu_state() -> str:
    query = "--query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw"
    out = subprocess.run(["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True)
    return out.stdout.strip()


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--waves", type=int, default=8)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=128)
    args = ap.parse_args()
    engine = load_engine(str(build_random_model("qwen2-0.5b")), device="cuda", max_batch_size=args.requests)
    await engine.start()
    rng = random.Random(1)
    sampling = SamplingParams(temperature=1.0, max_tokens=args.gen_tokens, ignore_eos=True, seed=0)

    async def wave(tag: str) -> dict[str, Any]:
        prompts = [[rng.randrange(3, 30000) for _ in range(64)] for _ in range(args.requests)]
        before = engine.stats()
        t0 = time.perf_counter()
        await asyncio.gather(
            *[engine.generate(p, sampling, request_id=f"{tag}-{i}") for i, p in enumerate(prompts)]
        )
        wall = time.perf_counter() - t0
        after = engine.stats()
        deltas = {k: round(after.get(k, 0) - before.get(k, 0), 4) for k in _COUNTERS}
        return {"wave": tag, "wall_s": round(wall, 4), **deltas, "gpu_after": _gpu_state()}

    try:
        waves = [await wave("warm")] + [await wave(f"w{i}") for i in range(args.waves)]
    finally:
        await engine.stop()
    timed = [w["step_s"] for w in waves[1:]]
    figures = {"waves": waves, "step_s_min_max": [min(timed), max(timed)], "gpu": _gpu_state()}
    document = result_file.result(result_file.header("engine_waves"), figures)
    sys.stdout.write(json.dumps(document, indent=1) + "\n")


if __name__ == "__main__":
    asyncio.run(main())
