"""Example tools for the tool tests and tests/tools/data/tools.yaml (written with postponed annotations on
purpose: function_tool must resolve string annotations)."""

from __future__ import annotations

import threading
from typing import Any

from agentloop.tools import BaseTool, ToolResponse, ToolResult, function_tool


@function_tool
def add(a: int, b: int = 0) -> int:
    """Add two integers.

    Args:
        a: The first addend.
        b: The second addend.
    """
    return a + b


def multiply(x: float, y: float) -> float:
    """Multiply two numbers (a plain function: the YAML loader wraps it)."""
    return x * y


@function_tool(name="thread_probe")
def thread_probe() -> dict[str, int]:
    """Report which thread ran the call."""
    return {"thread": threading.get_ident()}


class Counter(BaseTool):
    """Counts calls per trajectory instance; remembers what was created and released."""

    name = "counter"
    description = "Increase a counter and return its value."
    parameters = {
        "type": "object",
        "properties": {"step": {"type": "integer", "description": "How much to add."}},
        "required": ["step"],
        "additionalProperties": False,
    }

    def __init__(self, start: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.start = start
        self.counts: dict[str, int] = {}
        self.created: list[str] = []
        self.released: list[str] = []

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> str:
        iid = await super().create(instance_id, **kwargs)
        self.counts[iid] = self.start
        self.created.append(iid)
        return iid

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        self.counts[instance_id] += arguments["step"]
        value = self.counts[instance_id]
        return ToolResult(response=ToolResponse(text=str(value)), reward=float(value), metrics={"calls": 1})

    async def release(self, instance_id: str) -> None:
        del self.counts[instance_id]
        self.released.append(instance_id)


class Exploding(Counter):
    """Raises inside execute, so tests can check that release still runs."""

    name = "exploding"

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        raise RuntimeError(f"boom in {instance_id}")
