"""``TinkerServer``: the engine, the service and the HTTP server of ``agentloop tinker``, in one object.

Lifecycle: ``await start()`` loads the engine (the served base model, for sampling), binds
``host:port`` (0: a free port) and serves in the running event loop; ``url`` is then the base URL to
give ``tinker.ServiceClient(base_url=...)``; ``await stop()`` ends it. Training models load when a
client creates one.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from agentloop.http_server import EmbeddedServer
from agentloop.tinker.app import build_app
from agentloop.tinker.service import TinkerService
from agentloop.tinker.training import TrainerParts

__all__ = ["TinkerServer"]


class TinkerServer:
    """Serve ``model`` (an alias, folder or hub id, as ``agentloop serve`` takes) over the Tinker API.

    Args:
        parts: the trainer's functions (``agentloop.commands.tinker.trainer_parts()``).
        keys: the API keys a client may send (at least one).
        model_name: the name clients give as ``base_model`` and see in answers; default ``model``.
        state_dir: where training checkpoints go; default a temporary folder removed at ``stop``.
        engine_kwargs: passed to ``TorchEngine`` (``max_batch_size``, ``max_context``, ...).
        max_models: training models held at once (each a copy of the weights, gradients and Adam's moments).
    """

    def __init__(
        self,
        model: str,
        parts: TrainerParts,
        keys: list[SecretStr],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        device: str = "auto",
        model_name: str | None = None,
        state_dir: Path | None = None,
        engine_kwargs: dict[str, Any] | None = None,
        max_models: int = 4,
    ) -> None:
        if not keys:
            raise ValueError("TinkerServer needs at least one API key")
        self.model, self.parts, self.keys = model, parts, keys
        self.host, self.port, self.device = host, port, device
        self.model_name = model_name or model
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.state_dir = state_dir
        self.engine_kwargs = engine_kwargs or {}
        self.max_models = max_models
        self.service: TinkerService | None = None
        self._server: EmbeddedServer | None = None
        self._engine: Any = None

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("the Tinker server is not started; await start() first")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self._server.port}"

    async def start(self) -> str:
        """Load the engine, bind, serve; returns ``url``."""
        import anyio
        import torch

        from agentloop.device import pick_device
        from agentloop.engine.models import resolve_model
        from agentloop.engine.torch.engine import TorchEngine

        dev = pick_device(self.device)
        path = resolve_model(self.model)
        if self.state_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="agentloop-tinker-")
            self.state_dir = Path(self._tmp.name)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        dtype = torch.bfloat16 if dev.startswith("cuda") else torch.float32
        self._engine = await anyio.to_thread.run_sync(
            lambda: TorchEngine(path, device=dev, dtype=dtype, **self.engine_kwargs)
        )
        await self._engine.start()
        aliases = (self.model,) if self.model != self.model_name else ()
        self.service = TinkerService(
            self.model_name,
            path,
            self.parts,
            self._engine,
            self.state_dir,
            torch.device(dev),
            aliases,
            max_models=self.max_models,
        )
        self._server = EmbeddedServer(
            build_app(self.service, self.keys), self.host, self.port, what="the Tinker server", graceful_s=1.0
        )
        await self._server.start()
        return self.url

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop()
        if self.service is not None:
            await self.service.close()
        if self._engine is not None:
            await self._engine.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
