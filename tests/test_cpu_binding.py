"""Pinning a GPU process to CPUs chosen by where its GPU sits: read from a fake sysfs tree."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from agentloop import cpu_binding as cb

ALLOWED = sorted(os.sched_getaffinity(0))


def _sysfs(
    root: Path, nodes: dict[int, str], gpus: dict[str, str], others: dict[str, str] | None = None
) -> Path:
    """A sysfs tree: NUMA nodes with their cpulists, NVIDIA GPUs (3D controllers) with their nodes, and
    ``others``: non-NVIDIA PCI devices with their nodes."""
    for node, cpulist in nodes.items():
        d = root / f"devices/system/node/node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpulist + "\n")
    (root / "devices/system/node").mkdir(parents=True, exist_ok=True)
    (root / "devices/system/node/possible").write_text("0-1\n")  # not a node folder
    for address, node in gpus.items():
        _device(root, address, node, "0x10de", "0x030200")
    for address, node in (others or {}).items():
        _device(root, address, node, "0x8086", "0x020000")  # a NIC
    return root


def _device(root: Path, address: str, node: str, vendor: str, klass: str) -> None:
    d = root / "bus/pci/devices" / address
    d.mkdir(parents=True)
    (d / "numa_node").write_text(node + "\n")
    (d / "vendor").write_text(vendor + "\n")
    (d / "class").write_text(klass + "\n")


def _cpulist(cpus: list[int]) -> str:
    return ",".join(map(str, cpus))


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("0-3,8,10-11\n", {0, 1, 2, 3, 8, 10, 11}), ("5", {5}), ("", set()), ("0-1,", {0, 1})],
)
def test_parse_cpu_list(text: str, cpus: set[int]) -> None:
    assert cb.parse_cpu_list(text) == cpus


@pytest.mark.parametrize("text", ["a-3", "0-x", "1:2"])
def test_parse_cpu_list_rejects_garbage(text: str) -> None:
    with pytest.raises(ValueError, match="expected a cpulist like '0-3,8'"):
        cb.parse_cpu_list(text)


def test_numa_cpus_are_the_allowed_ones_of_the_gpus_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpus = {"0000:1b:00.0": "0", "0000:9a:00.0": "1", "0000:5c:00.0": "-1"}
    monkeypatch.setattr(cb, "SYSFS", _sysfs(tmp_path, {0: _cpulist(ALLOWED), 1: "4000-4003"}, gpus))
    assert cb.numa_node_count() == 2
    assert cb.pci_numa_cpus("0000:1B:00.0") == set(ALLOWED)  # sysfs writes lowercase hex
    assert cb.pci_numa_cpus("0000:9a:00.0") is None  # none of node 1's CPUs is allowed here
    assert cb.pci_numa_cpus("0000:5c:00.0") is None  # -1: the kernel knows no node
    assert cb.pci_numa_cpus("0000:ff:00.0") is None  # no such device
    assert cb.cpus_for("numa", "0000:1b:00.0") == set(ALLOWED)
    assert cb.cpus_for("none", "0000:1b:00.0") is None


def test_numa_is_a_no_op_on_a_one_node_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cb, "SYSFS", _sysfs(tmp_path, {0: _cpulist(ALLOWED)}, {"0000:06:00.0": "0"}))
    assert cb.numa_node_count() == 1
    assert cb.cpus_for("numa", "0000:06:00.0") is None
    monkeypatch.setattr(cb, "SYSFS", tmp_path / "absent")
    assert cb.numa_node_count() == 1
    assert cb.nvidia_gpus() == []


def test_exclusive_deals_a_one_node_hosts_cpus_out_among_its_gpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the 4-GPU hosts we rent: one node, numa_node -1 on every GPU; a NIC that is not a GPU
    gpus = {f"0000:00:0{i}.0": "-1" for i in (9, 6, 8, 7)}  # listed out of order
    root = _sysfs(tmp_path, {0: _cpulist(ALLOWED)}, gpus, others={"0000:00:05.0": "-1"})
    monkeypatch.setattr(cb, "SYSFS", root)
    assert cb.nvidia_gpus() == ["0000:00:06.0", "0000:00:07.0", "0000:00:08.0", "0000:00:09.0"]
    shares = [cb.cpus_for("exclusive", g) for g in cb.nvidia_gpus()]
    n = len(ALLOWED)
    expected = [set(ALLOWED[k * n // 4 : (k + 1) * n // 4]) or None for k in range(4)]
    assert shares == expected  # contiguous, in PCI order
    got = [s for s in shares if s]
    assert set().union(*got) == set(ALLOWED)  # together: every allowed CPU (when there are >= 4)
    assert sum(map(len, got)) == len(set().union(*got))  # disjoint
    assert cb.cpus_for("exclusive", "0000:00:05.0") is None  # not a GPU


def test_exclusive_shares_only_the_gpus_own_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # two nodes with two GPUs each; this process may run on node 0's CPUs only (the fake node 0 holds
    # exactly the allowed CPUs), so node 1's GPUs get no share here
    gpus = {"0000:1b:00.0": "0", "0000:2b:00.0": "0", "0000:9a:00.0": "1", "0000:aa:00.0": "1"}
    monkeypatch.setattr(cb, "SYSFS", _sysfs(tmp_path, {0: _cpulist(ALLOWED), 1: "4000-4007"}, gpus))
    half = len(ALLOWED) // 2
    assert cb.cpus_for("exclusive", "0000:1b:00.0") == (set(ALLOWED[:half]) or None)
    assert cb.cpus_for("exclusive", "0000:2b:00.0") == set(ALLOWED[half:])
    assert cb.cpus_for("exclusive", "0000:9a:00.0") is None


def test_a_mode_that_is_not_one_is_refused() -> None:
    with pytest.raises(ValueError, match="cpu_binding must be one of none, numa, exclusive, got 'fast'"):
        cb.bind_gpu_process("fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cpu_binding must be one of"):
        cb.cpus_for("NUMA", "0000:1b:00.0")  # type: ignore[arg-type]


def test_bind_gpu_process_without_cuda_does_nothing() -> None:
    before = os.sched_getaffinity(0)
    for mode in ("none", "numa", "exclusive"):
        assert cb.bind_gpu_process(mode) is None  # type: ignore[arg-type]
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
        cb.bind_threads(first)
        assert os.sched_getaffinity(0) == first
        assert os.sched_getaffinity(tids[0]) == first  # a thread started before the binding moved too
    finally:
        stop.set()
        worker.join()
        os.sched_setaffinity(0, before)
