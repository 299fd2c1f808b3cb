"""agentloop.event_loop: the loops agentloop creates run on uvloop where it is installed, else asyncio's."""

from __future__ import annotations

import asyncio
import importlib.util
import signal
import subprocess
import sys
import threading
import time

import anyio
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


async def _hold_a_lock_until_stopped(events: list[str]) -> None:
    """A command's shape: work under a lock whose release the interrupt must not skip, then cleanup."""
    lock = threading.Lock()
    try:
        while True:
            with lock:  # an interrupt raised here (the old handler's way) would leave this half done
                events.append("work")
                await anyio.to_thread.run_sync(time.sleep, 0.01)
    except anyio.get_cancelled_exc_class():
        events.append(f"cancelled, lock free: {not lock.locked()}")
        raise
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.sleep(0.05)  # async cleanup still runs (serve closes its proxy, engine, store)
            events.append("cleaned up")


@pytest.mark.parametrize(
    "use_uvloop", [False, pytest.param(True, marks=pytest.mark.skipif(not HAVE_UVLOOP, reason="no uvloop"))]
)
def test_request_stop_cancels_at_an_await_then_interrupts(use_uvloop: bool) -> None:
    """A stop request (the CLI's Ctrl-C/SIGTERM handler) cancels the function where it awaits, its cleanup
    runs to the end, and only then does ``run`` raise KeyboardInterrupt; with no loop running it is refused."""
    events: list[str] = []
    assert event_loop.request_stop() is False
    timer = threading.Timer(0.3, event_loop.request_stop)
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        event_loop.run(_hold_a_lock_until_stopped, events, use_uvloop=use_uvloop)
    assert events[-2:] == ["cancelled, lock free: True", "cleaned up"] and "work" in events
    assert event_loop.request_stop() is False  # the finished loop is forgotten


def test_a_signal_stops_a_command_through_its_loop() -> None:
    """The CLI's handler, on SIGTERM, cancels the running loop's command at an await (its synchronous
    stretches finish) instead of raising KeyboardInterrupt in the middle of one; cleanup then runs and
    the CLI's one line says what stopped it."""
    code = (
        "import os, signal, sys, threading, time, anyio\n"
        "from agentloop import cli, event_loop\n"
        "async def main():\n"
        "    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()\n"
        "    try:\n"
        "        while True:\n"
        "            end = time.monotonic() + 0.2\n"
        "            while time.monotonic() < end:  # a synchronous stretch: where the signal lands\n"
        "                pass\n"
        "            await anyio.sleep(0)\n"
        "    except BaseException as exc:\n"
        "        print('stopped with', type(exc).__name__, flush=True)\n"
        "        raise\n"
        "    finally:\n"
        "        with anyio.CancelScope(shield=True):\n"
        "            await anyio.sleep(0.1)\n"
        "            print('cleaned up', flush=True)\n"
        "def command(args):\n"
        "    event_loop.run(main)\n"
        "    return 0\n"
        "args = cli.build_parser().parse_args(['inspect', '.'])\n"
        "args.func = command\n"
        "cli.build_parser = lambda: type('P', (), {'parse_args': lambda self, argv: args})()\n"
        "sys.exit(cli.main([]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert done.stdout == "stopped with CancelledError\ncleaned up\n"  # not KeyboardInterrupt mid-stretch
    assert done.stderr.endswith("agentloop inspect: stopped by SIGTERM\n"), done.stderr


def test_call_soon_from_thread_answers_an_open_loop_and_skips_a_closed_one() -> None:
    """A worker thread's answer reaches an open loop; to a closed one it returns False (the caller is
    gone) instead of raising "Event loop is closed" in the worker thread."""
    import asyncio
    import threading

    from agentloop.event_loop import call_soon_from_thread

    async def answered() -> int:
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        loop = asyncio.get_running_loop()
        sent: list[bool] = []
        worker = threading.Thread(target=lambda: sent.append(call_soon_from_thread(loop, fut.set_result, 7)))
        worker.start()
        value = await fut
        worker.join()
        assert sent == [True]
        return value

    assert asyncio.run(answered()) == 7
    closed = asyncio.new_event_loop()
    closed.close()
    assert call_soon_from_thread(closed, print, "never") is False
