"""agentloop: an async agent-loop SDK with an embedded RL trainer that keeps exact token ids.

Public names are imported lazily (``import agentloop`` stays cheap: torch, fastapi and the
store backends load on first use). ``__all__`` is the public API and is checked against
DESIGN.md by a test.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # data model
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
    # agents and runner
    "rollout": "agentloop.agent",
    "Agent": "agentloop.agent",
    "emit_reward": "agentloop.agent",
    "Runner": "agentloop.runner",
    "spans_to_triplets": "agentloop.adapter",
    "configure_logging": "agentloop.logging",
    # store
    "Store": "agentloop.store.base",
    "MemoryStore": "agentloop.store.memory",
    "SQLiteStore": "agentloop.store.sqlite",
    "StoreServer": "agentloop.store.http",
    "StoreClient": "agentloop.store.http",
    # engine and proxy
    "InferenceEngine": "agentloop.engine.base",
    "SamplingParams": "agentloop.engine.base",
    "TokenOutput": "agentloop.engine.base",
    "load_engine": "agentloop.engine.models",
    "Proxy": "agentloop.proxy",
    "openai_client": "agentloop.client",
    "async_openai_client": "agentloop.client",
    # tools
    "function_tool": "agentloop.tools",
    "BaseTool": "agentloop.tools",
    "ToolResponse": "agentloop.tools",
    "ToolAgent": "agentloop.tools.agent",
    # errors
    "AgentLoopError": "agentloop.errors",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'agentloop' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:  # let type checkers and IDEs see the real names
    from agentloop.agent import Agent, emit_reward, rollout  # noqa: F401
    from agentloop.resources import LLM, ProxyLLM, Resources  # noqa: F401
    from agentloop.runner import Runner  # noqa: F401
    from agentloop.types import RolloutConfig, Triplet  # noqa: F401
