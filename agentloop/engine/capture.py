"""CUDA graph captures against the other threads of an engine's process.

While TorchEngine captures a decode step into a CUDA graph (its own thread, between two steps or
while it has no request), a
device-wide call from another thread of the process, such as ``torch.cuda.synchronize()``, fails with
"operation not permitted when stream is capturing" and invalidates the capture, which turns the
engine's CUDA graphs off for good. The trainer's weight loads do exactly that from a worker thread
(trainer/distributed/weight_sync.py: ``open_ipc``, ``_broadcast`` and ``synchronize``, which local_sync.py and a
replica's load use), and with ``max_staleness`` and in-flight updates a new batch size can be captured
at the same moment. Both sides hold this one lock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

_LOCK = threading.Lock()


@contextmanager
def no_graph_capture() -> Iterator[None]:
    """Hold off CUDA graph captures in this process for the block (and wait for one in progress):
    for GPU work from a thread other than the engine's, such as a device-wide synchronize."""
    with _LOCK:
        yield


@contextmanager
def graph_capture(wait: bool = True) -> Iterator[bool]:
    """The engine's side: a capture runs inside this block, never beside a ``no_graph_capture`` one.
    ``wait=False`` (a capture nobody waits for): yields False at once, and holds nothing, while
    another thread holds the lock."""
    if not _LOCK.acquire(blocking=wait):
        yield False
        return
    try:
        yield True
    finally:
        _LOCK.release()
