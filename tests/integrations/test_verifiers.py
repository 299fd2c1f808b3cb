"""verifiers environments (examples/verifiers_envs) run unchanged as agentloop rollouts.

verifiers 0.4.0 pins mcp==2.0.0 and openai<3, which the test venv cannot hold (its mcp is <2, its openai 3), so
``make frameworks`` installs it beside agentloop in ``.venv/frameworks/verifiers`` and each episode runs there
as a subprocess (verifiers_side.py): a real Proxy, a MemoryStore, a Runner, ``VerifiersAgent`` playing the env's
first task. The end-to-end tests take over a minute on 2 cores (verifiers starts its interception server, a
``uv`` chat program and, for the tool env, an MCP server per episode): they are ``slow``.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agentloop.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
SIDE_PYTHON = ROOT / ".venv" / "frameworks" / "verifiers" / "bin" / "python"
SKIP = pytest.mark.skipif(
    not SIDE_PYTHON.exists(),
    reason="verifiers has no virtualenv: make frameworks makes .venv/frameworks/verifiers (verifiers 0.4.0 pins "
    "mcp==2.0.0 and openai<3, which conflict with the test venv's)",
)


def run_side(env: str, model: Path, engine: str) -> dict[str, Any]:
    cfg = json.dumps({"env": env, "model": str(model), "engine": engine})
    proc = subprocess.run(
        [str(SIDE_PYTHON), str(Path(__file__).with_name("verifiers_side.py")), cfg],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])  # structlog's lines come before it


def check_calls(out: dict[str, Any]) -> None:
    """Each LLM call holds the engine's ids; each later prompt extends the last prompt + response exactly."""
    calls = out["calls"]
    assert calls and all(c["error"] is None and c["ledger_break"] is None for c in calls)
    assert all(c["logprobs"] == len(c["response_ids"]) > 0 for c in calls)
    for seen, call in zip(out["engine_calls"], calls, strict=False):
        assert (call["prompt_ids"], call["response_ids"]) == (seen["prompt_ids"], seen["response_ids"])
    for one, two in itertools.pairwise(calls):
        head = one["prompt_ids"] + one["response_ids"]
        assert two["prompt_ids"][: len(head)] == head


@pytest.mark.slow
@pytest.mark.e2e
@SKIP
def test_single_turn_env_with_the_tiny_model(tiny_model_dir: Path) -> None:
    """vf_arith through a TorchEngine: one call; the reward is what the env's reward method gives the
    completion the proxy recorded (the tiny random model's text: 0, but computed, not assumed)."""
    out = run_side("vf_arith", tiny_model_dir, "torch")
    assert out["status"] == "succeeded", out["error"]
    check_calls(out)
    assert len(out["calls"]) == 1
    assert out["reward"] == [out["rubric_correct"]]
    (sample,) = out["merged"]
    assert sample["response_ids"] == out["calls"][0]["response_ids"] and set(sample["mask"]) == {1}


@pytest.mark.slow
@pytest.mark.e2e
@SKIP
def test_tool_env_masks_the_tool_result(tiny_model_dir: Path) -> None:
    """vf_calc with a scripted engine (the tiny model's tokenizer): call the MCP multiply tool, then answer.
    The engine's ids are recorded exactly, the reward is the env's (1: the product), and in the merged
    training sample the tool's result tokens are masked out while both model turns are trained."""
    out = run_side("vf_calc", tiny_model_dir, "script")
    assert out["status"] == "succeeded", out["error"]
    check_calls(out)
    assert len(out["calls"]) == 2 and len(out["engine_calls"]) == 2
    assert out["last_text"] == out["answer"]
    assert out["reward"] == [out["rubric_correct"]] == [1.0]
    (sample,) = out["merged"]
    first, second = out["calls"]
    tool_part = len(second["prompt_ids"]) - len(first["prompt_ids"]) - len(first["response_ids"])
    assert tool_part > 0
    expected = [1] * len(first["response_ids"]) + [0] * tool_part + [1] * len(second["response_ids"])
    assert sample["mask"] == expected


# --- fast: what needs no verifiers ----------------------------------------------------------------------------


def test_without_verifiers_the_error_says_how_to_install() -> None:
    if SIDE_PYTHON.exists() and sys.executable == str(SIDE_PYTHON):
        pytest.skip("verifiers is installed in this venv")
    pytest.importorskip("agentloop")
    from integrations import verifiers as vfi

    try:
        import verifiers.v1  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"verifiers==0\.4\.0.*make frameworks"):
            vfi.load_env("vf_arith")
    else:
        with pytest.raises(ConfigError, match="empty"):
            vfi.load_env("verifiers:")


def test_train_job_names_what_a_verifiers_agent_takes(tmp_path: Path) -> None:
    """`agent: verifiers:` with a train_data that is not verifiers' own nor a file is refused by name."""
    from agentloop.cli import UsageError
    from agentloop.commands.train import load_job

    job = tmp_path / "job.yaml"
    job.write_text("agent: 'verifiers:'\ntrain_data: tasks.jsonl\n")
    with pytest.raises(UsageError, match="verifiers"):
        load_job(job)


@SKIP
@pytest.mark.slow  # in test-slow, after make frameworks has made the venv (make test runs before it)
@pytest.mark.e2e
@pytest.mark.parametrize("job", ["arith_job.yaml", "calc_job.yaml"])
def test_the_example_job_files_load_in_the_verifiers_venv(job: str, tmp_path: Path) -> None:
    """``agentloop train``'s loader reads each example job in verifiers' virtualenv, from another folder:
    the agent is a VerifiersAgent and the tasks are the environment's own (no train_data)."""
    code = (
        "import json, sys; from pathlib import Path; from agentloop.commands.train import load_job; "
        "from integrations.verifiers import VerifiersAgent; j = load_job(Path(sys.argv[1])); "
        "print(json.dumps({'agent': isinstance(j.agent, VerifiersAgent), 'tasks': len(j.train), "
        "'steps': j.config.trainer.total_training_steps}))"
    )
    path = ROOT / "examples" / "verifiers_envs" / job
    proc = subprocess.run(
        [str(SIDE_PYTHON), "-c", code, str(path)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["agent"] and out["tasks"] > 0 and out["steps"] > 0
