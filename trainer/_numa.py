"""Pin a GPU process's threads to the CPUs of the NUMA node its GPU hangs off.

A trainer rank launches thousands of kernels an update; on a host with several NUMA nodes the
scheduler may run its threads on the far node, where every launch and host-device copy crosses the
socket link, and the slowest rank sets the pace of every collective. torchrun's ``--numa-binding``
does the same for the processes it starts; Ray starts ours, so each rank binds itself.
"""

from __future__ import annotations

import os
from pathlib import Path

import structlog

log = structlog.get_logger("agentloop.trainer.numa")

SYSFS = Path("/sys")  # tests point this at a fake tree


def parse_cpu_list(text: str) -> set[int]:
    """The CPUs of a sysfs cpulist such as ``"0-3,8,10-11"``; an empty string is no CPU."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise ValueError(f"expected a cpulist like '0-3,8', got {text.strip()!r}")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def numa_node_count() -> int:
    """NUMA nodes this host has (1 when sysfs does not say)."""
    nodes = SYSFS / "devices/system/node"
    if not nodes.is_dir():
        return 1
    return max(1, sum(1 for p in nodes.iterdir() if p.name[4:].isdigit() and p.name.startswith("node")))


def pci_numa_cpus(pci_address: str) -> set[int] | None:
    """CPUs of the NUMA node of the PCI device at ``pci_address`` (``"0000:1b:00.0"``) that this process
    may run on; None when sysfs does not name a node or none of its CPUs is allowed here."""
    node_file = SYSFS / "bus/pci/devices" / pci_address.lower() / "numa_node"
    try:
        node = int(node_file.read_text().strip())
    except (OSError, ValueError):
        return None
    if node < 0:  # the kernel knows no node for the device (one-node hosts write -1)
        return None
    try:
        cpus = parse_cpu_list((SYSFS / f"devices/system/node/node{node}/cpulist").read_text())
    except (OSError, ValueError):
        return None
    allowed = cpus & os.sched_getaffinity(0)
    return allowed or None


def cuda_pci_address(device_index: int = 0) -> str:
    """The sysfs PCI address of CUDA device ``device_index`` of this process."""
    import torch

    props = torch.cuda.get_device_properties(device_index)
    domain, bus, device = (getattr(props, f"pci_{k}_id") for k in ("domain", "bus", "device"))  # untyped
    return f"{domain:04x}:{bus:02x}:{device:02x}.0"


def bind_threads(cpus: set[int]) -> None:
    """Move this process's threads that still have the main thread's affinity onto ``cpus`` (threads
    started later inherit it from the thread that starts them)."""
    original = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    for tid in os.listdir("/proc/self/task"):
        try:
            if os.sched_getaffinity(int(tid)) == original:
                os.sched_setaffinity(int(tid), cpus)
        except OSError:  # the thread ended meanwhile
            continue


def bind_to_gpu_numa_node(device_index: int = 0) -> set[int] | None:
    """Pin this process to the CPUs of CUDA device ``device_index``'s NUMA node; the CPUs it is pinned
    to, or None where there is nothing to do (no CUDA, one NUMA node, the node unknown). Call it before
    starting threads (NCCL's, the data loaders'), which inherit the affinity."""
    import torch

    if not torch.cuda.is_available() or numa_node_count() < 2:
        return None
    address = cuda_pci_address(device_index)
    cpus = pci_numa_cpus(address)
    if cpus is None:
        return None
    bind_threads(cpus)
    log.info("numa.bound", gpu=address, cpus=len(cpus))
    return cpus
