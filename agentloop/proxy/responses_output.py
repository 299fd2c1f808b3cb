"""The OpenAI Responses API, the answer side: a finished Generation as a ``response`` object or as the
SSE events the official ``openai`` client and Codex CLI parse.

Output items, in order: a ``reasoning`` item when the model thought (``<think>...</think>``: its text as
``reasoning_text`` content, the exact thought in ``encrypted_content``, see reasoning.py); a
``message`` with one ``output_text`` part when the model wrote text (or wrote nothing else at all);
then one item per tool call, as the client declared the tool (responses_tools.py): ``function_call``
(with ``namespace`` for a namespaced tool), ``custom_tool_call``, ``local_shell_call`` or
``tool_search_call``. ``status`` is ``completed``, or ``incomplete`` with ``incomplete_details.reason =
"max_output_tokens"`` when the token limit cut the answer.

Streaming sends ``response.created``, ``response.in_progress``, then per item
``response.output_item.added``, its deltas, ``response.output_item.done``, and last
``response.completed`` (or ``response.incomplete``). The deltas: a reasoning item's
``response.reasoning_text.delta`` / ``.done``; a message's ``response.content_part.added``,
``response.output_text.delta`` (per whole-character piece of the text as its tokens decode; one piece
when the text shares the output with a thought or tool calls), ``response.output_text.done``,
``response.content_part.done``; a function call's ``response.function_call_arguments.delta`` / ``.done``;
a custom tool call's ``response.custom_tool_call_input.delta`` / ``.done``. Every event has a
``sequence_number`` from 0. The generation is finished before the first event, so an error is an HTTP
error, never one in the middle of a stream. Token ids (``return_token_ids: true`` or
``X-Return-Token-Ids``): ``prompt_token_ids``, ``token_ids`` and ``logprobs`` on the response.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from agentloop.proxy.generation import Generation
from agentloop.proxy.openai_responses import ParsedRequest
from agentloop.proxy.reasoning import encode_reasoning, reasoning_text, split_reasoning
from agentloop.proxy.responses import text_pieces
from agentloop.proxy.responses_store import ResponseStore
from agentloop.proxy.responses_tools import call_item
from agentloop.proxy.schemas import JSONDict


@dataclass
class Answer:
    """One response: its id, output items, and the calls the client will send back."""

    id: str
    gen: Generation
    parsed: ParsedRequest
    thought: str  # the raw thought ("" when none): the start of gen.content
    text: str  # the rest of gen.content: the message's text
    output: list[JSONDict] = field(default_factory=list)
    # the calls whose item the client sends back in another form: (call_id, client's view, model's arguments)
    calls: list[tuple[str, Any, str]] = field(default_factory=list)

    @property
    def status(self) -> str:
        return "incomplete" if self.gen.finish_reason == "length" else "completed"


def answer(gen: Generation, parsed: ParsedRequest) -> Answer:
    """The output items of ``gen`` (module docstring)."""
    suffix = gen.id.removeprefix("chatcmpl-")
    thought, text = split_reasoning(gen.content)
    out = Answer("resp_" + suffix, gen, parsed, thought, text)
    if thought:
        out.output.append({"type": "reasoning", "id": "rs_" + suffix, "summary": [],
                           "content": [{"type": "reasoning_text", "text": reasoning_text(thought)}],
                           "encrypted_content": encode_reasoning(thought), "status": out.status})  # fmt: skip
    if text or not (thought or gen.tool_calls):
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        out.output.append({"type": "message", "id": "msg_" + suffix, "status": out.status, "role": "assistant",
                           "content": [part]})  # fmt: skip
    for call in gen.tool_calls:
        item, view = call_item(call, parsed.tools.ref(call["function"]["name"]))
        out.output.append(item)
        if item["type"] != "function_call":  # a function call's arguments come back as they are
            out.calls.append((call["id"], view, call["function"]["arguments"]))
    return out


def keep(ans: Answer, store: ResponseStore, key: str) -> None:
    """Remember the calls (always) and the response (unless ``store: false``) for later requests."""
    for call_id, view, arguments in ans.calls:
        store.remember_call(key, call_id, view, arguments)
    if ans.parsed.req.store is not False:
        store.keep(key, ans.id, ans.parsed.items, ans.output, ans.parsed.req.input)


def _reasoning_tokens(ans: Answer, tokenizer: Any) -> int:
    """How many of the output tokens decode to the thought."""
    if not ans.thought:
        return 0
    sent = count = 0
    for piece, ids, _ in text_pieces(ans.gen, tokenizer):
        if sent >= len(ans.thought):
            break
        sent += len(piece)
        count += len(ids)
    return count


def _response(ans: Answer, tokenizer: Any, done: bool, want_ids: bool) -> JSONDict:
    """The response object; ``done`` False: the one ``response.created`` announces (in progress)."""
    gen, req = ans.gen, ans.parsed.req
    status = ans.status if done else "in_progress"
    text = {"format": {"type": "text"}, **(req.text or {})}
    body: JSONDict = {
        "id": ans.id,
        "object": "response",
        "created_at": gen.created,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": gen.model,
        "output": ans.output if done else [],
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": None, "summary": None, **(req.reasoning or {})},
        "store": req.store is not False,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "text": text,
        "tool_choice": req.tool_choice or "auto",
        "tools": req.tools or [],
        "truncation": req.truncation or "disabled",
        "user": req.user,
        "metadata": req.metadata or {},
        "usage": None,
    }
    if done:
        n, m = len(gen.prompt_ids), len(gen.token_ids)
        body["usage"] = {"input_tokens": n, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0}, "output_tokens": m,
                         "output_tokens_details": {"reasoning_tokens": _reasoning_tokens(ans, tokenizer)},
                         "total_tokens": n + m}  # fmt: skip
        if want_ids:
            body.update(prompt_token_ids=gen.prompt_ids, token_ids=gen.token_ids, logprobs=gen.logprobs)
    return body


def response_json(ans: Answer, tokenizer: Any, want_ids: bool) -> bytes:
    return orjson.dumps(_response(ans, tokenizer, True, want_ids))


def response_events(ans: Answer, tokenizer: Any, want_ids: bool) -> Iterator[bytes]:
    """The SSE events of a streamed response (module docstring)."""
    seq = iter(range(1 << 62))

    def event(kind: str, **data: Any) -> bytes:
        obj = {"type": kind, "sequence_number": next(seq), **data}
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"

    pending = _response(ans, tokenizer, False, want_ids)
    yield event("response.created", response=pending)
    yield event("response.in_progress", response=pending)
    for index, item in enumerate(ans.output):
        where = {"item_id": item["id"], "output_index": index}
        kind = item["type"]
        if kind == "reasoning":
            text = item["content"][0]["text"]
            yield event("response.output_item.added", output_index=index,
                        item={**item, "status": "in_progress", "content": []})  # fmt: skip
            yield event("response.reasoning_text.delta", **where, content_index=0, delta=text)
            yield event("response.reasoning_text.done", **where, content_index=0, text=text)
        elif kind == "message":
            yield event("response.output_item.added", output_index=index,
                        item={**item, "status": "in_progress", "content": []})  # fmt: skip
            part = item["content"][0]
            yield event("response.content_part.added", **where, content_index=0, part={**part, "text": ""})
            whole = ans.thought or ans.gen.tool_calls  # the text is what is left around them: one piece
            pieces = [part["text"]] if whole else [p for p, _, _ in text_pieces(ans.gen, tokenizer)]
            for piece in filter(None, pieces):
                yield event("response.output_text.delta", **where, content_index=0, delta=piece, logprobs=[])
            yield event("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[])
            yield event("response.content_part.done", **where, content_index=0, part=part)
        elif kind == "function_call":
            yield event("response.output_item.added", output_index=index,
                        item={**item, "status": "in_progress", "arguments": ""})  # fmt: skip
            yield event("response.function_call_arguments.delta", **where, delta=item["arguments"])
            yield event("response.function_call_arguments.done", **where, name=item["name"],
                        arguments=item["arguments"])  # fmt: skip
        elif kind == "custom_tool_call":
            yield event("response.output_item.added", output_index=index,
                        item={**item, "status": "in_progress", "input": ""})  # fmt: skip
            yield event("response.custom_tool_call_input.delta", **where, delta=item["input"])
            yield event("response.custom_tool_call_input.done", **where, input=item["input"])
        else:  # local_shell_call, tool_search_call: whole items
            yield event(
                "response.output_item.added", output_index=index, item={**item, "status": "in_progress"}
            )
        yield event("response.output_item.done", output_index=index, item=item)
    final = _response(ans, tokenizer, True, want_ids)
    yield event(f"response.{final['status']}", response=final)
