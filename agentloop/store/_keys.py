"""Store keys and roles: one admin key (the trainer) and runner keys (one per runner).

A runner key is either given (``runner_keys={"gpu-node-1": key}``) or derived from the admin key with
``runner_key(admin_key, name)``: a server holding the admin key recognises it without a list, and
nobody without the admin key can forge one. Keys are compared in constant time and never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import SecretStr

from agentloop.errors import InvalidRequestError

Key = str | SecretStr


_RUNNER_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_DERIVED_PREFIX = "runner."


def plain_key(key: Key | None, what: str) -> str | None:
    """The key as a string (None for None or ""); a key with spaces or control characters is refused."""
    value = key.get_secret_value() if isinstance(key, SecretStr) else key
    if value is None or value == "":
        return None
    if not isinstance(value, str) or value != value.strip() or not value.isprintable():
        raise InvalidRequestError(f"{what} must be a printable string without surrounding spaces")
    return value


def check_runner_name(name: object) -> str:
    if not isinstance(name, str) or not _RUNNER_NAME.fullmatch(name):
        raise InvalidRequestError(f"a runner name takes 1-64 letters, digits, '_' or '-', got {name!r:.80}")
    return name


def _mac(admin_key: str, name: str) -> str:
    msg = b"agentloop store runner key\0" + name.encode()
    return hmac.new(admin_key.encode(), msg, hashlib.sha256).hexdigest()


def runner_key(admin_key: Key, name: str) -> str:
    """The key of runner ``name``, derived from the admin key: a StoreServer holding ``admin_key``
    accepts it as that runner without being told, and nobody without the admin key can make one.
    Hand one to each runner (``agentloop runner --api-key``); never hand out the admin key."""
    key = plain_key(admin_key, "admin_key")
    if key is None:
        raise InvalidRequestError("runner_key needs the admin key it is derived from, got an empty key")
    name = check_runner_name(name)
    return f"{_DERIVED_PREFIX}{name}.{_mac(key, name)}"


@dataclass(frozen=True)
class Who:
    """Who sent a request: the admin (runner None) or the runner of that name."""

    runner: str | None


ADMIN = Who(None)


class Keys:
    """The keys one server accepts. No key at all: every request is the admin's (a loopback server)."""

    def __init__(self, admin_key: Key | None, runner_keys: Mapping[str, Key] | None) -> None:
        self.admin = plain_key(admin_key, "admin_key")
        runners: list[tuple[bytes, Who]] = []
        seen = {self.admin} if self.admin else set()
        if runner_keys is not None and not isinstance(runner_keys, Mapping):
            raise InvalidRequestError(
                f"runner_keys maps runner names to keys ({{'gpu-node-1': key}}), got {type(runner_keys).__name__}"
            )
        for name, given in (runner_keys or {}).items():
            secret = plain_key(given, f"runner_keys[{name!r}]")
            if secret is None:
                raise InvalidRequestError(f"runner_keys[{name!r}] is empty; give every runner a key")
            if secret in seen:
                raise InvalidRequestError(
                    f"runner_keys[{name!r}] repeats another key (the admin key or another runner's); "
                    "every role needs its own key"
                )
            seen.add(secret)
            runners.append((f"Bearer {secret}".encode(), Who(check_runner_name(name))))
        self.runners = runners
        self.expected_admin = f"Bearer {self.admin}".encode() if self.admin else None
        self.open = self.admin is None and not runners

    def who(self, authorization: bytes | None) -> Who | None:
        """The sender of a request with this Authorization header; None: no valid key."""
        if self.open:
            return ADMIN
        got = authorization or b""
        if self.expected_admin is not None and hmac.compare_digest(got, self.expected_admin):
            return ADMIN
        for expected, who in self.runners:
            if hmac.compare_digest(got, expected):
                return who
        prefix = b"Bearer " + _DERIVED_PREFIX.encode()
        if self.admin is not None and got.startswith(prefix):
            raw_name, _, mac = got[len(prefix) :].partition(b".")
            name = raw_name.decode("latin-1")
            if _RUNNER_NAME.fullmatch(name) and hmac.compare_digest(mac, _mac(self.admin, name).encode()):
                return Who(name)
        return None


def admin_key_of(api_key: Key | None, admin_key: Key | None) -> Key | None:
    """``api_key`` (the one key of before roles) is the admin key; both given must agree."""
    if (
        api_key is not None
        and admin_key is not None
        and plain_key(api_key, "api_key") != plain_key(admin_key, "admin_key")
    ):
        raise InvalidRequestError("api_key and admin_key name the same (admin) key; pass only admin_key")
    return admin_key if admin_key is not None else api_key


def owner_of(worker_id: str | None) -> str | None:
    """The runner that dequeued an attempt, from its stored worker_id (``name/...``)."""
    return worker_id.split("/", 1)[0] if worker_id else None
