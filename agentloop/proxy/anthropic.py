"""The Anthropic Messages API (``POST .../v1/messages``, ``POST .../v1/messages/count_tokens``): the
request as chat, the Generation as a message.

A Messages request becomes the chat messages and tools the chat template renders and goes through
the path a chat completion takes (``ProxyService.chat``: token ledger, sampling, recording); the
finished Generation is written as an Anthropic ``message`` or as its SSE event sequence.
``count_tokens`` renders the same prompt and answers ``{"input_tokens": n}`` (a full render: the
count a fresh conversation would have; nothing is generated or recorded).

Conversion (what the template renders, and what the LLMCall records as ``messages``):

- ``system`` (a string or text blocks; ``cache_control`` accepted) -> a first system message;
- a user message's ``text`` blocks -> one user message (blocks joined by newlines), each
  ``tool_result`` block -> a ``tool`` message (``tool_call_id``, the tool's name, its text), in order;
  ``image`` and ``document`` blocks (also inside a tool_result) -> a placeholder such as
  ``[image omitted]``, logged: the model reads text only;
- an assistant message's ``text`` blocks -> its content, ``tool_use`` blocks -> its ``tool_calls``,
  a ``thinking`` block the proxy wrote -> the start of its content, exactly as the model wrote it
  (reasoning.py); other thinking and ``redacted_thinking`` blocks are skipped. The assistant message
  the proxy returned, sent back as it came, extends the token ledger;
- blocks of server tools (``server_tool_use``, ``web_search_tool_result``, ...) and other types are
  skipped, logged;
- ``tools`` (``name``, ``description``, ``input_schema``) -> function tools; server and
  Anthropic-defined tools (a ``type`` other than ``custom``: ``web_search_20250305``,
  ``bash_20250124``, ...) are not offered to the model, logged; ``tool_choice`` auto / any / tool / none
  -> auto / required / that function / none (naming a tool not offered: 400).

Accepted and ignored: ``metadata``, ``cache_control`` anywhere, ``anthropic-beta`` headers,
``service_tier``, ``output_config.effort``, ``disable_parallel_tool_use``. ``thinking``
(``enabled`` / ``adaptive``): a thought the model writes (``<think>...</think>``) is answered as a
``thinking`` block (its exact text in ``signature``) instead of text; ``budget_tokens`` is not
enforced (the thought counts against ``max_tokens``). Model names: a rollout attempt serves any; on
the session routes a ``claude-*`` name (Claude Code's main and small fast models) is served by the
proxy's model too; either way the call is recorded with the name the request gave.
Refused with a 400 in Anthropic's shape (``{"type": "error", "error": {"type":
"invalid_request_error", "message": ...}}``): ``output_config.format`` (structured outputs); a last
message from the assistant (prefill: the chat template closes that turn instead of continuing it);
incomplete blocks. A tool_result's ``is_error`` is kept on the recorded tool message but not rendered
(the model sees the tool's text).

The answer is written by anthropic_output.py.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import structlog
from pydantic import Field, field_validator, model_validator

from agentloop.proxy.reasoning import raw_reasoning
from agentloop.proxy.schemas import (
    ChatCompletionRequest,
    JSONDict,
    ProxyError,
    Strict,
    bad_request,
    parse_model,
)

log = structlog.get_logger("agentloop.proxy")

_NEEDS: dict[str, tuple[str, ...]] = {
    "text": ("text",),
    "tool_use": ("id", "name", "input"),
    "tool_result": ("tool_use_id",),
    "thinking": ("thinking",),
}
_MEDIA = ("image", "document")


def _as_blocks(value: Any) -> Any:
    """A string is one text block (one schema for both forms: errors name the block that is wrong)."""
    return [{"type": "text", "text": value}] if isinstance(value, str) else value


class TextBlock(Strict):
    type: Literal["text"]
    text: str


class ContentBlock(Strict):
    """One content block (``check_blocks`` checks the fields each known ``type`` needs)."""

    type: str
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = Field(None, min_length=1)  # tool_use
    input: Any = None  # tool_use: an object (check_blocks)
    tool_use_id: str | None = None  # tool_result
    content: Any = None  # tool_result: a string or blocks (check_blocks)
    is_error: bool | None = None  # tool_result
    thinking: str | None = None  # thinking
    signature: str | None = None  # thinking


class AnthropicMessage(Strict):
    role: Literal["user", "assistant"]
    content: list[ContentBlock]

    _blocks = field_validator("content", mode="before")(_as_blocks)


class AnthropicTool(Strict):
    """A client tool (``name``, ``description``, ``input_schema``) or a server / Anthropic-defined one
    (``type`` other than ``custom``: not offered to the model)."""

    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: JSONDict | None = None
    type: str | None = None

    @property
    def offered(self) -> bool:
        return self.type in (None, "custom")

    @model_validator(mode="after")
    def _schema(self) -> AnthropicTool:
        if self.offered and self.input_schema is None:
            raise ValueError(f"the client tool {self.name!r} needs an input_schema")
        return self


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
    thinking: JSONDict | None = None
    return_token_ids: bool = False

    _blocks = field_validator("system", mode="before")(_as_blocks)

    @property
    def thinks(self) -> bool:
        """Whether thoughts are answered as thinking blocks (``thinking.type`` enabled or adaptive)."""
        return bool(self.thinking) and (self.thinking or {}).get("type") in ("enabled", "adaptive")

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
    """Refuse incomplete content blocks, naming their place (blocks of other types are skipped later)."""
    messages = body.get("messages") if isinstance(body, dict) else None
    for i, msg in enumerate(messages if isinstance(messages, list) else []):
        content = msg.get("content") if isinstance(msg, dict) else None
        for j, block in enumerate(content if isinstance(content, list) else []):
            where = f"messages.{i}.content.{j}"
            if not isinstance(block, dict) or not isinstance(block.get("type"), str):
                raise bad_request(f"{where}: a content block must be an object with a string 'type'", where)
            kind = block["type"]
            for key in _NEEDS.get(kind, ()):
                if block.get(key) is None:
                    raise bad_request(f"{where}: a {kind} block needs {key!r}", param=f"{where}.{key}")
            if kind == "tool_use" and not isinstance(block["input"], dict):
                raise bad_request(f"{where}.input must be an object", param=f"{where}.input")
            inner = block.get("content")
            if kind == "tool_result" and inner is not None and not isinstance(inner, str | list):
                raise bad_request(f"{where}.content must be a string or blocks", param=f"{where}.content")
            for k, part in enumerate(inner if kind == "tool_result" and isinstance(inner, list) else []):
                if not isinstance(part, dict) or (
                    part.get("type") == "text" and not isinstance(part.get("text"), str)
                ):
                    raise bad_request(
                        f"{where}.content.{k}: a tool_result block must be an object; text blocks need 'text'",
                        param=f"{where}.content.{k}",
                    )


class _Notes:
    """What a conversion left out, logged once per request."""

    def __init__(self) -> None:
        self.omitted: list[str] = []
        self.skipped: list[str] = []

    def media(self, kind: str) -> str:
        self.omitted.append(kind)
        return f"[{kind} omitted]"

    def log(self) -> None:
        if self.omitted:
            log.info(
                "media blocks replaced by placeholders: the model reads text only",
                blocks=sorted(set(self.omitted)),
            )
        if self.skipped:
            log.info("content blocks skipped: not rendered for this model", blocks=sorted(set(self.skipped)))


def _result_text(content: Any, notes: _Notes) -> str:
    """A tool_result's content: a string, or its text blocks (media as placeholders) joined by newlines."""
    if isinstance(content, str):
        return content
    parts = []
    for part in content or []:
        kind = part.get("type")
        if kind == "text":
            parts.append(part["text"])
        elif kind in _MEDIA:
            parts.append(notes.media(kind))
        else:
            notes.skipped.append(f"tool_result.{kind}")
    return "\n".join(parts)


def chat_messages(req: MessagesRequest) -> list[JSONDict]:
    """The conversation as OpenAI chat messages (module docstring)."""
    out: list[JSONDict] = []
    if req.system:
        out.append({"role": "system", "content": "\n".join(b.text for b in req.system)})
    names: dict[str, str] = {}  # tool_use id -> tool name, for the tool messages that answer them
    notes = _Notes()
    for msg in req.messages:
        if msg.role == "assistant":
            calls, texts, thought = [], [], ""
            for b in msg.content:
                if b.type == "tool_use":
                    assert b.id is not None and b.name is not None  # check_blocks
                    names[b.id] = b.name
                    calls.append({"id": b.id, "type": "function",
                                  "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}})  # fmt: skip
                elif b.type == "text":
                    texts.append(b.text or "")
                elif b.type == "tool_result":
                    raise bad_request("tool_result blocks belong in user messages", param="messages")
                elif b.type == "thinking" and (raw := raw_reasoning(b.signature)) is not None:
                    thought += raw
                else:
                    notes.skipped.append(b.type)
            turn: JSONDict = {"role": "assistant", "content": thought + "\n".join(texts) or None}
            if calls:
                turn["tool_calls"] = calls
            out.append(turn)
        else:
            texts = []
            for b in msg.content:
                if b.type == "tool_use":
                    raise bad_request("tool_use blocks belong in assistant messages", param="messages")
                if b.type in ("text", *_MEDIA):
                    texts.append(b.text or "" if b.type == "text" else notes.media(b.type))
                    continue
                if b.type != "tool_result":
                    notes.skipped.append(b.type)
                    continue
                if texts:  # text before a tool result stays before it
                    out.append({"role": "user", "content": "\n".join(texts)})
                    texts = []
                assert b.tool_use_id is not None  # check_blocks
                tool: JSONDict = {
                    "role": "tool",
                    "tool_call_id": b.tool_use_id,
                    "content": _result_text(b.content, notes),
                }
                if b.tool_use_id in names:
                    tool["name"] = names[b.tool_use_id]
                if b.is_error:
                    tool["is_error"] = True
                out.append(tool)
            if texts or not msg.content:
                out.append({"role": "user", "content": "\n".join(texts)})
    notes.log()
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
    offered = [t for t in req.tools or [] if t.offered]
    dropped = sorted({f"{t.type}:{t.name}" for t in req.tools or [] if not t.offered})
    if dropped:
        log.info("server tools not offered to the model", tools=dropped)
    if offered:
        chat["tools"] = [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                          **({"description": t.description} if t.description else {})}} for t in offered]  # fmt: skip
    choice = req.tool_choice
    if choice is not None and choice.type == "tool" and choice.name not in {t.name for t in offered}:
        raise bad_request(
            f"tool_choice names the tool {choice.name!r}, which the request does not offer to this model "
            "(server tools are not offered); name one of its client tools",
            param="tool_choice",
        )
    if choice is not None and offered:
        chat["tool_choice"] = (
            {"type": "function", "function": {"name": choice.name}}
            if choice.type == "tool"
            else {"any": "required"}.get(choice.type, choice.type)
        )
    return req, parse_model(ChatCompletionRequest, chat, "messages request"), messages


def parse_count(body: Any) -> ChatCompletionRequest:
    """A ``count_tokens`` body (a Messages request without ``max_tokens``) as the chat request it renders."""
    if isinstance(body, dict) and body.get("max_tokens") is None:
        body = {**body, "max_tokens": 1}
    return parse(body)[1]


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
                429: "rate_limit_error"}  # fmt: skip


def error_body(exc: ProxyError) -> JSONDict:
    """Anthropic's error shape: ``{"type": "error", "error": {"type", "message"}}``."""
    kind = _ERROR_TYPES.get(exc.status, "api_error" if exc.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message}}
