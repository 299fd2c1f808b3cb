"""The Anthropic Messages API, the answer side: a finished Generation as a ``message`` or as its SSE
events (the request side is anthropic.py).

The answer: ``stop_reason`` is ``tool_use`` (the model called tools), ``stop_sequence`` (a
``stop_sequences`` string matched: the text ends before it, ``stop_sequence`` names it),
``max_tokens`` (the token limit), else ``end_turn``; ``usage`` counts the prompt's ids and the
engine's ids (end-of-turn id included). Streaming sends ``message_start``, per content block
``content_block_start``, its deltas (``thinking_delta`` and ``signature_delta`` for a thought,
``text_delta`` per whole-character piece of the text as its tokens decode, one ``input_json_delta``
with a tool call's input) and ``content_block_stop``, then ``message_delta`` (stop reason, usage) and
``message_stop``. The generation is finished before the first event (one engine call), so an error is
an HTTP error, never one in the middle of a stream. Token ids (``return_token_ids: true`` or
``X-Return-Token-Ids``): ``prompt_token_ids``, ``token_ids`` and ``logprobs`` on the message
(streaming: on ``message_delta``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import orjson

from agentloop.proxy.generation import Generation
from agentloop.proxy.reasoning import encode_reasoning, reasoning_text, split_reasoning
from agentloop.proxy.responses import text_pieces
from agentloop.proxy.schemas import JSONDict


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


def _thought_and_text(gen: Generation, thinks: bool) -> tuple[str, str]:
    """The raw thought (answered as a thinking block when the request enables thinking) and the text."""
    return split_reasoning(gen.content) if thinks else ("", gen.content or "")


def _thinking_block(thought: str) -> JSONDict:
    return {"type": "thinking", "thinking": reasoning_text(thought), "signature": encode_reasoning(thought)}


def message_json(
    gen: Generation, tokenizer: Any, stops: list[str], want_ids: bool, thinks: bool = False
) -> bytes:
    thought, text = _thought_and_text(gen, thinks)
    blocks = ([_thinking_block(thought)] if thought else []) + (
        [{"type": "text", "text": text}] if text else []
    )
    body = _message(gen, blocks + _tool_uses(gen), stop_reason(gen, tokenizer, stops))
    if want_ids:
        body.update(_extension(gen))
    return orjson.dumps(body)


def _event(kind: str, data: JSONDict) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **data}) + b"\n\n"


def message_events(
    gen: Generation, tokenizer: Any, stops: list[str], want_ids: bool, thinks: bool = False
) -> Iterator[bytes]:
    """The SSE events of a streamed message (module docstring)."""
    reason, sequence = stop_reason(gen, tokenizer, stops)
    start = _message(gen, [], (None, None))
    start["usage"] = {"input_tokens": len(gen.prompt_ids), "output_tokens": 0}
    yield _event("message_start", {"message": start})
    thought, text = _thought_and_text(gen, thinks)
    index = 0
    if thought:
        block = _thinking_block(thought)
        yield _event(
            "content_block_start", {"index": 0, "content_block": {**block, "thinking": "", "signature": ""}}
        )
        yield _event("content_block_delta", {"index": 0, "delta": {"type": "thinking_delta", "thinking": block["thinking"]}})  # fmt: skip
        yield _event("content_block_delta", {"index": 0, "delta": {"type": "signature_delta", "signature": block["signature"]}})  # fmt: skip
        yield _event("content_block_stop", {"index": 0})
        index = 1
    if text:
        yield _event("content_block_start", {"index": index, "content_block": {"type": "text", "text": ""}})
        # beside a thought or tool calls the text is what is left around them: one piece; else per decoded piece
        whole = thought or gen.tool_calls
        pieces = [text] if whole else [p for p, _, _ in text_pieces(gen, tokenizer) if p]
        for piece in pieces:
            yield _event(
                "content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": piece}}
            )
        yield _event("content_block_stop", {"index": index})
        index += 1
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
