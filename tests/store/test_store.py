"""One suite for every Store backend (memory, sqlite, http): the shared state machine's semantics."""

from __future__ import annotations

import time

import anyio
import pytest

from agentloop.errors import InvalidRequestError, InvalidTransitionError, NotFoundError, StaleAttemptError
from agentloop.resources import LLM, Resources
from agentloop.store.base import Store
from agentloop.types import AttemptStatus, ErrorInfo, Log, Reward, RolloutConfig, RolloutStatus, Span

from .conftest import FakeClock


def reward(rollout_id: str, attempt_id: str, value: float = 1.0, seq: int | None = None) -> Span:
    return Span(rollout_id=rollout_id, attempt_id=attempt_id, sequence_id=seq, payload=Reward(value=value))


async def test_fifo_order_and_attempt_numbering(store: Store) -> None:
    ids = [(await store.enqueue_rollout({"i": i})).rollout_id for i in range(5)]
    got = []
    for _ in ids:
        attempted = await store.dequeue_rollout("w")
        assert attempted is not None
        assert attempted.attempt.sequence_id == 1
        assert attempted.status is RolloutStatus.RUNNING
        assert attempted.attempt.status is AttemptStatus.PREPARING
        assert attempted.attempt.worker_id == "w"
        got.append(attempted.rollout_id)
    assert got == ids
    assert await store.dequeue_rollout("w") is None


async def test_enqueue_records_input_mode_config_metadata(store: Store) -> None:
    cfg = RolloutConfig(max_attempts=3, timeout_s=5)
    rollout = await store.enqueue_rollout({"q": [1, 2]}, mode="val", config=cfg, metadata={"k": "v"})
    stored = await store.get_rollout(rollout.rollout_id)
    assert stored.input == {"q": [1, 2]} and stored.mode == "val" and stored.metadata == {"k": "v"}
    assert stored.config == cfg and stored.status is RolloutStatus.QUEUED and stored.num_attempts == 0
    assert rollout.rollout_id.startswith("ro-") and len(rollout.rollout_id) > 30


async def test_requeue_goes_to_back_and_retries_until_max_attempts(store: Store) -> None:
    cfg = RolloutConfig(max_attempts=3)
    first = await store.enqueue_rollout("a", config=cfg)
    second = await store.enqueue_rollout("b", config=cfg)
    seqs = []
    for expected_status in (RolloutStatus.REQUEUED, RolloutStatus.REQUEUED, RolloutStatus.FAILED):
        attempted = await store.dequeue_rollout()
        assert attempted is not None and attempted.rollout_id == first.rollout_id
        seqs.append(attempted.attempt.sequence_id)
        err = ErrorInfo(type="RuntimeError", message="boom", traceback="Traceback ...")
        attempt = await store.update_attempt(
            first.rollout_id, attempted.attempt.attempt_id, status="failed", error=err
        )
        assert (
            attempt.status is AttemptStatus.FAILED and attempt.error == err and attempt.end_time is not None
        )
        assert (await store.get_rollout(first.rollout_id)).status is expected_status
        if expected_status is RolloutStatus.REQUEUED:  # the requeued rollout is behind "b" now
            nxt = await store.dequeue_rollout()
            assert nxt is not None and nxt.rollout_id == second.rollout_id
            await store.update_attempt(nxt.rollout_id, nxt.attempt.attempt_id, status="failed")
    assert seqs == [1, 2, 3]
    final = await store.get_rollout(first.rollout_id)
    assert final.num_attempts == 3 and final.end_time is not None
    attempts = await store.list_attempts(first.rollout_id)
    assert [a.sequence_id for a in attempts] == [1, 2, 3]
    assert all(a.status is AttemptStatus.FAILED for a in attempts)


async def test_retry_on_is_respected(store: Store) -> None:
    cfg = RolloutConfig(max_attempts=5, retry_on={AttemptStatus.TIMEOUT})
    rollout = await store.enqueue_rollout("x", config=cfg)
    attempted = await store.dequeue_rollout()
    assert attempted is not None
    await store.update_attempt(rollout.rollout_id, attempted.attempt.attempt_id, status=AttemptStatus.FAILED)
    assert (await store.get_rollout(rollout.rollout_id)).status is RolloutStatus.FAILED
    assert await store.dequeue_rollout() is None


async def test_success_ends_rollout(store: Store) -> None:
    rollout = await store.enqueue_rollout("x", config=RolloutConfig(max_attempts=3))
    attempted = await store.dequeue_rollout()
    assert attempted is not None
    await store.update_attempt(rollout.rollout_id, attempted.attempt.attempt_id, status="succeeded")
    done = await store.get_rollout(rollout.rollout_id)
    assert done.status is RolloutStatus.SUCCEEDED and done.end_time is not None
    with pytest.raises(StaleAttemptError, match="already finished as succeeded"):
        await store.update_attempt(rollout.rollout_id, attempted.attempt.attempt_id, status="failed")


async def test_watchdog_timeout_and_retry(store: Store, clock: FakeClock) -> None:
    rollout = await store.enqueue_rollout("x", config=RolloutConfig(timeout_s=10, max_attempts=2))
    attempted = await store.dequeue_rollout()
    assert attempted is not None
    clock.advance(5)
    assert await store.check_timeouts() == []
    await store.add_span(reward(rollout.rollout_id, attempted.attempt.attempt_id))  # heartbeats do not help
    clock.advance(5.5)
    ended = await store.check_timeouts()
    assert [(a.attempt_id, a.status) for a in ended] == [
        (attempted.attempt.attempt_id, AttemptStatus.TIMEOUT)
    ]
    assert ended[0].error is not None and "timeout_s=10" in ended[0].error.message
    assert (await store.get_rollout(rollout.rollout_id)).status is RolloutStatus.REQUEUED
    again = await store.dequeue_rollout()
    assert again is not None and again.attempt.sequence_id == 2
    with pytest.raises(StaleAttemptError, match="stale"):  # the timed-out attempt may not write any more
        await store.add_span(reward(rollout.rollout_id, attempted.attempt.attempt_id))
    clock.advance(11)
    assert await store.dequeue_rollout() is None  # dequeue runs the watchdog too
    assert (await store.get_rollout(rollout.rollout_id)).status is RolloutStatus.FAILED


async def test_watchdog_unresponsive_heartbeats_keep_alive(store: Store, clock: FakeClock) -> None:
    rollout = await store.enqueue_rollout("x", config=RolloutConfig(unresponsive_s=2))
    attempted = await store.dequeue_rollout()
    assert attempted is not None
    aid = attempted.attempt.attempt_id
    for _ in range(3):
        clock.advance(1.5)
        await store.update_attempt(rollout.rollout_id, aid, heartbeat=True)
        assert await store.check_timeouts() == []
    clock.advance(2.5)
    ended = await store.check_timeouts()
    assert [a.status for a in ended] == [AttemptStatus.UNRESPONSIVE]
    assert (await store.get_attempt(rollout.rollout_id, aid)).status is AttemptStatus.UNRESPONSIVE
    assert (await store.get_rollout(rollout.rollout_id)).status is RolloutStatus.FAILED  # max_attempts=1


async def test_first_span_moves_to_running_and_sequence_numbers(store: Store, clock: FakeClock) -> None:
    rollout = await store.enqueue_rollout("x")
    attempted = await store.dequeue_rollout()
    assert attempted is not None
    aid = attempted.attempt.attempt_id
    clock.advance(3)
    spans = [await store.add_span(reward(rollout.rollout_id, aid, value=v)) for v in (0.1, 0.2)]
    spans.append(
        await store.add_span(Span(rollout_id=rollout.rollout_id, attempt_id=aid, payload=Log(message="m")))
    )
    assert [s.sequence_id for s in spans] == [1, 2, 3]
    attempt = await store.get_attempt(rollout.rollout_id, aid)
    assert attempt.status is AttemptStatus.RUNNING and attempt.last_heartbeat_time == clock.now
    with pytest.raises(InvalidRequestError, match="already used"):
        await store.add_span(reward(rollout.rollout_id, aid, seq=2))
    explicit = await store.add_span(reward(rollout.rollout_id, aid, seq=10))
    assert explicit.sequence_id == 10
    assert (await store.add_span(reward(rollout.rollout_id, aid))).sequence_id == 11
    queried = await store.query_spans(rollout.rollout_id)
    assert [s.sequence_id for s in queried] == [1, 2, 3, 10, 11]
    assert [s.kind for s in queried][:3] == ["reward", "reward", "log"]


async def test_query_spans_latest_vs_given_attempt(store: Store) -> None:
    rollout = await store.enqueue_rollout("x", config=RolloutConfig(max_attempts=2))
    assert await store.query_spans(rollout.rollout_id) == []
    first = await store.dequeue_rollout()
    assert first is not None
    await store.add_span(reward(rollout.rollout_id, first.attempt.attempt_id, value=1))
    await store.update_attempt(rollout.rollout_id, first.attempt.attempt_id, status="failed")
    second = await store.dequeue_rollout()
    assert second is not None
    for v in (2, 3):
        await store.add_span(reward(rollout.rollout_id, second.attempt.attempt_id, value=v))
    latest = await store.query_spans(rollout.rollout_id, "latest")
    assert [s.payload.value for s in latest] == [2, 3]  # type: ignore[union-attr]
    old = await store.query_spans(rollout.rollout_id, first.attempt.attempt_id)
    assert [s.payload.value for s in old] == [1]  # type: ignore[union-attr]
    with pytest.raises(StaleAttemptError, match="superseded"):
        await store.add_span(reward(rollout.rollout_id, first.attempt.attempt_id))


async def test_wait_for_rollouts(store: Store) -> None:
    a = await store.enqueue_rollout("a")
    b = await store.enqueue_rollout("b")
    start = time.monotonic()
    assert await store.wait_for_rollouts([a.rollout_id, b.rollout_id], timeout=0) == []
    assert time.monotonic() - start < 0.5
    first = await store.dequeue_rollout()
    assert first is not None
    await store.update_attempt(first.rollout_id, first.attempt.attempt_id, status="succeeded")
    start = time.monotonic()
    done = await store.wait_for_rollouts([a.rollout_id, b.rollout_id], timeout=0.3)
    assert 0.25 <= time.monotonic() - start < 3
    assert [r.rollout_id for r in done] == [a.rollout_id]

    async def finish_later() -> None:
        await anyio.sleep(0.2)
        nxt = await store.dequeue_rollout()
        assert nxt is not None
        await store.update_attempt(nxt.rollout_id, nxt.attempt.attempt_id, status="failed")

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(finish_later)
            start = time.monotonic()
            done = await store.wait_for_rollouts([a.rollout_id, b.rollout_id], timeout=30)
            assert time.monotonic() - start < 3  # woken by the finish, not by the timeout
    assert {r.rollout_id: r.status for r in done} == {a.rollout_id: "succeeded", b.rollout_id: "failed"}


async def test_cancel(store: Store) -> None:
    queued = await store.enqueue_rollout("q")
    running = await store.enqueue_rollout("r")
    cancelled = await store.cancel_rollout(queued.rollout_id)
    assert cancelled.status is RolloutStatus.CANCELLED
    attempted = await store.dequeue_rollout()
    assert attempted is not None and attempted.rollout_id == running.rollout_id  # cancelled left the queue
    await store.cancel_rollout(running.rollout_id)
    with pytest.raises(StaleAttemptError):
        await store.update_attempt(running.rollout_id, attempted.attempt.attempt_id, status="succeeded")
    with pytest.raises(InvalidTransitionError, match="cancelled"):
        await store.cancel_rollout(running.rollout_id)
    done = await store.wait_for_rollouts([queued.rollout_id, running.rollout_id], timeout=0)
    assert len(done) == 2
    assert [r.rollout_id for r in await store.list_rollouts(status=["cancelled"])] == [
        queued.rollout_id,
        running.rollout_id,
    ]
    assert len(await store.list_rollouts(limit=1)) == 1


async def test_illegal_attempt_transition(store: Store) -> None:
    rollout = await store.enqueue_rollout("x")
    attempted = await store.dequeue_rollout()
    assert attempted is not None
    aid = attempted.attempt.attempt_id
    await store.update_attempt(rollout.rollout_id, aid, status="running")
    with pytest.raises(InvalidTransitionError, match="from running to preparing"):
        await store.update_attempt(rollout.rollout_id, aid, status="preparing")
    assert (await store.get_attempt(rollout.rollout_id, aid)).status is AttemptStatus.RUNNING


async def test_resources_versioning(store: Store) -> None:
    assert await store.get_latest_resources() is None
    a = await store.enqueue_rollout("a")
    first = await store.dequeue_rollout()
    assert first is not None and first.resources is None and first.resources_version is None
    llm = LLM(base_url="http://127.0.0.1:1/v1", model="m")
    assert await store.add_resources(Resources(items={"llm": llm})) == 1
    assert await store.add_resources(Resources(items={"llm": llm.model_copy(update={"model": "m2"})})) == 2
    latest = await store.get_latest_resources()
    assert latest is not None and latest.version == 2 and latest.get_llm().model == "m2"
    assert (await store.get_resources(1)).get_llm().model == "m"
    await store.enqueue_rollout("b")
    second = await store.dequeue_rollout()
    assert second is not None and second.resources_version == 2
    assert second.resources is not None and second.resources.version == 2
    assert (await store.get_rollout(second.rollout_id)).resources_version == 2
    assert (await store.get_rollout(a.rollout_id)).resources_version is None
    with pytest.raises(NotFoundError, match="version 7"):
        await store.get_resources(7)


async def test_unknown_ids(store: Store) -> None:
    with pytest.raises(NotFoundError, match="ro-missing"):
        await store.get_rollout("ro-missing")
    rollout = await store.enqueue_rollout("x")
    with pytest.raises(NotFoundError, match="at-missing"):
        await store.update_attempt(rollout.rollout_id, "at-missing", status="succeeded")
    with pytest.raises(NotFoundError, match="at-missing"):
        await store.add_span(reward(rollout.rollout_id, "at-missing"))
    with pytest.raises(NotFoundError, match="ro-nope"):
        await store.wait_for_rollouts([rollout.rollout_id, "ro-nope"], timeout=0)
    with pytest.raises(NotFoundError, match="at-missing"):
        await store.query_spans(rollout.rollout_id, "at-missing")
    with pytest.raises(NotFoundError):
        await store.cancel_rollout("ro-weird/../id")


async def test_get_rollout_attempt_is_get_rollout_and_get_attempt(store: Store) -> None:
    """One call (the proxy's liveness check) that answers what the two reads answer, errors included."""
    await store.enqueue_rollout("x", config=RolloutConfig(max_attempts=2, retry_on=["failed"]))
    first = await store.dequeue_rollout()
    assert first is not None
    rid, aid = first.rollout_id, first.attempt.attempt_id
    await store.update_attempt(rid, aid, status="failed")  # requeued: this attempt is superseded
    second = await store.dequeue_rollout()
    assert second is not None
    for att in (aid, second.attempt.attempt_id):
        rollout, attempt = await store.get_rollout_attempt(rid, att)
        assert rollout == await store.get_rollout(rid) and attempt == await store.get_attempt(rid, att)
    assert rollout.num_attempts == 2 and (await store.get_rollout_attempt(rid, aid))[1].status == "failed"
    with pytest.raises(NotFoundError, match="ro-missing"):
        await store.get_rollout_attempt("ro-missing", aid)
    with pytest.raises(NotFoundError, match="at-missing"):
        await store.get_rollout_attempt(rid, "at-missing")


async def test_bad_arguments_raise_validation_errors(store: Store) -> None:
    with pytest.raises(ValueError, match="mode"):
        await store.enqueue_rollout("x", mode="training")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_attempts"):
        await store.enqueue_rollout("x", config={"max_attempts": 0})
    with pytest.raises(InvalidRequestError, match="JSON"):
        await store.enqueue_rollout({"f": object()})
    with pytest.raises(InvalidRequestError, match="rollout_id"):
        await store.get_rollout(123)  # type: ignore[arg-type]
    rollout = await store.enqueue_rollout("x")
    attempted = await store.dequeue_rollout()
    assert attempted is not None
    with pytest.raises(InvalidRequestError, match="status must be one of"):
        await store.update_attempt(rollout.rollout_id, attempted.attempt.attempt_id, status="done")
    with pytest.raises(InvalidRequestError, match="timeout"):
        await store.wait_for_rollouts([rollout.rollout_id], timeout=-1)
    with pytest.raises(InvalidRequestError, match="list of ids"):
        await store.wait_for_rollouts(rollout.rollout_id, timeout=0)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="status entries"):
        await store.list_rollouts(status=["bogus"])
