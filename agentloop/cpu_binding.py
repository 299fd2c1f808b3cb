"""Pin a GPU process (a trainer rank, an engine replica) to CPUs chosen by where its GPU sits.

A GPU process launches thousands of kernels a second from one Python thread; when the scheduler runs
it on the far NUMA node, or beside another GPU process's busy thread, its launches slow down, and in a
data-parallel step or a rollout wave the slowest process sets the pace of all. ``cpu_binding``:

* ``none``: leave the process where the OS puts it.
* ``numa``: the CPUs of the GPU's NUMA node (as torchrun's ``--numa-binding``); a no-op on a host
  with one node or where sysfs does not name the GPU's node.
* ``exclusive``: the node's physical cores dealt out among the node's GPUs in contiguous, disjoint
  shares (by PCI address order), each core with all its hardware threads, so no two GPUs' processes
  share a core; on a host with one node, all the cores this process may use are dealt out. Processes
  of one GPU (a colocated rank and replica) share its share.

Limits: only CPUs this process may already run on are used, and a binding narrows that set, so bind
once per process, before starting threads (the engine's, NCCL's), which inherit the affinity. sysfs
shows every GPU of the host, so ``exclusive`` deals the cores out among all the host's GPUs, also
those another job uses. Only NVIDIA GPUs are dealt cores. Where a mode cannot apply, the process is
left as it is and a warning says why.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, get_args

import structlog

__all__ = [
    "CpuBinding",
    "bind_gpu_process",
    "check_mode",
    "cpus_for",
    "cuda_pci_address",
    "numa_node_count",
    "pci_numa_node",
    "usable_cpus",
]

log = structlog.get_logger("agentloop.cpu_binding")

CpuBinding = Literal["none", "numa", "exclusive"]
SYSFS = Path("/sys")
_NVIDIA = "0x10de"
_GPU_CLASSES = ("0x0300", "0x0302")  # display (VGA) and 3D controllers


def check_mode(mode: object) -> CpuBinding:
    """``mode`` when it is a CpuBinding, else a ValueError that lists them."""
    if mode not in get_args(CpuBinding):
        raise ValueError(f"cpu_binding must be one of {', '.join(get_args(CpuBinding))}, got {mode!r}")
    return mode  # type: ignore[return-value]


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity where the OS has one (a container's cpuset, a
    binding), else every CPU of the machine."""
    if hasattr(os, "sched_getaffinity"):  # Linux
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


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


def pci_address(domain: int, bus: int, device: int) -> str:
    """The sysfs name of PCI function 0 of ``domain:bus:device``: ``"0000:1b:00.0"``."""
    return f"{domain:04x}:{bus:02x}:{device:02x}.0"


def cuda_pci_address(device_index: int = 0) -> str:
    """The sysfs PCI address of CUDA device ``device_index`` of this process (AttributeError on a
    torch whose device properties lack the PCI ids)."""
    import torch

    props = torch.cuda.get_device_properties(device_index)
    return pci_address(props.pci_domain_id, props.pci_bus_id, props.pci_device_id)  # type: ignore[attr-defined]


def numa_node_count(root: Path = SYSFS) -> int:
    """NUMA nodes this host has (1 when sysfs does not say)."""
    nodes = root / "devices/system/node"
    if not nodes.is_dir():
        return 1
    return max(1, sum(1 for p in nodes.iterdir() if p.name.startswith("node") and p.name[4:].isdigit()))


def pci_numa_node(address: str, root: Path = SYSFS) -> int | None:
    """The NUMA node of the PCI device at ``address``; None when sysfs does not say (one-node hosts
    write -1) or has no such device."""
    try:
        node = int((root / "bus/pci/devices" / address.lower() / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def node_cpus(node: int, allowed: set[int], root: Path = SYSFS) -> set[int]:
    """The CPUs of NUMA node ``node`` among ``allowed`` (none when sysfs does not say)."""
    try:
        return parse_cpu_list((root / f"devices/system/node/node{node}/cpulist").read_text()) & allowed
    except (OSError, ValueError):
        return set()


def nvidia_gpus(root: Path = SYSFS) -> list[str]:
    """PCI addresses of the host's NVIDIA GPUs, sorted (all of them, whatever CUDA_VISIBLE_DEVICES
    shows this process)."""
    devices = root / "bus/pci/devices"
    if not devices.is_dir():
        return []
    found = []
    for dev in devices.iterdir():
        try:
            vendor, klass = (dev / "vendor").read_text().strip(), (dev / "class").read_text().strip()
        except OSError:
            continue
        if vendor == _NVIDIA and klass[:6] in _GPU_CLASSES:
            found.append(dev.name.lower())
    return sorted(found)


def physical_cores(cpus: set[int], root: Path = SYSFS) -> list[list[int]]:
    """``cpus`` grouped by physical core (hardware threads of one core together), ordered by their
    lowest CPU; a CPU whose topology sysfs does not give is a core of its own."""
    cores: dict[int, list[int]] = {}
    for cpu in sorted(cpus):
        try:
            siblings = parse_cpu_list(
                (root / f"devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text()
            )
        except (OSError, ValueError):
            siblings = {cpu}
        cores.setdefault(min(siblings & cpus or {cpu}), []).append(cpu)
    return [cores[k] for k in sorted(cores)]


def exclusive_cpus(address: str, allowed: set[int], root: Path = SYSFS) -> tuple[set[int] | None, str]:
    """This GPU's share of its node's cores among ``allowed`` CPUs (see the module docstring), or
    None and why not."""
    address = address.lower()
    node = pci_numa_node(address, root)
    peers = [g for g in nvidia_gpus(root) if pci_numa_node(g, root) == node]
    if address not in peers:
        return None, f"GPU {address} is not among the NVIDIA GPUs sysfs lists"
    cores = physical_cores(node_cpus(node, allowed, root) if node is not None else allowed, root)
    k, n = peers.index(address), len(peers)
    if len(cores) < n:
        return None, f"{len(cores)} cores here for {n} GPUs on the node: fewer than one a GPU"
    share = cores[k * len(cores) // n : (k + 1) * len(cores) // n]
    return {cpu for core in share for cpu in core}, ""


def cpus_for(
    mode: CpuBinding, address: str, allowed: set[int] | None = None, root: Path = SYSFS
) -> tuple[set[int] | None, str]:
    """The CPUs ``mode`` gives the GPU at ``address`` out of ``allowed`` (default: those this process
    may run on), or None and why the process stays as it is ("" for mode ``none``)."""
    check_mode(mode)
    allowed = os.sched_getaffinity(0) if allowed is None else allowed
    if mode == "none":
        return None, ""
    if mode == "exclusive":
        return exclusive_cpus(address, allowed, root)
    if numa_node_count(root) < 2:
        return None, "one NUMA node"
    node = pci_numa_node(address, root)
    if node is None:
        return None, f"sysfs gives no NUMA node for GPU {address}"
    cpus = node_cpus(node, allowed, root)
    return (cpus, "") if cpus else (None, f"none of node {node}'s CPUs is allowed to this process")


def bind_threads(cpus: set[int]) -> None:
    """Move the calling thread, and every thread of this process with the calling thread's affinity,
    onto ``cpus`` (threads started later inherit it from the thread that starts them)."""
    original = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    for tid in os.listdir("/proc/self/task"):
        try:
            if os.sched_getaffinity(int(tid)) == original:
                os.sched_setaffinity(int(tid), cpus)
        except OSError:  # the thread ended meanwhile
            continue


def bind_gpu_process(mode: CpuBinding, device_index: int = 0) -> set[int] | None:
    """Pin this process as ``mode`` says for its CUDA device ``device_index``; the CPUs it is pinned
    to, or None where it stays as it is (``none``, no CUDA, or the mode cannot apply: a warning says
    why). Never raises for an opt-in speed setting, except for a ``mode`` that is not one."""
    check_mode(mode)
    import torch

    if mode == "none" or not torch.cuda.is_available():
        return None
    try:
        address = cuda_pci_address(device_index)
        cpus, why = cpus_for(mode, address)
        if cpus is not None:
            bind_threads(cpus)
    except (AttributeError, OSError) as exc:  # a torch without PCI ids; an affinity the OS refused
        cpus, why, address = None, f"{type(exc).__name__}: {exc}", "?"
    if cpus is None:
        log.warning("cpu_binding.skipped", mode=mode, gpu=address, reason=why)
        return None
    log.info("cpu_binding.bound", mode=mode, gpu=address, cpus=len(cpus), first=min(cpus), last=max(cpus))
    return cpus
