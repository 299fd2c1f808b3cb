"""What bubblewrap isolates, checked from inside with real commands: the filesystem (writes land in
the workspace only; host files outside the binds are absent), the environment, the network (only
the lent loopback port leads out, relayed to a real server on the host), node-based CLIs."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import sys
from pathlib import Path

import anyio
import pytest
from anyio.abc import SocketStream

from agentloop.sandbox import Sandbox, SandboxConfig, loopback_port
from tests.sandbox.helpers import PYTHON, config, needs_bwrap

pytestmark = needs_bwrap


async def test_writes_land_in_the_workspace_and_nowhere_else(tmp_path: Path) -> None:
    marker = f"agentloop-sandbox-test-{os.getpid()}"
    async with Sandbox.open(config=config()) as sb:
        result = await sb.run(
            f"echo made > /workspace/inside.txt && mkdir -p deep/er && echo x > deep/er/f; "
            f"for p in /usr/{marker} /etc/{marker} /{marker} /dev/{marker} /run/agentloop/{marker}; do "
            f"  touch $p 2>/dev/null && echo WROTE $p; done; "
            f"echo private > /tmp/{marker} && cat /tmp/{marker}; echo shm > /dev/shm/{marker}"
        )
        inside = await sb.read_file("inside.txt")
        deep = await sb.read_file("/workspace/deep/er/f")
    assert result.ok, result
    assert "WROTE" not in result.stdout
    assert result.stdout == "private\n"
    assert inside == b"made\n" and deep == b"x\n"
    assert not Path(f"/tmp/{marker}").exists() and not Path(f"/dev/shm/{marker}").exists()


async def test_host_files_outside_the_binds_are_absent(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2")
    secret.chmod(0o644)
    async with Sandbox.open(config=config()) as sb:
        result = await sb.run(
            f"cat {secret}; ls {tmp_path}; ls /root /home /var /opt /sys 2>&1 | head -5; "
            "cat /etc/shadow; grep -c . /etc/passwd; ls /proc | grep -c '^[0-9]'"
        )
    assert "hunter2" not in result.stdout + result.stderr
    assert f"{secret}: No such file or directory" in result.stderr
    lines = result.stdout.splitlines()
    assert lines[-2] == "3", "the sandbox's own passwd (root, sandbox, nobody), not the host's"
    assert int(lines[-1]) <= 5, "its own pid namespace: bwrap, the launcher, sh, ls, grep"


async def test_the_host_environment_is_not_inherited(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTLOOP_TEST_SECRET", "s3cret")
    async with Sandbox.open(config=config(env={"FROM_CONFIG": "c"})) as sb:
        result = await sb.run("env | sort", env={"FROM_RUN": "r"}, stdin="ignored")
    env = dict(line.split("=", 1) for line in result.stdout.splitlines())
    assert "AGENTLOOP_TEST_SECRET" not in env
    assert env["FROM_CONFIG"] == "c" and env["FROM_RUN"] == "r"
    assert env["HOME"] == "/workspace/.home" and env["WORKSPACE"] == "/workspace" and env["TMPDIR"] == "/tmp"


async def test_stdin_reaches_the_command() -> None:
    async with Sandbox.open(config=config()) as sb:
        result = await sb.run("wc -c", stdin=b"x" * 200_000)  # more than a pipe buffer
    assert result.ok and result.stdout.strip() == "200000"


async def _serve(listener: anyio.abc.Listener[SocketStream], payload: bytes) -> None:
    async def answer(stream: SocketStream) -> None:
        async with stream:
            try:
                request = await stream.receive()
                await stream.send(request.upper() + b"|" + payload)
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                pass  # a client that only checked it could connect

    await listener.serve(answer)


REACH = """
import hashlib, socket, sys
proxy, other, outside = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
s = socket.create_connection(("127.0.0.1", proxy), timeout=5)
s.sendall(b"ping")
data = b""
while True:
    chunk = s.recv(65536)
    if not chunk:
        break
    data += chunk
head, _, body = data.partition(b"|")
print("proxy", head.decode(), len(body), hashlib.sha256(body).hexdigest())
for host, port in (("127.0.0.1", other), (outside, other), ("1.1.1.1", 443)):
    try:
        socket.create_connection((host, port), timeout=2)
        print("reached", host, port)
    except OSError as exc:
        print("blocked", host, exc.errno)
"""


def _host_address() -> str:
    """A non-loopback address of this host (the route to the internet), or 10.255.255.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("1.1.1.1", 53))  # UDP connect sends nothing
            return str(probe.getsockname()[0])
        except OSError:
            return "10.255.255.1"


async def test_only_the_lent_loopback_port_is_reachable() -> None:
    payload = os.urandom(3 << 20)  # several MiB through the relay, both directions checked
    async with (
        await anyio.create_tcp_listener(local_host="127.0.0.1") as proxy,
        await anyio.create_tcp_listener(local_host="0.0.0.0") as other,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(_serve, proxy, payload)
        tg.start_soon(_serve, other, b"other")
        proxy_port = proxy.extra(anyio.abc.SocketAttribute.local_port)
        other_port = other.extra(anyio.abc.SocketAttribute.local_port)
        url = f"http://127.0.0.1:{proxy_port}/rollout/r/attempt/a/v1"
        cfg = config(loopback_ports=(loopback_port(url),))
        async with Sandbox.open(config=cfg) as sb:
            script = [PYTHON, "-c", REACH, str(proxy_port), str(other_port), _host_address()]
            first = await sb.run(script)
            second = await sb.run(script)  # a second run gets a fresh relay
        tg.cancel_scope.cancel()
    for result in (first, second):
        lines = result.stdout.splitlines()
        assert lines[0] == f"proxy PING {len(payload)} {hashlib.sha256(payload).hexdigest()}", result
        assert [line.split()[0] for line in lines[1:]] == ["blocked"] * 3, result.stdout


async def test_host_network_shares_everything() -> None:
    async with (
        await anyio.create_tcp_listener(local_host="127.0.0.1") as other,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(_serve, other, b"x")
        port = other.extra(anyio.abc.SocketAttribute.local_port)
        async with Sandbox.open(config=config(network="host")) as sb:
            code = (
                f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=5); print('reached')"
            )
            result = await sb.run([PYTHON, "-c", code])
        tg.cancel_scope.cancel()
    assert result.stdout == "reached\n", result


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
async def test_node_clis_run_with_a_writable_home() -> None:
    cfg = SandboxConfig(backend="bwrap").with_node()
    script = (
        "const fs = require('fs'), os = require('os');"
        "fs.mkdirSync(os.homedir() + '/.config/cli', {recursive: true});"
        "fs.writeFileSync(os.homedir() + '/.config/cli/settings.json', '{}');"
        "console.log(os.homedir(), process.version.startsWith('v'))"
    )
    async with Sandbox.open(config=cfg) as sb:
        result = await sb.run(["node", "-e", script])
        settings = await sb.read_file(".home/.config/cli/settings.json")
        npm = await sb.run("npm --version") if shutil.which("npm") else None
    assert result.ok and result.stdout == "/workspace/.home true\n", result
    assert settings == b"{}"
    if npm is not None:
        assert npm.ok, npm


def test_with_node_lends_an_install_outside_usr(tmp_path: Path) -> None:
    prefix = tmp_path / "node-v99"
    (prefix / "bin").mkdir(parents=True)
    (prefix / "lib" / "node_modules").mkdir(parents=True)
    node = prefix / "bin" / "node"
    node.write_text("#!/bin/sh\n")
    node.chmod(0o755)
    cfg = SandboxConfig().with_node(str(node))
    assert cfg.ro_binds == (prefix,) and cfg.path == (str(prefix / "bin"),)
    assert cfg.with_node(str(node)) == cfg  # idempotent
    assert sys.executable  # keeps the import used when node is missing
