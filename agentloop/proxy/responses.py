"""OpenAI response bodies (JSON and SSE chunks) from a finished Generation.

Streaming sends the very token ids of the non-streaming answer: the engine contract is one
``generate`` call, and the chunks split its output. Text is decoded incrementally and a chunk is
only sent when its bytes form whole characters (a multi-byte character split over several tokens
waits for its last token), so the concatenated deltas equal the non-streaming content.

Extension fields (when the request has ``return_token_ids: true`` or the ``X-Return-Token-Ids``
header): ``prompt_token_ids`` and ``token_ids`` / ``logprobs`` (the engine's per-token logprobs);
in a stream, the first chunk has ``prompt_token_ids`` and every chunk the ``token_ids`` it covers.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson

from agentloop.proxy.schemas import JSONDict
from agentloop.proxy.service import Generation


class IncrementalDecoder:
    """Token ids -> text deltas, holding back bytes that do not yet form a whole character."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # ids[_prefix:_read] decode to text already emitted (context for the next token)
        self._read = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)  # type: ignore[no-any-return]

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        new_text = self._decode(self.ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return new_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """What is still held back (an incomplete character at the very end)."""
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        new_text = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return new_text[len(prefix_text) :]


def token_logprobs(tokenizer: Any, ids: list[int], logprobs: list[float] | None) -> list[JSONDict]:
    """OpenAI chat ``logprobs.content`` entries (top_logprobs is empty: the engine returns the sampled one)."""
    out = []
    for i, tid in enumerate(ids):
        text = tokenizer.decode([tid])
        out.append(
            {
                "token": text,
                "logprob": logprobs[i] if logprobs else 0.0,
                "bytes": list(text.encode()),
                "top_logprobs": [],
            }
        )
    return out


def _extension(gen: Generation) -> JSONDict:
    return {"prompt_token_ids": gen.prompt_ids, "token_ids": gen.token_ids, "logprobs": gen.logprobs}


def chat_json(gen: Generation, tokenizer: Any, want_logprobs: bool, want_ids: bool) -> bytes:
    message: JSONDict = {"role": "assistant", "content": gen.content}
    if gen.tool_calls:
        message["tool_calls"] = gen.tool_calls
    choice: JSONDict = {"index": 0, "message": message, "logprobs": None, "finish_reason": gen.finish_reason}
    if want_logprobs:
        choice["logprobs"] = {"content": token_logprobs(tokenizer, gen.token_ids, gen.logprobs)}
    body: JSONDict = {
        "id": gen.id,
        "object": "chat.completion",
        "created": gen.created,
        "model": gen.model,
        "choices": [choice],
        "usage": gen.usage,
    }
    if want_ids:
        choice["token_ids"] = gen.token_ids
        body.update(_extension(gen))
    return orjson.dumps(body)


def completion_json(gen: Generation, tokenizer: Any, want_logprobs: bool, want_ids: bool) -> bytes:
    choice: JSONDict = {
        "index": 0,
        "text": gen.content or "",
        "logprobs": None,
        "finish_reason": gen.finish_reason,
    }
    if want_logprobs:
        tokens = [tokenizer.decode([t]) for t in gen.token_ids]
        offsets, pos = [], 0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        choice["logprobs"] = {
            "tokens": tokens,
            "token_logprobs": gen.logprobs,
            "top_logprobs": None,
            "text_offset": offsets,
        }
    body: JSONDict = {
        "id": gen.id,
        "object": "text_completion",
        "created": gen.created,
        "model": gen.model,
        "choices": [choice],
        "usage": gen.usage,
    }
    if want_ids:
        choice["token_ids"] = gen.token_ids
        body.update(_extension(gen))
    return orjson.dumps(body)


def _sse(obj: JSONDict) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def text_pieces(gen: Generation, tokenizer: Any) -> Iterator[tuple[str, list[int], list[float]]]:
    """(text delta, token ids, their logprobs) per token that completes text; the rest goes last."""
    content = gen.content or ""
    dec = IncrementalDecoder(tokenizer)
    sent, ids, lps = 0, [], []
    lp = gen.logprobs or [0.0] * len(gen.token_ids)
    for i, tid in enumerate(gen.text_ids):
        ids.append(tid)
        lps.append(lp[i])
        delta = dec.push(tid)[: max(len(content) - sent, 0)]  # a cut stop string is never sent
        if delta:
            sent += len(delta)
            yield delta, ids, lps
            ids, lps = [], []
    tail = dec.flush()[: max(len(content) - sent, 0)]
    rest = len(gen.text_ids)
    yield tail, ids + gen.token_ids[rest:], lps + lp[rest:]


def chat_chunks(
    gen: Generation, tokenizer: Any, want_logprobs: bool, want_ids: bool, include_usage: bool
) -> Iterator[bytes]:
    head = {"id": gen.id, "object": "chat.completion.chunk", "created": gen.created, "model": gen.model}

    def chunk(delta: JSONDict, ids: list[int], lps: list[float], finish: str | None = None) -> JSONDict:
        choice: JSONDict = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        if want_logprobs and ids:
            choice["logprobs"] = {"content": token_logprobs(tokenizer, ids, lps)}
        obj: JSONDict = {**head, "choices": [choice]}
        if want_ids:
            obj["token_ids"] = ids
            choice["token_ids"] = ids
        if include_usage:
            obj["usage"] = None
        return obj

    first = chunk({"role": "assistant", "content": ""}, [], [])
    if want_ids:
        first["prompt_token_ids"] = gen.prompt_ids
    yield _sse(first)
    if gen.tool_calls:
        lp = gen.logprobs or [0.0] * len(gen.token_ids)
        delta: JSONDict = {"content": gen.content} if gen.content else {}
        delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(gen.tool_calls)]
        yield _sse(chunk(delta, gen.token_ids, lp))
        yield _sse(chunk({}, [], [], gen.finish_reason))
    else:
        pieces = list(text_pieces(gen, tokenizer))
        for text, ids, lps in pieces[:-1]:
            yield _sse(chunk({"content": text}, ids, lps))
        text, ids, lps = pieces[-1]
        yield _sse(chunk({"content": text} if text else {}, ids, lps, gen.finish_reason))
    if include_usage:
        yield _sse({**head, "choices": [], "usage": gen.usage})
    yield b"data: [DONE]\n\n"


def completion_chunks(
    gen: Generation, tokenizer: Any, want_ids: bool, include_usage: bool
) -> Iterator[bytes]:
    head = {"id": gen.id, "object": "text_completion", "created": gen.created, "model": gen.model}
    pieces = list(text_pieces(gen, tokenizer))
    for i, (text, ids, _) in enumerate(pieces):
        last = i == len(pieces) - 1
        choice: JSONDict = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": gen.finish_reason if last else None,
        }
        obj: JSONDict = {**head, "choices": [choice]}
        if want_ids:
            obj["token_ids"] = ids
            if i == 0:
                obj["prompt_token_ids"] = gen.prompt_ids
        yield _sse(obj)
    if include_usage:
        yield _sse({**head, "choices": [], "usage": gen.usage})
    yield b"data: [DONE]\n\n"
