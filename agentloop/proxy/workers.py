"""Proxy worker processes: the per-call work of a proxy spread over several processes.

Why: one proxied call costs ~0.5-1 ms of one core (HTTP parsing, the chat template, tokenizing,
JSON, recording the call in the store). When 128 agents call at once, one process works through
them one after another: the last reaches the engine ~80-100 ms after the first (an H100 host,
benchmarks/results/proxy_loss_gpu.json), against a ~640 ms generation, and the event loop competes
with the engine's thread for the GIL meanwhile.

With ``Proxy(workers=N)`` the proxy process keeps the engine and serves it to N worker processes
over a Unix socket (agentloop.engine.link): token ids in, token ids and logprobs out. The engine
process's CPU per call fell from 1.1-1.3 ms to 0.12-0.13 ms with 2 workers (a 2-core CPU, a burst of
128 calls, benchmarks/results/proxy_workers_cpu.json). Each worker is a whole proxy on a port of its own (same routes,
key, limits and sampling defaults) recording into the same SQLite store. The ProxyLLM resource lists
the workers' URL templates, and each rollout's calls go to the worker its rollout id picks
(``ProxyLLM.get_base_url``), so a conversation's token ledger lives in one process. App sessions
(``/v1`` on the proxy's own port) stay in the proxy process.

A worker that dies is started again on its port (its in-flight calls fail; the engine aborts them
when the worker's connection closes); workers exit when the proxy process's engine link closes,
so none outlives a proxy that was killed. A worker process runs ``agentloop.proxy.worker_process``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import select
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field, replace
from typing import Any

import anyio
import structlog
from pydantic import SecretStr

from agentloop.engine.base import InferenceEngine
from agentloop.engine.link import EngineHost
from agentloop.http_limits import HttpLimits
from agentloop.store.base import Store
from agentloop.store.sqlite import SQLiteStore

log = structlog.get_logger("agentloop.proxy")

START_TIMEOUT_S = 120.0  # a worker imports transformers and loads the tokenizer before it listens
STOP_TIMEOUT_S = 10.0  # SIGTERM, then SIGKILL
RESTART_CHECK_S = 1.0  # how often dead workers are looked for


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs to serve as the proxy does (picklable)."""

    index: int
    engine_socket: str
    tokenizer_dir: str
    max_context: int
    store_path: str
    host: str
    port: int  # 0: any free port (the first start); a restart reuses the port it had
    proxy_kwargs: dict[str, Any] = field(default_factory=dict)  # Proxy's own settings

    def to_json(self) -> bytes:
        """JSON, not pickle: nothing a worker reads is ever unpickled (tests/reliability/test_security.py)."""
        kwargs = dict(self.proxy_kwargs)
        key = kwargs.get("api_key")
        kwargs["api_key"] = key.get_secret_value() if isinstance(key, SecretStr) else key
        if isinstance(kwargs.get("limits"), HttpLimits):
            kwargs["limits"] = dataclasses.asdict(kwargs["limits"])
        return json.dumps({**dataclasses.asdict(self), "proxy_kwargs": kwargs}).encode()

    @classmethod
    def from_json(cls, data: bytes) -> WorkerSpec:
        fields = json.loads(data)
        kwargs = fields.pop("proxy_kwargs")
        if kwargs.get("limits") is not None:
            kwargs["limits"] = HttpLimits(**kwargs["limits"])
        return cls(**fields, proxy_kwargs=kwargs)


def check_shareable(store: Store) -> str:
    """The path of ``store`` for worker processes to open; ValueError unless it is a SQLiteStore."""
    if not isinstance(store, SQLiteStore):
        raise ValueError(
            f"Proxy(workers=N) needs a store that several processes can open: a SQLiteStore; got "
            f"{type(store).__name__}. Use SQLiteStore(path), or workers=0"
        )
    return str(store.path)


class ProxyWorkers:
    """Starts, watches and stops the worker processes of one proxy (module docstring)."""

    def __init__(self, count: int, engine: InferenceEngine, store: Store, host: str,
                 proxy_kwargs: dict[str, Any]) -> None:  # fmt: skip
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ValueError(f"workers must be an int >= 1 here, got {count!r}")
        self.count = count
        self._engine = engine
        self._store_path = check_shareable(store)
        self._host_name = host
        self._proxy_kwargs = proxy_kwargs
        self._host = EngineHost(engine)
        self._tokenizer_dir: tempfile.TemporaryDirectory[str] | None = None
        self._specs: list[WorkerSpec] = []
        self._procs: list[subprocess.Popen[bytes]] = []
        self._monitor: asyncio.Task[None] | None = None
        self._stopping = False
        self.restarts = 0

    @property
    def ports(self) -> list[int]:
        return [spec.port for spec in self._specs]

    async def start(self) -> list[int]:
        """Serve the engine, start every worker and wait until each listens; returns their ports."""
        socket_path = await self._host.start()
        self._tokenizer_dir = tempfile.TemporaryDirectory(prefix="agentloop-tokenizer-")
        await anyio.to_thread.run_sync(self._engine.tokenizer.save_pretrained, self._tokenizer_dir.name)
        base = WorkerSpec(index=0, engine_socket=str(socket_path), tokenizer_dir=self._tokenizer_dir.name,
                          max_context=self._engine.max_context, store_path=self._store_path,
                          host=self._host_name, port=0, proxy_kwargs=self._proxy_kwargs)  # fmt: skip
        results = await asyncio.gather(
            *(self._spawn(replace(base, index=i)) for i in range(self.count)), return_exceptions=True
        )
        started = [r for r in results if isinstance(r, tuple)]
        self._procs = [proc for proc, _ in started]
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            await self.stop()
            raise failed[0]
        self._specs = [spec for _, spec in started]
        self._monitor = asyncio.get_running_loop().create_task(self._watch())
        log.info("proxy workers started", ports=self.ports)
        return self.ports

    async def _spawn(self, spec: WorkerSpec) -> tuple[subprocess.Popen[bytes], WorkerSpec]:
        """Start one worker (``python -m agentloop.proxy.worker_process``: a fresh interpreter that never imports
        the caller's ``__main__``, unlike multiprocessing's spawn) and wait for its port."""
        read_fd, write_fd = os.pipe()  # the worker's one line back: "ready PORT" or "error WHY"
        try:  # a session of its own: a Ctrl-C at the terminal reaches the proxy, which stops its workers
            proc = subprocess.Popen(
                [sys.executable, "-m", "agentloop.proxy.worker_process", str(write_fd)],
                stdin=subprocess.PIPE, pass_fds=(write_fd,), start_new_session=True,
            )  # fmt: skip
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        assert proc.stdin is not None
        try:
            proc.stdin.write(spec.to_json())
            proc.stdin.close()
            with os.fdopen(read_fd, "rb") as answers:
                line = await anyio.to_thread.run_sync(_read_line, answers, abandon_on_cancel=True)
        except BaseException:
            with anyio.CancelScope(shield=True):  # a cancelled start still ends the process it began
                await _end_in_thread([proc])
            raise
        kind, _, detail = line.decode(errors="replace").strip().partition(" ")
        if kind != "ready":
            await _end_in_thread([proc])
            why = detail or f"it exited with code {proc.poll()}"
            raise RuntimeError(f"proxy worker {spec.index} failed to start: {why}")
        return proc, replace(spec, port=int(detail))

    async def _watch(self) -> None:
        """Start a worker that died again, on its port, so its rollouts' URLs keep working."""
        while not self._stopping:
            await asyncio.sleep(RESTART_CHECK_S)
            for i, proc in enumerate(self._procs):
                if proc.poll() is None or self._stopping:
                    continue
                log.error("proxy worker died; restarting it", index=i, exitcode=proc.returncode,
                          port=self._specs[i].port)  # fmt: skip
                try:
                    self._procs[i], _ = await self._spawn(self._specs[i])
                    self.restarts += 1
                except Exception as exc:  # e.g. its port was taken meanwhile: try again next round
                    log.error("proxy worker restart failed", index=i, error=str(exc)[:300])

    async def stop(self) -> None:
        """SIGTERM every worker (each lets its in-flight calls finish, up to its proxy's grace), then
        SIGKILL what is left after ``STOP_TIMEOUT_S``; stop serving the engine."""
        self._stopping = True
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
        await _end_in_thread(list(self._procs))
        await self._host.stop()
        if self._tokenizer_dir is not None:
            self._tokenizer_dir.cleanup()


def _read_line(answers: Any) -> bytes:
    """The worker's answer line, or b"" once it exited without one; at most ``START_TIMEOUT_S``."""
    ready, _, _ = select.select([answers], [], [], START_TIMEOUT_S)
    if not ready:
        return f"error no answer within {START_TIMEOUT_S:.0f} s".encode()
    return bytes(answers.readline())


async def _end_in_thread(procs: list[subprocess.Popen[bytes]]) -> None:
    """``_end_all`` off the event loop: it waits up to 2 x ``STOP_TIMEOUT_S`` for each process."""
    await anyio.to_thread.run_sync(_end_all, procs)


def _end_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_TIMEOUT_S)
