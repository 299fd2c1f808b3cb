"""Train SmolLM2-135M-Instruct as Claude Code's model on tiny failing-test repositories, on this CPU.

    python -m examples.coding_tasks.train                           # 6 GRPO steps, before/after held-out
    python -m examples.coding_tasks.train --steps 2 --heldout-size 8 --result /tmp/r.json   # a smoke run

Every attempt is one real Claude Code session (``al.harness.run`` in a bubblewrap sandbox, against the
attempt's proxy URL) on one repository of ``tasks.py``; the reward is 1.0 when the repository's test
passes afterwards, in the same sandbox. The Trainer validates on the held-out repositories greedily
before the first step and after the last (``val/success_rate``), and the run's store keeps every
call, so the summary also gives model calls and branches (conversations) per attempt and prompt
tokens per call; the engine's own counters give the share of prompt tokens its prefix cache served.
``--result`` writes the summary as a benchmark file (benchmarks/results/harness_cpu.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from examples.coding_tasks.agent import HARNESS, HARNESS_OPTIONS, agent
from examples.coding_tasks.tasks import make_tasks

# The recipe (see the README section and the module docstring of agent.py for the measurements)
DEFAULTS: dict[str, Any] = {
    "steps": 6,  # ~5-6 min a step on the 2-core CPU, ~50 min with both validations (+40 points held out)
    "batch_size": 4,  # repositories a step
    "n": 6,  # attempts a repository (GRPO group)
    "lr": 2e-5,
    "temperature": 0.4,  # held-out success of the untrained model: greedy 37.5%, T 0.4 29%, T 0.6 ~3% (JSON breaks)
    "max_tokens": 80,  # per call: the sed call is ~40-65 tokens, "Done." 3
    "concurrency": 16,  # Claude Code sessions at once (each ~1 CPU-second to start)
    "max_context": 2048,  # the engine's per-sequence limit (its KV cache): prompts are ~1.3-1.6k tokens
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m examples.coding_tasks.train", description=__doc__.splitlines()[0]
    )
    p.add_argument("--model", default="smollm2-135m-instruct", help="model alias or HF folder")
    p.add_argument("--steps", type=int, default=DEFAULTS["steps"])
    p.add_argument("--batch-size", type=int, default=DEFAULTS["batch_size"], help="repositories per step")
    p.add_argument("--n", type=int, default=DEFAULTS["n"], help="attempts per repository")
    p.add_argument("--lr", type=float, default=DEFAULTS["lr"])
    p.add_argument("--temperature", type=float, default=DEFAULTS["temperature"], help="training sampling")
    p.add_argument("--max-tokens", type=int, default=DEFAULTS["max_tokens"], help="per model call")
    p.add_argument("--concurrency", type=int, default=DEFAULTS["concurrency"], help="attempts in flight")
    p.add_argument(
        "--max-context", type=int, default=DEFAULTS["max_context"], help="engine tokens per sequence"
    )
    p.add_argument("--train-size", type=int, default=100)
    p.add_argument("--heldout-size", type=int, default=50)
    p.add_argument("--seed", type=int, default=0, help="task generation and trainer seed")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default="runs", help="parent folder of the run folder")
    p.add_argument("--name", default=None, help="run folder name (default coding-tasks-<time>)")
    p.add_argument("--result", default=None, help="also write the summary here (a benchmark JSON)")
    return p


def trainer_config(args: argparse.Namespace, run_dir: Path, model_path: str) -> dict[str, Any]:
    """GRPO as in trainer.demos.tools (engine log-probs, one sample per attempt), sized for a ~1.3k-token
    prompt: a micro-batch holds a group, so its prompt is computed once."""
    return {
        "data": {
            "train_batch_size": args.batch_size,
            "max_prompt_length": 2048,  # first call ~1.3-1.4k tokens; a later call adds ~70 a turn
            "max_response_length": args.max_tokens,
        },
        "actor_rollout_ref": {
            "model": {"path": model_path},
            "rollout": {
                "n": args.n,
                "temperature": args.temperature,
                "concurrency": args.concurrency,
                "max_num_seqs": args.concurrency,
                "agent_timeout_s": 900,
            },
            "actor": {
                "ppo_mini_batch_size": args.batch_size,
                # a group's prompt once + its rows' responses (~1.3k + 6 x ~0.2k): one group a micro-batch;
                # 16384 (several groups at once) took the trainer worker to 15 GB and Ray's OOM killer
                "ppo_max_token_len_per_gpu": 4096,
                "use_engine_logprobs": True,
                "optim": {"lr": args.lr, "weight_decay": 0.0},
                "grad_clip": 1.0,
            },
        },
        "algorithm": {"adv_estimator": "grpo"},
        "adapter": {"trajectory": True},  # one sample per attempt: the calls merged, the tool tokens masked
        "trainer": {
            "total_training_steps": args.steps,
            "test_freq": args.steps,
            "val_before_train": True,
            "default_local_dir": str(run_dir),
            "device": args.device,
            "logger": ["jsonl"],
            "resume": "disable",
            "seed": args.seed,
        },
    }


def held_out_metrics(store_path: Path) -> dict[int, dict[str, Any]]:
    """Per validation step, read from the run's store: success, model calls and branches (the
    conversations an attempt's calls form: main, side calls such as titles, subagents) per attempt,
    and prompt tokens per call."""
    import anyio

    from agentloop.adapter import merge_turns, spans_to_triplets
    from agentloop.store.sqlite import SQLiteStore
    from agentloop.types import LLMCall, Reward

    async def read() -> dict[int, dict[str, Any]]:
        store = SQLiteStore(store_path)
        rows: dict[int, list[dict[str, Any]]] = {}
        try:
            for rollout in await store.list_rollouts():
                if rollout.mode != "val":
                    continue
                spans = await store.query_spans(rollout.rollout_id, "latest")
                calls = [s.payload for s in spans if isinstance(s.payload, LLMCall)]
                rewards = [s.payload.value for s in spans if isinstance(s.payload, Reward)]
                samples = merge_turns(spans_to_triplets(spans).triplets) if calls else []
                rows.setdefault(int(rollout.metadata.get("step", 0)), []).append({  # type: ignore[arg-type]
                    "success": bool(rewards) and sum(rewards) >= 1.0,
                    "calls": len(calls),
                    "branches": len(samples),
                    "prompt_tokens": [len(c.prompt_ids) for c in calls],
                    "response_tokens": [len(c.response_ids) for c in calls],
                    "kind": (rollout.input or {}).get("kind") if isinstance(rollout.input, dict) else None,
                })  # fmt: skip
        finally:
            await store.close()
        return {step: _summarise(r) for step, r in sorted(rows.items())}

    return anyio.run(read)


def _summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    prompt = [t for r in rows for t in r["prompt_tokens"]]
    response = [t for r in rows for t in r["response_tokens"]]
    kinds = sorted({r["kind"] for r in rows if r["kind"]})
    return {
        "n": len(rows),
        "success": sum(r["success"] for r in rows) / len(rows),
        "calls_per_attempt": statistics.fmean(r["calls"] for r in rows),
        "branches_per_attempt": statistics.fmean(r["branches"] for r in rows),
        "prompt_tokens_per_call": statistics.fmean(prompt) if prompt else 0.0,
        "response_tokens_per_call": statistics.fmean(response) if response else 0.0,
        "success_by_kind": {
            k: sum(r["success"] for r in rows if r["kind"] == k) / sum(r["kind"] == k for r in rows)
            for k in kinds
        },
    }


def git_commit() -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "agentloop", "trainer", "examples/coding_tasks"],
                               capture_output=True, text=True)  # fmt: skip
        return head.stdout.strip() + (" + uncommitted edits" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Load the engine, train with held-out validation before and after, and summarise."""
    import anyio

    from agentloop.engine.factory import load_engine
    from agentloop.engine.models import resolve_model
    from trainer.config import TrainerConfig, engine_kwargs
    from trainer.fit.trainer import Trainer

    t0 = time.perf_counter()
    run_dir = Path(args.out) / (args.name or time.strftime("coding-tasks-%Y%m%d-%H%M%S"))
    train, heldout = make_tasks(args.train_size, args.heldout_size, args.seed)
    model_path = str(resolve_model(args.model))
    config = TrainerConfig.from_dict(trainer_config(args, run_dir, model_path))
    kwargs = {**engine_kwargs(config.actor_rollout_ref.rollout), "max_context": args.max_context}
    engine = load_engine(model_path, device=args.device, **kwargs)
    result = Trainer(config).fit(agent, train, heldout, engine=engine)
    stats = engine.stats()
    anyio.run(engine.stop)
    wall_s = time.perf_counter() - t0
    run_dir = Path(result.run_dir)
    by_step = held_out_metrics(run_dir / "store.db")
    before, after = by_step[min(by_step)], by_step[max(by_step)]
    timings = [row for row in result.history]
    summary: dict[str, Any] = {
        "harness": f"claude ({HARNESS}: Claude Code with "
        + " ".join(a if len(a) < 60 else f"<{len(a)} chars>" for a in HARNESS_OPTIONS[HARNESS]["args"])
        + ")",
        "model": args.model,
        "success_before": result.val_history[0]["val/success_rate"],
        "success_after": result.val_history[-1]["val/success_rate"],
        "wall_minutes": round(wall_s / 60, 2),
        "calls_per_attempt": {"before": before["calls_per_attempt"], "after": after["calls_per_attempt"]},
        "branches_per_attempt": {
            "before": before["branches_per_attempt"],
            "after": after["branches_per_attempt"],
        },
        "prompt_tokens_per_call": {
            "before": before["prompt_tokens_per_call"],
            "after": after["prompt_tokens_per_call"],
        },
        "response_tokens_per_call": {
            "before": before["response_tokens_per_call"],
            "after": after["response_tokens_per_call"],
        },
        "prompt_tokens_cached_share": round(stats.get("cached_prompt_share", 0.0), 4),
        "success_by_kind": {"before": before["success_by_kind"], "after": after["success_by_kind"]},
        "steps": result.steps,
        "mean_step_timing_s": {
            k.removeprefix("timing/"): round(statistics.fmean(r[k] for r in timings if k in r), 2)
            for k in sorted({k for r in timings for k in r if k.startswith("timing/")})
        },
        "per_step": [
            {
                k: round(v, 3)
                for k, v in r.items()
                if k in ("step", "reward/mean", "timing/step_s", "timing/rollout_s", "timing/update_s")
            }
            for r in timings
        ],
        "validations": {str(k): v for k, v in by_step.items()},
        "held_out": len(heldout),
        "train": len(train),
        "settings": {k: v for k, v in vars(args).items() if k not in ("result",)},
        "run_dir": str(run_dir),
        "commit": git_commit(),
    }
    summary["gain_points"] = round(100 * (summary["success_after"] - summary["success_before"]), 1)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from agentloop.logging import configure_logging

    args = build_parser().parse_args(argv)
    for key in ("steps", "batch_size", "n", "max_tokens", "concurrency", "train_size", "heldout_size"):
        if getattr(args, key) < 1:
            raise SystemExit(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    configure_logging(level="WARNING")
    summary = run(args)
    if args.result:  # benchmarks/result_file.py's header (this checkout's commit), then the summary
        from benchmarks import result_file

        gpu = None if args.device == "cpu" else "auto"
        head = result_file.header("coding_tasks", gpu=gpu, cpus_allowed=_cores())
        figures = {k: v for k, v in summary.items() if k != "commit"}
        result_file.write(args.result, result_file.result(head, figures))
    sys.stdout.write(
        f"\nheld-out success ({summary['held_out']} repositories, greedy): {summary['success_before']:.1%} before "
        f"-> {summary['success_after']:.1%} after ({summary['gain_points']:+.1f} points) in "
        f"{summary['wall_minutes']:.1f} min\nrun folder: {summary['run_dir']}\n"
    )
    return summary


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0


if __name__ == "__main__":
    main()
