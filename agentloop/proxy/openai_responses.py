"""The OpenAI Responses API (``POST .../v1/responses``): the request as chat, the Generation as a response.

A Responses request becomes the chat messages and tools the chat template renders and goes through
the path a chat completion takes (``ProxyService.chat``: token ledger, sampling, recording); the
finished Generation is written as a ``response`` object or as its SSE events.

Conversion (what the template renders, and what the LLMCall records as ``messages``):

- ``instructions`` -> a first system message; ``input`` as a string -> one user message;
- ``input`` items: messages (``role`` user / system / developer / assistant, ``content`` a string or
  ``input_text`` / ``output_text`` parts, joined) -> chat messages; ``function_call`` items -> the
  ``tool_calls`` of the assistant message just before them (or of a new one); ``function_call_output``
  -> a ``tool`` message. The ``output`` items a response returned, sent back as they came, extend the
  token ledger (delta tokenization);
- ``tools`` of type ``function`` -> function tools; ``tool_choice`` auto / none / required /
  ``{"type": "function", "name"}``; ``max_output_tokens`` -> max_tokens.

Refused with a 400 (OpenAI's error shape): ``previous_response_id`` and ``conversation`` (this
proxy does not store responses: send the whole conversation in ``input``, the earlier ``output``
items included), ``background: true``, ``prompt`` templates, a ``text.format`` other than text,
non-function tools (web_search, file_search, custom, ...), and items or parts other than those
above (images, files, ``reasoning``, ``item_reference``, ...). ``store``, ``reasoning``,
``include``, ``truncation``, ``user`` are accepted and ignored (``store`` is false in the answer);
``metadata`` is echoed.

The answer: ``output`` holds a ``message`` item with one ``output_text`` part (when the model wrote
text, or wrote nothing and called no tool) and a ``function_call`` item per tool call;
``status`` is ``completed``, or ``incomplete`` with ``incomplete_details.reason =
"max_output_tokens"`` when the token limit cut the answer. Streaming sends ``response.created``,
``response.in_progress``, per item ``response.output_item.added``, then for a message
``response.content_part.added``, ``response.output_text.delta`` (per whole-character piece of the
text as its tokens decode), ``response.output_text.done``, ``response.content_part.done``, for a
function call ``response.function_call_arguments.delta`` / ``.done``, then
``response.output_item.done``; last ``response.completed`` (or ``response.incomplete``). Every
event has a ``sequence_number``. The generation is finished before the first event, so an error
is an HTTP error, never one in the middle of a stream. Token ids (``return_token_ids: true`` or
``X-Return-Token-Ids``): ``prompt_token_ids``, ``token_ids`` and ``logprobs`` on the response.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import orjson
from pydantic import Field, field_validator, model_validator

from agentloop.proxy.responses import text_pieces
from agentloop.proxy.schemas import (
    ChatCompletionRequest,
    JSONDict,
    Strict,
    bad_request,
    parse_model,
)
from agentloop.proxy.service import Generation

_NEEDS = {"message": ("role", "content"), "function_call": ("call_id", "name", "arguments"),
          "function_call_output": ("call_id", "output")}  # fmt: skip
_PARTS = ("input_text", "output_text", "text")


def _as_parts(value: Any) -> Any:
    """A string is one text part (one schema for both forms: errors name the part that is wrong)."""
    return [{"type": "input_text", "text": value}] if isinstance(value, str) else value


class TextPart(Strict):
    type: str
    text: str


class InputItem(Strict):
    """A message, ``function_call`` or ``function_call_output`` item (``check_items`` checks ``type``)."""

    type: str = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None  # message
    content: list[TextPart] | None = None  # message
    call_id: str | None = None  # function_call, function_call_output
    name: str | None = Field(None, min_length=1)  # function_call
    arguments: str | None = None  # function_call
    output: list[TextPart] | None = None  # function_call_output

    _parts = field_validator("content", "output", mode="before")(_as_parts)


def check_items(body: Any) -> None:
    """Refuse unsupported or incomplete input items and parts, naming their place and what is supported."""
    items = body.get("input") if isinstance(body, dict) else None
    for i, item in enumerate(items if isinstance(items, list) else []):
        where = f"input.{i}"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if not isinstance(item, dict) or kind not in _NEEDS:
            raise bad_request(
                f"{where}: input items of type {kind!r} are not supported; the proxy takes "
                + ", ".join(_NEEDS),
                param=where,
            )
        for key in _NEEDS[kind]:
            if item.get(key) is None:
                raise bad_request(f"{where}: a {kind} item needs {key!r}", param=f"{where}.{key}")
        field = "content" if kind == "message" else "output"
        parts = item.get(field)
        for k, part in enumerate(parts if isinstance(parts, list) else []):
            got = part.get("type") if isinstance(part, dict) else type(part).__name__
            if got not in _PARTS:
                raise bad_request(
                    f"{where}.{field}.{k}: content parts of type {got!r} are not supported; the proxy "
                    "takes " + ", ".join(_PARTS),
                    param=f"{where}.{field}.{k}",
                )


class FunctionTool(Strict):
    type: str
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: JSONDict | None = None
    strict: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _function_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") != "function":
            raise ValueError(f"only tools of type 'function' are supported, got {data.get('type')!r}")
        return data


class ResponsesRequest(Strict):
    """The fields of a Responses request the proxy reads (others are accepted and ignored)."""

    model: str | None = None
    input: list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | JSONDict | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool | None = None
    return_token_ids: bool = False

    @field_validator("input", mode="before")
    @classmethod
    def _one_message(cls, value: Any) -> Any:
        return [{"role": "user", "content": value}] if isinstance(value, str) else value


_REFUSED = {
    "previous_response_id": "this proxy does not store responses; send the whole conversation in input "
    "(the earlier output items, then the new ones)",
    "conversation": "this proxy does not store conversations; send the whole conversation in input",
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
        raise bad_request(
            f"text.format {fmt.get('type')!r} is not supported: only plain text output", param="text.format"
        )


def _join(content: list[TextPart] | None) -> str:
    return "".join(p.text for p in content or [])


def chat_messages(req: ResponsesRequest) -> list[JSONDict]:
    """The conversation as OpenAI chat messages (module docstring)."""
    out: list[JSONDict] = []
    if req.instructions:
        out.append({"role": "system", "content": req.instructions})
    names: dict[str, str] = {}  # call_id -> function name, for the outputs that answer them
    for item in req.input:
        if item.type == "message":
            out.append({"role": item.role, "content": _join(item.content)})
        elif item.type == "function_call":
            assert item.call_id is not None and item.name is not None  # check_items
            names[item.call_id] = item.name
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}  # fmt: skip
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                out.append(last)
            last.setdefault("tool_calls", []).append(call)
        else:
            tool: JSONDict = {"role": "tool", "tool_call_id": item.call_id, "content": _join(item.output)}
            if item.call_id in names:
                tool["name"] = names[item.call_id]
            out.append(tool)
    return out


def parse(body: Any) -> tuple[ResponsesRequest, ChatCompletionRequest, list[JSONDict]]:
    """The validated request, the chat request it becomes, and its chat messages (400 on bad input)."""
    _refuse(body)
    check_items(body)
    req: ResponsesRequest = parse_model(ResponsesRequest, body, "responses request")
    messages = chat_messages(req)
    if not messages:
        raise bad_request("input is empty: give a string or at least one item", param="input")
    chat: JSONDict = {"model": req.model, "messages": messages}
    if req.max_output_tokens is not None:
        chat["max_tokens"] = req.max_output_tokens
    for key in ("temperature", "top_p"):
        if getattr(req, key) is not None:
            chat[key] = getattr(req, key)
    if req.tools:
        chat["tools"] = [{"type": "function", "function": t.model_dump(include={"name", "description", "parameters"},
                          exclude_none=True)} for t in req.tools]  # fmt: skip
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad_request(
                'tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}',
                param="tool_choice",
            )
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        chat["tool_choice"] = choice
    return req, parse_model(ChatCompletionRequest, chat, "responses request"), messages


# ---------------------------------------------------------------- the answer


def _suffix(gen: Generation) -> str:
    return gen.id.removeprefix("chatcmpl-")


def _items(gen: Generation) -> list[JSONDict]:
    """The output items: a message (unless the model only called tools), then the function calls."""
    status = "incomplete" if gen.finish_reason == "length" else "completed"
    items: list[JSONDict] = []
    if gen.content or not gen.tool_calls:
        part = {"type": "output_text", "text": gen.content or "", "annotations": [], "logprobs": []}
        items.append({"type": "message", "id": "msg_" + _suffix(gen), "status": status, "role": "assistant",
                      "content": [part]})  # fmt: skip
    for c in gen.tool_calls:
        items.append({"type": "function_call", "id": "fc_" + c["id"].removeprefix("call_"), "call_id": c["id"],
                      "name": c["function"]["name"], "arguments": c["function"]["arguments"],
                      "status": "completed"})  # fmt: skip
    return items


def _response(
    gen: Generation, req: ResponsesRequest, output: list[JSONDict] | None, want_ids: bool
) -> JSONDict:
    """The response object; ``output`` None: the one ``response.created`` announces (in progress)."""
    status = (
        "in_progress" if output is None else ("incomplete" if gen.finish_reason == "length" else "completed")
    )
    body: JSONDict = {
        "id": "resp_" + _suffix(gen),
        "object": "response",
        "created_at": gen.created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": gen.model,
        "output": output or [],
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": None,
        "store": False,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "text": {"format": {"type": "text"}},
        "tool_choice": req.tool_choice or "auto",
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
        "truncation": "disabled",
        "metadata": req.metadata or {},
        "usage": None,
    }
    if output is not None:
        n, m = len(gen.prompt_ids), len(gen.token_ids)
        body["usage"] = {"input_tokens": n, "input_tokens_details": {"cached_tokens": 0},
                         "output_tokens": m, "output_tokens_details": {"reasoning_tokens": 0},
                         "total_tokens": n + m}  # fmt: skip
        if want_ids:
            body.update(prompt_token_ids=gen.prompt_ids, token_ids=gen.token_ids, logprobs=gen.logprobs)
    return body


def response_json(gen: Generation, req: ResponsesRequest, want_ids: bool) -> bytes:
    return orjson.dumps(_response(gen, req, _items(gen), want_ids))


def response_events(
    gen: Generation, req: ResponsesRequest, tokenizer: Any, want_ids: bool
) -> Iterator[bytes]:
    """The SSE events of a streamed response (module docstring)."""
    seq = iter(range(1 << 62))

    def event(kind: str, **data: Any) -> bytes:
        obj = {"type": kind, "sequence_number": next(seq), **data}
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"

    pending = _response(gen, req, None, want_ids)
    yield event("response.created", response=pending)
    yield event("response.in_progress", response=pending)
    items = _items(gen)
    for index, item in enumerate(items):
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            yield event("response.output_item.added", output_index=index,
                        item={**item, "status": "in_progress", "content": []})  # fmt: skip
            part = item["content"][0]
            yield event("response.content_part.added", **where, content_index=0, part={**part, "text": ""})
            # with tool calls the text is what is left around them: one piece; else per decoded piece
            pieces = [part["text"]] if gen.tool_calls else [p for p, _, _ in text_pieces(gen, tokenizer)]
            for piece in filter(None, pieces):
                yield event("response.output_text.delta", **where, content_index=0, delta=piece, logprobs=[])
            yield event("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[])
            yield event("response.content_part.done", **where, content_index=0, part=part)
        else:
            yield event("response.output_item.added", output_index=index,
                        item={**item, "status": "in_progress", "arguments": ""})  # fmt: skip
            yield event("response.function_call_arguments.delta", **where, delta=item["arguments"])
            yield event("response.function_call_arguments.done", **where, name=item["name"],
                        arguments=item["arguments"])  # fmt: skip
        yield event("response.output_item.done", output_index=index, item=item)
    final = _response(gen, req, items, want_ids)
    yield event(f"response.{final['status']}", response=final)
