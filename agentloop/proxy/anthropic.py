"""The Anthropic Messages API (``POST .../v1/messages``): the request as chat, the Generation as a message.

A Messages request becomes the chat messages and tools the chat template renders and goes through
the path a chat completion takes (``ProxyService.chat``: token ledger, sampling, recording); the
finished Generation is written as an Anthropic ``message`` or as its SSE event sequence.

Conversion (what the template renders, and what the LLMCall records as ``messages``):

- ``system`` (a string or text blocks) -> a first system message;
- a user message's ``text`` blocks -> one user message (blocks joined by newlines), each
  ``tool_result`` block -> a ``tool`` message (``tool_call_id``, the tool's name, its text), in order;
- an assistant message's ``text`` blocks -> its content, ``tool_use`` blocks -> its ``tool_calls``.
  The assistant message the proxy returned, sent back as it came, extends the token ledger;
- ``tools`` (``name``, ``description``, ``input_schema``) -> function tools; ``tool_choice``
  auto / any / tool / none -> auto / required / that function / none.

Refused with a 400 in Anthropic's shape (``{"type": "error", "error": {"type":
"invalid_request_error", "message": ...}}``): image, document, thinking and other non-text blocks;
server tools (any tool ``type`` but ``custom``); ``output_config.format`` (structured outputs); a last message from the assistant (prefill: the
chat template closes that turn instead of continuing it). ``thinking``, ``metadata``,
``cache_control``, ``output_config.effort``, ``service_tier`` are accepted and ignored; a tool_result's ``is_error`` is kept
on the recorded tool message but not rendered (the model sees the tool's text).

The answer: ``stop_reason`` is ``tool_use`` (the model called tools), ``stop_sequence`` (a
``stop_sequences`` string matched: the text ends before it, ``stop_sequence`` names it),
``max_tokens`` (the token limit), else ``end_turn``; ``usage`` counts the prompt's ids and the
engine's ids (end-of-turn id included). Streaming sends ``message_start``, per content block
``content_block_start``, its deltas (``text_delta`` per whole-character piece of the text as its
tokens decode, one ``input_json_delta`` with a tool call's input) and ``content_block_stop``, then
``message_delta`` (stop reason, usage) and ``message_stop``. The generation is finished before the
first event (one engine call), so an error is an HTTP error, never one in the middle of a stream.
Token ids (``return_token_ids: true`` or ``X-Return-Token-Ids``): ``prompt_token_ids``,
``token_ids`` and ``logprobs`` on the message (streaming: on ``message_delta``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import orjson
from pydantic import Field, field_validator, model_validator

from agentloop.proxy.responses import text_pieces
from agentloop.proxy.schemas import (
    ChatCompletionRequest,
    JSONDict,
    ProxyError,
    Strict,
    bad_request,
    parse_model,
)
from agentloop.proxy.service import Generation

_NEEDS = {"text": ("text",), "tool_use": ("id", "name", "input"), "tool_result": ("tool_use_id",)}


def _as_blocks(value: Any) -> Any:
    """A string is one text block (one schema for both forms: errors name the block that is wrong)."""
    return [{"type": "text", "text": value}] if isinstance(value, str) else value


class TextBlock(Strict):
    type: Literal["text"]
    text: str


class ContentBlock(Strict):
    """One content block: ``text``, ``tool_use`` or ``tool_result`` (``check_blocks`` checks ``type``)."""

    type: str
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = Field(None, min_length=1)  # tool_use
    input: JSONDict | None = None  # tool_use
    tool_use_id: str | None = None  # tool_result
    content: list[TextBlock] | None = None  # tool_result
    is_error: bool | None = None  # tool_result

    _blocks = field_validator("content", mode="before")(_as_blocks)


class AnthropicMessage(Strict):
    role: Literal["user", "assistant"]
    content: list[ContentBlock]

    _blocks = field_validator("content", mode="before")(_as_blocks)


class AnthropicTool(Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: JSONDict
    type: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _client_tool(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if kind not in (None, "custom"):
            raise ValueError(
                f"only client tools (name, description, input_schema) are supported, not {kind!r}"
            )
        return data


class AnthropicToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> AnthropicToolChoice:
        if self.type == "tool" and not self.name:
            raise ValueError('tool_choice {"type": "tool"} needs the tool\'s "name"')
        return self


class MessagesRequest(Strict):
    """The fields of an Anthropic Messages request the proxy reads (others are accepted, ignored)."""

    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    return_token_ids: bool = False

    _blocks = field_validator("system", mode="before")(_as_blocks)

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and (len(value) > 16 or not all(value)):
            raise ValueError(f"stop_sequences takes at most 16 non-empty strings, got {len(value)}")
        return value

    @model_validator(mode="after")
    def _ends_with_user(self) -> MessagesRequest:
        if self.messages[-1].role != "user":
            raise ValueError(
                "the last message must be a user message (assistant prefill is not supported: "
                "the chat template would close that turn, not continue it)"
            )
        return self


def check_blocks(body: Any) -> None:
    """Refuse unsupported or incomplete content blocks, naming their place and what is supported."""
    messages = body.get("messages") if isinstance(body, dict) else None
    for i, msg in enumerate(messages if isinstance(messages, list) else []):
        content = msg.get("content") if isinstance(msg, dict) else None
        for j, block in enumerate(content if isinstance(content, list) else []):
            where = f"messages.{i}.content.{j}"
            kind = block.get("type") if isinstance(block, dict) else None
            if not isinstance(block, dict) or kind not in _NEEDS:
                raise bad_request(
                    f"{where}: content blocks of type {kind!r} are not supported; the proxy takes "
                    + ", ".join(_NEEDS),
                    param=where,
                )
            for key in _NEEDS[kind]:
                if block.get(key) is None:
                    raise bad_request(f"{where}: a {kind} block needs {key!r}", param=f"{where}.{key}")
            inner = block.get("content")
            for k, part in enumerate(inner if kind == "tool_result" and isinstance(inner, list) else []):
                if not isinstance(part, dict) or part.get("type") != "text":
                    got = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise bad_request(
                        f"{where}.content.{k}: tool_result content must be text blocks, got {got!r}",
                        param=f"{where}.content.{k}",
                    )


def _texts(blocks: list[TextBlock] | list[ContentBlock] | None) -> str:
    return "\n".join(b.text or "" for b in blocks or [] if b.type == "text")


def chat_messages(req: MessagesRequest) -> list[JSONDict]:
    """The conversation as OpenAI chat messages (module docstring)."""
    out: list[JSONDict] = []
    if req.system:
        out.append({"role": "system", "content": _texts(req.system)})
    names: dict[str, str] = {}  # tool_use id -> tool name, for the tool messages that answer them
    for msg in req.messages:
        if msg.role == "assistant":
            calls = []
            for b in msg.content:
                if b.type == "tool_use":
                    assert b.id is not None and b.name is not None  # check_blocks
                    names[b.id] = b.name
                    calls.append({"id": b.id, "type": "function",
                                  "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}})  # fmt: skip
                elif b.type == "tool_result":
                    raise bad_request("tool_result blocks belong in user messages", param="messages")
            turn: JSONDict = {"role": "assistant", "content": _texts(msg.content) or None}
            if calls:
                turn["tool_calls"] = calls
            out.append(turn)
        else:
            texts: list[str] = []
            for b in msg.content:
                if b.type == "tool_use":
                    raise bad_request("tool_use blocks belong in assistant messages", param="messages")
                if b.type == "text":
                    texts.append(b.text or "")
                    continue
                if texts:  # text before a tool result stays before it
                    out.append({"role": "user", "content": "\n".join(texts)})
                    texts = []
                assert b.tool_use_id is not None  # check_blocks
                tool: JSONDict = {"role": "tool", "tool_call_id": b.tool_use_id, "content": _texts(b.content)}
                if b.tool_use_id in names:
                    tool["name"] = names[b.tool_use_id]
                if b.is_error:
                    tool["is_error"] = True
                out.append(tool)
            if texts or not msg.content:
                out.append({"role": "user", "content": "\n".join(texts)})
    return out


def parse(body: Any) -> tuple[MessagesRequest, ChatCompletionRequest, list[JSONDict]]:
    """The validated request, the chat request it becomes, and its chat messages (400 on bad input)."""
    check_blocks(body)
    config = body.get("output_config") if isinstance(body, dict) else None
    if isinstance(config, dict) and config.get("format") is not None:
        raise bad_request(
            "structured outputs (output_config.format) are not supported: only plain text and tool calls",
            param="output_config.format",
        )
    req: MessagesRequest = parse_model(MessagesRequest, body, "messages request")
    messages = chat_messages(req)
    chat: JSONDict = {"model": req.model, "messages": messages, "max_tokens": req.max_tokens}
    for key in ("temperature", "top_p", "top_k"):
        if getattr(req, key) is not None:
            chat[key] = getattr(req, key)
    if req.stop_sequences:
        chat["stop"] = req.stop_sequences
    if req.tools:
        chat["tools"] = [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                          **({"description": t.description} if t.description else {})}} for t in req.tools]  # fmt: skip
    if req.tool_choice is not None:
        choice = req.tool_choice
        chat["tool_choice"] = (
            {"type": "function", "function": {"name": choice.name}}
            if choice.type == "tool"
            else {"any": "required"}.get(choice.type, choice.type)
        )
    return req, parse_model(ChatCompletionRequest, chat, "messages request"), messages


# ---------------------------------------------------------------- the answer


def stop_reason(gen: Generation, tokenizer: Any, stops: list[str]) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for a generation."""
    if gen.tool_calls:
        return "tool_use", None
    if stops:  # the service cut the text at the first stop string it found: find which one
        text = tokenizer.decode(gen.text_ids, skip_special_tokens=True)
        hits = [(i, s) for s in stops if (i := text.find(s)) >= 0]
        if hits:
            return "stop_sequence", min(hits)[1]
    return ("max_tokens" if gen.finish_reason == "length" else "end_turn"), None


def _tool_uses(gen: Generation) -> list[JSONDict]:
    return [{"type": "tool_use", "id": "toolu_" + c["id"].removeprefix("call_"),
             "name": c["function"]["name"], "input": json.loads(c["function"]["arguments"])}
            for c in gen.tool_calls]  # fmt: skip


def _extension(gen: Generation) -> JSONDict:
    return {"prompt_token_ids": gen.prompt_ids, "token_ids": gen.token_ids, "logprobs": gen.logprobs}


def _message(gen: Generation, content: list[JSONDict], stop: tuple[str | None, str | None]) -> JSONDict:
    return {
        "id": "msg_" + gen.id.removeprefix("chatcmpl-"),
        "type": "message",
        "role": "assistant",
        "model": gen.model,
        "content": content,
        "stop_reason": stop[0],
        "stop_sequence": stop[1],
        "usage": {"input_tokens": len(gen.prompt_ids), "output_tokens": len(gen.token_ids)},
    }


def message_json(gen: Generation, tokenizer: Any, stops: list[str], want_ids: bool) -> bytes:
    text = [{"type": "text", "text": gen.content}] if gen.content else []
    body = _message(gen, text + _tool_uses(gen), stop_reason(gen, tokenizer, stops))
    if want_ids:
        body.update(_extension(gen))
    return orjson.dumps(body)


def _event(kind: str, data: JSONDict) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **data}) + b"\n\n"


def message_events(gen: Generation, tokenizer: Any, stops: list[str], want_ids: bool) -> Iterator[bytes]:
    """The SSE events of a streamed message (module docstring)."""
    reason, sequence = stop_reason(gen, tokenizer, stops)
    start = _message(gen, [], (None, None))
    start["usage"] = {"input_tokens": len(gen.prompt_ids), "output_tokens": 0}
    yield _event("message_start", {"message": start})
    index = 0
    if gen.content:
        yield _event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
        # with tool calls the content is what is left around them: one piece; else per decoded piece
        pieces = [gen.content] if gen.tool_calls else [p for p, _, _ in text_pieces(gen, tokenizer) if p]
        for piece in pieces:
            yield _event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": piece}})
        yield _event("content_block_stop", {"index": 0})
        index = 1
    for i, block in enumerate(_tool_uses(gen), start=index):
        yield _event("content_block_start", {"index": i, "content_block": {**block, "input": {}}})
        partial = json.dumps(block["input"], ensure_ascii=False)
        yield _event("content_block_delta", {"index": i, "delta": {"type": "input_json_delta", "partial_json": partial}})  # fmt: skip
        yield _event("content_block_stop", {"index": i})
    delta: JSONDict = {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                       "usage": {"output_tokens": len(gen.token_ids)}}  # fmt: skip
    if want_ids:
        delta.update(_extension(gen))
    yield _event("message_delta", delta)
    yield _event("message_stop", {})


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
                429: "rate_limit_error"}  # fmt: skip


def error_body(exc: ProxyError) -> JSONDict:
    """Anthropic's error shape: ``{"type": "error", "error": {"type", "message"}}``."""
    kind = _ERROR_TYPES.get(exc.status, "api_error" if exc.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message}}
