"""The calc_x agent: al.ToolAgent with a safe calculator tool; reward = exact match of the final answer."""

from __future__ import annotations

import ast
import operator
import re
from decimal import Decimal, InvalidOperation
from typing import Any

from agentloop.tool_agent import ToolAgent
from agentloop.tools import function_tool

SYSTEM_PROMPT = (
    "You solve arithmetic word problems. Use the calculator tool for every computation. "
    "When you know the result, reply with one line: 'Answer: <number>'."
)

_OPS: dict[type, Any] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
_MAX_EXPONENT = 64  # keeps 10**10**10 from hanging the tool


def _eval(node: ast.AST) -> float | int:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value  # type: ignore[no-any-return]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))  # type: ignore[no-any-return]
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise ValueError(f"exponent {right} is too large (at most {_MAX_EXPONENT})")
        return _OPS[type(node.op)](left, right)  # type: ignore[no-any-return]
    raise ValueError(f"unsupported syntax: {ast.dump(node)[:60]}; use numbers and + - * / // % ** ( )")


def format_number(value: float | int) -> str:
    """``6.0`` -> ``"6"``, ``2.5`` -> ``"2.5"``."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(round(value, 10)) if isinstance(value, float) else str(value)


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "(12 + 30) * 4".
    """
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"cannot parse {expression!r}: {exc.msg}") from None
    return format_number(_eval(tree))


_ANSWER = re.compile(r"answer\s*[:=]?\s*(-?[\d,]*\.?\d+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?[\d,]*\.?\d+")


def extract_answer(text: str | None) -> str | None:
    """The number after 'Answer:', else the last number in the text (commas dropped), normalised."""
    if not text:
        return None
    found = _ANSWER.findall(text) or _NUMBER.findall(text)
    if not found:
        return None
    try:
        return format_number(float(Decimal(found[-1].replace(",", ""))))
    except (InvalidOperation, ValueError):
        return None


def exact_match(task: dict[str, Any], answer: str | None) -> float:
    """1.0 when the final answer's number equals the gold answer exactly, else 0.0."""
    return float(extract_answer(answer) == task["answer"])


def make_agent(max_turns: int = 4, sampling: dict[str, Any] | None = None) -> ToolAgent:
    return ToolAgent(
        [calculator], exact_match, system_prompt=SYSTEM_PROMPT, max_turns=max_turns, sampling=sampling,
        max_tool_response_chars=200,
    )  # fmt: skip
