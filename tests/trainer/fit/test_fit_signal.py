"""Issue 42, "fail loudly when nothing can be learned": an agent that forgot to ``return`` its reward (or a
judge whose every verdict failed) gave a run that printed ``trained 1 steps``, exited 0 and wrote a
``final_model/`` identical to the start. Now a step with no usable attempt is not a training step, and
``trainer.max_steps_without_signal`` of them in a row stop the fit with one EmptyBatchError that counts the
rollouts by why they were unusable.

The fits are real (the tiny model, the proxy, the runner, a SQLite store, the Ray worker), kept to a
batch of 2 tasks x rollout.n 2 = 4 rollouts a step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest

import agentloop as al
from agentloop.errors import EmptyBatchError
from trainer import Trainer, TrainerConfig
from trainer.fit.learning_signal import SignalWatch

TASKS = [{"prompt": f"Name a colour, number {i}.", "seed": i} for i in range(8)]
BATCH = 4  # data.train_batch_size 2 x rollout.n 2 rollouts a step


async def _ask(task: dict[str, Any], llm: al.LLM) -> list[int]:
    client = openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
    resp = await client.chat.completions.create(
        model=llm.model,
        messages=[{"role": "user", "content": task["prompt"]}],
        temperature=1.0,
        extra_body={"return_token_ids": True},
    )
    return list((resp.model_extra or {})["token_ids"])


@al.rollout
async def forgets_its_reward(task: dict[str, Any], llm: al.LLM) -> None:
    """Computes a reward and forgets to return it (the new user's mistake the issue tried)."""
    ids = await _ask(task, llm)
    _reward = (ids[0] % 997) / 997


calls = {"n": 0}


@al.rollout
async def late_reward(task: dict[str, Any], llm: al.LLM) -> float | None:
    """No reward for the first batch's 4 rollouts (sync mode: they all run before the next batch is
    drawn), then a reward that differs between almost any two samples."""
    ids = await _ask(task, llm)
    calls["n"] += 1
    return None if calls["n"] <= BATCH else (ids[0] % 997) / 997


def config(model_dir: Path, run_dir: Path, steps: int, without_signal: int) -> dict[str, Any]:
    return {
        "data": {"train_batch_size": 2, "max_prompt_length": 64, "max_response_length": 2},
        "actor_rollout_ref": {
            "model": {"path": str(model_dir)},
            "rollout": {"n": 2, "concurrency": 8},
            "actor": {"ppo_mini_batch_size": 2, "optim": {"lr": 1e-2, "weight_decay": 0.0}},
        },
        "trainer": {
            "total_training_steps": steps,
            "max_steps_without_signal": without_signal,
            "default_local_dir": str(run_dir),
            "device": "cpu",
            "logger": ["jsonl"],
        },
    }


def test_the_key_has_a_small_default_and_must_be_positive() -> None:
    assert TrainerConfig().trainer.max_steps_without_signal == 3
    with pytest.raises(ValueError, match=r"trainer\.max_steps_without_signal"):
        TrainerConfig.from_dict({"trainer": {"max_steps_without_signal": 0}})


def test_the_watch_counts_rollouts_by_kind_over_the_steps_in_a_row(tmp_path: Path) -> None:
    """Hand-counted: step a, 4 rollouts: 3 without a reward, 1 failed; step b, 4 rollouts: 2 without a
    reward, 1 with a prompt too long, 1 without an LLM call, the judge failed on 1 group. Limit 2: the
    error after b counts 8 rollouts: 5 + 1 + 1 + 1 (+ the judge's group). A step that trains in between
    resets the count and says how many batches were skipped before it."""
    watch = SignalWatch(2, tmp_path / "run")
    a = {"batch/samples": 0.0, "batch/dropped_attempts_no_reward": 3.0, "rollout/failed": 1.0}
    assert watch.observe(a, ["r1", "r2", "r3", "r4"]) is False and not watch.exhausted
    trained = {"batch/samples": 3.0}
    assert watch.observe(trained, ["r5", "r6", "r7", "r8"]) is True
    assert trained["batch/skipped_without_signal"] == 1.0 and watch.in_a_row == 0 and not watch.counts
    assert watch.observe(dict(a), ["r1", "r2", "r3", "r4"]) is False
    b = {"batch/samples": 0.0, "batch/dropped_attempts_no_reward": 2.0,
         "batch/attempts_untrained_prompt_too_long": 1.0, "rollout/without_calls": 1.0,
         "judge/failed_groups": 1.0}  # fmt: skip
    assert watch.observe(b, ["r9", "r10", "r11", "r12"]) is False and watch.exhausted
    assert watch.rollout_ids == ["r1", "r2", "r3", "r4", "r9", "r10", "r11", "r12"]
    message = str(watch.error("2 x ValueError: boom"))
    assert message == (
        "no learning signal: 2 steps in a row trained nothing (trainer.max_steps_without_signal=2): "
        "none of 8 rollouts gave a usable attempt: "
        "5 ended without a reward (return it from the agent, or call al.emit_reward), "
        "1 failed (the agent raised or timed out; their attempts' errors: 2 x ValueError: boom), "
        "1 had every prompt over data.max_prompt_length, "
        "1 made no LLM call through llm.base_url (the proxy records the tokens), "
        "the judge failed on 1 group of attempts (judge.jsonl; on_failure='skip'); "
        "the model was not updated by them and no final model was written; "
        f"look at the attempts with `agentloop inspect {tmp_path / 'run'}`, "
        f"their tracebacks with `agentloop inspect {tmp_path / 'run'} --errors`"
    )


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_a_fit_whose_agent_returns_no_reward_stops_with_the_reason(
    tmp_path: Path, tiny_model_dir: Path, ray_local: None
) -> None:
    """Before: 'trained 2 steps', exit 0, a final_model/ equal to the start. Now: 2 steps in a row
    without signal (the limit) x 4 rollouts = 8 rollouts, all 8 without a reward; no step counted, no
    metrics line, no final model, the run not marked finished."""
    run_dir = tmp_path / "run"
    with pytest.raises(EmptyBatchError) as info:
        Trainer(config(tiny_model_dir, run_dir, steps=2, without_signal=2)).fit(forgets_its_reward, TASKS)
    message = str(info.value)
    assert message.startswith(
        "no learning signal: 2 steps in a row trained nothing (trainer.max_steps_without_signal=2): "
        "none of 8 rollouts gave a usable attempt: 8 ended without a reward (return it from the agent, "
        "or call al.emit_reward); "
    ), message
    assert message.endswith(f"`agentloop inspect {run_dir}`") and "\n" not in message
    assert not (run_dir / "final_model").exists()
    assert json.loads((run_dir / "run.json").read_text())["status"] == "running"
    metrics = run_dir / "metrics.jsonl"
    assert not metrics.exists() or metrics.read_text() == ""


@pytest.mark.slow  # 15-25 s on 2 cores: in make test-slow (CI), to keep make test under 15 min
@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_steps_without_signal_do_not_count_and_a_later_signal_trains(
    tmp_path: Path, tiny_model_dir: Path, ray_local: None
) -> None:
    """The first batch has no reward (not a step: 1 skipped, under the limit of 2); the second has one:
    it is step 1 of 1, the run finishes with a final model."""
    calls["n"] = 0
    result = Trainer(config(tiny_model_dir, tmp_path / "run", steps=1, without_signal=2)).fit(
        late_reward, TASKS
    )
    assert calls["n"] == 2 * BATCH  # two batches drawn for the one step
    assert result.steps == 1 and result.model_dir is not None and result.model_dir.exists()
    [row] = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert row["step"] == 1 and row["batch/skipped_without_signal"] == 1.0
    assert row["batch/samples"] == BATCH and "weights_version" in row
