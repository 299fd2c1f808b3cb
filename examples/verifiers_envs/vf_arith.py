"""A single-turn verifiers environment: add two numbers, one reply, scored by a reward method.

Written with verifiers' own classes (``verifiers.v1``, 0.4.0): a ``TaskData`` row, a ``Task`` whose
``@vf.reward`` scores the finished trace, and a ``Taskset`` that yields the rows. verifiers finds it by
its module name (the taskset id ``vf_arith``); ``ENV`` pins the harness to verifiers' plain chat loop
(``null``: no tools) and the runtime to a local subprocess, so nothing here needs a sandbox service.

The questions are every ``a + b`` with a, b in 0..20 after one worked example turn, shuffled with a fixed seed; the taskset config's
``split`` picks the training questions (``train``, the default) or the held-out ones (``test``, never
trained on). ``held_out()`` gives the test split as agentloop tasks (``val_data: vf_arith:held_out``).
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from typing import Any, Literal

import verifiers.v1 as vf

# One worked turn before the question, as the main demo (trainer/demos/arithmetic.py) found SmolLM2 needs: without it the
# model explains at length and a short reply ends before the sum (17% of held-out questions right, greedy).
EXAMPLE = [
    {"role": "user", "content": "What is 15 + 23?"},  # 23 lies outside the operands 0..20
    {"role": "assistant", "content": "15 + 23 = 38"},
]
OPERAND_MAX = 20
HELD_OUT = 24  # the first 24 shuffled questions: the test split


class ArithData(vf.TaskData):
    answer: str
    """The sum, as text."""


def last_number(text: str) -> str | None:
    numbers = re.findall(r"-?\d+", text)
    return numbers[-1] if numbers else None


class ArithTask(vf.Task[ArithData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task: ArithData, trace: vf.Trace) -> float:
        """1 when the last number of the model's last reply is the sum."""
        return float(last_number(trace.last_reply) == task.answer)


class ArithConfig(vf.TasksetConfig):
    split: Literal["train", "test"] = "train"
    """``train``: the training questions; ``test``: the held-out ones."""


def questions(split: str) -> list[tuple[int, int]]:
    pairs = [(a, b) for a in range(OPERAND_MAX + 1) for b in range(OPERAND_MAX + 1)]
    random.Random(0).shuffle(pairs)
    return pairs[:HELD_OUT] if split == "test" else pairs[HELD_OUT:]


class ArithTaskset(vf.Taskset[ArithTask, ArithConfig]):
    def load(self) -> Iterator[ArithTask]:
        for a, b in questions(self.config.split):
            yield ArithTask(
                ArithData(
                    prompt=[*EXAMPLE, {"role": "user", "content": f"What is {a} + {b}?"}], answer=str(a + b)
                ),
                self.config.task,
            )


def held_out() -> list[dict[str, Any]]:
    """The test split as agentloop tasks: each row's ``TaskData`` as JSON, as agentloop's train_tasks makes."""
    taskset = ArithTaskset(ArithConfig(id="vf_arith", split="test"))
    return [task.data.model_dump(mode="json", exclude_unset=True) for task in taskset]


__all__ = ["ArithTaskset"]

# The environment as `agentloop train` (agent: verifiers:vf_arith:ENV) and `vf-eval` both take it.
ENV = vf.SingleAgentEnvConfig(
    taskset={"id": "vf_arith"},
    agent=vf.AgentConfig(harness={"id": "null"}, runtime=vf.SubprocessConfig(), max_turns=1),
)
