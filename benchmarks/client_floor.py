"""The load generator's own floor under ``engine_bench.py --via-proxy``: no proxy, no engine.

The same agents as the proxied rounds (``proxy_agents.py``: N ``openai.AsyncOpenAI`` clients in P
processes, built before the clock, one chat completion each on its own base URL) call an HTTP
server that answers every call at once with one canned chat completion of the proxied rounds' size
(served by W uvicorn processes on uvloop and httptools, as the proxy's workers are). A round's time
is what these clients and HTTP alone add to a burst; a proxied round cannot beat it, so it bounds
what ``proxy_loss`` can reach for a given direct round time::

    python benchmarks/client_floor.py --agents 128 --agent-procs 4 --server-procs 4 --reps 9
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine_bench import AgentProcesses, _agent_messages

from benchmarks import result_file
from trainer.distributed.data_parallel import free_port

_CANNED = orjson.dumps({
    "id": "chatcmpl-floor", "object": "chat.completion", "created": 0, "model": "agentloop",
    "choices": [{"index": 0, "finish_reason": "length", "logprobs": None,
                 "message": {"role": "assistant", "content": "token " * 128}}],
    "usage": {"prompt_tokens": 50, "completion_tokens": 128, "total_tokens": 178},
})  # fmt: skip


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """A bare ASGI app: reads the request body, answers the canned completion."""
    if scope["type"] != "http":
        return
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(_CANNED)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": _CANNED})


async def _wait_listening(port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the canned server did not listen on {port} within {timeout_s} s"
                ) from None
            await asyncio.sleep(0.1)


async def floor(agents: int, agent_procs: int, server_procs: int, reps: int) -> dict[str, Any]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent), *sys.path])}
    server = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "client_floor:app", "--port", str(port), "--workers",
         str(server_procs), "--loop", "uvloop", "--http", "httptools", "--log-level", "warning",
         "--backlog", "4096"],
        env=env,
    )  # fmt: skip
    procs = None
    try:
        await _wait_listening(port)
        procs = await AgentProcesses.start(agent_procs)
        rounds: list[dict[str, float]] = []
        for r in range(reps + 1):  # round 0 warms up
            jobs = [
                {"i": i, "base_url": f"http://127.0.0.1:{port}/rollout/r{r}-{i}/attempt/a/v1",
                 "messages": _agent_messages(f"floor{r}", i)}
                for i in range(agents)
            ]  # fmt: skip
            start, end, done = await procs.round(jobs, 128, 1.0, 1.0)
            assert [d[0] for d in done] == list(range(agents)) and all(d[1] == 128 for d in done)
            if r:
                rounds.append({
                    "round": (end - start) * 1e3,
                    "last_send": (max(d[3] for d in done) - start) * 1e3,
                    "first_received": (min(d[4] for d in done) - start) * 1e3,
                })  # fmt: skip
    finally:
        if procs is not None:
            await procs.close()
        server.terminate()
        server.wait(10)
    return {
        "agents": agents,
        "agent_procs": agent_procs,
        "server_procs": server_procs,
        "rounds": reps,
        "what": f"{agents} openai clients in {agent_procs} processes vs {server_procs} server processes "
        "answering a canned completion at once",
        "median_ms": {k: round(statistics.median(x[k] for x in rounds), 1) for k in rounds[0]},
        "rounds_ms": [round(x["round"], 1) for x in rounds],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=128)
    ap.add_argument("--agent-procs", type=int, default=4)
    ap.add_argument("--server-procs", type=int, default=4)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if min(args.agents, args.agent_procs, args.server_procs, args.reps) < 1:
        raise SystemExit("--agents, --agent-procs, --server-procs and --reps must be >= 1")
    figures = asyncio.run(floor(args.agents, args.agent_procs, args.server_procs, args.reps))
    document = result_file.result(result_file.header("client_floor"), figures)
    print(json.dumps(document, indent=2))
    if args.out:
        result_file.write(args.out, document)


if __name__ == "__main__":
    main()
