"""A tool-using verifiers environment: multiply two numbers with a Python calculator tool.

Written with verifiers' own classes (``verifiers.v1``, 0.4.0): the tool is a ``vf.Toolset`` (an MCP
server verifiers starts as ``python -m vf_calc``) with one ``@vf.tool`` method; the ``Taskset`` names it in
``toolsets``, so one server serves every episode (the tool keeps no per-task state), and each ``Task`` scores
the finished trace with two ``@vf.reward`` methods. ``ENV`` pins verifiers' chat loop (``null``: it calls
the MCP tools the taskset offers) and a local subprocess runtime.

The questions are ``a * b`` with a, b in 2..99, drawn with a fixed seed, each after two worked example
episodes (a call of the tool, its result, the answer); the taskset config's ``split`` picks the training
questions (``train``, the default) or the held-out ones (``test``, never trained on). ``held_out()`` gives
the test split as agentloop tasks (``val_data: vf_calc:held_out``).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from typing import Any, Literal

import verifiers.v1 as vf

SYSTEM_PROMPT = "Use the multiply tool, then answer with the number only."
TOOL = "calc_multiply"  # verifiers' chat program names an MCP tool <server>_<tool>
# Two worked episodes before the question (a call of the tool, its result, the answer). Measured on
# SmolLM2-135M at T 0.8 over 64 samples of 16 questions (a bare HF generate of the proxy's prompt): with none
# it never called the tool (0 of 16 right); with one, 14 of 64 samples called it, 7 on the question's
# numbers, and greedy answered directly (3 of 32 held out right); with two, 53 of 64 called it, 37 on the
# right numbers: enough right episodes in a group of 8 for GRPO to compare.
WORKED = [(12, 34), (57, 8)]


def worked_episode(index: int, a: int, b: int) -> list[dict[str, Any]]:
    call = {"id": f"call_{index}", "name": TOOL, "arguments": json.dumps({"a": a, "b": b})}
    return [
        {"role": "user", "content": f"What is {a} * {b}?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": str(a * b)},
        {"role": "assistant", "content": str(a * b)},
    ]


EXAMPLE = [message for i, (a, b) in enumerate(WORKED) for message in worked_episode(i, a, b)]
# The shaping reward: a call of the tool on the question's numbers. Small beside the answer's 1, so a
# reward >= 1 still means a right answer (agentloop's val/success_rate counts those).
CALL_BONUS = 0.1
QUESTIONS = 256
HELD_OUT = 32  # the first 32 questions: the test split


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


def call_operands(arguments: str) -> tuple[Any, Any] | None:
    """The (a, b) of a tool call's JSON arguments; None when they are not an object holding both."""
    try:
        args = json.loads(arguments)
    except ValueError:
        return None
    return (args.get("a"), args.get("b")) if isinstance(args, dict) else None


class CalcData(vf.TaskData):
    a: int
    b: int
    answer: str
    """The product, as text."""


class CalcTask(vf.Task[CalcData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task: CalcData, trace: vf.Trace) -> float:
        """1 when the last number of the model's last reply is the product."""
        return float(last_number(trace.last_reply) == task.answer)

    @vf.reward(weight=CALL_BONUS)
    async def called_tool(self, task: CalcData, trace: vf.Trace) -> float:
        """1 when the model called the multiply tool on the question's two numbers (either order)."""
        wanted = sorted([str(task.a), str(task.b)])
        calls = [c for m in trace.assistant_messages for c in m.tool_calls or [] if c.name == TOOL]
        return float(any(sorted(map(str, call_operands(c.arguments) or ())) == wanted for c in calls))

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))


class CalcConfig(vf.TasksetConfig):
    split: Literal["train", "test"] = "train"
    """``train``: the training questions; ``test``: the held-out ones."""


def questions(split: str) -> list[tuple[int, int]]:
    rng = random.Random(0)
    pairs = [(rng.randint(2, 99), rng.randint(2, 99)) for _ in range(QUESTIONS)]
    return pairs[:HELD_OUT] if split == "test" else pairs[HELD_OUT:]


class CalcTaskset(vf.Taskset[CalcTask, CalcConfig]):
    @classmethod
    def toolsets(cls, config: CalcConfig) -> list[vf.Toolset]:
        return [CalcToolset(vf.ToolsetConfig())]

    def load(self) -> Iterator[CalcTask]:
        for a, b in questions(self.config.split):
            prompt = [*EXAMPLE, {"role": "user", "content": f"What is {a} * {b}?"}]
            yield CalcTask(
                CalcData(prompt=prompt, system_prompt=SYSTEM_PROMPT, a=a, b=b, answer=str(a * b)),
                self.config.task,
            )


def held_out() -> list[dict[str, Any]]:
    """The test split as agentloop tasks: each row's ``TaskData`` as JSON, as agentloop's train_tasks makes."""
    taskset = CalcTaskset(CalcConfig(id="vf_calc", split="test"))
    return [task.data.model_dump(mode="json", exclude_unset=True) for task in taskset]


__all__ = ["CalcTaskset"]

# The environment as `agentloop train` (agent: verifiers:vf_calc:ENV) and `vf-eval` both take it.
ENV = vf.SingleAgentEnvConfig(
    taskset={"id": "vf_calc"},
    agent=vf.AgentConfig(harness={"id": "null"}, runtime=vf.SubprocessConfig(), max_turns=4),
)

if __name__ == "__main__":  # verifiers starts the tool server as `python -m vf_calc`
    CalcToolset.run()
