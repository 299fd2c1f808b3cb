"""``openai_client()`` / ``async_openai_client()``: an ``openai`` client for the current rollout attempt.

Inside a rollout (an ``@al.rollout`` function or ``al.Agent`` run by ``al.Runner``) the client points
at the attempt's proxy URL, so agent code needs no URL handling; outside one, pass the LLM.

Both set ``max_retries=0`` (openai's default is 2): the proxy records every call it answers, so a
retry of a call that timed out on the client's side would add a second training sample for one
turn. Pass ``max_retries=`` to choose otherwise.
"""

from __future__ import annotations

from typing import Any

import openai

from agentloop.context import current_rollout, get_rollout_context
from agentloop.errors import RolloutContextError
from agentloop.resources import LLM, ProxyLLM


def _resolve(llm: LLM | ProxyLLM | None, what: str) -> LLM:
    if llm is None:
        ctx = get_rollout_context(what)
        if ctx.llm is None:
            raise RolloutContextError(
                f"{what}: the rollout's resources hold no LLM; add an LLM or ProxyLLM (proxy.as_resource(model)) "
                "with store.add_resources, or pass llm="
            )
        return ctx.llm
    if isinstance(llm, LLM):
        return llm
    if isinstance(llm, ProxyLLM):
        current = current_rollout.get()
        if current is None:
            raise RolloutContextError(
                f"{what} got a ProxyLLM outside a rollout; its URL needs a rollout and attempt id: "
                "pass llm.resolve(rollout) or a plain al.LLM"
            )
        return llm.resolve(current.rollout)
    raise TypeError(f"{what}: llm must be an al.LLM, al.ProxyLLM or None, got {type(llm).__name__}")


def openai_client(llm: LLM | ProxyLLM | None = None, **kwargs: Any) -> openai.OpenAI:
    """A sync ``openai.OpenAI`` for this attempt (or ``llm``); ``kwargs`` go to the client (timeout, ...)."""
    resolved = _resolve(llm, "al.openai_client()")
    kwargs.setdefault("max_retries", 0)  # a retry would record a second sample (module docstring)
    return openai.OpenAI(base_url=resolved.base_url, api_key=resolved.api_key, **kwargs)


def async_openai_client(llm: LLM | ProxyLLM | None = None, **kwargs: Any) -> openai.AsyncOpenAI:
    """An ``openai.AsyncOpenAI`` for this attempt (or ``llm``); ``kwargs`` go to the client.

    Use it as ``async with al.async_openai_client() as client:``: a client left open holds its
    connection (a socket on each side) until garbage collection."""
    resolved = _resolve(llm, "al.async_openai_client()")
    kwargs.setdefault("max_retries", 0)  # a retry would record a second sample (module docstring)
    return openai.AsyncOpenAI(base_url=resolved.base_url, api_key=resolved.api_key, **kwargs)
