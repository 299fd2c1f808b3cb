"""The current rollout, as an explicit ContextVar (the only global state in agentloop)."""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from agentloop.errors import RolloutContextError

if TYPE_CHECKING:
    from agentloop.resources import LLM
    from agentloop.store.base import Store
    from agentloop.types import AttemptedRollout


@dataclass
class RolloutContext:
    """What code running inside one attempt can reach."""

    rollout: AttemptedRollout
    store: Store
    llm: LLM | None = None  # the attempt's resolved LLM, when the resources hold one
    rewards: list[float] = field(default_factory=list)  # values given by emit_reward, in order


current_rollout: ContextVar[RolloutContext | None] = ContextVar("agentloop_current_rollout", default=None)


def get_rollout_context(what: str = "this helper") -> RolloutContext:
    """The running attempt's context; raises RolloutContextError outside a rollout."""
    ctx = current_rollout.get()
    if ctx is None:
        raise RolloutContextError(
            f"{what} must be called inside a rollout (an @al.rollout function or al.Agent run by al.Runner)"
        )
    return ctx
