"""``agentloop train`` with an agent that forgets to ``return`` its reward: issue 42 found it printed
``trained 1 steps``, exited 0 and wrote a final model identical to the start. Now it exits 1 with one line
that says why (trainer/fit/learning_signal.py), and writes no final model. A whole fit through the command, run
in-process through ``agentloop.cli.main`` (the tiny model, the proxy, Ray)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from agentloop.cli import main

AGENT = """
import agentloop as al
import openai

@al.rollout
async def agent(task, llm):
    client = openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
    out = await client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": task["prompt"]}], max_tokens=2
    )
    reward = float(out.choices[0].message.content == "4")  # computed, never returned
"""


@pytest.mark.slow  # the CLI in a subprocess, a whole fit: ~20 s; the fit itself is in tests/trainer/fit/test_fit_signal.py
@pytest.mark.timeout(240)
def test_a_run_without_rewards_exits_1_with_one_line_saying_why(
    tiny_model_dir: Path,
    tmp_path: Path,
    ray_local: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """One step without signal is the limit here (max_steps_without_signal=1): 2 tasks x rollout.n 2 =
    4 rollouts, all 4 without a reward."""
    (tmp_path / "forgetful.py").write_text(AGENT)
    (tmp_path / "tasks.jsonl").write_text('{"prompt": "2+2?"}\n{"prompt": "3+1?"}\n')
    doc = {
        "agent": "forgetful.py:agent",
        "train_data": "tasks.jsonl",
        "data": {"train_batch_size": 2, "max_prompt_length": 64, "max_response_length": 2},
        "actor_rollout_ref": {
            "model": {"path": str(tiny_model_dir)},
            "rollout": {"n": 2},
            "actor": {"ppo_mini_batch_size": 2},
        },
        "trainer": {"total_training_steps": 1, "max_steps_without_signal": 1, "default_local_dir": "run",
                    "device": "cpu", "logger": ["jsonl"], "val_before_train": False},
    }  # fmt: skip
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
    monkeypatch.chdir(tmp_path)
    assert main(["train", "job.yaml"]) == 1
    out, err = capsys.readouterr()
    assert "trained" not in out
    assert err.splitlines()[-1] == (
        "agentloop train: error: no learning signal: a step trained nothing "
        "(trainer.max_steps_without_signal=1): none of 4 rollouts gave a usable attempt: "
        "4 ended without a reward (return it from the agent, or call al.emit_reward); "
        "the model was not updated by them and no final model was written; "
        f"look at the attempts with `agentloop inspect {tmp_path / 'run'}`"
    )
    assert (tmp_path / "run" / "store.db").exists() and not (tmp_path / "run" / "final_model").exists()
