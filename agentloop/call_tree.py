"""The call tree of one attempt: each LLM call's id, parent and branch kind.

One attempt can hold several conversations, so its calls form a tree: each call's parent is
the call whose prompt + response its prompt starts with (``LLMCall.parent_call_id``, recorded by the
proxy's token ledger; for spans recorded before call ids, the earlier call with the longest such
prefix, and ``call_id`` is then ``call_index + 1``). A root whose messages start with all of an earlier
call's messages continues that conversation where its tokens could not (a ledger break). Each call's
``branch`` is the one recorded when it is set (agentloop/proxy/ledger.py), else its parent's (or the
call's it continues), else, for a root:

- ``main``: the main root: the first root recorded as main, else the first root that offers tools
  (Claude Code sends title and quota calls without tools beside its first main call), else the first
  root with more than one call, else the first root;
- ``compaction``: a later root with the main conversation's system prompt and tools (those of the
  latest main or compaction call before it) that restates it: fewer messages than that call, a
  ``history edited`` / ``history truncated`` ledger break, or a user message that speaks of a summary
  or of a conversation continued (Claude Code continues a compacted session with the same system
  prompt and tools and one user message holding the summary);
- ``side``: a root whose calls offer no tools and that is one call or names another model than the main
  root (titles, summaries, quota checks: Claude Code's small fast model);
- ``subagent``: any other root: its own conversation (Claude Code's Task tool: another system prompt,
  tools, several calls; sometimes another model).

A fork (a second call extending the same call: parallel tool branches, a resampled turn) keeps its
parent's branch and starts a sample of its own (``merge_turns``). Rewards follow time, not branches:
a Reward span belongs to the call before it in time, and ``per_call``'s discount counts calls in time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from agentloop.types import LLMCall

__all__ = ["Node", "call_tree"]

_SUMMARY = re.compile(r"summar(?:y|ies|ize|ized|ise|ised)|continued from a previous conversation", re.I)
_REWRITTEN = ("history edited", "history truncated")  # ledger breaks of a rewritten history (ledger.py)


@dataclass(frozen=True)
class Node:
    """One call's place in its attempt's tree."""

    call_id: int
    parent_call_id: int | None
    branch: str


def call_tree(calls: list[LLMCall]) -> list[Node]:
    """Each call's id, parent id and branch, calls in time order (rules: the module docstring)."""
    recorded = [c.call_id for c in calls if c.call_id is not None]
    free = max(recorded) + 1 if recorded else 1  # spans without ids: call_index + 1, or past the recorded
    ids: list[int] = []
    parent: list[int | None] = []  # the parent's position in ``calls``
    # call id -> the latest call with it (a ledger dropped under load starts its ids again)
    by_id: dict[int, int] = {}
    for k, c in enumerate(calls):
        if c.call_id is not None:
            ids.append(c.call_id)
            parent.append(by_id.get(c.parent_call_id) if c.parent_call_id is not None else None)
        else:
            ids.append(free if recorded else k + 1)
            free += 1 if recorded else 0
            parent.append(_extended(calls, k))
        by_id[ids[k]] = k
    # the call each call takes its branch from: its parent, else the call whose messages it continues
    anchor = [
        p if p is not None or c.branch else _continued(calls, k)
        for k, (c, p) in enumerate(zip(calls, parent, strict=True))
    ]
    top = list(range(len(calls)))  # the root of each call's tree
    for k, a in enumerate(anchor):
        if a is not None:
            top[k] = top[a]
    roots = [k for k, a in enumerate(anchor) if a is None]  # calls[0] is always one
    size = {r: top.count(r) for r in roots}
    tools = {r: any(calls[k].tools for k in range(len(calls)) if top[k] == r) for r in roots}
    main = next(
        (r for r in roots if calls[r].branch == "main"),
        next((r for r in roots if calls[r].tools), next((r for r in roots if size[r] > 1), 0)),
    )
    branches: list[str] = []
    for k, c in enumerate(calls):
        a = anchor[k]
        if c.branch is not None:
            branches.append(c.branch)
        elif a is not None:
            branches.append(branches[a])
        elif k == main:
            branches.append("main")
        else:
            latest = next((j for j in range(k - 1, -1, -1) if branches[j] in ("main", "compaction")), None)
            if latest is not None and _restates(c, calls[latest]):
                branches.append("compaction")
            elif not tools[k] and (size[k] == 1 or c.model != calls[main].model):
                branches.append("side")
            else:
                branches.append("subagent")
    return [
        Node(ids[k], c.parent_call_id if c.call_id is not None else (None if p is None else ids[p]), b)
        for k, (c, p, b) in enumerate(zip(calls, parent, branches, strict=True))
    ]


def _extended(calls: list[LLMCall], k: int) -> int | None:
    """For spans without ids: the earlier call with the longest prompt + response that call k's prompt
    starts with (the most recent of equals), as the token ledger builds a delta."""
    prompt, best, best_len = calls[k].prompt_ids, None, 0
    for j in range(k - 1, -1, -1):
        c = calls[j]
        n = len(c.prompt_ids) + len(c.response_ids)
        if c.response_ids and best_len < n <= len(prompt) and prompt[: len(c.prompt_ids)] == c.prompt_ids:
            if prompt[len(c.prompt_ids) : n] == c.response_ids:
                best, best_len = j, n
    return best


def _continued(calls: list[LLMCall], k: int) -> int | None:
    """The earlier call whose messages call k's messages start with (the longest, then the latest):
    the conversation call k continues where the ledger could not extend its tokens."""
    messages, best, best_len = calls[k].messages, None, 0
    for j in range(k - 1, -1, -1):
        n = len(calls[j].messages)
        if best_len < n <= len(messages) and messages[:n] == calls[j].messages:
            best, best_len = j, n
    return best


def _system(call: LLMCall) -> Any:
    first = call.messages[0] if call.messages else {}
    return first.get("content") if first.get("role") in ("system", "developer") else None


def _text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def _restates(root: LLMCall, main: LLMCall) -> bool:
    """Whether a later root restates the main conversation (``main``: its latest call): a compaction."""
    if not root.messages or _system(root) != _system(main) or root.tools != main.tools:
        return False
    return (
        len(root.messages) < len(main.messages)
        or (root.ledger_break or "").startswith(_REWRITTEN)
        or any(m.get("role") == "user" and _SUMMARY.search(_text(m)) for m in root.messages)
    )
