"""Command tests call ``agentloop.cli.main`` in-process, and main configures logging for the whole
process (onto the stderr that pytest captured for that test): put the session's configuration back."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import structlog

from agentloop import logging as al_logging


@pytest.fixture(autouse=True)
def _restore_structlog() -> Iterator[None]:
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)
    al_logging._configured = None
