"""Issue 44, finding 7: the promotion gate's private eval proxy (the candidate weights, on loopback)
has a random key of its own: a local process without it is refused (401) on every route, the
evaluation's client (given the key) is answered.

Real components: the gate's own proxy factory around an echo engine with the real tokenizer, on a
loopback port.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import httpx

from agentloop.keys import key_value
from tests.proxy.engines import EchoEngine
from trainer.online import gate_proxy

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def test_the_gate_proxy_answers_only_the_evaluation(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    first = gate_proxy(EchoEngine(AutoTokenizer.from_pretrained(tiny_model_dir)))
    key = key_value(first.api_key)
    assert key and len(key) >= 32 and key != key_value(gate_proxy(first.engine).api_key)  # random per proxy
    async with first as proxy, httpx.AsyncClient(timeout=20) as http:
        v1 = proxy.session_base_url
        with anyio.fail_after(60):
            stranger = [
                (await http.get(f"{v1}/models")).status_code,
                (await http.post(f"{v1}/chat/completions", json=CHAT)).status_code,
                (await http.get(f"{v1}/sessions")).status_code,
                (
                    await http.post(
                        f"{v1}/chat/completions", json=CHAT, headers={"Authorization": "Bearer x"}
                    )
                ).status_code,
            ]
            evaluation = await http.post(
                f"{v1}/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {key}"}
            )
    assert stranger == [401, 401, 401, 401]
    assert evaluation.status_code == 200 and proxy.host == "127.0.0.1"
