"""Stopping a fit cleanly: Ctrl-C or SIGTERM ends the run through its ``finally`` blocks, prints one
line (the step, the run folder, whether a checkpoint can resume it) and exits 130/143."""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass
from typing import Any

from trainer.run_folder.checkpoint import CheckpointManager, RunPlan


@dataclass
class FitState:
    """What ``fit`` and its signal handling need to know about the run in progress."""

    plan: RunPlan
    identity: str
    started: bool = False  # the training loop began (a failure before leaves no folder behind)
    step: int = 0
    signum: int | None = None
    handler: Any = None  # the signal handler (reinstalled after ray.init, which sets its own for SIGTERM)
    loop: Any = None  # the event loop of the run and its outermost cancel scope (a signal cancels it)
    scope: Any = None


class Stopped(Exception):
    """Raised by fit's signal handler: Ctrl-C or SIGTERM asked the run to stop."""


def clean_stop(state: FitState) -> Any:
    """While fit runs in the main thread: the first SIGINT/SIGTERM stops the run cleanly (its
    ``finally`` blocks close the proxy, store and Ray) and fit prints one line and exits 130/143
    instead of a stack dump; a second signal ends the process at once."""
    from contextlib import contextmanager

    @contextmanager
    def installed() -> Any:
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum: int, _: Any) -> None:
            if state.signum is not None:
                os._exit(128 + signum)
            state.signum = signum
            if state.scope is not None:  # the loop runs: cancel the run there (finally blocks clean up)
                state.loop.call_soon_threadsafe(state.scope.cancel)
                return
            raise Stopped

        previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
        state.handler = handler
        try:
            yield
        except (Stopped, KeyboardInterrupt) as exc:
            exit_stopped(state, exc)
        except BaseExceptionGroup as group:
            if not group.subgroup((Stopped, KeyboardInterrupt)):
                raise
            exit_stopped(state, group)
        except SystemExit as exc:
            if exc.code != signal.SIGTERM:  # Ray's own SIGTERM handler: sys.exit(15)
                raise
            state.signum = signal.SIGTERM
            exit_stopped(state, exc)
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

    return installed()


def exit_stopped(state: FitState, exc: BaseException) -> None:
    import sys

    signum = state.signum or signal.SIGINT
    name = signal.Signals(signum).name
    latest = (
        CheckpointManager(state.plan.run_dir / "checkpoints").latest()
        if state.plan.run_dir.exists()
        else None
    )
    resume = (
        f"checkpoint of step {latest[1]['step']} kept: run again to resume"
        if latest
        else "no checkpoint to resume from"
    )
    sys.stderr.write(
        f"\ntraining stopped by {name} at step {state.step}; run folder {state.plan.run_dir} ({resume})\n"
    )
    sys.stderr.flush()
    raise SystemExit(128 + signum) from None


def single_error(group: BaseExceptionGroup) -> BaseException | None:
    """The one error inside nested task-group wrappers, or None when there are several."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        if len(exc.exceptions) != 1:
            return None
        exc = exc.exceptions[0]
    return exc
