"""Responses tools as chat functions and the model's calls as the items Codex CLI dispatches on
(responses_tools.py), checked on the tools Codex CLI 0.169.0 really sent (tests/proxy/data)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agentloop.proxy.reasoning import encode_reasoning, raw_reasoning, reasoning_text, split_reasoning
from agentloop.proxy.responses_tools import (
    ToolMap,
    call_item,
    chat_call,
    custom_input,
    shell_action,
    tool_choice,
)
from agentloop.proxy.schemas import ProxyError

CODEX = json.loads((Path(__file__).parent / "data" / "codex_0_169_requests.json").read_text())


def _call(name: str, arguments: Any) -> dict[str, Any]:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": "call_abc", "type": "function", "function": {"name": name, "arguments": text}}


def _names(tools: ToolMap) -> list[str]:
    return [f["function"]["name"] for f in tools.functions]


def test_codex_tools_become_functions_and_hosted_ones_are_left_out() -> None:
    fallback = ToolMap.build(CODEX["fallback"]["tools"])
    assert "multi_agent_v1__close_agent" in _names(fallback) and "exec_command" in _names(fallback)
    assert fallback.ref("multi_agent_v1__spawn_agent").namespace == "multi_agent_v1"
    assert fallback.dropped == ["web_search"]
    known = ToolMap.build(CODEX["gpt-5.5"]["tools"])
    patch = next(f["function"] for f in known.functions if f["function"]["name"] == "apply_patch")
    assert patch["parameters"]["required"] == ["input"] and "*** Begin Patch" in patch["description"]
    search = next(f["function"] for f in known.functions if f["function"]["name"] == "tool_search")
    assert search["parameters"]["required"] == ["query"]
    assert known.ref("apply_patch").kind == "custom" and known.ref("tool_search").kind == "tool_search"
    assert known.dropped == ["web_search"] and "web_search" not in _names(known)


def test_each_kind_of_call_is_answered_as_its_item_and_comes_back_exactly() -> None:
    tools = ToolMap.build(
        [*CODEX["fallback"]["tools"], *CODEX["gpt-5.5"]["tools"][3:4], {"type": "local_shell"}]
        + [t for t in CODEX["gpt-5.5"]["tools"] if t["type"] == "tool_search"]
    )
    remembered: dict[str, tuple[Any, str]] = {}

    def memory(call_id: str, view: Any) -> str | None:
        found = remembered.get(call_id)
        return found[1] if found and found[0] == view else None

    cases = [
        ("multi_agent_v1__close_agent", '{"target": "a1"}', "function_call"),
        ("apply_patch", '{"input": "*** Begin Patch\\n*** End Patch\\n"}', "custom_tool_call"),
        ("apply_patch", '{"patch": "raw text"}', "custom_tool_call"),  # one string argument: that string
        ("local_shell", '{"command": "ls -la", "workdir": "/w"}', "local_shell_call"),
        ("tool_search", '{"query": "calendar", "limit": 2}', "tool_search_call"),
    ]
    for name, arguments, kind in cases:
        call = _call(name, arguments)
        item, view = call_item(call, tools.ref(name))
        assert item["type"] == kind and item["call_id"] == "call_abc"
        remembered[call["id"]] = (view, arguments)
        back = chat_call(json.loads(json.dumps(item)), memory)  # as it travels: JSON
        assert back["function"] == {"name": name, "arguments": arguments}
    item, _ = call_item(_call("multi_agent_v1__close_agent", "{}"), tools.ref("multi_agent_v1__close_agent"))
    assert (item["namespace"], item["name"]) == ("multi_agent_v1", "close_agent")
    shell, _ = call_item(_call("local_shell", '{"command": "ls -la"}'), tools.ref("local_shell"))
    assert shell["action"]["command"] == ["bash", "-lc", "ls -la"] and shell["action"]["type"] == "exec"
    # an item the client changed is rebuilt from what it says
    edited = chat_call(
        {"type": "custom_tool_call", "call_id": "call_abc", "name": "apply_patch", "input": "x"}, memory
    )
    assert json.loads(edited["function"]["arguments"]) == {"input": "x"}


def test_custom_input_and_shell_action_take_what_the_model_wrote() -> None:
    assert custom_input('{"input": "a"}') == "a" and custom_input('{"text": "b"}') == "b"
    assert custom_input('{"a": 1, "b": 2}') == '{"a": 1, "b": 2}' and custom_input("not json") == "not json"
    assert shell_action('{"command": ["ls"], "timeout_ms": 5}')["timeout_ms"] == 5
    assert shell_action('{"command": 7}')["command"] == ["bash", "-lc", '{"command": 7}']


def test_tool_choice_maps_or_says_what_it_cannot_force() -> None:
    tools = ToolMap.build(CODEX["gpt-5.5"]["tools"])
    assert tool_choice("required", tools) == "required"
    assert tool_choice({"type": "custom", "name": "apply_patch"}, tools) == {
        "type": "function",
        "function": {"name": "apply_patch"},
    }
    assert tool_choice({"type": "function", "name": "close_agent", "namespace": "multi_agent_v1"}, tools) == {
        "type": "function",
        "function": {"name": "multi_agent_v1__close_agent"},
    }
    allowed = {
        "type": "allowed_tools",
        "mode": "required",
        "tools": [{"type": "function", "name": "exec_command"}],
    }
    assert tool_choice(allowed, tools) == "required" and _names(tools) == ["exec_command"]
    with pytest.raises(ProxyError, match="forces the tool 'web_search'"):
        tool_choice({"type": "web_search"}, tools)


@pytest.mark.parametrize(
    "bad",
    [
        [{"type": "function"}],
        [{"type": "namespace", "name": "ns", "tools": "x"}],
        [{"type": "function", "name": "a"}, {"type": "function", "name": "a"}],
        [{"type": "function", "name": "a", "parameters": []}],
        [{"name": "no type"}],
        {"type": "function", "name": "not a list"},
    ],
)
def test_malformed_tools_are_a_400_naming_the_place(bad: Any) -> None:
    with pytest.raises(ProxyError, match="tools") as err:
        ToolMap.build(bad)
    assert err.value.status == 400 and (err.value.param or "").startswith("tools")


@pytest.mark.parametrize(
    ("content", "thought"),
    [
        ("<think>plan</think>\n\nAnswer", "<think>plan</think>\n\n"),
        ("  <think>a</think>b", "  <think>a</think>"),
        ("plan only</think>\nAnswer", "plan only</think>\n"),  # the template opened the thought
        ("<think>cut off", "<think>cut off"),
        ("no thought </b>", ""),
        ("a <think>late</think> b", ""),
        (None, ""),
    ],
)
def test_a_thought_splits_off_and_comes_back_character_for_character(
    content: str | None, thought: str
) -> None:
    raw, text = split_reasoning(content)
    assert raw == thought and raw + text == (content or "")
    assert raw_reasoning(encode_reasoning(raw)) == raw
    if raw:
        assert "<think>" not in reasoning_text(raw) and "</think>" not in reasoning_text(raw)
    assert raw_reasoning("gAAAA-openai-encrypted") is None and raw_reasoning(None) is None
    assert raw_reasoning("agentloop-reasoning-v1:@@not base64@@") is None
