"""``agentloop train``'s ``reward.judge`` section: the RewardJudge it builds (settings, paths relative
to the job file, ``--set``), the one-line errors naming the bad key, and a whole run judged through
the command (the judge a real HTTP endpoint on a loopback port, as in tests/test_judge.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from agentloop.cli import UsageError, main
from agentloop.commands.train import load_job
from agentloop.judge import DEFAULT_RUBRIC, RewardJudge
from tests.test_judge import JudgeServer, first_wins, judge_server  # noqa: F401  (a fixture)

AGENT = """
import agentloop as al

@al.rollout
async def agent(task, llm):
    return None
"""

SILENT_AGENT = """
import agentloop as al
import openai

@al.rollout
async def agent(task, llm):
    client = openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
    await client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": task["prompt"]}], max_tokens=4
    )
"""

TASK_TEXT = """
def question(task):
    return "Q: " + task["q"]
"""


def _job(folder: Path, reward: Any, module: str, **extra: Any) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{module}.py").write_text(AGENT)
    (folder / "train.jsonl").write_text('{"q": "a"}\n{"q": "b"}\n')
    path = folder / "job.yaml"
    path.write_text(
        yaml.safe_dump({"agent": f"{module}:agent", "train_data": "train.jsonl", "reward": reward, **extra})
    )
    return path


def _err_line(capsys: pytest.CaptureFixture[str]) -> str:
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_a_judge_section_builds_the_judge_it_describes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "job"
    (folder / "helpers").mkdir(parents=True)
    (folder / "helpers" / "show.py").write_text(TASK_TEXT)
    judge = {
        "rubric": "Right answers win.\n",
        "base_url": "http://judge.example:8000/v1",
        "model": "judge-9b",
        "api_key": "env:TEST_JUDGE_KEY",
        "max_retries": 4,
        "timeout_s": 30,
        "max_tokens": 256,
        "max_chars": 1000,
        "task_text": "helpers/show.py:question",
        "cache_file": "verdicts.jsonl",
        "concurrency": 2,
        "on_failure": "skip",
        "name": "ruler",
        "extra_body": {"response_format": {"type": "json_object"}},
    }
    path = _job(folder, {"judge": judge}, "judged_agent")
    monkeypatch.setenv("TEST_JUDGE_KEY", "sk-judge")
    monkeypatch.chdir(tmp_path)  # paths in the file are the file's, not the working folder's
    job = load_job(Path("job/job.yaml"), ["reward.judge.max_retries=5"])
    built = job.reward
    assert isinstance(built, RewardJudge)
    assert built.rubric == "Right answers win.\n" and built.max_retries == 5  # --set wins over the file
    assert built.llm is not None and built.llm.base_url == "http://judge.example:8000/v1"
    assert built.llm.model == "judge-9b" and built.llm.api_key == "sk-judge"
    assert (built.timeout_s, built.max_tokens, built.max_chars, built.concurrency) == (30.0, 256, 1000, 2)
    assert built.on_failure == "skip" and built.name == "ruler"
    assert built.extra_body == {"response_format": {"type": "json_object"}}
    assert built.cache_file == path.parent.resolve() / "verdicts.jsonl"
    assert built.task_text is not None and built.task_text({"q": "2+2?"}) == "Q: 2+2?"
    assert "sk-judge" not in json.dumps(built.describe())  # the run identity never holds the key


def test_an_empty_judge_section_is_the_served_model_with_the_default_rubric(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    served = load_job(_job(tmp_path / "a", {"judge": {}}, "served_agent")).reward
    assert isinstance(served, RewardJudge) and served.llm is None and served.rubric == DEFAULT_RUBRIC
    assert served.cache_file is None and served.on_failure == "raise"  # fit keeps it in the run folder
    assert load_job(_job(tmp_path / "b", {"judge": None}, "unjudged_agent")).reward is None
    assert load_job(_job(tmp_path / "c", None, "no_reward_agent")).reward is None
    with_set = load_job(
        _job(tmp_path / "d", None, "set_judge_agent"), ["reward.judge.on_failure=skip"]
    ).reward
    assert isinstance(with_set, RewardJudge) and with_set.on_failure == "skip" and with_set.llm is None


@pytest.mark.parametrize(
    ("reward", "message"),
    [
        ({"judge": {"max_retries": -1}}, "reward.judge.max_retries: Input should be greater than or equal to 0; got -1"),
        ({"judge": {"rubrc": "x"}}, "unknown key 'reward.judge.rubrc'; did you mean 'rubric'?"),
        ({"scorer": {}}, "unknown key 'reward.scorer'; valid keys here: judge"),
        ({"judge": {"on_failure": "ignore"}}, "reward.judge.on_failure: Input should be 'raise' or 'skip'; got 'ignore'"),
        ({"judge": {"rubric": " \n"}}, "reward.judge.rubric: must say what makes one trajectory better than another, got ' \\n'"),
        ({"judge": {"base_url": "http://h/v1"}}, "reward.judge: model is required with base_url (http://h/v1)"),
        ({"judge": {"model": "m"}}, "reward.judge: model set without base_url: set base_url for an external judge"),
        ({"judge": {"base_url": "h:8000/v1", "model": "m"}}, "reward.judge: base_url must start with http:// or https://, got 'h:8000/v1'"),
        ({"judge": {"base_url": "http://h/v1", "model": "m", "api_key": "env:UNSET_JUDGE_KEY_X"}},
         "reward.judge.api_key: the value names the environment variable 'UNSET_JUDGE_KEY_X', which is not set"),
        ({"judge": "yes"}, "reward.judge: Input should be a valid dictionary or instance of JudgeConfig; got 'yes'"),
    ],
)  # fmt: skip
def test_a_bad_value_is_one_line_naming_the_key(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    reward: Any,
    message: str,
) -> None:
    monkeypatch.delenv("UNSET_JUDGE_KEY_X", raising=False)
    _job(tmp_path, reward, "bad_reward_agent")
    monkeypatch.chdir(tmp_path)
    assert main(["train", "job.yaml"]) == 2
    line = _err_line(capsys)
    assert line.startswith("agentloop train: error: job.yaml: ") and message in line, line


def test_task_text_must_name_a_function(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "texts.py").write_text("NOT_A_FUNCTION = 3\n")
    path = _job(tmp_path, {"judge": {"task_text": "texts.py:NOT_A_FUNCTION"}}, "task_text_agent")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        UsageError, match=r"reward\.judge\.task_text: .*texts\.py:NOT_A_FUNCTION must name a function"
    ):
        load_job(path)
    with pytest.raises(UsageError, match=r"reward\.judge\.task_text"):
        load_job(path, ["reward.judge.task_text=texts.py:missing"])


@pytest.mark.slow  # a whole fit through the command: Ray, the proxy, the tiny model
def test_agentloop_train_is_rewarded_by_the_configured_judge(
    judge_server: JudgeServer,  # noqa: F811
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    judge_server.answer = first_wins
    (tmp_path / "silent.py").write_text(SILENT_AGENT)
    (tmp_path / "tasks.jsonl").write_text('{"prompt": "Say 0."}\n{"prompt": "Say 1."}\n')
    llm = judge_server.llm
    doc = {
        "agent": "silent.py:agent",
        "train_data": "tasks.jsonl",
        "data": {"train_batch_size": 2, "max_prompt_length": 64, "max_response_length": 4},
        "actor_rollout_ref": {
            "model": {"path": str(tiny_model_dir)},
            "rollout": {"n": 3},
            "actor": {"ppo_mini_batch_size": 2},
        },
        "trainer": {"total_training_steps": 1, "default_local_dir": "run", "device": "cpu",
                    "logger": ["jsonl"], "val_before_train": False},
        "reward": {"judge": {"base_url": llm.base_url, "model": llm.model, "api_key": "env:TEST_JUDGE_KEY"}},
    }  # fmt: skip
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
    monkeypatch.setenv("TEST_JUDGE_KEY", "k1")
    monkeypatch.chdir(tmp_path)
    assert main(["train", "job.yaml"]) == 0, capsys.readouterr().err
    assert "trained 1 step;" in capsys.readouterr().out
    assert len(judge_server.requests) == 2 and {h["authorization"] for h in judge_server.headers} == {
        "Bearer k1"
    }
    assert all(r["model"] == "judge-1" and r["temperature"] == 0 for r in judge_server.requests)
    verdicts = [json.loads(x) for x in (tmp_path / "run" / "judge.jsonl").read_text().splitlines()]
    assert [v["scores"] for v in verdicts] == [[1.0, 0.0, 0.0]] * 2
    [row] = [
        json.loads(x)
        for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        if "judge/groups" in x
    ]
    assert row["judge/groups"] == 2 and row["reward/mean"] == pytest.approx(1 / 3)
