"""A verifiers environment trained unchanged by ``agentloop train``, SmolLM2-135M: does reward rise?

    make frameworks                  # .venv/frameworks/verifiers: verifiers 0.4.0 + agentloop
    OMP_NUM_THREADS=1 nice -n 19 .venv/frameworks/verifiers/bin/python benchmarks/verifiers_bench.py
    bash benchmarks/gpu/run_verifiers_calc.sh     # on the GPU machine: calc_job.yaml, --set trainer.device=cuda

Runs ``agentloop train JOB`` (default ``examples/verifiers_envs/arith_job.yaml``: the single-turn env
vf_arith.py; ``--job`` names another, e.g. the tool env's calc_job.yaml) into a fresh run folder, then reads the
run's metrics.jsonl and store.db and writes the result (``--out``, default
``benchmarks/results/verifiers_cpu.json``): the held-out success rate (and mean reward) before/after, the
training reward and success rate of the first/last steps (each also as the mean of 3 steps), every step's
reward, success rate and rewards by value, the wall minutes. The description ("what") is read from the job and
its environment: the env module's first docstring line and its ``@vf.reward`` methods with their weights.
A success is an episode whose reward is >= 1 (agentloop's ``val/success_rate`` rule): with a shaping reward
worth less than 1 beside an answer reward of 1, the success rate is the fraction of right answers.
``--set KEY=VALUE`` passes overrides to ``agentloop train``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "examples" / "verifiers_envs" / "arith_job.yaml"
RESULT = ROOT / "benchmarks" / "results" / "verifiers_cpu.json"


def read_metrics(run_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The training steps' rows and the validation rows of a run's metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "reward/mean" in r]
    vals = [r for r in rows if "val/reward_mean" in r]
    return steps, vals


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def train_rewards(run_dir: Path) -> dict[int, list[float]]:
    """Each training step's episode rewards (the metrics' step numbers), read from the run's store.db: the
    reward spans of each finished training rollout's latest attempt, summed (as the trainer sums them)."""
    from agentloop.commands.inspect_store import ReadOnlyStore
    from agentloop.types import Reward, RolloutStatus

    async def read() -> dict[int, list[float]]:
        store = ReadOnlyStore(run_dir / "store.db")
        steps: dict[int, list[float]] = {}
        try:
            for rollout in await store.list_rollouts():
                if rollout.mode != "train" or rollout.status is not RolloutStatus.SUCCEEDED:
                    continue
                spans = await store.query_spans(rollout.rollout_id)
                total = sum(s.payload.value for s in spans if isinstance(s.payload, Reward))
                step = int(rollout.metadata["step"]) + 1  # rollouts of metrics step N are enqueued at N - 1
                steps.setdefault(step, []).append(float(total))
        finally:
            await store.close()
        return steps

    return asyncio.run(read())


def success(rewards: list[float]) -> float | None:
    """The fraction of episodes with reward >= 1 (agentloop's val/success_rate rule)."""
    return sum(r >= 1.0 for r in rewards) / len(rewards) if rewards else None


def first_line(doc: str | None) -> str:
    return ((doc or "").strip().splitlines() or [""])[0].rstrip(".")


def describe(job: Any, job_path: Path, device: str) -> str:
    """What the run trains, read from the job and its environment (no per-env text in this script)."""
    env = job.agent.env
    module = sys.modules[type(env.taskset).__module__]
    where = Path(str(module.__file__)).resolve()
    where_text = str(where.relative_to(ROOT)) if where.is_relative_to(ROOT) else where.name
    summary = first_line(module.__doc__)
    task = job.agent.task(job.train[0])
    rewards = ", ".join(
        f"{fn.__name__} x{getattr(fn, '_vf_weight', 1.0):g} ({first_line(fn.__doc__)})"
        for fn in task.hooks("reward")
    )
    model = job.config.actor_rollout_ref.model.path
    val = f"; validation greedy on the job's val_data ({len(job.val)} tasks)" if job.val else ""
    return (
        f"a verifiers {version('verifiers')} environment ({where_text}: {summary}; its @vf.reward methods: "
        f"{rewards}) trained unchanged by agentloop train ({job_path.name}), GRPO on {model} on the "
        f"{'GPU' if device == 'cuda' else 'CPU'}{val}"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", type=Path, default=JOB)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", type=Path, default=RESULT)
    p.add_argument(
        "--time-limit",
        type=float,
        default=None,
        metavar="S",
        help="stop the run (SIGTERM: a clean stop) after S seconds and write what the finished steps measured",
    )
    args = p.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="verifiers-bench-")) / "run"
    # python -m agentloop.cli: also where agentloop is on PYTHONPATH rather than installed (the GPU machine)
    cmd = [
        sys.executable,
        "-m",
        "agentloop.cli",
        "train",
        str(args.job),
        "--set",
        f"trainer.default_local_dir={run_dir}",
    ]
    for item in args.overrides:
        cmd += ["--set", item]
    job_path = args.job.resolve()
    shown = " ".join(
        ["agentloop", "train", str(job_path.relative_to(ROOT) if job_path.is_relative_to(ROOT) else job_path)]
    )
    shown += "".join(f" --set {o}" for o in args.overrides)
    from agentloop.commands.train import load_job

    job = load_job(args.job, args.overrides)  # the tasks it trains and validates on, for the record
    device = job.config.trainer.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = device.split(":")[0]
    load_before = os.getloadavg()
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT)
    stopped = None
    try:
        proc.wait(timeout=args.time_limit)
    except subprocess.TimeoutExpired:  # SIGTERM stops a fit cleanly: the finished steps stay in metrics.jsonl
        stopped = f"stopped by SIGTERM at the time limit ({args.time_limit:g} s)"
        proc.terminate()
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    wall = time.monotonic() - start
    if proc.returncode != 0 and not (stopped and (run_dir / "metrics.jsonl").exists()):
        print(f"agentloop train exited {proc.returncode}; run folder {run_dir}", file=sys.stderr)
        return proc.returncode or 1
    steps, vals = read_metrics(run_dir)
    rewards = [float(r["reward/mean"]) for r in steps]
    episodes = train_rewards(run_dir)
    wins = [success(episodes.get(int(r["step"]), [])) for r in steps]
    known = [w for w in wins if w is not None]
    from benchmarks import result_file

    prefix = "".join(
        f"{k}={os.environ[k]} " for k in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES") if k in os.environ
    )
    niceness = os.nice(0)
    nice = f"nice -n {niceness} " if niceness else ""
    command = f"{prefix}{nice}{result_file.command_line()}"
    head = result_file.header(
        "verifiers_bench",
        command=command,
        gpu="auto" if device == "cuda" else None,
        load_average_at_start=[round(x, 2) for x in load_before],
        nice=niceness,
    )
    summary: dict[str, Any] = {
        "what": describe(job, args.job, device),
        "train_command": shown,
        "job_file": args.job.read_text(),
        "verifiers_version": version("verifiers"),
        "device": device,
        "steps": len(steps),
        "stopped_early": stopped,
        "wall_minutes": round(wall / 60, 1),
        "train_tasks": len(job.train),
        "val_tasks": len(job.val or []),
        "success_rule": "an episode's reward >= 1 (agentloop's val/success_rate)",
        "val_accuracy_before": vals[0]["val/success_rate"] if vals else None,
        "val_accuracy_after": vals[-1]["val/success_rate"] if len(vals) > 1 else None,
        "val_reward_before": vals[0]["val/reward_mean"] if vals else None,
        "val_reward_after": vals[-1]["val/reward_mean"] if len(vals) > 1 else None,
        "reward_first": rewards[0] if rewards else None,
        "reward_last": rewards[-1] if rewards else None,
        "reward_first3_mean": round(mean(rewards[:3]), 4) if len(rewards) >= 3 else None,
        "reward_last3_mean": round(mean(rewards[-3:]), 4) if len(rewards) >= 3 else None,
        "success_first3_mean": round(mean(known[:3]), 4) if len(known) >= 3 else None,
        "success_last3_mean": round(mean(known[-3:]), 4) if len(known) >= 3 else None,
        "per_step": [
            {
                **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k in KEEP},
                "success_rate": None if w is None else round(w, 4),
                "rewards_by_value": by_value(episodes.get(int(r["step"]), [])),
            }
            for r, w in zip(steps, wins, strict=True)
        ],
        "validation": [
            {k: v for k, v in r.items() if k.startswith("val/") or k == "timing/val_s"} for r in vals
        ],
        "run_dir": str(run_dir),
    }
    document = result_file.result(head, summary)
    result_file.write(args.out, document)
    print(
        json.dumps(
            {k: v for k, v in document.items() if k not in ("per_step", "validation", "job_file")}, indent=2
        )
    )
    return 0


def by_value(rewards: list[float]) -> dict[str, int]:
    """How many episodes got each reward ("1.1": 3): a shaping reward shows apart from the answer's."""
    counts: dict[str, int] = {}
    for r in sorted(rewards):
        counts[f"{r:g}"] = counts.get(f"{r:g}", 0) + 1
    return counts


KEEP = ("step", "reward/mean", "actor/grad_norm", "timing/rollout_s", "timing/update_s", "timing/step_s")

if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
