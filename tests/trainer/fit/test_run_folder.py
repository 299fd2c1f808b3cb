"""Issue 15 through the whole loop on CPU (tiny model, real proxy, runner, SQLite store, Ray worker):
re-runs that never hang, one run per folder, the trained model as a Hugging Face folder, greedy
validation before and after training, errors that list what the attempts raised, deadlines."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import openai
import pytest

import agentloop as al
from agentloop.errors import EmptyBatchError, ModelResolutionError, TrainerTimeoutError
from agentloop.store.sqlite import SQLiteStore
from agentloop.types import LLMCall
from trainer import Trainer

TASKS = [{"prompt": f"Name a colour, number {i}.", "seed": i} for i in range(8)]


@al.rollout
async def short_agent(task: dict, llm: al.LLM) -> float:
    """One call with the LLM's own sampling (no temperature in the request): reward 1 for low token ids."""
    client = openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
    resp = await client.chat.completions.create(
        model=llm.model,
        messages=[{"role": "user", "content": task["prompt"]}],
        extra_body={"return_token_ids": True},
    )
    ids = (resp.model_extra or {})["token_ids"]
    return sum(1 for t in ids if t < 4915) / len(ids)


@al.rollout
async def graded_agent(task: dict, llm: al.LLM) -> float:
    """A reward that differs between almost any two samples: every GRPO group has a signal."""
    client = openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
    resp = await client.chat.completions.create(
        model=llm.model,
        messages=[{"role": "user", "content": task["prompt"]}],
        temperature=1.0,
        extra_body={"return_token_ids": True},
    )
    ids = (resp.model_extra or {})["token_ids"]
    return (ids[0] % 997) / 997


@al.rollout
async def failing_agent(task: dict, llm: al.LLM) -> float:
    if task["seed"] % 2:
        raise ValueError("the tool server refused the connection")
    return "not a reward"  # type: ignore[return-value]


def config(model_dir: Path, run_dir: Path, steps: int = 2, **trainer: Any) -> dict[str, Any]:
    return {
        "data": {"train_batch_size": 2, "max_prompt_length": 64, "max_response_length": 2},
        "actor_rollout_ref": {
            "model": {"path": str(model_dir)},
            "rollout": {"n": 2, "concurrency": 8},
            "actor": {"ppo_mini_batch_size": 2, "optim": {"lr": 1e-2, "weight_decay": 0.0}},
        },
        "trainer": {
            "total_training_steps": steps,
            "default_local_dir": str(run_dir),
            "device": "cpu",
            "logger": ["jsonl"],
            **trainer,
        },
    }


def _steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # 10-20 s on 2 cores: in make test-slow (CI), to keep make test under 15 min
@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_rerun_of_a_finished_run_returns_at_once_and_never_hangs(
    tmp_path: Path, tiny_model_dir: Path, ray_local: None
) -> None:
    """issue 15 item 1: save_freq 2, total_training_steps 2; the second run of the same job hung after
    'resumed ... step=2' (the runner was stopped before its task started)."""
    cfg = config(tiny_model_dir, tmp_path / "run", steps=2, save_freq=2)
    first = Trainer(cfg).fit(short_agent, TASKS)
    assert first.steps == 2 and not first.already_finished
    start = time.monotonic()
    again = Trainer(cfg).fit(short_agent, TASKS)
    assert time.monotonic() - start < 5  # nothing loads: the run's record answers
    assert again.already_finished and again.steps == 2 and again.run_dir == first.run_dir
    assert again.model_dir == first.model_dir and [h["step"] for h in again.history] == [1, 2]
    assert again.metrics["reward/mean"] == first.metrics["reward/mean"]
    # a folder from before run.json existed: the resume at the last step trains nothing and returns
    (first.run_dir / "run.json").unlink()
    resumed = Trainer(cfg).fit(short_agent, TASKS)
    assert resumed.resumed_from == 2 and resumed.steps == 2 and resumed.history == []
    assert _steps(first.run_dir) == [1, 2]
    assert (resumed.model_dir / "model.safetensors").exists()


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_fit_writes_a_loadable_model_and_safetensors_checkpoints(
    tmp_path: Path, tiny_model_dir: Path, ray_local: None
) -> None:
    """issue 15 item 2: fit leaves final_model/ (safetensors, tokenizer, chat template) that transformers
    and the engine load; checkpoints keep the weights in safetensors beside the optimizer state."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    result = Trainer(config(tiny_model_dir, tmp_path / "run", steps=1, save_freq=1)).fit(graded_agent, TASKS)
    assert result.model_dir == result.run_dir / "final_model" and result.adapter_dir is None
    for name in ("model.safetensors", "config.json", "tokenizer.json", "chat_template.jinja"):
        assert (result.model_dir / name).exists(), name
    trained = AutoModelForCausalLM.from_pretrained(result.model_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(trained.state_dict()[name], base.state_dict()[name])  # the trained weights
    assert AutoTokenizer.from_pretrained(result.model_dir).chat_template
    step = result.run_dir / "checkpoints" / "global_step_1"
    assert sorted(p.name for p in step.iterdir()) == [
        "model.safetensors",
        "optimizer.pt",
        "trainer_state.json",
    ]
    saved = load_file(step / "model.safetensors")
    assert torch.equal(saved[name], trained.state_dict()[name])  # the checkpoint holds the final weights
    engine = al.load_engine(str(result.model_dir), device="cpu")  # what `agentloop serve --model` does
    assert engine.tokenizer.chat_template
    assert set(result.metrics) >= {"reward/mean", "step"} and result.metrics["step"] == 1


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_lora_run_writes_the_merged_model_and_the_peft_adapter(
    tmp_path: Path, tiny_model_dir: Path, ray_local: None
) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = config(tiny_model_dir, tmp_path / "run", steps=1)
    cfg["actor_rollout_ref"]["model"]["lora_rank"] = 4
    result = Trainer(cfg).fit(graded_agent, TASKS)
    assert result.adapter_dir is not None and (result.adapter_dir / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(result.model_dir).eval()
    adapted = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), result.adapter_dir
    )
    ids = torch.tensor([[1, 5, 9, 13, 200]])
    with torch.no_grad():
        a, b = merged(ids).logits, adapted.eval()(ids).logits
    assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max()


@pytest.mark.slow  # end to end, > 10 s: .ci/run runs it, make test does not
@pytest.mark.timeout(300)
def test_one_run_one_folder(tmp_path: Path, tiny_model_dir: Path, ray_local: None) -> None:
    """issue 15 item 3: a stopped 20-step run and a new 3-step run shared one metrics.jsonl."""
    run_dir = tmp_path / "run"
    first = Trainer(config(tiny_model_dir, run_dir, steps=1)).fit(short_agent, TASKS)
    assert first.run_dir == run_dir
    other = Trainer(config(tiny_model_dir, run_dir, steps=2)).fit(short_agent, TASKS)  # another run
    assert other.run_dir == tmp_path / "run-2" and _steps(other.run_dir) == [1, 2]
    assert _steps(run_dir) == [1]  # untouched
    # a resume continues the checkpoint's run: lines past the checkpoint's step are dropped
    cfg = config(tiny_model_dir, tmp_path / "resumed", steps=3, save_freq=2)
    Trainer(cfg).fit(short_agent, TASKS)
    resumed_dir = tmp_path / "resumed"
    (resumed_dir / "checkpoints" / "latest").write_text("2")  # as if stopped after step 3's metrics line
    record = json.loads((resumed_dir / "run.json").read_text())
    (resumed_dir / "run.json").write_text(json.dumps({**record, "status": "running"}))
    again = Trainer(cfg).fit(short_agent, TASKS)
    assert again.run_dir == resumed_dir and again.resumed_from == 2
    assert _steps(resumed_dir) == [1, 2, 3]


def test_a_failed_start_leaves_no_folder(tmp_path: Path) -> None:
    cfg = config(tmp_path / "no-such-model", tmp_path / "run")
    with pytest.raises(ModelResolutionError):
        Trainer(cfg).fit(short_agent, TASKS)
    assert not (tmp_path / "run").exists()


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_empty_batch_error_lists_the_attempts_errors_with_counts(
    tmp_path: Path, tiny_model_dir: Path, ray_local: None
) -> None:
    """issue 15 item 6: the cause sat in 64 warning lines above 'does the agent call the LLM ...?'.
    (Issue 42: a step without a usable attempt is counted toward trainer.max_steps_without_signal; 1 here.)"""
    with pytest.raises(EmptyBatchError) as info:
        Trainer(config(tiny_model_dir, tmp_path / "run", max_steps_without_signal=1)).fit(
            failing_agent, TASKS
        )
    message = str(info.value)
    assert "none of 4 rollouts gave a usable attempt: 4 failed (the agent raised or timed out" in message
    # 2 tasks x n=2, 2 attempts each (the trainer's retry): one task of each kind in the batch
    assert "4 x ValueError: the tool server refused the connection" in message, message
    assert "4 x AgentError: agent <agent failing_agent> returned a builtins.str" in message, message


@pytest.mark.slow  # 10-20 s on 2 cores: in make test-slow (CI), to keep make test under 15 min
@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_validation_is_greedy_and_runs_before_and_after_training(
    tmp_path: Path, tiny_model_dir: Path, ray_local: None
) -> None:
    """issue 15 item 8: validation sampled at temperature 1 and ran only before training."""
    val = [{"prompt": f"Name a fruit, number {i}.", "seed": 100 + i} for i in range(3)]
    result = Trainer(config(tiny_model_dir, tmp_path / "run", steps=2)).fit(short_agent, TASKS, val)
    assert [v["val/step"] for v in result.val_history] == [0.0, 2.0]
    assert "val/reward_mean" in result.metrics and "val/reward_mean" in result.history[-1]

    async def temperatures(mode: str) -> set[float]:
        store = SQLiteStore(result.run_dir / "store.db")
        try:
            found = set()
            for rollout in await store.list_rollouts():
                if rollout.mode == mode:
                    for span in await store.query_spans(rollout.rollout_id, "latest"):
                        if isinstance(span.payload, LLMCall):
                            found.add(float(span.payload.sampling["temperature"]))
            return found
        finally:
            await store.close()

    import anyio

    assert anyio.run(temperatures, "val") == {0.0}
    assert anyio.run(temperatures, "train") == {1.0}


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_waiting_for_rollouts_has_a_deadline(tmp_path: Path, tiny_model_dir: Path, ray_local: None) -> None:
    cfg = config(tiny_model_dir, tmp_path / "run", timeouts={"rollouts_s": 2})
    cfg["placement"] = {"local_runner": False}  # and no remote runner: nothing takes the rollouts
    with pytest.raises(TrainerTimeoutError, match=r"rollouts of step 1: 0 of 4 finished.*rollouts_s"):
        Trainer(cfg).fit(short_agent, TASKS)


@pytest.mark.slow  # end to end, > 10 s: .ci/run runs it, make test does not
@pytest.mark.timeout(300)
def test_sigterm_stops_with_one_line_and_no_ray_notice(tmp_path: Path, tiny_model_dir: Path) -> None:
    """issue 15 item 9: stack dumps on SIGTERM and Ray's token-auth notice on a user's console."""
    import os
    import signal
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.trainer.resume_job", str(tiny_model_dir), str(run_dir), "200"],
        cwd=Path(__file__).resolve().parents[3],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    latest = run_dir / "checkpoints" / "latest"
    deadline = time.monotonic() + 240
    try:
        while not latest.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no checkpoint within 240 s"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # Ray's helpers of the job
        except ProcessLookupError:
            pass
    assert proc.returncode == 143, err[-2000:]
    assert "Traceback" not in err and "Traceback" not in out, err[-3000:]
    assert "Token authentication" not in err + out
    stopped = [line for line in err.splitlines() if line.startswith("training stopped by SIGTERM")]
    assert len(stopped) == 1 and "run again to resume" in stopped[0], err[-2000:]
