"""SFT (trainer/sft/__init__.py): chosen rollouts of a real store -> a model fine-tuned on its own tokens only.

The core claim: SFT on correct calc_x trajectories raises held-out accuracy. A random tiny model cannot
learn arithmetic in a test, so the trajectories are calc_x's (its agent, system prompt, calculator tool
and exact-match reward) on problems whose arithmetic the calculator does: ``What is seven squared?``.
The model's part is calc_x's format: a well-formed hermes tool call whose expression holds the
question's number (``7 * 7``), then ``Answer: N``. A teacher engine writes those turns (right on most
tasks, a wrong answer on every 8th) through the real proxy, ToolAgent and runner into a real SQLiteStore;
SFT trains on the rewarded ones; the trained ``final_model/`` is loaded by the real TorchEngine and
answers held-out problems (unseen question/number pairs) greedily through the same agent and proxy.
Measured: 0% -> 56% (9 of 16) after 120 steps.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from agentloop.errors import ConfigError, EmptyBatchError
from agentloop.store.sqlite import SQLiteStore
from agentloop.types import AttemptStatus, LLMCall, Reward, Span
from trainer.sft import SFTConfig, load_configs, open_store, run_sft, select_attempts

pytestmark = pytest.mark.timeout(600)

WORDS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
TEMPLATES = [
    "What is {} squared?",
    "Compute the square of {}.",
    "Square the number {}.",
    "How much is {} times itself?",
    "Find the square of {}, please.",
    "Tell me {} squared.",
    "Multiply {} by itself.",
    "What do you get when you square {}?",
]
WRONG_EVERY = 8  # the teacher answers every 8th training task wrongly (reward 0): the filter leaves it out


def problems() -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """calc_x tasks ``{"question", "answer"}`` (train, held out): every template with every number word;
    the 16 pairs with ``(word - template) % 9 in (0, 1)`` are held out, so each word and each template
    is trained on, never the held-out pairs."""
    train, held = [], []
    for t, template in enumerate(TEMPLATES):
        for w, word in enumerate(WORDS):
            task = {"question": template.format(word), "answer": str((w + 1) ** 2)}
            (held if (w - t) % 9 in (0, 1) else train).append(task)
    return train, held


SIZE = len(problems()[0])  # 56 training tasks, 7 of them answered wrongly


def _teacher_turn(prompt: str, turn: int, wrong: set[str]) -> str:
    """Turn 0: the calculator call squaring the question's number; turn 1: the tool's result as the answer."""
    from tests.integrations.scripted import tool_call_text

    question = prompt.rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
    digit = next(str(i + 1) for i, w in enumerate(WORDS) if f" {w}" in f" {question}")
    if turn == 0:
        return tool_call_text("calculator", {"expression": f"{digit} * {digit}"})
    result = prompt.rsplit("<|im_start|>tool\n", 1)[1].split("<|im_end|>", 1)[0].strip()
    return "Answer: 0" if question in wrong else f"Answer: {result}"


async def _run_agent(engine: Any, store: Any, tasks: list[dict[str, str]], mode: str) -> list[float]:
    """calc_x's agent on ``tasks`` through the real proxy and runner (greedy); each task's reward."""
    from agentloop.proxy.server import Proxy
    from agentloop.resources import Resources
    from agentloop.runner import Runner
    from examples.calc_x.agent import make_agent

    agent = make_agent(max_turns=2, sampling={"temperature": 0.0, "max_tokens": 40})
    async with Proxy(engine, store) as proxy:
        await store.add_resources(Resources(items={"llm": proxy.as_resource("calc_x")}))
        ids = [(await store.enqueue_rollout(t, mode)).rollout_id for t in tasks]  # type: ignore[arg-type]
        with anyio.fail_after(300):
            await Runner(agent, store, concurrency=8, poll_interval=0.01).run(max_rollouts=len(tasks))
    rewards = []
    for rid in ids:
        spans = await store.query_spans(rid)
        rewards.append(sum(s.payload.value for s in spans if isinstance(s.payload, Reward)))
    return rewards


def record_teacher(path: Path, tokenizer: Any, tasks: list[dict[str, str]]) -> list[float]:
    """The teacher's calc_x trajectories in a SQLiteStore at ``path``; their rewards."""
    from tests.integrations.scripted import scripted_engine

    wrong = {t["question"] for t in tasks[::WRONG_EVERY]}
    engine = scripted_engine(tokenizer, lambda prompt, turn: _teacher_turn(prompt, turn, wrong))

    async def main() -> list[float]:
        store = SQLiteStore(path)
        try:
            return await _run_agent(engine, store, tasks, "train")
        finally:
            await store.close()

    return anyio.run(main)


def accuracy(model_dir: Path, tasks: list[dict[str, str]], tmp: Path) -> float:
    """Held-out accuracy of the model in ``model_dir``: calc_x's agent, greedy, the real TorchEngine."""
    from agentloop.engine.factory import load_engine

    async def main() -> float:
        engine = load_engine(str(model_dir), device="cpu", max_context=1024)
        await engine.start()
        store = SQLiteStore(tmp / f"eval-{model_dir.name}.db")
        try:
            rewards = await _run_agent(engine, store, tasks, "val")
        finally:
            await store.close()
            await engine.stop()
        return sum(r >= 1.0 for r in rewards) / len(rewards)

    return anyio.run(main)


@pytest.fixture(scope="module")
def teacher_store(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[float]]:
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("sft-store") / "store.db"
    rewards = record_teacher(path, AutoTokenizer.from_pretrained(tiny_model_dir), problems()[0])
    return path, rewards


@pytest.fixture(scope="module")
def learner_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's architecture and tokenizer, initialised with std 0.1 instead of 0.5.

    Measured on this task (2-core CPU, lr 1e-2, batch 8): with the tiny model's std 0.5 attention is
    one-hot from the start and the model learned only the tokens' marginals (the format, then the same
    digits whatever the question: 0% held out after 80 steps); with std 0.02 attention is uniform over the
    ~300-token prompt and 120 steps reached 12%; with std 0.1, 56% after 120 steps."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.initializer_range = 0.1
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("learner")
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    shutil.copy(tiny_model_dir / "generation_config.json", out / "generation_config.json")
    return out


def sft_config(model: Path, run_dir: Path, **trainer: Any) -> dict[str, Any]:
    return {
        "actor_rollout_ref": {"model": {"path": str(model)}, "actor": {"optim": {"lr": 1e-2}}},
        "data": {"train_batch_size": 8, "max_response_length": 128},
        "trainer": {
            "total_epochs": 24,
            "device": "cpu",
            "logger": ["jsonl"],
            "default_local_dir": str(run_dir),
            "test_freq": 10,
            **trainer,
        },
        "sft": {"min_reward": 1.0, "val_fraction": 0.125},
    }


# ---------------------------------------------------------------- the core claim


@pytest.mark.slow  # ~2-3 min on 2 cores: proxy + runner + store, 120 SFT steps, the engine twice (CI runs it in make test-slow)
def test_sft_on_correct_calc_x_trajectories_raises_held_out_accuracy(
    teacher_store: tuple[Path, list[float]], learner_dir: Path, tmp_path: Path
) -> None:
    store, rewards = teacher_store
    assert rewards.count(0.0) == SIZE // WRONG_EVERY and rewards.count(1.0) == SIZE - SIZE // WRONG_EVERY
    held_out = problems()[1]
    before = accuracy(learner_dir, held_out, tmp_path)

    result = run_sft(store, sft_config(learner_dir, tmp_path / "run", save_freq=50))

    after = accuracy(result.model_dir, held_out, tmp_path)  # type: ignore[arg-type]
    print(f"held-out accuracy before {before:.2f} after {after:.2f}; {result.steps} steps")
    assert before <= 0.1, before
    assert after >= 0.5, (before, after)
    run = result.run_dir
    assert result.train_attempts + result.val_attempts == SIZE - SIZE // WRONG_EVERY
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    nll = [r["val/nll"] for r in rows if "val/nll" in r]
    assert rows[0]["step"] == 0 and nll[-1] < nll[0] / 4, nll  # the held-out trajectories' NLL fell
    assert (run / "loss_curve.png").stat().st_size > 0 and (run / "checkpoints" / "latest").is_file()
    record = json.loads((run / "run.json").read_text())
    assert record["status"] == "finished" and record["kind"] == "sft" and record["step"] == result.steps


# ---------------------------------------------------------------- the public names


def test_trainer_sft_keeps_the_names_of_its_parts() -> None:
    """trainer.sft is the import path (the CLI, the README): its parts' public names stay importable."""
    import trainer.sft as sft
    from trainer.sft import actor as sft_actor
    from trainer.sft import config as sft_config
    from trainer.sft import data as sft_data

    assert sorted(sft.__all__) == sorted(
        ["SFTActor", "SFTConfig", "SFTResult", "open_store", "run_sft", "select_attempts", "split_tasks"]
    )
    moved = {
        sft_actor: ["SFTActor"],
        sft_config: ["SFTConfig", "load_configs", "sft_trainer_config"],
        sft_data: ["Selection", "open_store", "select_attempts", "split_tasks"],
    }
    for part, names in moved.items():
        for name in names:
            assert getattr(sft, name) is getattr(part, name), (part.__name__, name)


# ---------------------------------------------------------------- data: filter and masks


async def test_the_min_reward_filter_and_its_error(teacher_store: tuple[Path, list[float]]) -> None:
    store = open_store(teacher_store[0])
    try:
        good = await select_attempts(store, SFTConfig(min_reward=1.0))
        every = await select_attempts(store, SFTConfig(min_reward=None))
        with pytest.raises(EmptyBatchError) as err:
            await select_attempts(store, SFTConfig(min_reward=1.5))
        with pytest.raises(EmptyBatchError, match="0 x 7, 1 x 49"):
            await select_attempts(store, SFTConfig(min_reward=1.5, modes=["train", "val"]))
    finally:
        await store.close()
    assert len(good.attempts) == SIZE - SIZE // WRONG_EVERY and len(every.attempts) == SIZE
    message = str(err.value)
    assert f"{SIZE} rollouts ({SIZE} train/succeeded)" in message and "lower --min-reward" in message
    assert "0 x 7, 1 x 49" in message


async def test_a_recorded_trajectory_trains_the_model_tokens_only(
    teacher_store: tuple[Path, list[float]], tiny_model_dir: Path
) -> None:
    """One sample per attempt with the exact recorded ids; the tool's output and the template between
    the two calls are in the response with mask 0."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    store = open_store(teacher_store[0])
    try:
        chosen = await select_attempts(store, SFTConfig())
        rid = chosen.attempts[0][0].metadata["rollout_id"]
        calls = [s.payload for s in await store.query_spans(str(rid)) if isinstance(s.payload, LLMCall)]
    finally:
        await store.close()
    (sample,) = chosen.attempts[0]
    assert sample.prompt_ids == calls[0].prompt_ids and len(calls) == 2
    assert sample.prompt_ids + sample.response_ids == calls[1].prompt_ids + calls[1].response_ids
    mask = sample.response_mask or []
    model = [t for t, m in zip(sample.response_ids, mask, strict=True) if m]
    masked = [t for t, m in zip(sample.response_ids, mask, strict=True) if not m]
    assert model == calls[0].response_ids + calls[1].response_ids
    assert "<|im_start|>tool" in tok.decode(masked) and "<tool_call>" not in tok.decode(masked)


# ---------------------------------------------------------------- checkpoints and resume


async def _hand_store(path: Path, n: int, reward: float = 1.0) -> None:
    """``n`` succeeded attempts with fixed token ids, written through the Store API (no model)."""
    store = SQLiteStore(path)
    try:
        for i in range(n):
            rollout = await store.enqueue_rollout({"i": i})
            got = await store.dequeue_rollout()
            assert got is not None and got.rollout_id == rollout.rollout_id
            prompt, response = [1, 100 + i % 7, 200 + i % 5, 4], [300 + i % 11, 301, 302 + i % 3, 2]
            call = LLMCall(prompt_ids=prompt, response_ids=response, sampling={"temperature": 0.7})
            for payload in (call, Reward(value=reward)):
                await store.add_span(
                    Span(rollout_id=rollout.rollout_id, attempt_id=got.attempt.attempt_id, payload=payload)
                )
            await store.update_attempt(
                rollout.rollout_id, got.attempt.attempt_id, status=AttemptStatus.SUCCEEDED
            )
    finally:
        await store.close()


def test_a_resumed_run_takes_the_same_next_steps(tiny_model_dir: Path, tmp_path: Path) -> None:
    anyio.run(_hand_store, tmp_path / "store.db", 12)
    base = sft_config(tiny_model_dir, tmp_path / "a", total_epochs=2, save_freq=1)
    base["data"]["train_batch_size"] = 4
    base["sft"]["val_fraction"] = 0.25
    first = run_sft(tmp_path / "store.db", base)
    assert first.steps == 4 and first.train_attempts == 9 and first.val_attempts == 3  # 9 // 4 = 2 a pass

    again = json.loads(json.dumps(base))
    again["trainer"].update(
        default_local_dir=str(tmp_path / "b"), resume=str(first.run_dir / "checkpoints" / "global_step_2")
    )
    second = run_sft(tmp_path / "store.db", again)
    assert second.resumed_from == 2 and [h["step"] for h in second.history] == [3, 4]
    # the resumed run replays the same fp32 operations on the same machine from the exact saved state:
    # only a threaded reduction split otherwise could move a last bit
    for a, b in zip(first.history[2:], second.history, strict=True):
        assert b["sft/loss"] == pytest.approx(a["sft/loss"], rel=1e-6) and b["epoch"] == a["epoch"]
    from safetensors.torch import load_file

    wa = load_file(first.model_dir / "model.safetensors")  # type: ignore[operator]
    wb = load_file(second.model_dir / "model.safetensors")  # type: ignore[operator]
    assert all(torch.allclose(wa[k], wb[k], rtol=1e-5, atol=1e-6) for k in wa)

    same = run_sft(tmp_path / "store.db", base)  # this config's run finished: returned as it is
    assert same.already_finished and same.run_dir == first.run_dir and same.steps == 4


def test_bad_input_says_what_to_fix(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        run_sft(tmp_path / "nothing.db", sft_config(tiny_model_dir, tmp_path / "r"))
    (tmp_path / "not-a-store.db").write_bytes(b"hello")
    with pytest.raises(ValueError, match="not an agentloop store"):
        open_store(tmp_path / "not-a-store.db")
    with pytest.raises(ConfigError, match=r"sft\.min_rewrd"):
        load_configs({"sft": {"min_rewrd": 1}})
    anyio.run(_hand_store, tmp_path / "store.db", 3)
    with pytest.raises(ConfigError, match=r"3 training attempts .* data.train_batch_size \(8\)"):
        run_sft(
            tmp_path / "store.db", {**sft_config(tiny_model_dir, tmp_path / "r"), "sft": {"val_fraction": 0}}
        )
