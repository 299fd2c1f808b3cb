"""A proxy bound to every interface hands out an address clients can call, not 0.0.0.0."""

from __future__ import annotations

from typing import Any

import anyio
import httpx

from agentloop.proxy.server import machine_address
from agentloop.store.memory import MemoryStore
from tests.proxy.conftest import running_proxy
from tests.proxy.engines import EchoEngine

KEY = "k" * 40


async def test_a_wildcard_bind_advertises_this_machines_address(tokenizer: Any) -> None:
    async with running_proxy(EchoEngine(tokenizer), MemoryStore(), host="0.0.0.0", api_key=KEY) as proxy:
        assert "0.0.0.0" not in proxy.url and "0.0.0.0" not in proxy.as_resource().url_template
        assert proxy.advertise_host == machine_address()
        with anyio.fail_after(10):  # the advertised URL answers
            async with httpx.AsyncClient() as client:
                resp = await client.get(f"{proxy.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        assert resp.status_code == 200


async def test_an_advertised_host_goes_into_every_url(tokenizer: Any) -> None:
    proxy_args = {"host": "0.0.0.0", "api_key": KEY, "advertise_host": "gateway.example"}
    async with running_proxy(EchoEngine(tokenizer), MemoryStore(), **proxy_args) as proxy:
        assert proxy.url == f"http://gateway.example:{proxy.port}"
        assert proxy.as_resource().url_template.startswith(f"http://gateway.example:{proxy.port}/rollout/")
    async with running_proxy(EchoEngine(tokenizer), MemoryStore()) as local:  # loopback: unchanged
        assert local.url == f"http://127.0.0.1:{local.port}"
