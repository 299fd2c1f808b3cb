"""Adapter: the call tree of an attempt and its branches (main, subagent, compaction, side, forks), and
merge_turns giving one sample per branch; hand-built spans in the shapes Claude Code sends."""

from __future__ import annotations

from typing import Any

from agentloop.adapter import merge_turns, spans_to_triplets
from agentloop.types import LLMCall, Reward, Span, Triplet

RID, AID = "ro-branches", "at-branches"

MAIN_SYSTEM = "You are Claude Code, Anthropic's official CLI for Claude. Use the tools to help the user."
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}}
    for name in ("Read", "Edit", "Task")
]
SUB_TOOLS = TOOLS[:1]
TASK = {"role": "user", "content": "Fix the failing test in tests/test_math.py"}


def _asst(text: str, tool: str | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool:
        message["tool_calls"] = [
            {"id": "c1", "type": "function", "function": {"name": tool, "arguments": "{}"}}
        ]
    return message


class _Attempt:
    """The spans of one attempt, in sequence order."""

    def __init__(self) -> None:
        self.spans: list[Span] = []

    def call(
        self,
        prompt: list[int],
        response: list[int],
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        model: str = "claude-sonnet-4-5",
        **tree: Any,  # call_id, parent_call_id, branch, ledger_break
    ) -> _Attempt:
        call = LLMCall(prompt_ids=prompt, response_ids=response, response_logprobs=[-0.5] * len(response),
                       messages=messages, tools=tools, model=model, finish_reason="stop", **tree)  # fmt: skip
        return self._add(call)

    def reward(self, value: float) -> _Attempt:
        return self._add(Reward(value=value))

    def _add(self, payload: Any) -> _Attempt:
        self.spans.append(
            Span(rollout_id=RID, attempt_id=AID, sequence_id=len(self.spans) + 1, payload=payload)
        )
        return self

    def triplets(self, **kwargs: Any) -> list[Triplet]:
        return spans_to_triplets(self.spans, **kwargs).triplets


def _tree(triplets: list[Triplet]) -> list[tuple[int, int | None, str]]:
    return [(t.metadata["call_id"], t.metadata["parent_call_id"], t.metadata["branch"]) for t in triplets]


def _subagent_attempt(recorded: bool) -> _Attempt:
    """Main call 1 (tools), a title call beside it (small model, no tools), a Task subagent of two calls
    (its own system prompt and tools), then main call 2 with the subagent's result; ``recorded``: with
    the ids and branches the proxy records (else spans from before call ids)."""

    def ids(call_id: int, parent: int | None, branch: str | None) -> dict[str, Any]:
        return {"call_id": call_id, "parent_call_id": parent, "branch": branch} if recorded else {}

    main1 = [{"role": "system", "content": MAIN_SYSTEM}, TASK]
    sub1 = [{"role": "system", "content": "You are a file search specialist."},
            {"role": "user", "content": "Find where add() is defined"}]  # fmt: skip
    title = [{"role": "system", "content": "Write a 3-7 word title for this conversation."}, TASK]
    return (
        _Attempt()
        .call([1, 2, 3], [4, 5], main1, TOOLS, **ids(1, None, "main"))
        .call([30, 31], [32], title, None, "claude-haiku-4-5", **ids(2, None, None))
        .call([60, 61], [62, 63], sub1, SUB_TOOLS, **ids(3, None, None))
        .reward(0.25)  # per-call rewards follow the call before them, in time
        .call(
            [60, 61, 62, 63, 64],
            [65],
            [*sub1, _asst("", "Read"), {"role": "tool", "content": "def add"}],
            SUB_TOOLS,
            **ids(4, 3, None),
        )
        .call(
            [1, 2, 3, 4, 5, 6, 7],
            [8, 9],
            [*main1, _asst("", "Task"), {"role": "tool", "content": "in m.py"}],
            TOOLS,
            **ids(5, 1, "main"),
        )
        .reward(1.0)
    )


def test_recorded_ids_give_main_side_and_subagent_and_one_sample_per_branch() -> None:
    triplets = _subagent_attempt(recorded=True).triplets()
    assert _tree(triplets) == [
        (1, None, "main"),
        (2, None, "side"),  # one call, no tools, the small model
        (3, None, "subagent"),  # its own system prompt, tools, two calls
        (4, 3, "subagent"),
        (5, 1, "main"),
    ]
    assert [t.metadata["call_index"] for t in triplets] == [0, 1, 2, 3, 4]  # time order, unchanged
    main, title, sub = merge_turns(triplets)
    assert (main.prompt_ids, main.response_ids, main.response_mask) == (
        [1, 2, 3],
        [4, 5, 6, 7, 8, 9],
        [1, 1, 0, 0, 1, 1],
    )
    assert main.response_logprobs == [-0.5, -0.5, 0.0, 0.0, -0.5, -0.5]
    assert (title.prompt_ids, title.response_ids) == ([30, 31], [32])
    assert (sub.prompt_ids, sub.response_ids, sub.response_mask) == ([60, 61], [62, 63, 64, 65], [1, 1, 0, 1])
    assert [c["source"] for c in main.metadata["calls"]] == [0, 4]
    assert [c["source"] for c in sub.metadata["calls"]] == [2, 3]
    assert [main.metadata["branch"], title.metadata["branch"], sub.metadata["branch"]] == [
        "main",
        "side",
        "subagent",
    ]


def test_rewards_stay_with_the_call_they_follow_in_time() -> None:
    triplets = _subagent_attempt(recorded=True).triplets(strategy="per_call", discount=0.0)
    assert [t.metadata["call_reward"] for t in triplets] == [0.0, 0.0, 0.25, 0.0, 1.0]
    assert {t.metadata["attempt_reward"] for t in triplets} == {1.25}
    main, _, sub = merge_turns(triplets)
    assert [c["reward"] for c in main.metadata["calls"]] == [0.0, 1.0]
    assert [c["reward"] for c in sub.metadata["calls"]] == [0.25, 0.0]
    assert (main.reward, sub.reward) == (1.0, 0.0)  # the last call of the branch: its own reward


def test_spans_without_ids_fall_back_to_prompt_prefixes() -> None:
    """Spans recorded before call ids: ids are call_index + 1, parents the longest prompt + response the
    prompt starts with, branches by the same rules (main: the first root that offers tools)."""
    triplets = _subagent_attempt(recorded=False).triplets()
    assert _tree(triplets) == [(1, None, "main"), (2, None, "side"), (3, None, "subagent"),
                               (4, 3, "subagent"), (5, 1, "main")]  # fmt: skip
    assert [t.response_ids for t in merge_turns(triplets)] == [[4, 5, 6, 7, 8, 9], [32], [62, 63, 64, 65]]


def test_a_side_call_before_the_first_main_call_is_not_main() -> None:
    """Claude Code may send its quota check (the small model, no tools) before the main conversation."""
    quota = [{"role": "user", "content": "quota"}]
    triplets = (
        _Attempt()
        .call([70], [71], quota, None, "claude-haiku-4-5")
        .call([1, 2], [3], [{"role": "system", "content": MAIN_SYSTEM}, TASK], TOOLS)
        .triplets()
    )
    assert _tree(triplets) == [(1, None, "side"), (2, None, "main")]


def _compaction_attempt(**root: Any) -> list[Triplet]:
    """Main calls 1-2; the summary request (another system prompt, no tools); then the compacted
    conversation (main's system prompt and tools, one user message with the summary) and its next call."""
    main1 = [{"role": "system", "content": MAIN_SYSTEM}, TASK]
    main2 = [*main1, _asst("", "Read"), {"role": "tool", "content": "def add(a, b): return a - b"}]
    summarise = [{"role": "system", "content": "You are a helpful AI assistant tasked with summarizing conversations."},
                 *main2[1:], {"role": "user", "content": "Create a detailed summary of the conversation so far."}]  # fmt: skip
    summary = root.pop("summary", "This session is being continued from a previous conversation that ran out "
                                  "of context. The conversation is summarized below: add() subtracts.")  # fmt: skip
    compacted = root.pop(
        "messages", [{"role": "system", "content": MAIN_SYSTEM}, {"role": "user", "content": summary}]
    )
    return (
        _Attempt()
        .call([1, 2], [3], main1, TOOLS, call_id=1, branch="main")
        .call([1, 2, 3, 4], [5], main2, TOOLS, call_id=2, parent_call_id=1, branch="main")
        .call([40, 41], [42], summarise, None, "claude-haiku-4-5", call_id=3)
        .call([80, 81], [82], compacted, TOOLS, call_id=4, **root)
        .call(
            [80, 81, 82, 83],
            [84],
            [*compacted, _asst("", "Edit"), {"role": "tool", "content": "ok"}],
            TOOLS,
            call_id=5,
            parent_call_id=4,
        )
        .reward(1.0)
        .triplets()
    )


def test_a_compacted_conversation_is_its_own_branch_and_sample() -> None:
    triplets = _compaction_attempt()
    assert _tree(triplets) == [(1, None, "main"), (2, 1, "main"), (3, None, "side"),
                               (4, None, "compaction"), (5, 4, "compaction")]  # fmt: skip
    assert [(t.prompt_ids, t.response_ids) for t in merge_turns(triplets)] == [
        ([1, 2], [3, 4, 5]),
        ([40, 41], [42]),
        ([80, 81], [82, 83, 84]),
    ]


def test_compaction_is_told_by_fewer_messages_a_rewritten_history_or_a_summary() -> None:
    # fewer messages than the main conversation's latest call, no summary wording
    assert _tree(_compaction_attempt(summary="Go on with the fix."))[3][2] == "compaction"
    # more messages than main's latest call and no summary: a rewritten history only when the ledger says so
    rewritten = [{"role": "system", "content": MAIN_SYSTEM}, {"role": "user", "content": "Fix tests/test_math.py"},
                 _asst("", "Read"), {"role": "tool", "content": "(cut)"}, {"role": "user", "content": "go on"}]  # fmt: skip
    edited = "history edited: messages[1] differs from what call 2 saw"
    assert _tree(_compaction_attempt(messages=rewritten, ledger_break=edited))[3][2] == "compaction"
    assert _tree(_compaction_attempt(messages=rewritten))[3][2] == "subagent"
    # another system prompt: not the main conversation restated, but a subagent
    other = _Attempt().call(
        [1], [2], [{"role": "system", "content": MAIN_SYSTEM}, TASK], TOOLS, call_id=1, branch="main"
    )
    other.call([1, 2, 3], [4], [{"role": "system", "content": MAIN_SYSTEM}, TASK, _asst("", "Task"),
               {"role": "tool", "content": "x"}], TOOLS, call_id=2, parent_call_id=1, branch="main")  # fmt: skip
    other.call([9], [10], [{"role": "system", "content": "You review code."}, {"role": "user", "content": "Summary?"}],
               SUB_TOOLS, call_id=3)  # fmt: skip
    assert _tree(other.triplets())[2] == (3, None, "subagent")


def test_parallel_tool_branches_fork_into_their_own_samples() -> None:
    """Two calls extend call 1 (one per tool result): the second is a fork and starts a new sample from
    its own prompt; a call extending the fork joins the fork's sample."""
    m1 = [{"role": "system", "content": MAIN_SYSTEM}, TASK]
    fork = [*m1, _asst("", "Read")]
    triplets = (
        _Attempt()
        .call([1, 2], [3], m1, TOOLS, call_id=1, branch="main")
        .call(
            [1, 2, 3, 4],
            [5],
            [*fork, {"role": "tool", "content": "a"}],
            TOOLS,
            call_id=2,
            parent_call_id=1,
            branch="main",
        )
        .call(
            [1, 2, 3, 6],
            [7],
            [*fork, {"role": "tool", "content": "b"}],
            TOOLS,
            call_id=3,
            parent_call_id=1,
            branch="main",
        )
        .call(
            [1, 2, 3, 6, 7, 8],
            [9],
            [*fork, {"role": "tool", "content": "b"}, _asst("b"), TASK],
            TOOLS,
            call_id=4,
            parent_call_id=3,
            branch="main",
        )
        .reward(1.0)
        .triplets()
    )
    assert _tree(triplets) == [(1, None, "main"), (2, 1, "main"), (3, 1, "main"), (4, 3, "main")]
    first, second = merge_turns(triplets)
    assert (first.prompt_ids, first.response_ids, first.response_mask) == ([1, 2], [3, 4, 5], [1, 0, 1])
    assert (second.prompt_ids, second.response_ids, second.response_mask) == (
        [1, 2, 3, 6],
        [7, 8, 9],
        [1, 0, 1],
    )
    assert [c["source"] for c in second.metadata["calls"]] == [2, 3]
    # without ids (older spans), prefix matching forks the same way
    plain = [t.model_copy(update={"metadata": {k: v for k, v in t.metadata.items() if k not in ("call_id", "parent_call_id")}})
             for t in triplets]  # fmt: skip
    assert [t.response_ids for t in merge_turns(plain)] == [[3, 4, 5], [7, 8, 9]]


def test_a_ledger_break_in_the_main_conversation_stays_main() -> None:
    """A root whose messages continue an earlier call's (the template re-renders past turns, so the
    tokens could not be extended) is the same conversation: same branch, a new sample."""
    m1 = [{"role": "system", "content": MAIN_SYSTEM}, TASK]
    triplets = (
        _Attempt()
        .call([1, 2], [3], m1, TOOLS)
        .call([20, 21], [22], [{"role": "system", "content": "Title?"}, TASK], None, "claude-haiku-4-5")
        .call([1, 9, 4], [5], [*m1, _asst("<think>hm</think>ok"), TASK], TOOLS)  # no token prefix
        .triplets()
    )
    assert _tree(triplets) == [(1, None, "main"), (2, None, "side"), (3, None, "main")]
    assert [t.response_ids for t in merge_turns(triplets)] == [[3], [22], [5]]


def test_merge_turns_keeps_a_branch_apart_when_its_parent_is_missing_or_over_the_budget() -> None:
    att = {"rollout_id": "r", "attempt_id": "a"}

    def trip(prompt: list[int], resp: list[int], call_id: int, parent: int | None) -> Triplet:
        return Triplet(prompt_ids=prompt, response_ids=resp, reward=1.0,
                       metadata={**att, "call_id": call_id, "parent_call_id": parent})  # fmt: skip

    # call 2 failed (no triplet): call 3 names it and starts its own sample, though its tokens extend call 1
    calls = [trip([1], [2], 1, None), trip([1, 2, 3], [4], 3, 2)]
    assert [t.response_ids for t in merge_turns(calls)] == [[2], [4]]
    # a recorded root whose tokens do extend a sample (a ledger break whose full render came out the same)
    assert [t.response_ids for t in merge_turns([trip([1], [2], 1, None), trip([1, 2], [3], 2, None)])] == [
        [2, 3]
    ]
    # over max_tokens: the call starts a new sample from its own prompt
    chain = [trip([1], [2], 1, None), trip([1, 2, 3], [4], 2, 1), trip([1, 2, 3, 4, 5], [6], 3, 2)]
    split = merge_turns(chain, max_tokens=5)
    assert [(t.prompt_ids, t.response_ids) for t in split] == [([1], [2, 3, 4]), ([1, 2, 3, 4, 5], [6])]
    assert [t.response_ids for t in merge_turns(chain, max_tokens=6)] == [[2, 3, 4, 5, 6]]
