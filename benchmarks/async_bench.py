"""Long-tailed agents: the synchronous trainer against the fully asynchronous one, same seed, same tasks.

    # one GPU (a random-weight Qwen2-0.5B body with SmolLM2's 49k vocabulary, built locally: no hub)
    python benchmarks/async_bench.py --device cuda --out benchmarks/results/async_bench_gpu.json
    # CPU smoke run (the tiny test model, a few steps)
    python benchmarks/async_bench.py --device cpu --steps 3 --batch-size 2 --n 2 --max-len 24

The agent is a multi-turn "tool" agent whose shape is heavy-tailed, as real agent trajectories are:
each task draws its number of model calls and each call's ``max_tokens`` from Pareto distributions
(seeded by the task, so both runs see the same tasks), and a tool turn (an observation message,
masked in training) sits between two calls. Its reward is the share of the letters it writes that
fall in a-m (about 0.5 for a random model): a signal any policy can climb, so the two runs'
reward curves compare how much each learned from the same number of samples.

- ``sync``: ``rollout.max_staleness 0`` (every step waits for its slowest agent, then trains, then
  syncs) with the default ``weight_update_policy: drain``.
- ``async``: ``max_staleness k`` (the next k batches run while one trains) with
  ``weight_update_policy: inflight``: a weight update lands between two decode steps, so nothing
  waits for in-flight requests; each token records the version that sampled it, and token-level
  rollout correction uses the engine's behaviour log-probs.

Steps per hour count from the end of step ``--warmup-steps`` (default 2) to the end of the last
step. The first steps hold one-off warm-up (CUDA graph captures). torch.compile's recompiles used to
land in the updates of steps 1, 2, 8 and 16 (3-26 s each on an H100); the trainer now compiles every
kind of micro-batch when the actor is built (trainer/model/compiled.py), and on an H100 every update took
0.26-1.7 s. Each leg also reports ``steps_per_hour_from_step_1``. Run the legs in both orders
(``--legs sync,async`` and ``--legs async,sync``) and report both ratios: on an H100 (2026-11-27,
``--max-num-seqs 256 --max-staleness 4 --lr 1e-4 --steps 16``) they were 2.16x and 1.99x, and the
leg that ran second was the faster in both orders. ``--max-num-seqs`` sets the engine's slots for
both legs; the engine's default (32) queues the async leg's 320 agents. Prints JSON (and writes ``--out``).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import agentloop as al
from benchmarks import result_file

_LETTERS = re.compile(r"[a-z]")
REWARD_TOLERANCE = 0.01  # "not worse": the async leg's last-quarter reward at most this much below sync's


def a_to_m_share(text: str) -> float:
    """The share of ``text``'s letters (case-folded) that fall in a-m; 0.5 for text with no letter."""
    letters = _LETTERS.findall(text.lower())
    return sum(c <= "m" for c in letters) / len(letters) if letters else 0.5


def make_tasks(
    count: int, seed: int, max_turns: int, base_len: int, max_len: int, max_total: int
) -> list[dict[str, Any]]:
    """``count`` tasks, each with a Pareto-drawn call count (alpha 1.2) and per-call lengths (alpha
    1.5, each at most ``max_len``, together at most ``max_total`` so every attempt fits the context)."""
    tasks = []
    for i in range(count):
        rng = random.Random(seed * 1_000_003 + i)
        turns = min(max_turns, int(rng.paretovariate(1.2)))
        lengths: list[int] = []
        for _ in range(turns):
            room = max_total - sum(lengths)
            if room < 1:
                break
            lengths.append(min(max_len, room, int(base_len * rng.paretovariate(1.5))))
        tasks.append({"id": i, "prompt": f"Task {i}: write freely.", "lengths": lengths})
    return tasks


@al.rollout
async def long_tail_agent(task: dict[str, Any], llm: al.LLM) -> float:
    """Calls the model once per entry of ``task["lengths"]`` (that many tokens at most), with a tool
    observation between calls; returns the mean a-m share of what it wrote."""
    import openai

    client = openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, timeout=600, max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": task["prompt"]}]
    shares = []
    for turn, max_tokens in enumerate(task["lengths"]):
        reply = await client.chat.completions.create(
            model=llm.model,
            messages=messages,
            max_tokens=max_tokens,
            temperature=1.0,  # type: ignore[arg-type]
        )
        text = reply.choices[0].message.content or ""
        shares.append(a_to_m_share(text))
        messages += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": f"tool output {turn}: ok"},
        ]
    return statistics.fmean(shares)


def config(args: argparse.Namespace, mode: str, model: str, run_dir: Path) -> dict[str, Any]:
    """The trainer config of one leg: ``sync`` or ``async`` (module docstring)."""
    staleness = args.max_staleness if mode == "async" else 0
    return {
        "data": {
            "train_batch_size": args.batch_size,
            "max_prompt_length": 128,
            "max_response_length": args.max_total + args.max_turns * 48,  # + the tool turns (masked)
        },
        "actor_rollout_ref": {
            "model": {"path": model},
            "rollout": {
                "n": args.n,
                "temperature": 1.0,
                "max_staleness": staleness,
                "weight_update_policy": "inflight" if mode == "async" else "drain",
                "concurrency": args.batch_size * args.n * (staleness + 1),
                "max_num_seqs": args.max_num_seqs,
            },
            "actor": {
                "ppo_mini_batch_size": args.batch_size,
                "ppo_max_token_len_per_gpu": args.token_budget,
                "use_engine_logprobs": True,
                "optim": {"lr": args.lr, "weight_decay": 0.0},
                "grad_clip": 1.0,
            },
        },
        "adapter": {"trajectory": True},
        "algorithm": {"adv_estimator": "grpo"},
        "trainer": {
            "total_training_steps": args.steps,
            "val_before_train": False,
            "test_freq": 0,
            "save_freq": 0,
            "default_local_dir": str(run_dir),
            "device": args.device,
            "logger": ["jsonl"],
            "resume": "disable",
            "seed": args.seed,
        },
    }


def leg(args: argparse.Namespace, mode: str, model: str, tasks: list[dict[str, Any]]) -> dict[str, Any]:
    """Train one leg; its steps per hour, reward curve and staleness."""
    from trainer import Trainer

    run_dir = Path(tempfile.mkdtemp(prefix=f"agentloop-async-bench-{mode}-"))
    t0 = time.perf_counter()
    result = Trainer(config(args, mode, model, run_dir)).fit(long_tail_agent, tasks)
    wall = time.perf_counter() - t0
    rows = [r for r in result.history if "reward/mean" in r]
    trained = [r for r in rows if "timing/step_s" in r]
    ends = [r["timing/elapsed_s"] for r in rows]
    samples = [r.get("batch/samples", 0.0) for r in rows]
    rewards = [r["reward/mean"] for r in rows]
    tail = max(1, len(rewards) // 4)
    return {
        "mode": mode,
        "steps": len(rows),
        "warmup_steps": args.warmup_steps,
        "steps_per_hour": round(steps_per_hour(ends, args.warmup_steps), 1),
        "steps_per_hour_from_step_1": round(steps_per_hour(ends, 1), 1),
        "wall_s": round(wall, 1),
        "mean_step_s": round(statistics.fmean(r["timing/step_s"] for r in trained), 2),
        "mean_phase_s": _phases(trained[1:] or trained),  # step 1 holds the one-off warm-up
        "steps_without_update": len(rows) - len(trained),  # every sample cut or dropped: nothing to train
        "reward_first": round(rewards[0], 4),
        "reward_last_quarter_mean": round(statistics.fmean(rewards[-tail:]), 4),
        "staleness_max": max((r.get("rollout/staleness_max", 0.0) for r in rows), default=0.0),
        "mixed_version_samples": sum(r.get("rollout/mixed_version_samples", 0.0) for r in rows),
        "curve": [
            {
                "step": r["step"],
                "samples_seen": sum(samples[: i + 1]),
                "reward": round(r["reward/mean"], 4),
                "elapsed_s": round(r["timing/elapsed_s"], 2),
                "rollout_s": round(r.get("timing/rollout_s", float("nan")), 2),
                "update_s": round(r.get("timing/update_s", float("nan")), 2),
                "sync_s": round(r.get("timing/sync_s", float("nan")), 3),
            }
            for i, r in enumerate(rows)
        ],
    }


def steps_per_hour(ends: list[float], warmup_steps: int) -> float:
    """Steps per hour from the end of step ``warmup_steps`` to the end of the last step, given each
    step's end (seconds since the loop began; 0 warm-up steps count from the loop's start). NaN when
    the leg has no step after its warm-up: a rate needs at least ``warmup_steps + 1`` steps."""
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if len(ends) <= warmup_steps:
        return float("nan")
    start = ends[warmup_steps - 1] if warmup_steps else 0.0
    return (len(ends) - warmup_steps) / (ends[-1] - start) * 3600


def _phases(rows: list[dict[str, float]]) -> dict[str, float]:
    """Where a step's time went, means over ``rows``: waiting for its rollouts, the update (as the
    driver waits for it), the weight sync, and the rest (adapter, batch building, bookkeeping)."""

    def mean(key: str) -> float:
        return statistics.fmean(r.get(key, 0.0) for r in rows)

    known = {"wait_s": mean("timing/wait_s"), "update_s": mean("timing/update_wall_s"),
             "sync_s": mean("timing/sync_s")}  # fmt: skip
    return {
        k: round(v, 3) for k, v in {**known, "other_s": mean("timing/step_s") - sum(known.values())}.items()
    }


def _model(args: argparse.Namespace) -> str:
    if args.model:
        return str(args.model)
    if args.device == "cuda":
        from random_model import build_random_model

        return str(build_random_model("qwen2-0.5b-smol-vocab"))
    from tests.tiny_model import build_tiny_model

    return str(build_tiny_model(Path(tempfile.gettempdir()) / "agentloop-async-bench-tiny"))


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument(
        "--model", default=None, help="HF folder (default: random Qwen2-0.5B on cuda, tiny on cpu)"
    )
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch-size", type=int, default=16, help="tasks per step")
    ap.add_argument("--n", type=int, default=4, help="attempts per task (GRPO group)")
    ap.add_argument("--max-turns", type=int, default=6, help="most model calls per attempt")
    ap.add_argument("--base-len", type=int, default=32, help="Pareto scale of a call's max_tokens")
    ap.add_argument("--max-len", type=int, default=768, help="cap on a call's max_tokens")
    ap.add_argument("--max-total", type=int, default=2048, help="cap on an attempt's generated tokens")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="engine batch (default: the engine's)")
    ap.add_argument("--max-staleness", type=int, default=2, help="async leg: batches ahead of the weights")
    ap.add_argument("--lr", type=float, default=2e-6)
    ap.add_argument("--token-budget", type=int, default=16384, help="ppo_max_token_len_per_gpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--warmup-steps", type=int, default=2,
        help="steps/hour count from the end of this many steps (one-off compiles; module docstring)",
    )  # fmt: skip
    ap.add_argument("--legs", default="sync,async", help="which legs to run, in order")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--previous", type=Path, default=None, help="a JSON of earlier legs (one call per leg on a GPU)"
    )
    args = ap.parse_args()
    if not 0 <= args.warmup_steps < args.steps:
        ap.error(f"--warmup-steps ({args.warmup_steps}) must be >= 0 and below --steps ({args.steps}): "
                 "steps/hour counts the steps after the warm-up")  # fmt: skip
    model = _model(args)
    tasks = make_tasks(args.steps * args.batch_size * (args.max_staleness + 1), args.seed, args.max_turns,
                       args.base_len, args.max_len, args.max_total)  # fmt: skip
    head = result_file.header("async_bench", gpu=_card(args.device))
    out: dict[str, Any] = {
        "what": "long-tailed multi-turn agents, sync vs fully async (inflight updates)",
        "device": args.device,
        "model": model,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "calls_per_attempt_mean": statistics.fmean(len(t["lengths"]) for t in tasks),
        "max_tokens_per_attempt_p50_p99": _percentiles([sum(t["lengths"]) for t in tasks]),
    }
    if args.previous is not None:  # legs measured by an earlier call on the same machine
        earlier = json.loads(args.previous.read_text())
        if earlier.get("card") != head["card"]:
            raise SystemExit(f"--previous ran on {earlier.get('card')!r}, this run on {head['card']!r}")
        for mode in ("sync", "async"):
            # a leg recorded before --warmup-steps existed counted its steps/hour from the end of step 1
            warmup = earlier[mode].get("warmup_steps", 1) if mode in earlier else args.warmup_steps
            if warmup != args.warmup_steps:
                raise SystemExit(f"--previous's {mode} leg counts steps/hour after {warmup} warm-up steps, "
                                 f"this run after {args.warmup_steps}: pass --warmup-steps {warmup} or rerun that leg")  # fmt: skip
        out.update({k: earlier[k] for k in ("sync", "async") if k in earlier})
    for mode in args.legs.split(","):
        out[mode] = leg(args, mode, model, tasks)
        _save(result_file.result(head, out), args.out)
    if "sync" in out and "async" in out:
        s, a = out["sync"], out["async"]
        out["speedup_steps_per_hour"] = round(a["steps_per_hour"] / s["steps_per_hour"], 3)
        out["warmup_steps"] = args.warmup_steps
        if "steps_per_hour_from_step_1" in s and "steps_per_hour_from_step_1" in a:
            out["speedup_steps_per_hour_from_step_1"] = round(
                a["steps_per_hour_from_step_1"] / s["steps_per_hour_from_step_1"], 3
            )
        # after the same number of samples (same steps, same batch size): the last quarter's mean
        out["reward_tolerance"] = REWARD_TOLERANCE
        out["reward_not_worse"] = (
            a["reward_last_quarter_mean"] >= s["reward_last_quarter_mean"] - REWARD_TOLERANCE
        )
    _save(result_file.result(head, out), args.out)
    print(json.dumps(result_file.result(head, out), indent=2))


def _percentiles(values: list[int]) -> list[float]:
    ordered = sorted(values)
    return [ordered[len(ordered) // 2], ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]]


def _card(device: str) -> str | None:
    """The GPU the legs ran on (the header's card); None on the CPU."""
    if device != "cuda":
        return None
    import torch

    return torch.cuda.get_device_name(0)


def _save(document: dict[str, Any], path: Path | None) -> None:
    if path is not None:
        result_file.write(path, document)


if __name__ == "__main__":
    main()
