"""The CLI end to end: `train` a tiny model from a YAML config, `inspect` its run, `bench --results`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

AGENT_MODULE = """
import openai
import agentloop as al

@al.rollout
async def agent(task, llm):
    client = openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
    resp = await client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": task["q"]}], max_tokens=3
    )
    return float(len(resp.choices[0].message.content or "") % 2)
"""


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agentloop.cli", *args], capture_output=True, text=True, cwd=cwd, timeout=600
    )


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    work = tmp_path_factory.mktemp("cli-train")
    (work / "cli_agent_mod.py").write_text(AGENT_MODULE)
    (work / "train.jsonl").write_text("\n".join(json.dumps({"q": f"question {i}"}) for i in range(8)))
    config = {
        "agent": "cli_agent_mod:agent",
        "train_data": "train.jsonl",
        "trainer": {
            "data": {"train_batch_size": 2, "max_prompt_length": 64, "max_response_length": 3},
            "actor_rollout_ref": {
                "model": {"path": str(tiny_model_dir)},
                "rollout": {"n": 2},
                "actor": {"ppo_mini_batch_size": 2},
            },
            "trainer": {"total_training_steps": 2, "device": "cpu", "default_local_dir": str(work / "run")},
        },
    }
    (work / "config.yaml").write_text(yaml.safe_dump(config))
    out = _cli("train", "config.yaml", "--set", "actor_rollout_ref.actor.optim.lr=1e-4", cwd=work)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "trained 2 steps" in out.stdout
    return work / "run"


def test_train_writes_the_run_folder(trained_run: Path) -> None:
    rows = [json.loads(line) for line in (trained_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert (
        json.loads((trained_run / "config.json").read_text())["actor_rollout_ref"]["actor"]["optim"]["lr"]
        == 1e-4
    )


def test_inspect_prints_table_and_trajectory(trained_run: Path) -> None:
    out = _cli("inspect", str(trained_run), "--no-color", cwd=trained_run)
    assert out.returncode == 0, out.stderr
    assert "8 rollouts in" in out.stdout
    assert "succeeded" in out.stdout
    assert "[prompt]<|im_start|>" in out.stdout and "[model]" in out.stdout
    # the advantage the trainer gave the call, from its group (the other attempt at the task, same step)
    assert re.search(r"-> reward [01]\.0; advantage per call: [+-]\d\.\d{3}", out.stdout), out.stdout


def test_train_rejects_bad_config(tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({"agent": "x:y", "train_data": "t.jsonl", "oops": 1}))
    out = _cli("train", "bad.yaml", cwd=tmp_path)
    assert out.returncode == 2 and "unknown top-level keys ['oops']" in out.stderr
    (tmp_path / "bad2.yaml").write_text(
        yaml.safe_dump({"agent": "no_such_module_xyz:agent", "train_data": "t.jsonl"})
    )
    out = _cli("train", "bad2.yaml", cwd=tmp_path)
    assert out.returncode == 2 and "cannot import module 'no_such_module_xyz'" in out.stderr


def test_inspect_rejects_a_folder_without_store(tmp_path: Path) -> None:
    out = _cli("inspect", str(tmp_path), cwd=tmp_path)
    assert out.returncode == 2 and "has no store.db" in out.stderr


def test_bench_results_table() -> None:
    out = _cli("bench", "--results", "--only", "engine_bench.py", cwd=Path.cwd())
    assert "engine vs HF generate (CPU)" in out.stdout
    assert out.returncode in (0, 1)  # 1 means a figure misses its target; the table is printed either way
