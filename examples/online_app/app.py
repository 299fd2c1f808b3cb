"""An app that plays users against ``agentloop serve --train`` and posts delayed rewards.

Each user asks an arithmetic question (``What is a + b? ...``, after one worked example) with the plain
``openai`` client and its own ``X-Session-Id``, waits ``--delay-s`` (feedback comes later in real apps),
then posts the checker's reward to ``/v1/sessions/{id}/reward``. The questions come from the training
side of a fixed split; the held-out side is the promotion gate's evaluation (``--write-eval`` writes
it as ``eval.jsonl`` for ``online.yaml``), so the gate never scores a question the app trained on.

    python -m examples.online_app.app --write-eval examples/online_app/eval.jsonl
    export AGENTLOOP_ADMIN_KEY=$(openssl rand -hex 16)   # both shells: the app reads the promotions with it
    agentloop serve --train examples/online_app/online.yaml --run-dir runs/online     # another shell
    python -m examples.online_app.app --url http://127.0.0.1:8000 --minutes 15 --out online.json

``--wrong-sign`` posts the negated reward: a deliberately bad signal the gate must refuse to serve.
The JSON it writes: the app's reward per minute, before/after (first and last ``--window-min``),
requests served, p50/p99 latency, and the server's promotions and rollbacks (read from the admin
routes, so with the server's admin key: ``--admin-key`` or ``$AGENTLOOP_ADMIN_KEY``; without it they
are left out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import openai

from examples.online_app.reward import app_reward
from trainer.demos.arithmetic import EXAMPLE, make_datasets


def write_eval(path: Path, size: int, seed: int) -> int:
    """The held-out questions as the gate's JSONL (``prompt`` and ``answer``... via ``messages``)."""
    _, held_out = make_datasets(20, size, seed)
    with path.open("w", encoding="utf-8") as f:
        for task in held_out:
            messages = [*EXAMPLE, {"role": "user", "content": task["question"]}]
            f.write(json.dumps({"messages": messages, "answer": task["answer"]}) + "\n")
    return len(held_out)


class Stats:
    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.rewards: list[tuple[float, float]] = []  # (minutes since start, the checker's reward)
        self.latencies: list[float] = []
        self.errors = 0


async def user(
    i: int, args: argparse.Namespace, tasks: list[dict[str, Any]], stats: Stats, stop: float
) -> None:
    rng = random.Random(args.seed * 1000 + i)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with (
        openai.AsyncOpenAI(base_url=f"{args.url}/v1", api_key=args.api_key or "EMPTY", max_retries=0,
                           timeout=args.timeout_s) as client,
        httpx.AsyncClient(timeout=args.timeout_s, headers=headers) as http,
    ):  # fmt: skip
        while time.monotonic() < stop:
            task = rng.choice(tasks)
            session = f"user{i}-{uuid.uuid4().hex[:12]}"
            t = time.monotonic()
            try:
                reply = await client.chat.completions.create(
                    model=args.model,
                    messages=[*EXAMPLE, {"role": "user", "content": task["question"]}],
                    max_tokens=args.max_tokens,
                    temperature=args.temperature,
                    extra_headers={"X-Session-Id": session},
                )
            except openai.OpenAIError:
                stats.errors += 1
                await asyncio.sleep(1.0)
                continue
            stats.latencies.append(time.monotonic() - t)
            text = reply.choices[0].message.content or ""
            reward = app_reward(task, text)
            stats.rewards.append(((time.monotonic() - stats.t0) / 60, 1.0 if reward == 1.0 else 0.0))
            await asyncio.sleep(args.delay_s)  # the feedback arrives later
            value = -reward if args.wrong_sign else reward
            try:
                answer = await http.post(f"{args.url}/v1/sessions/{session}/reward", json={"value": value})
                stats.errors += answer.status_code != 200  # a refused reward is lost feedback
            except httpx.HTTPError:
                stats.errors += 1


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


async def main(args: argparse.Namespace) -> dict[str, Any]:
    train, _ = make_datasets(20, args.eval_size, args.seed)
    stats = Stats()
    stop = stats.t0 + args.minutes * 60
    await asyncio.gather(*(user(i, args, train, stats, stop) for i in range(args.users)))
    minutes = (time.monotonic() - stats.t0) / 60
    per_minute = [_mean([r for m, r in stats.rewards if k <= m < k + 1]) for k in range(int(minutes) + 1)]
    before = _mean([r for m, r in stats.rewards if m < args.window_min])
    after = _mean([r for m, r in stats.rewards if m >= minutes - args.window_min])
    lat = sorted(stats.latencies)
    versions = await read_versions(args)
    history = versions.get("history", [])
    return {
        "reward_before": before,
        "reward_after": after,
        "minutes": round(minutes, 2),
        "requests_served": len(stats.latencies),
        "request_errors": stats.errors,
        "latency_p50_s": round(statistics.median(lat), 3) if lat else None,
        "latency_p99_s": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3) if lat else None,
        "reward_per_minute": per_minute,
        "promotions": sum(h["kind"] == "promoted" for h in history),
        "refusals": sum(h["kind"] == "refused" for h in history),
        "rollbacks": sum(h["kind"] == "rollback" for h in history),
        "updates": versions.get("updates"),
        "versions": versions.get("versions"),
        "history": history,
        "wrong_sign": args.wrong_sign,
    }


def admin_headers(args: argparse.Namespace) -> dict[str, str]:
    """The admin key's header (``--admin-key``, else ``$AGENTLOOP_ADMIN_KEY``); none without one."""
    from agentloop.keys import key_value, read_key

    key = key_value(read_key(args.admin_key or os.environ.get("AGENTLOOP_ADMIN_KEY"), "--admin-key"))
    return {"Authorization": f"Bearer {key}"} if key else {}


async def read_versions(args: argparse.Namespace) -> dict[str, Any]:
    """The server's promotions (``GET /v1/admin/versions``); ``{}`` when its admin routes refuse us."""
    async with httpx.AsyncClient(timeout=30, headers=admin_headers(args)) as http:
        r = await http.get(f"{args.url}/v1/admin/versions")
    return r.json() if r.status_code == 200 else {}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (agentloop serve --train)")
    p.add_argument("--api-key", default=None, help="the server's app key, if it has one")
    p.add_argument(
        "--admin-key",
        default=None,
        help="the server's admin key as env:NAME or file:PATH (or $AGENTLOOP_ADMIN_KEY)",
    )
    p.add_argument("--model", default="smollm2-135m-instruct", help="the model name the server serves")
    p.add_argument("--minutes", type=float, default=15.0, help="how long the users ask")
    p.add_argument("--users", type=int, default=8, help="users asking at once")
    p.add_argument("--delay-s", type=float, default=2.0, help="seconds before a reward is posted")
    p.add_argument("--temperature", type=float, default=0.8, help="the app's sampling temperature")
    p.add_argument("--max-tokens", type=int, default=24, help="max tokens per reply")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per request")
    p.add_argument("--window-min", type=float, default=3.0, help="minutes averaged for before / after")
    p.add_argument("--eval-size", type=int, default=60, help="held-out questions (the gate's)")
    p.add_argument("--seed", type=int, default=0, help="the question split and the users' choices")
    p.add_argument("--wrong-sign", action="store_true", help="post negated rewards (a bad update)")
    p.add_argument("--write-eval", type=Path, default=None, help="write the held-out JSONL and exit")
    p.add_argument("--out", type=Path, default=None, help="write the summary JSON here")
    return p


if __name__ == "__main__":
    args = build_parser().parse_args()
    if args.write_eval is not None:
        print(f"wrote {write_eval(args.write_eval, args.eval_size, args.seed)} tasks to {args.write_eval}")
    else:
        summary = asyncio.run(main(args))
        text = json.dumps(summary, indent=2)
        if args.out is not None:
            args.out.write_text(text + "\n")
        print(text)
