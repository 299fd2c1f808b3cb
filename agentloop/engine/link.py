"""One engine served to other processes of the same machine over a Unix socket.

``EngineHost`` runs in the engine's process (its event loop) and answers generate and abort calls
from any number of connections; ``RemoteEngine`` is the client: an ``InferenceEngine`` for the
proxy's worker processes (agentloop.proxy.workers), which parse, template, tokenize and record calls
while the GPU engine stays in one process. Token ids cross the socket, never text.

Wire format: each message is a 4-byte big-endian length and an orjson object, at most
``MAX_FRAME_BYTES``. Calls carry an ``id`` the answer repeats, so one connection multiplexes all of
a worker's requests::

    -> {"op": "generate", "id": 7, "prompt_ids": [...], "sampling": {...}, "request_id": "r/a/c"}
    <- {"id": 7, "out": {TokenOutput fields}}  |  {"id": 7, "err": {"kind": "...", "msg": "..."}}
    -> {"op": "abort", "id": 8, "request_id": "r/a/c"}
    <- {"id": 8, "found": true}

``kind`` maps back to the engine's exception (``context`` -> ContextLengthExceededError, ``aborted``
-> RequestAbortedError, ``invalid`` -> ValueError, else EngineError), so the proxy answers a remote
engine's failures exactly as a local one's. The socket lives in a private (0700) folder; a malformed
message is answered ``invalid`` (a frame over the limit closes the connection), never crashes the host.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson
import structlog
import torch
from pydantic import ValidationError

from agentloop.engine.base import InferenceEngine, SamplingParams, TokenOutput
from agentloop.errors import ContextLengthExceededError, EngineError, RequestAbortedError

log = structlog.get_logger("agentloop.engine.link")

MAX_FRAME_BYTES = 64 * 1024 * 1024  # a 1M-token prompt as JSON ids is ~8 MB: far inside
_HEADER = struct.Struct(">I")
_ERRORS: dict[str, type[Exception]] = {
    "context": ContextLengthExceededError,
    "aborted": RequestAbortedError,
    "invalid": ValueError,
}


async def _read_frame(reader: asyncio.StreamReader) -> Any:
    """The next message; None at a clean end of stream. Raises ValueError on an oversized frame."""
    try:
        header = await reader.readexactly(_HEADER.size)
    except asyncio.IncompleteReadError:
        return None
    (size,) = _HEADER.unpack(header)
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"a frame of {size} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    return orjson.loads(await reader.readexactly(size))


def _frame(message: Mapping[str, Any]) -> bytes:
    body = orjson.dumps(message)
    return _HEADER.pack(len(body)) + body


def _error_kind(exc: BaseException) -> str:
    if isinstance(exc, ContextLengthExceededError):
        return "context"
    if isinstance(exc, RequestAbortedError):
        return "aborted"
    if isinstance(exc, ValueError | TypeError | ValidationError):
        return "invalid"
    return "engine"


class EngineHost:
    """Serves ``engine``'s generate and abort on a Unix socket (module docstring); ``path`` is set
    once ``start()`` returns. One task per call in flight; ``stop()`` closes every connection."""

    def __init__(self, engine: InferenceEngine, path: str | Path | None = None) -> None:
        self.engine = engine
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self.path = Path(path) if path is not None else None
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> Path:
        """Listen; returns the socket's path."""
        if self._server is not None:
            raise RuntimeError("an EngineHost starts once")
        if self.path is None:
            self._dir = tempfile.TemporaryDirectory(prefix="agentloop-engine-")
            os.chmod(self._dir.name, 0o700)  # only this user's processes reach the engine
            self.path = Path(self._dir.name) / "engine.sock"
        self._server = await asyncio.start_unix_server(
            self._serve, path=str(self.path), limit=MAX_FRAME_BYTES
        )
        return self.path

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)
        if self._dir is not None:
            self._dir.cleanup()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection: a task per call; when it closes (its worker stopped or died), the calls
        it left in flight are cancelled, which aborts them in the engine and frees their slots."""
        self._writers.add(writer)
        mine: dict[
            asyncio.Task[None], str | None
        ] = {}  # this connection's calls in flight, their request ids
        try:
            while (message := await _read_frame(reader)) is not None:
                task = asyncio.get_running_loop().create_task(self._answer(message, writer))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                rid = (
                    message.get("request_id")
                    if isinstance(message, dict) and message.get("op") == "generate"
                    else None
                )
                mine[task] = rid if isinstance(rid, str) else None
                task.add_done_callback(lambda t: mine.pop(t, None))
        except (ValueError, orjson.JSONDecodeError, ConnectionError) as exc:
            log.warning("engine link: connection closed", error=str(exc)[:200])
        finally:
            self._writers.discard(writer)
            writer.close()
            for task, rid in list(mine.items()):
                task.cancel()
                if rid is not None:  # also ask the engine by id: not every engine aborts on a cancelled await
                    with contextlib.suppress(Exception):
                        await self.engine.abort(rid)

    async def _answer(self, message: Any, writer: asyncio.StreamWriter) -> None:
        call_id = message.get("id") if isinstance(message, dict) else None
        try:
            reply = {"id": call_id, **await self._call(message)}
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            reply = {"id": call_id, "err": {"kind": _error_kind(exc), "msg": str(exc)[:2000]}}
        if not writer.is_closing():
            writer.write(_frame(reply))

    async def _call(self, message: Any) -> dict[str, Any]:
        if not isinstance(message, dict) or not isinstance(message.get("id"), int):
            raise ValueError(f"expected an object with an int 'id', got {str(message)[:100]}")
        op = message.get("op")
        request_id = message.get("request_id")
        if request_id is not None and not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string or null, got {type(request_id).__name__}")
        if op == "generate":
            prompt = message.get("prompt_ids")
            if not isinstance(prompt, list):
                raise ValueError(f"prompt_ids must be a list of token ids, got {type(prompt).__name__}")
            sampling = SamplingParams.model_validate(message.get("sampling"))
            out = await self.engine.generate(prompt, sampling, request_id=request_id)  # the engine checks ids
            return {"out": out.model_dump(mode="json")}
        if op == "abort":
            if request_id is None:
                raise ValueError("abort needs a request_id")
            return {"found": bool(await self.engine.abort(request_id))}
        raise ValueError(f"op must be 'generate' or 'abort', got {str(op)[:40]!r}")


class RemoteEngine:
    """An ``InferenceEngine`` whose generate and abort run in another process's ``EngineHost``.

    ``tokenizer`` and ``max_context`` are given (the host's engine's), since the proxy needs them
    before any call. A lost connection fails every call in flight with EngineError, and later calls
    too: the worker holding this engine should stop (``closed`` says so). Weight updates go to the
    host's engine directly, never through here."""

    def __init__(self, path: str | Path, tokenizer: Any, max_context: int) -> None:
        self.path = Path(path)
        self._tokenizer = tokenizer
        self._max_context = int(max_context)
        self._connecting = asyncio.Lock()
        self._writer: asyncio.StreamWriter | None = None
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._next_id = 0
        self._version = 0
        self._receiver: asyncio.Task[None] | None = None
        self.closed = asyncio.Event()

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def max_context(self) -> int:
        return self._max_context

    @property
    def weights_version(self) -> int:
        """The version of the latest answer seen (the host's engine owns the real one)."""
        return self._version

    async def start(self) -> None:
        """Connect (once; concurrent first calls share the one connection)."""
        async with self._connecting:
            if self._writer is not None:
                return
            reader, self._writer = await asyncio.open_unix_connection(str(self.path), limit=MAX_FRAME_BYTES)
            self._receiver = asyncio.get_running_loop().create_task(self._receive(reader))

    async def stop(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._receiver is not None:
            self._receiver.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._receiver
        self._fail_all(EngineError("the engine link was closed"))

    async def _receive(self, reader: asyncio.StreamReader) -> None:
        error: Exception = EngineError(f"the engine host at {self.path} closed the connection")
        try:
            while (message := await _read_frame(reader)) is not None:
                call_id = message.get("id") if isinstance(message, dict) else None
                fut = self._pending.pop(call_id, None) if isinstance(call_id, int) else None
                if fut is not None and not fut.done():
                    fut.set_result(message)
        except (ValueError, orjson.JSONDecodeError, ConnectionError) as exc:
            error = EngineError(f"the engine link broke: {exc}")
        finally:
            self.closed.set()
            self._fail_all(error)

    def _fail_all(self, error: Exception) -> None:
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(error)

    async def _call(self, message: dict[str, Any]) -> dict[str, Any]:
        if self._writer is None:
            await self.start()
        if self.closed.is_set() or self._writer is None or self._writer.is_closing():
            raise EngineError(f"the engine host at {self.path} is gone")
        self._next_id += 1
        call_id = self._next_id
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = fut
        self._send({**message, "id": call_id})
        try:
            reply = await fut
        finally:
            self._pending.pop(call_id, None)
        if "err" in reply:
            err = reply["err"]
            raise _ERRORS.get(err.get("kind"), EngineError)(err.get("msg", "the engine failed"))
        return reply

    def _send(self, message: dict[str, Any]) -> None:
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(_frame(message))

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, request_id: str | None = None
    ) -> TokenOutput:
        message = {"op": "generate", "prompt_ids": prompt_ids, "sampling": sampling.model_dump(mode="json"),
                   "request_id": request_id}  # fmt: skip
        try:
            reply = await self._call(message)
        except asyncio.CancelledError:
            if request_id is not None:  # the caller gave up: free the engine's slot (answer ignored)
                self._send({"op": "abort", "id": 0, "request_id": request_id})
            raise
        out = TokenOutput.model_validate(reply["out"])
        self._version = max(self._version, out.weights_version)
        return out

    async def abort(self, request_id: str) -> bool:
        return bool((await self._call({"op": "abort", "request_id": request_id}))["found"])

    async def update_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> int:
        raise EngineError("weights are updated on the engine's own process, not through a RemoteEngine")

    def stats(self) -> dict[str, Any]:
        return {"in_flight": len(self._pending), "weights_version": self._version}
