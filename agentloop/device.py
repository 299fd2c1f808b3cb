"""``pick_device``: the one place a device name (``auto``, ``cpu``, ``cuda``, ``cuda:N``) becomes a device.

Used by the engine factory (``agentloop.engine.factory.load_engine``) and the trainer
(``trainer.model.actor.resolve_device``). torch is imported on first call, not with this module.
"""

from __future__ import annotations

from agentloop.errors import EngineError

__all__ = ["pick_device"]


def pick_device(device: str = "auto", *, check: bool = True) -> str:
    """``auto`` -> ``cuda`` when CUDA is available in this process, else ``cpu``; ``cpu[:N]`` and
    ``cuda[:N]`` are returned as given; anything else is a ValueError that lists the accepted names.

    ``check``: a CUDA device asked for where CUDA is not available is an EngineError. Turn it off where
    the name is passed on to another process or machine (the trainer's driver names the device its Ray
    workers use, and may itself have no GPU).
    """
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not isinstance(device, str) or device.split(":")[0] not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")
    if check and device.startswith("cuda") and not torch.cuda.is_available():
        raise EngineError(f"device {device!r} was asked for but CUDA is not available; use device='cpu'")
    return device
