"""TorchEngine shortens the GIL switch interval so its thread gets the GIL back quickly."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from agentloop.engine.torch._thread_settings import GIL_SWITCH_INTERVAL_S, shorten_gil_switch_interval


@pytest.fixture
def restore_interval() -> Iterator[None]:
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


def test_the_default_interval_is_shortened(restore_interval: None) -> None:
    sys.setswitchinterval(0.005)  # CPython's default
    shorten_gil_switch_interval()
    assert sys.getswitchinterval() == pytest.approx(GIL_SWITCH_INTERVAL_S)


def test_a_shorter_interval_is_kept(restore_interval: None) -> None:
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S / 2)
    shorten_gil_switch_interval()
    assert sys.getswitchinterval() == pytest.approx(GIL_SWITCH_INTERVAL_S / 2)
