"""What the benchmarks record about the machine they ran on (benchmarks/result_file.py's header)."""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what ``platform`` knows, else "unknown"."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def memory_gb() -> float | None:
    """Total RAM in GiB from /proc/meminfo (Linux), else None."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)  # the line is in KiB
    except (OSError, ValueError, IndexError):
        pass
    return None


def card() -> str | None:
    """The GPUs this process sees, ``"4 x NVIDIA H200"`` for several of one name; None without a GPU.

    Asks torch when the script has imported it (it honours CUDA_VISIBLE_DEVICES), else nvidia-smi; it
    never imports torch itself (seconds of start-up for a CPU benchmark)."""
    names: list[str] = []
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    elif shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            names = [line.strip() for line in out.stdout.splitlines() if line.strip()]
        except (OSError, subprocess.SubprocessError):
            names = []
    if not names:
        return None
    if len(set(names)) == 1:
        return names[0] if len(names) == 1 else f"{len(names)} x {names[0]}"
    return ", ".join(names)
