"""A training job for the resume test, run as a subprocess: python -m tests.trainer.resume_job MODEL RUN_DIR STEPS."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import openai

import agentloop as al
from trainer import Trainer


@al.rollout
async def seeded_agent(task: dict, llm: al.LLM, rollout: al.AttemptedRollout) -> float:
    """Deterministic per (task, sample): the seed comes from the task and the sample index."""
    client = openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
    seed = task["seed"] * 100 + int(rollout.metadata["sample_index"])
    resp = await client.chat.completions.create(
        model=llm.model,
        messages=[{"role": "user", "content": task["prompt"]}],
        max_tokens=2,
        temperature=1.0,
        seed=seed,
        extra_body={"return_token_ids": True},
    )
    ids = (resp.model_extra or {})["token_ids"]
    return sum(1 for t in ids if t < 4915) / len(ids)


def config(model_dir: str, run_dir: str, steps: int) -> dict[str, Any]:
    return {
        "data": {"train_batch_size": 2, "max_prompt_length": 64, "max_response_length": 2},
        "actor_rollout_ref": {
            "model": {"path": model_dir},
            "rollout": {"n": 4, "concurrency": 8},
            "actor": {"ppo_mini_batch_size": 2, "optim": {"lr": 1e-2, "weight_decay": 0.0}},
        },
        "trainer": {
            "total_training_steps": steps,
            "save_freq": 1,
            "default_local_dir": run_dir,
            "device": "cpu",
            "logger": ["jsonl"],
            "seed": 7,
        },
    }


TASKS = [{"prompt": f"Tell me about item {i}.", "seed": i} for i in range(8)]


def main() -> None:
    model_dir, run_dir, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    result = Trainer(config(model_dir, run_dir, steps)).fit(seeded_agent, TASKS)
    print(json.dumps({"steps": result.steps, "run_dir": str(Path(run_dir))}))


if __name__ == "__main__":
    main()
