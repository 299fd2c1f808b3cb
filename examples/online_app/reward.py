"""The checker the app and the promotion gate share: strict ``<answer>N</answer>`` exact match."""

from __future__ import annotations

from typing import Any

from trainer.demos.arithmetic import parse_answer


def score(task: dict[str, Any], text: str) -> float:
    """1.0 when the reply's first ``<answer>`` tag holds the task's answer, else 0.0 (the gate's score)."""
    return 1.0 if parse_answer(text) == int(task["answer"]) else 0.0


def app_reward(task: dict[str, Any], text: str, format_bonus: float = 0.1) -> float:
    """What the app posts: 1.0 right, ``format_bonus`` for a well-formed wrong answer, 0.0 otherwise."""
    got = parse_answer(text)
    if got is None:
        return 0.0
    return 1.0 if got == int(task["answer"]) else format_bonus
