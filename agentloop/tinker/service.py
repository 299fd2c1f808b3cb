"""The state behind the Tinker routes: sessions, training models, sampling sessions, checkpoints.

Ids follow the SDK's own scheme where it derives them itself: a training model is
``<session>:train:<n>`` (the SDK computes it for ``create_training_client_from_state``), a sampling
session ``<session>:sample:<n>``. Checkpoints are ``tinker://<run>/weights/<name>`` (training state,
on disk under ``state_dir``) and ``tinker://<run>/sampler_weights/<name>`` (a snapshot of the
adapters, kept in memory while the server runs), with ``<run>`` the model id without colons.

Each training model runs its work one request at a time in the order it came
(``asyncio.Lock`` is first-come first-served), in a worker thread so the event loop keeps answering
polls; sampling runs on the engine (``Sampler``).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import anyio
import torch

from agentloop.logging import get_logger
from agentloop.tinker._proto import RawForwardBackward, encode_forward_backward_output
from agentloop.tinker.futures import FutureTable
from agentloop.tinker.sampling import BASE, Sampler, Snapshot
from agentloop.tinker.training import TrainerParts, TrainingModel, read_meta
from agentloop.tinker.wire import (
    CreateModelRequest,
    CreateSamplingSessionRequest,
    LoadWeightsRequest,
    LoraConfig,
    OptimStepRequest,
    SampleRequest,
    SaveWeightsForSamplerRequest,
    SaveWeightsRequest,
    WireError,
    check_name,
    forward_backward_from_proto,
)

__all__ = ["NotFound", "TinkerService"]

T = TypeVar("T")
log = get_logger(__name__)


class NotFound(KeyError):
    """An id the server does not know (HTTP 404)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "not found"


# a session silent this long (no heartbeat) is taken for dead when its models' room is needed
SESSION_SILENT_S = 600.0


@dataclass
class _Model:
    model: TrainingModel
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass
class _Session:
    session_id: str
    created: float = field(default_factory=time.time)
    last_heartbeat: float = field(default_factory=time.time)
    finished: bool = False


class TinkerService:
    """What the routes call (module docstring). ``model_name``: the base model's name in answers;
    ``aliases``: other names a client may give for it (its folder, a hub id)."""

    def __init__(
        self,
        model_name: str,
        model_path: Path,
        parts: TrainerParts,
        engine: Any,
        state_dir: Path,
        device: torch.device,
        aliases: tuple[str, ...] = (),
        max_models: int = 4,
    ) -> None:
        self.model_name, self.model_path, self.parts, self.device = model_name, model_path, parts, device
        self.max_models = max_models  # training models at once: each is a copy of the model in memory
        self._creating: set[str] = set()
        self.names = {model_name, str(model_path), *aliases}
        self.state_dir = state_dir
        self.max_context = int(engine.max_context)
        self.sampler = Sampler(engine, self.max_context)
        self.futures = FutureTable(user_errors=(ValueError, KeyError))
        self.sessions: dict[str, _Session] = {}
        self.models: dict[str, _Model] = {}
        self.samplers: dict[str, Snapshot] = {}
        self.sampler_paths: dict[str, Snapshot] = {}

    # ------------------------------------------------------------------ sessions

    def create_session(self) -> str:
        sid = f"session-{uuid.uuid4().hex[:12]}"
        self.sessions[sid] = _Session(sid)
        return sid

    def session(self, sid: str) -> _Session:
        s = self.sessions.get(sid)
        if s is None:
            raise NotFound(
                f"session {sid!r} does not exist on this server (it restarted?); create a new ServiceClient"
            )
        return s

    def heartbeat(self, sid: str) -> None:
        self.session(sid).last_heartbeat = time.time()

    def finish_session(self, sid: str) -> None:
        """The client closed its ServiceClient: its training models and sampling sessions go (a named
        sampler checkpoint keeps what it needs to be sampled)."""
        self.session(sid).finished = True
        for key in [k for k in self.models if k.startswith(f"{sid}:train:")]:
            del self.models[key]
        for key in [k for k in self.samplers if k.startswith(f"{sid}:sample:")]:
            del self.samplers[key]

    def _check_base(self, name: str | None) -> str:
        if name is None or name in self.names:
            return self.model_name
        raise WireError(f"base_model {name!r} is not served here; this server trains {self.model_name!r}")

    def capabilities(self) -> dict[str, Any]:
        return {
            "supported_models": [
                {
                    "model_name": self.model_name,
                    "max_context_length": self.max_context,
                    "trainable": True,
                    "sampleable": True,
                }
            ]
        }

    # ------------------------------------------------------------------ training models

    def _model(self, model_id: str) -> _Model:
        m = self.models.get(model_id)
        if m is None:
            raise NotFound(
                f"training model {model_id!r} does not exist; create it with create_lora_training_client"
            )
        return m

    async def _in_turn(self, m: _Model, fn: Callable[[], T]) -> T:
        """Run ``fn`` in a worker thread after the model's earlier requests (module docstring)."""
        async with m.lock:
            return await anyio.to_thread.run_sync(fn)

    def _submit(self, what: str, work: Callable[[], Awaitable[Any]]) -> str:
        return self.futures.submit(work, what)

    def create_model(self, req: CreateModelRequest) -> str:
        self.session(req.session_id)
        base = self._check_base(req.base_model)
        if req.lora_config is None:
            raise WireError(
                "full fine-tuning is not served; give a lora_config (create_lora_training_client)"
            )
        opt = (req.optimizer_config or {}).get("type", "adamw")
        if opt != "adamw":
            raise WireError(f"optimizer {opt!r} is not served; this server steps with Adam (adamw)")
        model_id = f"{req.session_id}:train:{req.model_seq_id}"
        if model_id in self.models:
            raise WireError(
                f"training model {model_id!r} exists already (model_seq_id {req.model_seq_id} is taken)"
            )
        lora = req.lora_config
        self._reserve(model_id)

        async def work() -> dict[str, Any]:
            await self._new_model(model_id, base, lora)
            return {"model_id": model_id, "type": "create_model"}

        return self._submit("create_model", work)

    def _reserve(self, model_id: str) -> None:
        """Count ``model_id`` against ``max_models`` from its request on (WireError past the cap):
        each training model holds a copy of the weights, its gradients and Adam's moments."""
        if len(self.models) + len(self._creating) >= self.max_models:
            self._drop_silent_sessions()
        if len(self.models) + len(self._creating) >= self.max_models:
            raise WireError(
                f"this server holds at most {self.max_models} training models at once (each is a copy of the "
                "model, its gradients and Adam's moments in memory); close a ServiceClient to free its models, "
                "or start agentloop tinker with a larger --max-models"
            )
        self._creating.add(model_id)

    def _drop_silent_sessions(self) -> None:
        """Finish the sessions that sent no heartbeat for ``SESSION_SILENT_S`` (the SDK sends one every
        10 s while its ServiceClient lives): a client that died without closing frees its models."""
        now = time.time()
        for sid, session in list(self.sessions.items()):
            if not session.finished and now - session.last_heartbeat > SESSION_SILENT_S:
                self.finish_session(sid)

    async def _new_model(self, model_id: str, base: str, lora: LoraConfig) -> _Model:
        try:
            model = await anyio.to_thread.run_sync(
                lambda: TrainingModel(model_id, base, self.model_path, lora, self.parts, self.device)
            )
            if model_id in self.models:
                raise WireError(f"training model {model_id!r} exists already")
            m = self.models[model_id] = _Model(model)
        finally:
            self._creating.discard(model_id)
        return m

    def get_info(self, model_id: str) -> dict[str, Any]:
        m = self._model(model_id).model
        return {
            "type": "get_info",
            "model_id": model_id,
            "model_data": {
                "arch": _arch(m),
                "model_name": self.model_name,
                "tokenizer_id": str(self.model_path),
            },
            "is_lora": True,
            "lora_rank": m.lora.rank,
            "model_name": self.model_name,
        }

    def forward_backward(self, raw: RawForwardBackward) -> str:
        m = self._model(raw.model_id)
        fb = forward_backward_from_proto(raw, m.model.vocab_size)

        async def work() -> bytes:
            t0 = time.perf_counter()
            outputs, metrics = await self._in_turn(m, lambda: m.model.forward_backward(fb))
            log.info(
                "tinker.forward_backward", model_id=raw.model_id, loss_fn=fb.loss_fn, forward_only=fb.forward_only,
                datums=len(fb.data), tokens=sum(len(d.tokens) for d in fb.data), seconds=round(time.perf_counter() - t0, 2),
            )  # fmt: skip
            return encode_forward_backward_output(outputs, metrics)

        return self._submit("forward" if fb.forward_only else "forward_backward", work)

    def optim_step(self, req: OptimStepRequest) -> str:
        m = self._model(req.model_id)
        if req.adam_params is None:
            raise WireError("optim_step needs adam_params; other optimizers are not served")
        adam = req.adam_params

        async def work() -> dict[str, Any]:
            return {"metrics": await self._in_turn(m, lambda: m.model.optim_step(adam))}

        return self._submit("optim_step", work)

    def _run_id(self, model_id: str) -> str:
        return model_id.replace(":", "-")

    def save_weights(self, req: SaveWeightsRequest) -> str:
        m = self._model(req.model_id)
        name = check_name(req.path) if req.path else f"step-{m.model.step:06d}-{uuid.uuid4().hex[:6]}"
        run = self._run_id(req.model_id)
        folder = self.state_dir / run / "weights" / name

        async def work() -> dict[str, Any]:
            await self._in_turn(m, lambda: m.model.save(folder))
            return {"path": f"tinker://{run}/weights/{name}", "type": "save_weights"}

        return self._submit("save_weights", work)

    def _checkpoint_folder(self, path: str) -> Path:
        parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
        if len(parts) != 3 or parts[1] != "weights":
            raise WireError(
                f"path {path!r} is not a training checkpoint; give tinker://RUN/weights/NAME as save_state answered"
            )
        check_name(parts[0], "the run in path")
        check_name(parts[2], "the name in path")
        folder = self.state_dir / parts[0] / "weights" / parts[2]
        if not folder.is_dir():
            raise NotFound(f"checkpoint {path!r} does not exist on this server (state dir {self.state_dir})")
        return folder

    def load_weights(self, req: LoadWeightsRequest) -> str:
        folder = self._checkpoint_folder(req.path)
        if req.model_id is not None:
            m = self._model(req.model_id)

            async def into_existing() -> dict[str, Any]:
                await self._in_turn(m, lambda: m.model.load(folder, req.optimizer))
                return {"path": req.path, "model_id": req.model_id, "type": "load_weights"}

            return self._submit("load_weights", into_existing)
        if req.session_id is None or req.model_seq_id is None:
            raise WireError(
                "load_weights needs model_id, or session_id and model_seq_id (a new training model)"
            )
        self.session(req.session_id)
        meta = read_meta(folder)
        base = self._check_base(req.base_model or meta["base_model"])
        lora = LoraConfig.model_validate(meta["lora"])
        model_id = f"{req.session_id}:train:{req.model_seq_id}"
        if model_id in self.models:
            raise WireError(f"training model {model_id!r} exists already")
        self._reserve(model_id)

        async def into_new() -> dict[str, Any]:
            m = await self._new_model(model_id, base, lora)
            await self._in_turn(m, lambda: m.model.load(folder, req.optimizer))
            return {"path": req.path, "model_id": model_id, "type": "load_weights"}

        return self._submit("load_weights", into_new)

    # ------------------------------------------------------------------ sampling

    def _snapshot_of(self, m: _Model, key: str, model_path: str | None) -> Callable[[], Awaitable[Snapshot]]:
        async def take() -> Snapshot:
            adapters = await self._in_turn(m, m.model.adapter_state)

            async def materialize() -> dict[str, torch.Tensor]:
                return await self._in_turn(m, lambda: m.model.merged_weights(adapters))

            return Snapshot(key, self.model_name, materialize, model_path)

        return take

    def save_weights_for_sampler(self, req: SaveWeightsForSamplerRequest) -> str:
        m = self._model(req.model_id)
        if req.path is not None:
            name = check_name(req.path)
            path = f"tinker://{self._run_id(req.model_id)}/sampler_weights/{name}"
            take = self._snapshot_of(m, path, path)

            async def named() -> dict[str, Any]:
                self.sampler_paths[path] = await take()
                return {"path": path, "type": "save_weights_for_sampler"}

            return self._submit("save_weights_for_sampler", named)
        if req.sampling_session_seq_id is None:
            raise WireError("save_weights_for_sampler needs a path (a name) or a sampling_session_seq_id")
        session = req.model_id.split(":train:")[0]
        sid = f"{session}:sample:{req.sampling_session_seq_id}"
        take = self._snapshot_of(m, sid, None)

        async def session_snapshot() -> dict[str, Any]:
            self.samplers[sid] = await take()
            return {"sampling_session_id": sid, "type": "save_weights_for_sampler"}

        return self._submit("save_weights_for_sampler", session_snapshot)

    def _sampler_path(self, path: str) -> Snapshot:
        snap = self.sampler_paths.get(path)
        if snap is None:
            raise NotFound(
                f"sampler weights {path!r} do not exist on this server; save them with save_weights_for_sampler "
                "(they are kept in memory while the server runs)"
            )
        return snap

    def create_sampling_session(self, req: CreateSamplingSessionRequest) -> str:
        self.session(req.session_id)
        sid = f"{req.session_id}:sample:{req.sampling_session_seq_id}"
        if req.model_path is not None:
            self.samplers[sid] = self._sampler_path(req.model_path)
        else:
            self.samplers[sid] = Snapshot(BASE, self._check_base(req.base_model))
        return sid

    def get_sampler(self, sid: str) -> dict[str, Any]:
        snap = self.samplers.get(sid)
        if snap is None:
            raise NotFound(f"sampling session {sid!r} does not exist")
        return {"sampler_id": sid, "base_model": snap.base_model, "model_path": snap.model_path}

    def sample(self, req: SampleRequest) -> tuple[str, list[str]]:
        if req.sampling_session_id is not None:
            snap = self.samplers.get(req.sampling_session_id)
            if snap is None:
                raise NotFound(f"sampling session {req.sampling_session_id!r} does not exist")
        elif req.model_path is not None:
            snap = self._sampler_path(req.model_path)
        else:
            snap = Snapshot(BASE, self._check_base(req.base_model))
        req.prompt.tokens()  # a bad prompt is a 400 now, not a failed future later

        async def work() -> bytes:
            body, _ = await self.sampler.sample(snap, req)
            return body

        rid = self._submit("sample", work)
        return rid, [f"{rid}-{i}" for i in range(req.num_samples)]

    async def close(self) -> None:
        await self.futures.close()


def _arch(m: TrainingModel) -> str:
    config = getattr(m.model, "config", None)
    return str(getattr(config, "model_type", "") or "unknown")
