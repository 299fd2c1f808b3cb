"""``agentloop inspect RUN_DIR``: a table of the run's rollouts and one trajectory in colour.

In the trajectory, the prompt is dim, tokens the model produced (trained, mask 1) are green, and
tokens it did not produce (tool output, later user turns: mask 0) are yellow. For a training rollout
each call's advantage is shown as the trainer computed it (``trainer.sample_advantages`` over the
attempts at the same task in the same step, with the run's config).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import anyio

from agentloop.types import Reward, Rollout, Triplet

DIM, GREEN, YELLOW, BOLD, RESET = "\x1b[2m", "\x1b[32m", "\x1b[33m", "\x1b[1m", "\x1b[0m"


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("inspect", help="show a run's rollouts and one trajectory (model vs masked tokens)")
    p.add_argument("run_dir", type=Path, help="a run folder (holds store.db and config.json)")
    p.add_argument("--limit", type=int, default=20, help="rows in the rollout table")
    p.add_argument("--rollout", default=None, help="the rollout to print (default: the best-rewarded one)")
    p.add_argument("--no-color", action="store_true", help="plain text with [model]...[/model] marks")
    p.set_defaults(func=run)


def _reward(spans: list[Any]) -> float | None:
    values = [s.payload.value for s in spans if isinstance(s.payload, Reward)]
    return sum(values) if values else None


async def collect(run_dir: Path) -> list[tuple[Rollout, float | None, int]]:
    from agentloop.store.sqlite import SQLiteStore

    store = SQLiteStore(run_dir / "store.db")
    try:
        rows = []
        for rollout in await store.list_rollouts():
            spans = await store.query_spans(rollout.rollout_id) if rollout.num_attempts else []
            calls = sum(1 for s in spans if s.kind == "llm_call")
            rows.append((rollout, _reward(spans), calls))
        return rows
    finally:
        await store.close()


async def trajectory(run_dir: Path, rollout_id: str) -> tuple[list[Triplet], Rollout, list[float | None]]:
    """The rollout's calls merged for display, the rollout, and each call's advantage (None when the
    trainer would not train on it, or the rollout is not a training rollout)."""
    from agentloop.adapter import spans_to_triplets, triplets_for_rollouts
    from agentloop.store.sqlite import SQLiteStore
    from agentloop.types import RolloutStatus
    from trainer import TrainerConfig, sample_advantages  # the CLI is where agentloop reaches the trainer
    from trainer.batch import merge_trajectory

    config = _config(run_dir)
    store = SQLiteStore(run_dir / "store.db")
    try:
        rollout = await store.get_rollout(rollout_id)
        spans = await store.query_spans(rollout_id)
        calls = spans_to_triplets(spans, rollout=rollout).triplets
        advantages: list[float | None] = [None] * len(calls)
        if rollout.mode == "train" and rollout.status is RolloutStatus.SUCCEEDED:
            key = (rollout.metadata.get("step"), rollout.metadata.get("data_index"))
            group = [
                r.rollout_id
                for r in await store.list_rollouts()
                if r.mode == "train" and (r.metadata.get("step"), r.metadata.get("data_index")) == key
            ]
            cfg = TrainerConfig.from_dict(config)
            adapted = await triplets_for_rollouts(store, group, cfg.adapter.credit_assignment)
            if not cfg.algorithm.use_kl_in_reward:
                by_call = dict(
                    zip(
                        (
                            (t.metadata.get("attempt_id"), t.metadata.get("call_index"))
                            for t in adapted.triplets
                        ),
                        sample_advantages(adapted.triplets, cfg),
                        strict=True,
                    )
                )
                advantages = [
                    by_call.get((t.metadata.get("attempt_id"), t.metadata.get("call_index"))) for t in calls
                ]
    finally:
        await store.close()
    return merge_trajectory(calls), rollout, advantages


def render(tokenizer: Any, triplet: Triplet, color: bool) -> str:
    """Prompt dim; response tokens green where mask 1 (model) and yellow where mask 0 (not trained)."""
    out = [_paint(tokenizer.decode(triplet.prompt_ids), DIM, "prompt", color)]
    mask = triplet.response_mask or []
    start = 0
    for i in range(1, len(mask) + 1):  # runs of equal mask values
        if i == len(mask) or mask[i] != mask[start]:
            text = tokenizer.decode(triplet.response_ids[start:i])
            out.append(
                _paint(text, GREEN, "model", color) if mask[start] else _paint(text, YELLOW, "masked", color)
            )
            start = i
    return "".join(out)


def _paint(text: str, code: str, tag: str, color: bool) -> str:
    return f"{code}{text}{RESET}" if color else f"[{tag}]{text}[/{tag}]"


def run(args: argparse.Namespace) -> int:
    run_dir: Path = args.run_dir
    if not (run_dir / "store.db").exists():
        sys.stderr.write(
            f"agentloop inspect: {run_dir} has no store.db; give a run folder written by training\n"
        )
        return 2
    rows = anyio.run(collect, run_dir)
    color = not args.no_color and sys.stdout.isatty()
    w = sys.stdout.write
    w(f"{len(rows)} rollouts in {run_dir}\n")
    w(f"{'rollout':<14} {'mode':<5} {'status':<10} {'attempts':>8} {'calls':>5} {'reward':>7}  input\n")
    for rollout, reward, calls in rows[-args.limit :]:
        shown = json.dumps(rollout.input)[:60]
        r = "-" if reward is None else f"{reward:.3f}"
        w(
            f"{rollout.rollout_id[:13]:<14} {rollout.mode:<5} {rollout.status.value:<10} {rollout.num_attempts:>8} {calls:>5} {r:>7}  {shown}\n"
        )
    chosen = args.rollout
    if chosen is None:
        scored = [(reward, r.rollout_id) for r, reward, calls in rows if reward is not None and calls]
        if not scored:
            w("no rollout with LLM calls and a reward to print\n")
            return 0
        chosen = max(scored)[1]
    matches = [r.rollout_id for r, _, _ in rows if r.rollout_id.startswith(chosen)]
    if len(matches) != 1:
        sys.stderr.write(
            f"agentloop inspect: --rollout {chosen!r} matches {len(matches)} rollouts; give more of the id\n"
        )
        return 2
    triplets, rollout, advantages = anyio.run(trajectory, run_dir, matches[0])
    tokenizer = _tokenizer(run_dir)
    w(
        f"\n{BOLD if color else ''}trajectory of {rollout.rollout_id}{RESET if color else ''} "
        f"({len(triplets)} sample(s); green: model tokens, trained; yellow: masked)\n"
    )
    remaining = list(advantages)
    for t in triplets:
        n = int(t.metadata.get("merged_calls", 1))
        mine, remaining = remaining[:n], remaining[n:]
        shown = ", ".join("-" if a is None else f"{a:+.3f}" for a in mine)
        w(render(tokenizer, t, color) + f"\n  -> reward {t.reward}; advantage per call: {shown}\n")
    return 0


def _config(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "config.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _tokenizer(run_dir: Path) -> Any:
    from transformers import AutoTokenizer

    from agentloop.engine.models import resolve_model

    config = _config(run_dir)
    model = config.get("actor_rollout_ref", {}).get("model", {}).get("path", "smollm2-135m-instruct")
    return AutoTokenizer.from_pretrained(str(resolve_model(model)))
