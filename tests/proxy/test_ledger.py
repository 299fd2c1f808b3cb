"""Token ledger: delta tokenization on SmolLM2's template, fallbacks with a reasoning-stripping template."""

from __future__ import annotations

import json
from typing import Any

import anyio

from agentloop.proxy.chat import ChatTemplate
from agentloop.proxy.ledger import TokenLedger
from agentloop.store.memory import MemoryStore
from agentloop.types import LLMCall
from tests.proxy.conftest import attempt_url, new_attempt, running_proxy
from tests.proxy.engines import EchoEngine

TOOLS = [{"type": "function", "function": {"name": "calc", "description": "evaluate arithmetic",
          "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}}]  # fmt: skip

# Qwen-style: reasoning inside <think>...</think> is dropped from every assistant turn but the last.
STRIP_THINK_TEMPLATE = (
    "{% for m in messages %}"
    "{% set content = m['content'] %}"
    "{% if m['role'] == 'assistant' and not loop.last and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def scripted(replies: list[str]) -> Any:
    it = iter(replies)
    return lambda prompt_ids, sampling: next(it)


async def _spans(store: MemoryStore, rollout_id: str) -> list[LLMCall]:
    return [s.payload for s in await store.query_spans(rollout_id)]  # type: ignore[misc]


async def test_three_turns_with_a_tool_call_extend_the_exact_tokens(tokenizer: Any, oai: Any) -> None:
    call_text = '<tool_call>\n{"name": "calc", "arguments": {"expr": "2+3"}}\n</tool_call>'
    engine = EchoEngine(tokenizer, reply=scripted([call_text, "It is 5.", "Bye!"]))
    store = MemoryStore()
    async with running_proxy(engine, store) as proxy:
        att = await new_attempt(store)
        client = oai(attempt_url(proxy, att))
        messages: list[Any] = [{"role": "user", "content": "What is 2+3?"}]
        with anyio.fail_after(20):
            r1 = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)  # type: ignore[arg-type]
            msg = r1.choices[0].message
            assert r1.choices[0].finish_reason == "tool_calls" and msg.content is None
            assert msg.tool_calls is not None and msg.tool_calls[0].function.name == "calc"
            assert json.loads(msg.tool_calls[0].function.arguments) == {"expr": "2+3"}
            messages += [msg.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "5"}]  # fmt: skip
            r2 = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)  # type: ignore[arg-type]
            messages += [{"role": "assistant", "content": r2.choices[0].message.content},
                         {"role": "user", "content": "Thanks"}]  # fmt: skip
            await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)  # type: ignore[arg-type]
    c1, c2, c3 = await _spans(store, att.rollout_id)
    for call, engine_call in zip((c1, c2, c3), engine.calls, strict=True):
        assert engine_call.output is not None
        assert call.prompt_ids == engine_call.prompt_ids and call.response_ids == engine_call.output.token_ids
        assert call.ledger_break is None and not call.tool_call_parse_error
    assert c1.response_ids == [*tokenizer.encode(call_text, add_special_tokens=False), tokenizer.eos_token_id]
    assert "<tools>" in tokenizer.decode(
        c1.prompt_ids
    )  # SmolLM2's template has no tools: hermes system block
    head = c1.prompt_ids + c1.response_ids
    assert c2.prompt_ids[: len(head)] == head
    assert (
        tokenizer.decode(c2.prompt_ids[len(head) :])
        == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    )
    head2 = c2.prompt_ids + c2.response_ids
    assert c3.prompt_ids[: len(head2)] == head2
    assert (
        tokenizer.decode(c3.prompt_ids[len(head2) :])
        == "\n<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n"
    )
    assert (
        c1.response_message is not None and c1.response_message["tool_calls"][0]["function"]["name"] == "calc"
    )


def _plan_after(tokenizer: Any, template: ChatTemplate, reply: str, response_ids: list[int]) -> Any:
    """Record one call answering ``reply`` with ``response_ids``, then plan the follow-up."""
    ledger = TokenLedger()
    first = [{"role": "user", "content": "hi"}]
    plan1 = ledger.plan("k", first, None, template)
    ledger.record("k", plan1, first, None, response_ids, {"role": "assistant", "content": reply})
    follow = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "again"}]
    return plan1, ledger.plan("k", follow, None, template)


def test_a_response_cut_by_length_gets_the_closing_tokens_as_prompt(tokenizer: Any) -> None:
    template = ChatTemplate(tokenizer)
    ids = tokenizer.encode("truncated answ", add_special_tokens=False)  # no <|im_end|>: stopped on length
    plan1, plan2 = _plan_after(tokenizer, template, "truncated answ", ids)
    assert plan2.ledger_break is None and plan2.extends_call == 1
    assert plan2.prompt_ids[: len(plan1.prompt_ids) + len(ids)] == plan1.prompt_ids + ids
    tail = tokenizer.decode(plan2.prompt_ids[len(plan1.prompt_ids) + len(ids) :])
    assert tail == "<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"


def test_history_edits_fall_back_to_a_full_render(tokenizer: Any) -> None:
    template, ledger = ChatTemplate(tokenizer), TokenLedger()
    first = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    plan1 = ledger.plan("k", first, None, template)
    eos = tokenizer.eos_token_id
    ledger.record("k", plan1, first, None, [*tokenizer.encode("yo", add_special_tokens=False), eos],
                  {"role": "assistant", "content": "yo"})  # fmt: skip
    cases = {
        "edited": [{"role": "system", "content": "S"}, first[1], {"role": "assistant", "content": "yo"}],
        "differs from the assistant message": [*first, {"role": "assistant", "content": "YO"}, {"role": "user", "content": "x"}],
        "truncated": [first[1], {"role": "assistant", "content": "yo"}, {"role": "user", "content": "x"}],
        "tools changed": [*first, {"role": "assistant", "content": "yo"}],
    }  # fmt: skip
    for reason, msgs in cases.items():
        tools = [{"type": "function", "function": {"name": "f"}}] if reason == "tools changed" else None
        plan = ledger.plan("k", msgs, tools, template)
        assert plan.ledger_break is not None and reason.split()[0] in plan.ledger_break, (
            reason,
            plan.ledger_break,
        )
        assert plan.prompt_ids == template.encode(template.render(msgs, tools, True))
    fresh = ledger.plan("k", [{"role": "user", "content": "new task"}], None, template)
    assert fresh.ledger_break is None  # a new conversation in the same attempt is not a break


async def test_a_template_that_strips_think_breaks_the_ledger_and_says_why(tokenizer: Any, oai: Any) -> None:
    engine = EchoEngine(tokenizer, reply=scripted(["<think>hmm</think>\nfour", "ok", "plain", "fine"]))
    store = MemoryStore()
    async with running_proxy(engine, store, chat_template=STRIP_THINK_TEMPLATE) as proxy:
        client = oai(attempt_url(proxy, await new_attempt(store)))
        with anyio.fail_after(20):
            for _ in range(2):  # first with reasoning (break), then without (delta works)
                msgs: list[Any] = [{"role": "user", "content": "2+2?"}]
                r = await client.chat.completions.create(model="m", messages=msgs)
                msgs += [
                    {"role": "assistant", "content": r.choices[0].message.content},
                    {"role": "user", "content": "sure?"},
                ]
                await client.chat.completions.create(model="m", messages=msgs)
    calls = [s.payload for s in await store.query_spans((await store.list_rollouts())[0].rollout_id)]
    assert [c.ledger_break is not None for c in calls] == [False, True, False, False]  # type: ignore[union-attr]
    assert "strips <think>" in calls[1].ledger_break  # type: ignore[union-attr,operator]
    assert "hmm" not in tokenizer.decode(calls[1].prompt_ids)  # type: ignore[union-attr]
    c3, c4 = calls[2], calls[3]
    assert c4.prompt_ids[: len(c3.prompt_ids) + len(c3.response_ids)] == c3.prompt_ids + c3.response_ids  # type: ignore[union-attr]


async def test_streamed_tool_calls_match_the_non_streamed_ones(tokenizer: Any, oai: Any) -> None:
    text = 'Checking.<tool_call>{"name": "calc", "arguments": {"expr": "7*6"}}</tool_call>'
    engine, store = EchoEngine(tokenizer, reply=lambda p, s: text), MemoryStore()
    async with running_proxy(engine, store) as proxy:
        client = oai(attempt_url(proxy, await new_attempt(store)))
        msgs: Any = [{"role": "user", "content": "7*6?"}]
        with anyio.fail_after(20):
            full = await client.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
            stream = await client.chat.completions.create(
                model="m", messages=msgs, tools=TOOLS, stream=True, extra_body={"return_token_ids": True}
            )
            chunks = [c async for c in stream]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert [(c.function.name, c.function.arguments) for c in calls] == [  # type: ignore[union-attr]
        (c.function.name, c.function.arguments)  # type: ignore[union-attr]
        for c in full.choices[0].message.tool_calls or []
    ]
    assert "".join(d.content or "" for d in deltas) == full.choices[0].message.content == "Checking."
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    ids = [t for c in chunks for t in (c.model_extra or {}).get("token_ids", [])]
    assert ids == engine.calls[1].output.token_ids  # type: ignore[union-attr]
