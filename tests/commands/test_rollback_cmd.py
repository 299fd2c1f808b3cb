"""`agentloop rollback` sends the server's admin key (issue 44, finding 4): with it the rollback is
done; without it, or with an app key, the server refuses and the command says why in one line; a
server started without an admin key has its admin routes off.

Real components: the rollback command against a real Proxy (echo engine) on a loopback port with the
real admin routes over a stand-in for the online trainer.
"""

from __future__ import annotations

import json
import time
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
        t = 1_790_000_000.0
        return {
            "current": 1,
            "versions": [{"version": 0, "score": 0.5, "step": 0, "time": t},
                         {"version": 1, "score": 0.625, "step": 2, "time": t + 60}],
            "history": [
                {"time": t, "kind": "baseline", "version": 0, "score": 0.5},
                {"time": t + 30, "kind": "refused", "step": 1, "score": 0.1, "baseline": 0.5, "margin": 0.05,
                 "serving": 0},
                {"time": t + 60, "kind": "promoted", "version": 1, "step": 2, "score": 0.625, "baseline": 0.5,
                 "margin": 0.05},
            ],
            "updates": 2, "updates_failed": 0, "sessions_trained": 8, "sessions_dropped_untrained": 1,
        }  # fmt: skip

    async def rollback(self, version: int) -> dict[str, Any]:
        self.rollbacks.append(version)
        return {"current": version, "from": 1}


def _printed(capsys: pytest.CaptureFixture[str]) -> Any:
    out = capsys.readouterr().out  # the server's log lines too: --json prints indented JSON
    return json.loads(out[out.index("{\n") :])


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


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
        url = ["--url", proxy.session_base_url]  # the banner's base URL (.../v1) works as the address
        with anyio.fail_after(60):
            assert await _rollback(*url, "--to", "0", "--admin-key-file", str(tmp_path / "admin.key")) == 0
            assert "serving version 0 (was 1)\n" in capsys.readouterr().out
            monkeypatch.setenv("AGENTLOOP_ADMIN_KEY", ADMIN)
            assert await _rollback(*url, "--list", "--json") == 0
            assert _printed(capsys)["current"] == 1
            assert await _rollback("--url", proxy.url + "/", "--list") == 0  # a human table
            out = capsys.readouterr().out
            t = 1_790_000_000.0
            table = [
                "serving version 1; 2 updates (0 failed), 8 sessions trained on, 1 dropped untrained",
                "  version   score  update  promoted at",
                f"        0   0.500       -  {_when(t)}",
                f"*       1   0.625       2  {_when(t + 60)}",
                "log:",
                f"  {_when(t)}  baseline  version 0 scored 0.500",
                f"  {_when(t + 30)}  refused   update 1 refused: score 0.100 below best 0.500 - margin 0.05; "
                "version 0 kept",
                f"  {_when(t + 60)}  promoted  update 2 became version 1: score 0.625 (best so far 0.500, margin 0.05)",
            ]
            assert "\n".join(table) + "\n" in out, out
            assert "{" not in out.split(table[0])[1]  # no raw JSON
            with pytest.raises(UsageError, match="--url must be an http"):
                await _rollback("--url", "127.0.0.1:8000", "--list")
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
