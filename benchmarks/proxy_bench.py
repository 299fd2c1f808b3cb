"""Proxy overhead: latency the proxy adds over a direct engine call, and the most requests/s.

The engine is an instant stub (fixed tokens, returned at once), so every microsecond measured is
the proxy's: HTTP parsing, validation, chat templating + token ledger, the liveness check and the
LLMCall span written to a MemoryStore, and the JSON response. Requests go to the rollout route
(the training path); half of them are second turns that take the delta-tokenization path.

The proxy runs in this process; the load generator runs in a separate process and speaks raw
HTTP/1.1 over keep-alive sockets, so its own CPU stays small next to the proxy's (an httpx or
openai client costs more per request than the proxy itself on a 2-core machine).

    python benchmarks/proxy_bench.py            # prints JSON, writes benchmarks/results/proxy_bench.json

``--burst N`` measures what engine_bench --via-proxy sees on a GPU (N agents, one chat completion
each, all at once) without one: N first-turn requests at one moment, each on a new connection, a
SQLite store (``--store``), and a barrier engine that answers all N once all have arrived. It reports
the proxy process's CPU per request (process, event-loop thread, store writer thread, GC) and
send -> engine, engine -> received. ``--profile FILE`` adds a cProfile of the event-loop thread.
benchmarks/results/proxy_cpu_profile.json holds the paired A/B of uvloop and one store read per liveness
check; issue 20's before/after figures are in benchmarks/NOTES.md.

    python benchmarks/proxy_bench.py --burst 128 --rounds 8     # writes benchmarks/results/proxy_burst_cpu.json

The proxy runs on uvloop where it is installed (agentloop.event_loop); ``--no-uvloop`` (or
``AGENTLOOP_UVLOOP=0``) puts it on asyncio's own loop, for an A/B. The load generator is on asyncio's.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import result_file

REPLY = "Hello! How can I help you today?"
RESULTS = Path(__file__).parent / "results" / "proxy_bench.json"
BURST_RESULTS = RESULTS.with_name("proxy_burst_cpu.json")


# ---------------------------------------------------------------- the load generator (child process)


def _request(path: str, body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    return head.encode() + data


async def _roundtrip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, req: bytes) -> int:
    writer.write(req)
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length = 0
    for line in head.split(b"\r\n"):
        if line[:15].lower() == b"content-length:":
            length = int(line[15:])
    await reader.readexactly(length)
    return status


def _conversation(prefix: str, i: int) -> list[bytes]:
    """Two requests of one conversation: a first turn, and a second turn that extends it."""
    first = [{"role": "user", "content": f"Question number {i}: what is {i} + {i}?"}]
    second = [
        *first,
        {"role": "assistant", "content": REPLY},
        {"role": "user", "content": "Thanks, and times two?"},
    ]
    path = f"{prefix}/chat/completions"
    return [
        _request(path, {"model": "m", "messages": m, "max_tokens": 32, "seed": i}) for m in (first, second)
    ]


async def _client(args: dict[str, Any]) -> dict[str, Any]:
    host, port, prefixes = args["host"], args["port"], args["prefixes"]
    out: dict[str, Any] = {}
    # sequential latency on one keep-alive connection
    reader, writer = await asyncio.open_connection(host, port)
    health = b"GET /health HTTP/1.1\r\nHost: bench\r\n\r\n"
    base = []
    for _ in range(args["latency_requests"]):
        t = time.perf_counter()
        await _roundtrip(reader, writer, health)
        base.append(time.perf_counter() - t)
    lat = []
    for i in range(args["latency_requests"]):
        for req in _conversation(prefixes[i % len(prefixes)], i):
            t = time.perf_counter()
            status = await _roundtrip(reader, writer, req)
            lat.append(time.perf_counter() - t)
            assert status == 200, status
    writer.close()
    out["health_latency_s"], out["chat_latency_s"] = base, lat

    # throughput: `c` connections, each sending conversations back to back for `seconds`
    out["throughput"] = {}
    for c in args["concurrency"]:
        done, errors = 0, 0
        deadline = time.perf_counter() + args["seconds"]

        async def worker(w: int, c: int, deadline: float) -> None:
            nonlocal done, errors
            r, wr = await asyncio.open_connection(host, port)
            i = w
            while time.perf_counter() < deadline:
                for req in _conversation(prefixes[i % len(prefixes)], i):
                    if await _roundtrip(r, wr, req) == 200:
                        done += 1
                    else:
                        errors += 1
                i += c
            wr.close()

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(w, c, deadline) for w in range(c)))
        elapsed = time.perf_counter() - t0
        out["throughput"][str(c)] = {
            "requests": done,
            "errors": errors,
            "seconds": elapsed,
            "rps": done / elapsed,
        }
    return out


# ---------------------------------------------------------------- the proxy side (this process)


class InstantEngine:
    """Returns the same tokens at once: the proxy's overhead is all that is left to measure."""

    def __init__(self, tokenizer: Any) -> None:
        from agentloop.engine.base import TokenOutput

        self.tokenizer = tokenizer
        ids = [*tokenizer.encode(REPLY, add_special_tokens=False), tokenizer.eos_token_id]
        self._out = TokenOutput(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop")
        self.max_context, self.weights_version = 8192, 0

    async def generate(self, prompt_ids: list[int], sampling: Any, request_id: str | None = None) -> Any:
        return self._out

    async def abort(self, request_id: str) -> bool:
        return False

    async def update_weights(self, named_tensors: Any) -> int:
        raise NotImplementedError

    def stats(self) -> dict[str, Any]:
        return {}

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _direct_engine_latency(engine: InstantEngine, n: int) -> list[float]:
    from agentloop.engine.base import SamplingParams

    prompt = engine.tokenizer.encode("Question number 1: what is 1 + 1?", add_special_tokens=False)
    sp = SamplingParams(max_tokens=32, seed=1)
    out = []
    for _ in range(n):
        t = time.perf_counter()
        await engine.generate(prompt, sp)
        out.append(time.perf_counter() - t)
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from agentloop.engine.models import smollm2_tokenizer_dir
    from agentloop.proxy.server import Proxy
    from agentloop.store.memory import MemoryStore

    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())
    engine, store = InstantEngine(tokenizer), MemoryStore()
    load_before = round(os.getloadavg()[0], 2)  # other work on the machine lowers the figures
    prefixes = []
    for i in range(args.attempts):
        await store.enqueue_rollout({"i": i})
        att = await store.dequeue_rollout("bench")
        assert att is not None
        prefixes.append(f"/rollout/{att.rollout_id}/attempt/{att.attempt.attempt_id}/v1")
    direct = await _direct_engine_latency(engine, 2000)
    async with Proxy(engine, store) as proxy:
        client_args = {
            "host": "127.0.0.1", "port": proxy.port, "prefixes": prefixes, "latency_requests": args.latency_requests,
            "concurrency": args.concurrency, "seconds": args.seconds,
        }  # fmt: skip
        child = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--client", json.dumps(client_args), stdout=subprocess.PIPE
        )
        stdout, _ = await child.communicate()
        if child.returncode != 0:
            raise RuntimeError(f"load generator failed with exit code {child.returncode}")
    res = json.loads(stdout)
    spans = 0
    for p in prefixes:
        spans += len(await store.query_spans(p.split("/")[2]))
    lat, base = res["chat_latency_s"], res["health_latency_s"]
    direct_p50 = statistics.median(direct)
    best = max(res["throughput"].items(), key=lambda kv: kv[1]["rps"])
    ms = 1000.0
    return {
        "load_average_1m_at_start": load_before,
        "engine": "instant stub (fixed tokens, no compute)",
        "http_parser": "httptools"
        if importlib.util.find_spec("httptools")
        else "h11 (pip install httptools: faster)",
        "route": "/rollout/{rid}/attempt/{aid}/v1/chat/completions (non-streaming), MemoryStore, 2-turn conversations",
        "direct_engine_p50_ms": direct_p50 * ms,
        "proxy_request_p50_ms": statistics.median(lat) * ms,
        "proxy_request_p99_ms": _pct(lat, 0.99) * ms,
        "added_latency_p50_ms": (statistics.median(lat) - direct_p50) * ms,
        "added_latency_p99_ms": (_pct(lat, 0.99) - direct_p50) * ms,
        "http_floor_p50_ms": statistics.median(base) * ms,
        "throughput_rps_by_concurrency": {k: round(v["rps"], 1) for k, v in res["throughput"].items()},
        "errors": sum(v["errors"] for v in res["throughput"].values()),
        "max_rps": round(best[1]["rps"], 1),
        "max_rps_concurrency": int(best[0]),
        "spans_recorded": spans,
        "requests_sent": len(lat) + sum(v["requests"] + v["errors"] for v in res["throughput"].values()),
        "targets": {"added_latency_p50_ms": 2.0, "max_rps": 500},
    }


# ---------------------------------------------------------------- --burst: N requests at one moment
#
# What engine_bench --via-proxy measures on a GPU (128 agents, one chat completion each, all sent at
# once), without the GPU: a barrier engine holds every generate until all N have arrived, then answers
# them all at once, as a batch that finishes together. Before the barrier is the proxy's admission
# work (HTTP, validation, liveness check, templating), after it the answering (decode, LLMCall span
# in the store, JSON response). The proxy's CPU is read per round (process, its event-loop thread,
# the SQLite store's writer thread); --profile adds a cProfile of the event-loop thread.


def _burst_messages(tag: str, i: int) -> list[dict[str, str]]:
    """Agent ``i``'s one user message (42-58 prompt tokens, as engine_bench's agents)."""
    q = f"What is {i} plus {i * 7}? Show the steps." + " Please answer carefully." * (i % 4)
    return [{"role": "user", "content": f"[{tag}-{i}] {q}"}]


async def _read_response(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line[:15].lower() == b"content-length:":
            length = int(line[15:])
    await reader.readexactly(length)
    return int(head[9:12])


async def _burst_client() -> None:
    """One round per stdin line ``{"host", "ports", "tag", "prefixes", "max_tokens"}`` (a port per request): print
    ``{"ready"}``, wait for a "go" line, then every request at once, each on a connection of its own
    opened then (as an openai client connects on its first request); print ``{"sent", "received",
    "status"}`` (``time.time()`` per request)."""
    loop = asyncio.get_running_loop()

    async def line() -> Any:
        text = await loop.run_in_executor(None, sys.stdin.readline)
        return json.loads(text) if text.strip() else None

    while (job := await line()) is not None:
        reqs = [
            (port, _request(f"{p}/chat/completions", {"model": "m", "messages": _burst_messages(job["tag"], i),
                     "max_tokens": job["max_tokens"], "temperature": 1.0, "top_p": 1.0}))
            for i, (p, port) in enumerate(zip(job["prefixes"], job["ports"], strict=True))
        ]  # fmt: skip
        print(json.dumps({"ready": len(reqs)}), flush=True)
        await line()  # "go"

        async def call(port: int, req: bytes) -> tuple[float, int, float]:
            sent = time.time()
            reader, writer = await asyncio.open_connection(job["host"], port)
            writer.write(req)
            status = await _read_response(reader)
            received = time.time()
            writer.close()
            return sent, status, received

        got = await asyncio.gather(*(call(port, r) for port, r in reqs))
        print(json.dumps({"sent": [g[0] for g in got], "status": [g[1] for g in got],
                          "received": [g[2] for g in got]}), flush=True)  # fmt: skip


class BarrierEngine(InstantEngine):
    """Holds each generate until ``n`` are waiting, then answers all (``response_tokens`` random ids
    with log-probs, finish ``length``); records when each routing key called and when each batch went."""

    def __init__(self, tokenizer: Any, n: int, response_tokens: int) -> None:
        import random

        from agentloop.engine.base import TokenOutput

        super().__init__(tokenizer)
        rng = random.Random(0)
        ids = [rng.randrange(100, len(tokenizer) - 100) for _ in range(response_tokens)]
        self._out = TokenOutput(token_ids=ids, logprobs=[-2.5] * len(ids), finish_reason="length")
        self.n, self._waiting, self._event = n, 0, asyncio.Event()
        self.called: dict[str, float] = {}  # routing key ("rollout/attempt") -> time.time() of the call
        self.released: list[float] = []

    async def generate(self, prompt_ids: list[int], sampling: Any, request_id: str | None = None) -> Any:
        self.called[(request_id or "").rpartition("/req-")[0]] = time.time()
        event = self._event
        self._waiting += 1
        if self._waiting >= self.n:
            self._waiting, self._event = 0, asyncio.Event()
            self.released.append(time.time())
            event.set()
        else:
            await asyncio.wait_for(event.wait(), 60)
        return self._out


class _GcClock:
    """Seconds spent in garbage collections of each generation (of any thread) while installed."""

    def __init__(self) -> None:
        self.seconds, self._t0 = [0.0, 0.0, 0.0], 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds[info["generation"]] += time.perf_counter() - self._t0


class _CpuClocks:
    """CPU seconds of this process, of the calling (event-loop) thread and of one other thread."""

    def __init__(self, other: Any) -> None:
        self._other = time.pthread_getcpuclockid(other.ident) if other is not None else None

    def read(self) -> tuple[float, float, float]:
        other = time.clock_gettime(self._other) if self._other is not None else 0.0
        return time.process_time(), time.thread_time(), other


async def run_burst(args: argparse.Namespace) -> dict[str, Any]:
    import cProfile
    import tempfile

    from transformers import AutoTokenizer

    from agentloop.engine.models import smollm2_tokenizer_dir
    from agentloop.proxy.server import Proxy
    from agentloop.store.memory import MemoryStore
    from agentloop.store.sqlite import SQLiteStore
    from agentloop.types import AttemptStatus

    n, tmp = args.burst, tempfile.TemporaryDirectory(prefix="proxy-burst-")
    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())
    engine = BarrierEngine(tokenizer, n, args.response_tokens)
    store: Any = SQLiteStore(Path(tmp.name) / "store.db") if args.store == "sqlite" else MemoryStore()
    clocks = _CpuClocks(getattr(store, "_worker", None))
    profile = cProfile.Profile() if args.profile else None
    child = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--burst-client", stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert child.stdin is not None and child.stdout is not None
    load_before = round(os.getloadavg()[0], 2)
    gc_clock = _GcClock()
    if args.gc_threshold:
        gc.set_threshold(*args.gc_threshold)
    gc.callbacks.append(gc_clock)
    rows: list[dict[str, float]] = []
    rounds: list[dict[str, float]] = []
    try:
        async with Proxy(
            engine, store, default_max_tokens=args.response_tokens, workers=args.workers
        ) as proxy:
            resource = proxy.as_resource()
            workers = [w.pid for w in getattr(proxy._workers, "_procs", [])]
            for r in range(args.rounds + 1):  # round 0 warms up, untimed
                attempts = []
                for i in range(n):
                    await store.enqueue_rollout({"i": i, "round": r})
                    attempts.append(await store.dequeue_rollout("bench"))
                keys = [f"{a.rollout_id}/{a.attempt.attempt_id}" for a in attempts]
                urls = [
                    urlsplit(resource.get_base_url(*k.split("/"))) for k in keys
                ]  # a worker's, with workers
                job = {"host": "127.0.0.1", "ports": [u.port for u in urls], "tag": f"r{r}",
                       "max_tokens": args.response_tokens, "prefixes": [u.path for u in urls]}  # fmt: skip
                child.stdin.write(json.dumps(job).encode() + b"\n")
                assert "ready" in json.loads(await child.stdout.readline())
                before, gc_before, workers_before = clocks.read(), list(gc_clock.seconds), _cpu_s(workers)
                if profile is not None and r > 0:
                    profile.enable()
                child.stdin.write(b'"go"\n')
                res = json.loads(await child.stdout.readline())
                if profile is not None:
                    profile.disable()
                after, workers_after = clocks.read(), _cpu_s(workers)
                assert res["status"] == [200] * n, f"round {r}: statuses {sorted(set(res['status']))}"
                for a in attempts:
                    await store.update_attempt(
                        a.rollout_id, a.attempt.attempt_id, status=AttemptStatus.SUCCEEDED
                    )
                if r == 0:
                    continue
                released = engine.released[-1]
                called = [engine.called.pop(k) for k in keys]
                for sent, got, call in zip(res["sent"], res["received"], called, strict=True):
                    rows.append(
                        {"to_engine": call - sent, "from_engine": got - released, "client": got - sent}
                    )
                process, loop, writer = (b - a for a, b in zip(before, after, strict=True))
                gc_s = [b - a for a, b in zip(gc_before, gc_clock.seconds, strict=True)]
                rounds.append({
                    "process_cpu_ms_per_request": process / n * 1e3,
                    "loop_thread_cpu_ms_per_request": loop / n * 1e3,
                    "store_thread_cpu_ms_per_request": writer / n * 1e3,
                    "gc_ms_per_request": sum(gc_s) / n * 1e3,
                    "worker_processes_cpu_ms_per_request": (workers_after - workers_before) / n * 1e3,
                    "gc_gen_ms": [round(x * 1e3, 2) for x in gc_s],
                    "admission_spread_ms": (max(called) - min(called)) * 1e3,
                    "first_sent_to_last_received_ms": (max(res["received"]) - min(res["sent"])) * 1e3,
                })  # fmt: skip
            spans = sum([len(await store.query_spans(k.split("/")[0])) for k in keys])
    finally:
        gc.callbacks.remove(gc_clock)
        child.stdin.close()
        await child.wait()
        await store.close()
        tmp.cleanup()

    def med(xs: list[float]) -> float:
        return round(statistics.median(xs), 3)

    result: dict[str, Any] = {
        "load_average_1m_at_start": load_before,
        "workload": {
            "requests_per_burst": n,
            "rounds": args.rounds,
            "store": args.store,
            "response_tokens": args.response_tokens,
            "route": "/rollout/{rid}/attempt/{aid}/v1/chat/completions",
            "request": "one first-turn chat completion per attempt, all at once, each on a new connection",
            "proxy_workers": args.workers,  # > 0: "process" is the engine's process, the workers' CPU apart
            "engine": "barrier stub: every generate waits until all of the burst's have arrived, then all answer",
        },
        "per_request_cpu_ms": {
            k.removesuffix("_per_request").removesuffix("_cpu_ms"): med([x[k] for x in rounds])
            for k in rounds[0]
            if k.endswith("cpu_ms_per_request")
        },
        "latency_ms_median": {
            "send_to_engine": med([x["to_engine"] * 1e3 for x in rows]),
            "engine_to_received": med([x["from_engine"] * 1e3 for x in rows]),
            "client": med([x["client"] * 1e3 for x in rows]),
            "admission_spread": med([x["admission_spread_ms"] for x in rounds]),
            "first_sent_to_last_received": med([x["first_sent_to_last_received_ms"] for x in rounds]),
        },
        "gc_ms_per_request_median": med([x["gc_ms_per_request"] for x in rounds]),
        "gc_threshold": list(gc.get_threshold()),
        "latency_ms_max": {
            "send_to_engine": round(max(x["to_engine"] for x in rows) * 1e3, 3),
            "engine_to_received": round(max(x["from_engine"] for x in rows) * 1e3, 3),
        },
        "rounds": rounds,
        "spans_recorded_last_round": spans,
    }
    if profile is not None:
        import pstats

        profile.dump_stats(args.profile)
        stats = pstats.Stats(profile)
        result["profile_cumulative_ms_per_request"] = _phases(stats, n * args.rounds)
    return result


# the proxy's phases as functions of the event-loop thread (cumulative time under cProfile, which
# roughly doubles it: compare phases with each other, not with the unprofiled CPU figures)
PHASES = {
    "http_parse_and_dispatch (uvicorn)": ("httptools_impl.py", "data_received"),
    "read_json": ("routes.py", "read_json"),
    "parse_model (pydantic request)": ("schemas.py", "parse_model"),
    "check_live (store reads)": ("service.py", "check_live"),
    "ledger.plan (template + tokens)": ("ledger.py", "plan"),
    "sampling": ("service.py", "sampling"),
    "_text (decode)": ("service.py", "_text"),
    "record (LLMCall + add_span)": ("service.py", "record"),
    "ledger.record": ("ledger.py", "record"),
    "chat_json (response)": ("responses.py", "chat_json"),
    "response write (uvicorn send)": ("httptools_impl.py", "send"),
}


def _cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of the processes ``pids`` so far (Linux /proc; 0 elsewhere or for none)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / os.sysconf("SC_CLK_TCK")


def _phases(stats: Any, requests: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, (file, func) in PHASES.items():
        total = sum(v[3] for (f, _, fn), v in stats.stats.items() if f.endswith(file) and fn == func)
        out[name] = round(total / requests * 1e3, 4)
    out["total_loop_thread"] = round(stats.total_tt / requests * 1e3, 4)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--client", help=argparse.SUPPRESS)
    parser.add_argument("--attempts", type=int, default=64, help="rollout attempts the requests spread over")
    parser.add_argument(
        "--latency-requests", type=int, default=500, help="sequential conversations (2 requests each)"
    )
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=[8, 32, 128], help="connections per run"
    )
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each throughput run")
    parser.add_argument("--out", type=Path, help=f"default {RESULTS} ({BURST_RESULTS} with --burst)")
    parser.add_argument("--burst", type=int, default=0, help="N requests at one moment (see run_burst)")
    parser.add_argument("--burst-client", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=10, help="--burst: timed bursts")
    parser.add_argument("--store", choices=["sqlite", "memory"], default="sqlite", help="--burst: the store")
    parser.add_argument("--response-tokens", type=int, default=128, help="--burst: tokens per answer")
    parser.add_argument("--gc-threshold", type=int, nargs=3, help="--burst: gc.set_threshold for the run")
    parser.add_argument("--profile", help="--burst: write a cProfile of the event-loop thread here")
    parser.add_argument(
        "--workers", type=int, default=0, help="--burst: Proxy(workers=N) (needs --store sqlite)"
    )
    parser.add_argument(
        "--no-uvloop",
        action="store_true",
        help="the proxy on asyncio's own loop even where uvloop is installed",
    )
    args = parser.parse_args()
    # the load generator stays on asyncio's loop either way: only the proxy's loop changes in an A/B
    if args.burst_client:
        asyncio.run(_burst_client())
        return
    if args.client:
        print(json.dumps(asyncio.run(_client(json.loads(args.client)))))
        return
    import structlog

    from agentloop import event_loop

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))  # warnings and up
    use_uvloop = False if args.no_uvloop else None  # None: uvloop where installed, unless $AGENTLOOP_UVLOOP=0
    result = event_loop.run(run_burst if args.burst else run, args, use_uvloop=use_uvloop)
    result["event_loop"] = event_loop.loop_name(use_uvloop)
    head = result_file.header(
        "proxy_bench --burst" if args.burst else "proxy_bench",
        gpu=None,  # the stub engine computes nothing: the proxy's CPU is what is measured
        python=platform.python_version(),
        platform=platform.platform(),
    )
    document = result_file.result(head, result)
    print(json.dumps(document, indent=2))
    result_file.write(args.out or (BURST_RESULTS if args.burst else RESULTS), document)


if __name__ == "__main__":
    main()
