"""Issue 16, serve-mode sessions: recorded in the store the user names (its session tables) and read
back by the next server; a TTL, byte caps per session and overall, bounded rewards, over-context calls
not kept, ledgers swept with their sessions; the store holds only what the table holds.

Real components: a real Proxy on a loopback port over a SQLiteStore file, the echo engine with the
real SmolLM2 tokenizer, the real store on disk; the table's clock is replaced where time must pass.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import orjson
import pytest

from agentloop.proxy.schemas import ProxyError
from agentloop.proxy.server import Proxy
from agentloop.proxy.sessions import SessionTable, read_saved_sessions
from agentloop.store.sessions import SessionJournal
from agentloop.store.sqlite import SQLiteStore
from agentloop.types import LLMCall, Reward
from tests.proxy.engines import EchoEngine

ASK = [{"role": "user", "content": "Capital of France?"}]


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def _call(n_ids: int = 10, text: str = "hi") -> LLMCall:
    return LLMCall(
        prompt_ids=list(range(n_ids)), response_ids=[1, 2], response_logprobs=[-0.5, -0.5],
        messages=[{"role": "user", "content": text}],
    )  # fmt: skip


@contextmanager
def _journal(path: Path) -> Iterator[SessionJournal]:
    """A journal on a SQLiteStore at ``path``, the store closed (its queue drained) after."""
    store = SQLiteStore(path)
    try:
        yield SessionJournal(store)
    finally:
        anyio.run(store.close)


def _rows(path: Path, table: str) -> int:
    with sqlite3.connect(path) as conn:
        return int(conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0])


async def _session_chat(
    http: httpx.AsyncClient, proxy: Proxy, sid: str, messages: list[Any]
) -> httpx.Response:
    return await http.post(
        f"{proxy.session_base_url}/chat/completions",
        json={"messages": messages},
        headers={"X-Session-Id": sid},
    )


async def test_sessions_survive_a_restart_of_the_server(tokenizer: Any, tmp_path: Path) -> None:
    store_path = tmp_path / "agentloop-serve.db"  # what `agentloop serve --store` names
    engine = EchoEngine(tokenizer, reply=lambda ids, sampling: "Paris.")
    store = SQLiteStore(store_path)
    try:
        async with Proxy(engine, store) as proxy, httpx.AsyncClient(timeout=20) as http:
            assert proxy.session_store == store_path
            with anyio.fail_after(30):
                first = await _session_chat(http, proxy, "app-1", ASK)
                assert first.status_code == 200
                reply = first.json()["choices"][0]["message"]
                await _session_chat(http, proxy, "app-2", ASK)
                r = await http.post(f"{proxy.session_base_url}/sessions/app-1/reward", json={"reward": 1.0})
                assert r.status_code == 200
    finally:
        await store.close()
    store = SQLiteStore(store_path)  # agentloop serve ends and starts again on the same store
    try:
        async with Proxy(engine, store) as proxy, httpx.AsyncClient(timeout=20) as http:
            with anyio.fail_after(30):
                listing = (await http.get(f"{proxy.session_base_url}/sessions")).json()
                got = (await http.get(f"{proxy.session_base_url}/sessions/app-1")).json()
                follow = [*ASK, reply, {"role": "user", "content": "And Italy?"}]
                assert (await _session_chat(http, proxy, "app-1", follow)).status_code == 200
                r = await http.post(f"{proxy.session_base_url}/sessions/app-1/reward", json={"reward": 0.5})
                assert r.status_code == 200
    finally:
        await store.close()
    assert {s["session_id"]: s["num_calls"] for s in listing["data"]} == {"app-1": 1, "app-2": 1}
    assert [r["value"] for r in got["rewards"]] == [1.0] and got["calls"][0]["prompt_ids"]
    assert not list(tmp_path.glob("*.jsonl"))  # nothing beside the store: the sessions are in it
    server, sessions = read_saved_sessions(store_path)  # what `agentloop inspect` reads
    assert server["model"] == proxy.model_name
    by_id = {s.session_id: s for s in sessions}
    assert len(by_id["app-1"].calls) == 2 and [r.value for r in by_id["app-1"].rewards] == [1.0, 0.5]
    assert len(by_id["app-2"].calls) == 1
    one, two = by_id["app-1"].calls  # the exact token ids, as the engine produced them
    assert two.prompt_ids[: len(one.prompt_ids) + len(one.response_ids)] == one.prompt_ids + one.response_ids


async def test_over_context_session_calls_are_not_kept_and_dropped_sessions_take_their_ledger(
    tokenizer: Any, tmp_path: Path
) -> None:
    engine = EchoEngine(tokenizer, max_context=96)
    store = SQLiteStore(tmp_path / "serve.db")
    try:
        async with Proxy(engine, store) as proxy, httpx.AsyncClient(timeout=20) as http:
            with anyio.fail_after(30):
                long = [{"role": "user", "content": "word " * 2000}]
                over = await _session_chat(http, proxy, "big", long)
                ok = await _session_chat(http, proxy, "small", ASK)
            assert over.status_code == 400 and over.json()["error"]["code"] == "context_length_exceeded"
            assert ok.status_code == 200
            assert proxy.sessions.get("big") is None and "session/big" not in proxy.ledger.keys()
            assert "session/small" in proxy.ledger.keys()
            taken = proxy.sessions.pop("small")  # a trainer takes the session
            assert taken is not None and len(taken.calls) == 1
            assert "session/small" not in proxy.ledger.keys()  # its ledger went with it
    finally:
        await store.close()
    assert _rows(tmp_path / "serve.db", "session_calls") == 0  # "big" never stored, "small" taken
    assert read_saved_sessions(tmp_path / "serve.db")[1] == []  # the taken session does not come back


def test_a_session_taken_for_training_stays_in_the_store_marked_and_never_comes_back(tmp_path: Path) -> None:
    """Issue 46: sessions ``serve --train`` trained on stay in the store for audit, marked with the run,
    the update and its outcome, under an archive id; a restarted table does not train on them again, and
    an app that reuses the id starts a fresh session."""
    clock, dropped, path = Clock(), list[str](), tmp_path / "s.db"
    with _journal(path) as journal:
        table = SessionTable(journal=journal, clock=clock)
        table.on_drop = dropped.append
        table.add_call("s1", _call(text="first"), owner="fp1")
        table.add_call("s1", _call(text="second"), owner="fp1")
        table.add_reward("s1", Reward(value=1.0), owner="fp1")
        table.add_call("s2", _call(text="other"))
        table.add_reward("s2", Reward(value=0.0))
        taken = table.take_for_training("s1", update=3, run="/runs/online/a")
        assert taken is not None and len(taken.calls) == 2 and "s1" not in table
        assert table.take_for_training("s2", update=3, run="/runs/online/a") is not None
        assert table.take_for_training("gone", update=3, run="/runs/online/a") is None
        assert dropped == []  # used, not lost
        journal.update_outcome(3, "/runs/online/a", "promoted", version=2)
        journal.update_outcome(3, "/runs/online/other", "rejected")  # another run's update 3: not these
        table.add_call("s1", _call(text="a new conversation"))  # the app reuses the id
        journal.flush_sync()
    _, saved = read_saved_sessions(path)
    by_id = {s.session_id.partition("#")[0]: s for s in saved if s.trained is not None}
    assert sorted(by_id) == ["s1", "s2"] and all(
        s.session_id.startswith(("s1#u3-", "s2#u3-")) for s in saved if s.trained
    )
    old = by_id["s1"]
    assert [c.messages[-1]["content"] for c in old.calls] == ["first", "second"]
    assert old.total_reward == 1.0 and old.owner == "fp1"
    assert old.trained is not None and (old.trained.update, old.trained.run) == (3, "/runs/online/a")
    assert (old.trained.outcome, old.trained.version, old.trained.at) == ("promoted", 2, clock.now)
    [fresh] = [s for s in saved if s.trained is None]
    assert fresh.session_id == "s1" and [c.messages[-1]["content"] for c in fresh.calls] == [
        "a new conversation"
    ]
    with _journal(path) as journal:  # a restart: only the untrained session is live
        assert SessionTable(journal=journal, clock=clock).ids() == ["s1"]


def test_ttl_drops_idle_sessions_now_and_on_restart(tmp_path: Path) -> None:
    clock, dropped, path = Clock(), list[str](), tmp_path / "s.db"
    with _journal(path) as journal:
        table = SessionTable(journal=journal, ttl_s=3600, clock=clock)
        table.on_drop = dropped.append
        table.add_call("old", _call())
        clock.now += 1800
        table.add_call("new", _call())
        clock.now += 1801  # "old" idle for 3601 s, "new" for 1801 s
        assert table.ids() == ["new"] and dropped == ["old"]
    assert [s.session_id for s in read_saved_sessions(path)[1]] == ["new"]  # the store dropped it too
    with _journal(path) as journal:
        assert SessionTable(journal=journal, ttl_s=3600, clock=clock).ids() == ["new"]
    clock.now += 1800  # the server was down; "new" is now idle for 3601 s too
    with _journal(path) as journal:
        assert SessionTable(journal=journal, ttl_s=3600, clock=clock).ids() == []
    assert _rows(path, "sessions") == 0 and _rows(path, "session_calls") == 0


def test_byte_caps_per_session_and_overall_hold_in_memory_and_in_the_store(tmp_path: Path) -> None:
    one = len(orjson.dumps(_call().model_dump(mode="json")))  # the bytes a call is counted for
    path = tmp_path / "s.db"
    with _journal(path) as journal:
        table = SessionTable(journal=journal, max_session_bytes=3 * one, max_total_bytes=5 * one)
        for i in range(5):
            table.add_call("a", _call(text=f"a{i}"))  # a session keeps its 3 newest calls
        assert [c.messages[0]["content"] for c in table.get("a").calls] == ["a2", "a3", "a4"]  # type: ignore[union-attr]
        journal.flush_sync()
        assert _rows(path, "session_calls") == 3
        for i in range(3):
            table.add_call("b", _call(text=f"b{i}"))  # 6 calls > 5 overall: the least recent session goes
        assert table.ids() == ["b"] and table.nbytes == 3 * one
        assert not table.add_call("b", _call(n_ids=4 * one))  # a call over the session cap is not kept
    assert _rows(path, "session_calls") == 3 and _rows(path, "sessions") == 1
    with _journal(path) as journal:
        restarted = SessionTable(journal=journal, max_session_bytes=3 * one, max_total_bytes=5 * one)
        assert restarted.ids() == ["b"] and restarted.nbytes == 3 * one
        assert [c.messages[0]["content"] for c in restarted.get("b").calls] == ["b0", "b1", "b2"]  # type: ignore[union-attr]
    with _journal(path) as journal:  # a server restarted with smaller caps trims the store to them
        smaller = SessionTable(journal=journal, max_session_bytes=2 * one, max_total_bytes=5 * one)
        assert [c.messages[0]["content"] for c in smaller.get("b").calls] == ["b1", "b2"]  # type: ignore[union-attr]
    assert _rows(path, "session_calls") == 2


def test_rewards_per_session_are_bounded(tmp_path: Path) -> None:
    table = SessionTable(max_rewards_per_session=2)
    table.add_call("s", _call())
    table.add_reward("s", Reward(value=1.0))
    table.add_reward("s", Reward(value=0.0))
    with pytest.raises(ProxyError) as exc:
        table.add_reward("s", Reward(value=1.0))
    assert exc.value.status == 409 and exc.value.code == "too_many_rewards"
    assert [r.value for r in table.get("s").rewards] == [1.0, 0.0]  # type: ignore[union-attr]
    with pytest.raises(KeyError):
        table.add_reward("never-seen", Reward(value=1.0))


def test_the_store_stays_bounded_as_sessions_come_and_go(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    with _journal(path) as journal:
        table = SessionTable(journal=journal, max_sessions=4)
        for i in range(200):  # 200 sessions through a table of 4: the rows would grow without end
            table.add_call(f"s{i}", _call(text=str(i)))
            table.add_reward(f"s{i}", Reward(value=i / 200))
    _, sessions = read_saved_sessions(path)
    assert [s.session_id for s in sessions] == ["s196", "s197", "s198", "s199"]
    assert [c.messages[0]["content"] for s in sessions for c in s.calls] == ["196", "197", "198", "199"]
    assert [r.value for r in sessions[-1].rewards] == [199 / 200]
    assert _rows(path, "session_calls") == 4


def test_an_unreadable_reward_is_skipped_not_the_session(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    with _journal(path) as journal:
        table = SessionTable(journal=journal)
        table.add_call("s", _call())
        table.add_reward("s", Reward(value=1.0))
    with sqlite3.connect(path) as conn:  # a reward this version cannot read (a later version's, say)
        conn.execute("""UPDATE sessions SET rewards='[{"value": 1.0}, {"value": "high"}]'""")
    with _journal(path) as journal:
        rec = SessionTable(journal=journal).get("s")
    assert rec is not None and len(rec.calls) == 1 and [r.value for r in rec.rewards] == [1.0]


async def test_a_store_failure_is_answered_503_not_a_lost_answer(tokenizer: Any, tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "serve.db")
    try:
        async with Proxy(EchoEngine(tokenizer), store) as proxy, httpx.AsyncClient(timeout=20) as http:
            with sqlite3.connect(tmp_path / "serve.db") as conn:  # the session tables become unwritable
                conn.execute("CREATE TRIGGER no_calls BEFORE INSERT ON session_calls BEGIN "
                             "SELECT RAISE(ABORT, 'disk says no'); END")  # fmt: skip
            with anyio.fail_after(30):
                r = await _session_chat(http, proxy, "app-1", ASK)
            assert r.status_code == 503 and r.json()["error"]["type"] == "store_error", r.text
            assert "session call" in r.json()["error"]["message"]
    finally:
        await store.close()


def test_a_reward_belongs_to_the_calls_before_it_also_after_a_restart(tmp_path: Path) -> None:
    from agentloop.adapter import spans_to_triplets

    path = tmp_path / "s.db"
    with _journal(path) as journal:
        table = SessionTable(journal=journal)
        table.add_call("s", _call(text="first"))
        table.add_reward("s", Reward(value=0.5))  # for the first answer
        table.add_call("s", _call(text="second"))
        table.add_reward("s", Reward(value=1.0))  # for the second
        live = table.get("s")
    with _journal(path) as journal:
        restarted = SessionTable(journal=journal).get("s")
    for rec in (live, restarted):
        assert rec is not None
        kinds = [type(span.payload).__name__ for span in rec.spans()]
        assert kinds == ["LLMCall", "Reward", "LLMCall", "Reward"]
        triplets = spans_to_triplets(rec.spans(), strategy="per_call").triplets
        assert [t.metadata["call_reward"] for t in triplets] == [0.5, 1.0]
