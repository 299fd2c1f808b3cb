"""A tool-using verifiers environment: multiply two numbers with a Python calculator tool.

Written with verifiers' own classes (``verifiers.v1``, 0.4.0): the tool is a ``vf.Toolset`` (an MCP
server verifiers starts per rollout, ``python -m vf_calc``) with one ``@vf.tool`` method; the ``Task``
names it in ``toolsets`` and scores the final reply with ``@vf.reward``. ``ENV`` pins verifiers' chat
loop (``null``: it calls the MCP tools the task offers) and a local subprocess runtime.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

import verifiers.v1 as vf

SYSTEM_PROMPT = "Use the multiply tool, then answer with the number only."


class CalcToolset(vf.Toolset[vf.ToolsetConfig]):
    @property
    def server_name(self) -> str:
        return "calc"

    @vf.tool
    async def multiply(self, a: int, b: int) -> str:
        """Multiply two integers and return the product."""
        return str(a * b)


def last_number(text: str) -> str | None:
    numbers = re.findall(r"-?\d+", text)
    return numbers[-1] if numbers else None


class CalcData(vf.TaskData):
    answer: str
    """The product, as text."""


class CalcTask(vf.Task[CalcData, vf.State, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config: vf.TaskConfig) -> list[vf.Toolset]:
        return [CalcToolset(vf.ToolsetConfig())]

    @vf.reward
    async def correct(self, task: CalcData, trace: vf.Trace) -> float:
        """1 when the last number of the model's last reply is the product."""
        return float(last_number(trace.last_reply) == task.answer)

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))


class CalcTaskset(vf.Taskset[CalcTask, vf.TasksetConfig]):
    def load(self) -> Iterator[CalcTask]:
        rng = random.Random(0)
        for _ in range(64):
            a, b = rng.randint(2, 99), rng.randint(2, 99)
            yield CalcTask(
                CalcData(prompt=f"What is {a} * {b}?", system_prompt=SYSTEM_PROMPT, answer=str(a * b)),
                self.config.task,
            )


__all__ = ["CalcTaskset"]

ENV = vf.SingleAgentEnvConfig(
    taskset={"id": "vf_calc"},
    agent=vf.AgentConfig(harness={"id": "null"}, runtime=vf.SubprocessConfig(), max_turns=4),
)

if __name__ == "__main__":  # verifiers starts the tool server as `python -m vf_calc`
    CalcToolset.run()
