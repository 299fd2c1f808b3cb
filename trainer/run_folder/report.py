"""A training run's human-readable outputs: ``curves.png`` (reward and held-out accuracy) and ``report.md``.

Every ``Trainer.fit`` writes them when it finishes (:func:`write_fit_report`, from the run's
metrics.jsonl, so a resumed run's report covers all its steps); the demos then write their own richer
summary over them (:func:`write_report`)."""

from __future__ import annotations

import json
import platform
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REQUIRED = ("steps", "wall_s")


def plot_reward_accuracy(
    history: Sequence[Mapping[str, float]], val_history: Sequence[Mapping[str, float]], out_path: Path
) -> Path:
    """Train reward per step (left axis) and held-out accuracy at each validation (right axis) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    points = [(row["step"], row["reward/mean"]) for row in history if row.get("reward/mean") is not None]
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
        if row.get("val/success_rate") is not None
    ]
    if acc:
        twin = ax.twinx()
        xs, ys = zip(*acc, strict=True)
        twin.plot(xs, ys, marker="s", color="tab:orange", label="held-out accuracy")
        twin.set_ylabel("held-out exact-match accuracy", color="tab:orange")
        twin.set_ylim(-0.02, 1.02)
        twin.legend(loc="lower right")
    if points:  # a legend without lines is a matplotlib UserWarning on the user's console
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
    lines = [
        f"# {summary.get('title', 'agentloop demo')}",
        "",
        f"Model `{summary.get('model', '?')}`, {summary.get('algorithm', 'GRPO')} through the full stack "
        f"(runner -> proxy -> engine -> store -> Ray trainer) on {summary.get('machine', _machine())}.",
        "",
        "| metric | value |",
        "|---|---|",
    ]
    before, after = summary.get("accuracy_before"), summary.get("accuracy_after")
    if before is not None:
        lines.append(f"| held-out accuracy before | {float(before):.1%} |")
    if after is not None:
        lines.append(f"| held-out accuracy after | {float(after):.1%} |")
    if before is not None and after is not None:
        lines.append(f"| gain | {(float(after) - float(before)) * 100:+.1f} points |")
    for key, label in (("val_reward_before", "before"), ("val_reward_after", "after")):
        if summary.get(key) is not None:
            lines.append(f"| held-out reward (mean) {label} | {float(summary[key]):.3f} |")
    for key, label in (("reward_first", "first step"), ("reward_last", "last step")):
        if summary.get(key) is not None:
            lines.append(f"| train reward (mean), {label} | {float(summary[key]):.3f} |")
    if "val_size" in summary:
        what = summary.get("val_what", "greedy, strict exact match")
        lines.append(f"| held-out questions ({what}) | {summary['val_size']} |")
    lines += [
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


def mean_timings(history: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The mean of each ``timing/*`` metric over the steps, keyed without the prefix."""
    # elapsed_s is the time since the loop began, not a phase of the step
    keys = sorted({k for row in history for k in row if k.startswith("timing/") and k != "timing/elapsed_s"})
    out = {}
    for key in keys:
        values = [row[key] for row in history if row.get(key) is not None]
        if values:
            out[key.removeprefix("timing/")] = sum(values) / len(values)
    return out


def fit_summary(
    run_dir: Path, config: Mapping[str, Any], *, wall_s: float, train_size: int, val_size: int | None
) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    """The summary, step rows and validation rows of a finished fit, read from its metrics.jsonl."""
    from trainer.run_folder.metrics import read_metrics

    rows = read_metrics(Path(run_dir) / "metrics.jsonl")
    history = [r for r in rows if r.get("step", 0) >= 1]
    val_history = [r for r in rows if r.get("val/reward_mean") is not None]
    model = config.get("actor_rollout_ref", {}).get("model", {}).get("path", "?")
    data = config.get("data", {})
    rollout = config.get("actor_rollout_ref", {}).get("rollout", {})
    summary: dict[str, Any] = {
        "title": f"Training run {run_dir}",
        "run_dir": str(run_dir),
        "model": model,
        "algorithm": str(config.get("algorithm", {}).get("adv_estimator", "grpo")).upper(),
        "steps": int(history[-1]["step"]) if history else 0,
        "wall_s": wall_s,
        "train_size": train_size,
        "timing": mean_timings(history),
        "settings": {
            "train_batch_size": data.get("train_batch_size"),
            "rollout.n": rollout.get("n"),
            "max_response_length": data.get("max_response_length"),
            "lr": config.get("actor_rollout_ref", {}).get("actor", {}).get("optim", {}).get("lr"),
        },
    }
    rewards = [r["reward/mean"] for r in history if r.get("reward/mean") is not None]
    if rewards:
        summary["reward_first"], summary["reward_last"] = rewards[0], rewards[-1]
    if val_size and val_history:
        summary["val_size"] = val_size
        summary["val_what"] = "rollout.val_kwargs sampling; accuracy: reward >= 1"
        first, last = val_history[0], val_history[-1]
        if len(val_history) > 1:
            summary["accuracy_before"] = first.get("val/success_rate")
            summary["val_reward_before"] = first.get("val/reward_mean")
        summary["accuracy_after"] = last.get("val/success_rate")
        summary["val_reward_after"] = last.get("val/reward_mean")
    return summary, history, val_history


def write_fit_report(
    run_dir: Path, config: Mapping[str, Any], *, wall_s: float, train_size: int, val_size: int | None
) -> Path:
    """``curves.png``, ``summary.json`` and ``report.md`` for a finished fit (``config``: its
    ``model_dump``); returns report.md's path."""
    summary, history, val_history = fit_summary(
        run_dir, config, wall_s=wall_s, train_size=train_size, val_size=val_size
    )
    return write_report(run_dir, summary, history, val_history)


def _machine() -> str:
    import os

    return f"{platform.machine()} CPU, {os.cpu_count()} cores"


__all__ = [
    "fit_summary",
    "mean_timings",
    "plot_reward_accuracy",
    "render_report",
    "write_fit_report",
    "write_report",
]
