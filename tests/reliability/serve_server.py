"""`agentloop serve`'s proxy (EchoEngine with a model folder's tokenizer) in its own process, keyed as
one of three setups, for the attacks of tests/reliability/test_attacks_serve.py:

    python -m tests.reliability.serve_server MODE MODEL_DIR URL_FILE     (key K from $AGENTLOOP_TEST_STORE_KEY)

- ``keys``: app keys K and K-b, admin key K-admin, the admin routes over a stand-in trainer;
- ``open``: no key (loopback only), the admin routes off (no admin key), as ``agentloop serve`` without flags;
- ``gate``: the promotion gate's private eval proxy (``trainer.online.gate_proxy``); its key, which
  only the evaluation gets, is written to URL_FILE.key.

The stand-in trainer counts rollbacks; ``GET /v1/admin/versions`` reports them as ``rollbacks``.
Writes its URL to URL_FILE once it accepts connections and serves until killed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import anyio

from agentloop.keys import key_value
from agentloop.proxy.admin import add_admin_routes
from agentloop.proxy.server import Proxy
from agentloop.store.memory import MemoryStore
from tests.proxy.engines import EchoEngine
from tests.reliability.store_server import KEY_ENV


class StandInTrainer:
    """What the admin routes drive, counting the rollbacks that got through."""

    def __init__(self) -> None:
        self.rollbacks: list[int] = []

    def versions(self) -> dict[str, Any]:
        return {
            "current": 0,
            "versions": [{"version": 0}, {"version": 1}],
            "history": [],
            "rollbacks": self.rollbacks,
        }

    async def rollback(self, version: int) -> dict[str, Any]:
        self.rollbacks.append(version)
        return {"current": version}


async def main(mode: str, model_dir: Path, url_file: Path) -> None:
    from transformers import AutoTokenizer

    engine = EchoEngine(AutoTokenizer.from_pretrained(model_dir))
    key = os.environ[KEY_ENV]
    if mode == "keys":
        proxy = Proxy(
            engine, MemoryStore(), api_key=key, app_keys=[key, f"{key}-b"], admin_key=f"{key}-admin"
        )
    elif mode == "open":
        proxy = Proxy(engine, MemoryStore())
    elif mode == "gate":
        from trainer.online import gate_proxy

        proxy = gate_proxy(engine)
        Path(f"{url_file}.key").write_text(key_value(proxy.api_key) or "")
    else:
        raise SystemExit(f"MODE must be keys, open or gate, got {mode!r}")
    if mode != "gate":
        add_admin_routes(proxy.app, StandInTrainer(), proxy.admin_key, bound_host=proxy.host)
    await proxy.start()
    try:
        url_file.write_text(proxy.url)
        await anyio.sleep_forever()
    finally:
        await proxy.stop()


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
