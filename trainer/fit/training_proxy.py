"""The proxy a fit serves its agents through, and the served model as an LLM for a judge."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agentloop.store.base import Store
from trainer.config import TrainerConfig

if TYPE_CHECKING:
    from agentloop.proxy import Proxy


def training_proxy(cfg: TrainerConfig, engine: Any, store: Store, record_sessions: bool) -> Proxy:
    """The proxy a fit serves its agents through (not started)."""
    from secrets import token_urlsafe

    from agentloop.proxy import Proxy

    return Proxy(
        engine,
        store,
        host=cfg.placement.proxy_host,
        advertise_host=cfg.placement.proxy_advertise_host,
        # a key per run: agents get it as llm.api_key (ProxyLLM.api_key, remote runners through the
        # store's resources); no one else who can reach the port gets generations
        api_key=token_urlsafe(32),
        max_body_bytes=32 * 1024 * 1024,
        default_max_tokens=cfg.data.max_response_length,
        record_sessions=record_sessions,  # False with a judge: its calls (session route) are no app sessions
        workers=cfg.actor_rollout_ref.rollout.proxy_workers,
    )


def served_llm(proxy: Any) -> Any:
    """The served model on the proxy's session route (recorded as no rollout): what a judge without
    its own llm calls."""
    from agentloop.resources import LLM

    return LLM(base_url=proxy.session_base_url, model=proxy.model_name, api_key=proxy.as_resource().api_key)
