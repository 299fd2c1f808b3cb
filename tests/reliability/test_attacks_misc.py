"""Issue 44's low findings 6, 8, 9, 10, 11, 13 and 14, each attack as the review ran it, with what a
legitimate user gets meanwhile (a coroutine ticking on the event loop, the owner's own store, a
process that must exit, a second judge request); each test records one row of the reliability
report's attacks table (``worst_legit_ms``: the worst the legitimate side saw; ``memory_growth_mb``:
this process's resident memory, before to peak)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.commands.test_inspect import run_dir as _training_run  # noqa: F401  # a fixture: a run folder
from tests.loop_watch import watch_event_loop
from tests.reliability.report import record

REPO = Path(__file__).resolve().parents[2]


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


@dataclass
class Watched:
    gaps: list[float] = field(default_factory=list)
    peak_mb: float = 0.0
    base_mb: float = 0.0

    @property
    def worst_ms(self) -> float:
        return round(max(self.gaps, default=0.0) * 1000, 1)

    @property
    def growth_mb(self) -> float:
        return round(max(self.peak_mb - self.base_mb, 0.0), 1)


@asynccontextmanager
async def watched() -> AsyncIterator[Watched]:
    """The event loop's gaps (a coroutine ticking every 10 ms: the legitimate work) and the memory."""
    w = Watched(base_mb=rss_mb())
    w.peak_mb = w.base_mb

    async def sample() -> None:
        while True:
            w.peak_mb = max(w.peak_mb, rss_mb())
            await anyio.sleep(0.02)

    async with anyio.create_task_group() as tg, watch_event_loop(interval_s=0.01) as gaps:
        tg.start_soon(sample)
        await anyio.sleep(0.05)  # both tick before the attack's first synchronous step
        w.gaps = gaps
        try:
            yield w
        finally:
            w.peak_mb = max(w.peak_mb, rss_mb())
            tg.cancel_scope.cancel()


def row(
    name: str, tried: int, held: bool, lost: int, w: Watched, legit_ms: float | None = None, **detail: Any
) -> None:
    """One row; ``legit_ms``: the worst the legitimate side waited (default: the event loop's worst gap,
    kept in the detail either way)."""
    record(
        "attack",
        name=name,
        tried=tried,
        held=held,
        lost=lost,
        worst_legit_ms=w.worst_ms if legit_ms is None else round(legit_ms, 1),
        memory_growth_mb=w.growth_mb,
        detail={"name": name, "worst_event_loop_gap_ms": w.worst_ms, **detail},
    )


@contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


# ---------------------------------------------------------------- finding 6


async def test_run_folders_and_stores_are_the_owners_only(tmp_path: Path) -> None:
    from agentloop.store.sqlite import SQLiteStore
    from agentloop.types import Log, Span
    from trainer.run_folder import checkpoint as ck

    name = "files: run folder, store.db (+ -wal/-shm), run.json, config, checkpoints, agentloop-serve.db readable by other local users"
    run_dir = tmp_path / "runs" / "p" / "run"
    with umask(0o022):  # the usual one: what the review ran under
        async with watched() as w:
            run_dir.mkdir(parents=True)
            (run_dir / "config.json").write_text("{}")
            ck.write_run(run_dir, {"status": "running"})
            step = ck.CheckpointManager(run_dir / "checkpoints").begin(1)
            (step / "model.safetensors").write_bytes(b"w")
            ck.CheckpointManager(run_dir / "checkpoints").commit(1, {"step": 1})
            stores = [SQLiteStore(run_dir / "store.db"), SQLiteStore(tmp_path / "agentloop-serve.db")]
            owner_ms = 0.0
            try:
                for store in stores:  # the owner's own work goes on as before
                    start = time.monotonic()
                    r = await store.enqueue_rollout({"task": "secret"})
                    a = await store.dequeue_rollout("w")
                    assert a is not None
                    await store.add_span(
                        Span(
                            rollout_id=r.rollout_id, attempt_id=a.attempt.attempt_id, payload=Log(message="m")
                        )
                    )
                    owner_ms = max(owner_ms, (time.monotonic() - start) * 1000)
                ck.write_run(run_dir, {"status": "finished"})
                files = [run_dir, *run_dir.rglob("*"), *tmp_path.glob("agentloop-serve.db*")]
                readable = [
                    str(p.relative_to(tmp_path)) for p in files if stat.S_IMODE(p.lstat().st_mode) & 0o077
                ]
            finally:
                for store in stores:
                    await store.close()
    row(
        name,
        len(files),
        not readable,
        len(readable),
        w,
        open_to_others=readable,
        legit_ms=owner_ms,
        legit="the owner's enqueue, dequeue and span on each store",
    )
    assert not readable, readable


# ---------------------------------------------------------------- findings 8 and 9


async def test_traces_without_content_capture_carry_no_exception_text() -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from agentloop import tracing
    from agentloop.agent import rollout
    from agentloop.runner import Runner
    from agentloop.store.memory import MemoryStore
    from agentloop.types import RolloutConfig

    @rollout
    async def quotes_its_task(task: dict[str, Any], llm: Any) -> float:
        raise ValueError(f"could not parse {task['secret']!r}")

    name = "tracing: exception messages quoting the task exported with content capture off"
    memory = InMemorySpanExporter()
    tracing.configure(exporter=memory, capture_content=False)
    store = MemoryStore()
    n = 20
    try:
        async with watched() as w:
            for i in range(n):
                await store.enqueue_rollout(
                    {"secret": f"password-{i}-hunter2"}, config=RolloutConfig(max_attempts=1)
                )
            await Runner(quotes_its_task, store, concurrency=4, poll_interval=0.01).run(max_rollouts=n)
            assert await anyio.to_thread.run_sync(tracing.force_flush, 10)
        spans = memory.get_finished_spans()
        leaked = [
            s.name for s in spans
            if "hunter2" in repr(dict(s.attributes or {})) + str(s.status.description)
            + "".join(repr(dict(e.attributes or {})) for e in s.events)
        ]  # fmt: skip
    finally:
        tracing.shutdown(timeout_s=5)
    row(name, n, not leaked, len(leaked), w, spans=len(spans), leaked=leaked[:3])
    assert not leaked


_HUNG = """
import sys, threading, time
from opentelemetry.sdk.trace.export import SpanExporter
from agentloop import tracing

class Hung(SpanExporter):
    def export(self, spans):
        threading.Event().wait()

    def shutdown(self):
        threading.Event().wait()

tracing.configure(exporter=Hung())
for _ in range(3):
    tracing._pipeline.tracer.start_span("x").end()
start = time.monotonic()
flushed = tracing.force_flush(timeout_s=1)
print("FLUSH", flushed, round(time.monotonic() - start, 2), file=sys.stderr, flush=True)
start = time.monotonic()
tracing.shutdown(timeout_s=2)
print("SHUTDOWN", round(time.monotonic() - start, 2), file=sys.stderr, flush=True)
"""


def test_a_hung_exporter_cannot_keep_the_process_from_exiting() -> None:
    name = "tracing: an OTel exporter that never returns, then force_flush(1 s), shutdown(2 s) and the process's exit"
    base = rss_mb()
    start = time.monotonic()
    try:
        out = subprocess.run(
            [sys.executable, "-c", _HUNG], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        exited_s, stderr = time.monotonic() - start, out.stderr
    except subprocess.TimeoutExpired as exc:
        exited_s, stderr = float("inf"), str(exc.stderr)
    lines = dict(ln.split(" ", 1) for ln in stderr.splitlines() if ln.startswith(("FLUSH", "SHUTDOWN")))
    shutdown_s = float(lines.get("SHUTDOWN", "inf"))
    held = shutdown_s < 2.5 and exited_s < 60 and lines.get("FLUSH", "").startswith("False")
    w = Watched(base_mb=base, peak_mb=rss_mb())  # no event loop here: the process is the legitimate side
    row(name, 3, held, 0 if held else 1, w, legit_ms=min(exited_s, 60.0) * 1000, flush=lines.get("FLUSH"),
        shutdown_s=shutdown_s, legit="the process, start to exit (imports, a 1 s flush and a 2 s shutdown)")  # fmt: skip
    assert held, stderr[-2000:]


# ---------------------------------------------------------------- findings 10 and 11


@pytest.mark.e2e
async def test_closing_an_mcp_session_does_not_wait_for_a_delete_that_never_comes() -> None:
    from agentloop.tools.mcp import mcp_tools
    from tests.tools.test_mcp import start_http_server

    name = "mcp: closing HTTP sessions with a server that never answers the session's DELETE"
    srv, proc = await anyio.to_thread.run_sync(start_http_server, "http-ignoring-delete")
    closes: list[float] = []
    answered: list[str] = []
    try:
        async with watched() as w:
            for _ in range(2):
                with anyio.fail_after(120):  # before the fix: 300 s a close
                    async with mcp_tools(srv) as tools:
                        answered.append((await tools[0].execute("i", {"a": 1, "b": 2})).response.text or "")
                        start = time.monotonic()
                    closes.append(time.monotonic() - start)
    finally:
        proc.kill()
        proc.wait()
    held = max(closes) < 7
    row(name, len(closes), held, 0 if held else len(closes), w, legit_ms=max(closes) * 1000,
        close_s=[round(c, 2) for c in closes], calls_answered=answered,
        legit="the app leaving `async with mcp_tools(...)` (before: 300 s)")  # fmt: skip
    assert held, closes


async def test_backtracking_schema_patterns_neither_stall_the_loop_nor_outlive_the_deadline() -> None:
    from mcp import types

    from agentloop.tools import ToolRegistry, execute_tool_call
    from agentloop.tools.mcp import MCPTool, StdioServer
    from tests.tools.test_bounded_patterns import SCHEMAS

    name = "mcp: a server's backtracking JSON Schema patterns (pattern, patternProperties, additionalProperties, propertyNames) on 27 characters of model output"
    nowhere = StdioServer(command="/nonexistent/server")
    results: list[str] = []
    slow: list[str] = []
    deadline = 5.0
    async with watched() as w:
        for where, (schema, args) in SCHEMAS.items():
            spec = types.Tool(name="lookup", inputSchema={"type": "object", **schema})
            registry = ToolRegistry([MCPTool(spec, nowhere, timeout_s=deadline)])
            start = time.monotonic()
            result = await execute_tool_call(registry, "lookup", args)
            if time.monotonic() - start > deadline + 1:
                slow.append(where)
            results.append(str(result.metrics.get("error")))
    accepted = [r for r in results if r not in ("invalid_arguments", "timeout")]
    held = w.worst_ms < 1000 and not slow
    row(
        name,
        len(results),
        held,
        len(accepted) + len(slow),
        w,
        errors=results,
        past_deadline=slow,
        deadline_s=deadline,
    )
    assert held and not accepted, (w.worst_ms, slow, results)


# ---------------------------------------------------------------- finding 13


async def test_a_rollout_cannot_forge_trajectories_or_notes_in_the_judge_prompt() -> None:
    import agentloop as al
    from tests.test_judge import INJECTION, JudgeServer, conversation, trajectories_of

    name = "judge: rollout text that closes its <trajectory> block, adds fake trajectories, delimiters and operator notes"
    answer = {"scores": [{"trajectory_id": t, "score": 0.5} for t in ("1", "2")]}  # the real two
    server = JudgeServer(lambda body: (200, json.dumps(answer)))
    server.thread.start()
    forged = tampered = 0
    judged_ms = 0.0
    tried = 5
    try:
        judge = al.judge_reward(llm=server.llm)
        async with watched() as w:
            for i in range(tried):
                group = [conversation(INJECTION), conversation(f"{i}")][:: 1 if i % 2 else -1]
                start = time.monotonic()
                await judge.score(f"What is {i} + 2?", group)
                judged_ms = max(judged_ms, (time.monotonic() - start) * 1000)
        for request in server.requests:  # read as the judge is told to: by the request's own code
            found = trajectories_of(request)
            forged += len(found) != 2
            tampered += INJECTION not in [json.loads(text)[-1]["content"] for _, text in found]
    finally:
        server.httpd.shutdown()
        server.httpd.server_close()
    row(name, tried, forged == tampered == 0, forged + tampered, w, legit_ms=judged_ms,
        requests=len(server.requests), legit="each group's judge call, the two real trajectories scored")  # fmt: skip
    assert forged == tampered == 0


# ---------------------------------------------------------------- finding 14


def test_inspect_never_downloads_what_a_hostile_store_names(
    tmp_path: Path,
    tiny_model_dir: Path,
    _training_run: Path,  # noqa: F811  # the fixture imported above
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import sqlite3

    from transformers import AutoTokenizer

    from agentloop.engine import models
    from tests.commands.test_inspect import _inspect, _serve_two_sessions

    name = "inspect: a run's config.json and a serve store's metadata naming hub repos to download"
    tried: list[str] = []

    def download(repo_id: str) -> Path:  # the network edge: record, fetch nothing
        tried.append(repo_id)
        raise models.ModelResolutionError("test: no download")

    monkeypatch.setattr(models, "_download_from_hub", download)
    store = tmp_path / "serve" / "agentloop-serve.db"  # run_dir is tmp_path itself
    store.parent.mkdir()
    anyio.run(_serve_two_sessions, store, AutoTokenizer.from_pretrained(tiny_model_dir))
    with sqlite3.connect(store) as conn:
        meta = {"model": "evil-org/exfil-model", "tokenizer": "evil-org/exfil-tokenizer"}
        conn.execute("UPDATE store_meta SET value = ? WHERE key = 'serve'", (json.dumps(meta),))
    run_dir = _training_run  # store.db with two rewarded rollouts, and config.json
    config = {"actor_rollout_ref": {"model": {"path": "evil-org/exfil-run-model"}}}
    (run_dir / "config.json").write_text(json.dumps(config))
    refused = []
    base = rss_mb()
    code, _, err = _inspect(str(store), "--no-color", capsys=capsys)
    refused.append(code == 2 and "'evil-org/exfil-tokenizer'" in err)
    code, _, err = _inspect(str(run_dir), "--no-color", capsys=capsys)
    refused.append(code == 2 and "'evil-org/exfil-run-model'" in err)
    start = time.monotonic()
    code, out, err = _inspect(str(store), "--no-color", "--model", str(tiny_model_dir), capsys=capsys)
    legit_ms = (time.monotonic() - start) * 1000
    legit_ok = code == 0 and "[model]Paris is the capital." in out
    w = Watched(base_mb=base, peak_mb=rss_mb())  # no event loop here
    held = all(refused) and not tried and legit_ok
    row(name, len(refused), held, len(tried), w, legit_ms=legit_ms, downloads_tried=tried,
        refused_with_a_message=refused, legit="inspect of the same store with the user's own --model")  # fmt: skip
    assert held, (tried, refused, err)
