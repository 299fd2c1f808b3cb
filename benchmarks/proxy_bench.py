"""Proxy overhead: latency the proxy adds over a direct engine call, and the most requests/s.

The engine is an instant stub (fixed tokens, returned at once), so every microsecond measured is
the proxy's: HTTP parsing, validation, chat templating + token ledger, the liveness check and the
LLMCall span written to a MemoryStore, and the JSON response. Requests go to the rollout route
(the training path); half of them are second turns that take the delta-tokenization path.

The proxy runs in this process; the load generator runs in a separate process and speaks raw
HTTP/1.1 over keep-alive sockets, so its own CPU stays small next to the proxy's (an httpx or
openai client costs more per request than the proxy itself on a 2-core machine).

    python benchmarks/proxy_bench.py            # prints JSON, writes benchmarks/results/proxy_bench.json
"""

from __future__ import annotations

import argparse
import asyncio
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

REPLY = "Hello! How can I help you today?"
RESULTS = Path(__file__).parent / "results" / "proxy_bench.json"


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
        "benchmark": "proxy_bench",
        "machine": {
            "cpu_count": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "load_average_1m_at_start": load_before,
        },
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
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.client:
        print(json.dumps(asyncio.run(_client(json.loads(args.client)))))
        return
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))  # warnings and up
    result = asyncio.run(run(args))
    text = json.dumps(result, indent=2)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
