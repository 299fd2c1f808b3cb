"""``agentloop runner``: remote runner processes against a real StoreServer; a SIGKILLed runner loses
no rollout (the watchdog requeues its attempt and a second runner finishes it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from agentloop.agent import rollout
from agentloop.cli import main
from agentloop.commands.runner import load_object
from agentloop.store.memory import MemoryStore
from agentloop.store.server import StoreServer
from agentloop.types import AttemptedRollout, RolloutConfig, RolloutStatus

ROOT = Path(__file__).resolve().parents[2]


@rollout
async def hang_on_first_attempt(task: dict, llm: object, rollout: AttemptedRollout) -> float:
    """The first attempt hangs (its runner gets killed); a retry answers at once."""
    if rollout.attempt.sequence_id == 1:
        await anyio.sleep(3600)
    return float(task["value"])


def _runner(url: str, *extra: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "agentloop.cli", "runner", "--store", url, "--concurrency", "2", *extra]
    agent = "tests.commands.test_runner_cmd:hang_on_first_attempt"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [*cmd, "--agent", agent], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def test_bad_agent_spec_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["runner", "--store", "http://127.0.0.1:9", "--agent", "no_colon"]) == 2
    assert "--agent must look like module:object" in capsys.readouterr().err
    assert main(["runner", "--store", "http://127.0.0.1:9", "--agent", "os:not_there"]) == 2
    assert "has no attribute 'not_there'" in capsys.readouterr().err
    assert main(["runner", "--store", "ftp://x", "--agent", "os:path"]) == 2
    assert "url must start with http" in capsys.readouterr().err
    assert main(["runner", "--store", "http://x", "--agent", "os:path", "--concurrency", "0"]) == 2
    assert load_object("tests.commands.test_runner_cmd:hang_on_first_attempt") is hang_on_first_attempt


@pytest.mark.e2e
async def test_killed_runner_loses_no_rollout() -> None:
    store = MemoryStore()
    config = RolloutConfig(unresponsive_s=1.5, max_attempts=2)
    async with StoreServer(store) as server:
        r = await store.enqueue_rollout({"value": 1.0}, config=config)
        first = _runner(server.url)
        second = None
        try:
            with anyio.fail_after(40):
                while (await store.get_rollout(r.rollout_id)).status is not RolloutStatus.RUNNING:
                    assert first.poll() is None, first.communicate()[1].decode()[-2000:]
                    await anyio.sleep(0.1)
                first.send_signal(signal.SIGKILL)  # the runner machine dies mid-rollout
                await anyio.to_thread.run_sync(first.wait)
                second = _runner(server.url, "--max-rollouts", "1")
                done = await store.wait_for_rollouts([r.rollout_id], timeout=30)
                rc = await anyio.to_thread.run_sync(second.wait)
            assert rc == 0, second.communicate()[1].decode()[-2000:]
        finally:
            for proc in (first, second):
                if proc is not None and proc.poll() is None:
                    proc.kill()
                    proc.wait()
    assert done and done[0].status is RolloutStatus.SUCCEEDED
    attempts = await store.list_attempts(r.rollout_id)
    assert [a.status.value for a in attempts] == ["unresponsive", "succeeded"]


@pytest.mark.e2e
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
async def test_a_signal_stops_the_runner_with_one_line_and_its_exit_code(signum: signal.Signals) -> None:
    store = MemoryStore()
    async with StoreServer(store) as server:
        r = await store.enqueue_rollout({"value": 1.0}, config=RolloutConfig(max_attempts=1))
        proc = _runner(server.url)
        try:
            with anyio.fail_after(40):
                while (await store.get_rollout(r.rollout_id)).status is not RolloutStatus.RUNNING:
                    assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
                    await anyio.sleep(0.1)
                proc.send_signal(signum)
                _, err = await anyio.to_thread.run_sync(proc.communicate)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 128 + signum, err.decode()[-2000:]
        last = err.decode().strip().splitlines()[-1]
        assert (
            last
            == f"agentloop runner: stopped by {signum.name} (its unfinished attempts were reported as stopped)"
        )
        assert "Traceback" not in err.decode()
        assert (await store.get_rollout(r.rollout_id)).status is RolloutStatus.FAILED  # reported, not lost


@rollout
async def answer(task: dict, llm: object) -> float:
    return float(task["value"])


@pytest.mark.e2e
@pytest.mark.parametrize("source", ["environment", "file"])
async def test_the_store_key_never_goes_on_the_command_line(source: str, tmp_path: Path) -> None:
    """`agentloop runner` reads the store's key from $AGENTLOOP_STORE_API_KEY or `--api-key file:PATH`."""
    key = "s3cret-key-0123456789"
    store = MemoryStore()
    async with StoreServer(store, api_key=key) as server:
        r = await store.enqueue_rollout({"value": 1.0})
        cmd = [sys.executable, "-m", "agentloop.cli", "runner", "--store", server.url, "--max-rollouts", "1"]
        cmd += ["--agent", "tests.commands.test_runner_cmd:answer"]
        env = {k: v for k, v in os.environ.items() if k != "AGENTLOOP_STORE_API_KEY"}
        env["PYTHONPATH"] = str(ROOT)
        if source == "environment":
            env["AGENTLOOP_STORE_API_KEY"] = key
        else:
            (tmp_path / "store.key").write_text(key + "\n")
            cmd += ["--api-key", f"file:{tmp_path / 'store.key'}"]
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        with anyio.fail_after(60):
            _, err = await anyio.to_thread.run_sync(proc.communicate)
        assert proc.returncode == 0, err.decode()[-2000:]
        assert not any(key in part for part in cmd)
        done = await store.wait_for_rollouts([r.rollout_id], timeout=5)
        assert done and done[0].status is RolloutStatus.SUCCEEDED


@pytest.mark.e2e
async def test_a_runner_runs_with_its_own_key_from_runner_key(tmp_path: Path) -> None:
    """`agentloop runner-key NAME` prints the runner's key; a runner with it runs its attempts, and the
    key cannot do the admin's work (enqueue)."""
    from agentloop.errors import InvalidRequestError
    from agentloop.store.client import StoreClient

    admin = "admin-key-0123456789abcdef"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AGENTLOOP_STORE_API_KEY": admin}
    cmd = [sys.executable, "-m", "agentloop.cli", "runner-key", "gpu-node-1"]
    made = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip()
    assert key and admin not in key
    (tmp_path / "runner.key").write_text(key + "\n")
    store = MemoryStore()
    async with StoreServer(store, admin_key=admin) as server:
        r = await store.enqueue_rollout({"value": 1.0})
        run = [sys.executable, "-m", "agentloop.cli", "runner", "--store", server.url, "--max-rollouts", "1"]
        run += [
            "--agent",
            "tests.commands.test_runner_cmd:answer",
            "--api-key",
            f"file:{tmp_path / 'runner.key'}",
        ]
        runner_env = {k: v for k, v in env.items() if k != "AGENTLOOP_STORE_API_KEY"}
        proc = subprocess.Popen(run, cwd=ROOT, env=runner_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        with anyio.fail_after(60):
            _, err = await anyio.to_thread.run_sync(proc.communicate)
        assert proc.returncode == 0, err.decode()[-2000:]
        done = await store.wait_for_rollouts([r.rollout_id], timeout=5)
        assert done and done[0].status is RolloutStatus.SUCCEEDED
        client = StoreClient(server.url, api_key=key)
        try:
            with pytest.raises(InvalidRequestError, match="admin"):
                await client.enqueue_rollout({"value": 2.0})
        finally:
            await client.close()
