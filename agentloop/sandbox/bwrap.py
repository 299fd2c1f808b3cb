"""The bubblewrap backend: each command runs in fresh Linux namespaces (user, mount, pid, network,
ipc, uts, cgroup) that see a read-only system, the workspace and nothing else of the host.

What a sandboxed command sees::

    /usr, /bin, /lib*, /sbin      the host's, read-only
    /etc                          ld.so, alternatives, certificates, timezone (read-only); passwd,
                                  group and hosts made for the sandbox (user ``sandbox``, uid 1000)
    /workspace                    the workspace, writable; HOME is /workspace/.home
    /tmp, /dev/shm                private tmpfs of limits.tmp_mb each
    /proc, /dev                   its own pid namespace; a minimal /dev
    /run/agentloop/               the launcher, the loopback relay sockets (read-only)
    ro_binds, Python's prefix     read-only at their host paths
    everything else (/home, /root, /tmp of the host, other workspaces)   absent

The rest of the root is read-only; capabilities are dropped and no_new_privs set (bubblewrap).
Not isolated: the kernel itself (no seccomp filter: a kernel bug is an escape), CPU and memory
bandwidth (rlimits bound amounts per process, not rates), and what ro_binds lend.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path

import anyio

from agentloop.sandbox._files import Source
from agentloop.sandbox._host import HostWorkspace, launcher_python, run_as
from agentloop.sandbox._supervise import Launch
from agentloop.sandbox.config import SandboxConfig
from agentloop.sandbox.errors import SandboxUnavailableError

__all__ = ["BwrapBackend", "bwrap_problem"]

WORKDIR = "/workspace"
INSIDE_UID = 1000  # the sandbox's own uid and gid; the host's user is mapped to it
LAUNCHER = "/run/agentloop/launcher.py"
RELAY = "/run/agentloop/relay"
# /etc entries lent read-only (those missing here are skipped): the dynamic linker's cache, Debian's
# alternatives (/usr/bin/node may point there), public certificates, timezone, name-service order.
ETC_LENT = (
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/alternatives",
    "/etc/localtime",
    "/etc/nsswitch.conf",
    "/etc/ssl/certs",
    "/etc/ssl/openssl.cnf",
    "/etc/ca-certificates",
    "/etc/pki",
    "/etc/protocols",
    "/etc/services",
    "/etc/mime.types",
    "/etc/os-release",
)
ETC_HOST_NETWORK = ("/etc/resolv.conf", "/etc/hosts", "/etc/gai.conf")  # network='host' only


def _system_binds() -> list[str]:
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):  # merged-/usr systems: /bin -> usr/bin
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    return args


def bwrap_args(
    bwrap: str,
    *,
    config: SandboxConfig,
    base: Path | None,
    workspace: Path | None,
    python_dir: Path | None,
    relay: Path | None,
    chdir: str,
) -> list[str]:
    """bubblewrap's arguments up to the command (the caller appends ``--`` and it). ``base`` holds
    etc/ and launcher.py; the probe passes None for it and for the workspace."""
    tmp = str(config.limits.tmp_mb << 20)
    args = [bwrap, "--unshare-all", "--unshare-user", "--uid", str(INSIDE_UID), "--gid", str(INSIDE_UID)]
    args += ["--hostname", "sandbox", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    if config.network == "host":
        args += ["--share-net"]
    args += _system_binds()
    for entry in ETC_LENT + (ETC_HOST_NETWORK if config.network == "host" else ()):
        args += ["--ro-bind-try", entry, entry]
    if base is not None:
        for name in ("passwd", "group") + (("hosts",) if config.network == "none" else ()):
            args += ["--ro-bind", str(base / "etc" / name), f"/etc/{name}"]
    args += ["--proc", "/proc", "--dev", "/dev"]
    args += ["--size", tmp, "--tmpfs", "/dev/shm", "--size", tmp, "--tmpfs", "/tmp"]
    if workspace is not None:
        args += ["--bind", str(workspace), WORKDIR]
    if base is not None:
        args += ["--ro-bind", str(base / "launcher.py"), LAUNCHER]
    if relay is not None:
        args += ["--ro-bind", str(relay), RELAY]
    if python_dir is not None:
        args += ["--ro-bind", str(python_dir), str(python_dir)]
    for path in config.ro_binds:
        args += ["--ro-bind", str(path), str(path)]
    args += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", chdir]
    return args


@functools.cache  # a fact about this machine and this user; probing costs a process start
def _probe(bwrap: str, uid: int | None, python: str, python_dir: Path | None) -> str | None:
    args = bwrap_args(
        bwrap, config=SandboxConfig(), base=None, workspace=None, python_dir=python_dir, relay=None, chdir="/"
    )
    try:
        done = subprocess.run(
            [*args, "--", python, "-I", "-S", "-c", "import json, resource, socket, threading"],
            capture_output=True,
            timeout=30,
            user=uid,
            group=uid,
            extra_groups=[] if uid is not None else None,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        who = f" as uid {uid}" if uid is not None else ""
        return f"{bwrap} could not run{who}: {exc}"
    if done.returncode != 0:
        message = done.stderr.decode(errors="replace").strip()[:500]
        problem = f"{bwrap} failed (exit {done.returncode}): {message}"
        if "uid map" in message.lower() or "namespace" in message.lower():
            problem += (
                " (user namespaces are off: sysctl kernel.unprivileged_userns_clone=1; Ubuntu 24.04: "
                "bwrap's apparmor profile; in a container: --security-opt seccomp=unconfined or --privileged)"
            )
        return problem
    return None


def bwrap_problem(config: SandboxConfig | None = None, bwrap: str | None = None) -> str | None:
    """Why bubblewrap cannot sandbox here (a sentence with the fix), or None when it can. Blocking:
    the first call per user and interpreter runs bwrap once."""
    config = config or SandboxConfig()
    found = bwrap or shutil.which("bwrap")
    if found is None:
        return "bubblewrap is not installed (Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install bubblewrap)"
    try:
        python, python_dir = launcher_python(config)
    except SandboxUnavailableError as exc:
        return str(exc)
    return _probe(found, run_as(config), python, python_dir)


class BwrapWorkspace(HostWorkspace):
    isolation = "bwrap"
    workdir = WORKDIR

    def __init__(self, config: SandboxConfig, base: Path, bwrap: str) -> None:
        super().__init__(config, base)
        self.bwrap = bwrap

    def _prepare(self, source: Source) -> None:
        super()._prepare(source)
        etc = self.base / "etc"
        etc.mkdir(mode=0o755)
        home = f"{WORKDIR}/{self.config.home}"
        (etc / "passwd").write_text(
            f"root:x:0:0:root:/root:/bin/sh\nsandbox:x:{INSIDE_UID}:{INSIDE_UID}:sandbox:{home}:/bin/sh\n"
            "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
        )
        (etc / "group").write_text(f"root:x:0:\nsandbox:x:{INSIDE_UID}:\nnogroup:x:65534:\n")
        (etc / "hosts").write_text("127.0.0.1\tlocalhost sandbox\n::1\tlocalhost ip6-localhost\n")
        for name in ("passwd", "group", "hosts"):
            os.chmod(etc / name, 0o644)

    def relay_dir(self) -> Path | None:
        if self.config.network != "none" or not self.config.loopback_ports:
            return None
        return self.base / f"relay-{next(self._runs)}"

    def launch(
        self, argv: list[str], env: dict[str, str], cwd: str, status_fd: int, relay: Path | None
    ) -> Launch:
        inside = WORKDIR if cwd == "." else f"{WORKDIR}/{cwd}"
        ports = [[p, f"{RELAY}/{p}.sock"] for p in self.config.loopback_ports] if relay else []
        args = bwrap_args(
            self.bwrap,
            config=self.config,
            base=self.base,
            workspace=self.root,
            python_dir=self.python_dir,
            relay=relay,
            chdir=WORKDIR,
        )
        spec = self.spec(argv, inside, status_fd, relay=ports)
        return Launch(
            argv=[*args, "--", self.python, "-I", "-S", "-B", LAUNCHER, spec],
            env=self.environment(env, "/tmp"),
            cwd=str(self.base),
            user=self.owner.uid,
            kill="namespace",
            isolation=self.isolation,
        )


class BwrapBackend:
    """Workspaces on this host, commands in bubblewrap. ``bwrap``: its path (default: on PATH)."""

    name = "bwrap"

    def __init__(self, bwrap: str | None = None) -> None:
        self.bwrap = bwrap

    async def create(self, source: Source, config: SandboxConfig) -> BwrapWorkspace:
        problem = await anyio.to_thread.run_sync(bwrap_problem, config, self.bwrap)
        if problem is not None:
            raise SandboxUnavailableError(f"the bwrap backend cannot run here: {problem}")
        bwrap = self.bwrap or shutil.which("bwrap")
        assert bwrap is not None  # bwrap_problem said so
        return await BwrapWorkspace.make(source, config, bwrap=bwrap)
