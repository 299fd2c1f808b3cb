"""Tiny repositories with one failing test each, generated from a seed.

Each task is a one-function module ``<name>.py`` and its test ``test_<name>.py`` (plain ``assert``s
run by ``python3 test_<name>.py``: no pytest in the sandbox). The function is one line off what the
test expects, in one of four ways (``KINDS``)::

    operator     return a - b               the test expects a + b
    off_by_one   return list(range(1, n))   the test expects range(1, n + 1)
    constant     return hours * 50          the test expects hours * 60
    string       return "Hello, " + name    the test expects "Hi, " + name

The task statement names the file, shows the function and the failing assertion, so the fix is
reachable by a small model: one shell command, ``sed -i 's/OLD/NEW/' <name>.py`` (``fix``), with OLD
and NEW plain text (no regex characters: ``sed`` takes them literally). ``hint`` adds the replacement
to the statement (``Replace `a - b` with `a + b`.``); without it the model has to read the change off
the assertion.

    python -m examples.coding_tasks.tasks --out /tmp/coding_tasks   # repos/train/NNN, repos/heldout/NNN, *.jsonl

Train and held-out tasks come from one shuffled list with distinct (kind, function, change), so no
held-out repository is trained on.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

KINDS = ("operator", "off_by_one", "constant", "string")
TRAIN_SIZE, HELDOUT_SIZE = 100, 50

# operator: names per right operator; the wrong operator is one of the other two
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_OP_NAMES = {"+": ("add", "total", "combine", "plus", "sum_of", "join"),
             "-": ("subtract", "diff", "minus", "remaining", "gap", "less"),
             "*": ("multiply", "times", "product", "scale", "area", "mul")}  # fmt: skip
_PAIRS = (("a", "b"), ("x", "y"), ("m", "n"))
# off_by_one: (name, body with {v} and {end}, right end, wrong end, expected(n))
_RANGES = (
    ("count_up", "list(range(1, {end}))", "{v} + 1", "{v}", lambda n: list(range(1, n + 1))),
    ("count_from_zero", "list(range(0, {end}))", "{v} + 1", "{v}", lambda n: list(range(0, n + 1))),
    ("first_n", "list(range({end}))", "{v}", "{v} - 1", lambda n: list(range(n))),
    ("evens_upto", "list(range(0, {end}, 2))", "{v} + 1", "{v}", lambda n: list(range(0, n + 1, 2))),
    ("odds_upto", "list(range(1, {end}, 2))", "{v} + 1", "{v}", lambda n: list(range(1, n + 1, 2))),
    ("sum_upto", "sum(range(1, {end}))", "{v} + 1", "{v}", lambda n: sum(range(1, n + 1))),
    ("count_down", "list(range({end}, 0, -1))", "{v}", "{v} - 1", lambda n: list(range(n, 0, -1))),
    ("threes_upto", "list(range(0, {end}, 3))", "{v} + 1", "{v}", lambda n: list(range(0, n + 1, 3))),
    ("last_index", "{end}", "{v} - 1", "{v}", lambda n: n - 1),
)
_VARS = ("n", "k", "m", "size", "count", "limit")
# constant: (name, argument, right factor, wrong factors)
_CONSTANTS = (
    ("minutes", "hours", 60, (50, 600, 6, 100)),
    ("seconds", "minutes", 60, (100, 30, 6, 600)),
    ("grams", "kilos", 1000, (100, 10, 10000)),
    ("cents", "euros", 100, (10, 1000, 50)),
    ("days", "weeks", 7, (5, 6, 8, 10)),
    ("months", "years", 12, (10, 11, 13, 52)),
    ("hours", "days", 24, (12, 20, 60, 42)),
    ("meters", "km", 1000, (100, 10, 1024)),
    ("inches", "feet", 12, (10, 6, 16)),
    ("feet", "yards", 3, (2, 4, 12)),
    ("pence", "pounds", 100, (10, 1000, 12)),
    ("millis", "seconds", 1000, (100, 60, 10)),
)
# string: (name, right greeting, wrong ones)
_STRINGS = (
    ("greet", "Hi", ("Hello", "Hey", "Bye")),
    ("welcome", "Welcome", ("Hello", "Hi", "Hey")),
    ("farewell", "Bye", ("Goodbye", "Hi", "Ciao")),
    ("thank", "Thanks", ("Thank you", "Cheers", "Merci")),
    ("salute", "Hello", ("Hullo", "Hi", "Yo")),
    ("congratulate", "Congrats", ("Well done", "Bravo", "Hi")),
    ("goodnight", "Good night", ("Good day", "Night", "Bye")),
    ("morning", "Good morning", ("Morning", "Good day", "Hi")),
)
_PARAMS = ("name", "who")
_NAMES = ("Bob", "Ann", "Tom", "Eve", "Sam", "Zoe", "Max", "Ida")


def _operator(rng: random.Random) -> dict[str, Any]:
    right = rng.choice(list(_OPS))
    wrong = rng.choice([op for op in "+-" if op != right])  # never `*`: sed would need it escaped
    name, (p, q) = rng.choice(_OP_NAMES[right]), rng.choice(_PAIRS)
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    while _OPS[right](a, b) == _OPS[wrong](a, b):
        a, b = rng.randint(2, 9), rng.randint(2, 9)
    return {
        "name": name, "body": f"def {name}({p}, {q}):\n    return {p} {wrong} {q}\n",
        "old": f"{p} {wrong} {q}", "new": f"{p} {right} {q}",
        "assertion": f"assert {name}({a}, {b}) == {_OPS[right](a, b)}",
    }  # fmt: skip


def _off_by_one(rng: random.Random) -> dict[str, Any]:
    name, body, right_end, wrong_end, expected = rng.choice(_RANGES)
    v, n = rng.choice(_VARS), rng.randint(3, 9)
    old, new = body.format(end=wrong_end.format(v=v)), body.format(end=right_end.format(v=v))
    arg = "items" if name == "last_index" else v
    if name == "last_index":  # the index of the last of `items`: len(items) - 1
        old, new = old.replace(v, "len(items)"), new.replace(v, "len(items)")
        call, want = f"{name}({list(range(10, 10 + n))})", repr(n - 1)
    else:
        while eval(old, {}, {v: n}) == expected(n):  # a step range ends on n only for some n
            n = rng.randint(3, 9)
        call, want = f"{name}({n})", repr(expected(n))
    body = f"def {name}({arg}):\n    return {old}\n"
    if old.startswith("list(") or old.startswith("sum("):  # the change is inside: range(...)
        old, new = old[old.index("range(") : -1], new[new.index("range(") : -1]
    return {"name": name, "body": body, "old": old, "new": new, "assertion": f"assert {call} == {want}"}


def _constant(rng: random.Random) -> dict[str, Any]:
    name, arg, right, wrongs = rng.choice(_CONSTANTS)
    wrong = rng.choice(wrongs)
    x = rng.randint(2, 9)
    return {
        "name": name, "body": f"def {name}({arg}):\n    return {arg} * {wrong}\n",
        "old": str(wrong), "new": str(right),
        "assertion": f"assert {name}({x}) == {x * right}",
    }  # fmt: skip


def _string(rng: random.Random) -> dict[str, Any]:
    name, right, wrongs = rng.choice(_STRINGS)
    wrong, param, who = rng.choice(wrongs), rng.choice(_PARAMS), rng.choice(_NAMES)
    return {
        "name": name, "body": f'def {name}({param}):\n    return "{wrong}, " + {param}\n',
        "old": wrong, "new": right,
        "assertion": f"assert {name}({who!r}) == {right + ', ' + who!r}",
    }  # fmt: skip


_MAKERS = {"operator": _operator, "off_by_one": _off_by_one, "constant": _constant, "string": _string}


def statement(task: dict[str, Any], hint: bool = False) -> str:
    """The prompt the harness gets: the file, its function, the failing assertion (and the change)."""
    module, test = f"{task['name']}.py", f"test_{task['name']}.py"
    lines = [
        f"{test} fails. Fix {module} with one shell command.",
        f"{module}:",
        task["body"].rstrip("\n"),
        f"Failing assertion in {test}:",
        task["assertion"],
    ]
    if hint:
        lines.append(f"Replace `{task['old']}` with `{task['new']}`.")
    return "\n".join(lines)


def fix_command(task: dict[str, Any]) -> str:
    """The reference fix: one ``sed`` that replaces the wrong text by the right one. The texts are plain
    (no ``/ \\ & [ ] . * ^ $ '`` in the wrong text, no ``/ \\ & '`` in the right one: sed and the shell
    take them literally) and the wrong one occurs once in the module (checked)."""
    for text, special in ((task["old"], "/\\&[].*^$'"), (task["new"], "/\\&'")):
        if set(text) & set(special):
            raise ValueError(f"{text!r} would need escaping in a sed command")
    if task["body"].count(task["old"]) != 1:
        raise ValueError(f"{task['old']!r} must occur once in {task['body']!r}")
    return f"sed -i 's/{task['old']}/{task['new']}/' {task['name']}.py"


def make_tasks(
    train_size: int = TRAIN_SIZE, heldout_size: int = HELDOUT_SIZE, seed: int = 0, hint: bool = True
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``train_size`` + ``heldout_size`` distinct tasks, kinds in equal shares, split after a shuffle."""
    if train_size < 1 or heldout_size < 0:
        raise ValueError(f"train_size must be >= 1 and heldout_size >= 0, got {train_size}, {heldout_size}")
    rng = random.Random(seed)
    total, seen = train_size + heldout_size, set()
    tasks: list[dict[str, Any]] = []
    for _ in range(total * 50):
        if len(tasks) == total:
            break
        kind = KINDS[len(tasks) % len(KINDS)]
        t = _MAKERS[kind](rng)
        key = t["body"]  # distinct functions: no held-out fix is a training fix
        if key in seen:
            continue
        seen.add(key)
        t = {"kind": kind, **t}
        tasks.append(t)
    else:
        raise ValueError(f"could not make {total} distinct tasks from seed {seed}")
    rng.shuffle(tasks)
    out = []
    for i, t in enumerate(tasks):
        split = "heldout" if i < heldout_size else "train"
        task = {"id": f"{split}-{i:03d}", "split": split, **t}
        task["files"] = {
            f"{t['name']}.py": t["body"],
            f"test_{t['name']}.py": f"from {t['name']} import {t['name']}\n\n{t['assertion']}\n",
        }
        task["test"] = f"test_{t['name']}.py"
        task["fix"] = fix_command(task)
        task["hint"] = hint
        task["prompt"] = statement(task, hint)
        out.append(task)
    return out[heldout_size:], out[:heldout_size]


def check_command(task: dict[str, Any]) -> list[str]:
    """The test, run after the harness: with its bytecode cache elsewhere, since a sed that keeps the
    file's size within the same second leaves a ``__pycache__`` entry (from a run of the failing test
    before the fix) that Python would take as current and run the old code."""
    return ["python3", "-X", "pycache_prefix=/tmp/check-pycache", task["test"]]


def write_repo(task: dict[str, Any], folder: Path) -> Path:
    """The task's files under ``folder`` (created)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for rel, text in task["files"].items():
        (folder / rel).write_text(text)
    return folder


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument(
        "--out", required=True, help="folder for repos/{train,heldout}/NNN and {train,heldout}.jsonl"
    )
    p.add_argument("--train-size", type=int, default=TRAIN_SIZE)
    p.add_argument("--heldout-size", type=int, default=HELDOUT_SIZE)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hint", action=argparse.BooleanOptionalAction, default=True, help="name the replacement")
    args = p.parse_args(argv)
    out = Path(args.out)
    train, heldout = make_tasks(args.train_size, args.heldout_size, args.seed, args.hint)
    out.mkdir(parents=True, exist_ok=True)
    for split, tasks in (("train", train), ("heldout", heldout)):
        with open(out / f"{split}.jsonl", "w") as f:
            for task in tasks:
                write_repo(task, out / "repos" / split / task["id"])
                f.write(json.dumps(task) + "\n")
    print(json.dumps({"out": str(out), "train": len(train), "heldout": len(heldout)}))


if __name__ == "__main__":
    main()
