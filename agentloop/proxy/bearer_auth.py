"""Who may use the per-attempt routes: the proxy's key, or that attempt's own key (``BearerAuth``)."""

from __future__ import annotations

import hmac

from pydantic import SecretStr
from starlette.requests import Request

from agentloop.proxy.attempt_keys import attempt_key
from agentloop.proxy.schemas import ProxyError


class BearerAuth:
    """Checks ``Authorization: Bearer <key>`` (or ``X-Api-Key: <key>``, which the anthropic client
    sends) in constant time. Holds the key where a traceback that prints local variables cannot show
    it (its repr names no key)."""

    __slots__ = ("_expected", "_key")

    def __init__(self, key: SecretStr | str | None) -> None:
        secret = key.get_secret_value() if isinstance(key, SecretStr) else key
        self._expected = f"Bearer {secret}".encode() if secret else None
        self._key = secret.encode() if secret else None

    @property
    def required(self) -> bool:
        return self._expected is not None

    def allows(self, request: Request) -> bool:
        """The proxy's key, or on a per-attempt route that attempt's own key (attempt_keys.py)."""
        if self._expected is None or self._key is None:
            return True
        api_key = request.headers.get("x-api-key")
        if api_key is not None and "authorization" not in request.headers:
            got = b"Bearer " + api_key.encode()
        else:
            got = request.headers.get("authorization", "").encode()
        if hmac.compare_digest(got, self._expected):
            return True
        rid, aid = request.path_params.get("rollout_id"), request.path_params.get("attempt_id")
        if not rid or not aid:
            return False
        return hmac.compare_digest(got, b"Bearer " + attempt_key(self._key.decode(), rid, aid).encode())

    def __repr__(self) -> str:
        return f"BearerAuth(required={self.required})"


def unauthorized() -> ProxyError:
    return ProxyError(401, "missing or wrong bearer token (Authorization: Bearer <api_key>, or "
                      "X-Api-Key: <api_key>)", "authentication_error", code="invalid_api_key")  # fmt: skip
