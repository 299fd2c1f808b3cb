"""The trainer's serving side in its own process, for the trust attacks (issue 44): a Proxy (EchoEngine with
a model folder's tokenizer) keyed per run, and a StoreServer whose runners dequeue through an
AttemptKeyStore, over one MemoryStore whose resources hold the proxy as the trainer stores it (no key).

    python -m tests.reliability.trust_server MODEL_DIR URL_FILE     (admin key from $AGENTLOOP_TEST_STORE_KEY)

The proxy's key is the admin key + ``PROXY_SUFFIX`` (the test plays the trainer, which holds both).
Writes the store's URL to URL_FILE once both accept connections and serves until killed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import anyio

from agentloop.proxy.attempt_keys import PER_ATTEMPT, AttemptKeyStore
from agentloop.proxy.server import Proxy
from agentloop.resources import Resources
from agentloop.store.memory import MemoryStore
from agentloop.store.server import StoreServer
from tests.proxy.engines import EchoEngine
from tests.reliability.store_server import KEY_ENV

PROXY_SUFFIX = "-proxy"


async def main(model_dir: Path, url_file: Path) -> None:
    from transformers import AutoTokenizer

    key = os.environ[KEY_ENV]
    store = MemoryStore()
    engine = EchoEngine(AutoTokenizer.from_pretrained(model_dir))
    proxy = Proxy(engine, store, api_key=key + PROXY_SUFFIX, record_sessions=False)
    await proxy.start()
    try:
        resource = proxy.as_resource().model_copy(update={"api_key": PER_ATTEMPT})
        await store.add_resources(Resources(items={"main_llm": resource}))
        async with StoreServer(AttemptKeyStore(store, proxy), api_key=key) as server:  # type: ignore[arg-type]
            url_file.write_text(server.url)
            await anyio.sleep_forever()
    finally:
        await proxy.stop()


if __name__ == "__main__":
    anyio.run(main, Path(sys.argv[1]), Path(sys.argv[2]))
