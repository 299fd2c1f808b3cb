"""The event loops agentloop creates: uvloop where it is installed, else asyncio's own.

agentloop's servers (proxy, store server) run in their caller's event loop, so a program that makes
its own loop chooses it. The loops agentloop makes itself (``Trainer.fit``, which hosts the proxy while
training, ``Runner.run_sync``, ``agentloop serve`` and ``agentloop runner``, the proxy benchmarks) go through ``run``, which picks uvloop when it can be imported: the proxy's
event-loop CPU per call in a burst of 128 is lower on it (benchmarks/results/proxy_cpu_profile.json).

``AGENTLOOP_UVLOOP=0`` (or false / no / off) turns it off, for an A/B or to rule it out while
debugging; Windows has no uvloop, so the dependency is for Linux and macOS only.

Traps: uvloop is an asyncio loop (``asyncio.get_running_loop()`` works, anyio's asyncio backend
runs on it), but code that reaches into asyncio's private transport attributes does not see them on
uvloop's transports, and uvloop swallows a KeyboardInterrupt raised inside a protocol callback
(``run`` puts it back, see ``_reraise_interrupts``). Short one-shot commands (``inspect``, ``sft``'s store read) keep anyio's
default: importing uvloop costs more than it saves there.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, TypeVarTuple, Unpack

import anyio

__all__ = ["UVLOOP_ENV", "call_soon_from_thread", "loop_name", "request_stop", "run", "uvloop_wanted"]

T = TypeVar("T")
Ts = TypeVarTuple("Ts")
UVLOOP_ENV = "AGENTLOOP_UVLOOP"  # "0", "false", "no" or "off": asyncio's own loop even with uvloop installed
_OFF = frozenset({"0", "false", "no", "off"})
# the loops ``run`` is running now (innermost last), each with the cancel scope around its function
_running: list[tuple[asyncio.AbstractEventLoop, anyio.CancelScope]] = []


def uvloop_wanted(use_uvloop: bool | None = None) -> bool:
    """Whether ``run`` would use uvloop: ``use_uvloop`` when given, else unless ``$AGENTLOOP_UVLOOP``
    turns it off; and in either case only where uvloop can be imported."""
    if use_uvloop is None:
        use_uvloop = os.environ.get(UVLOOP_ENV, "").strip().lower() not in _OFF
    return use_uvloop and importlib.util.find_spec("uvloop") is not None


def loop_name(use_uvloop: bool | None = None) -> str:
    """What ``run`` would run on, for benchmark records: "uvloop 0.23.0" or "asyncio"."""
    if not uvloop_wanted(use_uvloop):
        return "asyncio"
    import uvloop

    return f"uvloop {uvloop.__version__}"


def run(func: Callable[[Unpack[Ts]], Awaitable[T]], *args: *Ts, use_uvloop: bool | None = None) -> T:
    """``anyio.run(func, *args)`` on the asyncio backend, on a uvloop loop when ``uvloop_wanted``
    (there with interrupts that stop the loop, see ``_reraise_interrupts``). :func:`request_stop`
    cancels ``func``; once its ``finally`` blocks have run, ``run`` raises KeyboardInterrupt."""
    if not uvloop_wanted(use_uvloop):
        return anyio.run(_stoppable, func, *args, backend="asyncio")
    return anyio.run(_interruptible, func, *args, backend="asyncio", backend_options={"use_uvloop": True})


def request_stop() -> bool:
    """Cancel the function the innermost :func:`run` is running, from a signal handler (or any
    thread); False when no ``run`` is running. The CLI's Ctrl-C/SIGTERM handler calls it instead of
    raising KeyboardInterrupt wherever Python happens to be: an interrupt in the middle of a lock, a
    thread hand-off or a library's cleanup could leave that half done (``agentloop serve --train`` once
    hung on SIGTERM), where a cancellation reaches the code only at its awaits."""
    if not _running:
        return False
    loop, scope = _running[-1]
    loop.call_soon_threadsafe(scope.cancel)
    return True


def call_soon_from_thread(
    loop: asyncio.AbstractEventLoop, callback: Callable[[Unpack[Ts]], object], *args: *Ts
) -> bool:
    """``loop.call_soon_threadsafe(callback, *args)`` from a worker thread (the engine's, the SQLite
    store's) answering a caller on ``loop``; False, and nothing done, when that loop has already closed
    (its program stopped with calls in flight): nobody is left to answer, and the thread goes on."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        if not loop.is_closed():
            raise
        return False
    return True


async def _stoppable(func: Callable[[Unpack[Ts]], Awaitable[T]], *args: *Ts) -> T:
    entry = (asyncio.get_running_loop(), anyio.CancelScope())
    _running.append(entry)
    try:
        with entry[1]:
            return await func(*args)
    finally:
        _running.remove(entry)
    raise KeyboardInterrupt  # cancelled by request_stop (only then does the scope swallow it)


async def _interruptible(func: Callable[[Unpack[Ts]], Awaitable[T]], *args: *Ts) -> T:
    asyncio.get_running_loop().set_exception_handler(_reraise_interrupts)
    return await _stoppable(func, *args)


def _reraise_interrupts(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """A KeyboardInterrupt or SystemExit raised inside a transport's protocol callback (a signal
    handler that raises, as the CLI's does, runs wherever Python happens to be: uvicorn's
    ``eof_received`` when a client has just closed) is re-raised from a callback of its own.

    asyncio's loop lets such an exception through and stops; uvloop hands it to the exception handler,
    which logs it (or, with logging silenced, nothing), and the program runs on: ``agentloop serve``
    ignored Ctrl-C about one time in four in tests/commands/test_serve_keys.py. Raised from a plain
    callback it stops uvloop's loop as it stops asyncio's."""
    exc = context.get("exception")
    if isinstance(exc, KeyboardInterrupt | SystemExit):
        loop.call_soon(_raise, exc)
    else:
        loop.default_exception_handler(context)


def _raise(exc: BaseException) -> None:
    raise exc
