"""Issue 16, serve-mode sessions: recorded in the log beside the store the user names and replayed by
the next server; a TTL, byte caps per session and overall, bounded rewards, over-context calls not
kept, ledgers swept with their sessions; the log rewritten when mostly dead.

Real components: a real Proxy on a loopback port over a SQLiteStore file, the echo engine with the
real SmolLM2 tokenizer, the real log on disk; the table's clock is replaced where time must pass.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import httpx
import orjson
import pytest

from agentloop.proxy.schemas import ProxyError
from agentloop.proxy.server import Proxy
from agentloop.proxy.sessions import SessionLog, SessionTable, read_session_log
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


def _lines(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


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
            with anyio.fail_after(30):
                first = await _session_chat(http, proxy, "app-1", ASK)
                assert first.status_code == 200
                reply = first.json()["choices"][0]["message"]
                await _session_chat(http, proxy, "app-2", ASK)
                r = await http.post(f"{proxy.session_base_url}/sessions/app-1/reward", json={"reward": 1.0})
                assert r.status_code == 200
        # the server stops (agentloop serve ends) and starts again on the same store
        async with Proxy(engine, store) as proxy, httpx.AsyncClient(timeout=20) as http:
            with anyio.fail_after(30):
                listing = (await http.get(f"{proxy.session_base_url}/sessions")).json()
                got = (await http.get(f"{proxy.session_base_url}/sessions/app-1")).json()
                follow = [*ASK, reply, {"role": "user", "content": "And Italy?"}]
                assert (await _session_chat(http, proxy, "app-1", follow)).status_code == 200
                r = await http.post(f"{proxy.session_base_url}/sessions/app-1/reward", json={"reward": 0.5})
                assert r.status_code == 200
            log = proxy.session_log
    finally:
        await store.close()
    assert {s["session_id"]: s["num_calls"] for s in listing["data"]} == {"app-1": 1, "app-2": 1}
    assert [r["value"] for r in got["rewards"]] == [1.0] and got["calls"][0]["prompt_ids"]
    assert log == tmp_path / "agentloop-serve.sessions.jsonl"
    _, sessions = read_session_log(log)  # what `agentloop inspect` reads
    by_id = {s.session_id: s for s in sessions}
    assert len(by_id["app-1"].calls) == 2 and [r.value for r in by_id["app-1"].rewards] == [1.0, 0.5]
    assert len(by_id["app-2"].calls) == 1


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
            log = proxy.session_log
    finally:
        await store.close()
    assert log is not None
    kinds = [(line["type"], line.get("session_id")) for line in _lines(log)]
    assert ("call", "big") not in kinds and ("drop", "small") in kinds
    assert read_session_log(log)[1] == []  # the taken session does not come back


def test_ttl_drops_idle_sessions_now_and_on_replay(tmp_path: Path) -> None:
    clock, dropped = Clock(), list[str]()
    log = SessionLog(tmp_path / "s.sessions.jsonl")
    table = SessionTable(log=log, ttl_s=3600, clock=clock)
    table.on_drop = dropped.append
    table.add_call("old", _call())
    clock.now += 1800
    table.add_call("new", _call())
    clock.now += 1801  # "old" idle for 3601 s, "new" for 1801 s
    assert table.ids() == ["new"] and dropped == ["old"]
    log.close()
    clock.now += 1800  # the server was down; "new" is now idle for 3601 s too
    replayed = SessionTable(log=SessionLog(log.path), ttl_s=3600, clock=clock)
    assert replayed.ids() == []
    clock.now -= 3600
    assert SessionTable(log=SessionLog(log.path), ttl_s=3600, clock=clock).ids() == ["new"]


def test_byte_caps_per_session_and_overall_hold_in_memory_and_on_replay(tmp_path: Path) -> None:
    one = len(orjson.dumps(_call().model_dump(mode="json")))  # the bytes a call is counted for
    log = SessionLog(tmp_path / "s.sessions.jsonl")
    table = SessionTable(log=log, max_session_bytes=3 * one, max_total_bytes=5 * one)
    for i in range(5):
        table.add_call("a", _call(text=f"a{i}"))  # a session keeps its 3 newest calls
    assert [c.messages[0]["content"] for c in table.get("a").calls] == ["a2", "a3", "a4"]  # type: ignore[union-attr]
    for i in range(3):
        table.add_call("b", _call(text=f"b{i}"))  # 6 calls > 5 overall: the least recent session goes
    assert table.ids() == ["b"] and table.nbytes == 3 * one
    assert not table.add_call("b", _call(n_ids=4 * one))  # a call over the session cap is not kept
    log.close()
    replayed = SessionTable(log=SessionLog(log.path), max_session_bytes=3 * one, max_total_bytes=5 * one)
    assert replayed.ids() == ["b"] and replayed.nbytes == 3 * one
    assert [c.messages[0]["content"] for c in replayed.get("b").calls] == ["b0", "b1", "b2"]  # type: ignore[union-attr]


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


def test_the_log_is_rewritten_when_mostly_dead_and_stays_bounded(tmp_path: Path) -> None:
    one = len(orjson.dumps(_call().model_dump(mode="json")))
    log = SessionLog(tmp_path / "s.sessions.jsonl")
    table = SessionTable(log=log, max_sessions=4, max_session_bytes=2 * one, max_total_bytes=8 * one)
    table.COMPACT_MIN_BYTES = 20 * one
    sizes = []
    for i in range(200):  # 200 sessions through a table of 4: the file would grow without end
        table.add_call(f"s{i}", _call(text=str(i)))
        sizes.append(log.size)
    assert max(sizes) < 2 * 8 * one + 20 * one + 4 * one  # bounded (plus a few lines of headroom)
    assert log.size == log.path.stat().st_size
    log.close()
    _, sessions = read_session_log(log.path)
    assert [s.session_id for s in sessions] == ["s196", "s197", "s198", "s199"]
    assert [c.messages[0]["content"] for s in sessions for c in s.calls] == ["196", "197", "198", "199"]
    assert not (tmp_path / "s.sessions.jsonl.tmp").exists()


def test_a_torn_or_unreadable_line_is_skipped_not_the_log(tmp_path: Path) -> None:
    log = SessionLog(tmp_path / "s.sessions.jsonl")
    table = SessionTable(log=log)
    table.add_call("s", _call())
    table.add_reward("s", Reward(value=1.0))
    log.close()
    with log.path.open("ab") as f:  # a reward this version cannot read, then a line cut by a kill
        f.write(b'{"type":"reward","session_id":"s","reward":{"value":"high"}}\n{"type":"call","sess')
    replayed = SessionTable(log=SessionLog(log.path))
    rec = replayed.get("s")
    assert rec is not None and len(rec.calls) == 1 and [r.value for r in rec.rewards] == [1.0]
    replayed.add_call("s", _call())  # the next server's first line does not join the torn one
    replayed.log.close()  # type: ignore[union-attr]
    again = SessionTable(log=SessionLog(log.path)).get("s")
    assert again is not None and len(again.calls) == 2
