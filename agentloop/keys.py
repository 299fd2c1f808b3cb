"""Keys (bearer tokens) from places where they stay secret: an environment variable or a file.

A key on a command line is visible to every user of the machine (``ps``), and one in a config lands
in run folders and W&B. So a key is named by reference and read where it is used::

    env:AGENTLOOP_STORE_API_KEY     the value of that environment variable
    file:/run/secrets/store.key     the content of that file (surrounding whitespace stripped)
    anything else                   the key itself (tests, or a value already read)

Keys are ``pydantic.SecretStr`` once read: printed, logged or dumped they show ``**********``; only
``get_secret_value()`` (at the HTTP header) shows the key. In a pydantic config use ``KeyRef``::

    store_api_key: KeyRef = Field(default=None, description="...")   # env:NAME, file:PATH or the key
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator, SecretStr

__all__ = ["KeyRef", "key_value", "read_key"]

ENV, FILE = "env:", "file:"
_MAX_KEY_BYTES = 4096  # an HTTP header line; a key file larger than this is not a key file


def read_key(ref: str | SecretStr | None, what: str = "key") -> SecretStr | None:
    """The key ``ref`` names (see the module docstring); None for None or "". ``what`` names the
    setting in errors (the errors never contain the key)."""
    if ref is None:
        return None
    if isinstance(ref, SecretStr):
        raw = ref.get_secret_value()
        return read_key(raw, what) if raw.startswith((ENV, FILE)) else (ref if raw else None)
    if not isinstance(ref, str):
        raise ValueError(
            f"{what} must be a string (env:NAME, file:PATH or the key), got {type(ref).__name__}"
        )
    if ref.startswith(ENV):
        name = ref[len(ENV) :]
        value = os.environ.get(name)
        if not value:
            raise ValueError(f"{what} names the environment variable {name!r}, which is not set or empty")
        return _checked(value.strip(), what, f"${name}")
    if ref.startswith(FILE):
        path = Path(ref[len(FILE) :]).expanduser()
        try:
            if path.stat().st_size > _MAX_KEY_BYTES:
                raise ValueError(
                    f"{what}: {path} has more than {_MAX_KEY_BYTES} bytes; a key file holds one key"
                )
            value = path.read_text().strip()
        except OSError as exc:
            raise ValueError(f"{what}: cannot read the key file {path}: {exc.strerror or exc}") from None
        if not value:
            raise ValueError(f"{what}: the key file {path} is empty")
        return _checked(value, what, str(path))
    return _checked(ref, what, "the value") if ref else None


def _checked(value: str, what: str, where: str) -> SecretStr:
    if any(c.isspace() or not c.isprintable() for c in value):
        raise ValueError(f"{what}: the key in {where} contains whitespace or control characters")
    return SecretStr(value)


def key_value(key: SecretStr | str | None) -> str | None:
    """The plain key for an HTTP header (None stays None)."""
    return key.get_secret_value() if isinstance(key, SecretStr) else key


def _validate_ref(value: Any) -> SecretStr | None:
    return read_key(value, "the value")


KeyRef = Annotated[SecretStr | None, BeforeValidator(_validate_ref)]
"""A config field holding a key: accepts ``env:NAME``, ``file:PATH`` or the key; holds a SecretStr."""
