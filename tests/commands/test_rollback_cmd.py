"""`agentloop rollback` sends the server's admin key (issue 44, finding 4): with it the rollback is
done; without it, or with an app key, the server refuses and the command says why in one line; a
server started without an admin key has its admin routes off.

Real components: the rollback command against a real Proxy (echo engine) on a loopback port with the
real admin routes over a stand-in for the online trainer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest

from agentloop.cli import UsageError, build_parser
from agentloop.proxy.admin import add_admin_routes
from agentloop.proxy.server import Proxy
from agentloop.store.memory import MemoryStore
from tests.proxy.engines import EchoEngine

APP, ADMIN = "rollback-app-key", "rollback-admin-key"


class Control:
    def __init__(self) -> None:
        self.rollbacks: list[int] = []

    def versions(self) -> dict[str, Any]:
        return {"current": 1, "versions": [{"version": 0}, {"version": 1}], "history": []}

    async def rollback(self, version: int) -> dict[str, Any]:
        self.rollbacks.append(version)
        return {"current": version}


def _printed(capsys: pytest.CaptureFixture[str]) -> Any:
    out = capsys.readouterr().out  # the server's log lines too: the command prints indented JSON
    return json.loads(out[out.index("{\n") :])


async def _rollback(*argv: str) -> int:
    args = build_parser().parse_args(["rollback", *argv])
    return await anyio.to_thread.run_sync(args.func, args)  # a blocking httpx client, as from a shell


async def test_rollback_sends_the_admin_key(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "admin.key").write_text(ADMIN + "\n")
    (tmp_path / "app.key").write_text(APP + "\n")
    monkeypatch.delenv("AGENTLOOP_ADMIN_KEY", raising=False)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    control = Control()
    async with Proxy(EchoEngine(tokenizer), MemoryStore(), api_key=APP, admin_key=ADMIN) as proxy:
        add_admin_routes(proxy.app, control, proxy.admin_key, bound_host=proxy.host)
        url = ["--url", proxy.url]
        with anyio.fail_after(60):
            assert await _rollback(*url, "--to", "0", "--admin-key-file", str(tmp_path / "admin.key")) == 0
            assert _printed(capsys) == {"current": 0}
            monkeypatch.setenv("AGENTLOOP_ADMIN_KEY", ADMIN)
            assert await _rollback(*url, "--list") == 0
            assert _printed(capsys)["current"] == 1
            monkeypatch.delenv("AGENTLOOP_ADMIN_KEY")
            with pytest.raises(UsageError, match="answered 401: missing or wrong admin key"):
                await _rollback(*url, "--to", "0")
            with pytest.raises(UsageError, match="answered 401"):  # an app key is not the admin key
                await _rollback(*url, "--to", "0", "--admin-key-file", str(tmp_path / "app.key"))
    assert control.rollbacks == [0]
    async with Proxy(EchoEngine(tokenizer), MemoryStore(), api_key=APP) as proxy:  # no admin key
        add_admin_routes(proxy.app, control, proxy.admin_key, bound_host=proxy.host)
        with anyio.fail_after(60), pytest.raises(UsageError, match="answered 403: the admin routes are off"):
            await _rollback("--url", proxy.url, "--to", "0", "--admin-key", f"file:{tmp_path / 'app.key'}")
    assert control.rollbacks == [0]
