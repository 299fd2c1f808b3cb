"""Issue 44, findings 4 and 5: who may use `agentloop serve`'s app-facing routes.

4. App keys own their sessions: another app key gets 404 on a session it did not create (read,
   reward, write into it), never sees it listed, and cannot reach the admin routes; the admin key sees
   every session and is the only key the admin routes take; the owners survive a restart.
5. A web page cannot use a server without a key on loopback: a ``text/plain`` POST (what a page sends
   without a CORS preflight) is 415, a foreign ``Host`` (DNS rebinding) and another ``Origin`` are 403,
   and the admin routes are off (403) without an admin key.

Real components: a real Proxy on a loopback port (echo engine, real tokenizer) over a real SQLite
store, the real admin routes over a stand-in for the online trainer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from agentloop.proxy.access import AppKeys, owner_id
from agentloop.proxy.admin import add_admin_routes
from agentloop.proxy.server import Proxy
from agentloop.proxy.sessions import read_saved_sessions
from agentloop.store.sqlite import SQLiteStore
from tests.proxy.engines import EchoEngine

APP_A, APP_B, ADMIN = "app-key-aaaa", "app-key-bbbb", "admin-key-cccc"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


class Control:
    """Stands in for the online trainer behind the admin routes; counts rollbacks."""

    def __init__(self) -> None:
        self.rollbacks: list[int] = []

    def versions(self) -> dict[str, Any]:
        return {"current": 0, "versions": [{"version": 0}, {"version": 1}], "history": []}

    async def rollback(self, version: int) -> dict[str, Any]:
        self.rollbacks.append(version)
        return {"current": version}


async def test_app_keys_own_their_sessions_and_only_the_admin_sees_all(
    tokenizer: Any, tmp_path: Path
) -> None:
    store = SQLiteStore(tmp_path / "serve.db")
    keys = {"api_key": APP_A, "app_keys": [APP_A, APP_B], "admin_key": ADMIN}
    control = Control()
    try:
        proxy = Proxy(EchoEngine(tokenizer), store, **keys)
        add_admin_routes(proxy.app, control, proxy.admin_key, bound_host=proxy.host)
        async with proxy, httpx.AsyncClient(timeout=20) as http:
            v1 = proxy.session_base_url
            with anyio.fail_after(60):
                for key, sid in ((APP_A, "mine"), (APP_B, "theirs")):
                    ok = await http.post(
                        f"{v1}/chat/completions", json=CHAT, headers={**bearer(key), "X-Session-Id": sid}
                    )
                    assert ok.status_code == 200, ok.text
                # B attacks A's session: read it, reward it, write into it, see it listed
                read = await http.get(f"{v1}/sessions/mine", headers=bearer(APP_B))
                reward = await http.post(
                    f"{v1}/sessions/mine/reward", json={"value": 9.0}, headers=bearer(APP_B)
                )
                write = await http.post(
                    f"{v1}/chat/completions", json=CHAT, headers={**bearer(APP_B), "X-Session-Id": "mine"}
                )
                listed_b = (await http.get(f"{v1}/sessions", headers=bearer(APP_B))).json()["data"]
                unknown = await http.get(f"{v1}/sessions/never-made", headers=bearer(APP_B))
                # ... and the admin routes
                b_versions = await http.get(f"{proxy.url}/v1/admin/versions", headers=bearer(APP_B))
                b_rollback = await http.post(
                    f"{proxy.url}/v1/admin/rollback", json={"version": 0}, headers=bearer(APP_B)
                )
                # A and the admin
                own = await http.get(f"{v1}/sessions/mine", headers=bearer(APP_A))
                rewarded = await http.post(
                    f"{v1}/sessions/mine/reward", json={"value": 1.0}, headers=bearer(APP_A)
                )
                listed_admin = (await http.get(f"{v1}/sessions", headers=bearer(ADMIN))).json()["data"]
                admin_reads = await http.get(f"{v1}/sessions/theirs", headers=bearer(ADMIN))
                admin_versions = await http.get(f"{proxy.url}/v1/admin/versions", headers=bearer(ADMIN))
                admin_rollback = await http.post(
                    f"{proxy.url}/v1/admin/rollback", json={"version": 1}, headers=bearer(ADMIN)
                )
                nobody = await http.get(f"{v1}/sessions", headers=bearer("a-guess"))
        for refused in (read, reward, write):
            assert refused.status_code == 404, refused.text
            assert refused.json()["error"]["type"] == "not_found_error"
        assert read.json()["error"]["message"] == "session 'mine' not found"  # as for one never made:
        assert unknown.json()["error"]["message"] == "session 'never-made' not found"
        assert [s["session_id"] for s in listed_b] == ["theirs"]
        assert b_versions.status_code == 401 and b_rollback.status_code == 401
        assert own.status_code == 200 and len(own.json()["calls"]) == 1  # B's call did not land in it
        assert rewarded.status_code == 200 and [r["value"] for r in rewarded.json()["rewards"]] == [1.0]
        assert sorted(s["session_id"] for s in listed_admin) == ["mine", "theirs"]
        assert admin_reads.status_code == 200
        assert admin_versions.status_code == 200 and admin_rollback.json() == {"current": 1}
        assert control.rollbacks == [1]  # only the admin's
        assert nobody.status_code == 401
        # the owners are saved with the sessions (fingerprints, not keys) and hold after a restart
        saved = b"".join(f.read_bytes() for f in tmp_path.glob("serve.db*"))  # the file and its WAL
        assert owner_id(APP_A).encode() in saved and owner_id(APP_B).encode() in saved
        assert not any(key.encode() in saved for key in (APP_A, APP_B, ADMIN))
        async with (
            Proxy(EchoEngine(tokenizer), store, **keys) as again,
            httpx.AsyncClient(timeout=20) as http,
        ):
            assert (
                await http.get(f"{again.session_base_url}/sessions/mine", headers=bearer(APP_B))
            ).status_code == 404
            assert (
                await http.get(f"{again.session_base_url}/sessions/mine", headers=bearer(APP_A))
            ).status_code == 200
    finally:
        await store.close()


async def test_one_key_as_before_and_the_admin_routes_off_without_an_admin_key(
    tokenizer: Any, tmp_path: Path
) -> None:
    """The setup before admin keys (one --api-key) keeps working: that key is the app key; without an
    admin key the admin routes answer 403, with any key."""
    control = Control()
    proxy = Proxy(EchoEngine(tokenizer), SQLiteStore(tmp_path / "serve.db"), api_key=APP_A)
    add_admin_routes(proxy.app, control, proxy.admin_key, bound_host=proxy.host)
    try:
        async with proxy, httpx.AsyncClient(timeout=20, headers=bearer(APP_A)) as http:
            ok = await http.post(
                f"{proxy.session_base_url}/chat/completions", json=CHAT, headers={"X-Session-Id": "s"}
            )
            listed = (await http.get(f"{proxy.session_base_url}/sessions")).json()["data"]
            off = await http.post(f"{proxy.url}/v1/admin/rollback", json={"version": 0})
    finally:
        await proxy.store.close()
    assert ok.status_code == 200 and [s["session_id"] for s in listed] == ["s"]
    assert off.status_code == 403 and off.json()["error"]["code"] == "admin_off"
    assert "--admin-key-file" in off.json()["error"]["message"] and control.rollbacks == []


async def test_a_web_page_cannot_use_a_loopback_server_without_a_key(tokenizer: Any, tmp_path: Path) -> None:
    control = Control()
    proxy = Proxy(EchoEngine(tokenizer), SQLiteStore(tmp_path / "serve.db"))  # no key: loopback only
    add_admin_routes(proxy.app, control, None, bound_host=proxy.host)
    try:
        async with proxy, httpx.AsyncClient(timeout=20) as http:
            v1, url, port = proxy.session_base_url, proxy.url, proxy.port
            ok = await http.post(f"{v1}/chat/completions", json=CHAT, headers={"X-Session-Id": "legit"})
            assert ok.status_code == 200
            plain = {"Content-Type": "text/plain"}
            body = b'{"version": 0}'
            # what a page sends without a preflight: text/plain POSTs
            page_rollback = await http.post(f"{url}/v1/admin/rollback", content=body, headers=plain)
            page_chat = await http.post(f"{v1}/chat/completions", content=str(CHAT).encode(), headers=plain)
            page_reward = await http.post(
                f"{v1}/sessions/legit/reward", content=b'{"value": 5}', headers=plain
            )
            # DNS rebinding: the page's own name, pointed at 127.0.0.1, in Host
            rebound = {"Host": f"evil.example:{port}"}
            rebound_list = await http.get(f"{v1}/sessions", headers=rebound)
            rebound_read = await http.get(f"{v1}/sessions/legit", headers=rebound)
            rebound_chat = await http.post(f"{v1}/chat/completions", json=CHAT, headers=rebound)
            # a cross-origin fetch (JSON after a preflight the server never grants, or a browser that sends it)
            cross = await http.post(
                f"{v1}/sessions/legit/reward", json={"value": 5}, headers={"Origin": "http://evil.example"}
            )
            null_origin = await http.get(f"{v1}/sessions", headers={"Origin": "null"})
            cross_site = await http.get(f"{v1}/sessions", headers={"Sec-Fetch-Site": "cross-site"})
            # legitimate local names and the server's own origin
            names = [f"localhost:{port}", f"127.0.0.1:{port}", f"app.localhost:{port}", f"127.0.0.2:{port}"]
            local = [(await http.get(f"{v1}/sessions", headers={"Host": h})).status_code for h in names]
            same_origin = await http.post(
                f"{v1}/chat/completions",
                json=CHAT,
                headers={"Origin": f"http://127.0.0.1:{port}", "Sec-Fetch-Site": "same-origin"},
            )
            json_with_charset = await http.post(
                f"{v1}/chat/completions",
                content=b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}',
                headers={"Content-Type": "application/json; charset=utf-8"},
            )
            admin_json = await http.post(f"{url}/v1/admin/rollback", json={"version": 0})
            session = (await http.get(f"{v1}/sessions/legit")).json()
    finally:
        await proxy.store.close()
    assert [r.status_code for r in (page_chat, page_reward)] == [415, 415]
    assert page_chat.json()["error"]["code"] == "unsupported_media_type"
    assert page_rollback.status_code == 403 and admin_json.status_code == 403  # off: no admin key
    assert control.rollbacks == []
    for refused in (rebound_list, rebound_read, rebound_chat):
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "forbidden_host"
        assert "legit" not in refused.text
    for refused in (cross, null_origin, cross_site):
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "cross_origin"
    assert local == [200, 200, 200, 200]
    assert same_origin.status_code == 200 and json_with_charset.status_code == 200
    assert session["rewards"] == [] and len(session["calls"]) == 1  # nothing the page sent landed


def test_app_keys_refuse_an_admin_key_equal_to_an_app_key() -> None:
    with pytest.raises(ValueError, match="must differ"):
        AppKeys([APP_A, APP_B], APP_B)
    assert "key" not in repr(AppKeys([APP_A], ADMIN)).replace("app_keys", "")


async def test_sessions_without_an_owner_go_to_the_one_app_key(tokenizer: Any, tmp_path: Path) -> None:
    """Sessions saved without an owner (a keyless server, or one from before owners) are adopted by the
    app key when there is exactly one (a server that gains its first key keeps its apps' sessions);
    with several app keys they are the admin's alone."""
    for keys, reader, owner_of_old in [
        ({"app_keys": [APP_A, APP_B], "admin_key": ADMIN}, APP_A, None),  # several keys: nobody's
        ({"api_key": APP_A}, APP_A, APP_A),  # one key, as before: the app's
    ]:
        store = SQLiteStore(tmp_path / f"{len(keys)}.db")
        try:
            async with Proxy(EchoEngine(tokenizer), store) as keyless, httpx.AsyncClient(timeout=20) as http:
                made = await http.post(
                    f"{keyless.session_base_url}/chat/completions", json=CHAT, headers={"X-Session-Id": "old"}
                )
                assert made.status_code == 200
            async with (
                Proxy(EchoEngine(tokenizer), store, **keys) as proxy,
                httpx.AsyncClient(timeout=20) as http,
            ):
                read = await http.get(f"{proxy.session_base_url}/sessions/old", headers=bearer(reader))
                admin = await http.get(f"{proxy.session_base_url}/sessions/old", headers=bearer(ADMIN))
            assert read.status_code == (200 if owner_of_old else 404)
            assert admin.status_code == (200 if "admin_key" in keys else 401)
            _, saved = read_saved_sessions(store.path)  # the adoption is saved too
            assert [s.owner for s in saved] == [owner_id(owner_of_old) if owner_of_old else ""]
        finally:
            await store.close()
