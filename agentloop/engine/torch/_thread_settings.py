"""Process settings the engine thread needs: a short GIL switch interval (CUDA) and no stray
OpenMP pool (CPU). TorchEngine.start applies them once, before it starts its thread."""

from __future__ import annotations

import sys
from pathlib import Path

import structlog
import torch

log = structlog.get_logger("agentloop.engine.torch.engine")

GIL_SWITCH_INTERVAL_S = 0.0002  # see shorten_gil_switch_interval


def shorten_gil_switch_interval() -> None:
    """Lower the interpreter's GIL switch interval to ``GIL_SWITCH_INTERVAL_S`` (never raise it).

    Why: the engine thread drops the GIL inside every torch call and must take it back after, while
    the event loop thread (the proxy parsing, templating and recording 128 agents' calls) holds it.
    A thread that wants the GIL asks the holder to let go only after the switch interval, 5 ms by
    default: a decode step of a few ms then waits several times that for the GIL at each torch call,
    and the GPU idles. At 0.2 ms the engine thread waits at most that long per hand-off, and the
    event loop loses only the cost of the extra switches. It is process-wide (``sys.setswitchinterval``).
    """
    if sys.getswitchinterval() > GIL_SWITCH_INTERVAL_S:
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        log.info("engine.gil_switch_interval", seconds=GIL_SWITCH_INTERVAL_S)


def free_openmp_pool_of_this_thread() -> None:
    """Free the calling thread's OpenMP worker pool (``omp_pause_resource_all(omp_pause_hard)``).

    Why: the engine thread runs every forward. With libgomp, while another thread (the one that
    loaded the model) still owns a worker pool, the process has more OpenMP threads than cores, and
    libgomp stops spin-waiting: each of the ~500 parallel regions of a forward then wakes sleeping
    workers. Measured on the 2-core dev machine, SmolLM2 fp32 at batch 32: a decode forward in the
    engine thread takes ~230 ms with the caller's pool alive and ~150 ms once it is freed (as fast
    as on the main thread). A pool the caller needs again is simply re-created.
    """
    import ctypes

    names = sorted(Path(torch.__file__).parent.joinpath("lib").glob("libgomp*.so*"))
    for name in [*map(str, names), "libgomp.so.1", "libiomp5.so"]:
        try:
            pause = ctypes.CDLL(name).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        pause(2)  # omp_pause_hard; returns non-zero (and does nothing) inside a parallel region
        return
