"""Store throughput: rollout lifecycles per second for each backend and concurrency.

One lifecycle: enqueue -> dequeue -> 3 spans -> update_attempt(succeeded) -> wait_for_rollouts.
Backends: memory, sqlite (a temp file, synchronous=FULL), http (a StoreServer in a child process
in front of a MemoryStore or SQLiteStore; the workers use a StoreClient). Prints JSON.

    python benchmarks/store_bench.py [--workers 1 32 256] [--out benchmarks/results/store_bench.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentloop.store import MemoryStore, SQLiteStore, StoreClient, StoreServer
from agentloop.store.base import Store
from agentloop.types import Reward, Span
from benchmarks import result_file

LIFECYCLES = {"memory": 4000, "sqlite": 2000, "http-memory": 600, "http-sqlite": 600}


def peak_rss_mb(who: int = resource.RUSAGE_SELF) -> float:
    return resource.getrusage(who).ru_maxrss / 1024  # Linux reports KiB


async def lifecycles(store: Store, workers: int, total: int) -> float:
    """Run ``total`` lifecycles on ``workers`` concurrent tasks; returns lifecycles per second."""
    per_worker = max(1, total // workers)

    async def worker(i: int) -> None:
        for _ in range(per_worker):
            rollout = await store.enqueue_rollout({"task": i})
            attempted = await store.dequeue_rollout(f"w{i}")
            assert attempted is not None
            aid = attempted.attempt.attempt_id
            for step in range(3):
                await store.add_span(
                    Span(rollout_id=attempted.rollout_id, attempt_id=aid, payload=Reward(value=step))
                )
            await store.update_attempt(attempted.rollout_id, aid, status="succeeded")
            done = await store.wait_for_rollouts([rollout.rollout_id], timeout=30)
            assert len(done) == 1

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(workers):
            tg.start_soon(worker, i)
    return per_worker * workers / (time.perf_counter() - start)


async def serve(kind: str, port_file: str) -> None:
    """Child process: serve a store until stdin closes."""
    backend: Store = MemoryStore() if kind == "memory" else SQLiteStore(Path(port_file).with_suffix(".db"))
    async with StoreServer(backend) as server:
        Path(port_file).write_text(server.url)
        await anyio.to_thread.run_sync(sys.stdin.read)
    await backend.close()


async def bench_http(kind: str, workers: int, total: int) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        port_file = os.path.join(tmp, "url")
        cmd = [sys.executable, __file__, "--serve", kind, port_file]
        child = subprocess.Popen(cmd, stdin=subprocess.PIPE)
        try:
            while not os.path.exists(port_file) or not Path(port_file).read_text():
                await anyio.sleep(0.05)
            client = StoreClient(Path(port_file).read_text(), max_connections=max(8, workers))
            rate = await lifecycles(client, workers, total)
            await client.close()
        finally:
            assert child.stdin is not None
            child.stdin.close()
            child.wait(timeout=30)
    return rate, peak_rss_mb(resource.RUSAGE_CHILDREN)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    load_at_start = os.getloadavg()  # the 2 cores are shared: figures drop as the load average rises
    results: dict[str, Any] = {}
    for backend in args.backends:
        for workers in args.workers:
            total = max(workers, LIFECYCLES[backend] // (1 if workers > 1 else 4))
            server_rss = None
            if backend == "memory":
                rate = await lifecycles(MemoryStore(), workers, total)
            elif backend == "sqlite":
                with tempfile.TemporaryDirectory() as tmp:
                    store = SQLiteStore(Path(tmp) / "bench.db")
                    rate = await lifecycles(store, workers, total)
                    await store.close()
            else:
                rate, server_rss = await bench_http(backend.split("-", 1)[1], workers, total)
            entry = {
                "lifecycles_per_s": round(rate, 1),
                "lifecycles": total,
                "peak_rss_mb": round(peak_rss_mb(), 1),
            }
            if server_rss is not None:
                entry["server_peak_rss_mb"] = round(server_rss, 1)
            results.setdefault(backend, {})[str(workers)] = entry
            print(json.dumps({"backend": backend, "workers": workers, **entry}), file=sys.stderr)
    # the figures `agentloop bench` checks: lifecycles/s by backend and workers (http: over SQLite)
    names = {"memory": "memory", "sqlite": "sqlite", "http-sqlite": "http"}
    throughput = {
        names[b]: {w: e["lifecycles_per_s"] for w, e in by_workers.items()}
        for b, by_workers in results.items()
        if b in names
    }
    return {
        "what": "store lifecycles: enqueue -> dequeue -> 3 spans -> succeed -> wait",
        "load_average_at_start": load_at_start,
        "load_average_at_end": os.getloadavg(),
        "python": platform.python_version(),
        "sqlite": "WAL, group commit (a call returns after its commit); fsync (FULL) on commits holding an enqueue or a finished rollout, NORMAL for dequeue/spans/heartbeats",
        "http": "StoreServer (uvicorn + httptools, hand-routed ASGI, orjson) in a child process; StoreClient (lean keep-alive HTTP/1.1 pool, agentloop/store/_wire.py) in this one",
        "targets_at_32_workers": {"memory": 2000, "sqlite": 500, "http": 300},
        "throughput": throughput,
        "results": results,
    }


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--serve":
        anyio.run(serve, sys.argv[2], sys.argv[3])
        sys.exit(0)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--backends", nargs="+", default=list(LIFECYCLES), choices=list(LIFECYCLES))
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()
    head = result_file.header("store_bench", gpu=None)
    document = result_file.result(head, anyio.run(main, args))
    print(json.dumps(document, indent=2))
    if args.out is not None:
        result_file.write(args.out, document)
