"""Run by tests/proxy/test_open_files.py in a subprocess: waves of agents that never close their
openai clients, against the real proxy, under a low soft limit on open files and no cyclic GC (as
between two rare full collections). Prints one JSON line per wave: how many requests failed."""

from __future__ import annotations

import asyncio
import gc
import json
import resource
import sys

import openai
from transformers import AutoTokenizer

import agentloop.http_server as server
from agentloop.engine.models import smollm2_tokenizer_dir
from agentloop.store.memory import MemoryStore
from tests.proxy.conftest import attempt_url, new_attempt, running_proxy
from tests.proxy.engines import EchoEngine


async def main(limit: int, waves: int, agents: int, raise_limit: bool) -> None:
    if not raise_limit:
        server.raise_open_file_limit = lambda: -1  # the proxy before it raised the limit
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    gc.disable()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())
    store = MemoryStore()
    async with running_proxy(EchoEngine(tokenizer, reply=lambda p, s: "hi"), store) as proxy:
        kept: list[openai.AsyncOpenAI] = []

        async def agent(url: str) -> None:
            client = openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0, timeout=4)
            kept.append(client)  # never closed
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )

        for wave in range(waves):
            urls = [attempt_url(proxy, await new_attempt(store)) for _ in range(agents)]
            results = await asyncio.gather(*[agent(u) for u in urls], return_exceptions=True)
            failed = [type(r).__name__ for r in results if isinstance(r, BaseException)]
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            print(
                json.dumps({"wave": wave, "failed": len(failed), "kinds": sorted(set(failed)), "soft": soft})
            )
            sys.stdout.flush()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "raise"))
