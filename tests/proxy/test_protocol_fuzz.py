"""Malformed Responses and Messages requests of many shapes (seeded random items, tools, blocks, tool
choices: the places Codex CLI and Claude Code bodies vary) are answered with a 4xx in the API's error
shape or served, never a 5xx: a wrong type anywhere is the client's error, not the proxy's."""

from __future__ import annotations

import random
from typing import Any

import anyio
import httpx

from tests.proxy.conftest import running_proxy
from tests.proxy.engines import EchoEngine

VALUES: list[Any] = [None, 0, 5, -1, "", "x", [], {}, [1], [{}], [{"type": "input_text"}], {"a": 1}, True, [None],
                     [{"type": 5}], "<tool_call>", [{"type": "function", "name": "f"}]]  # fmt: skip
ITEM_KEYS = ["type", "role", "content", "call_id", "name", "arguments", "input", "output", "action", "tools",
             "encrypted_content", "id", "namespace", "summary"]  # fmt: skip
ITEM_TYPES: list[Any] = ["message", "function_call", "function_call_output", "custom_tool_call",
                         "custom_tool_call_output", "local_shell_call", "local_shell_call_output", "tool_search_call",
                         "tool_search_output", "reasoning", "item_reference", "web_search_call", "weird", 5, None]  # fmt: skip
TOOL_TYPES: list[Any] = [
    "function",
    "namespace",
    "custom",
    "local_shell",
    "tool_search",
    "web_search",
    "mcp",
    None,
    3,
]
BLOCK_TYPES: list[Any] = ["text", "tool_use", "tool_result", "thinking", "redacted_thinking", "image", "document",
                          "server_tool_use", "weird", None, 4]  # fmt: skip
CHOICES: list[Any] = [*VALUES, {"type": "custom"}, {"type": "allowed_tools", "tools": 5},
                      {"type": "allowed_tools", "tools": [5, {"type": "function"}]}, {"type": "function", "name": 5},
                      {"type": "tool", "name": "t"}, {"type": "any"}]  # fmt: skip


def _some(r: random.Random, keys: list[str], most: int) -> dict[str, Any]:
    return {k: r.choice(VALUES) for k in r.sample(keys, r.randint(0, most))}


def responses_body(r: random.Random) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "input": [{"type": r.choice(ITEM_TYPES), **_some(r, ITEM_KEYS, 6)}
                                                    for _ in range(r.randint(0, 4))]}  # fmt: skip
    if r.random() < 0.5:
        tool_keys = ["name", "tools", "parameters", "description", "format", "execution"]
        body["tools"] = [
            {"type": r.choice(TOOL_TYPES), **_some(r, tool_keys, 4)} for _ in range(r.randint(0, 3))
        ]
    for key, p in (("tool_choice", 0.3), ("previous_response_id", 0.2), ("text", 0.2), ("store", 0.2)):
        if r.random() < p:
            body[key] = r.choice(CHOICES if key == "tool_choice" else VALUES)
    return body


def messages_body(r: random.Random) -> dict[str, Any]:
    keys = ["text", "id", "name", "input", "tool_use_id", "content", "thinking", "signature", "source"]
    messages: list[Any] = [
        {"role": r.choice(["user", "assistant"]),
         "content": r.choice([[{"type": r.choice(BLOCK_TYPES), **_some(r, keys, 4)} for _ in range(3)], "hi", 5])}
        for _ in range(r.randint(1, 3))
    ]  # fmt: skip
    body: dict[str, Any] = {"model": r.choice(["claude-x", "m"]), "max_tokens": 8,
                            "messages": [*messages, {"role": "user", "content": "hi"}]}  # fmt: skip
    if r.random() < 0.4:
        body["tools"] = [{"type": r.choice([None, "custom", "web_search_20250305", 5]), "name": r.choice(["t", "", 5]),
                          "input_schema": r.choice(VALUES)} for _ in range(2)]  # fmt: skip
    for key, p in (("tool_choice", 0.3), ("thinking", 0.3), ("system", 0.3)):
        if r.random() < p:
            body[key] = r.choice(CHOICES if key == "tool_choice" else VALUES)
    return body


async def test_malformed_harness_requests_get_a_4xx_never_a_5xx(tokenizer: Any) -> None:
    r = random.Random(43)
    answers = []
    async with (
        running_proxy(EchoEngine(tokenizer, max_context=4096)) as proxy,
        httpx.AsyncClient(timeout=20) as http,
    ):
        with anyio.fail_after(120):
            for i in range(600):
                path = ("/v1/responses", "/v1/messages", "/v1/messages/count_tokens")[i % 3]
                body = responses_body(r) if i % 3 == 0 else messages_body(r)
                answer = await http.post(proxy.url + path, json=body, headers={"X-Session-Id": "fuzz"})
                answers.append((path, answer.status_code, answer.json()))
    for path, status, body in answers:
        assert status < 500, (path, body)
        if status >= 400:
            message = body["error"]["message"]
            assert message and "internal" not in message, (path, body)
    assert {s for _, s, _ in answers} >= {200, 400}  # some are served, some refused
