"""Pinning a GPU rank to its NUMA node's CPUs: read from a fake sysfs tree."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from trainer import _numa


def _sysfs(root: Path, nodes: dict[int, str], gpus: dict[str, str]) -> Path:
    for node, cpulist in nodes.items():
        d = root / f"devices/system/node/node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpulist + "\n")
    (root / "devices/system/node/possible").write_text("0-1\n")  # not a node folder
    for address, node in gpus.items():
        d = root / "bus/pci/devices" / address
        d.mkdir(parents=True)
        (d / "numa_node").write_text(node + "\n")
    return root


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("0-3,8,10-11\n", {0, 1, 2, 3, 8, 10, 11}), ("5", {5}), ("", set()), ("0-1,", {0, 1})],
)
def test_parse_cpu_list(text: str, cpus: set[int]) -> None:
    assert _numa.parse_cpu_list(text) == cpus


@pytest.mark.parametrize("text", ["a-3", "0-x", "1:2"])
def test_parse_cpu_list_rejects_garbage(text: str) -> None:
    with pytest.raises(ValueError, match="expected a cpulist like '0-3,8'"):
        _numa.parse_cpu_list(text)


def test_node_cpus_of_a_gpu_are_the_allowed_ones_of_its_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    mine, other = ",".join(map(str, allowed)), "4000-4003"  # node 1: CPUs this process may not use
    root = _sysfs(
        tmp_path, {0: mine, 1: other}, {"0000:1b:00.0": "0", "0000:9a:00.0": "1", "0000:5c:00.0": "-1"}
    )
    monkeypatch.setattr(_numa, "SYSFS", root)
    assert _numa.numa_node_count() == 2
    assert _numa.pci_numa_cpus("0000:1B:00.0") == set(allowed)  # sysfs writes lowercase hex
    assert _numa.pci_numa_cpus("0000:9a:00.0") is None  # none of node 1's CPUs is allowed here
    assert _numa.pci_numa_cpus("0000:5c:00.0") is None  # -1: the kernel knows no node
    assert _numa.pci_numa_cpus("0000:ff:00.0") is None  # no such device


def test_one_node_host_and_no_sysfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_numa, "SYSFS", _sysfs(tmp_path, {0: "0-3"}, {}))
    assert _numa.numa_node_count() == 1
    monkeypatch.setattr(_numa, "SYSFS", tmp_path / "absent")
    assert _numa.numa_node_count() == 1


def test_bind_to_gpu_numa_node_without_cuda_does_nothing() -> None:
    before = os.sched_getaffinity(0)
    assert _numa.bind_to_gpu_numa_node(0) is None
    assert os.sched_getaffinity(0) == before


def test_bind_threads_moves_the_threads_that_had_the_main_affinity() -> None:
    before = os.sched_getaffinity(0)
    if len(before) < 2:
        pytest.skip("needs two CPUs to pin to a smaller set")
    first = {min(before)}
    started, stop = threading.Event(), threading.Event()
    tids: list[int] = []

    def idle() -> None:
        tids.append(threading.get_native_id())
        started.set()
        stop.wait(10)

    worker = threading.Thread(target=idle)
    worker.start()
    started.wait(10)
    try:
        _numa.bind_threads(first)
        assert os.sched_getaffinity(0) == first
        assert os.sched_getaffinity(tids[0]) == first  # a thread started before the binding moved too
    finally:
        stop.set()
        worker.join()
        os.sched_setaffinity(0, before)
