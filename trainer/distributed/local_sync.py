"""Weight sync on one GPU: the trainer worker (a Ray actor) and the engine (in the driver) share it.

    trainer worker:  state_dict() ─► cast to the engine's dtype, packed into a few flat buckets on its
                     GPU ─► one CUDA IPC handle per bucket, back to the driver through Ray (bytes)
    driver:          open the handles (the same GPU, by UUID) ─► views per tensor ─►
                     engine.update_weights(views): a device-to-device copy ─► release the buckets

Why: the general path (``worker.named_weights`` → CPU, pickled into Ray's object store, to the
driver, copied back onto the GPU) moves a 0.5B model's 2 GB of fp32 weights through host memory
twice, seconds per step that every step waits for (the async trainer too: it is its critical
path). This is what trainer/distributed/weight_sync.py does for data-parallel ranks and replica pools, for
the default single-GPU layout.

Used when the worker's GPU and the engine's are one device (compared by UUID) and the policy has
no LoRA adapter (its merged weights are made on the CPU); otherwise ``LocalIPCSync.create``
returns None and the trainer keeps the general path. Tied weights (``lm_head`` = ``embed_tokens``)
are sent once: the engine's model is the same architecture, so loading one updates both.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import torch

from trainer.distributed.weight_sync import (
    Layout,
    SyncReport,
    gpu_uuid,
    manifest_of,
    open_ipc,
    pack,
    plan_layout,
    synchronize,
    unpack,
)

# ---------------------------------------------------------------- in the trainer worker


def sent_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict without tied aliases (``lm_head`` = ``embed_tokens`` goes once)."""
    aliases = manifest_of(model).aliases
    return {k: v for k, v in model.state_dict().items() if k not in aliases}


class SharedWeights:
    """The worker side: packs its policy's weights into buckets and keeps them until released."""

    def __init__(self) -> None:
        self.layout: Layout | None = None
        self.dtype: torch.dtype | None = None
        self.buckets: list[torch.Tensor] = []

    @torch.no_grad()
    def share(
        self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype
    ) -> tuple[Layout, list[Any]]:
        """Buckets of every weight (in ``dtype``) on ``device`` and their IPC handles."""
        from torch.multiprocessing.reductions import reduce_tensor

        tensors = sent_tensors(model)
        if self.layout is None or self.dtype != dtype:
            specs = {k: (tuple(v.shape), dtype) for k, v in tensors.items()}
            self.layout, self.dtype = plan_layout(specs), dtype
        self.buckets = pack(tensors, self.layout, device)
        torch.cuda.synchronize(device)
        return self.layout, [reduce_tensor(b)[1] for b in self.buckets]

    def release(self) -> None:
        """Free the buckets (the driver has copied them into the engine)."""
        self.buckets = []


# ---------------------------------------------------------------- in the driver


def engine_target(engine: Any) -> tuple[torch.device, torch.dtype] | None:
    """Where an in-process engine keeps its weights and in which dtype; None when unknown."""
    model = getattr(engine, "model", None)
    if isinstance(model, torch.nn.Module):
        p = next(model.parameters())
        return p.device, p.dtype
    dtype = getattr(engine, "model_dtype", None)
    if isinstance(dtype, torch.dtype) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device()), dtype
    return None


class LocalIPCSync:
    """Sync a ``TrainerWorker``'s weights into an engine on the same GPU (module docstring)."""

    def __init__(self, worker: Any, engine: Any, device: torch.device, dtype: torch.dtype) -> None:
        self.worker, self.engine, self.device, self.dtype = worker, engine, device, dtype

    @classmethod
    async def create(cls, worker: Any, engine: Any) -> LocalIPCSync | None:
        """A sync when ``worker`` and ``engine`` share one GPU and the policy has no LoRA, else None."""
        target = engine_target(engine)
        if target is None or target[0].type != "cuda" or not hasattr(worker, "ipc_info"):
            return None
        info = await worker.ipc_info.remote()
        if info["lora"] or info["gpu"] is None or info["gpu"] != gpu_uuid(target[0]):
            return None
        return cls(worker, engine, *target)

    async def sync(self) -> SyncReport:
        """Send the worker's current weights to the engine; returns the new version and timings."""
        t0 = time.perf_counter()
        layout, handles = await self.worker.share_weights.remote(self.dtype)
        t1 = time.perf_counter()
        try:
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            buckets = await asyncio.to_thread(open_ipc, handles, index)
            version = int(await self.engine.update_weights(unpack(buckets, layout)))
            await asyncio.to_thread(synchronize, self.device)  # copied before the buckets go
            del buckets
        finally:
            await self.worker.release_shared_weights.remote()
        t2 = time.perf_counter()
        return SyncReport(version, t2 - t0, t1 - t0, t2 - t1, layout.nbytes, 1, 0)


__all__ = ["LocalIPCSync", "SharedWeights", "engine_target", "sent_tensors"]
