"""Stopping a fit that cannot learn: a step whose batch holds no usable attempt is not a training step.

An attempt gives a training sample only if it made an LLM call through ``llm.base_url``, ended with a
reward (returned, ``al.emit_reward`` or a judge's), and its prompts fit ``data.max_prompt_length``
(``trainer.batch.build_batch`` counts the others by kind). A step where no attempt did trains nothing:
the loop does not count it, draws the next batch, and after ``trainer.max_steps_without_signal`` such
steps in a row stops with an EmptyBatchError that says how many attempts failed in which way and where
to look (``agentloop inspect RUN``). A step that trains resets the count and reports how many batches
were skipped before it (``batch/skipped_without_signal``).

Why: an agent that forgot to ``return`` its reward, or a judge whose every verdict failed
(``on_failure='skip'``), gave a run that printed ``trained 1 steps``, exited 0 and wrote a final model
identical to the start, with only warnings and ``reward=nan`` to show for it (issue 42).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from agentloop.errors import EmptyBatchError

# (the step metric that counts rollouts whose final attempt was unusable in one way, how the message
# names them); each rollout is in one at most: a failed one leaves no triplet, build_batch drops a whole
# attempt for its first reason
KINDS = (
    (
        "batch/dropped_attempts_no_reward",
        "ended without a reward (return it from the agent, or call al.emit_reward)",
    ),
    ("rollout/failed", "failed (the agent raised or timed out{errors})"),
    ("batch/attempts_untrained_prompt_too_long", "had every prompt over data.max_prompt_length"),
    ("batch/dropped_attempts_empty", "had empty prompt or response token ids"),
    ("rollout/without_calls", "made no LLM call through llm.base_url (the proxy records the tokens)"),
)


def has_signal(metrics: dict[str, float]) -> bool:
    """Whether a step's batch held a usable sample (the step updated the policy)."""
    return metrics.get("batch/samples", 0.0) > 0


@dataclass
class SignalWatch:
    """Counts the steps in a row without a usable attempt (module docstring); ``limit`` is
    ``trainer.max_steps_without_signal``."""

    limit: int
    run_dir: Path
    in_a_row: int = 0  # steps without signal since the last one that trained
    rollout_ids: list[str] = field(default_factory=list)  # their rollouts (for the failures' summary)
    counts: Counter[str] = field(default_factory=Counter)  # their rollouts, by kind; judge failures

    def observe(self, metrics: dict[str, float], rollout_ids: list[str]) -> bool:
        """Record a step's outcome; True when it trained (``metrics`` then say how many batches were
        skipped before it), False when it did not count. ``exhausted`` says whether to stop."""
        if has_signal(metrics):
            if self.in_a_row:
                metrics["batch/skipped_without_signal"] = float(self.in_a_row)
            self.in_a_row = 0
            self.rollout_ids.clear()
            self.counts.clear()
            return True
        self.in_a_row += 1
        self.rollout_ids.extend(rollout_ids)
        self.counts["rollouts"] += len(rollout_ids)
        for key, _ in KINDS:
            self.counts[key] += int(metrics.get(key, 0))
        self.counts["judge/failed_groups"] += int(metrics.get("judge/failed_groups", 0))
        return False

    @property
    def exhausted(self) -> bool:
        return self.in_a_row >= self.limit

    def summary(self) -> dict[str, int]:
        """The counts so far, for the log line of a step without signal."""
        return {"in_a_row": self.in_a_row, "limit": self.limit, **{k: v for k, v in self.counts.items() if v}}

    def error(self, errors: str = "") -> EmptyBatchError:
        """The one-line error that stops the fit; ``errors``: the failed attempts' errors with counts
        (``trainer.fit.rollout_wait.failure_summary`` over ``rollout_ids``: retries included)."""
        n = self.in_a_row
        steps = f"{n} steps in a row" if n > 1 else "a step"
        parts = []
        for key, what in KINDS:
            if self.counts[key]:
                detail = f"; their attempts' errors: {errors}" if errors else ""
                parts.append(f"{self.counts[key]} {what.format(errors=detail)}")
        judge = self.counts["judge/failed_groups"]
        if judge:
            groups = "1 group" if judge == 1 else f"{judge} groups"
            parts.append(f"the judge failed on {groups} of attempts (judge.jsonl; on_failure='skip')")
        tracebacks = (
            f", their tracebacks with `agentloop inspect {self.run_dir} --errors`"
            if self.counts["rollout/failed"]
            else ""
        )
        return EmptyBatchError(
            f"no learning signal: {steps} trained nothing (trainer.max_steps_without_signal={self.limit}): "
            f"none of {self.counts['rollouts']} rollouts gave a usable attempt: "
            f"{', '.join(parts) or 'no reason recorded'}; the model was not updated by them and no final "
            f"model was written; look at the attempts with `agentloop inspect {self.run_dir}`{tracebacks}"
        )
