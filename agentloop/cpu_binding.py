"""Pin a GPU process (a trainer rank, an engine replica) to CPUs chosen by where its GPU sits.

A GPU process launches thousands of kernels a second from one Python thread; when the scheduler runs
it on the far NUMA node, or beside another GPU process's busy thread, its launches slow down, and in a
data-parallel step or a rollout wave the slowest process sets the pace of all. ``cpu_binding``:

* ``none``: leave the process where the OS puts it.
* ``numa``: the CPUs of the GPU's NUMA node (as torchrun's ``--numa-binding``); a no-op on a host
  with one node or where sysfs does not name the GPU's node.
* ``exclusive``: the node's CPUs dealt out among the node's GPUs in contiguous, disjoint shares (by PCI
  address order), so no two GPUs' processes share a CPU; on a host with one node, all of this
  process's CPUs are dealt out. Processes of one GPU (a colocated rank and replica) share its share.

Only CPUs this process may already run on are used. Call it before starting threads (the engine's,
NCCL's), which inherit the affinity.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, get_args

import structlog

__all__ = ["CpuBinding", "bind_gpu_process", "check_mode"]

log = structlog.get_logger("agentloop.cpu_binding")

CpuBinding = Literal["none", "numa", "exclusive"]
SYSFS = Path("/sys")  # tests point this at a fake tree
_NVIDIA = "0x10de"


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
    return max(1, sum(1 for p in nodes.iterdir() if p.name.startswith("node") and p.name[4:].isdigit()))


def pci_numa_node(pci_address: str) -> int | None:
    """The NUMA node of the PCI device at ``pci_address`` (``"0000:1b:00.0"``); None when sysfs does
    not say (one-node hosts write -1)."""
    try:
        node = int((SYSFS / "bus/pci/devices" / pci_address.lower() / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def node_cpus(node: int) -> set[int] | None:
    """CPUs of NUMA node ``node`` that this process may run on; None when there are none."""
    try:
        cpus = parse_cpu_list((SYSFS / f"devices/system/node/node{node}/cpulist").read_text())
    except (OSError, ValueError):
        return None
    return (cpus & os.sched_getaffinity(0)) or None


def pci_numa_cpus(pci_address: str) -> set[int] | None:
    """CPUs of the NUMA node of the PCI device at ``pci_address`` that this process may run on; None
    when sysfs does not name a node or none of its CPUs is allowed here."""
    node = pci_numa_node(pci_address)
    return None if node is None else node_cpus(node)


def nvidia_gpus() -> list[str]:
    """PCI addresses of the host's NVIDIA display and 3D controllers, sorted (all of them, whatever
    CUDA_VISIBLE_DEVICES shows this process)."""
    devices = SYSFS / "bus/pci/devices"
    if not devices.is_dir():
        return []
    found = []
    for dev in devices.iterdir():
        try:
            vendor, klass = (dev / "vendor").read_text().strip(), (dev / "class").read_text().strip()
        except OSError:
            continue
        if vendor == _NVIDIA and klass[:6] in ("0x0300", "0x0302"):
            found.append(dev.name.lower())
    return sorted(found)


def exclusive_cpus(pci_address: str) -> set[int] | None:
    """This GPU's share of its node's CPUs (see the module docstring); None when the GPU is not in
    sysfs or its share would be empty."""
    address = pci_address.lower()
    node = pci_numa_node(address)
    peers = [g for g in nvidia_gpus() if pci_numa_node(g) == node]
    if address not in peers:
        return None
    pool = node_cpus(node) if node is not None else os.sched_getaffinity(0)
    if not pool:
        return None
    cpus, k, n = sorted(pool), peers.index(address), len(peers)
    share = set(cpus[k * len(cpus) // n : (k + 1) * len(cpus) // n])
    return share or None


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


def check_mode(mode: object) -> CpuBinding:
    """``mode`` when it is a CpuBinding, else a ValueError that lists them."""
    if mode not in get_args(CpuBinding):
        raise ValueError(f"cpu_binding must be one of {', '.join(get_args(CpuBinding))}, got {mode!r}")
    return mode  # type: ignore[return-value]


def cpus_for(mode: CpuBinding, pci_address: str) -> set[int] | None:
    """The CPUs ``mode`` gives the GPU at ``pci_address``; None: leave the process as it is."""
    if check_mode(mode) == "numa":
        return pci_numa_cpus(pci_address) if numa_node_count() > 1 else None
    if mode == "exclusive":
        return exclusive_cpus(pci_address)
    return None


def bind_gpu_process(mode: CpuBinding, device_index: int = 0) -> set[int] | None:
    """Pin this process as ``mode`` says for its CUDA device ``device_index``; the CPUs it is pinned
    to, or None where there is nothing to do (``none``, no CUDA, nothing known about the GPU)."""
    check_mode(mode)
    import torch

    if mode == "none" or not torch.cuda.is_available():
        return None
    address = cuda_pci_address(device_index)
    cpus = cpus_for(mode, address)
    if cpus is None:
        return None
    bind_threads(cpus)
    log.info("cpu_binding.bound", mode=mode, gpu=address, cpus=len(cpus), first=min(cpus), last=max(cpus))
    return cpus
