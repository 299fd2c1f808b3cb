"""Token-level inference engines: the contract, the default torch engine, model resolution and the factory.

``VLLMEngine`` (optional extra ``agentloop[vllm]``) is imported lazily, on first access.
"""

from typing import Any

from agentloop.engine.base import InferenceEngine, SamplingParams, TokenOutput
from agentloop.engine.factory import load_engine
from agentloop.engine.models import resolve_model
from agentloop.engine.torch.engine import TorchEngine

__all__ = [
    "InferenceEngine",
    "SamplingParams",
    "TokenOutput",
    "TorchEngine",
    "VLLMEngine",
    "load_engine",
    "resolve_model",
]


def __getattr__(name: str) -> Any:
    if name == "VLLMEngine":
        from agentloop.engine.vllm_engine import VLLMEngine

        return VLLMEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
