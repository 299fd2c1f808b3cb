"""A ReactAgentLoop trains for two steps with Trainer.fit on CPU (tiny model, real proxy, store, Ray worker)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integrations.test_langgraph import Multiplier


class Scored(Multiplier):
    sampling = {"max_tokens": 8}

    def reward(self, task: Any, final_state: Any) -> float:
        # a dense reward so GRPO groups differ: the length of the final message, capped
        last = final_state["messages"][-1].content if final_state else ""
        return min(len(str(last)), 40) / 40


@pytest.mark.e2e
def test_react_agent_loop_trains_two_steps(tmp_path: Path, tiny_model_dir: Path) -> None:
    from trainer import Trainer

    cfg = {
        "data": {"train_batch_size": 2, "max_prompt_length": 1024, "max_response_length": 64},
        "actor_rollout_ref": {
            "model": {"path": str(tiny_model_dir)},
            "rollout": {"n": 2, "temperature": 1.0, "concurrency": 4},
            "actor": {"ppo_mini_batch_size": 2, "optim": {"lr": 1e-3}},
        },
        "algorithm": {"adv_estimator": "grpo"},
        "trainer": {
            "total_training_steps": 2,
            "default_local_dir": str(tmp_path / "run"),
            "device": "cpu",
            "logger": ["jsonl"],
            "val_before_train": False,
        },
    }
    tasks = [{"question": f"{i}*3?", "answer": str(3 * i)} for i in range(4)]
    result = Trainer(cfg).fit(Scored(), tasks)
    assert len(result.history) == 2 and all("reward/mean" in m for m in result.history)
    assert (result.run_dir / "metrics.jsonl").read_text().count("\n") == 2
