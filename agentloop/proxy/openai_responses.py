"""The OpenAI Responses API (``POST .../v1/responses``), the request side: a Responses request as the
chat messages and tools the chat template renders. The request then takes the path a chat completion
takes (``ProxyService.chat``: token ledger, sampling, recording); responses_output.py writes the answer.

Conversion (what the template renders, and what the LLMCall records as ``messages``):

- ``instructions`` -> a first system message; ``input`` as a string -> one user message;
- ``previous_response_id`` -> that response's input and output items come first (responses_store.py);
  ``item_reference`` items -> the output item of a kept response they name;
- ``message`` items (``role`` user / system / developer / assistant; ``content`` a string or parts:
  ``input_text`` / ``output_text`` / ``text`` / ``refusal`` joined; ``input_image`` / ``input_file`` /
  ``input_audio`` become a short placeholder such as ``[image omitted]``, logged: the model reads text
  only) -> chat messages;
- call items (``function_call``, ``custom_tool_call``, ``local_shell_call``, ``tool_search_call``) ->
  the ``tool_calls`` of the assistant message just before them (or of a new one), under the flat names
  of responses_tools.py; their outputs (``function_call_output``, ``custom_tool_call_output``,
  ``local_shell_call_output``, ``tool_search_output``) -> ``tool`` messages;
- ``reasoning`` items the proxy wrote (reasoning.py) -> the start of the next assistant turn, exactly
  as the model wrote it; other reasoning items (summaries only, another server's encrypted content)
  are skipped;
- records of hosted tools and other item types (``web_search_call``, ``compaction``, ...) are
  skipped, logged;
- ``tools`` and ``tool_choice``: responses_tools.py; ``max_output_tokens`` -> max_tokens.

The output items a response returned, sent back as they came, extend the token ledger (delta
tokenization). Accepted (echoed on the response where it has a field): ``store`` (false: not kept
for ``previous_response_id``), ``include`` (a reasoning item always carries ``encrypted_content``),
``reasoning`` (effort and summary change nothing here), ``text`` (``verbosity``; a ``json_schema`` /
``json_object`` format is not enforced: logged, the model's text is returned as it is),
``parallel_tool_calls`` (the calls a turn holds are returned as the model wrote them), ``metadata``,
``truncation``, ``user``, ``prompt_cache_key``, Codex's ``client_metadata``. Refused with a 400 in OpenAI's error shape: ``conversation`` objects,
``background: true``, ``prompt`` templates, a malformed item or tool (naming its place).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import structlog
from pydantic import Field, field_validator

from agentloop.proxy.reasoning import raw_reasoning
from agentloop.proxy.responses_store import ResponseStore
from agentloop.proxy.responses_tools import ToolMap, chat_call, tool_choice
from agentloop.proxy.schemas import (
    ChatCompletionRequest,
    JSONDict,
    Strict,
    bad_request,
    parse_model,
)

log = structlog.get_logger("agentloop.proxy")

_NEEDS: dict[str, tuple[str, ...]] = {
    "message": ("role", "content"),
    "function_call": ("call_id", "name", "arguments"),
    "function_call_output": ("call_id", "output"),
    "custom_tool_call": ("call_id", "name", "input"),
    "custom_tool_call_output": ("call_id", "output"),
    "local_shell_call": ("call_id", "action"),
    "local_shell_call_output": ("call_id", "output"),
    "tool_search_call": ("call_id", "arguments"),
    "tool_search_output": ("call_id", "tools"),
    "reasoning": (),
    "item_reference": ("id",),
}
_STRINGS = ("role", "call_id", "name", "arguments", "input", "id")
_CALLS = ("function_call", "custom_tool_call", "local_shell_call", "tool_search_call")
_OUTPUTS = ("function_call_output", "custom_tool_call_output", "local_shell_call_output")
_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
_MEDIA_PARTS = {"input_image": "image", "input_file": "file", "input_audio": "audio"}


class ResponsesRequest(Strict):
    """The fields of a Responses request the proxy reads (others are accepted and ignored)."""

    model: str | None = None
    input: list[JSONDict]
    instructions: str | None = None
    tools: list[JSONDict] | None = None
    tool_choice: Literal["auto", "none", "required"] | JSONDict | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    include: list[str] | None = None
    reasoning: JSONDict | None = None
    text: JSONDict | None = None
    truncation: str | None = None
    user: str | None = None
    return_token_ids: bool = False

    @field_validator("input", mode="before")
    @classmethod
    def _one_message(cls, value: Any) -> Any:
        return [{"role": "user", "content": value}] if isinstance(value, str) else value


_REFUSED = {
    "conversation": "this proxy does not keep conversation objects; send previous_response_id or the "
    "whole conversation in input",
    "prompt": "prompt templates are not supported; send instructions and input",
}


def _refuse(body: Any) -> None:
    if not isinstance(body, dict):
        return  # parse_model says what is wrong
    for key, why in _REFUSED.items():
        if body.get(key) is not None:
            raise bad_request(f"{key} is not supported: {why}", param=key)
    if body.get("background"):
        raise bad_request(
            "background responses are not supported: send background: false", param="background"
        )
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    if isinstance(fmt, dict) and fmt.get("type", "text") != "text":
        log.info("text.format not enforced: the model's text is returned as it is", format=fmt.get("type"))


def check_items(items: list[JSONDict]) -> None:
    """Refuse incomplete items and unknown content parts, naming their place (``input.3.call_id``)."""
    for i, item in enumerate(items):
        where = f"input.{i}"
        kind = item.get("type", "message")
        if not isinstance(kind, str):
            raise bad_request(f"{where}.type must be a string", param=f"{where}.type")
        for key in _NEEDS.get(kind, ()):
            value = item.get(key)
            if value is None and key == "call_id" and item.get("id") is not None:
                key, value = "id", item["id"]  # an item may name its call by ``id``
            if value is None:
                raise bad_request(f"{where}: a {kind} item needs {key!r}", param=f"{where}.{key}")
            objects = kind in ("tool_search_call", "local_shell_call") and key in ("arguments", "action")
            if objects and not isinstance(value, dict):
                raise bad_request(f"{where}.{key} must be an object", param=f"{where}.{key}")
            if key in _STRINGS and not objects and value is not None and not isinstance(value, str):
                raise bad_request(f"{where}.{key} must be a string", param=f"{where}.{key}")
        if kind == "tool_search_output" and not isinstance(item["tools"], list):
            raise bad_request(f"{where}.tools must be a list of tools", param=f"{where}.tools")
        if kind == "message" and item["role"] not in _ROLES:
            raise bad_request(f"{where}.role must be one of {', '.join(_ROLES)}", param=f"{where}.role")
        field = "content" if kind == "message" else "output" if kind in _OUTPUTS else None
        parts = item.get(field) if field else None
        for k, part in enumerate(parts if isinstance(parts, list) else []):
            got = part.get("type") if isinstance(part, dict) else type(part).__name__
            text_ok = got not in _TEXT_PARTS or isinstance(part.get(got if got == "refusal" else "text"), str)
            if (got not in _TEXT_PARTS and got not in _MEDIA_PARTS) or not text_ok:
                raise bad_request(
                    f"{where}.{field}.{k}: content parts of type {got!r} are not supported (or lack their "
                    f"text); the proxy takes {', '.join(_TEXT_PARTS + tuple(_MEDIA_PARTS))}",
                    param=f"{where}.{field}.{k}",
                )
        if field and parts is not None and not isinstance(parts, str | list):
            raise bad_request(
                f"{where}.{field} must be a string or a list of parts", param=f"{where}.{field}"
            )


def _join(parts: Any, omitted: list[str]) -> str:
    """A string, or parts joined: text as it is, media as a placeholder (noted in ``omitted``)."""
    if isinstance(parts, str):
        return parts
    out = []
    for part in parts or []:
        kind = part.get("type")
        if kind in _MEDIA_PARTS:
            omitted.append(kind)
            name = part.get("filename")
            out.append(f"[{_MEDIA_PARTS[kind]} omitted{': ' + name if isinstance(name, str) else ''}]")
        else:
            out.append(part.get("refusal" if kind == "refusal" else "text") or "")
    return "".join(out)


def chat_messages(
    instructions: str | None, items: Iterable[JSONDict], tools: ToolMap, store: ResponseStore, key: str
) -> list[JSONDict]:
    """The conversation as OpenAI chat messages (module docstring)."""
    out: list[JSONDict] = [{"role": "system", "content": instructions}] if instructions else []
    names: dict[str, str] = {}  # call_id -> flat tool name, for the outputs that answer them
    thought: JSONDict | None = None  # an assistant turn a reasoning item began: its text joins it
    omitted: list[str] = []
    skipped: list[str] = []

    def memory(call_id: str, view: Any) -> str | None:
        return store.call_arguments(key, call_id, view)

    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            text = _join(item["content"], omitted)
            if item["role"] == "assistant" and thought is not None and out and out[-1] is thought:
                thought["content"] += text
            else:
                out.append({"role": item["role"], "content": text})
            thought = None
        elif kind == "reasoning":
            raw = raw_reasoning(item.get("encrypted_content"))
            if raw is None:
                skipped.append("reasoning")
                continue
            thought = {"role": "assistant", "content": raw}
            out.append(thought)
        elif kind in _CALLS:
            call = chat_call({**item, "call_id": item.get("call_id") or item.get("id")}, memory)
            names[call["id"]] = call["function"]["name"]
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                out.append(last)
            last.setdefault("tool_calls", []).append(call)
            thought = None
        elif kind in _OUTPUTS or kind == "tool_search_output":
            call_id = item.get("call_id") or item.get("id")
            text = (
                tools.discovered_text(item["tools"])
                if kind == "tool_search_output"
                else _join(item["output"], omitted)
            )
            tool: JSONDict = {"role": "tool", "tool_call_id": call_id, "content": text}
            if call_id in names:
                tool["name"] = names[call_id]
            out.append(tool)
            thought = None
        else:
            skipped.append(kind)
    if omitted:
        log.info(
            "media parts replaced by placeholders: the model reads text only", parts=sorted(set(omitted))
        )
    if skipped:
        log.info("input items skipped: not rendered for this model", items=sorted(set(skipped)))
    return out


@dataclass
class ParsedRequest:
    """A Responses request and what it becomes."""

    req: ResponsesRequest
    chat: ChatCompletionRequest
    messages: list[JSONDict]  # the chat messages (recorded as the call's messages)
    tools: ToolMap
    items: list[JSONDict]  # the whole conversation's input items (previous response's included)


def _resolve(items: list[JSONDict], store: ResponseStore, key: str) -> list[JSONDict]:
    out = []
    for i, item in enumerate(items):
        if item.get("type") == "item_reference":
            found = store.item(key, item["id"])
            if found is None:
                raise bad_request(
                    f"input.{i}: item_reference {item['id']!r} names no output item of a response this "
                    "proxy keeps for this attempt or session",
                    param=f"input.{i}.id",
                )
            item = found
        out.append(item)
    return out


def parse(body: Any, store: ResponseStore, key: str) -> ParsedRequest:
    """The validated request and the chat request it becomes (400 on bad input); ``store`` holds the
    earlier responses and calls of conversation ``key``."""
    _refuse(body)
    req: ResponsesRequest = parse_model(ResponsesRequest, body, "responses request")
    check_items(req.input)
    items = _resolve(req.input, store, key)
    if req.previous_response_id is not None:
        items = store.conversation(key, req.previous_response_id) + items
    discovered = [t for it in items if it.get("type") == "tool_search_output" for t in it.get("tools") or []]
    tools = ToolMap.build(req.tools, discovered)
    dropped = sorted(set(tools.dropped))
    if dropped and store.first_note(key, "dropped:" + ",".join(dropped)):
        log.info("hosted tools not offered to the model", tools=dropped, key=key)
    choice = tool_choice(req.tool_choice, tools)
    messages = chat_messages(req.instructions, items, tools, store, key)
    if not messages:
        raise bad_request("input is empty: give a string or at least one item", param="input")
    chat: JSONDict = {"model": req.model, "messages": messages}
    if req.max_output_tokens is not None:
        chat["max_tokens"] = req.max_output_tokens
    for name in ("temperature", "top_p"):
        if getattr(req, name) is not None:
            chat[name] = getattr(req, name)
    if tools.functions:
        chat["tools"] = tools.functions
        if choice is not None:
            chat["tool_choice"] = choice
    return ParsedRequest(
        req, parse_model(ChatCompletionRequest, chat, "responses request"), messages, tools, items
    )
