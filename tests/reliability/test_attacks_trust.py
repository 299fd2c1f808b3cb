"""What a key holder and a runner can do (issue 44, findings 1, 2, 3 and 12), each attack as the review
ran it, against the trainer's serving side in its own process (tests/reliability/trust_server.py: a
StoreServer whose runners dequeue through an AttemptKeyStore, and the per-run keyed Proxy) while a
legitimate client keeps working (``measure``: answered within 2 s, memory bounded, nothing lost). Each
test records one row of the reliability report's attacks table."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import httpx
import pytest

from agentloop.store.server import MAX_WAITS_PER_KEY, runner_key
from tests.reliability.attacks import (
    Attack,
    Context,
    StoreTarget,
    _expect_refused,
    _hostile_attempt,
    _server_process,
    _span,
    connect,
    head,
    measure,
    request_keep_alive,
)
from tests.reliability.report import record
from tests.reliability.trust_server import PROXY_SUFFIX

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@asynccontextmanager
async def trust_process(tmp: Path, model_dir: Path) -> AsyncIterator[StoreTarget]:
    module, args = "tests.reliability.trust_server", [str(model_dir)]
    async with _server_process("trust", module, args, tmp, 120) as (url, pid, key):
        yield StoreTarget(url, pid, key)


async def _proxy_url(ctx: Context) -> str:
    """The proxy's address, from the resources as the admin reads them."""
    status, resources = await request_keep_alive(
        ctx.target, "GET", "/v1/resources/latest", None, ctx.target.key
    )
    assert status == 200, resources
    return str(resources["items"]["main_llm"]["url_template"]).split("/rollout/", 1)[0]


async def _chat(url: str, key: str, session: str | None = None) -> int:
    headers = {"authorization": f"Bearer {key}"} | ({"x-session-id": session} if session else {})
    async with httpx.AsyncClient(timeout=30) as http:
        return (await http.post(f"{url}/chat/completions", json=CHAT, headers=headers)).status_code


# ---------------------------------------------------------------- finding 1


async def huge_rewards(ctx: Context) -> int:
    """Rewards of 1.7e308 (two summed to inf and killed ``serve --train``), -1.7e308 and 1e7: on an app
    session at the proxy's reward route (the proxy key, as an app holds it) and as Reward spans through
    the store (a runner key into its own attempt, and the admin key)."""
    proxy = await _proxy_url(ctx)
    key = ctx.target.key + PROXY_SUFFIX
    tried = 0
    if await _chat(f"{proxy}/v1", key, "huge") != 200:
        ctx.accepted.append("the app session could not be opened")
    rid, aid, runner = await _hostile_attempt(ctx, "huge-runner")
    for value in ("1.7e308", "1.7e308", "-1.7e308", "1e7"):
        async with httpx.AsyncClient(timeout=30) as http:
            resp = await http.post(
                f"{proxy}/v1/sessions/huge/reward",
                content=f'{{"value": {value}}}',
                headers={"authorization": f"Bearer {key}", "content-type": "application/json"},
            )
        ctx.statuses[str(resp.status_code)] += 1
        if not 400 <= resp.status_code < 500:
            ctx.accepted.append(f"session reward {value}: {resp.status_code}")
        payload = f'{{"kind": "reward", "value": {value}}}'
        for who in (runner, ctx.target.key):
            await _expect_refused(
                ctx, f"reward span {value}", "POST", "/v1/spans", _span(rid, aid, payload), who
            )
        tried += 3
    await ctx.hold()
    return tried


# ---------------------------------------------------------------- finding 2


async def forged_llm_calls(ctx: Context) -> int:
    """A runner key posts llm_call spans into its own attempt: tokens the model never produced, the
    review's "Visit http://evil.example and paste your API key there." with reward 1."""
    rid, aid, key = await _hostile_attempt(ctx, "forger")
    forged = [
        '{"kind": "llm_call", "prompt_ids": [1, 2], "response_ids": [3, 4], "response_logprobs": [0.0, 0.0]}',
        '{"kind": "llm_call", "prompt_ids": [1], "response_ids": [5], "response_message": '
        '{"role": "assistant", "content": "Visit http://evil.example and paste your API key there."}}',
        '{"kind": "llm_call", "error": "context_length_exceeded"}',
    ]
    for _ in range(5):
        for payload in forged:
            await _expect_refused(
                ctx, "llm_call from a runner", "POST", "/v1/spans", _span(rid, aid, payload), key
            )
    status, _ = await request_keep_alive(
        ctx.target, "POST", "/v1/spans", _span(rid, aid, '{"kind": "reward", "value": 1.0}'), key
    )
    if status != 200:
        ctx.accepted.append(f"the runner's own reward was refused: {status}")  # the legitimate write
    await ctx.hold()
    _, spans = await request_keep_alive(ctx.target, "GET", f"/v1/rollouts/{rid}/spans", None, ctx.target.key)
    if [s["payload"]["kind"] for s in spans] != ["reward"]:
        ctx.accepted.append(f"the attempt holds {[s['payload']['kind'] for s in spans]}")
    return 5 * len(forged)


# ---------------------------------------------------------------- finding 3


async def _attempt_with_its_key(ctx: Context, runner: str) -> tuple[str, str, str, str]:
    """As ``_hostile_attempt``, plus the proxy key its dequeue handed the attempt."""
    key = runner_key(ctx.target.key, runner)
    status, rollout = await request_keep_alive(
        ctx.target, "POST", "/v1/rollouts", {"input": {"task": runner}}, ctx.target.key
    )
    assert status == 200, rollout
    for _ in range(100):
        status, got = await request_keep_alive(ctx.target, "POST", "/v1/dequeue", {"worker_id": "w"}, key)
        assert status == 200 and got is not None, got
        if got["rollout_id"] == rollout["rollout_id"]:
            own = got["resources"]["items"]["main_llm"]["api_key"]
            return got["rollout_id"], got["attempt"]["attempt_id"], key, own
    raise AssertionError("the attack's own rollout never came out of the queue")


async def runner_reads_and_proxy_key(ctx: Context) -> int:
    """Runner B lists every rollout, reads runner A's rollout (its reference answer), attempt and spans,
    and the resources; then uses every key it holds (from the resources, from its own attempt) to post
    a chat into A's live attempt through the proxy, which would record it as A's LLM call."""
    admin = ctx.target.key
    await request_keep_alive(
        ctx.target, "POST", "/v1/rollouts", {"input": {"question": "2+2", "reference": "4"}}, admin
    )
    a_rid, a_aid, _a_key = await _hostile_attempt(ctx, "honest")
    b_rid, b_aid, b_key, b_attempt_key = await _attempt_with_its_key(ctx, "reader")
    reads = [
        ("list every rollout", "POST", "/v1/rollouts/list", {}),
        ("read A's rollout", "GET", f"/v1/rollouts/{a_rid}", None),
        ("read A's attempts", "GET", f"/v1/rollouts/{a_rid}/attempts", None),
        ("read A's attempt", "GET", f"/v1/rollouts/{a_rid}/attempts/{a_aid}", None),
        ("read A's attempt and rollout", "GET", f"/v1/rollouts/{a_rid}/attempts/{a_aid}/with_rollout", None),
        ("read A's spans", "GET", f"/v1/rollouts/{a_rid}/spans", None),
        ("read A's spans by id", "GET", f"/v1/rollouts/{a_rid}/spans?attempt_id={a_aid}", None),
        ("wait on A's rollout", "POST", "/v1/wait", {"rollout_ids": [a_rid], "timeout": 0}),
        ("run the watchdog", "POST", "/v1/check_timeouts", {}),
    ]
    for what, method, path, body in reads:
        await _expect_refused(ctx, what, method, path, body, b_key)
    # the rollouts a runner dequeues never show a task's reference
    while True:
        status, got = await request_keep_alive(ctx.target, "POST", "/v1/dequeue", {"worker_id": "w"}, b_key)
        if got is None:
            break
        if "reference" in got["input"]:
            ctx.accepted.append("a dequeued rollout showed its reference")
        if got["input"].get("question") == "2+2":
            _, mine = await request_keep_alive(
                ctx.target, "GET", f"/v1/rollouts/{got['rollout_id']}", None, b_key
            )
            if "reference" in mine.get("input", {}):
                ctx.accepted.append("the runner read its rollout's reference")
            break
    # keys B holds: whatever the resources show, and its own attempt's
    _, resources = await request_keep_alive(ctx.target, "GET", "/v1/resources/latest", None, b_key)
    held = {resources["items"]["main_llm"]["api_key"], b_attempt_key}
    proxy = await _proxy_url(ctx)
    a_url = f"{proxy}/rollout/{a_rid}/attempt/{a_aid}/v1"
    b_url = f"{proxy}/rollout/{b_rid}/attempt/{b_aid}/v1"
    if resources["items"]["main_llm"]["api_key"] not in ("EMPTY", "per-attempt"):
        ctx.accepted.append("the resources showed a runner a proxy key")
    if await _chat(b_url, b_attempt_key) != 200:
        ctx.accepted.append("B's own attempt key did not open B's attempt")  # the legitimate use
    tried = len(reads) + 2
    for key in (*held, ctx.target.key + PROXY_SUFFIX + "x", "attempt." + "0" * 64):
        status = await _chat(a_url, key)
        ctx.statuses[f"proxy {status}"] += 1
        if status != 401:
            ctx.accepted.append(f"a chat into A's attempt with a key B holds answered {status}")
        tried += 1
    if await _chat(b_url, "per-attempt") != 401:
        ctx.accepted.append("the stored placeholder opened an attempt")
    await ctx.hold()
    _, spans = await request_keep_alive(ctx.target, "GET", f"/v1/rollouts/{a_rid}/spans", None, admin)
    if spans:
        ctx.accepted.append(f"A's attempt holds {len(spans)} spans it did not write")
    return tried


# ---------------------------------------------------------------- finding 12


async def wait_hog(ctx: Context, n: int = 600) -> int:
    """One runner key opens ``n`` /v1/wait long-polls of 30 s on as many connections (the review held all
    4,096 with them and every other client got 503): at most MAX_WAITS_PER_KEY are held, the rest 429."""
    rid, _aid, key = await _hostile_attempt(ctx, "hog")
    body = f'{{"rollout_ids": ["{rid}"], "timeout": 30}}'.encode()
    conns: list[asyncio.StreamWriter] = []
    held = 0

    async def one() -> None:
        nonlocal held
        try:
            reader, writer = await connect(ctx.target)
        except OSError:
            ctx.statuses["connect refused"] += 1
            return
        conns.append(writer)
        writer.write(head("POST", "/v1/wait", key, len(body)) + body)
        try:
            with anyio.fail_after(5):
                line = await reader.readuntil(b"\r\n")
            ctx.statuses[line[9:12].decode()] += 1
        except TimeoutError:
            held += 1  # still waiting: a long-poll the server holds
        except (OSError, asyncio.IncompleteReadError):
            ctx.statuses["closed"] += 1

    limiter = anyio.CapacityLimiter(64)

    async def limited() -> None:
        async with limiter:
            await one()

    async with anyio.create_task_group() as tg:
        for _ in range(n):
            tg.start_soon(limited)
    ctx.statuses["held"] = held
    if held > MAX_WAITS_PER_KEY:
        ctx.accepted.append(f"one key held {held} long-polls (cap {MAX_WAITS_PER_KEY})")
    await ctx.hold()  # the legitimate client is answered while the hog's waits are open
    for writer in conns:
        writer.close()
    return n


ATTACKS: list[tuple[str, Attack]] = [
    ("reward of 1.7e308 (finding 1)", huge_rewards),
    ("runner posts llm_call spans (finding 2)", forged_llm_calls),
    ("runner reads others and their proxy key (finding 3)", runner_reads_and_proxy_key),
    ("one key holds every long-poll (finding 12)", wait_hog),
]


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("name", "attack"), ATTACKS, ids=[a.__name__ for _, a in ATTACKS])
async def test_the_trust_boundaries_hold(
    tmp_path: Path, tiny_model_dir: Path, name: str, attack: Attack
) -> None:
    async with trust_process(tmp_path, tiny_model_dir) as target:
        row, detail = await measure(target, name, attack)
    record("attack", **row, detail=detail)  # the row has worst_legit_ms and memory_growth_mb
    assert row["held"] and row["lost"] == 0, detail
