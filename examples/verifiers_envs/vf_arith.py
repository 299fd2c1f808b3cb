"""A single-turn verifiers environment: add two numbers, one reply, scored by a reward method.

Written with verifiers' own classes (``verifiers.v1``, 0.4.0): a ``TaskData`` row, a ``Task`` whose
``@vf.reward`` scores the finished trace, and a ``Taskset`` that yields the rows. verifiers finds it by
its module name (the taskset id ``vf_arith``); ``ENV`` pins the harness to verifiers' plain chat loop
(``null``: no tools) and the runtime to a local subprocess, so nothing here needs a sandbox service.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

import verifiers.v1 as vf

SYSTEM_PROMPT = "Answer with the number only."


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


class ArithTaskset(vf.Taskset[ArithTask, vf.TasksetConfig]):
    def load(self) -> Iterator[ArithTask]:
        rng = random.Random(0)
        for _ in range(64):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            yield ArithTask(
                ArithData(prompt=f"What is {a} + {b}?", system_prompt=SYSTEM_PROMPT, answer=str(a + b)),
                self.config.task,
            )


__all__ = ["ArithTaskset"]

# The environment as `agentloop train` (agent: verifiers:vf_arith:ENV) and `vf-eval` both take it.
ENV = vf.SingleAgentEnvConfig(
    taskset={"id": "vf_arith"},
    agent=vf.AgentConfig(harness={"id": "null"}, runtime=vf.SubprocessConfig(), max_turns=1),
)
