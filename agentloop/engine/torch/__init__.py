"""TorchEngine, agentloop's default inference engine, and its pieces: request admission and the
scheduler thread, the slot KV cache, prefill and decode (CUDA graphs, the CPU decoder), attention without a
dense mask, and sampling (the fused GPU sampler)."""

from agentloop.engine.torch.engine import TorchEngine

__all__ = ["TorchEngine"]
