"""The first process of every sandboxed run: a standalone script (stdlib only, Python 3.8+) that
``python -I -S _launcher.py SPEC`` starts inside bubblewrap, or on the host for the subprocess backend.

It is the sandbox's supervisor, not part of agentloop's import graph (it runs under an interpreter
that cannot see the package). SPEC is one JSON argument::

    {"argv": [...], "cwd": "/workspace", "rlimits": {"CPU": [soft, hard], ...},
     "nproc_user": false, "relay": [[port, "/run/agentloop/relay/port.sock"], ...],
     "status_fd": 3, "parent_death": false}

What it does, in order:

1. Becomes a child subreaper (``PR_SET_CHILD_SUBREAPER``): orphans of the command, daemons and
   double-forks included, are reparented to it, so it can reap and kill the whole tree.
2. Listens on ``127.0.0.1:port`` for each relay entry and forwards every connection to the Unix
   socket beside it, which the host relays to its own ``127.0.0.1:port`` (the rollout's proxy).
   In bubblewrap's fresh network namespace this loopback port is the only way out.
3. Forks the command; the child sets the rlimits, then execs. RLIMIT_NPROC is set here, after
   bubblewrap made the user namespace: the kernel then counts only the sandbox's processes against
   it (set before, the user's processes outside would count too). ``nproc_user`` (the subprocess
   backend, no namespace) adds the processes this user already runs, which the kernel counts.
4. Waits for the command, reaping every orphan meanwhile (zombies count against RLIMIT_NPROC);
   when it exits, or on SIGTERM (the host's deadline), SIGKILLs every descendant left.
5. Writes {"exit_code", "signal", "cpu_user_s", "cpu_system_s", "max_rss_kb"} to ``status_fd``
   (rusage of all reaped descendants) and exits with the command's code (128 + N for signal N).

The status is advisory: sandboxed code runs as the same user inside and could forge it. Nothing the
host decides for safety (deadline, output caps, disk quota) reads it.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import socket
import sys
import threading

_PR_SET_PDEATHSIG = 1
_PR_SET_DUMPABLE = 4
_PR_SET_CHILD_SUBREAPER = 36


class _Terminate(Exception):
    """Raised by the SIGTERM handler in the main thread: the host's deadline passed."""


def _on_sigterm(signum, frame):  # type: ignore[no-untyped-def]
    raise _Terminate()


def _prctl(option: int, arg: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(option, arg, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: no subreaper; the process group is killed instead
        pass


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def _serve_relay(listener: socket.socket, path: str) -> None:
    while True:
        try:
            client, _ = listener.accept()
        except OSError:
            return
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            upstream.connect(path)
        except OSError:
            client.close()
            upstream.close()
            continue
        try:
            threading.Thread(target=_pump, args=(client, upstream), daemon=True).start()
            threading.Thread(target=_pump, args=(upstream, client), daemon=True).start()
        except RuntimeError:  # no thread left (the sandbox spent its process limit): drop this one
            client.close()
            upstream.close()


def _start_relays(entries: list) -> list:  # type: ignore[type-arg]
    listeners = []
    for port, path in entries:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", int(port)))
        listener.listen(64)
        threading.Thread(target=_serve_relay, args=(listener, path), daemon=True).start()
        listeners.append(listener)
    return listeners


def _user_process_count() -> int:
    """Processes and threads of this real uid (what the kernel counts against RLIMIT_NPROC)."""
    uid, count = os.getuid(), 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                count += int(fields["Threads"].strip())
        except (OSError, KeyError, ValueError, IndexError):
            continue
    return count


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
            ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _reap_all() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _kill_tree() -> None:
    """SIGKILL every descendant, pass after pass: a fork bomb's children forked mid-pass come back to
    us (subreaper) and die in the next one."""
    for _ in range(100):
        pids = _descendants(os.getpid())
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        _reap_all()
    _reap_all()


def _child(spec: dict, extra_nproc: int) -> None:  # type: ignore[type-arg]
    try:
        for sig in (signal.SIGTERM, signal.SIGPIPE, signal.SIGXFSZ):  # Python ignores the last two;
            signal.signal(sig, signal.SIG_DFL)  # an ignored signal stays ignored across exec
        try:
            os.chdir(spec["cwd"])
        except OSError as exc:
            sys.stderr.write(f"agentloop.sandbox: cannot enter {spec['cwd']!r}: {exc.strerror}\n")
            sys.stderr.flush()
            os._exit(126)
        for name, (soft, hard) in spec["rlimits"].items():
            if name == "NPROC":
                soft, hard = soft + extra_nproc, hard + extra_nproc
            resource.setrlimit(getattr(resource, "RLIMIT_" + name), (soft, hard))
        argv = spec["argv"]
        os.execvp(argv[0], argv)
    except OSError as exc:
        sys.stderr.write(f"agentloop.sandbox: cannot run {spec['argv'][0]!r}: {exc.strerror}\n")
        sys.stderr.flush()
        os._exit(127 if isinstance(exc, FileNotFoundError) else 126)
    except BaseException as exc:
        sys.stderr.write(f"agentloop.sandbox: cannot start the command: {exc!r}\n")
        sys.stderr.flush()
        os._exit(126)


def main() -> None:
    spec = json.loads(sys.argv[1])
    status_fd = spec.get("status_fd")
    if status_fd is not None:
        os.set_inheritable(status_fd, False)  # the command must not hold it
    if spec.get("parent_death"):  # subprocess backend: the host process dying is a deadline too
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    # Not dumpable: the command (same uid) cannot ptrace this process or open its /proc/PID/fd (the
    # status pipe). The command's own exec makes it dumpable again.
    _prctl(_PR_SET_DUMPABLE, 0)
    signal.signal(signal.SIGTERM, _on_sigterm)
    _start_relays(spec.get("relay", []))
    extra = _user_process_count() if spec.get("nproc_user") else 0

    status = None
    pid = os.fork()
    if pid == 0:
        _child(spec, extra)
    try:
        while status is None:  # reap orphans too: zombies count against the process limit
            reaped, code = os.waitpid(-1, 0)
            if reaped == pid:
                status = code
    except _Terminate:
        pass
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _kill_tree()
    if status is None:  # SIGTERM: the main child was killed by _kill_tree and reaped there
        status = signal.SIGKILL
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    code = 128 + sig if sig is not None else os.WEXITSTATUS(status)
    report = {
        "exit_code": code,
        "signal": sig,
        "cpu_user_s": usage.ru_utime,
        "cpu_system_s": usage.ru_stime,
        "max_rss_kb": usage.ru_maxrss,
    }
    if status_fd is not None:
        try:
            os.write(status_fd, json.dumps(report).encode())
        except OSError:
            pass
    os._exit(code)


if __name__ == "__main__":
    main()
