"""@rollout, Agent, emit_reward and return-value handling, run through a real Runner and MemoryStore."""

from __future__ import annotations

import pickle
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import pytest

import agentloop as al
from agentloop.agent import Agent, FunctionAgent, attempt_context, check_reward, emit_reward, rollout
from agentloop.context import current_rollout
from agentloop.errors import AgentError, RolloutContextError
from agentloop.resources import LLM, ProxyLLM, Resources
from agentloop.runner import Runner
from agentloop.store.memory import MemoryStore
from agentloop.types import AttemptedRollout, AttemptStatus, Log, RolloutStatus, Span

TEMPLATE = "http://127.0.0.1:9/rollout/{rollout_id}/attempt/{attempt_id}/v1"


async def _run_one(
    agent: Any, task: Any = None, resources: Resources | None = None
) -> tuple[MemoryStore, str]:
    store = MemoryStore()
    if resources is not None:
        await store.add_resources(resources)
    ro = await store.enqueue_rollout(task if task is not None else {})
    with anyio.fail_after(10):
        await Runner(agent, store).run(max_rollouts=1)
    return store, ro.rollout_id


def _log_span(rollout: AttemptedRollout, message: str) -> Span:
    """What the proxy does on an LLM call: write a span for the attempt straight to the store."""
    return Span(
        rollout_id=rollout.rollout_id, attempt_id=rollout.attempt.attempt_id, payload=Log(message=message)
    )


# ---------------------------------------------------------------- decorator


async def test_async_agent_stays_callable() -> None:
    @rollout
    async def solve(task: dict[str, int], llm: Any) -> float:
        """Docs survive."""
        return task["x"] * 2.0

    assert isinstance(solve, Agent) and isinstance(solve, FunctionAgent)
    assert await solve({"x": 3}, None) == 6.0
    assert solve.__name__ == "solve" and solve.__doc__ == "Docs survive."


def test_sync_agent_stays_callable_and_named() -> None:
    @rollout(name="adder")
    def add(task: dict[str, int], llm: Any, rollout: Any) -> int:
        return task["a"] + task["b"]

    assert add({"a": 1, "b": 2}, None, None) == 3
    assert add.name == "adder" and add.arity == 3 and not add.is_async


async def test_proxy_llm_resolved_per_attempt_and_rollout_passed() -> None:
    seen: list[tuple[Any, AttemptedRollout]] = []

    @rollout
    def agent(task: Any, llm: LLM, rollout: AttemptedRollout) -> float:
        seen.append((llm, rollout))
        return 1.0

    res = Resources(
        items={"policy": ProxyLLM(url_template=TEMPLATE, model="m", sampling={"temperature": 0.5})}
    )
    _, rid = await _run_one(agent, resources=res)
    ((llm, ro),) = seen
    assert isinstance(llm, LLM) and isinstance(ro, AttemptedRollout)
    assert llm.base_url == f"http://127.0.0.1:9/rollout/{rid}/attempt/{ro.attempt.attempt_id}/v1"
    assert llm.model == "m" and llm.sampling == {"temperature": 0.5}
    assert ro.rollout_id == rid and ro.resources_version == 1


async def test_plain_llm_passed_as_is_and_class_agent_gets_resources() -> None:
    plain = LLM(base_url="http://127.0.0.1:9/v1", model="m")
    got: list[Any] = []

    @rollout
    async def fn_agent(task: Any, llm: LLM) -> float:
        got.append(llm)
        return 1.0

    class ClassAgent(Agent):
        async def rollout(self, task: Any, resources: Resources | None, rollout: AttemptedRollout) -> float:
            got.append(resources)
            return 1.0

    await _run_one(fn_agent, resources=Resources(items={"llm": plain}))
    proxy = Resources(items={"llm": ProxyLLM(url_template=TEMPLATE, model="m")})
    await _run_one(ClassAgent(), resources=proxy)
    assert got[0] == plain
    assert isinstance(got[1], Resources) and isinstance(
        got[1].get_llm(), ProxyLLM
    )  # unresolved: author's job
    await _run_one(fn_agent)  # no resources at all: llm is None
    assert got[2] is None


def _one_arg(task: Any) -> float:
    return 0.0


def _four_args(task: Any, llm: Any, rollout: Any, extra: Any) -> float:
    return 0.0


def _kw_only(task: Any, llm: Any, *, depth: int) -> float:
    return 0.0


def _gen(task: Any, llm: Any) -> Any:
    yield 1.0


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (_one_arg, r"_one_arg\(task: 'Any'\) -> 'float' takes 1 positional"),
        (_four_args, r"_four_args.* requires 4 positional arguments"),
        (_kw_only, r"_kw_only.* keyword-only arguments \['depth'\]"),
        (_gen, r"_gen is a generator"),
        (dict, r"for the class dict, subclass al.Agent"),
        (42, r"expects a function, got int"),
    ],
)
def test_bad_signatures_rejected(fn: Any, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        rollout(fn)


def test_sync_rollout_method_rejected_at_class_creation() -> None:
    with pytest.raises(TypeError, match=r"Bad.rollout must be an `async def` method"):

        class Bad(Agent):
            def rollout(self, task: Any, resources: Any, rollout: Any) -> float:  # type: ignore[override]
                return 0.0


def test_module_level_agent_pickles_by_reference() -> None:
    from tests.runner_fixtures import echo_agent

    assert pickle.loads(pickle.dumps(echo_agent)) is echo_agent


# ---------------------------------------------------------------- return values


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("value", "reward"),
    [(0.25, 0.25), (3, 3.0), (True, 1.0), (False, 0.0)],
    ids=["float", "int", "true", "false"],
)
async def test_numeric_return_is_the_reward(value: Any, reward: float) -> None:
    @rollout
    async def agent(task: Any, llm: Any) -> Any:
        return value

    store, rid = await _run_one(agent)
    assert (await store.get_rollout(rid)).status is RolloutStatus.SUCCEEDED
    spans = await store.query_spans(rid)
    assert [(s.payload.kind, s.payload.value, s.payload.name) for s in spans] == [("reward", reward, "final")]


async def test_none_return_without_rewards_succeeds_with_no_reward_span() -> None:
    @rollout
    async def agent(task: Any, llm: Any) -> None:
        return None

    store, rid = await _run_one(agent)
    assert (await store.get_rollout(rid)).status is RolloutStatus.SUCCEEDED
    assert await store.query_spans(rid) == []


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("value", "message"),
    [("1.0", "returned a builtins.str"), ([1.0], "returned a builtins.list"), (float("nan"), "returned nan")],
    ids=["str", "list", "nan"],
)
async def test_non_reward_return_fails_the_attempt(value: Any, message: str) -> None:
    @rollout
    def agent(task: Any, llm: Any) -> Any:
        return value

    store, rid = await _run_one(agent)
    (attempt,) = await store.list_attempts(rid)
    assert attempt.status is AttemptStatus.FAILED
    assert attempt.error is not None and attempt.error.type == "AgentError"
    assert message in attempt.error.message
    assert (await store.get_rollout(rid)).status is RolloutStatus.FAILED


def test_check_reward_hint_for_arrays() -> None:
    class Tensorish:
        def item(self) -> float:
            return 1.0

    with pytest.raises(AgentError, match=r"call \.item\(\)"):
        check_reward(Tensorish(), "agent")


# ---------------------------------------------------------------- emit_reward


async def test_emit_reward_order_async() -> None:
    @rollout
    async def agent(task: Any, llm: Any, rollout: AttemptedRollout) -> None:
        store = current_store[0]
        emit_reward(0.1, name="a")  # bare: stored at the next await, before the next awaited reward
        await emit_reward(0.2, name="b")  # awaited: stored before the LLM span below
        await store.add_span(_log_span(rollout, "llm call 1"))
        stored = await emit_reward(0.3)
        assert stored.sequence_id == 4
        await store.add_span(_log_span(rollout, "llm call 2"))
        emit_reward(1, name="last")
        return None

    current_store: list[MemoryStore] = []
    store = MemoryStore()
    current_store.append(store)
    ro = await store.enqueue_rollout({})
    with anyio.fail_after(5):
        await Runner(agent, store).run(max_rollouts=1)
    spans = await store.query_spans(ro.rollout_id)
    got = [(s.sequence_id, getattr(s.payload, "value", None) or s.payload.message) for s in spans]  # type: ignore[union-attr]
    assert got == [(1, 0.1), (2, 0.2), (3, "llm call 1"), (4, 0.3), (5, "llm call 2"), (6, 1.0)]
    assert (await store.get_rollout(ro.rollout_id)).status is RolloutStatus.SUCCEEDED


async def test_emit_reward_order_sync_agent_in_thread() -> None:
    store = MemoryStore()

    loop = anyio.lowlevel.current_token()

    @rollout
    def agent(task: Any, llm: Any, rollout: AttemptedRollout) -> float:
        for turn in range(3):
            anyio.from_thread.run(store.add_span, _log_span(rollout, f"llm call {turn}"), token=loop)
            emit_reward(turn / 10, name=f"turn{turn}")  # blocks until stored
        return 1.0

    ro = await store.enqueue_rollout({})
    with anyio.fail_after(5):
        await Runner(agent, store).run(max_rollouts=1)
    spans = await store.query_spans(ro.rollout_id)
    kinds = [(s.kind, getattr(s.payload, "name", None)) for s in spans]
    assert kinds == [
        ("log", None),
        ("reward", "turn0"),
        ("log", None),
        ("reward", "turn1"),
        ("log", None),
        ("reward", "turn2"),
        ("reward", "final"),
    ]
    assert [s.sequence_id for s in spans] == list(range(1, 8))


async def test_emit_reward_outside_a_rollout_raises() -> None:
    with pytest.raises(RolloutContextError, match="emit_reward must be called inside a rollout"):
        emit_reward(1.0)
    with pytest.raises(RolloutContextError, match="inside a rollout"):
        await anyio.to_thread.run_sync(emit_reward, 1.0)


async def test_emit_reward_validates_value() -> None:
    store = MemoryStore()
    await store.enqueue_rollout({})
    attempted = await store.dequeue_rollout("w")
    assert attempted is not None
    async with attempt_context(attempted, store):
        with pytest.raises(TypeError, match=r"emit_reward takes a number .* got str"):
            emit_reward("1")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="finite"):
            emit_reward(float("inf"))
        with pytest.raises(TypeError, match="name must be a str"):
            emit_reward(1.0, name=3)  # type: ignore[arg-type]
        await emit_reward(1.0)
    assert [s.payload.value for s in await store.query_spans(attempted.rollout_id)] == [1.0]  # type: ignore[union-attr]
    with pytest.raises(RolloutContextError):
        emit_reward(1.0)  # the context ended with the block


async def test_emit_reward_after_attempt_finished_is_refused() -> None:
    store = MemoryStore()
    await store.enqueue_rollout({})
    attempted = await store.dequeue_rollout("w")
    assert attempted is not None
    async with attempt_context(attempted, store) as ctx:
        pass
    token = current_rollout.set(ctx)  # e.g. an abandoned worker thread that still holds the context
    try:
        with pytest.raises(RolloutContextError, match="has already finished"):
            emit_reward(1.0)
    finally:
        current_rollout.reset(token)


async def test_rejected_reward_write_fails_the_attempt() -> None:
    @rollout
    async def agent(task: Any, llm: Any, rollout: AttemptedRollout) -> None:
        await store.cancel_rollout(rollout.rollout_id)
        emit_reward(1.0)  # the store refuses it: the attempt already ended

    store = MemoryStore()
    ro = await store.enqueue_rollout({})
    with anyio.fail_after(5):
        stats = await Runner(agent, store).run(max_rollouts=1)
    assert stats.lost == 1
    assert (await store.get_rollout(ro.rollout_id)).status is RolloutStatus.CANCELLED


# a third parameter receives the AttemptedRollout; one meant for something else is refused


def _tokenizer_third(task: Any, llm: Any, tokenizer: Any) -> float:
    return 0.0


def _annotated_other(task: Any, llm: Any, rollout_count: int) -> float:
    return 0.0


def test_third_parameter_not_for_the_rollout_is_rejected() -> None:
    for fn in (_tokenizer_third, _annotated_other):
        with pytest.raises(TypeError, match=r"third parameter '\w+' that is neither named `rollout`") as info:
            rollout(fn)
        assert "(task, llm) or (task, llm, rollout)" in str(info.value)  # says what is allowed


def _ro_annotated(task: Any, llm: Any, ro: AttemptedRollout) -> float:
    return 0.0


def _ro_string_annotated(task: Any, llm: Any, attempt: al.AttemptedRollout | None) -> float:
    return 0.0


def _tokenizer_with_default(task: Any, llm: Any, tokenizer: Any = None) -> float:
    return 0.0


def _var_positional(task: Any, llm: Any, *rest: Any) -> float:
    return 0.0


@pytest.mark.parametrize(
    ("fn", "arity"),
    [(_ro_annotated, 3), (_ro_string_annotated, 3), (_tokenizer_with_default, 2), (_var_positional, 2)],
)
def test_supported_signatures_keep_working(fn: Any, arity: int) -> None:
    assert rollout(fn).arity == arity
