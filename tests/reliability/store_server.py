"""A StoreServer over a MemoryStore in its own process, so attacks can measure its memory alone.

    python -m tests.reliability.store_server URL_FILE     (admin key from $AGENTLOOP_TEST_STORE_KEY)

Writes its URL to URL_FILE once it accepts connections and serves with the default limits until killed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import anyio

from agentloop.store.memory import MemoryStore
from agentloop.store.server import StoreServer

KEY_ENV = "AGENTLOOP_TEST_STORE_KEY"  # not on the command line: visible to every user in ps


async def main(url_file: Path) -> None:
    async with StoreServer(MemoryStore(), api_key=os.environ[KEY_ENV]) as server:
        url_file.write_text(server.url)
        await anyio.sleep_forever()


if __name__ == "__main__":
    anyio.run(main, Path(sys.argv[1]))
