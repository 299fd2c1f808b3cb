"""The call tree the proxy records: call ids, parents and branches, through a real proxy and the tiny
model (a side call, a main conversation, a subagent, a fork), and the ledger's branch rules."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from agentloop.adapter import merge_turns, spans_to_triplets
from agentloop.engine.torch.engine import TorchEngine
from agentloop.proxy.chat import ChatTemplate
from agentloop.proxy.ledger import TokenLedger
from agentloop.store.memory import MemoryStore
from agentloop.types import LLMCall
from tests.proxy.conftest import attempt_url, new_attempt, running_proxy

MAIN_TOOLS = [{"type": "function", "function": {"name": "Task", "description": "run a subagent",
               "parameters": {"type": "object", "properties": {"prompt": {"type": "string"}}}}}]  # fmt: skip
SUB_TOOLS = [{"type": "function", "function": {"name": "Grep", "description": "search files",
              "parameters": {"type": "object", "properties": {"pattern": {"type": "string"}}}}}]  # fmt: skip
MAIN = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "Fix the bug."}]
SUB = [{"role": "system", "content": "You search code."}, {"role": "user", "content": "Find add()."}]


@pytest.fixture
async def engine(tiny_model_dir: Path) -> AsyncIterator[TorchEngine]:
    eng = TorchEngine(tiny_model_dir, max_context=1024, max_batch_size=4)
    await eng.start()
    try:
        yield eng
    finally:
        await eng.stop()


async def test_side_main_subagent_and_fork_are_recorded_as_a_tree(engine: TorchEngine, oai: Any) -> None:
    store = MemoryStore()
    async with running_proxy(engine, store) as proxy:
        att = await new_attempt(store)
        client = oai(attempt_url(proxy, att))
        seeds = iter(range(10, 100))

        async def ask(messages: list[Any], tools: Any = None, model: str = "main-model") -> list[Any]:
            kwargs: Any = {"tools": tools} if tools else {}
            r = await client.chat.completions.create(model=model, messages=messages, seed=next(seeds),
                                                     temperature=1.0, max_tokens=8, **kwargs)  # fmt: skip
            return [*messages, r.choices[0].message.model_dump(exclude_none=True)]

        with anyio.fail_after(120):
            await ask([{"role": "user", "content": "quota"}], model="small-fast")  # 1: side, before main
            main = await ask(MAIN, MAIN_TOOLS)  # 2: the main root (it offers tools)
            sub = await ask(SUB, SUB_TOOLS)  # 3: the subagent's root
            await ask([*sub, {"role": "tool", "tool_call_id": "g", "content": "m.py:3"}], SUB_TOOLS)  # 4
            await ask([*main, {"role": "tool", "tool_call_id": "t", "content": "in m.py"}], MAIN_TOOLS)  # 5
            await ask([*main, {"role": "tool", "tool_call_id": "t", "content": "not found"}], MAIN_TOOLS)  # 6
    spans = await store.query_spans(att.rollout_id)
    calls: list[LLMCall] = [s.payload for s in spans]  # type: ignore[misc]
    assert [(c.call_id, c.parent_call_id, c.branch) for c in calls] == [
        (1, None, None),  # a root without tools: the adapter decides (side)
        (2, None, "main"),
        (3, None, None),  # a later root: the adapter decides (subagent)
        (4, 3, None),
        (5, 2, "main"),
        (6, 2, "main"),  # a fork: the second call extending call 2
    ]
    assert all(c.ledger_break is None for c in calls)
    triplets = spans_to_triplets(spans).triplets
    assert [t.metadata["branch"] for t in triplets] == [
        "side",
        "main",
        "subagent",
        "subagent",
        "main",
        "main",
    ]
    quota, main_sample, sub_sample, fork = merge_turns(triplets)
    c = calls
    assert (quota.prompt_ids, quota.response_ids) == (c[0].prompt_ids, c[0].response_ids)
    assert main_sample.prompt_ids == c[1].prompt_ids
    tool_tokens = c[4].prompt_ids[len(c[1].prompt_ids) + len(c[1].response_ids) :]
    assert main_sample.response_ids == [*c[1].response_ids, *tool_tokens, *c[4].response_ids]
    assert main_sample.response_mask == [1] * len(c[1].response_ids) + [0] * len(tool_tokens) + [1] * len(
        c[4].response_ids
    )
    sub_tool = c[3].prompt_ids[len(c[2].prompt_ids) + len(c[2].response_ids) :]
    assert (sub_sample.prompt_ids, sub_sample.response_ids) == (
        c[2].prompt_ids,
        [*c[2].response_ids, *sub_tool, *c[3].response_ids],
    )
    assert (fork.prompt_ids, fork.response_ids) == (c[5].prompt_ids, c[5].response_ids)  # its own prompt
    assert [k["source"] for s in (main_sample, sub_sample) for k in s.metadata["calls"]] == [1, 4, 2, 3]


async def test_text_completions_and_over_context_calls_take_ids_too(engine: TorchEngine, oai: Any) -> None:
    store = MemoryStore()
    async with running_proxy(engine, store) as proxy:
        att = await new_attempt(store)
        client = oai(attempt_url(proxy, att))
        with anyio.fail_after(60):
            await client.completions.create(model="m", prompt="Once upon", max_tokens=4, seed=1)
            await client.chat.completions.create(model="m", messages=MAIN, max_tokens=4, seed=2)
            with pytest.raises(Exception, match="context"):
                await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "x " * 2000}]
                )
            await client.chat.completions.create(model="m", messages=SUB, max_tokens=4, seed=3)
    calls: list[LLMCall] = [s.payload for s in await store.query_spans(att.rollout_id)]  # type: ignore[misc]
    assert [(c.call_id, c.error) for c in calls] == [
        (1, None),
        (2, None),
        (3, "context_length_exceeded"),
        (4, None),
    ]


def _record(ledger: TokenLedger, template: ChatTemplate, messages: list[Any], tools: Any, reply: str) -> Any:
    plan = ledger.plan("k", messages, tools, template)
    ids = [*template.tokenizer.encode(reply, add_special_tokens=False), template.tokenizer.eos_token_id]
    entry = ledger.record("k", plan, messages, tools, ids, {"role": "assistant", "content": reply})
    return plan, entry


def test_the_ledger_records_the_branches_it_can_decide(tokenizer: Any) -> None:
    template, ledger = ChatTemplate(tokenizer), TokenLedger()
    tools = [{"name": "Task", "description": "", "parameters": {"type": "object", "properties": {}}}]
    title, _ = _record(ledger, template, [{"role": "user", "content": "title?"}], None, "A title")
    assert (title.branch, title.extends_call) == (None, None)  # no tools: main or a side call, later
    main, first = _record(ledger, template, MAIN, tools, "On it.")
    assert (main.branch, first.call_index) == ("main", 2)
    turn = [*MAIN, {"role": "assistant", "content": "On it."}, {"role": "user", "content": "go"}]
    extends, _ = _record(ledger, template, turn, tools, "Done.")
    assert (extends.branch, extends.extends_call, extends.ledger_break) == ("main", 2, None)
    # the tools changed: no token delta, but the same conversation goes on: main
    more = [*turn, {"role": "assistant", "content": "Done."}, {"role": "user", "content": "more"}]
    changed, _ = _record(ledger, template, more, None, "Ok.")
    assert changed.ledger_break and changed.ledger_break.startswith("tools changed")
    assert (changed.branch, changed.extends_call) == ("main", None)
    # a later root, even with tools: not main (a subagent or a compaction: the adapter decides)
    sub, _ = _record(ledger, template, SUB, tools, "Found.")
    assert (sub.branch, sub.extends_call) == (None, None)
    # a rewritten history starts no conversation of its own: the adapter decides (a compaction)
    edited = [MAIN[0], {"role": "user", "content": "Summary: fix the bug."}, *turn[2:]]
    rewritten, _ = _record(ledger, template, edited, tools, "Ok.")
    assert rewritten.ledger_break and rewritten.ledger_break.startswith("history edited")
    assert rewritten.branch is None
    assert ledger.new_call_id("k") == 7 and ledger.new_call_id("other") == 1
