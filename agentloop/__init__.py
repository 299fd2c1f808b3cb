"""agentloop: an async agent-loop SDK with an embedded RL trainer that keeps exact token ids.

Public names are imported lazily (``import agentloop`` stays cheap: torch, starlette and the
store backends load on first use); the exception tree (``agentloop.errors``, which imports
nothing) eagerly. ``__all__`` is the public API: tests/test_public_api.py checks it against the
list in docs/architecture.md (both ways), the design's names, ``_LAZY`` and the ``TYPE_CHECKING``
imports below, which let type checkers and IDEs see every name.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from agentloop._version import __version__
from agentloop.errors import (
    AgentError,
    AgentLoopError,
    ConfigError,
    ContextLengthExceededError,
    EmptyBatchError,
    EngineError,
    ImportObjectError,
    InvalidRequestError,
    InvalidTransitionError,
    JudgeError,
    ModelResolutionError,
    NotFoundError,
    RequestAbortedError,
    RolloutContextError,
    SandboxArgumentError,
    SandboxError,
    SandboxUnavailableError,
    StaleAttemptError,
    StoreUnavailableError,
    ToolArgumentError,
    ToolDefinitionError,
    ToolError,
    ToolNotFoundError,
    TrainerTimeoutError,
    VerifiersEpisodeError,
)

if TYPE_CHECKING:  # the real names for type checkers and IDEs; at run time __getattr__ imports them
    from agentloop.adapter import spans_to_triplets
    from agentloop.agent import Agent, emit_reward, rollout
    from agentloop.client import async_openai_client, openai_client
    from agentloop.engine.base import InferenceEngine, SamplingParams, TokenOutput
    from agentloop.engine.factory import load_engine
    from agentloop.judge import RewardJudge, judge_reward
    from agentloop.logging import configure_logging
    from agentloop.proxy import Proxy
    from agentloop.resources import LLM, ProxyLLM, Resources
    from agentloop.runner import Runner
    from agentloop.store.base import Store
    from agentloop.store.client import StoreClient
    from agentloop.store.memory import MemoryStore
    from agentloop.store.server import StoreServer
    from agentloop.store.sqlite import SQLiteStore
    from agentloop.tools import BaseTool, ToolResponse, function_tool
    from agentloop.tools.agent import ToolAgent
    from agentloop.types import (
        Attempt,
        AttemptedRollout,
        AttemptStatus,
        ErrorInfo,
        LLMCall,
        Log,
        Reward,
        Rollout,
        RolloutConfig,
        RolloutStatus,
        Span,
        ToolCall,
        Triplet,
    )


__all__ = [
    "LLM",
    "Agent",
    "AgentError",
    "AgentLoopError",
    "Attempt",
    "AttemptStatus",
    "AttemptedRollout",
    "BaseTool",
    "ConfigError",
    "ContextLengthExceededError",
    "EmptyBatchError",
    "EngineError",
    "ErrorInfo",
    "ImportObjectError",
    "InferenceEngine",
    "InvalidRequestError",
    "InvalidTransitionError",
    "JudgeError",
    "LLMCall",
    "Log",
    "MemoryStore",
    "ModelResolutionError",
    "NotFoundError",
    "Proxy",
    "ProxyLLM",
    "RequestAbortedError",
    "Resources",
    "Reward",
    "RewardJudge",
    "Rollout",
    "RolloutConfig",
    "RolloutContextError",
    "RolloutStatus",
    "Runner",
    "SQLiteStore",
    "SamplingParams",
    "SandboxArgumentError",
    "SandboxError",
    "SandboxUnavailableError",
    "Span",
    "StaleAttemptError",
    "Store",
    "StoreClient",
    "StoreServer",
    "StoreUnavailableError",
    "TokenOutput",
    "ToolAgent",
    "ToolArgumentError",
    "ToolCall",
    "ToolDefinitionError",
    "ToolError",
    "ToolNotFoundError",
    "ToolResponse",
    "TrainerTimeoutError",
    "Triplet",
    "VerifiersEpisodeError",
    "__version__",
    "async_openai_client",
    "configure_logging",
    "emit_reward",
    "function_tool",
    "judge_reward",
    "load_engine",
    "openai_client",
    "rollout",
    "spans_to_triplets",
]  # sorted; docs/architecture.md's Public API section groups them

# lazily imported public name -> the module that defines it
_LAZY: dict[str, str] = {
    "Rollout": "agentloop.types",
    "Attempt": "agentloop.types",
    "AttemptedRollout": "agentloop.types",
    "RolloutStatus": "agentloop.types",
    "AttemptStatus": "agentloop.types",
    "RolloutConfig": "agentloop.types",
    "Span": "agentloop.types",
    "LLMCall": "agentloop.types",
    "Reward": "agentloop.types",
    "ToolCall": "agentloop.types",
    "Log": "agentloop.types",
    "ErrorInfo": "agentloop.types",
    "Triplet": "agentloop.types",
    "LLM": "agentloop.resources",
    "ProxyLLM": "agentloop.resources",
    "Resources": "agentloop.resources",
    "rollout": "agentloop.agent",
    "Agent": "agentloop.agent",
    "emit_reward": "agentloop.agent",
    "Runner": "agentloop.runner",
    "spans_to_triplets": "agentloop.adapter",
    "configure_logging": "agentloop.logging",
    "Store": "agentloop.store.base",
    "MemoryStore": "agentloop.store.memory",
    "SQLiteStore": "agentloop.store.sqlite",
    "StoreServer": "agentloop.store.server",
    "StoreClient": "agentloop.store.client",
    "InferenceEngine": "agentloop.engine.base",
    "SamplingParams": "agentloop.engine.base",
    "TokenOutput": "agentloop.engine.base",
    "load_engine": "agentloop.engine.factory",
    "Proxy": "agentloop.proxy",
    "openai_client": "agentloop.client",
    "async_openai_client": "agentloop.client",
    "function_tool": "agentloop.tools",
    "BaseTool": "agentloop.tools",
    "ToolResponse": "agentloop.tools",
    "ToolAgent": "agentloop.tools.agent",
    "judge_reward": "agentloop.judge",
    "RewardJudge": "agentloop.judge",
}


# submodules reached as attributes (``al.harness.run(...)``), imported on first use
_SUBMODULES = ("harness", "sandbox")


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"agentloop.{name}")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'agentloop' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
