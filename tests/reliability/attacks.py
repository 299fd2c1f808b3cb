"""Attacks on the servers (issue 16), each run against a StoreServer or a Proxy (EchoEngine) in its own
process while a legitimate client keeps working. ``measure`` gives one row ``{"name", "tried", "held", "lost"}``:

- held: every probe of the legitimate client (a fresh connection with a valid key: enqueue and read
  back on the store, a chat completion on the proxy) was answered within ANSWER_S during the attack, and the server's resident memory never
  grew by RSS_BOUND or more;
- lost: legitimate rollouts (proxy: session calls) that could not be read back intact afterwards
  (missing, unreadable, or changed by the attacker), plus hostile writes the server accepted.

benchmarks/reliability.py collects the rows (via tests/reliability/test_attacks.py) into its
"attacks" table.
"""

from __future__ import annotations

import asyncio
import functools
import os
import secrets
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import orjson

from agentloop.store.client import StoreClient
from agentloop.store.server import runner_key
from tests.loop_watch import watch_event_loop
from tests.reliability.conftest import REPO
from tests.reliability.store_server import KEY_ENV

ANSWER_S = 2.0  # a legitimate client's answer within this, during every attack
RSS_BOUND = 64 * 2**20  # the server's memory may not grow by this much (a 96 MB header once grew it 96 MB)
PROBES = 3  # legitimate requests made while the attack's sockets are open


@dataclass
class Target:
    """A server under attack in its own process: where it listens, its pid, a key that passes its
    authentication (the admin key for the store, the proxy key for the proxy)."""

    url: str
    pid: int
    key: str

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    post_path = "/v1/spans"  # a route that reads a body

    def body_key(self) -> str:
        """The key a hostile but authenticated client sends a slow body with."""
        return self.key

    async def probe(self, i: int) -> str:
        """One legitimate request on a fresh connection; an id that ``lost`` checks afterwards."""
        raise NotImplementedError

    async def lost(self, ids: list[str]) -> int:
        """How many probes' results did not survive intact."""
        raise NotImplementedError


class StoreTarget(Target):
    def body_key(self) -> str:
        return runner_key(self.key, "hostile")  # a compromised runner

    async def probe(self, i: int) -> str:
        async with StoreClient(self.url, api_key=self.key, timeout=ANSWER_S * 5) as client:
            rollout = await client.enqueue_rollout({"legit": i})
            await client.get_rollout(rollout.rollout_id)
        return rollout.rollout_id

    async def lost(self, ids: list[str]) -> int:
        lost = 0
        async with StoreClient(self.url, api_key=self.key, timeout=30) as client:
            for rid in ids:
                try:
                    rollout = await client.get_rollout(rid)
                    await client.query_spans(rid)
                    # queued, or running when an attack's runner dequeued it: either way untouched
                    lost += rollout.status.value not in ("queued", "running") or "legit" not in rollout.input
                except Exception:
                    lost += 1
        return lost


class ProxyTarget(Target):
    post_path = "/v1/chat/completions"

    async def probe(self, i: int) -> str:
        import httpx

        sid = f"legit-{i}-{secrets.token_hex(4)}"
        headers = {"authorization": f"Bearer {self.key}", "x-session-id": sid}
        body = {"messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 4}
        async with httpx.AsyncClient(timeout=ANSWER_S * 5) as http:
            resp = await http.post(f"{self.url}/v1/chat/completions", json=body, headers=headers)
        resp.raise_for_status()
        return sid

    async def lost(self, ids: list[str]) -> int:
        import httpx

        lost = 0
        async with httpx.AsyncClient(timeout=30, headers={"authorization": f"Bearer {self.key}"}) as http:
            for sid in ids:
                resp = await http.get(f"{self.url}/v1/sessions/{sid}")
                lost += resp.status_code != 200
        return lost


def rss(pid: int) -> int:
    """Resident memory of process ``pid`` now (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


@asynccontextmanager
async def _server_process(
    what: str, module: str, args: list[str], tmp: Path, start_s: float
) -> AsyncIterator[tuple[str, int, str]]:
    """``python -m module *args URL_FILE`` with a fresh key in KEY_ENV; (url, pid, key) once it listens."""
    key = secrets.token_hex(16)
    url_file = tmp / f"{what}-{secrets.token_hex(4)}.url"
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args, str(url_file)],
        cwd=REPO,
        env={**os.environ, KEY_ENV: key},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        with anyio.fail_after(start_s):
            while not url_file.exists() or not url_file.read_text():
                if proc.poll() is not None:
                    raise RuntimeError(f"the {what} process exited with {proc.returncode}")
                await anyio.sleep(0.05)
        yield url_file.read_text(), proc.pid, key
    finally:
        proc.kill()
        proc.wait()


@asynccontextmanager
async def store_process(tmp: Path) -> AsyncIterator[StoreTarget]:
    """A StoreServer (MemoryStore, default limits, an admin key) in a child process."""
    async with _server_process("store", "tests.reliability.store_server", [], tmp, 60) as (url, pid, key):
        yield StoreTarget(url, pid, key)


@asynccontextmanager
async def proxy_process(tmp: Path, model_dir: Path) -> AsyncIterator[ProxyTarget]:
    """A Proxy (EchoEngine with the tiny model's tokenizer, MemoryStore, a key) in a child process."""
    module, args = "tests.reliability.proxy_server", [str(model_dir)]
    async with _server_process("proxy", module, args, tmp, 120) as (url, pid, key):
        yield ProxyTarget(url, pid, key)


@dataclass
class Context:
    """What an attack gets: the target, ``hold()`` (returns once the legitimate client has probed
    PROBES times while the attack holds its sockets) and counters it fills."""

    target: Target
    probes_done: Callable[[], int]
    statuses: Counter[str] = field(default_factory=Counter)
    accepted: list[str] = field(default_factory=list)  # hostile writes the store took (each one is lost)

    async def hold(self) -> None:
        start = self.probes_done()
        with anyio.fail_after(60):
            while self.probes_done() < start + PROBES:
                await anyio.sleep(0.02)


Attack = Callable[[Context], Awaitable[int]]  # returns how many hostile connections/requests it tried


async def measure(target: Target, name: str, attack: Attack) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run ``attack`` while probing the legitimate client and sampling the server's memory; the row
    and the measurements behind it."""
    latencies: list[float] = []
    failures: list[str] = []
    legit: list[str] = []
    base = peak = rss(target.pid)
    done = anyio.Event()
    tried = 0

    async def probe() -> None:
        start = time.monotonic()
        try:
            with anyio.fail_after(ANSWER_S * 5):
                legit.append(await target.probe(len(latencies)))
        except Exception as exc:
            failures.append(f"{type(exc).__name__}: {exc}"[:200])
        latencies.append(time.monotonic() - start)

    async def probes() -> None:
        while not done.is_set():
            await probe()
            await anyio.sleep(0.1)

    async def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, rss(target.pid))
            await anyio.sleep(0.02)

    ctx = Context(target, lambda: len(latencies))

    async def run() -> None:
        nonlocal tried
        try:
            tried = await attack(ctx)
        finally:
            done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(sample)
        tg.start_soon(probes)
        tg.start_soon(run)
    peak = max(peak, rss(target.pid))
    lost = await target.lost(legit) + len(ctx.accepted)
    grown = peak - base
    held = not failures and max(latencies) < ANSWER_S and grown < RSS_BOUND
    row = {
        "name": name,
        "tried": tried,
        "held": held,
        "lost": lost,
        "worst_legit_ms": round(max(latencies) * 1e3, 1),
        "memory_growth_mb": round(grown / 2**20, 1),
    }
    detail = {
        "name": name,
        "probes": len(latencies),
        "worst_answer_s": round(max(latencies), 3),
        "probe_failures": failures[:3],
        "rss_growth_mb": round(grown / 2**20, 1),
        "hostile_answers": dict(ctx.statuses),
        "accepted": ctx.accepted[:5],
    }
    return row, detail


# ---------------------------------------------------------------- raw HTTP


async def connect(target: Target) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", target.port)


def head(method: str, path: str, key: str | None = None, length: int | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: localhost"]  # a loopback name: the proxy refuses others
    if key is not None:
        lines.append(f"Authorization: Bearer {key}")
    if length is not None:
        lines += ["Content-Type: application/json", f"Content-Length: {length}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def request(
    target: Target, method: str, path: str, body: bytes | None, key: str | None
) -> tuple[int, bytes]:
    """One request on a fresh connection; (status, body); status 0 when the server closed it unanswered."""
    try:
        reader, writer = await connect(target)
    except OSError:
        return 0, b""
    try:
        writer.write(head(method, path, key, len(body) if body is not None else None) + (body or b""))
        with anyio.fail_after(30):
            data = await reader.read()  # answers that close the connection (401 does)
    except (OSError, TimeoutError):
        return 0, b""
    finally:
        writer.close()
    if not data.startswith(b"HTTP/1.1 "):
        return 0, data
    return int(data[9:12]), data.split(b"\r\n\r\n", 1)[-1]


async def request_keep_alive(target: Target, method: str, path: str, body: Any, key: str) -> tuple[int, Any]:
    """A request through StoreClient's wire (keep-alive); (status, parsed JSON body)."""
    from agentloop.store._wire import WirePool

    pool = WirePool(target.url, 1, {"authorization": f"Bearer {key}"})
    try:
        content = body if isinstance(body, bytes) else (orjson.dumps(body) if body is not None else None)
        status, data = await pool.request(method, path, content, 30, idempotent=False)
    finally:
        await pool.close()
    try:
        return status, orjson.loads(data)
    except orjson.JSONDecodeError:
        return status, data[:200]


# ---------------------------------------------------------------- the attacks


async def slow_and_half_open(ctx: Context, n: int = 500) -> int:
    """n sockets at once: a third send nothing, a third half a request head, a third (a compromised
    runner's key) a complete head announcing 100 body bytes and then only 10."""
    hostile = ctx.target.body_key()
    conns = []
    for i in range(n):
        reader, writer = await connect(ctx.target)
        if i % 3 == 1:
            writer.write(f"POST {ctx.target.post_path} HTTP/1.1\r\nHost: s\r\nContent-Le".encode())
        elif i % 3 == 2:
            writer.write(head("POST", ctx.target.post_path, hostile, 100) + b'{"rollout_')
        conns.append((reader, writer))
    await ctx.hold()
    for _, writer in conns:
        writer.close()
    return n


async def oversized_headers(ctx: Context, n: int = 3, mb: int = 96) -> int:
    """n connections each sending a header line of ``mb`` MB (1 MB writes)."""
    chunk = b"a" * 2**20

    async def send() -> None:
        _reader, writer = await connect(ctx.target)
        writer.write(b"GET /v1/health HTTP/1.1\r\nHost: store\r\nX-Big: ")
        sent = 0
        try:
            for _ in range(mb):
                writer.write(chunk)
                await writer.drain()
                sent += 1
            ctx.statuses["whole line sent"] += 1
        except (ConnectionError, OSError):
            ctx.statuses[f"cut after {sent} MB"] += 1
        writer.close()

    async with anyio.create_task_group() as tg:
        for _ in range(n):
            tg.start_soon(send)
        tg.start_soon(ctx.hold)
    return n


async def unauthenticated_flood(ctx: Context, idle: int = 4500, requests: int = 2000) -> int:
    """``idle`` sockets without a key (more than max_connections=4096), then ``requests`` requests with
    wrong keys (64 at a time), all while the idle ones stay open."""
    conns = []
    for _ in range(idle):
        try:
            conns.append(await connect(ctx.target))
        except OSError:
            ctx.statuses["connect refused"] += 1
    limiter = anyio.CapacityLimiter(64)

    async def wrong_key(i: int) -> None:
        async with limiter:
            status, _ = await request(ctx.target, "POST", ctx.target.post_path, b"{}", f"guess-{i}")
        ctx.statuses[str(status)] += 1
        if status < 400 and status != 0:
            ctx.accepted.append(f"wrong key {i} answered {status}")

    async with anyio.create_task_group() as tg:
        for i in range(requests):
            tg.start_soon(wrong_key, i)
        tg.start_soon(ctx.hold)
    for _, writer in conns:
        writer.close()
    return idle + requests


def _span(rid: str, aid: str, payload: str) -> bytes:
    return f'{{"rollout_id": "{rid}", "attempt_id": "{aid}", "payload": {payload}}}'.encode()


async def _hostile_attempt(ctx: Context, runner: str) -> tuple[str, str, str]:
    """A rollout enqueued by the admin and dequeued by ``runner``; (rollout_id, attempt_id, key)."""
    key = runner_key(ctx.target.key, runner)
    status, rollout = await request_keep_alive(
        ctx.target, "POST", "/v1/rollouts", {"input": {"task": runner}}, ctx.target.key
    )
    assert status == 200, rollout
    for _ in range(100):  # FIFO: the probes' rollouts may come first (dequeued too, left running)
        status, attempted = await request_keep_alive(
            ctx.target, "POST", "/v1/dequeue", {"worker_id": "w"}, key
        )
        assert status == 200 and attempted is not None, attempted
        if attempted["rollout_id"] == rollout["rollout_id"]:
            return attempted["rollout_id"], attempted["attempt"]["attempt_id"], key
    raise AssertionError("the attack's own rollout never came out of the queue")


async def _expect_refused(ctx: Context, what: str, method: str, path: str, body: Any, key: str) -> None:
    status, answer = await request_keep_alive(ctx.target, method, path, body, key)
    ctx.statuses[str(status)] += 1
    if not 400 <= status < 500:
        ctx.accepted.append(f"{what}: {status} {str(answer)[:120]}")


async def non_finite_numbers(ctx: Context) -> int:
    """NaN / Infinity / -Infinity as a reward, a log-prob, a span field, a rollout input, metadata and a
    config float; afterwards the attacked rollout must still read back."""
    rid, aid, key = await _hostile_attempt(ctx, "nan-runner")
    tried = 0
    for lit in ("NaN", "Infinity", "-Infinity"):
        for what, payload in [
            ("reward", f'{{"kind": "reward", "value": {lit}}}'),
            ("logprob", f'{{"kind": "llm_call", "response_ids": [5], "response_logprobs": [{lit}]}}'),
            ("log field", f'{{"kind": "log", "message": "m", "fields": {{"loss": {lit}}}}}'),
            ("tool result", f'{{"kind": "tool_call", "name": "t", "result": [{lit}]}}'),
        ]:
            await _expect_refused(ctx, f"{lit} {what}", "POST", "/v1/spans", _span(rid, aid, payload), key)
            tried += 1
        for what, body in [
            ("input", f'{{"input": {{"x": {lit}}}}}'),
            ("metadata", f'{{"input": 1, "metadata": {{"s": {lit}}}}}'),
            ("timeout_s", f'{{"input": 1, "config": {{"timeout_s": {lit}}}}}'),
        ]:
            await _expect_refused(ctx, f"{lit} {what}", "POST", "/v1/rollouts", body.encode(), ctx.target.key)
            tried += 1
    await ctx.hold()
    status, spans = await request_keep_alive(
        ctx.target, "GET", f"/v1/rollouts/{rid}/spans", None, ctx.target.key
    )
    if status != 200:
        ctx.accepted.append(f"the attacked rollout no longer reads back: {status} {str(spans)[:120]}")
    return tried


async def deep_json(ctx: Context) -> int:
    """JSON nested 256, 512 and 1024 deep in free-form span fields; the rollout must still read back."""
    rid, aid, key = await _hostile_attempt(ctx, "deep-runner")
    tried = 0
    for depth in (150, 256, 512, 1024):
        deep = "[" * depth + "1" + "]" * depth
        for payload in (
            f'{{"kind": "log", "message": "m", "fields": {{"x": {deep}}}}}',
            f'{{"kind": "llm_call", "sampling": {{"extra": {deep}}}}}',
        ):
            await _expect_refused(ctx, f"depth {depth}", "POST", "/v1/spans", _span(rid, aid, payload), key)
            tried += 1
    await ctx.hold()
    status, spans = await request_keep_alive(
        ctx.target, "GET", f"/v1/rollouts/{rid}/spans", None, ctx.target.key
    )
    if status != 200:
        ctx.accepted.append(f"the attacked rollout no longer reads back: {status} {str(spans)[:120]}")
    return tried


async def role_violations(ctx: Context) -> int:
    """A runner key tries what only the admin may (resources, cancel, enqueue) and writes into another
    runner's attempt (a reward span, a failed status, a heartbeat)."""
    victim_rid, victim_aid, _ = await _hostile_attempt(ctx, "honest")
    _, _, key = await _hostile_attempt(ctx, "hostile")
    admin = ctx.target.key
    _status, before = await request_keep_alive(ctx.target, "GET", "/v1/resources/latest", None, admin)
    attempt = f"/v1/rollouts/{victim_rid}/attempts/{victim_aid}"
    cases: list[tuple[str, str, str, Any]] = [
        ("replace resources", "POST", "/v1/resources", {"items": {}}),
        ("cancel a rollout", "POST", f"/v1/rollouts/{victim_rid}/cancel", None),
        ("enqueue", "POST", "/v1/rollouts", {"input": {"injected": True}}),
        ("reward into another runner's attempt", "POST", "/v1/spans",
         _span(victim_rid, victim_aid, '{"kind": "reward", "value": 100.0}')),
        ("fail another runner's attempt", "POST", attempt, {"status": "failed"}),
        ("heartbeat another runner's attempt", "POST", attempt, {"heartbeat": True}),
    ]  # fmt: skip
    for _ in range(5):
        for what, method, path, body in cases:
            await _expect_refused(ctx, what, method, path, body, key)
    await ctx.hold()
    _, rollout = await request_keep_alive(ctx.target, "GET", f"/v1/rollouts/{victim_rid}", None, admin)
    _, spans = await request_keep_alive(ctx.target, "GET", f"/v1/rollouts/{victim_rid}/spans", None, admin)
    _, after = await request_keep_alive(ctx.target, "GET", "/v1/resources/latest", None, admin)
    if rollout.get("status") != "running" or spans != [] or after != before:
        ctx.accepted.append(
            f"the honest runner's rollout was changed: {rollout.get('status')}, {len(spans)} spans"
        )
    return 5 * len(cases)


# ---------------------------------------------------------------- the proxy: hostile requests


async def keyed_retries(ctx: Context, keys: int = 20, tries: int = 5) -> int:
    """A client retrying each call ``tries`` times with one Idempotency-Key: one recorded call per key
    (a second record would become a second training sample)."""
    import httpx

    sid = f"retries-{secrets.token_hex(4)}"
    headers = {"authorization": f"Bearer {ctx.target.key}", "x-session-id": sid}
    async with httpx.AsyncClient(timeout=30) as http:
        for k in range(keys):
            body = {"messages": [{"role": "user", "content": f"retry {k}"}], "max_tokens": 4}
            for _ in range(tries):
                resp = await http.post(
                    f"{ctx.target.url}/v1/chat/completions",
                    json=body,
                    headers={**headers, "idempotency-key": f"call-{k}"},
                )
                ctx.statuses[str(resp.status_code)] += 1
        await ctx.hold()
        session = (await http.get(f"{ctx.target.url}/v1/sessions/{sid}", headers=headers)).json()
    extra = len(session.get("calls", [])) - keys
    ctx.accepted += [f"{extra} retries recorded as extra calls"] if extra else []
    return keys * tries


async def non_finite_request_fields(ctx: Context) -> int:
    """NaN / Infinity in a request's sampling fields: refused with a 4xx, never generated or recorded."""
    import httpx

    headers = {"authorization": f"Bearer {ctx.target.key}", "content-type": "application/json"}
    fields = ["temperature", "top_p", "max_tokens", "seed", "frequency_penalty"]
    values = ["NaN", "Infinity", "-Infinity", "1e999"]
    async with httpx.AsyncClient(timeout=30) as http:
        for name in fields:
            for value in values:
                body = '{"messages": [{"role": "user", "content": "x"}], "' + name + '": ' + value + "}"
                resp = await http.post(f"{ctx.target.url}/v1/chat/completions", content=body, headers=headers)
                ctx.statuses[str(resp.status_code)] += 1
                if not 400 <= resp.status_code < 500:
                    ctx.accepted.append(f"{name}={value}: {resp.status_code}")
    await ctx.hold()
    return len(fields) * len(values)


# ---------------------------------------------------------------- hostile tool input (in-process)


async def hostile_tool_input(tmp: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Model-written tool input on the event loop that serves the other agents: the calc_x exponent
    tower and SQL that writes files, attaches databases, recurses forever or cross-joins. Held: every
    call ends as a tool error within its deadline + 1 s and the loop never stalls ANSWER_S or more;
    lost: files the SQL created and calls that did not fail."""
    from agentloop.tools import ToolRegistry, execute_tool_call
    from examples.calc_x.agent import calculator
    from examples.sql_agent.agent import execute
    from examples.sql_agent.make_db import build_database

    db = build_database(tmp / "company.db")
    deadline = 1.0
    towers = ["(((10**64)**64)**64)**64", "9**9**9", "2**2**2**2**2**2", "(10**99)*(10**99)", "1e308*1e308"]
    sql = [
        f"VACUUM INTO '{tmp / 'copy.db'}'",
        f"ATTACH 'file:{tmp / 'new.db'}?mode=rwc' AS x",
        "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r) SELECT count(*) FROM r",
        "SELECT * FROM employees a, employees b, employees c, employees d",
        "DELETE FROM employees",
        "PRAGMA journal_mode = DELETE",
    ]
    slow: list[str] = []
    accepted: list[str] = []
    registry = ToolRegistry([calculator])
    async with watch_event_loop(interval_s=0.01) as gaps:
        for expr in towers:
            start = time.monotonic()
            result = await execute_tool_call(registry, "calculator", {"expression": expr}, timeout_s=deadline)
            if time.monotonic() - start > deadline + 1:
                slow.append(expr)
            if not result.is_error:
                accepted.append(f"calculator({expr}) = {str(result.response)[:60]}")
        for query in sql:
            start = time.monotonic()
            try:
                await anyio.to_thread.run_sync(functools.partial(execute, db, query, timeout_s=deadline))
                accepted.append(f"SQL ran: {query[:60]}")
            except Exception:  # the authorizer, the deadline or the row cap refused it
                pass
            if time.monotonic() - start > deadline + 1:
                slow.append(query[:60])
    created = [p.name for p in (tmp / "copy.db", tmp / "new.db") if p.exists()]
    worst_gap = max(gaps, default=0.0)
    lost = len(created) + len(accepted)
    name = "tools: hostile model input (calc_x exponent towers, SQL VACUUM INTO / ATTACH / endless WITH RECURSIVE / cross join / writes)"
    row = {
        "name": name,
        "tried": len(towers) + len(sql),
        "held": worst_gap < ANSWER_S and not slow,
        "lost": lost,
    }
    detail = {
        "name": name,
        "worst_event_loop_gap_s": round(worst_gap, 3),
        "calls_past_deadline": slow,
        "files_created": created,
        "accepted": accepted[:5],
        "deadline_s": deadline,
    }
    return row, detail


STORE_ATTACKS: list[tuple[str, Attack]] = [
    ("store: 500 slow and half-open clients at once (idle, half a header, 10 of 100 body bytes)",
     slow_and_half_open),
    ("store: oversized headers (3 x 96 MB header lines)", oversized_headers),
    ("store: unauthenticated flood (4500 idle sockets over max_connections + 2000 wrong-key requests)",
     unauthenticated_flood),
    ("store: NaN/Infinity in rewards, log-probs, span fields, input, metadata, config", non_finite_numbers),
    ("store: JSON nested 150-1024 deep in span fields", deep_json),
    ("store: role violations by a runner key (resources, cancel, enqueue, another runner's attempt)",
     role_violations),
]  # fmt: skip
PROXY_ATTACKS: list[tuple[str, Attack]] = [
    ("proxy: 500 slow and half-open clients at once (idle, half a header, 10 of 100 body bytes)",
     slow_and_half_open),
    ("proxy: oversized headers (3 x 96 MB header lines)", oversized_headers),
    ("proxy: unauthenticated flood (4500 idle sockets over max_connections + 2000 wrong-key requests)",
     unauthenticated_flood),
    ("proxy: client retries (20 calls x 5 tries with one Idempotency-Key each)", keyed_retries),
    ("proxy: NaN/Infinity in a request's sampling fields", non_finite_request_fields),
]  # fmt: skip
