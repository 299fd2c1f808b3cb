"""benchmarks/proxy_bench.py --burst: N calls at one moment through a real proxy + SQLite store, every one
answered 200 and recorded, the proxy's CPU per request and the latency split reported."""

from __future__ import annotations

import argparse

import anyio
import pytest

from tests.benchmarks import load_benchmark


@pytest.mark.e2e
@pytest.mark.parametrize("workers", [0, 2])
async def test_a_burst_is_answered_recorded_and_measured(workers: int) -> None:
    bench = load_benchmark("proxy_bench")
    n, rounds = 16, 2
    args = argparse.Namespace(
        burst=n, rounds=rounds, store="sqlite", response_tokens=32, profile=None, gc_threshold=None,
        workers=workers,
    )  # fmt: skip
    with anyio.fail_after(120):
        result = await bench.run_burst(args)  # asserts every answer was a 200 itself
    assert result["spans_recorded_last_round"] == n
    assert len(result["rounds"]) == rounds
    cpu = result["per_request_cpu_ms"]
    assert 0 < cpu["loop_thread"] <= cpu["process"]
    if workers:  # the workers record the calls (all n spans are there): this process's store thread idles
        # (the workers' CPU comes from /proc in 10 ms ticks: ~20 ms a round here, too coarse to compare)
        assert (
            cpu["store_thread"] < 0.05 and cpu["worker_processes"] >= 0
        )  # idle: ~0.002 ms a request seen once
    else:
        assert cpu["store_thread"] > 0 and cpu["worker_processes"] == 0
    latency = result["latency_ms_median"]
    # the barrier engine answers once all n arrived: no call reaches it after the batch went, and the
    # last answer comes after the first call was sent
    assert 0 <= latency["admission_spread"] <= latency["first_sent_to_last_received"]
    assert latency["send_to_engine"] > 0 and latency["engine_to_received"] > 0
