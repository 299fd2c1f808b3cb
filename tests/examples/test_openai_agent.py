"""openai_agent: the minimal @al.rollout agent, scripted and on the tiny model through the CLI."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from agentloop.store.memory import MemoryStore
from agentloop.store.sqlite import SQLiteStore
from examples._harness import run_rollouts
from examples.openai_agent import run
from examples.openai_agent.agent import agent, make_tasks
from tests.examples.checks import check_exact_tokens
from tests.integrations.scripted import scripted_engine


async def test_scripted_answers_are_scored(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = scripted_engine(tok, lambda prompt, turn: "Paris." if "France" in prompt else "No idea.")
    store = MemoryStore()
    with anyio.fail_after(60):
        summary = await run_rollouts(agent, make_tasks(2), engine, store=store)
    assert summary["rewards"] == [1.0, 0.0] and summary["llm_calls"] == 2 and summary["masked_tokens"] == 0
    assert (await check_exact_tokens(store, summary["rollout_ids"]))["samples"] == 2


@pytest.mark.e2e
def test_cli_runs_on_the_tiny_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    argv = ["--model", str(tiny_model_dir), "--rollouts", "3", "--device", "cpu", "--max-tokens", "8",
            "--store", str(tmp_path / "s.db")]  # fmt: skip
    summary = run.main(argv)
    assert summary["statuses"] == {"succeeded": 3} and summary["triplets"] == summary["llm_calls"] == 3

    async def check() -> dict[str, int]:
        store = SQLiteStore(str(tmp_path / "s.db"))
        try:
            return await check_exact_tokens(store, summary["rollout_ids"])
        finally:
            await store.close()

    assert anyio.run(check) == {"calls": 3, "samples": 3, "masked": 0}


@pytest.mark.slow  # 10-20 s on 2 cores: in make test-slow (CI), to keep make test under 15 min
@pytest.mark.e2e
def test_cli_train_flag_runs_trainer_fit(tiny_model_dir: Path, tmp_path: Path) -> None:
    argv = ["--model", str(tiny_model_dir), "--rollouts", "4", "--device", "cpu", "--max-tokens", "4",
            "--train", "1", "--run-dir", str(tmp_path / "run")]  # fmt: skip
    summary = run.main(argv)
    assert summary["steps"] == 1 and (tmp_path / "run" / "metrics.jsonl").exists()
