"""The tools demo's calculator (trainer/demos/tools.py): evaluates the model's arithmetic, which is
hostile input: only numbers, + - * / and parentheses, no names or calls, bounded in length and size."""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from typing import Any

from agentloop.tools import function_tool

_OPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}
_MAX_ABS = 10**12  # model output is hostile input: no giant numbers (there is no ** either)
_MAX_EXPRESSION_CHARS = 200


def evaluate(expression: str) -> int | float:
    """The value of ``expression``: numbers, ``+ - * /``, parentheses and signs; anything else raises."""
    if len(expression) > _MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression is {len(expression)} characters long, at most {_MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r}; write numbers with + - * / and ( )") from None

    def ev(node: ast.AST) -> int | float:
        value: int | float
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, int | float)
            and not isinstance(node.value, bool)
        ):
            value = node.value
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            value = -ev(node.operand) if isinstance(node.op, ast.USub) else ev(node.operand)
        elif isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ValueError("division by zero")
            value = _OPS[type(node.op)](left, right)
        else:
            raise ValueError(f"unsupported {type(node).__name__} in {expression!r}; use + - * / and ( )")
        if abs(value) > _MAX_ABS:
            raise ValueError(f"a value in {expression!r} exceeds {_MAX_ABS:.0e}")
        return value

    return ev(tree.body)


def format_number(value: int | float) -> str:
    """``6.0`` -> ``"6"``, ``2.5`` -> ``"2.5"``, ``1 / 3`` -> ``"0.333333"``."""
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else f"{value:.6g}"
    return str(value)


@function_tool(timeout_s=5.0)
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: e.g. "12 * 7 - 5"
    """
    return format_number(evaluate(expression))
