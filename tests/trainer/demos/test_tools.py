"""The tools demo's pieces: the calculator, the data split, the reward, the prompt's tool-call format,
the ``--task`` switch, and a 1-step run through the real stack with the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.demos.tools import (
    KINDS,
    build_parser,
    evaluate,
    format_number,
    make_datasets,
    make_problems,
    parse_answer,
    run_tools_demo,
    score,
    task_messages,
    well_formed_calls,
)


def test_calculator_evaluates_arithmetic_only() -> None:
    assert evaluate("12 * 7 - 5") == 79
    assert evaluate("(12 + 30) * -4") == -168
    assert evaluate("60 / 5 + 3") == 15.0
    for bad in ("2 ** 10", "__import__('os')", "x + 1", "7 // 2", "1 / 0", "9" * 14 + " * 1", "1 +" * 100):
        with pytest.raises(ValueError):
            evaluate(bad)


async def test_calculator_tool_formats_results() -> None:
    from agentloop.tools import ToolRegistry, execute_tool_call
    from trainer.demos.tools import calculator

    registry = ToolRegistry([calculator])
    assert (
        await execute_tool_call(registry, "calculator", '{"expression": "60 / 5 + 3"}')
    ).response.text == "15"
    assert (await execute_tool_call(registry, "calculator", '{"expression": "7 / 2"}')).response.text == "3.5"
    failed = await execute_tool_call(registry, "calculator", '{"expression": "2 ** 99"}')
    assert failed.is_error and (failed.response.text or "").startswith("Error")


def test_problems_are_distinct_graded_and_right() -> None:
    problems = make_problems(50, seed=3)
    assert len({p["question"] for p in problems}) == 50
    assert [p["kind"] for p in problems[: len(KINDS)]] == [k for k, _, _ in KINDS]
    assert {p["level"] for p in problems} == {1, 2, 3}
    product = next(p for p in problems if p["kind"] == "product")
    a, b = (int(x) for x in product["question"].removeprefix("What is ").removesuffix("?").split(" * "))
    assert product["answer"] == a * b
    assert problems == make_problems(50, seed=3)


def test_datasets_are_deterministic_and_disjoint() -> None:
    train, val = make_datasets(train_size=200, val_size=50, seed=0)
    assert (len(train), len(val)) == (200, 50)
    assert (train, val) == make_datasets(200, 50, seed=0)
    assert make_datasets(200, 50, seed=1)[1] != val
    assert {t["question"] for t in val}.isdisjoint(t["question"] for t in train)
    assert {t["kind"] for t in val} == {t["kind"] for t in train} == {k for k, _, _ in KINDS}
    with pytest.raises(ValueError, match="must be >= 1"):
        make_datasets(0, 5, seed=0)


@pytest.mark.parametrize(
    ("text", "made_call", "train_reward"),
    [
        ("Answer: 1081", True, 1.0),
        ("Answer: 1081", False, 1.0),  # right without the tool: still right
        ("The result is 1081.\nAnswer: 1081", True, 1.0),
        ("Answer: 1080", True, 0.1),  # well-formed call, wrong answer: the train-only bonus
        ("Answer: 1080", False, 0.0),
        ("Answer: 1080 no wait Answer: 1081", True, 0.1),  # the first answer counts
        ("1081", True, 0.1),  # the number without "Answer:" is not an answer
        ("Answer: 1081.5", True, 0.1),
        ("Answer: 1081.", True, 1.0),  # a full stop is not a decimal
        (None, True, 0.1),  # the loop ended without a final answer (max turns)
    ],
)
def test_score_is_strict_exact_match(text: str | None, made_call: bool, train_reward: float) -> None:
    assert score(text, 1081, made_call, call_bonus=0.1) == train_reward
    assert score(text, 1081, made_call) == (1.0 if train_reward == 1.0 else 0.0)  # validation: no bonus


def test_parse_answer() -> None:
    assert parse_answer("Answer: -3") == -3
    assert parse_answer("Answer:42") == 42
    assert parse_answer("answer 42") is None
    assert parse_answer(None) is None


def test_well_formed_calls_counts_calls_the_tool_ran() -> None:
    messages = [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "a"}]},
        {"role": "tool", "name": "calculator", "content": "42"},
        {"role": "tool", "name": "calculator", "content": "Error: cannot parse 'x'"},
        {"role": "tool", "name": "other", "content": "1"},
    ]
    assert well_formed_calls(messages) == 1
    assert well_formed_calls([{"role": "assistant", "content": "<tool_call>{bad</tool_call>"}]) == 0
    # the worked examples' calls come before the question: they are not the model's
    prompt = task_messages({"question": "What is 12 * 34?"})
    assert well_formed_calls(prompt) == 0
    assert well_formed_calls([*prompt, *messages]) == 1


def test_example_tool_call_renders_in_the_format_the_parser_reads(tiny_model_dir: Path) -> None:
    """The worked example shows the model the exact text the proxy parses back into a tool call."""
    from transformers import AutoTokenizer

    from agentloop.proxy.chat import ChatTemplate, canonical_message
    from agentloop.proxy.schemas import ChatMessage
    from agentloop.proxy.tool_parser import parse_tool_calls
    from agentloop.tools import ToolRegistry
    from trainer.demos.tools import calculator

    messages = task_messages({"question": "What is 12 * 34?"})
    assert messages[0]["role"] == "system" and messages[-1] == {"role": "user", "content": "What is 12 * 34?"}
    assert [m["role"] for m in messages[1:-1]].count("tool") >= 1
    template = ChatTemplate(AutoTokenizer.from_pretrained(tiny_model_dir))
    canon = [canonical_message(ChatMessage(**m), i) for i, m in enumerate(messages)]
    text = template.render(canon, ToolRegistry([calculator]).schemas(), add_generation_prompt=True)
    start = text.index("<|im_start|>assistant\n<tool_call>") + len("<|im_start|>assistant\n")
    call_text = text[start : text.index("</tool_call>", start) + len("</tool_call>")]
    assert call_text.startswith("<tool_call>\n{") and f"{call_text}<|im_end|>" in text
    parsed = parse_tool_calls(call_text)
    assert parsed.error is None and parsed.tool_calls[0]["function"]["name"] == "calculator"
    expression = json.loads(parsed.tool_calls[0]["function"]["arguments"])["expression"]
    assert f"<|im_start|>tool\n{format_number(evaluate(expression))}<|im_end|>" in text
    assert text.endswith("<|im_start|>user\nWhat is 12 * 34?<|im_end|>\n<|im_start|>assistant\n")


def test_task_switch_keeps_the_arithmetic_demo_as_it_is() -> None:
    from trainer.demos.arithmetic import build_parser as demo_parser

    arithmetic = demo_parser().parse_args([])
    assert (arithmetic.task, arithmetic.steps, arithmetic.max_tokens, arithmetic.operand_max) == (
        "arithmetic",
        24,
        24,
        20,
    )
    tools = demo_parser().parse_args(["--task", "tools", "--steps", "3"])
    assert tools.task == "tools" and tools.steps == 3 and tools.max_turns >= 2 and tools.trajectory
    assert vars(tools) == vars(build_parser().parse_args(["--steps", "3"]))
    with pytest.raises(SystemExit):
        demo_parser().parse_args(["--task", "tools", "--operand-max", "5"])  # an arithmetic-only option


def test_bad_values_are_refused(tmp_path: Path) -> None:
    for argv, match in (
        (["--n", "1"], "--n must be >= 2"),
        (["--max-turns", "1"], "--max-turns must be >= 2"),
        (["--call-bonus", "1.0"], "--call-bonus must be in"),
        (["--train-size", "2", "--batch-size", "4"], "--train-size"),
        (["--max-staleness", "-2"], "--max-staleness must be >= 0"),
    ):
        with pytest.raises(ValueError, match=match):
            run_tools_demo(build_parser().parse_args([*argv, "--out", str(tmp_path)]))


@pytest.mark.slow  # end to end, > 10 s: .ci/run runs it, make test does not
@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_one_step_run_writes_every_file(tmp_path: Path, tiny_model_dir: Path, estimator: str) -> None:
    sizes = [
        "--steps",
        "1",
        "--batch-size",
        "2",
        "--n",
        "2",
        "--max-tokens",
        "6",
        "--max-turns",
        "2",
        "--val-size",
        "3",
    ]
    args = build_parser().parse_args(
        [
            "--model",
            str(tiny_model_dir),
            "--out",
            str(tmp_path),
            "--name",
            "mini",
            *sizes,
            "--train-size",
            "4",
            "--estimator",
            estimator,
            "--critic-warmup",
            "0",
        ]
    )
    summary = run_tools_demo(args)
    run_dir = tmp_path / "mini"
    assert summary["steps"] == 1 and summary["val_size"] == 3 and summary["train_size"] == 4
    for key in ("accuracy", "tool_call_rate", "mean_turns"):
        for when in ("before", "after"):
            assert isinstance(summary[f"{key}_{when}"], float), key
    assert 0.0 <= summary["accuracy_after"] <= 1.0 and 1.0 <= summary["mean_turns_before"] <= 2.0
    assert summary["wall_minutes"] == pytest.approx(summary["wall_s"] / 60)
    assert summary["val_failed_before"] == summary["val_failed_after"] == 0
    assert sorted(summary["validations"]) == ["0", "1"]
    assert all(v["n"] == 3 for v in summary["validations"].values())
    for name in ("report.md", "curves.png", "summary.json", "metrics.jsonl", "final_model/model.safetensors"):
        assert (run_dir / name).stat().st_size > 0, name
    report = (run_dir / "report.md").read_text()
    assert "| attempts with a well-formed calculator call |" in report and "level 3" in report
    assert (
        json.loads((run_dir / "summary.json").read_text())["tool_call_rate_after"]
        == summary["tool_call_rate_after"]
    )
    config = json.loads((run_dir / "config.json").read_text())
    assert config["adapter"]["trajectory"] is True
    assert config["algorithm"]["adv_estimator"] == estimator
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in steps if "actor/pg_loss" in m or "critic/vf_loss" in m]
    assert trained and all(("critic/vf_loss" in m) == (estimator == "gae") for m in trained)
