"""Token-level inference engines: the contract, the default torch engine and model resolution."""

from agentloop.engine.base import InferenceEngine, SamplingParams, TokenOutput
from agentloop.engine.models import load_engine, resolve_model
from agentloop.engine.torch_engine import TorchEngine

__all__ = ["InferenceEngine", "SamplingParams", "TokenOutput", "TorchEngine", "load_engine", "resolve_model"]
