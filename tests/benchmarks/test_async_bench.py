"""benchmarks/async_bench.py's steps/hour: counted after ``--warmup-steps`` steps, NaN for a leg with no
step after its warm-up, a clear error before any run when --steps leaves none, and the 2026-11-27 H100
curves in results/async_bench_gpu.json reproduce the figures recorded from them."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tests.benchmarks import BENCHMARKS, load_benchmark


def test_steps_per_hour_counts_after_the_warmup_steps() -> None:
    bench = load_benchmark("async_bench")
    ends = [30.0, 40.0, 50.0, 60.0]  # each step's end, seconds since the loop began
    assert bench.steps_per_hour(ends, 0) == pytest.approx(4 / 60 * 3600)  # from the loop's start
    assert bench.steps_per_hour(ends, 1) == pytest.approx(3 / 30 * 3600)  # the figure before --warmup-steps
    assert bench.steps_per_hour(ends, 2) == pytest.approx(2 / 20 * 3600)
    assert bench.steps_per_hour(ends, 3) == pytest.approx(1 / 10 * 3600)  # one step after the warm-up


@pytest.mark.parametrize("steps", [0, 1, 2])
def test_a_leg_with_no_step_after_its_warmup_reports_nan(steps: int) -> None:
    bench = load_benchmark("async_bench")
    assert math.isnan(bench.steps_per_hour([10.0 * (i + 1) for i in range(steps)], 2))


def test_a_negative_warmup_is_refused() -> None:
    bench = load_benchmark("async_bench")
    with pytest.raises(ValueError, match="warmup_steps must be >= 0, got -1"):
        bench.steps_per_hour([1.0, 2.0], -1)


def test_the_cli_refuses_a_warmup_that_leaves_no_step_before_building_anything() -> None:
    run = subprocess.run(
        [sys.executable, str(BENCHMARKS / "async_bench.py"), "--device", "cpu", "--steps", "2", "--warmup-steps", "2"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2  # argparse's usage error, before a model or trainer exists
    assert "--warmup-steps (2) must be >= 0 and below --steps (2)" in run.stderr


def test_the_recorded_h100_curves_give_the_recorded_rates() -> None:
    bench = load_benchmark("async_bench")
    result = json.loads((BENCHMARKS / "results" / "async_bench_gpu.json").read_text())
    ratios = {}
    for order, legs in (
        ("sync_then_async", "legs_sync_then_async"),
        ("async_then_sync", "legs_async_then_sync"),
    ):
        rates = {}
        for mode in ("sync", "async"):
            leg = result[legs][mode]
            ends = [point["elapsed_s"] for point in leg["curve"]]
            # the curve's ends are rounded to 0.01 s (each off by <= 0.005 s, the span by <= 0.01 s: the rate
            # by rate * 0.01 / span) and the recorded rates to 0.1
            for warmup, key in ((2, "steps_per_hour"), (1, "steps_per_hour_from_step_1")):
                rate = bench.steps_per_hour(ends, warmup)
                tolerance = rate * 0.01 / (ends[-1] - ends[warmup - 1]) + 0.05
                assert rate == pytest.approx(leg[key], abs=tolerance)
            rates[mode] = leg["steps_per_hour"]
        ratios[order] = rates["async"] / rates["sync"]
        # the recorded ratio: of the two recorded rates, rounded to 1e-3
        assert ratios[order] == pytest.approx(result["speedup_steps_per_hour_by_order"][order], abs=6e-4)
    assert result["speedup_steps_per_hour"] == min(result["speedup_steps_per_hour_by_order"].values())
    assert result["met"] is (result["speedup_steps_per_hour"] >= result["target_speedup"])
    assert result["card"] == "NVIDIA H100 80GB HBM3"  # the header's card: the run's one GPU
