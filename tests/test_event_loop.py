"""agentloop.event_loop: the loops agentloop creates run on uvloop where it is installed, else asyncio's."""

from __future__ import annotations

import asyncio
import importlib.util
import sys

import pytest

from agentloop import event_loop

HAVE_UVLOOP = importlib.util.find_spec("uvloop") is not None


async def _loop_module(x: int) -> tuple[str, int]:
    return type(asyncio.get_running_loop()).__module__, x


@pytest.mark.skipif(not HAVE_UVLOOP, reason="uvloop is not installed (Windows, or installed without it)")
def test_run_is_on_uvloop_where_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(event_loop.UVLOOP_ENV, raising=False)
    module, x = event_loop.run(_loop_module, 7)
    assert module.startswith("uvloop") and x == 7
    assert event_loop.loop_name().startswith("uvloop ")


@pytest.mark.parametrize("off", ["0", "false", "No", " off "])
def test_the_environment_turns_it_off(monkeypatch: pytest.MonkeyPatch, off: str) -> None:
    monkeypatch.setenv(event_loop.UVLOOP_ENV, off)
    assert not event_loop.uvloop_wanted()
    assert event_loop.run(_loop_module, 1)[0].startswith("asyncio")
    assert event_loop.loop_name() == "asyncio"
    if HAVE_UVLOOP:  # an explicit argument wins over the environment
        assert event_loop.uvloop_wanted(True)


def test_use_uvloop_false_is_asyncio(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(event_loop.UVLOOP_ENV, raising=False)
    assert event_loop.run(_loop_module, 2, use_uvloop=False)[0].startswith("asyncio")


def test_without_uvloop_it_is_asyncio(monkeypatch: pytest.MonkeyPatch) -> None:
    """uvloop not importable (Windows): even an explicit ``use_uvloop=True`` runs on asyncio's loop."""
    monkeypatch.setitem(sys.modules, "uvloop", None)  # None in sys.modules: find_spec None, import fails
    assert not event_loop.uvloop_wanted(True)
    assert event_loop.run(_loop_module, 3, use_uvloop=True)[0].startswith("asyncio")
    assert event_loop.loop_name(True) == "asyncio"


class _InterruptOnEof(asyncio.Protocol):
    def eof_received(self) -> None:
        raise KeyboardInterrupt  # as a signal handler that raises would, running at this moment


async def _serve_until_interrupted() -> str:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_InterruptOnEof, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write_eof()
    await asyncio.sleep(5)  # the interrupt ends this sleep, as Ctrl-C ends `agentloop serve`
    return "the interrupt was swallowed"


@pytest.mark.parametrize(
    "use_uvloop", [False, pytest.param(True, marks=pytest.mark.skipif(not HAVE_UVLOOP, reason="no uvloop"))]
)
def test_an_interrupt_in_a_protocol_callback_stops_the_loop(use_uvloop: bool) -> None:
    """uvloop alone logs a KeyboardInterrupt raised in ``eof_received`` and runs on; ``run`` stops."""
    with pytest.raises(KeyboardInterrupt):
        event_loop.run(_serve_until_interrupted, use_uvloop=use_uvloop)
