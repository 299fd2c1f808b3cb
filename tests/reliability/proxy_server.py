"""A Proxy (EchoEngine with a model folder's tokenizer, MemoryStore) in its own process, for attacks
that measure its memory alone.

    python -m tests.reliability.proxy_server MODEL_DIR URL_FILE     (key from $AGENTLOOP_TEST_STORE_KEY)

Writes its URL to URL_FILE once it accepts connections and serves with the default limits until killed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import anyio

from agentloop.proxy.server import Proxy
from agentloop.store.memory import MemoryStore
from tests.proxy.engines import EchoEngine
from tests.reliability.store_server import KEY_ENV


async def main(model_dir: Path, url_file: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    proxy = Proxy(EchoEngine(tokenizer), MemoryStore(), api_key=os.environ[KEY_ENV], record_sessions=False)
    await proxy.start()
    try:
        url_file.write_text(proxy.url)
        await anyio.sleep_forever()
    finally:
        await proxy.stop()


if __name__ == "__main__":
    anyio.run(main, Path(sys.argv[1]), Path(sys.argv[2]))
