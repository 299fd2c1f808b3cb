"""verifiers environments (examples/verifiers_envs) run unchanged as agentloop rollouts.

verifiers 0.4.0 pins mcp==2.0.0 and openai<3, which the test venv cannot hold (its mcp is <2, its openai 3), so
``make frameworks`` installs it beside agentloop in ``.venv/frameworks/verifiers`` and each episode runs there
as a subprocess (verifiers_side.py): a real Proxy, a MemoryStore, a Runner, ``VerifiersAgent`` playing the env's
first task. The end-to-end tests take over a minute on 2 cores (verifiers starts its interception server, a
``uv`` chat program and, for the tool env, an MCP server per episode): they are ``slow``.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agentloop.errors import ConfigError
from integrations.verifiers import API_KEY_VAR, _hold_key

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
    The engine's ids are recorded exactly, the reward is the env's (1 for the product, plus its bonus for
    the call on the question's numbers), and in the merged training sample the tool's result tokens are
    masked out while both model turns are trained."""
    out = run_side("vf_calc", tiny_model_dir, "script")
    assert out["status"] == "succeeded", out["error"]
    check_calls(out)
    assert len(out["calls"]) == 2 and len(out["engine_calls"]) == 2
    assert out["last_text"] == out["answer"]
    assert out["rubric_correct"] == 1.0 and out["call_bonus"] > 0
    assert not [n for n in out["setenv_names"] if n.startswith(API_KEY_VAR)], out["setenv_names"]
    assert out["reward"] == [out["rubric_correct"] + out["call_bonus"]]
    (sample,) = out["merged"]
    first, second = out["calls"]
    tool_part = len(second["prompt_ids"]) - len(first["prompt_ids"]) - len(first["response_ids"])
    assert tool_part > 0
    expected = [1] * len(first["response_ids"]) + [0] * tool_part + [1] * len(second["response_ids"])
    assert sample["mask"] == expected


@pytest.mark.slow
@pytest.mark.e2e
@SKIP
def test_tool_env_with_smollm2() -> None:
    """vf_calc's first training question answered by SmolLM2-135M-Instruct (greedy) through a TorchEngine:
    every call recorded with the engine's ids, the reward the env's own (its answer rubric on the recorded
    text, plus the call bonus or not), and when the model called the tool, the tool's result masked out of
    the merged sample. Whether this question comes out right is the model's business, not asserted."""
    from agentloop.engine.models import resolve_model

    out = run_side("vf_calc", resolve_model("smollm2-135m-instruct"), "smollm2")
    assert out["status"] == "succeeded", out["error"]
    check_calls(out)
    assert 1 <= len(out["calls"]) <= 4  # ENV's max_turns
    (reward,) = out["reward"]
    assert reward in (
        pytest.approx(out["rubric_correct"]),
        pytest.approx(out["rubric_correct"] + out["call_bonus"]),
    )
    (sample,) = out["merged"]
    assert len(sample["response_ids"]) == len(sample["mask"])
    if len(out["calls"]) > 1:  # a tool turn came between the model's calls: its tokens are not trained
        assert 0 in sample["mask"]
    assert not [n for n in out["setenv_names"] if n.startswith(API_KEY_VAR)], out["setenv_names"]


# --- fast: what needs no verifiers ----------------------------------------------------------------------------


def test_an_attempts_key_is_seen_by_python_but_never_set_in_the_c_environment() -> None:
    """The key verifiers' client reads with os.environ.get is there for Python, while the process's C
    environment (what torch's threads read with getenv) is never written: a setenv racing the engine
    thread's getenv killed an H200 run with SIGSEGV at step 9."""
    libc = ctypes.CDLL(None)
    libc.getenv.restype = ctypes.c_char_p
    var = API_KEY_VAR + "_TEST_HOLD_KEY"
    _hold_key(var, "sk-attempt")
    try:
        assert os.environ.get(var) == "sk-attempt" and var in os.environ
        assert libc.getenv(var.encode()) is None
    finally:
        _hold_key(var, None)
    assert var not in os.environ and os.environ.get(var) is None
    _hold_key(var, None)  # removing what is not there is no error


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


BROKEN_ENV = '''
"""A verifiers environment whose reward method raises on one of its two tasks."""
from collections.abc import Iterator

import verifiers.v1 as vf


class BrokenData(vf.TaskData):
    answer: str


class BrokenTask(vf.Task[BrokenData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task: BrokenData, trace: vf.Trace) -> float:
        if task.answer == "?":
            raise ValueError("vf_broken has no answer key for this task")
        return 1.0


class BrokenTaskset(vf.Taskset[BrokenTask, vf.TasksetConfig]):
    def load(self) -> Iterator[BrokenTask]:
        yield BrokenTask(BrokenData(prompt="What is 2 + 2?", answer="4"), self.config.task)
        yield BrokenTask(BrokenData(prompt="What is 3 + 1?", answer="?"), self.config.task)


__all__ = ["BrokenTaskset"]

ENV = vf.SingleAgentEnvConfig(
    taskset={"id": "vf_broken"},
    agent=vf.AgentConfig(harness={"id": "null"}, runtime=vf.SubprocessConfig(), max_turns=1),
)
'''


@SKIP
@pytest.mark.slow  # agentloop train in the verifiers venv: Ray, the tiny model, 8 episodes (~2 min on 2 busy cores)
@pytest.mark.e2e
def test_an_env_whose_reward_raises_fails_its_attempts_not_the_run(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """``agentloop train`` on an environment whose reward method raises for one of its two tasks: the run
    trains its step and exits 0; that task's attempts fail with VerifiersEpisodeError carrying the env's own
    ValueError, in the console's failure line and in ``agentloop inspect RUN --errors`` (with the env's
    frame: vf_broken.py, in correct)."""
    import yaml

    (tmp_path / "vf_broken.py").write_text(BROKEN_ENV)
    doc = {
        "agent": "verifiers:vf_broken:ENV",
        "data": {"train_batch_size": 2, "max_prompt_length": 128, "max_response_length": 4},
        "actor_rollout_ref": {
            "model": {"path": str(tiny_model_dir)},
            "rollout": {"n": 2},
            "actor": {"ppo_mini_batch_size": 2},
        },
        "trainer": {"total_training_steps": 1, "default_local_dir": "run", "device": "cpu",
                    "logger": ["jsonl"], "val_before_train": False, "save_last": False},
    }  # fmt: skip
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
    agentloop = str(SIDE_PYTHON.with_name("agentloop"))
    train = subprocess.run(
        [agentloop, "train", "job.yaml"], capture_output=True, text=True, timeout=900, cwd=tmp_path
    )
    console = train.stdout + train.stderr
    assert train.returncode == 0, console[-6000:]
    assert "trained 1 step" in console
    # verifiers wraps the reward's error in its TaskError; the one-line message names both
    first_line = re.compile(
        r"VerifiersEpisodeError: verifiers environment 'vf_broken': TaskError: .*"
        r"ValueError: vf_broken has no answer key for this task"
    )
    assert first_line.search(console), console[-6000:]  # the runner's first failure, the step's summary
    inspect = subprocess.run(
        [agentloop, "inspect", "run", "--errors"], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert inspect.returncode == 0, inspect.stderr[-3000:]
    errors = inspect.stdout
    assert first_line.search(errors), errors[-4000:]
    assert "vf_broken.py:16 in correct" in errors, errors[-4000:]  # the env's own frame: where it broke
    assert 'raise ValueError("vf_broken has no answer key for this task")' in errors, errors[-4000:]
    assert "1 kind of error" in errors, errors[-4000:]  # only the broken task's attempts failed
