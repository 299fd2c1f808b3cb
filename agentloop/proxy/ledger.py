"""The token ledger: exact prompt ids for multi-turn conversations (delta tokenization).

Per conversation key (one rollout attempt, or one session), the ledger remembers every call:
its canonical messages, tools, prompt text, prompt ids, response ids and the assistant message
returned. When a new request's messages are an earlier call's messages + the assistant message
that call returned + new messages, the new prompt is::

    earlier prompt_ids + earlier response_ids + encode(closing + new_text)

- ``new_text`` is the template's rendering of the new messages (and the generation prompt): the
  suffix of the full render that follows the render of the conversation up to that assistant turn.
- ``closing`` is what the template writes after the model's last token in that turn and that the
  model did not produce itself:

  * the response ended on an end-of-turn id (``<|im_end|>``): that id is already the last response
    id; ``closing`` is the template's separator after it (``"\\n"`` for ChatML);
  * the response ended on length or a stop string (no end-of-turn id): nothing is appended to the
    response ids; ``closing`` is the template's end-of-turn text + separator (``"<|im_end|>\\n"``),
    tokenized as part of the new prompt (so a trainer masks it as prompt, not as model output).

The model's tokens are never re-tokenized. When this cannot be done exactly, the prompt falls back
to a full render of the messages and the plan carries ``ledger_break`` with the reason:
the history was edited or truncated, the assistant message differs from what was returned, the
tools changed, or the template renders earlier turns differently once more turns follow (e.g. it
strips ``<think>`` from past assistant messages).

One key can hold several conversations (a subagent, a compaction, a title call, parallel tool
branches), so its calls form a tree, not one line. Each call gets an id (``new_call_id``: 1, 2, ...
per key, also for calls the ledger does not keep, such as text completions) and the plan names its
parent (``extends_call``: the call whose prompt + response the prompt starts with; None for a root)
and its ``branch`` as far as it is known now (the adapter decides the rest, agentloop/adapter.py):

- a call that extends another, or continues another's messages where the tokens could not
  (a ledger break after the whole earlier history: the reply was edited, the tools changed, the
  template re-renders): that call's branch;
- a root that offers tools while no earlier call of the key is ``main``: ``"main"``. Not simply
  the first root: Claude Code sends its title and quota calls (no tools, a small model) beside,
  and sometimes before, its first main call;
- any other root: None (a subagent, a compaction or a side call; the adapter tells them apart once
  all the attempt's calls are known).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agentloop.proxy.chat import ChatTemplate
from agentloop.proxy.schemas import JSONDict


@dataclass(frozen=True)
class LedgerEntry:
    """One finished call of a conversation."""

    call_index: int  # the call's id in its key (LLMCall.call_id)
    messages: list[JSONDict]  # canonical messages (see chat.canonical_message)
    tools: list[JSONDict] | None
    prompt_text: str  # template render of ``messages`` with the generation prompt
    prompt_ids: list[int]
    response_ids: list[int]
    response: JSONDict  # canonical assistant message returned
    parent: int | None = None  # the call this one extends (LLMCall.parent_call_id)
    branch: str | None = None  # LLMCall.branch (see the module docstring)


@dataclass(frozen=True)
class PromptPlan:
    """The prompt for one call and how it was built."""

    prompt_ids: list[int]
    prompt_text: str  # full template render (with generation prompt) of the request's messages
    ledger_break: str | None = None  # why delta tokenization was not possible
    extends_call: int | None = None  # call index whose prompt + response this prompt starts with
    delta_tokens: int = 0  # tokens encoded for the new messages only
    branch: str | None = None  # the branch as known now (module docstring); None: the adapter decides


class TokenLedger:
    """Per-conversation call history, bounded (least recently used conversations are dropped)."""

    def __init__(self, max_conversations: int = 10_000, max_calls: int = 256) -> None:
        if max_conversations < 1 or max_calls < 1:
            raise ValueError(
                f"max_conversations and max_calls must be >= 1, got {max_conversations}, {max_calls}"
            )
        self.max_conversations, self.max_calls = max_conversations, max_calls
        self._calls: OrderedDict[str, list[LedgerEntry]] = OrderedDict()
        self._counts: dict[str, int] = {}
        self.on_forget: Callable[[str], None] | None = None  # told of each conversation dropped

    def __len__(self) -> int:
        return len(self._calls)

    def keys(self) -> list[str]:
        """Conversation keys, least recently used first."""
        return list(self._calls)

    def calls(self, key: str) -> list[LedgerEntry]:
        return list(self._calls.get(key, ()))

    def new_call_id(self, key: str) -> int:
        """The next call id of ``key`` (1, 2, ...), taken when a call is recorded: ids stay unique per key
        for calls the ledger does not keep (text completions, a prompt over the context)."""
        index = self._counts.get(key, 0) + 1
        self._counts[key] = index
        self._calls.setdefault(key, [])  # a key with a count is one the sweep and the LRU bound see
        self._calls.move_to_end(key)
        self._trim()
        return index

    def _trim(self) -> None:
        while len(self._calls) > self.max_conversations:
            self.forget(next(iter(self._calls)))

    def forget(self, key: str) -> None:
        self._calls.pop(key, None)
        self._counts.pop(key, None)
        if self.on_forget is not None:
            self.on_forget(key)

    def plan(
        self, key: str, messages: list[JSONDict], tools: list[JSONDict] | None, template: ChatTemplate
    ) -> PromptPlan:
        """The prompt ids for ``messages``: delta on an earlier call when possible, else a full render."""
        full = template.render(messages, tools, add_generation_prompt=True)
        entries = self._calls.get(key)
        reason, continued = None, None
        if entries:
            self._calls.move_to_end(key)
            match = _find_extended(entries, messages, tools)
            if match is not None:
                return _delta(match, messages, tools, template, full)
            reason, continued = _why_no_match(entries, messages, tools)
        if continued is not None:
            branch = continued.branch
        elif tools and not any(e.branch == "main" for e in entries or ()):
            branch = "main"
        else:
            branch = None
        return PromptPlan(
            prompt_ids=template.encode(full), prompt_text=full, ledger_break=reason, branch=branch
        )

    def record(
        self,
        key: str,
        plan: PromptPlan,
        messages: list[JSONDict],
        tools: list[JSONDict] | None,
        response_ids: list[int],
        response: JSONDict,
        call_id: int | None = None,
    ) -> LedgerEntry:
        """Remember a finished call so later calls can extend it; ``call_id``: the id ``new_call_id``
        gave its span (None: take the next one)."""
        index = call_id if call_id is not None else self.new_call_id(key)
        entry = LedgerEntry(
            index, messages, tools, plan.prompt_text, plan.prompt_ids, response_ids, response,
            parent=plan.extends_call, branch=plan.branch,
        )  # fmt: skip
        entries = self._calls.setdefault(key, [])
        self._calls.move_to_end(key)
        entries.append(entry)
        if len(entries) > self.max_calls:
            del entries[0]
        self._trim()
        return entry


def _find_extended(
    entries: list[LedgerEntry], messages: list[JSONDict], tools: list[JSONDict] | None
) -> LedgerEntry | None:
    """The earlier call with the longest history that ``messages`` extends (+ its returned message)."""
    best: LedgerEntry | None = None
    for e in reversed(entries):
        n = len(e.messages)
        if n < len(messages) and (best is None or n > len(best.messages)):
            if messages[n] == e.response and e.tools == tools and messages[:n] == e.messages:
                best = e
    return best


def _common_prefix(a: list[Any], b: list[Any]) -> int:
    i = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        i += 1
    return i


def _why_no_match(
    entries: list[LedgerEntry], messages: list[JSONDict], tools: list[JSONDict] | None
) -> tuple[str | None, LedgerEntry | None]:
    """A reason for the fallback (None when the request is simply a new conversation), and the earlier
    call whose whole history the request continues (None when it starts or rewrites a history)."""
    prefixes = [x for x in entries if x.messages == messages[: len(x.messages)]]
    continued = max(prefixes, key=lambda x: (len(x.messages), x.call_index), default=None)
    if not any(m["role"] == "assistant" for m in messages):
        return None, continued
    e = max(entries, key=lambda x: (_common_prefix(x.messages, messages), x.call_index))
    n, k = len(e.messages), _common_prefix(e.messages, messages)
    if k < n:
        if k == 0 and messages[0] in e.messages[1:]:
            j = e.messages.index(messages[0])
            reason = f"history truncated at the front: messages[0] is messages[{j}] of call {e.call_index}"
        elif k == len(messages):
            reason = (
                f"history truncated: the request has {len(messages)} messages, call {e.call_index} had {n}"
            )
        else:
            reason = f"history edited: messages[{k}] differs from what call {e.call_index} saw"
    elif n >= len(messages):
        reason = f"the request repeats call {e.call_index}'s messages without its response"
    elif messages[n] != e.response:
        reason = f"messages[{n}] differs from the assistant message call {e.call_index} returned"
    elif e.tools != tools:
        reason = f"tools changed since call {e.call_index}"
    else:  # pragma: no cover
        reason = f"the request does not extend any earlier call (closest: call {e.call_index})"
    return reason, continued


def _delta(
    e: LedgerEntry, messages: list[JSONDict], tools: list[JSONDict] | None, template: ChatTemplate, full: str
) -> PromptPlan:
    def fallback(reason: str) -> PromptPlan:  # the request continues call e's messages: e's branch
        return PromptPlan(
            prompt_ids=template.encode(full), prompt_text=full, ledger_break=reason, branch=e.branch
        )

    n = len(e.messages)
    base = template.render(messages[: n + 1], tools, add_generation_prompt=False)
    if not base.startswith(e.prompt_text):
        return fallback(
            f"the template renders call {e.call_index}'s prompt differently once its reply follows"
        )
    if not full.startswith(base):
        return fallback(
            f"the template re-renders earlier turns once more messages follow (e.g. strips <think> from past "
            f"assistant turns); call {e.call_index}'s tokens are not a prefix of this prompt"
        )
    segment = base[len(e.prompt_text) :]  # the assistant turn as the template writes it
    last = e.response_ids[-1] if e.response_ids else None
    ended_on_eot = last is not None and last in template.stop_token_ids
    if ended_on_eot:
        eot = template.tokenizer.convert_ids_to_tokens(last)
        pos = segment.rfind(eot)
    else:
        pos, eot = (
            max((segment.rfind(t), t) for t in template.stop_texts) if template.stop_texts else (-1, "")
        )
    if pos < 0:
        return fallback(f"the template does not close the assistant turn of call {e.call_index} with {eot!r}")
    closing = segment[pos + len(eot) :] if ended_on_eot else segment[pos:]
    delta_ids = template.encode(closing + full[len(base) :], follows_token=True)
    return PromptPlan(
        prompt_ids=e.prompt_ids + e.response_ids + delta_ids,
        prompt_text=full,
        extends_call=e.call_index,
        delta_tokens=len(delta_ids),
        branch=e.branch,
    )
