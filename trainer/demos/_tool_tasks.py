"""The tools demo's tasks (trainer/demos/tools.py): problems from a seed, the prompt with its worked
examples, and the reward (the first ``Answer: N`` against the gold answer)."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from typing import Any

# ---------------------------------------------------------------- problems

_NAMES = ("Ada", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jon", "Kai", "Lena")
_ITEMS = ("apples", "pencils", "stamps", "marbles", "books", "coins", "shells", "cards", "eggs", "nails")


def _product(r: random.Random) -> tuple[str, int]:
    a, b = r.randint(12, 999), r.randint(12, 99)
    return f"What is {a} * {b}?", a * b


def _times_minus(r: random.Random) -> tuple[str, int]:
    who, item = r.choice(_NAMES), r.choice(_ITEMS)
    a, b = r.randint(3, 40), r.randint(6, 60)
    c = r.randint(1, a * b - 1)
    return (
        f"{who} buys {a} boxes of {item} with {b} {item} in each box, then loses {c} of them. "
        f"How many {item} does {who} have?",
        a * b - c,
    )


def _times_plus(r: random.Random) -> tuple[str, int]:
    who, item = r.choice(_NAMES), r.choice(_ITEMS)
    a, b, c = r.randint(3, 40), r.randint(6, 60), r.randint(1, 99)
    return (
        f"{who} buys {a} boxes of {item} with {b} {item} in each box, then finds {c} more. "
        f"How many {item} does {who} have?",
        a * b + c,
    )


def _plus_minus(r: random.Random) -> tuple[str, int]:
    who, item = r.choice(_NAMES), r.choice(_ITEMS)
    a, b = r.randint(100, 999), r.randint(100, 999)
    c = r.randint(10, a + b - 1)
    return (
        f"{who} has {a} {item}, gets {b} more and then gives away {c}. How many {item} does {who} have now?",
        a + b - c,
    )


def _share(r: random.Random) -> tuple[str, int]:
    who, item = r.choice(_NAMES), r.choice(_ITEMS)
    friends, each, extra = r.randint(2, 12), r.randint(5, 120), r.randint(1, 50)
    return (
        f"{who} shares {friends * each} {item} equally among {friends} friends and then gives each "
        f"friend {extra} more. How many {item} does each friend get in total?",
        each + extra,
    )


# (kind, level, generator), easy to hard. Level 1: one operation on bare numbers; level 2: two
# operations in words, in the worked example's form (a product, then a sum or difference); level 3:
# two operations in other forms. Every word problem has three numbers and needs both operations,
# so no kind rewards dropping a term that another kind needs. The examples' names and items are
# not in the data.
KINDS: tuple[tuple[str, int, Callable[[random.Random], tuple[str, int]]], ...] = (
    ("product", 1, _product),
    ("times_minus", 2, _times_minus),
    ("times_plus", 2, _times_plus),
    ("plus_minus", 3, _plus_minus),
    ("share", 3, _share),
)


def make_problems(n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` distinct problems ``{question, answer, kind, level}``, the kinds in turn, from ``seed``."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    r = random.Random(seed)
    seen: set[str] = set()
    out: list[dict[str, Any]] = []
    while len(out) < n:
        kind, level, gen = KINDS[len(out) % len(KINDS)]
        question, answer = gen(r)
        if question not in seen:
            seen.add(question)
            out.append({"question": question, "answer": answer, "kind": kind, "level": level})
    return out


def make_datasets(train_size: int, val_size: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, held-out): ``train_size + val_size`` distinct problems shuffled by ``seed`` and split.

    No held-out question is ever trained on; the same seed always gives the same split, and both
    sets hold every kind in the same proportions (up to shuffling).
    """
    if train_size < 1 or val_size < 1:
        raise ValueError(f"train_size and val_size must be >= 1, got {train_size} and {val_size}")
    problems = make_problems(train_size + val_size, seed)
    random.Random(seed).shuffle(problems)
    return problems[val_size:], problems[:val_size]


# ---------------------------------------------------------------- prompt

SYSTEM_PROMPT = (
    "You are a math assistant. Do not compute in your head: call the calculator tool with the "
    "expression, then reply with one line 'Answer: <number>' using the number it returned."
)


def _worked_example(index: int, question: str, expression: str, result: str) -> list[dict[str, Any]]:
    """One solved problem as earlier turns: question, tool call, tool result, final answer."""
    call_id = f"call_example_{index}"
    return [
        {"role": "user", "content": question},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "name": "calculator", "content": result},
        {"role": "assistant", "content": f"Answer: {result}"},
    ]


# Two solved problems shown before every question (their names and items are not in the data):
# a bare product and a two-step word problem.
EXAMPLES: list[dict[str, Any]] = [
    *_worked_example(1, "What is 23 * 47?", "23 * 47", "1081"),
    *_worked_example(
        2,
        "Mia buys 7 boxes of cups with 14 cups in each box, then breaks 9 of them. "
        "How many cups does Mia have?",
        "7 * 14 - 9",
        "89",
    ),
]


def task_messages(task: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation the model sees: system prompt, the worked examples, then the question."""
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        *EXAMPLES,
        {"role": "user", "content": task["question"]},
    ]


# ---------------------------------------------------------------- reward

_ANSWER_RE = re.compile(r"Answer:\s*(-?\d+)(?!\d|\.\d)")  # "Answer: 89." counts, "Answer: 89.5" does not


def parse_answer(text: str | None) -> int | None:
    """The integer after the first ``Answer:`` in ``text``, or None (``Answer: 4.5`` is None too)."""
    match = _ANSWER_RE.search(text or "")
    return int(match.group(1)) if match else None


def well_formed_calls(messages: list[dict[str, Any]]) -> int:
    """Calculator calls after the last user message (the worked examples' calls come before it)
    that the proxy parsed and the tool ran without an error."""
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    return sum(
        1
        for m in messages[users[-1] + 1 if users else 0 :]
        if m.get("role") == "tool"
        and m.get("name") == "calculator"
        and not str(m.get("content") or "").startswith("Error")
    )


def score(answer: str | None, gold: int, made_call: bool, call_bonus: float = 0.0) -> float:
    """1.0 when the final answer is exactly ``gold``; else ``call_bonus`` if a call was well formed."""
    if parse_answer(answer) == gold:
        return 1.0
    return call_bonus if made_call else 0.0
