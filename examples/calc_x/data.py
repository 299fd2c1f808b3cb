"""Arithmetic word problems, generated deterministically from a seed (nothing is downloaded)."""

from __future__ import annotations

import random
from collections.abc import Callable

Problem = dict[str, str]

_NAMES = ["Ada", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jon"]
_ITEMS = ["apples", "pencils", "stamps", "marbles", "books", "coins", "shells", "cards"]


def _plus(r: random.Random, who: str, item: str) -> tuple[str, int]:
    a, b = r.randint(12, 999), r.randint(12, 999)
    return f"{who} has {a} {item} and gets {b} more. How many {item} does {who} have now?", a + b


def _minus(r: random.Random, who: str, item: str) -> tuple[str, int]:
    a = r.randint(200, 2000)
    b = r.randint(10, a - 1)
    return f"{who} had {a} {item} and gave away {b}. How many {item} are left?", a - b


def _times_minus(r: random.Random, who: str, item: str) -> tuple[str, int]:
    a, b = r.randint(3, 40), r.randint(6, 60)
    c = r.randint(1, a * b - 1)
    return (
        f"{who} buys {a} boxes of {item} with {b} {item} in each box, then loses {c} of them. "
        f"How many {item} does {who} have?",
        a * b - c,
    )


def _share(r: random.Random, who: str, item: str) -> tuple[str, int]:
    friends, each = r.randint(2, 12), r.randint(5, 120)
    extra = r.randint(1, 50)
    return (
        f"{who} shares {friends * each} {item} equally among {friends} friends and then gives each friend "
        f"{extra} more. How many {item} does each friend get in total?",
        each + extra,
    )


_KINDS: list[Callable[[random.Random, str, str], tuple[str, int]]] = [_plus, _minus, _times_minus, _share]


def make_problems(n: int, seed: int = 0) -> list[Problem]:
    """``n`` problems ``{"question", "answer"}``; the same seed gives the same problems."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    r = random.Random(seed)
    out = []
    for i in range(n):
        question, answer = _KINDS[i % len(_KINDS)](r, r.choice(_NAMES), r.choice(_ITEMS))
        out.append({"question": question, "answer": str(answer)})
    return out
