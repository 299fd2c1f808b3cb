"""What a fit returns, and the result of a run that finished before, read back from its folder."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from trainer.run_folder import checkpoint as ck
from trainer.run_folder.checkpoint import RunPlan
from trainer.run_folder.metrics import read_metrics


@dataclass
class FitResult:
    """What ``Trainer.fit`` returns."""

    run_dir: Path  # everything the run wrote: metrics.jsonl, checkpoints/, final_model/, store.db
    steps: int  # the step the run ended at (counting steps of the run it resumed)
    history: list[dict[str, float]] = field(default_factory=list)  # one row per step this call trained
    val_history: list[dict[str, float]] = field(default_factory=list)
    model_dir: Path | None = None  # the trained model, a Hugging Face folder (AutoModelForCausalLM, serve)
    adapter_dir: Path | None = None  # LoRA runs: the peft adapter (model_dir holds it merged)
    metrics: dict[str, float] = field(default_factory=dict)  # the last step's metrics + last validation
    resumed_from: int | None = None  # the checkpoint step this call continued from
    already_finished: bool = False  # the run had finished before: nothing was trained, its result returned


def finished_result(plan: RunPlan) -> FitResult:
    """The result of a run that finished before, read from its folder."""
    record = plan.record or {}
    rows = read_metrics(plan.run_dir / "metrics.jsonl")
    history = [r for r in rows if r.get("step", 0) >= 1]
    val_history = [
        {k: v for k, v in r.items() if k.startswith("val/") or k == "timing/val_s"}
        for r in rows
        if "val/reward_mean" in r
    ]
    adapter = record.get("adapter_dir")
    return FitResult(
        run_dir=plan.run_dir,
        steps=int(record.get("step", 0)),
        history=history,
        val_history=val_history,
        model_dir=plan.run_dir / record.get("model_dir", ck.FINAL_MODEL),
        adapter_dir=plan.run_dir / adapter if adapter else None,
        metrics=dict(record.get("metrics") or {}),
        already_finished=True,
    )


def final_metrics(history: list[dict[str, float]], val_history: list[dict[str, float]]) -> dict[str, float]:
    """The last step's metrics with the last validation's."""
    out = dict(history[-1]) if history else {}
    if val_history:
        out.update(val_history[-1])
    return out
