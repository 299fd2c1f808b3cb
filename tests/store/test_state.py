"""The pure state machine shared by every backend."""

from __future__ import annotations

import pytest

from agentloop.errors import InvalidTransitionError, StaleAttemptError
from agentloop.store import state
from agentloop.types import Attempt, AttemptStatus, Rollout, RolloutConfig, RolloutStatus


def running(config: RolloutConfig | None = None) -> tuple[Rollout, Attempt]:
    rollout = Rollout(input=1, config=config or RolloutConfig())
    rollout, attempt, attempted = state.start_attempt(rollout, "w", None, now=100.0)
    assert attempted.attempt == attempt and attempted.rollout_id == rollout.rollout_id
    return rollout, attempt


def test_every_terminal_rollout_refuses_every_transition() -> None:
    for status in (RolloutStatus.SUCCEEDED, RolloutStatus.FAILED, RolloutStatus.CANCELLED):
        rollout = Rollout(input=1, status=status)
        for new in RolloutStatus:
            with pytest.raises(InvalidTransitionError, match=f"from {status.value} to {new.value}"):
                state.check_rollout_transition(rollout, new)


def test_start_attempt_numbers_and_times() -> None:
    rollout, attempt = running()
    assert (rollout.status, rollout.num_attempts, rollout.start_time) == (RolloutStatus.RUNNING, 1, 100.0)
    assert (attempt.sequence_id, attempt.status, attempt.start_time) == (1, AttemptStatus.PREPARING, 100.0)
    with pytest.raises(InvalidTransitionError, match="from running to running"):
        state.start_attempt(rollout, "w", None, now=101.0)


def test_finish_attempt_propagation() -> None:
    cfg = RolloutConfig(max_attempts=2, retry_on={AttemptStatus.UNRESPONSIVE})
    rollout, attempt = running(cfg)
    r, a = state.finish_attempt(rollout, attempt, AttemptStatus.UNRESPONSIVE, None, now=105.0)
    assert (r.status, r.end_time, a.end_time) == (RolloutStatus.REQUEUED, None, 105.0)
    r2, _ = state.finish_attempt(rollout, attempt, AttemptStatus.FAILED, None, now=105.0)
    assert r2.status is RolloutStatus.FAILED and r2.end_time == 105.0
    r3, _ = state.finish_attempt(rollout, attempt, AttemptStatus.SUCCEEDED, None, now=105.0)
    assert r3.status is RolloutStatus.SUCCEEDED
    assert rollout.status is RolloutStatus.RUNNING  # pure: the inputs are untouched


def test_watchdog_verdict_boundaries() -> None:
    cfg = RolloutConfig(timeout_s=10, unresponsive_s=3)
    _, attempt = running(cfg)
    assert state.watchdog_verdict(attempt, cfg, now=103.0) is None  # exactly at the limit: still fine
    assert state.watchdog_verdict(attempt, cfg, now=103.01) is AttemptStatus.UNRESPONSIVE
    beat = attempt.model_copy(update={"last_heartbeat_time": 109.0})
    assert state.watchdog_verdict(beat, cfg, now=110.5) is AttemptStatus.TIMEOUT
    assert state.attempt_deadline(beat, cfg) == 110.0


def test_stale_attempt_messages() -> None:
    rollout, attempt = running()
    with pytest.raises(StaleAttemptError, match="superseded"):
        state.ensure_current(rollout, attempt, "at-newer")
    done = attempt.model_copy(update={"status": AttemptStatus.FAILED})
    with pytest.raises(StaleAttemptError, match="already finished as failed"):
        state.ensure_current(rollout, done, attempt.attempt_id)
