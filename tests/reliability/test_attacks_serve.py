"""`agentloop serve` holds under the attacks of issue 44 (findings 4, 5 and 7), each run against the
proxy in its own process (tests/reliability/serve_server.py) while a legitimate app keeps working
(``measure``: answered within 2 s, memory bounded, its sessions read back intact):

4. another app key reads, rewards and writes into an app's sessions, lists them, and calls the admin
   routes (versions, rollback): every request refused (404 on the sessions, 401 on the admin routes),
   the sessions unchanged, no rollback done;
5. a web page against a server without a key: ``text/plain`` and form POSTs (rollback, chat,
   reward), a rebound ``Host``, a cross-origin and a cross-site request: every one refused (415, 403),
   the admin routes off;
7. a local process without the key asks the promotion gate's private eval proxy: 401 on every route.

One row each in the reliability report's attacks table (``record("attack", ...)``).
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.reliability.attacks import Context, ProxyTarget, _server_process, measure
from tests.reliability.report import record

pytestmark = pytest.mark.e2e  # each test runs a server process

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
JSON = {"content-type": "application/json"}


@asynccontextmanager
async def serve_process(tmp: Path, model_dir: Path, mode: str) -> AsyncIterator[ProxyTarget]:
    """The serve proxy keyed as ``mode`` (serve_server.py) in a child process; its target's key is the
    legitimate app's (the gate's own key for ``gate``)."""
    module, args = "tests.reliability.serve_server", [mode, str(model_dir)]
    async with _server_process("serve", module, args, tmp, 120) as (url, pid, key):
        if mode == "gate":
            (key_file,) = tmp.glob("serve-*.url.key")
            key = key_file.read_text()
        yield ProxyTarget(url, pid, key)


async def _try(
    ctx: Context,
    http: httpx.AsyncClient,
    what: str,
    method: str,
    path: str,
    body: Any,
    headers: dict[str, str],
) -> None:
    """One hostile request; anything but a 4xx is a hostile write the server took."""
    content = body if isinstance(body, bytes) or body is None else orjson.dumps(body)
    resp = await http.request(method, f"{ctx.target.url}{path}", content=content, headers=headers)
    ctx.statuses[str(resp.status_code)] += 1
    if not 400 <= resp.status_code < 500:
        ctx.accepted.append(f"{what}: {resp.status_code} {resp.text[:100]}")


async def _new_session(http: httpx.AsyncClient, url: str, key: str | None) -> str:
    sid = f"victim-{secrets.token_hex(4)}"
    auth = {"authorization": f"Bearer {key}"} if key else {}
    resp = await http.post(f"{url}/v1/chat/completions", json=CHAT, headers={**auth, "x-session-id": sid})
    resp.raise_for_status()
    return sid


async def _untouched(ctx: Context, http: httpx.AsyncClient, sid: str, key: str | None) -> None:
    """The victim's session as its app left it: one call, no reward."""
    auth = {"authorization": f"Bearer {key}"} if key else {}
    resp = await http.get(f"{ctx.target.url}/v1/sessions/{sid}", headers=auth)
    session = resp.json() if resp.status_code == 200 else {}
    if len(session.get("calls", [])) != 1 or session.get("rewards"):
        ctx.accepted.append(f"session {sid} changed: {resp.status_code} {resp.text[:100]}")


async def another_apps_sessions(ctx: Context, victims: int = 3, rounds: int = 3) -> int:
    """App key B against app A's sessions (read, reward, write, list) and the admin routes."""
    app_a, app_b, admin = ctx.target.key, f"{ctx.target.key}-b", f"{ctx.target.key}-admin"
    hostile = {"authorization": f"Bearer {app_b}"}
    tried = 0
    async with httpx.AsyncClient(timeout=30) as http:
        sids = [await _new_session(http, ctx.target.url, app_a) for _ in range(victims)]
        for _ in range(rounds):
            for sid in sids:
                for what, method, path, body, extra in [
                    ("read another app's session", "GET", f"/v1/sessions/{sid}", None, {}),
                    ("reward another app's session", "POST", f"/v1/sessions/{sid}/reward", {"value": 1e6}, JSON),
                    ("write into another app's session", "POST", "/v1/chat/completions", CHAT,
                     {**JSON, "x-session-id": sid}),
                    ("versions with an app key", "GET", "/v1/admin/versions", None, {}),
                    ("rollback with an app key", "POST", "/v1/admin/rollback", {"version": 1}, JSON),
                ]:  # fmt: skip
                    await _try(ctx, http, what, method, path, body, {**hostile, **extra})
                    tried += 1
            listed = (await http.get(f"{ctx.target.url}/v1/sessions", headers=hostile)).json()
            seen = {s["session_id"] for s in listed.get("data", [])} & set(sids)
            ctx.accepted += [f"another app key lists {len(seen)} of the app's sessions"] if seen else []
            tried += 1
        await ctx.hold()
        for sid in sids:
            await _untouched(ctx, http, sid, app_a)
        versions = await http.get(
            f"{ctx.target.url}/v1/admin/versions", headers={"authorization": f"Bearer {admin}"}
        )
        if versions.status_code != 200 or versions.json()["rollbacks"]:
            ctx.accepted.append(f"rollbacks done: {versions.status_code} {versions.text[:100]}")
    return tried


# the per-attempt routes, keyless too where serve has no key: no rollout lives in serve's store, so a web page
# gets 404 before anything is generated or recorded
ATTEMPT = "/rollout/ro-page/attempt/at-page/v1"


async def web_page_requests(ctx: Context, rounds: int = 5) -> int:
    """What a web page can send to a loopback server without a key: simple (no-preflight) POSTs, a
    rebound Host (DNS rebinding), cross-origin and cross-site requests."""
    port = ctx.target.port
    tried = 0
    async with httpx.AsyncClient(timeout=30) as http:
        sid = await _new_session(http, ctx.target.url, None)
        evil = {"host": f"evil.example:{port}"}
        chat = orjson.dumps(CHAT)
        cases: list[tuple[str, str, str, Any, dict[str, str]]] = [
            ("text/plain rollback", "POST", "/v1/admin/rollback", b'{"version": 1}', {"content-type": "text/plain"}),
            ("text/plain chat", "POST", "/v1/chat/completions", chat, {"content-type": "text/plain", "x-session-id": sid}),
            ("text/plain reward", "POST", f"/v1/sessions/{sid}/reward", b'{"value": 1e6}', {"content-type": "text/plain"}),
            ("form reward", "POST", f"/v1/sessions/{sid}/reward", b'{"value": 1e6}',
             {"content-type": "application/x-www-form-urlencoded"}),
            ("rebound Host: list", "GET", "/v1/sessions", None, evil),
            ("rebound Host: read", "GET", f"/v1/sessions/{sid}", None, evil),
            ("rebound Host: reward", "POST", f"/v1/sessions/{sid}/reward", b'{"value": 1e6}', {**evil, **JSON}),
            ("rebound Host: rollback", "POST", "/v1/admin/rollback", b'{"version": 1}', {**evil, **JSON}),
            ("cross-origin reward", "POST", f"/v1/sessions/{sid}/reward", b'{"value": 1e6}',
             {"origin": "http://evil.example", **JSON}),
            ("cross-origin chat", "POST", "/v1/chat/completions", chat,
             {"origin": "http://evil.example", "x-session-id": sid, **JSON}),
            ("cross-site list", "GET", "/v1/sessions", None, {"sec-fetch-site": "cross-site"}),
            ("JSON rollback, no admin key", "POST", "/v1/admin/rollback", b'{"version": 1}', JSON),
            ("text/plain per-attempt chat", "POST", f"{ATTEMPT}/chat/completions", chat, {"content-type": "text/plain"}),
            ("rebound Host: per-attempt chat", "POST", f"{ATTEMPT}/chat/completions", chat, {**evil, **JSON}),
            ("cross-origin per-attempt chat", "POST", f"{ATTEMPT}/chat/completions", chat,
             {"origin": "http://evil.example", **JSON}),
        ]  # fmt: skip
        for _ in range(rounds):
            for what, method, path, body, headers in cases:
                await _try(ctx, http, what, method, path, body, headers)
                tried += 1
        await ctx.hold()
        await _untouched(ctx, http, sid, None)
    return tried


async def gate_without_its_key(ctx: Context, rounds: int = 5) -> int:
    """A local process asks the gate's eval proxy (the candidate weights) without its key."""
    tried = 0
    async with httpx.AsyncClient(timeout=30) as http:
        for _ in range(rounds):
            for auth in (
                {},
                {"authorization": "Bearer guess"},
                {"authorization": f"Bearer {ctx.target.key[:-1]}"},
            ):
                for what, method, path, body in [
                    ("models", "GET", "/v1/models", None),
                    ("chat", "POST", "/v1/chat/completions", CHAT),
                    ("completions", "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                    ("sessions", "GET", "/v1/sessions", None),
                ]:
                    await _try(
                        ctx, http, f"{what} without the gate's key", method, path, body, {**auth, **JSON}
                    )
                    tried += 1
        await ctx.hold()
    return tried


SERVE_ATTACKS = [
    ("keys", "serve: another app key reads, rewards, writes and lists an app's sessions, calls the admin routes",
     another_apps_sessions),
    ("open", "serve without a key: a web page's text/plain and form POSTs, rebound Host, cross-origin/cross-site "
     "requests (rollback, chat, reward)", web_page_requests),
    ("gate", "serve --train: requests without the key to the promotion gate's eval proxy", gate_without_its_key),
]  # fmt: skip


@pytest.mark.parametrize(
    ("mode", "name", "attack"), SERVE_ATTACKS, ids=[a.__name__ for *_, a in SERVE_ATTACKS]
)
async def test_serve_holds(tmp_path: Path, tiny_model_dir: Path, mode: str, name: str, attack: Any) -> None:
    async with serve_process(tmp_path, tiny_model_dir, mode) as target:
        row, detail = await measure(target, name, attack)
    record("attack", **row, detail=detail)  # the row has worst_legit_ms and memory_growth_mb
    assert row["held"] and row["lost"] == 0, detail
