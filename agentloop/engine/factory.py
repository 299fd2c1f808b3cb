"""The engine factory: ``load_engine(model, device, backend)`` -> a ready InferenceEngine.

The model name is resolved by ``agentloop.engine.models.resolve_model`` (an alias, a local folder or a
hub id), the device by ``agentloop.device.pick_device``; the backend picks the engine class.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from agentloop.device import pick_device
from agentloop.engine.models import SMOLLM2_ALIAS, resolve_model
from agentloop.errors import EngineError

__all__ = ["load_engine"]


def load_engine(
    model: str = SMOLLM2_ALIAS, device: str = "auto", backend: str = "torch", **engine_kwargs: Any
) -> Any:
    """Resolve ``model`` and start-ready an inference engine on ``device`` (cuda: bf16, cpu: fp32).

    ``backend`` is ``"torch"`` (TorchEngine, the default) or ``"vllm"`` (optional extra).
    """
    dev = pick_device(device)
    path = resolve_model(model)
    if backend == "torch":
        import torch

        from agentloop.engine.torch.engine import TorchEngine

        dtype = torch.bfloat16 if dev.startswith("cuda") else torch.float32
        return TorchEngine(path, device=dev, dtype=dtype, **engine_kwargs)
    if backend == "vllm":
        if importlib.util.find_spec("vllm") is None:
            raise EngineError(
                "backend='vllm' needs vLLM, which is not installed: pip install -e '.[vllm]' in a clone of agentloop (the vllm extra; no release is on PyPI)"
            )
        from agentloop.engine import vllm_engine  # type: ignore[attr-defined]

        return vllm_engine.VLLMEngine(str(path), **engine_kwargs)
    raise ValueError(f"backend must be 'torch' or 'vllm', got {backend!r}")
