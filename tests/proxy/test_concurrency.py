"""200 concurrent agents through one proxy: every call answered and recorded, none lost."""

from __future__ import annotations

import json
import sqlite3
import ssl
from pathlib import Path
from typing import Any

import anyio
import httpx

from agentloop.store.memory import MemoryStore
from agentloop.store.sqlite import SQLiteStore
from agentloop.types import LLMCall
from tests.proxy.conftest import attempt_url, both_loops, new_attempt, running_proxy
from tests.proxy.engines import EchoEngine

anyio_backend = both_loops  # asyncio's loop and uvloop's (tests/proxy/conftest.py)

AGENTS = 200


async def test_200_concurrent_agents_all_finish(tokenizer: Any, oai: Any) -> None:
    engine, store = EchoEngine(tokenizer, delay_s=0.01), MemoryStore()
    for i in range(AGENTS):
        await store.enqueue_rollout({"i": i})
    attempts = [await store.dequeue_rollout(f"w{i}") for i in range(AGENTS)]
    finished: list[str] = []
    tls = ssl.create_default_context()  # one context for all clients (building one per client costs ~20 ms)
    async with running_proxy(engine, store) as proxy:

        async def agent(att: Any) -> None:  # each agent has its own client and connection, as in a real run
            client = oai(attempt_url(proxy, att), http_client=httpx.AsyncClient(verify=tls, timeout=30))
            messages: list[Any] = [{"role": "user", "content": f"task {att.input['i']}"}]
            for turn in range(2):
                r = await client.chat.completions.create(model="m", messages=messages, seed=turn)
                messages += [{"role": "assistant", "content": r.choices[0].message.content},
                             {"role": "user", "content": "next"}]  # fmt: skip
            finished.append(att.rollout_id)

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for att in attempts:
                    tg.start_soon(agent, att)
    assert sorted(finished) == sorted(a.rollout_id for a in attempts if a is not None)
    for att in attempts:
        assert att is not None
        calls: list[LLMCall] = [s.payload for s in await store.query_spans(att.rollout_id)]  # type: ignore[misc]
        assert len(calls) == 2 and calls[0].messages[0]["content"] == f"task {att.input['i']}"
        head = calls[0].prompt_ids + calls[0].response_ids
        assert calls[1].prompt_ids[: len(head)] == head and calls[1].ledger_break is None
    assert len(engine.calls) == 2 * AGENTS


# ---------------------------------------------------------------- durability under a burst (SQLite store)

BURST = 48


async def _burst(proxy: Any, attempts: list[Any]) -> list[httpx.Response]:
    """One chat completion per attempt, all at once, each with the token ids in its answer."""
    answers: dict[int, httpx.Response] = {}
    async with httpx.AsyncClient(timeout=30) as client:

        async def call(i: int, att: Any) -> None:
            answers[i] = await client.post(
                attempt_url(proxy, att) + "/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": f"task {i}"}], "seed": i},
                headers={"X-Return-Token-Ids": "1"},
            )

        async with anyio.create_task_group() as tg:
            for i, att in enumerate(attempts):
                tg.start_soon(call, i, att)
    return [answers[i] for i in range(len(attempts))]


async def test_a_burst_of_calls_is_durable_in_the_store_before_each_answer(
    tokenizer: Any, tmp_path: Path
) -> None:
    """Each answer leaves only once its span is committed: another connection to the file sees it
    the moment the answer arrives (a process killed then would lose nothing it answered). The
    commit is held back a while (another connection holds the write lock as the burst's answers are
    ready), so an answer sent before its commit would be caught."""
    path = tmp_path / "store.db"
    store = SQLiteStore(path)
    attempts = [await new_attempt(store, {"i": i}) for i in range(BURST)]
    reader = sqlite3.connect(path, isolation_level=None)
    locker = sqlite3.connect(path, isolation_level=None)
    engine = Gated(tokenizer, BURST)
    seen: dict[str, list[int]] = {}
    answers: dict[int, httpx.Response] = {}
    try:
        async with running_proxy(engine, store) as proxy, httpx.AsyncClient(timeout=30) as client:

            async def call(i: int, att: Any) -> None:
                r = await client.post(
                    attempt_url(proxy, att) + "/chat/completions",
                    json={"model": "m", "messages": [{"role": "user", "content": f"task {i}"}]},
                    headers={"X-Return-Token-Ids": "1"},
                )
                rows = reader.execute(  # committed rows only: this connection is not the store's
                    "SELECT data FROM spans WHERE attempt_id=?", (att.attempt.attempt_id,)
                ).fetchall()
                assert r.status_code == 200, r.text
                assert len(rows) == 1, f"call {i} was answered before its span was committed"
                seen[att.attempt.attempt_id] = json.loads(rows[0][0])["payload"]["response_ids"]
                answers[i] = r

            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    for i, att in enumerate(attempts):
                        tg.start_soon(call, i, att)
                    await engine.arrived.wait()
                    locker.execute("BEGIN IMMEDIATE")  # the spans' commit waits for this lock
                    engine.go.set()
                    await anyio.sleep(0.5)
                    assert not answers, "answers left while their spans could not be committed"
                    locker.execute("ROLLBACK")
    finally:
        reader.close()
        locker.close()
        await store.close()
    assert len(engine.calls) == BURST
    for i, att in enumerate(attempts):
        assert seen[att.attempt.attempt_id] == answers[i].json()["token_ids"]  # the very ids answered


class Gated(EchoEngine):
    """Holds every generation until ``go``; ``arrived`` is set once ``n`` are waiting (one GPU batch)."""

    def __init__(self, tokenizer: Any, n: int) -> None:
        super().__init__(tokenizer)
        self.n, self.waiting = n, 0
        self.arrived, self.go = anyio.Event(), anyio.Event()

    async def generate(self, prompt_ids: list[int], sampling: Any, request_id: str | None = None) -> Any:
        self.waiting += 1
        if self.waiting == self.n:
            self.arrived.set()
        await self.go.wait()
        return await super().generate(prompt_ids, sampling, request_id)


async def test_a_store_that_fails_under_a_burst_answers_every_waiting_call_with_503(
    tokenizer: Any, tmp_path: Path
) -> None:
    """Another process holds the store's write lock while a burst's spans are written: every call of
    the batch gets a 503 store_error once the store gives up (no hang, no 500), nothing is recorded,
    and the proxy answers normally once the lock is gone."""
    path = tmp_path / "store.db"
    store = SQLiteStore(path, busy_timeout_s=0.5)
    attempts = [await new_attempt(store, {"i": i}) for i in range(BURST + 1)]
    locker = sqlite3.connect(path, isolation_level=None)
    engine = Gated(tokenizer, BURST)
    try:
        async with running_proxy(engine, store) as proxy:
            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    results: list[httpx.Response] = []

                    async def burst() -> None:
                        results.extend(await _burst(proxy, attempts[:BURST]))

                    tg.start_soon(burst)
                    await engine.arrived.wait()
                    locker.execute("BEGIN IMMEDIATE")  # the write lock, held as another process would
                    engine.go.set()
                assert [r.status_code for r in results] == [503] * BURST
                assert {r.json()["error"]["type"] for r in results} == {"store_error"}
                locker.execute("ROLLBACK")
                after = await _burst(proxy, attempts[BURST:])
    finally:
        locker.close()
    assert after[0].status_code == 200, after[0].text
    for att in attempts[:BURST]:
        assert await store.query_spans(att.rollout_id) == []
    assert len(await store.query_spans(attempts[BURST].rollout_id)) == 1
    await store.close()
