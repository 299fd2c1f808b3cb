"""Recent Responses answers, kept in memory per conversation (one rollout attempt, or one session).

Two things a Responses client relies on a server to remember:

- ``previous_response_id``: a request continues an earlier response: its conversation is that
  response's input items + its output items + the new ``input`` (``instructions`` and ``tools`` are
  not carried over, as in OpenAI's API). Responses are kept unless the request said ``store: false``
  (Codex CLI does, and sends the whole conversation every time); ``item_reference`` items name an
  output item of a kept response.
- what the model wrote for each tool call the proxy answered as a ``custom_tool_call``,
  ``local_shell_call`` or ``tool_search_call`` (responses_tools.py): kept whatever ``store`` says, so
  the item sent back becomes the model's exact call again.

Bounds: ``max_responses`` responses per conversation and ``max_bytes`` (JSON size of their new items,
shared items counted again) over all, least recently used first; ``max_calls`` calls per
conversation; ``max_keys`` conversations. ``forget(key)`` drops a conversation (the proxy calls it when
the token ledger forgets the attempt or session). An id that was dropped, never kept, or belongs to
another conversation is answered 400 ``previous_response_not_found``, as OpenAI answers it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import orjson

from agentloop.proxy.schemas import JSONDict, bad_request

MiB = 1024 * 1024


@dataclass
class _Kept:
    items: list[JSONDict]  # the whole conversation's input items (earlier responses' included)
    output: list[JSONDict]
    nbytes: int


@dataclass
class _Conversation:
    responses: OrderedDict[str, _Kept] = field(default_factory=OrderedDict)
    calls: OrderedDict[str, tuple[Any, str]] = field(default_factory=OrderedDict)  # call_id -> (view, args)
    notes: set[str] = field(default_factory=set)  # what was logged about this conversation


class ResponseStore:
    """Bounded memory of recent responses and tool calls per conversation key (module docstring)."""

    def __init__(
        self, max_keys: int = 4096, max_responses: int = 64, max_calls: int = 512, max_bytes: int = 256 * MiB
    ) -> None:
        if min(max_keys, max_responses, max_calls, max_bytes) < 1:
            raise ValueError(
                f"max_keys, max_responses, max_calls and max_bytes must be >= 1, got "
                f"{max_keys}, {max_responses}, {max_calls}, {max_bytes}"
            )
        self.max_keys, self.max_responses, self.max_calls, self.max_bytes = (
            max_keys, max_responses, max_calls, max_bytes,
        )  # fmt: skip
        self._keys: OrderedDict[str, _Conversation] = OrderedDict()
        self._lru: OrderedDict[tuple[str, str], int] = OrderedDict()  # (key, response id) -> bytes
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._lru)

    def _conversation(self, key: str) -> _Conversation:
        conv = self._keys.get(key)
        if conv is None:
            conv = self._keys[key] = _Conversation()
            while len(self._keys) > self.max_keys:
                self.forget(next(iter(self._keys)))
        self._keys.move_to_end(key)
        return conv

    # ------------------------------------------------------------ previous_response_id, item_reference

    def conversation(self, key: str, response_id: str) -> list[JSONDict]:
        """The items a request that continues ``response_id`` starts with (400 when it is not kept)."""
        conv = self._keys.get(key)
        kept = conv.responses.get(response_id) if conv is not None else None
        if kept is None:
            raise bad_request(
                f"Previous response with id {response_id!r} not found: this proxy keeps the last "
                f"{self.max_responses} responses of each attempt or session that were not sent with "
                "store: false; send the whole conversation in input instead",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        self._lru.move_to_end((key, response_id))
        return [*kept.items, *kept.output]

    def item(self, key: str, item_id: str) -> JSONDict | None:
        """An output item of a kept response, by its id (``item_reference``)."""
        conv = self._keys.get(key)
        for kept in reversed(conv.responses.values()) if conv is not None else ():
            for item in kept.output:
                if item.get("id") == item_id:
                    return item
        return None

    def keep(
        self, key: str, response_id: str, items: list[JSONDict], output: list[JSONDict], new: list[Any]
    ) -> None:
        """Keep a response so a later request may continue it; ``new``: the request's own ``input``
        items (``items`` ends with them), what the response adds to the memory held."""
        conv = self._conversation(key)
        nbytes = len(orjson.dumps(new)) + len(orjson.dumps(output))
        conv.responses[response_id] = _Kept(items, output, nbytes)
        self._lru[(key, response_id)] = nbytes
        self.nbytes += nbytes
        while len(conv.responses) > self.max_responses:
            self._drop(key, next(iter(conv.responses)))
        while self.nbytes > self.max_bytes and len(self._lru) > 1:
            self._drop(*next(iter(self._lru)))

    def _drop(self, key: str, response_id: str) -> None:
        self.nbytes -= self._lru.pop((key, response_id), 0)
        conv = self._keys.get(key)
        if conv is not None:
            conv.responses.pop(response_id, None)

    # ------------------------------------------------------------ the model's calls

    def remember_call(self, key: str, call_id: str, view: Any, arguments: str) -> None:
        """The model wrote ``arguments``; the client got ``view`` (an input, an action, an object)."""
        calls = self._conversation(key).calls
        calls[call_id] = (view, arguments)
        while len(calls) > self.max_calls:
            calls.popitem(last=False)

    def call_arguments(self, key: str, call_id: str, view: Any) -> str | None:
        """The model's arguments for a call the client sent back unchanged; else None."""
        conv = self._keys.get(key)
        found = conv.calls.get(call_id) if conv is not None else None
        return found[1] if found is not None and found[0] == view else None

    def first_note(self, key: str, note: str) -> bool:
        """True the first time ``note`` is made about conversation ``key`` (a log line once, not per call)."""
        notes = self._conversation(key).notes
        if note in notes or len(notes) >= 64:
            return False
        notes.add(note)
        return True

    def forget(self, key: str) -> None:
        conv = self._keys.pop(key, None)
        for response_id in list(conv.responses) if conv is not None else ():
            self.nbytes -= self._lru.pop((key, response_id), 0)
