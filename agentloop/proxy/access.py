"""Who may use a proxy's app-facing routes, and what a web page cannot do with them.

The app-facing routes are the session routes (``/v1/...``, ``/v1/sessions...``) and the admin routes
of ``agentloop serve --train`` (``/v1/admin/...``). The per-attempt routes (``/rollout/.../v1``) are
the trainer's and keep their own key (bearer_auth.py).

Keys (``AppKeys``):

- an **app key** uses the model and owns the sessions it creates: it lists, reads, extends and
  rewards those only; another app key's session answers 404, as an unknown one does. A session
  records its owner as a fingerprint of the key (``owner_id``: a hash, never the key).
- the **admin key** also sees and rewards every session, and is the only key the admin routes take
  (versions, rollback); without one the admin routes are off (403).
- no app key (loopback only): every local client is the one anonymous app (owner ``""``).

A web page (``check_browser``, ``check_json``): a page the user visits can send requests to a
loopback server, and with DNS rebinding read the answers. So on a server bound to loopback a
request must name a loopback host (``Host``: ``localhost``, ``*.localhost``, a loopback address, or
the bound host, never a name resolved through DNS), a browser's request must come from the server's
own origin (``Origin``, ``Sec-Fetch-Site``), and a POST must be ``Content-Type: application/json``
(a page sends ``text/plain`` without asking the server first; ``application/json`` needs a CORS
preflight, which this server never grants). Each refusal is a 4xx with an OpenAI-style body.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from pydantic import SecretStr
from starlette.requests import Request

from agentloop.http_limits import is_loopback
from agentloop.proxy.schemas import ProxyError

__all__ = ["AppKeys", "Caller", "check_browser", "check_json", "owner_id"]

ANONYMOUS = ""  # the owner of sessions made without a key (loopback only)


def owner_id(key: SecretStr | str) -> str:
    """The owner a key's sessions record: a fingerprint of the key, not the key (it is saved in the
    store; 128 bits of SHA-256 name a key without revealing it)."""
    raw = key.get_secret_value() if isinstance(key, SecretStr) else key
    return "key-" + hashlib.sha256(b"agentloop session owner\0" + raw.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Caller:
    """Who made a request: the owner its sessions get, and whether it holds the admin key."""

    owner: str
    admin: bool = False

    def may_use(self, session_owner: str) -> bool:
        """True when this caller may read, extend or reward a session owned by ``session_owner``."""
        return self.admin or hmac.compare_digest(self.owner, session_owner)


def _plain(key: SecretStr | str | None) -> str | None:
    raw = key.get_secret_value() if isinstance(key, SecretStr) else key
    return raw or None


class AppKeys:
    """The app keys and the admin key of the app-facing routes (module docstring). Compares in
    constant time; its repr names no key."""

    __slots__ = ("_admin", "_apps")

    def __init__(self, app_keys: Sequence[SecretStr | str | None], admin_key: SecretStr | str | None) -> None:
        apps = [k for k in (_plain(k) for k in app_keys) if k is not None]
        self._apps = [(k.encode(), owner_id(k)) for k in dict.fromkeys(apps)]
        admin = _plain(admin_key)
        if admin is not None and admin in apps:
            raise ValueError("the admin key must differ from every app key (else that app is the admin)")
        self._admin = (admin.encode(), owner_id(admin)) if admin is not None else None

    @property
    def required(self) -> bool:
        """True when the session routes need a key (an app key, or the admin key)."""
        return bool(self._apps)

    @property
    def admin_on(self) -> bool:
        """True when an admin key is set (the admin routes are on)."""
        return self._admin is not None

    @staticmethod
    def _presented(request: Request) -> bytes | None:
        # ``Authorization: Bearer KEY``, or ``X-Api-Key: KEY`` (what the anthropic client sends)
        auth = request.headers.get("authorization")
        if auth is None:
            api_key = request.headers.get("x-api-key")
            return api_key.encode() if api_key is not None else None
        scheme, _, value = auth.partition(" ")
        return value.strip().encode() if scheme.lower() == "bearer" else None

    def caller(self, request: Request) -> Caller | None:
        """The request's caller; None when it carries no key the routes accept (then 401)."""
        presented = self._presented(request)
        if presented is not None and self._admin is not None:
            if hmac.compare_digest(presented, self._admin[0]):
                return Caller(self._admin[1], admin=True)
        if not self._apps:
            return Caller(ANONYMOUS)
        found = None
        for key, owner in self._apps:  # every key compared: the time does not say which one matched
            if presented is not None and hmac.compare_digest(presented, key):
                found = owner
        return Caller(found) if found is not None else None

    def is_admin(self, request: Request) -> bool:
        presented = self._presented(request)
        return (
            self._admin is not None
            and presented is not None
            and hmac.compare_digest(presented, self._admin[0])
        )

    def __repr__(self) -> str:
        return f"AppKeys(app_keys={len(self._apps)}, admin={self.admin_on})"


def _host_name(value: str) -> str:
    """The host of a ``Host`` header or an origin's netloc, without port or brackets, lower case."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def is_loopback_name(name: str, bound_host: str) -> bool:
    """True for ``localhost``, ``*.localhost``, a loopback address or the bound host: names that reach
    this machine without asking DNS (a DNS name can be made to point at 127.0.0.1: DNS rebinding)."""
    name = name.rstrip(".")
    if name == "localhost" or name.endswith(".localhost") or name == bound_host.strip("[]").lower():
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def check_browser(request: Request, bound_host: str | None) -> None:
    """On a server bound to loopback: 403 for a ``Host`` that is not a loopback name (DNS rebinding)
    and for a browser's request from another origin (``Origin``, ``Sec-Fetch-Site``). Nothing to
    check off loopback (a key is required there) or with ``bound_host`` None."""
    if bound_host is None or not is_loopback(bound_host):
        return
    host = request.headers.get("host")
    if host is not None and not is_loopback_name(_host_name(host), bound_host):
        raise ProxyError(
            403,
            f"Host {host[:80]!r} is not this server's: a server on {bound_host} answers only to "
            "localhost, a loopback address or its bound host (a DNS name pointed at it is refused)",
            "permission_error",
            code="forbidden_host",
        )
    origin = request.headers.get("origin")
    if origin is not None:
        parts = urlsplit(origin)
        same = parts.scheme in ("http", "https") and host is not None and parts.netloc.lower() == host.lower()
        if not same:
            raise ProxyError(
                403,
                f"cross-origin request from {origin[:80]!r} refused: a web page may not call this server",
                "permission_error",
                code="cross_origin",
            )
    elif request.headers.get("sec-fetch-site", "none") not in ("same-origin", "none"):
        raise ProxyError(
            403,
            "cross-site request refused: a web page may not call this server",
            "permission_error",
            code="cross_origin",
        )


def check_json(request: Request) -> None:
    """415 for a POST whose body is not declared ``application/json``."""
    if request.method != "POST":
        return
    declared = request.headers.get("content-type", "")
    if declared.split(";", 1)[0].strip().lower() != "application/json":
        raise ProxyError(
            415,
            f"Content-Type must be application/json, got {declared[:60]!r}",
            "invalid_request_error",
            code="unsupported_media_type",
        )
