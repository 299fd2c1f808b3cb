"""Proxy(workers=N): rollouts' calls served by worker processes, tokens exactly the engine's."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from agentloop.engine.base import SamplingParams
from agentloop.engine.torch.engine import TorchEngine
from agentloop.proxy.server import Proxy
from agentloop.proxy.workers import ProxyWorkers
from agentloop.store.memory import MemoryStore
from agentloop.store.sqlite import SQLiteStore
from agentloop.types import LLMCall
from tests.proxy.conftest import attempt_url, new_attempt
from tests.proxy.test_torch_engine import ENGINE_LOGPROB_ATOL

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]  # worker processes, one of them killed


@pytest.fixture
async def engine(tiny_model_dir: Path) -> AsyncIterator[TorchEngine]:
    eng = TorchEngine(tiny_model_dir, max_context=1024, max_batch_size=8)
    await eng.start()
    try:
        yield eng
    finally:
        await eng.stop()


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SQLiteStore]:
    s = SQLiteStore(tmp_path / "store.db")
    try:
        yield s
    finally:
        await s.close()


@pytest.fixture
async def proxy(engine: TorchEngine, store: SQLiteStore) -> AsyncIterator[Proxy]:
    p = Proxy(engine, store, workers=2)
    await p.start()
    try:
        yield p
    finally:
        await p.stop()


async def test_each_rollout_talks_to_one_worker_and_gets_the_engines_exact_tokens(
    proxy: Proxy, engine: TorchEngine, store: SQLiteStore, oai: Any
) -> None:
    resource = proxy.as_resource()
    assert len(set(proxy.worker_ports)) == 2 and proxy.port not in proxy.worker_ports
    assert resource.worker_url_templates == proxy.worker_url_templates
    attempts = [await new_attempt(store, {"q": i}) for i in range(6)]
    ports = Counter(int(attempt_url(proxy, a).split(":")[2].split("/")[0]) for a in attempts)
    assert set(ports) <= set(proxy.worker_ports)

    async def agent(i: int) -> None:
        client = oai(attempt_url(proxy, attempts[i]))
        messages: list[Any] = [{"role": "user", "content": f"Tell me about {i}."}]
        for turn in range(2):
            r = await client.chat.completions.create(
                model="tiny", messages=messages, seed=10 * i + turn, temperature=1.0, max_tokens=8
            )
            messages += [
                r.choices[0].message.model_dump(exclude_none=True),
                {"role": "user", "content": "More."},
            ]

    with anyio.fail_after(120):
        await asyncio.gather(*(agent(i) for i in range(6)))
    engine_requests = engine.stats()["requests"]
    assert engine_requests == 12  # every call reached the one engine in this process
    for a in attempts:
        calls: list[LLMCall] = [s.payload for s in await store.query_spans(a.rollout_id)]  # type: ignore[misc]
        assert len(calls) == 2
        for call in calls:  # recorded by a worker process: the ids the engine produced, not re-tokenized
            direct = await engine.generate(call.prompt_ids, SamplingParams(**call.sampling))
            assert call.response_ids == direct.token_ids
            assert call.response_logprobs == pytest.approx(direct.logprobs, abs=ENGINE_LOGPROB_ATOL)
            assert call.ledger_break is None
        head = calls[0].prompt_ids + calls[0].response_ids  # turn 2 extends turn 1's exact ids
        assert calls[1].prompt_ids[: len(head)] == head


async def test_a_worker_answers_bad_requests_with_4xx(proxy: Proxy, store: SQLiteStore) -> None:
    att = await new_attempt(store)
    url = attempt_url(proxy, att)
    async with httpx.AsyncClient(timeout=30) as client:
        bad_json = await client.post(f"{url}/chat/completions", content=b"{not json")
        no_messages = await client.post(f"{url}/chat/completions", json={"model": "tiny"})
        too_long = await client.post(
            f"{url}/chat/completions",
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "word " * 3000}],
                "max_tokens": 4,
            },
        )
    assert bad_json.status_code == 400 and no_messages.status_code in (400, 422)
    assert too_long.status_code == 400 and "context" in too_long.text.lower()


async def test_a_killed_worker_comes_back_on_its_port(proxy: Proxy, store: SQLiteStore, oai: Any) -> None:
    workers = proxy._workers
    assert isinstance(workers, ProxyWorkers)
    pid = workers._procs[0].pid
    assert pid is not None
    ports = list(proxy.worker_ports)
    os.kill(pid, signal.SIGKILL)
    with anyio.fail_after(120):
        while workers.restarts < 1:
            await asyncio.sleep(0.2)
    assert proxy.worker_ports == ports and workers._procs[0].pid != pid
    att = next(a for a in [await new_attempt(store, {"q": i}) for i in range(20)]
               if str(ports[0]) in attempt_url(proxy, a))  # fmt: skip
    client = oai(attempt_url(proxy, att))
    with anyio.fail_after(60):
        r = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    assert r.choices[0].message.content is not None


async def test_workers_stop_with_the_proxy(engine: TorchEngine, store: SQLiteStore) -> None:
    p = Proxy(engine, store, workers=1)
    await p.start()
    workers = p._workers
    assert isinstance(workers, ProxyWorkers)
    procs = list(workers._procs)
    await p.stop()
    assert all(proc.poll() is not None for proc in procs)
    assert all(proc.returncode == 0 for proc in procs), [proc.returncode for proc in procs]  # a clean stop


def test_workers_need_a_store_several_processes_can_open(tokenizer: Any) -> None:
    from tests.proxy.engines import EchoEngine

    with pytest.raises(ValueError, match="SQLiteStore"):
        Proxy(EchoEngine(tokenizer), MemoryStore(), workers=2)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="workers must be an int >= 0"):
            Proxy(EchoEngine(tokenizer), MemoryStore(), workers=bad)  # type: ignore[arg-type]


async def test_a_worker_that_cannot_start_says_why_and_leaves_nothing_running(
    tokenizer: Any, store: SQLiteStore
) -> None:
    from tests.proxy.engines import EchoEngine

    pool = ProxyWorkers(2, EchoEngine(tokenizer), store, "127.0.0.1", {"default_max_tokens": 0})
    with (
        anyio.fail_after(120),
        pytest.raises(RuntimeError, match="failed to start: ValueError: default_max_tokens"),
    ):
        await pool.start()
    assert all(proc.poll() is not None for proc in pool._procs)


def test_a_worker_spec_goes_over_as_json_and_comes_back_the_same() -> None:
    from pydantic import SecretStr

    from agentloop.http_limits import HttpLimits
    from agentloop.proxy.workers import WorkerSpec

    spec = WorkerSpec(index=1, engine_socket="/tmp/x/engine.sock", tokenizer_dir="/tmp/t", max_context=2048,
                      store_path="/tmp/s.db", host="127.0.0.1", port=0,
                      proxy_kwargs={"api_key": SecretStr("k3y"), "limits": HttpLimits(max_connections=7),
                                    "default_sampling": {"temperature": 0.5}, "chat_template": None})  # fmt: skip
    back = WorkerSpec.from_json(spec.to_json())
    assert back.proxy_kwargs["limits"] == HttpLimits(max_connections=7)
    assert back.proxy_kwargs["api_key"] == "k3y"  # Proxy takes the plain key as well
    assert back == WorkerSpec(**{**dataclasses.asdict(spec), "proxy_kwargs": back.proxy_kwargs})
