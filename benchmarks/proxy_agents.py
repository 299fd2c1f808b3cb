"""Agents of ``engine_bench.py --via-proxy --agent-procs P``, in a process of their own.

``engine_bench.py`` starts P of these, as real agents run in runner processes outside the proxy's.
Each keeps one event loop for the whole run and imports only the standard library, ``openai`` and
``agentloop.event_loop`` (no torch). One JSON object a line on stdin and stdout, parent to worker /
worker to parent::

    {"agents": [{"i", "base_url", "messages"}], "max_tokens", "temperature", "top_p"}
                                                   -> builds one AsyncOpenAI per agent  -> {"ready": k}
    {"cmd": "go"}                                  -> all agents at once, one chat completion each
                                                   -> {"start", "end", "results": [[i, completion_tokens,
                                                       finish_reason, sent, received], ...]}
    {"cmd": "quit"} or end of input                -> exits

The loop is uvloop where it is installed (agentloop.event_loop), asyncio's own with
``AGENTLOOP_UVLOOP=0`` in the environment (it is inherited from engine_bench.py's process).
Times are ``time.time()`` (one clock for every process of the host): ``start`` when "go" is read,
``end`` when the last response is parsed, ``sent`` / ``received`` around each agent's call.
Any failure answers ``{"error": traceback}`` in place of the expected line. stdout carries the
protocol only; logs and tracebacks go to stderr.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import sys
import time
import traceback
from typing import Any

import openai

TLS = ssl.create_default_context()  # one for all clients (building one per client costs ~20 ms)


def send(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def recv() -> dict[str, Any] | None:
    line = sys.stdin.readline()  # blocking, while nothing else runs on this process's loop
    return json.loads(line) if line else None


async def one_round(job: dict[str, Any]) -> None:
    clients = [
        openai.AsyncOpenAI(
            base_url=a["base_url"], api_key="EMPTY", max_retries=0,
            http_client=openai.DefaultAsyncHttpxClient(verify=TLS, timeout=600.0),
        )
        for a in job["agents"]
    ]  # fmt: skip
    try:
        send({"ready": len(clients)})
        go = recv()
        if go != {"cmd": "go"}:
            raise RuntimeError(f'expected {{"cmd": "go"}} after "ready", got {go!r}')

        async def agent(client: openai.AsyncOpenAI, a: dict[str, Any]) -> list[Any]:
            sent = time.time()
            r = await client.chat.completions.create(
                model="agentloop", messages=a["messages"], max_tokens=job["max_tokens"],
                temperature=job["temperature"], top_p=job["top_p"],
            )  # fmt: skip
            received = time.time()
            assert r.usage is not None, "the proxy's response has no usage"
            return [a["i"], r.usage.completion_tokens, str(r.choices[0].finish_reason), sent, received]

        start = time.time()
        results = await asyncio.gather(*[agent(c, a) for c, a in zip(clients, job["agents"], strict=True)])
        end = time.time()
        send({"start": start, "end": end, "results": results})
    finally:
        for c in clients:
            await c.close()


async def main() -> None:
    while (job := recv()) is not None and job.get("cmd") != "quit":
        try:
            await one_round(job)
        except Exception:
            send({"error": traceback.format_exc()})


if __name__ == "__main__":
    from agentloop import event_loop  # light: anyio, no torch

    event_loop.run(main)  # uvloop where installed; AGENTLOOP_UVLOOP=0: asyncio's own loop
