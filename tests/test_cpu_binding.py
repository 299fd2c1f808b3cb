"""Pinning a GPU process to CPUs chosen by where its GPU sits: fixed topologies in a fake sysfs tree."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from agentloop import cpu_binding as cb

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="CPU affinity is Linux's")


def _sysfs(
    root: Path,
    nodes: dict[int, str],
    gpus: dict[str, str],
    others: dict[str, str] | None = None,
    smt_pairs: int | None = None,
) -> Path:
    """A sysfs tree: NUMA nodes with their cpulists; NVIDIA GPUs (3D controllers) and ``others`` (NICs)
    with their nodes; with ``smt_pairs`` p, CPU c and c + p are the two threads of one core."""
    (root / "devices/system/node").mkdir(parents=True)
    (root / "devices/system/node/possible").write_text("0-1\n")  # not a node folder
    for node, cpulist in nodes.items():
        (root / f"devices/system/node/node{node}").mkdir()
        (root / f"devices/system/node/node{node}/cpulist").write_text(cpulist + "\n")
    for address, node in gpus.items():
        _device(root, address, node, "0x10de", "0x030200")
    for address, node in (others or {}).items():
        _device(root, address, node, "0x8086", "0x020000")
    if smt_pairs:
        for c in range(2 * smt_pairs):
            topo = root / f"devices/system/cpu/cpu{c}/topology"
            topo.mkdir(parents=True)
            first = c % smt_pairs
            (topo / "thread_siblings_list").write_text(f"{first},{first + smt_pairs}\n")
    return root


def _device(root: Path, address: str, node: str, vendor: str, klass: str) -> None:
    d = root / "bus/pci/devices" / address
    d.mkdir(parents=True)
    (d / "numa_node").write_text(node + "\n")
    (d / "vendor").write_text(vendor + "\n")
    (d / "class").write_text(klass + "\n")


def _shares(mode: cb.CpuBinding, root: Path, allowed: set[int]) -> list[set[int] | None]:
    return [cb.cpus_for(mode, g, allowed, root)[0] for g in cb.nvidia_gpus(root)]


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


@pytest.mark.usefixtures("thread_affinities")
def test_usable_cpus_follow_the_affinity() -> None:
    allowed = os.sched_getaffinity(0)
    assert cb.usable_cpus() == len(allowed)
    os.sched_setaffinity(0, {min(allowed)})
    assert cb.usable_cpus() == 1  # a container's cpuset or a binding, not the machine's count


def test_pci_address_is_sysfs_naming() -> None:
    assert cb.pci_address(0, 0x1B, 0) == "0000:1b:00.0"
    assert cb.pci_address(1, 0xDC, 0x1F) == "0001:dc:1f.0"


def test_numa_gives_the_allowed_cpus_of_the_gpus_node(tmp_path: Path) -> None:
    gpus = {"0000:1b:00.0": "0", "0000:9a:00.0": "1", "0000:5c:00.0": "-1", "0000:7c:00.0": "x"}
    root = _sysfs(tmp_path, {0: "0-7", 1: "8-15"}, gpus)
    assert cb.numa_node_count(root) == 2
    assert cb.cpus_for("numa", "0000:1B:00.0", set(range(16)), root) == ({0, 1, 2, 3, 4, 5, 6, 7}, "")
    assert cb.cpus_for("numa", "0000:9a:00.0", {0, 1, 9}, root) == ({9}, "")  # only allowed CPUs
    assert cb.cpus_for("numa", "0000:9a:00.0", {0, 1}, root) == (
        None,
        "none of node 1's CPUs is allowed to this process",
    )
    for unknown in ("0000:5c:00.0", "0000:7c:00.0", "0000:ff:00.0"):  # -1, garbage, no such device
        assert cb.cpus_for("numa", unknown, set(range(16)), root) == (
            None,
            f"sysfs gives no NUMA node for GPU {unknown}",
        )
    assert cb.cpus_for("none", "0000:1b:00.0", set(range(16)), root) == (None, "")


def test_numa_is_a_no_op_on_a_one_node_host(tmp_path: Path) -> None:
    root = _sysfs(tmp_path, {0: "0-7"}, {"0000:06:00.0": "0"})
    assert cb.cpus_for("numa", "0000:06:00.0", set(range(8)), root) == (None, "one NUMA node")
    assert cb.numa_node_count(tmp_path / "absent") == 1
    assert cb.nvidia_gpus(tmp_path / "absent") == []


def test_exclusive_deals_a_one_node_hosts_cores_out_in_pci_order(tmp_path: Path) -> None:
    # the 4-GPU hosts we rent: one node, numa_node -1 on every GPU, no SMT siblings; a NIC is not a GPU
    gpus = {f"0000:00:0{i}.0": "-1" for i in (9, 6, 8, 7)}  # listed out of order
    root = _sysfs(tmp_path, {0: "0-7"}, gpus, others={"0000:00:05.0": "-1"})
    assert cb.nvidia_gpus(root) == ["0000:00:06.0", "0000:00:07.0", "0000:00:08.0", "0000:00:09.0"]
    assert _shares("exclusive", root, set(range(8))) == [{0, 1}, {2, 3}, {4, 5}, {6, 7}]
    assert cb.cpus_for("exclusive", "0000:00:05.0", set(range(8)), root) == (
        None,
        "GPU 0000:00:05.0 is not among the NVIDIA GPUs sysfs lists",
    )


def test_exclusive_keeps_a_cores_hardware_threads_together(tmp_path: Path) -> None:
    # one node 0-7,8-15 where CPU c and c + 8 are one core's two threads: a split by CPU number would
    # give GPU 2 the second threads of GPU 0's cores
    gpus = {f"0000:0{i}:00.0": "0" for i in range(4)}
    root = _sysfs(tmp_path, {0: "0-15"}, gpus, smt_pairs=8)
    assert cb.physical_cores({0, 1, 8, 9}, root) == [[0, 8], [1, 9]]
    assert _shares("exclusive", root, set(range(16))) == [
        {0, 1, 8, 9},
        {2, 3, 10, 11},
        {4, 5, 12, 13},
        {6, 7, 14, 15},
    ]


def test_exclusive_shares_only_the_gpus_own_node(tmp_path: Path) -> None:
    gpus = {"0000:1b:00.0": "0", "0000:2b:00.0": "0", "0000:9a:00.0": "1", "0000:aa:00.0": "1"}
    root = _sysfs(tmp_path, {0: "0-3", 1: "4-7"}, gpus)
    assert _shares("exclusive", root, set(range(8))) == [{0, 1}, {2, 3}, {4, 5}, {6, 7}]


def test_exclusive_binds_nobody_when_there_are_fewer_cores_than_gpus(tmp_path: Path) -> None:
    gpus = {f"0000:0{i}:00.0": "-1" for i in range(4)}
    root = _sysfs(tmp_path, {0: "0-7"}, gpus)
    assert _shares("exclusive", root, {0, 1}) == [None] * 4
    assert (
        cb.cpus_for("exclusive", "0000:00:00.0", {0, 1}, root)[1]
        == "2 cores here for 4 GPUs on the node: fewer than one a GPU"
    )


def test_a_mode_that_is_not_one_is_refused() -> None:
    with pytest.raises(ValueError, match="cpu_binding must be one of none, numa, exclusive, got 'fast'"):
        cb.bind_gpu_process("fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cpu_binding must be one of"):
        cb.cpus_for("NUMA", "0000:1b:00.0")  # type: ignore[arg-type]


@pytest.fixture
def thread_affinities() -> Iterator[None]:
    """Every thread of this process gets its affinity back after the test."""
    before = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            before[int(tid)] = os.sched_getaffinity(int(tid))
        except OSError:
            continue
    yield
    for tid, cpus in before.items():
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:  # ended meanwhile
            continue


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, exclusive would really bind")
@pytest.mark.usefixtures("thread_affinities")
def test_bind_gpu_process_without_cuda_does_nothing() -> None:
    before = os.sched_getaffinity(0)
    for mode in ("none", "numa", "exclusive"):
        assert cb.bind_gpu_process(mode) is None  # type: ignore[arg-type]
    assert os.sched_getaffinity(0) == before


@pytest.mark.usefixtures("thread_affinities")
def test_bind_threads_moves_the_threads_that_had_the_callers_affinity() -> None:
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
