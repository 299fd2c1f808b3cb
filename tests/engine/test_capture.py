"""A CUDA graph capture and the trainer's weight loads never overlap in one process (capture.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch

from agentloop.engine.capture import graph_capture, no_graph_capture
from trainer.distributed import local_sync, weight_sync


def _waits_for_capture(monkeypatch: pytest.MonkeyPatch, load: Callable[[], object]) -> None:
    """``load`` (which syncs the device) runs only after a capture in progress has ended."""
    synced: list[float] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: synced.append(time.monotonic()))
    with graph_capture():
        thread = threading.Thread(target=load)
        thread.start()
        time.sleep(0.2)
        assert synced == [], "the device was synchronized while a graph was being captured"
        released = time.monotonic()
    thread.join(5)
    assert len(synced) == 1 and synced[0] >= released


def test_ipc_weight_load_waits_for_a_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    _waits_for_capture(monkeypatch, lambda: weight_sync.open_ipc([], 0))


def test_the_sync_after_a_load_waits_for_a_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    """weight_sync.synchronize: after the local IPC sync's and a replica's load (``_load``)."""
    _waits_for_capture(monkeypatch, lambda: weight_sync.synchronize(torch.device("cpu")))
    assert local_sync.synchronize is weight_sync.synchronize


def test_broadcast_waits_for_a_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    class Work:
        def wait(self) -> None:
            pass

    class Group:
        def broadcast(self, tensors: list[torch.Tensor], opts: object) -> Work:
            torch.cuda.synchronize()  # stands for the GPU work a broadcast starts
            return Work()

    _waits_for_capture(monkeypatch, lambda: weight_sync._broadcast(Group(), [torch.zeros(1)]))


def test_an_idle_capture_does_not_wait_for_a_weight_load() -> None:
    """graph_capture(wait=False), the engine's idle captures: skipped while a load holds the lock."""
    with no_graph_capture(), graph_capture(wait=False) as held:
        assert held is False
    with graph_capture(wait=False) as held:
        assert held is True
        with graph_capture(wait=False) as again:  # held: a second one does not get it either
            assert again is False
    with graph_capture() as held:  # released again, and the waiting form still works
        assert held is True
