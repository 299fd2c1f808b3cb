"""The demo's pieces: the data split, the reward, the report, and a 2-step run through the real stack."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.demos.arithmetic import build_parser, grpo_config, make_datasets, parse_answer, run_demo, score
from trainer.run_folder.report import render_report, write_report


def test_datasets_are_deterministic_and_disjoint() -> None:
    train, val = make_datasets(operand_max=20, val_size=150, seed=0)
    assert len(val) == 150 and len(train) == 21 * 21 - 150
    assert (train, val) == make_datasets(operand_max=20, val_size=150, seed=0)
    assert make_datasets(operand_max=20, val_size=150, seed=1)[1] != val
    held_out = {(t["a"], t["b"]) for t in val}
    assert held_out.isdisjoint((t["a"], t["b"]) for t in train)
    assert all(t["answer"] == t["a"] + t["b"] and f"{t['a']} + {t['b']}" in t["question"] for t in val)


@pytest.mark.parametrize(("operand_max", "val_size"), [(0, 1), (3, 0), (3, 16)])
def test_datasets_reject_bad_sizes(operand_max: int, val_size: int) -> None:
    with pytest.raises(ValueError, match="must be"):
        make_datasets(operand_max, val_size, seed=0)


@pytest.mark.parametrize(
    ("text", "expected", "reward"),
    [
        ("<answer>42</answer>", 42, 1.0),
        ("21 + 21 = 42, so <answer> 42 </answer>", 42, 1.0),
        ("<answer>41</answer>", 42, 0.1),  # well-formed but wrong: the format bonus only
        ("<answer>41</answer> no wait <answer>42</answer>", 42, 0.1),  # the first tag counts
        ("21 + 21 = 42", 42, 0.0),  # right number, no tag: strict exact match fails
        ("<answer>42", 42, 0.0),
        ("<answer>forty-two</answer>", 42, 0.0),
    ],
)
def test_score_is_strict_exact_match_in_the_tag(text: str, expected: int, reward: float) -> None:
    assert score(text, expected, format_bonus=0.1) == reward
    assert score(text, expected) == (1.0 if reward == 1.0 else 0.0)  # validation: no bonus


def test_parse_answer() -> None:
    assert parse_answer("x <answer>-3</answer>") == -3
    assert parse_answer("no tag") is None


def test_report_writes_table_and_curve(tmp_path: Path) -> None:
    history = [{"step": 1.0, "reward/mean": 0.1}, {"step": 2.0, "reward/mean": 0.5}]
    val_history = [{"val/step": 0.0, "val/success_rate": 0.02}, {"val/step": 2.0, "val/success_rate": 0.4}]
    summary = {"accuracy_before": 0.02, "accuracy_after": 0.4, "steps": 2, "wall_s": 90.0, "val_size": 50}
    path = write_report(tmp_path, summary, history, val_history)
    text = path.read_text()
    assert "| held-out accuracy before | 2.0% |" in text and "| gain | +38.0 points |" in text
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 2
    with pytest.raises(ValueError, match="summary lacks wall_s"):
        render_report({k: v for k, v in summary.items() if k != "wall_s"})


def test_parser_rejects_bad_values(tmp_path: Path) -> None:
    args = build_parser().parse_args(["--n", "1", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="--n must be >= 2"):
        run_demo(args)
    args = build_parser().parse_args(["--max-staleness", "-1", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="--max-staleness must be >= 0, got -1"):
        run_demo(args)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--weight-update-policy", "later"])


def test_async_options_reach_the_trainer_config(tmp_path: Path) -> None:
    """Synchronous by default; --max-staleness / --weight-update-policy set the rollout keys."""
    from trainer.config import TrainerConfig, engine_kwargs

    default = grpo_config(build_parser().parse_args([]), tmp_path, "m")["actor_rollout_ref"]["rollout"]
    assert (default["max_staleness"], default["weight_update_policy"]) == (0, "drain")
    args = build_parser().parse_args(["--max-staleness", "2", "--weight-update-policy", "inflight"])
    rollout = TrainerConfig.from_dict(grpo_config(args, tmp_path, "m")).actor_rollout_ref.rollout
    assert (rollout.max_staleness, rollout.weight_update_policy) == (2, "inflight")
    # fit_and_save builds the demo's engine from these keys
    kwargs = engine_kwargs(rollout)
    assert (kwargs["weight_update_policy"], kwargs["max_batch_size"]) == ("inflight", 64)


@pytest.mark.slow  # end to end, > 10 s: .ci/run runs it, make test does not
def test_two_step_run_writes_every_file(tmp_path: Path, tiny_model_dir: Path) -> None:
    sizes = ["--steps", "2", "--batch-size", "2", "--n", "2", "--max-tokens", "4", "--operand-max", "4"]
    args = build_parser().parse_args(
        ["--model", str(tiny_model_dir), "--out", str(tmp_path), "--name", "mini", *sizes, "--val-size", "4"]
    )
    summary = run_demo(args)
    run_dir = tmp_path / "mini"
    assert summary["steps"] == 2 and summary["val_size"] == 4 and summary["train_size"] == 21
    assert 0.0 <= summary["accuracy_before"] <= 1.0 and 0.0 <= summary["accuracy_after"] <= 1.0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and "val/success_rate" in rows[-1]
    for name in ("report.md", "curves.png", "summary.json", "final_model/model.safetensors"):
        assert (run_dir / name).stat().st_size > 0, name
    assert (run_dir / "final_model" / "tokenizer.json").exists()
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(run_dir / "final_model").config.num_hidden_layers == 2
    with pytest.raises(FileExistsError, match="already exists"):
        run_demo(args)
