"""calc_x: the data, the calculator, the reward, a scripted tool run and the CLI on the tiny model."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import anyio
import pytest

from agentloop.store.memory import MemoryStore
from agentloop.store.sqlite import SQLiteStore
from examples._harness import run_rollouts
from examples.calc_x import run
from examples.calc_x.agent import calculator, exact_match, extract_answer, make_agent
from examples.calc_x.data import make_problems
from tests.examples.checks import check_exact_tokens
from tests.integrations.scripted import scripted_engine, tool_call_text


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
