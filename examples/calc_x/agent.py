"""The calc_x agent: al.ToolAgent with a safe calculator tool; reward = exact match of the final answer."""

from __future__ import annotations

import ast
import math
import operator
import re
from decimal import Decimal, InvalidOperation
from typing import Any

from agentloop.tools import ToolAgent, function_tool

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
# Model output is hostile input: every number the calculator holds stays below 10**100 (333 bits),
# so each operation costs microseconds. Word problems never need more. A power is refused from the
# sizes of its operands *before* it is computed: `(((10**64)**64)**64)**64` took 13 s of CPU in one
# C-level pow that holds the GIL (a thread cannot be stopped, and the event loop stalled with it).
MAX_ABS = 10**100
_MAX_BITS = MAX_ABS.bit_length()
MAX_EXPRESSION_CHARS = 500  # longer input is refused before parsing


def _check_size(value: Any) -> float | int:
    if isinstance(value, complex):  # (-8) ** 0.5
        raise ValueError("the result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"the result {value} is not a finite number")
    if isinstance(value, int) and abs(value) >= MAX_ABS:
        raise ValueError("a number in the expression has more than 100 digits; the calculator stops there")
    if isinstance(value, float) and abs(value) >= MAX_ABS:
        raise ValueError(f"the result {value:g} is 1e100 or more; the calculator stops there")
    return value  # type: ignore[no-any-return]


def _power(base: float | int, exponent: float | int) -> float | int:
    """``base ** exponent``, refused when the result would exceed MAX_ABS (checked before computing)."""
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        # |base| >= 2**(bits - 1), so |base ** exponent| >= 2**((bits - 1) * exponent): too big, whatever it is
        if (abs(base).bit_length() - 1) * exponent >= _MAX_BITS:
            raise ValueError(f"{base} ** {exponent} has more than 100 digits; the calculator stops there")
    elif isinstance(base, float | int) and abs(base) > 1 and isinstance(exponent, float | int):
        # float power: overflows (OverflowError) in constant time, but big exponents are never needed
        if abs(exponent) > _MAX_BITS:
            raise ValueError(f"exponent {exponent} is too large (at most {_MAX_BITS})")
    return _check_size(operator.pow(base, exponent))


def _eval(node: ast.AST) -> float | int:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _check_size(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))  # type: ignore[no-any-return]
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            return _power(left, right)
        # both operands are below MAX_ABS: a product has at most 2 * 333 bits, microseconds to compute
        return _check_size(_OPS[type(node.op)](left, right))
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
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression has {len(expression)} characters; at most {MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError) as exc:  # ValueError: an integer literal over 4300 digits
        raise ValueError(f"cannot parse {expression!r}: {getattr(exc, 'msg', exc)}") from None
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
