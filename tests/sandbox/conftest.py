"""Every sandbox test needs a Python for the sandbox's launcher; where none is usable, they skip."""

from __future__ import annotations

import pytest

from tests.sandbox.helpers import NO_LAUNCHER


@pytest.fixture(autouse=True)
def _launcher_python() -> None:
    if NO_LAUNCHER is not None:
        pytest.skip(f"no sandbox can start here: {NO_LAUNCHER}")
