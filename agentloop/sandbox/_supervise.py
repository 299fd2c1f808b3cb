"""Run one launcher process from the host without blocking the event loop: feed stdin, keep the
first bytes of stdout and stderr, measure the workspace while it runs, kill the whole tree at the
deadline, and turn what came back into a ``RunResult``.

Traps:

- Output is drained to the end, not left in the pipe: a command that prints 50 MB of logs and then
  works on must not block on a full pipe. What passes ``output_bytes`` is counted and dropped (the
  CPU cost is one read per 64 KiB, bounded by the deadline).
- A process that escaped the tree could hold the pipes open after the launcher exits; reading
  stops two seconds after the exit instead of waiting for an EOF that never comes.
- Cancellation from outside (a rollout's own timeout) kills the tree too, under a shielded scope.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import anyio
from anyio.abc import ByteReceiveStream, ByteSendStream, Process

from agentloop.sandbox._files import disk_usage
from agentloop.sandbox.config import Limits
from agentloop.sandbox.errors import SandboxError
from agentloop.sandbox.result import LimitHit, ResourceUsage, RunResult

__all__ = ["KillHow", "Launch", "supervise"]

EXIT_GRACE_S = (
    2.0  # after the launcher exits, how long the pipes may stay open; after SIGTERM, how long to die
)


# How a launch's tree dies. "launcher": SIGTERM to the launcher, which SIGKILLs its descendants and
# reports. "namespace": SIGKILL to the child of the process (bwrap's pid 1 in the sandbox): the kernel
# kills everything in the pid namespace before pid 1 is reaped, and bwrap exits after it, so waiting
# for bwrap waits for the whole sandbox (SIGKILL to bwrap itself would return before the namespace
# is empty). Either way the process group and the process are SIGKILLed last.
KillHow = Literal["launcher", "namespace"]


@dataclass(frozen=True)
class Launch:
    """One host process to start: the launcher, directly or inside bubblewrap."""

    argv: list[str]
    env: dict[str, str]
    cwd: str
    user: int | None  # setuid/setgid to it before exec (agentloop runs as root), or None
    kill: KillHow
    isolation: str


class _Capture:
    """The first ``cap`` bytes of a stream and the count of all of them."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.kept = bytearray()
        self.total = 0
        self.done = anyio.Event()

    async def drain(self, stream: ByteReceiveStream) -> None:
        try:
            async for chunk in stream:
                self.total += len(chunk)
                room = self.cap - len(self.kept)
                if room > 0:
                    self.kept += chunk[:room]
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass
        finally:
            self.done.set()

    @property
    def truncated(self) -> bool:
        return self.total > self.cap

    def text(self, name: str) -> str:
        text = self.kept.decode("utf-8", "replace")
        if self.truncated:
            text += (
                f"\n[agentloop.sandbox: {name} truncated: kept the first {self.cap} of {self.total} bytes]\n"
            )
        return text


async def _feed(stream: ByteSendStream, data: bytes) -> None:
    try:
        if data:
            await stream.send(data)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
        pass  # the command exited or closed stdin without reading it all: its choice
    finally:
        await stream.aclose()


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(child) for child in f.read().split()]
    except (OSError, ValueError):
        return []


async def _kill(proc: Process, how: KillHow) -> None:
    """Kill a launch's whole tree and wait for it (see ``Launch.kill``)."""
    if proc.returncode is None:
        if how == "launcher":
            try:
                proc.terminate()  # the launcher SIGKILLs every descendant, reports, exits
            except ProcessLookupError:
                pass
            waits = True
        else:  # pid 1 of bwrap's namespace: the kernel empties the namespace before it is reaped
            waits = False
            for child in _children(proc.pid):
                try:
                    os.kill(child, signal.SIGKILL)
                    waits = True
                except ProcessLookupError:
                    pass
        if waits:
            with anyio.move_on_after(EXIT_GRACE_S):
                await proc.wait()
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the group outlives its leader while members remain
    except (ProcessLookupError, PermissionError):
        pass
    if proc.returncode is None:
        try:
            proc.kill()
        except ProcessLookupError:
            pass
        await proc.wait()


async def _watch_disk(root: Path, quota: int, poll_s: float, exceeded: Callable[[int], None]) -> None:
    while True:
        await anyio.sleep(poll_s)
        used = await anyio.to_thread.run_sync(disk_usage, root, abandon_on_cancel=True)
        if used > quota:
            exceeded(used)
            return


def _read_status(fd: int) -> dict[str, object]:
    """The launcher's report, or {} when it is missing or malformed (killed first, or forged)."""
    os.set_blocking(fd, False)
    data = b""
    try:
        while len(data) < 65536:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            data += chunk
    except BlockingIOError:  # a process that escaped still holds the write end: take what came
        pass
    try:
        report = json.loads(data) if data else {}
    except ValueError:
        return {}
    return report if isinstance(report, dict) else {}


def _number(report: dict[str, object], key: str) -> float | None:
    value = report.get(key)
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
        return float(value)
    return None


# Starts ``argv[2:]`` as uid ``argv[1]``: what the stdlib's user/group/extra_groups do, for uvloop
_DROP_TO = (
    "import os, sys; u = int(sys.argv[1]); os.setgroups([]); os.setgid(u); os.setuid(u); "
    "os.execvp(sys.argv[2], sys.argv[2:])"
)


def _as_user(argv: list[str], uid: int | None) -> tuple[list[str], dict[str, object]]:
    """The command line and keywords that start the launcher as ``uid`` (None: as ourselves): the
    stdlib's ``user``, ``group`` and ``extra_groups``. uvloop's ``subprocess_exec`` refuses those
    ("unexpected kwargs: user, group, extra_groups"; the trainer's loop is uvloop) and anyio passes no
    ``preexec_fn``, so under uvloop a short Python drops to ``uid`` the same way (supplementary
    groups cleared, then gid, then uid) and execs the launcher; the status pipe stays inherited."""
    if uid is None:
        return argv, {}
    import asyncio

    try:
        uvloop = type(asyncio.get_running_loop()).__module__.startswith("uvloop")
    except RuntimeError:  # not on an asyncio loop (trio): the stdlib's keywords
        uvloop = False
    if uvloop:
        return [sys.executable, "-I", "-S", "-c", _DROP_TO, str(uid), *argv], {}
    return argv, {"user": uid, "group": uid, "extra_groups": []}


async def supervise(
    launch: Launch,
    *,
    status: tuple[int, int],
    stdin: bytes | None,
    timeout_s: float,
    limits: Limits,
    workspace: Path,
) -> RunResult:
    """Start ``launch``, run it to its end or its deadline, and report. ``status`` is the (read,
    write) pipe whose write end the launcher's spec names; this closes both."""
    read_fd, write_fd = status
    out, err = _Capture(limits.output_bytes), _Capture(limits.output_bytes)
    hit: list[LimitHit] = []
    start = time.monotonic()
    try:
        proc = await _start(launch, stdin, write_fd)
        try:
            await _run_to_end(proc, launch, stdin, out, err, hit, timeout_s, limits, workspace)
        finally:
            with anyio.CancelScope(shield=True):
                if proc.returncode is None:
                    await _kill(proc, launch.kill)
                await proc.aclose()
        wall_s = time.monotonic() - start
        report = _read_status(read_fd)
    finally:
        os.close(read_fd)
    used = await anyio.to_thread.run_sync(disk_usage, workspace)
    if used > limits.disk_mb << 20 and not hit:
        hit.append("disk")
    return _result(launch, proc, report, out, err, hit, wall_s, used)


async def _start(launch: Launch, stdin: bytes | None, write_fd: int) -> Process:
    """The launcher's process, with the status pipe's write end passed on (and closed here)."""
    try:
        argv, as_user = _as_user(launch.argv, launch.user)
        return await anyio.open_process(
            argv,
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=launch.cwd,
            env=launch.env,
            start_new_session=True,  # its own process group: killpg reaches what the launcher missed
            pass_fds=(write_fd,),
            **as_user,  # type: ignore[arg-type]
        )
    except OSError as exc:
        raise SandboxError(f"cannot start the sandbox launcher {launch.argv[0]!r}: {exc}") from exc
    finally:
        os.close(write_fd)


async def _run_to_end(
    proc: Process,
    launch: Launch,
    stdin: bytes | None,
    out: _Capture,
    err: _Capture,
    hit: list[LimitHit],
    timeout_s: float,
    limits: Limits,
    workspace: Path,
) -> None:
    """Feed ``stdin``, drain the output and watch the disk until ``proc`` exits; at the deadline or
    over the disk quota (appended to ``hit``), kill its tree."""
    async with anyio.create_task_group() as tg:
        assert proc.stdout is not None and proc.stderr is not None
        tg.start_soon(out.drain, proc.stdout)
        tg.start_soon(err.drain, proc.stderr)
        if stdin is not None:
            assert proc.stdin is not None
            tg.start_soon(_feed, proc.stdin, stdin)

        deadline = anyio.move_on_after(timeout_s)

        def over_quota(used: int) -> None:
            hit.append("disk")
            deadline.cancel()

        tg.start_soon(_watch_disk, workspace, limits.disk_mb << 20, limits.disk_poll_s, over_quota)
        with deadline:
            await proc.wait()
        if deadline.cancelled_caught and not hit:
            hit.append("timeout")
        if hit:
            await _kill(proc, launch.kill)
        with anyio.move_on_after(EXIT_GRACE_S):
            await out.done.wait()
            await err.done.wait()
        tg.cancel_scope.cancel()


def _result(
    launch: Launch,
    proc: Process,
    report: dict[str, object],
    out: _Capture,
    err: _Capture,
    hit: list[LimitHit],
    wall_s: float,
    used: int,
) -> RunResult:
    code = report.get("exit_code")
    sig = report.get("signal")
    if not isinstance(code, int) or isinstance(code, bool) or not 0 <= code <= 255:
        returncode = proc.returncode if proc.returncode is not None else -signal.SIGKILL
        code = 128 - returncode if returncode < 0 else returncode
        sig = -returncode if returncode < 0 else None
    if not isinstance(sig, int) or isinstance(sig, bool) or not 0 < sig < 128:
        sig = None
    if hit and hit[0] == "timeout":
        sig = sig or signal.SIGKILL
    limit: LimitHit | None = hit[0] if hit else None
    through = sig if sig is not None else (code - 128 if code > 128 else None)  # a shell reports 128+N
    if limit is None and through == signal.SIGXCPU:
        limit = "cpu_time"
    elif limit is None and through == signal.SIGXFSZ:
        limit = "file_size"
    max_rss = _number(report, "max_rss_kb")
    return RunResult(
        exit_code=code,
        signal=sig,
        stdout=out.text("stdout"),
        stderr=err.text("stderr"),
        stdout_bytes=out.total,
        stderr_bytes=err.total,
        stdout_truncated=out.truncated,
        stderr_truncated=err.truncated,
        timed_out=limit == "timeout",
        limit_hit=limit,
        usage=ResourceUsage(
            wall_s=wall_s,
            cpu_user_s=_number(report, "cpu_user_s"),
            cpu_system_s=_number(report, "cpu_system_s"),
            max_rss_kb=int(max_rss) if max_rss is not None else None,
            workspace_bytes=used,
        ),
        isolation=launch.isolation,
    )
