"""benchmarks/scale_bench.py's per-thread counters, which place a Ray rank's update time against a
torchrun rank's (CPU seconds, context switches, niceness)."""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

import pytest

from tests.benchmarks import load_benchmark

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/thread-self")


def _spin(seconds: float) -> None:
    deadline = time.thread_time() + seconds
    while time.thread_time() < deadline:
        pass


def test_thread_counters_count_only_the_calling_threads_cpu() -> None:
    bench = load_benchmark("scale_bench")
    before = bench.thread_counters()
    _spin(0.05)
    other = threading.Thread(target=_spin, args=(0.2,))  # another thread's CPU is not this one's
    other.start()
    other.join()
    delta = bench.counter_deltas(before, bench.thread_counters())
    assert 0.05 <= delta["main_cpu_s"] < 0.15, delta


def test_thread_counters_tell_waiting_from_preemption() -> None:
    bench = load_benchmark("scale_bench")
    before = bench.thread_counters()
    for _ in range(100):
        time.sleep(0.0005)  # each sleep gives the CPU up: a voluntary switch, never an involuntary one
    delta = bench.counter_deltas(before, bench.thread_counters())
    assert delta["voluntary_switches"] >= 100, delta
    assert delta["involuntary_switches"] < delta["voluntary_switches"], delta


def test_thread_counters_read_the_threads_own_niceness() -> None:
    bench = load_benchmark("scale_bench")
    seen: dict[str, Any] = {}

    def lowered() -> None:  # raising a thread's niceness needs no privilege
        own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(own + 5, 19))
        seen.update(expected=min(own + 5, 19), read=bench.thread_counters()["nice"])

    thread = threading.Thread(target=lowered)
    thread.start()
    thread.join()
    assert seen["read"] == seen["expected"], seen
    assert bench.thread_counters()["nice"] == os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # the 1-rank leg would skip FSDP2 and the 2-rank leg (fsdp_size -1) would not: two paths, one ratio
        (["--skip-fsdp-when-replicated"], "compares like with like only with --fsdp-size 1"),
        (["--gpus", "1"], "--gpus 1 needs --only-trainer"),
    ],
)
def test_options_that_would_mix_code_paths_or_scale_to_nothing_are_refused(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], message: str
) -> None:
    import asyncio

    bench = load_benchmark("scale_bench")
    monkeypatch.setattr(sys, "argv", ["scale_bench.py", "--device", "cpu", *argv])
    with pytest.raises(SystemExit, match=message):
        asyncio.run(bench.main())
