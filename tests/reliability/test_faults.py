"""Fault injection with real processes and real signals: nothing finished is lost, nothing is counted twice."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import openai
import pytest

from agentloop.adapter import triplets_for_rollouts
from agentloop.agent import rollout
from agentloop.errors import EngineError
from agentloop.resources import Resources
from agentloop.runner import Runner
from agentloop.store.client import StoreClient
from agentloop.store.server import StoreServer
from agentloop.store.sqlite import SQLiteStore
from agentloop.types import AttemptedRollout, AttemptStatus, RolloutConfig, RolloutStatus, Span
from tests.proxy.engines import EchoEngine
from tests.reliability.agents import chat_agent, reward_agent
from tests.reliability.conftest import REPO, running_proxy
from tests.reliability.report import record

A, R = AttemptStatus, RolloutStatus


def _spawn(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.reliability.agents", *args],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own process group: killpg reaches everything it started
    )


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


async def _wait_for(path: Path, proc: subprocess.Popen[bytes], what: str, limit: float = 60) -> str:
    with anyio.fail_after(limit):
        while not (path.exists() and path.read_text()):
            assert proc.poll() is None, f"the child process ended before {what}"
            await anyio.sleep(0.05)
    return path.read_text()


def _llm_calls(spans: list[Span]) -> list[Span]:
    return [s for s in spans if s.payload.kind == "llm_call"]


@pytest.mark.e2e
async def test_sigkilled_runner_is_retried_once_without_duplicate_triplets(
    tmp_path: Path, tokenizer: Any
) -> None:
    store = SQLiteStore(tmp_path / "store.db", poll_interval_s=0.05)
    async with StoreServer(store) as server, running_proxy(EchoEngine(tokenizer), store) as proxy:
        await store.add_resources(Resources(items={"llm": proxy.as_resource()}))
        marker = tmp_path / "marker"
        task = {"q": 1, "turns": 2, "hang_after": 1, "marker": str(marker)}
        ro = await store.enqueue_rollout(task, config=RolloutConfig(unresponsive_s=1.0, max_attempts=3))
        child = _spawn("runner", server.url)
        try:  # the child's agent made one LLM call and hangs: kill the whole runner process
            first_attempt = await _wait_for(marker, child, "its first LLM call")
        finally:
            _kill(child)
        assert len(_llm_calls(await store.query_spans(ro.rollout_id, first_attempt))) == 1
        with anyio.fail_after(30):  # another runner: the watchdog ends attempt 1, attempt 2 runs
            stats = await Runner(chat_agent, store, concurrency=2).run(max_rollouts=1)
        assert stats.succeeded == 1
        attempts = await store.list_attempts(ro.rollout_id)
        assert [(a.sequence_id, a.status) for a in attempts] == [(1, A.UNRESPONSIVE), (2, A.SUCCEEDED)]
        assert attempts[0].worker_id == "doomed-runner" and attempts[0].attempt_id == first_attempt
        assert (await store.get_rollout(ro.rollout_id)).status is R.SUCCEEDED
        result = await triplets_for_rollouts(store, [ro.rollout_id])
        latest = _llm_calls(await store.query_spans(ro.rollout_id, attempts[1].attempt_id))
        assert len(result.triplets) == len(latest) == 2  # attempt 1's call never reaches the trainer
        assert [t.prompt_ids for t in result.triplets] == [s.payload.prompt_ids for s in latest]  # type: ignore[union-attr]
    await store.close()
    record("fault", name="runner SIGKILLed mid-rollout", survived=True, lost_rollouts=0, duplicates=0)


async def test_agent_that_raises_or_hangs_is_retried(tmp_path: Path) -> None:
    @rollout
    async def agent(task: dict[str, Any], llm: Any, ro: AttemptedRollout) -> float:
        if ro.attempt.sequence_id == 1:
            if task["fault"] == "raise":
                raise RuntimeError("agent blew up")
            await anyio.sleep(3600)  # hangs past timeout_s
        return 1.0

    store = SQLiteStore(tmp_path / "store.db", poll_interval_s=0.05)
    cfg = RolloutConfig(timeout_s=0.5, max_attempts=2)
    raised = await store.enqueue_rollout({"fault": "raise"}, config=cfg)
    hung = await store.enqueue_rollout({"fault": "hang"}, config=cfg)
    with anyio.fail_after(20):
        stats = await Runner(agent, store, concurrency=4).run(max_rollouts=4)
    assert (stats.failed, stats.timeout, stats.succeeded) == (1, 1, 2)
    a_raised = await store.list_attempts(raised.rollout_id)
    assert [a.status for a in a_raised] == [A.FAILED, A.SUCCEEDED]
    err = a_raised[0].error
    assert err is not None and err.type == "RuntimeError" and "agent blew up" in (err.traceback or "")
    assert [a.status for a in await store.list_attempts(hung.rollout_id)] == [A.TIMEOUT, A.SUCCEEDED]
    for rid in (raised.rollout_id, hung.rollout_id):
        assert (await store.get_rollout(rid)).status is R.SUCCEEDED
    await store.close()
    record("fault", name="agent raises", survived=True, lost_rollouts=0)
    record("fault", name="agent hangs past timeout_s", survived=True, lost_rollouts=0)


class FlakyEngine(EchoEngine):
    """EchoEngine whose first ``failures`` generate calls raise EngineError."""

    def __init__(self, tokenizer: Any, failures: int) -> None:
        super().__init__(tokenizer)
        self.failures = failures

    async def generate(self, prompt_ids: list[int], sampling: Any, request_id: str | None = None) -> Any:
        if self.failures > 0:
            self.failures -= 1
            raise EngineError("injected engine failure (CUDA error: device-side assert)")
        return await super().generate(prompt_ids, sampling, request_id=request_id)


async def test_engine_failure_is_503_and_the_attempt_is_retried(tmp_path: Path, tokenizer: Any) -> None:
    statuses: list[int] = []

    @rollout
    async def agent(task: dict[str, Any], llm: Any) -> float:
        async with openai.AsyncOpenAI(base_url=llm.base_url, api_key="x", max_retries=0) as client:
            try:
                await client.chat.completions.create(
                    model=llm.model, messages=[{"role": "user", "content": "hi"}]
                )
            except openai.APIStatusError as exc:
                statuses.append(exc.status_code)
                raise
        return 1.0

    store = SQLiteStore(tmp_path / "store.db", poll_interval_s=0.05)
    async with running_proxy(FlakyEngine(tokenizer, failures=1), store) as proxy:
        await store.add_resources(Resources(items={"llm": proxy.as_resource()}))
        ro = await store.enqueue_rollout({"q": 1}, config=RolloutConfig(max_attempts=2))
        with anyio.fail_after(20):
            await Runner(agent, store).run(max_rollouts=2)
    assert statuses == [503]
    attempts = await store.list_attempts(ro.rollout_id)
    assert [a.status for a in attempts] == [A.FAILED, A.SUCCEEDED]
    assert "503" in (attempts[0].error.message if attempts[0].error else "")
    assert len(_llm_calls(await store.query_spans(ro.rollout_id))) == 1
    await store.close()
    record("fault", name="engine raises during generate", survived=True, lost_rollouts=0)


async def test_proxy_restart_while_agents_wait(tmp_path: Path, tokenizer: Any) -> None:
    store = SQLiteStore(tmp_path / "store.db", poll_interval_s=0.05)
    engine = EchoEngine(tokenizer, delay_s=0.05)
    first = await (proxy := running_proxy(engine, store)).__aenter__()
    port = first.port
    await store.add_resources(Resources(items={"llm": first.as_resource()}))
    ids = [(await store.enqueue_rollout({"q": i, "turns": 4})).rollout_id for i in range(8)]
    runner = Runner(chat_agent, store, concurrency=8)
    try:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(runner.run, 8)
                while len(engine.calls) < 10:
                    await anyio.sleep(0.01)
                await proxy.__aexit__(None, None, None)  # agents now get connection refused, and retry
                await anyio.sleep(0.3)
                proxy = running_proxy(engine, store, port=port)
                await proxy.__aenter__()
    finally:
        await proxy.__aexit__(None, None, None)
    done = await store.wait_for_rollouts(ids, timeout=0)
    assert len(done) == 8 and {r.status for r in done} == {R.SUCCEEDED}
    assert runner.stats.succeeded == 8 and runner.stats.attempts == 8  # no attempt needed a retry
    for rid in ids:
        assert len(_llm_calls(await store.query_spans(rid))) == 4  # each call recorded exactly once
    await store.close()
    record("fault", name="proxy restarted while agents wait", survived=True, lost_rollouts=0)


@pytest.mark.e2e
async def test_sqlite_store_process_killed_and_restarted(tmp_path: Path) -> None:
    db, url_file = tmp_path / "store.db", tmp_path / "url"
    child = _spawn("store", str(db), "0", str(url_file))
    try:
        url = await _wait_for(url_file, child, "the store listened")
        port = url.rsplit(":", 1)[1]
        async with StoreClient(url, timeout=15) as client:
            cfg = RolloutConfig(unresponsive_s=3.0, max_attempts=5)
            ids = [(await client.enqueue_rollout({"i": i}, config=cfg)).rollout_id for i in range(40)]
            runner = Runner(reward_agent, client, concurrency=8, poll_interval=0.05)
            with anyio.fail_after(90):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(runner.run)
                    before: list[str] = []
                    while len(before) < 10:
                        before = [r.rollout_id for r in await client.list_rollouts(status=["succeeded"])]
                        await anyio.sleep(0.02)
                    _kill(child)  # SIGKILL mid-run: requests in flight fail, runners keep going
                    url_file.unlink()
                    await anyio.sleep(0.5)
                    child = _spawn("store", str(db), port, str(url_file))
                    assert await _wait_for(url_file, child, "the store came back") == url
                    done = await client.wait_for_rollouts(ids, timeout=60)
                    runner.stop()
            assert len(done) == 40 and {r.status for r in done} == {R.SUCCEEDED}
            assert set(before) <= {r.rollout_id for r in done}
            for rid in ids:  # the latest attempt holds its three rewards, each once
                spans = await client.query_spans(rid)
                assert [s.payload.name for s in spans] == ["step0", "step1", "step2"]  # type: ignore[union-attr]
            retried = sum(r.num_attempts > 1 for r in done)
    finally:
        _kill(child)
    record("fault", name="SQLite store process SIGKILLed and restarted", survived=True, lost_rollouts=0,
           rollouts=40, retried=retried)  # fmt: skip


def test_trainer_kill_and_resume_is_covered_elsewhere() -> None:
    """The trainer SIGKILLed after a checkpoint and resumed: tests/trainer/fit/test_resume.py."""
    path = REPO / "tests" / "trainer" / "fit" / "test_resume.py"
    assert "SIGKILL" in path.read_text() and "def test_resume_after_kill" in path.read_text()
