"""trainer/run_folder/report.py's report for any fit (issue 46: `agentloop train` wrote no report.md/curves.png, the
demo did): read from metrics.jsonl, so a resumed run's report covers every step; rows only for what ran."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from trainer.config import TrainerConfig
from trainer.run_folder.report import write_fit_report


def _metrics(run_dir: Path, rows: list[dict[str, float]]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_fit_with_validation_reports_before_and_after(tmp_path: Path) -> None:
    config = TrainerConfig.from_dict({}).model_dump(mode="json")
    _metrics(
        tmp_path,
        [
            {"step": 0, "val/reward_mean": 0.2, "val/success_rate": 0.1, "val/step": 0.0},
            {"step": 1, "reward/mean": 0.25, "timing/step_s": 2.0, "timing/elapsed_s": 2.0},
            {"step": 2, "reward/mean": None, "timing/step_s": 4.0, "timing/elapsed_s": 6.0},  # NaN, as logged
            {"step": 3, "reward/mean": 0.5, "timing/step_s": 3.0, "val/reward_mean": 0.6,
             "val/success_rate": 0.5, "val/step": 3.0},
        ],
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no matplotlib UserWarning for the user's console
        path = write_fit_report(tmp_path, config, wall_s=120.0, train_size=8, val_size=4)
    report = path.read_text()
    assert report.startswith(f"# Training run {tmp_path}\n")
    assert "Model `smollm2-135m-instruct`, GRPO through the full stack" in report
    for row in ("| held-out accuracy before | 10.0% |", "| held-out accuracy after | 50.0% |",
                "| gain | +40.0 points |", "| held-out reward (mean) after | 0.600 |",
                "| train reward (mean), first step | 0.250 |", "| train reward (mean), last step | 0.500 |",
                "| training questions | 8 |", "| training steps | 3 |", "| wall time (load + train + eval) | 2.0 min |",
                "| step_s | 3.00 |"):  # fmt: skip
        assert row in report, row
    assert "elapsed_s" not in report  # a running total, not a phase of a step
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "summary.json").read_text())["train_size"] == 8


def test_a_fit_without_validation_or_rewards_still_reports(tmp_path: Path) -> None:
    config = TrainerConfig.from_dict({}).model_dump(mode="json")
    _metrics(tmp_path, [{"step": 1, "batch/samples": 0.0}])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a legend without lines warned before
        report = write_fit_report(tmp_path, config, wall_s=6.0, train_size=2, val_size=None).read_text()
    assert "held-out" not in report and "train reward" not in report
    assert "| training steps | 1 |" in report
    assert (tmp_path / "curves.png").stat().st_size > 0
