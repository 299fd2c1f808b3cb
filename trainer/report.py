"""A training run's human-readable outputs: ``curves.png`` (reward and held-out accuracy) and ``report.md``."""

from __future__ import annotations

import json
import platform
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REQUIRED = ("accuracy_before", "accuracy_after", "steps", "wall_s", "val_size")


def plot_reward_accuracy(
    history: Sequence[Mapping[str, float]], val_history: Sequence[Mapping[str, float]], out_path: Path
) -> Path:
    """Train reward per step (left axis) and held-out accuracy at each validation (right axis) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    points = [(row["step"], row["reward/mean"]) for row in history if "reward/mean" in row]
    if points:
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, marker="o", markersize=3, color="tab:blue", label="train reward (mean)")
    ax.set_xlabel("training step")
    ax.set_ylabel("train reward", color="tab:blue")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    acc = [
        (row.get("val/step", 0.0), row["val/success_rate"])
        for row in val_history
        if "val/success_rate" in row
    ]
    if acc:
        twin = ax.twinx()
        xs, ys = zip(*acc, strict=True)
        twin.plot(xs, ys, marker="s", color="tab:orange", label="held-out accuracy")
        twin.set_ylabel("held-out exact-match accuracy", color="tab:orange")
        twin.set_ylim(-0.02, 1.02)
        twin.legend(loc="lower right")
    ax.legend(loc="upper left")
    ax.set_title(out_path.parent.name)
    fig.tight_layout()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path


def render_report(summary: Mapping[str, Any]) -> str:
    """report.md's text: the results table, the per-step timings and the settings."""
    missing = [k for k in REQUIRED if k not in summary]
    if missing:
        raise ValueError(f"summary lacks {', '.join(missing)}; it needs {', '.join(REQUIRED)}")
    before, after = float(summary["accuracy_before"]), float(summary["accuracy_after"])
    lines = [
        f"# {summary.get('title', 'agentloop demo')}",
        "",
        f"Model `{summary.get('model', '?')}`, GRPO through the full stack (runner -> proxy -> engine -> "
        f"store -> Ray trainer) on {summary.get('machine', _machine())}.",
        "",
        "| metric | value |",
        "|---|---|",
        f"| held-out accuracy before | {before:.1%} |",
        f"| held-out accuracy after | {after:.1%} |",
        f"| gain | {(after - before) * 100:+.1f} points |",
        f"| held-out questions (greedy, strict exact match) | {summary['val_size']} |",
        f"| training questions | {summary.get('train_size', '?')} |",
        f"| training steps | {summary['steps']} |",
        f"| wall time (load + train + eval) | {float(summary['wall_s']) / 60:.1f} min |",
    ]
    timing = summary.get("timing") or {}
    if timing:
        lines += ["", "Mean seconds per step:", "", "| phase | s |", "|---|---|"]
        lines += [f"| {k} | {float(v):.2f} |" for k, v in sorted(timing.items())]
    if summary.get("prompt"):
        lines += ["", f"Prompt: `{summary['prompt']}`"]
    settings = summary.get("settings")
    if settings:
        lines += ["", "Settings:", "", "```json", json.dumps(settings, indent=2, default=str), "```"]
    lines += ["", "Files: `metrics.jsonl`, `curves.png`, `final_model/` (safetensors + tokenizer).", ""]
    return "\n".join(lines)


def write_report(
    run_dir: Path,
    summary: Mapping[str, Any],
    history: Sequence[Mapping[str, float]],
    val_history: Sequence[Mapping[str, float]],
) -> Path:
    """Write ``curves.png``, ``summary.json`` and ``report.md`` into ``run_dir``; returns report.md's path."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    plot_reward_accuracy(history, val_history, run_dir / "curves.png")
    (run_dir / "summary.json").write_text(json.dumps(dict(summary), indent=2, default=str))
    path = run_dir / "report.md"
    path.write_text(render_report(summary))
    return path


def _machine() -> str:
    import os

    return f"{platform.machine()} CPU, {os.cpu_count()} cores"


__all__ = ["plot_reward_accuracy", "render_report", "write_report"]
