"""Every limit, on both backends: a fork bomb, a memory hog, an endless loop with children, a flood
of output, a disk filler, an oversized file, a CPU burner. Real processes, small limits."""

from __future__ import annotations

import signal
import time

import anyio
import pytest

from agentloop.sandbox import Limits, Sandbox
from tests.sandbox.helpers import FAST, PYTHON, config, needs_bwrap, running_with

BACKENDS = [pytest.param("bwrap", marks=needs_bwrap), "subprocess"]
SLEEP = {"bwrap": "1001.1", "subprocess": "1001.2"}  # sleep lengths that mark a test's processes

FORK_UNTIL_REFUSED = """
import os, time
n = 0
try:
    for _ in range(10000):
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        n += 1
except OSError as exc:
    print("refused", n, exc.errno)
"""


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_fork_loop_stops_at_the_process_limit_and_leaves_nothing(backend: str) -> None:
    limits = FAST.model_copy(update={"processes": 24})
    marker = f"fork-marker-{backend}"  # distinct per test: pytest-xdist runs them side by side
    async with Sandbox.open(config=config(backend, limits=limits)) as sb:
        result = await sb.run([PYTHON, "-c", FORK_UNTIL_REFUSED, marker])
    assert result.exit_code == 0, result
    words = result.stdout.split()
    assert words[0] == "refused" and words[2] == str(11), result.stdout  # EAGAIN
    # bwrap: the sandbox's own processes count (bwrap's init and the launcher too); subprocess: the
    # count the user had at the start is added, and that user's other processes may end meanwhile
    assert 0 < int(words[1]) < (24 if backend == "bwrap" else 40), result.stdout
    # the sleeping children were killed when the command exited
    assert running_with(marker) == []


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_shell_fork_bomb_is_bounded_and_killed_at_the_deadline(backend: str) -> None:
    limits = FAST.model_copy(update={"processes": 32})
    async with Sandbox.open(config=config(backend, limits=limits)) as sb:
        start = time.monotonic()
        # exec: the main process needs no fork of its own to wait for the deadline
        result = await sb.run(
            f"bomb() {{ bomb | bomb & }}; bomb; exec sleep {SLEEP[backend]}4", timeout_s=1.5
        )
        elapsed = time.monotonic() - start
        after = await sb.run("echo alive")  # the sandbox still works; the bomb is gone
    assert result.timed_out and result.limit_hit == "timeout", result
    assert elapsed < 8, elapsed  # 1.5 s, then the kill (2 cores under a bomb: slow but bounded)
    assert after.ok and after.stdout == "alive\n", after
    assert running_with(f"{SLEEP[backend]}4") == []


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_memory_hog_fails_to_allocate(backend: str) -> None:
    limits = FAST.model_copy(update={"memory_mb": 256})
    async with Sandbox.open(config=config(backend, limits=limits)) as sb:
        hog = await sb.run([PYTHON, "-c", "x = bytearray(1 << 30); print('allocated')"])
        fits = await sb.run([PYTHON, "-c", "x = bytearray(32 << 20); print('allocated')"])
    assert hog.exit_code != 0 and "MemoryError" in hog.stderr and "allocated" not in hog.stdout
    assert fits.ok and fits.stdout == "allocated\n"


@pytest.mark.parametrize("backend", BACKENDS)
async def test_the_deadline_kills_the_whole_tree(backend: str) -> None:
    # children in the background, one in a session of its own, and the shell spinning
    marker = SLEEP[backend] + "1"
    script = f"sleep {marker} & setsid sleep {marker} & (sleep {marker} &) ; while :; do :; done"
    async with Sandbox.open(config=config(backend)) as sb:
        start = time.monotonic()
        result = await sb.run(script, timeout_s=1)
        elapsed = time.monotonic() - start
    assert result.timed_out and result.limit_hit == "timeout" and not result.ok
    assert result.signal == signal.SIGKILL and result.exit_code == 128 + signal.SIGKILL
    assert 1 <= elapsed < 5, elapsed
    assert running_with(marker) == []


@pytest.mark.parametrize("backend", BACKENDS)
async def test_background_processes_die_when_the_command_exits(backend: str) -> None:
    async with Sandbox.open(config=config(backend)) as sb:
        result = await sb.run(f"setsid sleep {SLEEP[backend]}2 > /dev/null 2>&1 & echo started")
    assert result.ok and result.stdout == "started\n"
    assert running_with(f"{SLEEP[backend]}2") == []


@pytest.mark.parametrize("backend", BACKENDS)
async def test_cancelling_a_run_kills_its_tree(backend: str) -> None:
    async with Sandbox.open(config=config(backend)) as sb:
        with anyio.move_on_after(0.5):
            await sb.run(f"sleep {SLEEP[backend]}3 & sleep {SLEEP[backend]}3")
    assert running_with(f"{SLEEP[backend]}3") == []


@pytest.mark.parametrize("backend", BACKENDS)
async def test_huge_output_is_cut_counted_and_said(backend: str) -> None:
    limits = FAST.model_copy(update={"output_bytes": 1000})
    async with Sandbox.open(config=config(backend, limits=limits)) as sb:
        result = await sb.run("head -c 5000000 /dev/zero | tr '\\0' a; echo tail >&2")
    assert result.ok and result.truncated and result.stdout_truncated and not result.stderr_truncated
    assert result.stdout_bytes == 5_000_000 and result.stderr == "tail\n"
    kept, note = result.stdout[:1000], result.stdout[1000:]
    assert kept == "a" * 1000
    assert "truncated" in note and "5000000" in note


@pytest.mark.parametrize("backend", BACKENDS)
async def test_the_disk_quota_kills_a_filler(backend: str) -> None:
    limits = FAST.model_copy(update={"disk_mb": 4, "disk_poll_s": 0.1})
    async with Sandbox.open(config=config(backend, limits=limits)) as sb:
        start = time.monotonic()
        result = await sb.run("while :; do head -c 500000 /dev/zero >> fill; sleep 0.02; done", timeout_s=8)
        elapsed = time.monotonic() - start
        burst = await sb.run("rm fill; head -c 6000000 /dev/zero > burst")  # may end before a poll
    assert result.limit_hit == "disk" and not result.timed_out and elapsed < 5, (result, elapsed)
    assert result.usage.workspace_bytes is not None and result.usage.workspace_bytes > 4 << 20
    assert burst.limit_hit == "disk"  # by a poll, or else by the check after the run


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_file_over_file_mb_is_stopped(backend: str) -> None:
    limits = FAST.model_copy(update={"file_mb": 1})
    async with Sandbox.open(config=config(backend, limits=limits)) as sb:
        result = await sb.run("head -c 2000000 /dev/zero > big")
        size = len(await sb.read_file("big"))
        python = await sb.run([PYTHON, "-c", "open('big', 'wb').write(bytes(2 << 20))"])
    assert result.limit_hit == "file_size" and result.exit_code == 128 + signal.SIGXFSZ, result
    assert size == 1 << 20
    # Python ignores SIGXFSZ: the write fails instead, and the program decides
    assert python.exit_code == 1 and "File too large" in python.stderr and python.limit_hit is None


@pytest.mark.parametrize("backend", BACKENDS)
async def test_cpu_seconds_are_bounded(backend: str) -> None:
    limits = Limits(cpu_s=1, timeout_s=20)
    async with Sandbox.open(config=config(backend, limits=limits)) as sb:
        result = await sb.run([PYTHON, "-c", "while True: pass"])
    assert result.limit_hit == "cpu_time" and result.signal == signal.SIGXCPU and not result.timed_out
    used = (result.usage.cpu_user_s or 0) + (result.usage.cpu_system_s or 0)
    assert used >= 0.8, result.usage  # RLIMIT_CPU counts both, in scheduler ticks
