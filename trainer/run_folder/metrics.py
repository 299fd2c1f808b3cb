"""Metric sinks for a training run: console, metrics.jsonl, TensorBoard, W&B; and the curve PNG."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

import structlog

log = structlog.get_logger("agentloop.trainer.metrics")

Metrics = Mapping[str, float | int]


class MetricSink(Protocol):
    def log(self, step: int, metrics: Metrics) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """Appends one JSON object per step to ``metrics.jsonl``; flushed per line so a crash loses nothing."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = path.open("a", encoding="utf-8")

    def log(self, step: int, metrics: Metrics) -> None:
        row = {"step": step, **{k: _finite(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class ConsoleSink:
    """A structlog event per step with the headline figures."""

    KEYS = ("reward/mean", "val/accuracy", "actor/pg_loss", "actor/grad_norm", "timing/step_s")

    def log(self, step: int, metrics: Metrics) -> None:
        shown = {k: round(float(metrics[k]), 4) for k in self.KEYS if metrics.get(k) is not None}
        if shown:  # step 0 holds only the first validation, which logged its own line
            log.info("step", step=step, **shown)

    def close(self) -> None:
        pass


class TensorBoardSink:
    def __init__(self, log_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # tensorboard is optional
            raise ImportError("trainer.logger 'tensorboard' needs `pip install tensorboard`") from exc
        self._writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, metrics: Metrics) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, float(value), step)

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    def __init__(self, project: str, name: str, config: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError as exc:  # wandb is optional
            raise ImportError("trainer.logger 'wandb' needs `pip install wandb`") from exc
        self._run = wandb.init(project=project, name=name, config=config)

    def log(self, step: int, metrics: Metrics) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


class MetricsLogger:
    """Fans one step's metrics out to every configured sink."""

    def __init__(self, sinks: Iterable[MetricSink]) -> None:
        self.sinks = list(sinks)

    @classmethod
    def create(
        cls, kinds: Iterable[str], run_dir: Path, project: str, name: str, config: dict[str, Any]
    ) -> MetricsLogger:
        sinks: list[MetricSink] = []
        for kind in kinds:
            if kind == "console":
                sinks.append(ConsoleSink())
            elif kind == "jsonl":
                sinks.append(JsonlSink(run_dir / "metrics.jsonl"))
            elif kind == "tensorboard":
                sinks.append(TensorBoardSink(run_dir / "tensorboard"))
            elif kind == "wandb":
                sinks.append(WandbSink(project, name, config))
            else:
                raise ValueError(f"unknown logger {kind!r}; expected console, jsonl, tensorboard or wandb")
        return cls(sinks)

    def log(self, step: int, metrics: Metrics) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl (a torn last line from a crash is skipped)."""
    rows: list[dict[str, Any]] = []
    if not path.exists():
        return rows
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def plot_curves(
    metrics_path: Path, out_path: Path, keys: Iterable[str] = ("reward/mean", "val/accuracy")
) -> Path:
    """Plot the given keys of a metrics.jsonl against the step into a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    fig, ax = plt.subplots(figsize=(7, 4))
    plotted = False
    for key in keys:
        points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker="o", markersize=3, label=key)
            plotted = True
    ax.set_xlabel("training step")
    ax.grid(alpha=0.3)
    if plotted:  # a legend without lines is a matplotlib UserWarning on the user's console
        ax.legend(loc="lower right")
    ax.set_title(out_path.parent.name)
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path


def _finite(value: float | int) -> float | int | None:
    return value if not isinstance(value, float) or math.isfinite(value) else None
