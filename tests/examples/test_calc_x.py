"""calc_x: the data, the calculator, the reward, a scripted tool run and the CLI on the tiny model."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from agentloop.store.memory import MemoryStore
from agentloop.store.sqlite import SQLiteStore
from agentloop.tools import ToolRegistry, execute_tool_call
from examples._harness import run_rollouts
from examples.calc_x import run
from examples.calc_x.agent import calculator, exact_match, extract_answer, make_agent
from examples.calc_x.data import make_problems
from tests.examples.checks import check_exact_tokens
from tests.integrations.scripted import scripted_engine, tool_call_text
from tests.loop_watch import watch_event_loop


def test_problems_are_deterministic_and_correct() -> None:
    a, b = make_problems(8, seed=1), make_problems(8, seed=1)
    assert a == b and a != make_problems(8, seed=2)
    first = a[0]  # "X has a ... and gets b more"
    nums = [int(n) for n in re.findall(r"\d+", first["question"])]
    assert first["answer"] == str(nums[0] + nums[1])
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        make_problems(0)


def test_calculator_and_reward() -> None:
    assert (
        calculator("(12 + 30) * 4") == "168" and calculator("7 / 2") == "3.5" and calculator("-2**3") == "-8"
    )
    for bad in ("__import__('os')", "2 ** 1000", "1 +"):
        with pytest.raises(ValueError):
            calculator(bad)
    assert extract_answer("so it is 41, no wait. Answer: 1,234") == "1234"
    assert (
        extract_answer("it is 12.0") == "12"
        and extract_answer("none") is None
        and extract_answer(None) is None
    )
    assert exact_match({"answer": "42"}, "Answer: 42") == 1.0 and exact_match({"answer": "42"}, "43") == 0.0


HOSTILE = [
    "(((10**64)**64)**64)**64",  # 13 s of CPU in one GIL-holding pow on the old code; one more level: hours
    "((10**64)**64)**64",
    "9**9**9",
    "10**10**10",
    "2**332 * 2**332 * 2**332",
    "(10**99) * (10**99) * (10**99)",
    "1" * 400,
    "10**-400",
    "1e308 * 10",
    "(-8) ** 0.5",
    "1.0000001 ** 100000000",
    "1 + " * 200 + "1",
]


@pytest.mark.parametrize("expression", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_expressions_are_refused_before_any_long_computation(expression: str) -> None:
    """issue 16: operand sizes are bounded *before* computing, so no expression costs more than microseconds."""
    start = time.thread_time()
    with pytest.raises(ValueError, match=r"digits|too large|not a real|finite|1e100|characters"):
        calculator(expression)
    assert time.thread_time() - start < 0.05, expression


def test_the_bounds_leave_room_for_every_word_problem() -> None:
    assert calculator("2**332") == str(2**332) and calculator("10**99") == "1" + "0" * 99
    assert (
        calculator("12345678 * 87654321") == "1082152022374638" and calculator("1.5 ** 10") == "57.6650390625"
    )
    assert (
        calculator("(-2) ** 3") == "-8"
        and calculator("2 ** -2") == "0.25"
        and calculator("1 ** 10**99") == "1"
    )


async def test_the_tower_through_the_agent_tool_path_answers_in_milliseconds() -> None:
    """The tool as the ToolAgent calls it (a worker thread with a 2 s deadline): an error the model can
    read, at once, while the event loop keeps ticking (the old code stalled the loop for 13 s)."""
    registry = ToolRegistry([calculator])
    async with watch_event_loop() as gaps:
        start = time.monotonic()
        result = await execute_tool_call(registry, "calculator", {"expression": HOSTILE[0]}, timeout_s=2.0)
        elapsed = time.monotonic() - start
    assert result.is_error and result.metrics["error"] == "tool_exception", result
    assert "more than 100 digits" in (result.response.text or "")
    assert elapsed < 1.0 and max(gaps) < 0.5, (elapsed, max(gaps))


async def test_scripted_calculator_run_scores_and_masks(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tasks = make_problems(2, seed=5)[:1]
    a, b = (int(n) for n in re.findall(r"\d+", tasks[0]["question"])[:2])

    def script(prompt: str, turn: int) -> str:
        if turn == 0:
            return "Let me compute.\n" + tool_call_text("calculator", {"expression": f"{a} + {b}"})
        result = re.findall(r"<\|im_start\|>tool\n(.*?)<\|im_end\|>", prompt, re.DOTALL)[-1].strip()
        return f"Answer: {result}"

    store = MemoryStore()
    with anyio.fail_after(60):
        summary = await run_rollouts(make_agent(), tasks, scripted_engine(tok, script), store=store)
    assert summary["rewards"] == [1.0] and summary["tool_calls"] == 1 and summary["llm_calls"] == 2
    assert summary["samples"] == 1 and summary["masked_tokens"] > 0
    counts = await check_exact_tokens(store, summary["rollout_ids"])
    assert counts == {"calls": 2, "samples": 1, "masked": summary["masked_tokens"]}


@pytest.mark.e2e
def test_cli_runs_on_the_tiny_model(tiny_model_dir: Path, tmp_path: Path, capsys: Any) -> None:
    db = tmp_path / "calc.db"
    argv = ["--model", str(tiny_model_dir), "--rollouts", "3", "--device", "cpu", "--max-tokens", "12",
            "--max-turns", "2", "--store", str(db)]  # fmt: skip
    summary = run.main(argv)
    assert summary["rollouts"] == 3 and summary["statuses"] == {"succeeded": 3}
    assert (
        all(r in (0.0, 1.0) for r in summary["rewards"]) and summary["triplets"] == summary["llm_calls"] >= 3
    )
    assert '"mean_reward"' in capsys.readouterr().out

    async def check() -> dict[str, int]:
        store = SQLiteStore(str(db))
        try:
            return await check_exact_tokens(store, summary["rollout_ids"])
        finally:
            await store.close()

    counts = anyio.run(check)
    assert counts["calls"] == summary["llm_calls"] and counts["masked"] == summary["masked_tokens"]
