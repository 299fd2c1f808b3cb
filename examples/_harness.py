"""What every example's run script shares: start store + engine + proxy + runner, run N rollouts, summarise.

``run_rollouts`` takes an engine (so tests can pass the tiny model, or a scripted engine);
``main_args`` / ``run_cli`` give each example the same flags (``--model``, ``--rollouts``, ...).
Without ``--train`` nothing is trained: the summary shows what a trainer would get (rewards, triplets,
masked tokens); ``--train STEPS`` runs ``trainer.Trainer.fit`` on the same tasks instead.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from typing import Any

import anyio

from agentloop.adapter import merge_turns, triplets_for_rollouts
from agentloop.proxy.server import Proxy
from agentloop.resources import Resources
from agentloop.runner import Runner
from agentloop.store.memory import MemoryStore
from agentloop.store.sqlite import SQLiteStore
from agentloop.types import LLMCall, Rollout, Triplet

DEFAULT_MODEL = "smollm2-135m-instruct"


async def run_rollouts(
    agent: Any,
    tasks: Sequence[Any],
    engine: Any,
    *,
    store: Any = None,
    concurrency: int = 4,
    sampling: dict[str, Any] | None = None,
    model_name: str = "agentloop",
    timeout_s: float = 600.0,
) -> dict[str, Any]:
    """Run each task once through ``agent`` on ``engine`` and return a summary (see ``summarise``)."""
    if not tasks:
        raise ValueError("run_rollouts needs at least one task")
    store = store if store is not None else MemoryStore()
    await engine.start()
    try:
        async with Proxy(engine, store) as proxy:
            await store.add_resources(Resources(items={"llm": proxy.as_resource(model_name, sampling or {})}))
            ids = [(await store.enqueue_rollout(t)).rollout_id for t in tasks]
            with anyio.fail_after(timeout_s):
                await Runner(agent, store, concurrency=concurrency, poll_interval=0.02).run(
                    max_rollouts=len(ids)
                )
    finally:
        await engine.stop()
    rollouts = [await store.get_rollout(rid) for rid in ids]
    spans = {rid: await store.query_spans(rid) for rid in ids}
    result = await triplets_for_rollouts(store, ids)
    return summarise(rollouts, spans, result.triplets, merge_turns(result.triplets))


def summarise(
    rollouts: list[Rollout], spans: dict[str, list[Any]], triplets: list[Triplet], samples: list[Triplet]
) -> dict[str, Any]:
    """Rewards, statuses, triplets and how many response tokens are trained (mask 1) or masked (mask 0)."""
    rewards: list[float] = []
    for r in rollouts:
        final = [s.payload.value for s in spans[r.rollout_id] if s.kind == "reward"]
        rewards.append(sum(final) if final else float("nan"))
    calls = [s.payload for ss in spans.values() for s in ss if isinstance(s.payload, LLMCall)]
    model_tokens = sum(sum(t.response_mask or []) for t in samples)
    masked = sum(len(t.response_ids) - sum(t.response_mask or []) for t in samples)
    scored = [x for x in rewards if x == x]  # NaN: no reward
    return {
        "rollouts": len(rollouts),
        "statuses": {
            s: sum(r.status.value == s for r in rollouts) for s in {r.status.value for r in rollouts}
        },
        "rewards": rewards,
        "mean_reward": statistics.fmean(scored) if scored else None,
        "llm_calls": len(calls),
        "tool_calls": sum(s.kind == "tool_call" for ss in spans.values() for s in ss),
        "triplets": len(triplets),
        "samples": len(samples),
        "model_tokens": model_tokens,
        "masked_tokens": masked,
        "rollout_ids": [r.rollout_id for r in rollouts],
    }


def parser(description: str, rollouts: int = 4) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default=DEFAULT_MODEL, help="model alias, local folder or hub id")
    p.add_argument("--rollouts", type=int, default=rollouts, help="how many rollouts to run")
    p.add_argument("--concurrency", type=int, default=4, help="rollouts in flight at once")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--max-tokens", type=int, default=256, help="per model call")
    p.add_argument("--seed", type=int, default=0, help="dataset seed")
    p.add_argument("--store", default=None, help="SQLite file to keep the rollouts in (default: in memory)")
    p.add_argument(
        "--train", type=int, default=0, metavar="STEPS", help="train STEPS GRPO steps (Trainer.fit)"
    )
    p.add_argument("--run-dir", default="runs/example", help="with --train: checkpoints, metrics, plots")
    return p


def train(args: argparse.Namespace, agent: Any, tasks: Sequence[Any], reward: Any = None) -> dict[str, Any]:
    """``--train STEPS``: GRPO with the embedded trainer on ``tasks`` (batch = min(4, len(tasks)));
    ``reward``: an ``al.judge_reward`` that scores the attempts instead of the agent."""
    from trainer import Trainer

    batch = min(4, len(tasks))
    cfg = {
        "data": {"train_batch_size": batch, "max_response_length": args.max_tokens},
        "actor_rollout_ref": {
            "model": {"path": args.model},
            "rollout": {"n": 4, "temperature": args.temperature, "concurrency": args.concurrency},
            "actor": {"ppo_mini_batch_size": batch},
        },
        "algorithm": {"adv_estimator": "grpo"},
        "trainer": {
            "total_training_steps": args.train,
            "default_local_dir": args.run_dir,
            "device": args.device,
        },
    }
    result = Trainer(cfg).fit(agent, list(tasks), reward=reward)
    summary = {"steps": len(result.history), "run_dir": str(result.run_dir), "history": result.history}
    print(json.dumps(summary, indent=2, default=str))  # the script's output: a JSON summary
    return summary


def run_cli(args: argparse.Namespace, agent: Any, tasks: Sequence[Any]) -> dict[str, Any]:
    """Load the engine, run the rollouts and print the summary as JSON (what the scripts call)."""
    from agentloop.engine.factory import load_engine

    if args.rollouts < 1:
        raise SystemExit(f"--rollouts must be >= 1, got {args.rollouts}")
    if args.train:
        return train(args, agent, tasks)
    engine = load_engine(args.model, device=args.device)
    store = SQLiteStore(args.store) if args.store else None
    sampling = {"temperature": args.temperature, "max_tokens": args.max_tokens}

    async def go() -> dict[str, Any]:
        try:
            return await run_rollouts(
                agent, list(tasks), engine, store=store, concurrency=args.concurrency, sampling=sampling,
                model_name=args.model,
            )  # fmt: skip
        finally:
            if store is not None:
                await store.close()

    summary = anyio.run(go)
    shown = {k: v for k, v in summary.items() if k != "rollout_ids"}
    print(json.dumps(shown, indent=2))  # the script's output: a JSON summary
    return summary
