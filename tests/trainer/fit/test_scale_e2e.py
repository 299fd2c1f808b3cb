"""Scale-out end to end on CPU: 2 FSDP2 trainer ranks (gloo) and 2 engine replicas as Ray actors, the
store served over HTTP, and the agents run by two `agentloop runner` processes; one training step."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from agentloop.agent import rollout
from agentloop.resources import LLM
from trainer import Trainer
from trainer.distributed.data_parallel import free_port

ROOT = Path(__file__).resolve().parents[3]


@rollout
async def short_answer_agent(task: dict, llm: LLM) -> float:
    """One call; reward 1 for an answer of one token id below 4096 (a random policy: ~8%)."""
    client = openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0, timeout=60)
    resp = await client.chat.completions.create(
        model=llm.model,
        messages=[{"role": "user", "content": task["prompt"]}],
        max_tokens=2,
        extra_body={"return_token_ids": True},
    )
    ids = (resp.model_extra or {}).get("token_ids") or []
    return float(bool(ids) and ids[0] < 4096)


@pytest.mark.slow  # end to end, > 10 s: .ci/run runs it, make test does not
def test_two_ranks_two_replicas_two_runner_processes(tmp_path: Path, tiny_model_dir: Path) -> None:
    port = free_port()
    cfg = {
        "data": {"train_batch_size": 2, "max_prompt_length": 64, "max_response_length": 2},
        "actor_rollout_ref": {
            "model": {"path": str(tiny_model_dir)},
            "rollout": {"n": 2, "replicas": 2},
            "actor": {"ppo_mini_batch_size": 2, "optim": {"lr": 1e-3}},
        },
        "trainer": {
            "total_training_steps": 1,
            "default_local_dir": str(tmp_path / "run"),
            "device": "cpu",
            "logger": ["jsonl"],
            "n_gpus_per_node": 2,
        },
        "placement": {"store_server": True, "store_port": port, "local_runner": False},
    }
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    runners = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "agentloop.cli",
                "runner",
                "--store",
                f"http://127.0.0.1:{port}",
                "--agent",
                "tests.trainer.fit.test_scale_e2e:short_answer_agent",
                "--concurrency",
                "2",
                "--max-rollouts",
                "2",
                "--worker-id",
                f"remote-{i}",
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for i in range(2)
    ]
    try:
        result = Trainer(cfg).fit(short_answer_agent, [{"prompt": f"Say {i}."} for i in range(2)])
        outs = [r.communicate(timeout=60) for r in runners]
    finally:
        for r in runners:
            if r.poll() is None:
                r.kill()
                r.wait()
    assert result.steps == 1
    metrics = result.history[0]
    assert metrics["rollout/succeeded"] == 4 and metrics["batch/samples"] == 4, metrics
    assert metrics["weights_version"] == 1
    for r, (out, err) in zip(runners, outs, strict=True):
        assert r.returncode == 0, err.decode()[-2000:]
        assert "'succeeded': 2" in out.decode(), out.decode()  # each process ran two of the rollouts
