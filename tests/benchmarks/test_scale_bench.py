"""benchmarks/scale_bench.py's per-thread counters, which place a Ray rank's update time against a
torchrun rank's (CPU seconds, context switches, niceness)."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from tests.benchmarks import load_benchmark


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/thread-self")
def test_thread_counters_count_this_threads_cpu_and_waits() -> None:
    bench = load_benchmark("scale_bench")
    before = bench.thread_counters()
    deadline = time.thread_time() + 0.05
    while time.thread_time() < deadline:  # 50 ms of this thread's CPU
        pass
    for _ in range(3):
        time.sleep(0.001)  # each sleep gives the CPU up: a voluntary switch
    spin = threading.Thread(target=lambda: time.sleep(0.2))  # another thread's time is not counted
    spin.start()
    spin.join()
    delta = bench.counter_deltas(before, bench.thread_counters())
    assert 0.05 <= delta["main_cpu_s"] < 0.15, delta
    assert delta["voluntary_switches"] >= 3, delta
    assert delta["involuntary_switches"] >= 0, delta
    assert delta["nice"] == os.getpriority(os.PRIO_PROCESS, 0), delta
