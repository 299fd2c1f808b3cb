"""issue 16: training and validation rollouts carry ``rollout.agent_timeout_s``, so an agent that hangs
is cancelled (attempt status timeout) and retried, and the step finishes instead of waiting forever."""

from __future__ import annotations

from pathlib import Path

import anyio
import openai
import pytest

import agentloop as al
from agentloop.store.sqlite import SQLiteStore
from agentloop.types import AttemptedRollout, AttemptStatus, RolloutStatus
from trainer import Trainer

TASKS = [{"prompt": f"Name a colour, number {i}.", "seed": i} for i in range(2)]


@al.rollout
async def hangs_on_its_first_attempt(task: dict, llm: al.LLM, rollout: AttemptedRollout) -> float:
    """The first attempt waits forever (a tool that never answers); the retry answers."""
    if rollout.attempt.sequence_id == 1:
        await anyio.sleep_forever()
    client = openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
    resp = await client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": task["prompt"]}], max_tokens=2
    )
    return float(bool(resp.choices[0].message.content))


@pytest.mark.slow  # 10-20 s on 2 cores: in make test-slow (CI), to keep make test under 15 min
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_hung_agent_times_out_and_is_retried_in_training_and_validation(
    tmp_path: Path, tiny_model_dir: Path, ray_local: None
) -> None:
    cfg = {
        "data": {"train_batch_size": 2, "max_prompt_length": 64, "max_response_length": 2},
        "actor_rollout_ref": {
            "model": {"path": str(tiny_model_dir)},
            "rollout": {"n": 2, "concurrency": 8, "agent_timeout_s": 2.0},
            "actor": {"ppo_mini_batch_size": 2, "optim": {"lr": 1e-2, "weight_decay": 0.0}},
        },
        "trainer": {
            "total_training_steps": 1,
            "default_local_dir": str(tmp_path / "run"),
            "device": "cpu",
            "logger": ["jsonl"],
            "val_before_train": False,
            "timeouts": {"rollouts_s": 120},  # what would end the run if the agent were waited on
        },
    }
    result = Trainer(cfg).fit(hangs_on_its_first_attempt, TASKS, TASKS[:1])
    assert [h["step"] for h in result.history] == [1.0]
    assert [v["val/step"] for v in result.val_history] == [1.0]

    async def attempts() -> dict[str, list[tuple[RolloutStatus, list[AttemptStatus]]]]:
        store = SQLiteStore(result.run_dir / "store.db")
        try:
            out: dict[str, list[tuple[RolloutStatus, list[AttemptStatus]]]] = {"train": [], "val": []}
            for rollout in await store.list_rollouts():
                tries = sorted(await store.list_attempts(rollout.rollout_id), key=lambda a: a.sequence_id)
                out[rollout.mode].append((rollout.status, [a.status for a in tries]))
                assert rollout.config.timeout_s == 2.0
            return out
        finally:
            await store.close()

    found = anyio.run(attempts)
    expected = (RolloutStatus.SUCCEEDED, [AttemptStatus.TIMEOUT, AttemptStatus.SUCCEEDED])
    assert found["train"] == [expected] * 4, found
    assert found["val"] == [expected], found
