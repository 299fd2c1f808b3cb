"""Hermes-style tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` -> OpenAI tool_calls.

All or nothing: when any call in the output is malformed (bad JSON, no name, an unclosed tag),
the whole output stays as text content, the proxy logs "failed to decode tool call" (at debug: the
trainer counts them per step, ``rollout/tool_call_parse_errors``) and flags the span
(``LLMCall.tool_call_parse_error``); the reward function then scores the text.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class ParsedOutput:
    """Model text split into content and OpenAI tool calls."""

    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None  # why the tool calls could not be decoded


def new_tool_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _decode_call(body: str) -> dict[str, Any]:
    obj = json.loads(body)
    if not isinstance(obj, dict):
        raise ValueError(f"a tool call must be a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"a tool call needs a non-empty string 'name', got {name!r:.60}")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = json.loads(args)  # some models emit the arguments as a JSON string
    if not isinstance(args, dict):
        raise ValueError(f"tool call arguments must be a JSON object, got {type(args).__name__}")
    return {
        "id": new_tool_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
    }


def parse_tool_calls(text: str) -> ParsedOutput:
    """Split ``text`` into content and tool calls; text without ``<tool_call>`` is all content."""
    if _OPEN not in text:
        return ParsedOutput(content=text)
    calls = []
    try:
        for match in _CALL.finditer(text):
            calls.append(_decode_call(match.group(1).strip()))
        rest = _CALL.sub("", text)
        if _OPEN in rest or _CLOSE in rest:
            raise ValueError("unbalanced <tool_call> tags")
    except ValueError as exc:  # json.JSONDecodeError is a ValueError
        return ParsedOutput(content=text, error=f"{type(exc).__name__}: {exc}"[:300])
    content = rest.strip()
    return ParsedOutput(content=content or None, tool_calls=calls)
