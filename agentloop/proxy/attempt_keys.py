"""Per-attempt proxy credentials: each dequeued attempt gets a key that opens its own proxy route only.

The proxy's key (the trainer makes one per run) would open every attempt's route, so it is never handed
to an agent nor stored. Instead each attempt's key is derived from it::

    attempt_key(proxy_key, rollout_id, attempt_id) = "attempt." + HMAC-SHA256(proxy_key, rollout_id \\0 attempt_id)

The proxy recomputes it from the path of a per-attempt route (``/rollout/{rid}/attempt/{aid}/v1/...``),
so one attempt's key cannot write into another attempt, and reading the resources gives no key at all.

``AttemptKeyStore(store, proxy)`` is the store the runners dequeue from: it delegates every call to
``store`` and, on ``dequeue_rollout``, puts the attempt's key into each ProxyLLM of this proxy in the
attempt's resources (what ``ProxyLLM.resolve`` hands the agent as ``llm.api_key``). The resources the
trainer stores carry ``PER_ATTEMPT`` instead of a key, so the proxy's key is not at rest in store.db.
A StoreServer over an AttemptKeyStore hands remote runners their attempts' keys the same way.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any, Protocol

from pydantic import SecretStr

from agentloop.resources import ProxyLLM, Resources
from agentloop.store.base import Store
from agentloop.types import AttemptedRollout

__all__ = ["PER_ATTEMPT", "AttemptKeyStore", "attempt_key"]

PER_ATTEMPT = "per-attempt"  # a stored ProxyLLM's api_key: the dequeuing store puts the attempt's key here
_PREFIX = "attempt."
_CONTEXT = b"agentloop proxy attempt key\0"


def attempt_key(proxy_key: SecretStr | str, rollout_id: str, attempt_id: str) -> str:
    """The key that opens attempt ``attempt_id`` of rollout ``rollout_id`` on the proxy keyed ``proxy_key``."""
    secret = proxy_key.get_secret_value() if isinstance(proxy_key, SecretStr) else proxy_key
    if not secret:
        raise ValueError("attempt_key needs the proxy's key, got an empty key")
    msg = _CONTEXT + rollout_id.encode() + b"\0" + attempt_id.encode()
    return _PREFIX + hmac.new(secret.encode(), msg, hashlib.sha256).hexdigest()


class _KeyedProxy(Protocol):
    @property
    def api_key(self) -> SecretStr | None: ...

    @property
    def url_template(self) -> str: ...


class AttemptKeyStore:
    """``store`` whose ``dequeue_rollout`` gives each attempt its own key for ``proxy`` (module docstring);
    every other call goes to ``store`` unchanged."""

    def __init__(self, store: Store, proxy: _KeyedProxy) -> None:
        self.store, self._proxy = store, proxy

    def __getattr__(self, name: str) -> Any:  # what a backend offers beyond the protocol
        return getattr(self.store, name)

    # the Store protocol, spelled out (a Protocol isinstance check does not see __getattr__ on 3.12+)
    async def enqueue_rollout(self, *args: Any, **kwargs: Any) -> Any:
        return await self.store.enqueue_rollout(*args, **kwargs)

    async def update_attempt(self, *args: Any, **kwargs: Any) -> Any:
        return await self.store.update_attempt(*args, **kwargs)

    async def add_span(self, span: Any) -> Any:
        return await self.store.add_span(span)

    async def query_spans(self, *args: Any, **kwargs: Any) -> Any:
        return await self.store.query_spans(*args, **kwargs)

    async def get_rollout(self, rollout_id: str) -> Any:
        return await self.store.get_rollout(rollout_id)

    async def get_attempt(self, rollout_id: str, attempt_id: str) -> Any:
        return await self.store.get_attempt(rollout_id, attempt_id)

    async def get_rollout_attempt(self, rollout_id: str, attempt_id: str) -> Any:
        return await self.store.get_rollout_attempt(rollout_id, attempt_id)

    async def list_attempts(self, rollout_id: str) -> Any:
        return await self.store.list_attempts(rollout_id)

    async def list_rollouts(self, *args: Any, **kwargs: Any) -> Any:
        return await self.store.list_rollouts(*args, **kwargs)

    async def cancel_rollout(self, rollout_id: str) -> Any:
        return await self.store.cancel_rollout(rollout_id)

    async def wait_for_rollouts(self, *args: Any, **kwargs: Any) -> Any:
        return await self.store.wait_for_rollouts(*args, **kwargs)

    async def add_resources(self, resources: Any) -> int:
        return await self.store.add_resources(resources)

    async def get_latest_resources(self) -> Any:
        return await self.store.get_latest_resources()

    async def get_resources(self, version: int) -> Any:
        return await self.store.get_resources(version)

    async def check_timeouts(self) -> Any:
        return await self.store.check_timeouts()

    async def close(self) -> None:
        await self.store.close()

    def __repr__(self) -> str:
        return f"AttemptKeyStore({self.store!r})"

    async def dequeue_rollout(self, worker_id: str | None = None) -> AttemptedRollout | None:
        attempted = await self.store.dequeue_rollout(worker_id)
        if attempted is None or attempted.resources is None:
            return attempted
        return attempted.model_copy(update={"resources": self.keyed(attempted)})

    def keyed(self, attempted: AttemptedRollout) -> Resources | None:
        """The attempt's resources with its key in each ProxyLLM that points at this proxy."""
        resources, key = attempted.resources, self._proxy.api_key
        if resources is None or key is None:
            return resources
        template = self._proxy.url_template
        items = {
            name: item.model_copy(
                update={"api_key": attempt_key(key, attempted.rollout_id, attempted.attempt.attempt_id)}
            )
            if isinstance(item, ProxyLLM) and item.serves(template)
            else item
            for name, item in resources.items.items()
        }
        return resources.model_copy(update={"items": items})
