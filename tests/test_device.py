"""pick_device (agentloop.device): one resolver for the engine factory and the trainer's actor."""

from __future__ import annotations

import pytest
import torch

from agentloop.device import pick_device
from agentloop.errors import EngineError
from trainer.model.actor import resolve_device


def test_names() -> None:
    here = "cuda" if torch.cuda.is_available() else "cpu"
    assert pick_device() == pick_device("auto") == here
    assert pick_device("cpu") == "cpu" and pick_device("cuda:1", check=False) == "cuda:1"
    for bad in ("tpu", "", "gpu:0", None):
        with pytest.raises(ValueError, match=r"device must be 'auto', 'cpu' or 'cuda\[:N\]', got"):
            pick_device(bad)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_cuda_without_cuda() -> None:
    with pytest.raises(EngineError, match="device 'cuda:0' was asked for but CUDA is not available"):
        pick_device("cuda:0")
    assert pick_device("cuda:0", check=False) == "cuda:0"  # named for another process or machine


def test_the_trainer_resolves_devices_the_same_way() -> None:
    """trainer.model.actor.resolve_device is pick_device as a torch.device, without the availability check (the
    driver may name the GPU of a Ray worker on another machine)."""
    assert resolve_device("auto") == torch.device(pick_device("auto"))
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(ValueError, match="device must be"):
        resolve_device("tpu")
