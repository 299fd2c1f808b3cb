"""PPO with a critic (``--estimator gae``) against GRPO on the tools demo: one JSON with both curves.

    agentloop demo --task tools --estimator gae --name ppo           # runs/ppo
    python benchmarks/ppo_vs_grpo.py --ppo runs/ppo --grpo benchmarks/results/demo_tools_cpu.json

Each side is a run folder of ``agentloop demo --task tools`` (its ``summary.json`` and
``metrics.jsonl``) or a committed result JSON with ``per_step`` rows (``demo_tools_cpu.json``). Each
object holds ``accuracy_before``, ``accuracy_after`` (held-out, greedy, strict), ``wall_minutes`` and
``curve``: the training reward per step (and the critic's explained variance for PPO). Prints JSON
(benchmarks/result_file.py's header, then both sides) and writes it to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import result_file

_CURVE_KEYS = ("reward/mean", "critic/vf_loss", "critic/vf_explained_var", "timing/step_s")


def side(source: Path) -> dict[str, Any]:
    """One estimator's summary and curve, from a run folder or a committed result JSON."""
    if source.is_dir():
        summary = json.loads((source / "summary.json").read_text())
        rows = [
            json.loads(line) for line in (source / "metrics.jsonl").read_text().splitlines() if line.strip()
        ]
        steps = [r for r in rows if "reward/mean" in r]
        config = json.loads((source / "config.json").read_text())
        estimator = config["algorithm"]["adv_estimator"]
    else:
        summary = json.loads(source.read_text())
        steps = summary["per_step"]
        estimator = "grpo"
    curve = [{"step": r["step"], **{k: r[k] for k in _CURVE_KEYS if r.get(k) is not None}} for r in steps]
    return {
        "estimator": estimator,
        "source": str(source),
        "accuracy_before": summary["accuracy_before"],
        "accuracy_after": summary["accuracy_after"],
        "accuracy_gain_points": round(100 * (summary["accuracy_after"] - summary["accuracy_before"]), 1),
        "wall_minutes": round(summary["wall_minutes"], 2),
        "steps": len(curve),
        "curve": curve,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--ppo", type=Path, required=True, help="the PPO run folder (or result JSON)")
    ap.add_argument("--grpo", type=Path, required=True, help="the GRPO run folder (or result JSON)")
    ap.add_argument("--note", default="", help="what the reader should know (machine load, ...)")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args()
    out = {
        "what": "tools demo: PPO with a critic (gae) vs GRPO",
        "ppo": side(args.ppo),
        "grpo": side(args.grpo),
    }
    if args.note:
        out["note"] = args.note
    # the runs' own machine: this script only reads them, so the header's machine is where it was run
    document = result_file.result(result_file.header("ppo_vs_grpo", gpu=None), out)
    print(json.dumps(document, indent=2))
    if args.out is not None:
        result_file.write(args.out, document)


if __name__ == "__main__":
    main()
