"""Weight sync from the data-parallel trainer ranks into every engine replica, without the object store.

    every rank: state_dict() ─► full_tensor() per DTensor (FSDP2 all-gather: a collective) ─► cast
                to the engine's dtype and copy into a few flat buckets on its own GPU
    colocated replica j (same GPU as rank i):  CUDA IPC — rank i sends one small handle per bucket
                through Ray, replica j maps the buckets, copies them into its parameters, lets go
    other replicas: rank 0 broadcasts the buckets over a weight-sync process group
                {trainer rank 0, those replicas} (NCCL on GPUs, gloo on CPU); each replica receives
                into buckets laid out from the manifest and loads them

Why this design
* The old path (``named_weights`` to rank 0's CPU, pickled back to the driver, ``ray.put``, every
  replica ``ray.get``) copies 1.26 GB device->host->store->host->device per replica: seconds. Here
  the bytes never leave the GPUs: IPC is one device-to-device copy per replica; NCCL a broadcast.
* IPC for colocated replicas, because NCCL refuses two ranks of one communicator on one GPU and
  every rank already holds the full weights after ``full_tensor()``: rank i feeds replica i, all
  replicas load in parallel.
* The weight-sync group is its own ``ProcessGroupNCCL``/``ProcessGroupGloo`` over its own TCPStore
  (hosted by rank 0), not the default group: the trainer ranks' FSDP group stays untouched and the
  replicas (other processes, other GPUs) join only this one.
* Few big buckets (``bucket_bytes``, 512 MiB by default) instead of one handle or one broadcast per
  tensor: a 0.5B model has ~290 tensors; opening an IPC handle or launching a collective per tensor
  costs more than the copy. Offsets are 256-byte aligned.
* The manifest (names, shapes, dtypes, tied aliases) is exchanged once in ``setup``: the layout is
  fixed, a mismatch fails there with the names that differ, and tied weights (``lm_head`` =
  ``embed_tokens``) are sent once (22% of a Qwen2-0.5B's bytes).
* ``agentloop`` must not import ``trainer``: both actor kinds expose a generic ``call(fn, *args)``
  (vLLM's ``collective_rpc`` pattern) and the functions that run inside them live here.

The bucket layout and the packing are in trainer/distributed/_buckets.py (pure, CPU-testable).

Traps: CUDA IPC does not work with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` on the
trainer side; the buckets are a transient extra copy of the weights (in the engine's dtype) on each
GPU during a sync.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import structlog
import torch

from agentloop.engine.capture import no_graph_capture
from trainer.distributed._buckets import (
    ALIGN_BYTES,
    DEFAULT_BUCKET_BYTES,
    Bucket,
    Entry,
    Layout,
    alloc_buckets,
    entry_index,
    pack,
    pack_one,
    plan_layout,
    unpack,
)

log = structlog.get_logger("agentloop.trainer.weight_sync")

_EXT = "weight_sync"  # key of this module's state in an actor's ``extensions`` dict


# ---------------------------------------------------------------- manifests


@dataclass(frozen=True)
class Manifest:
    """An engine model's state-dict names -> (shape, dtype), and tied names -> the name they share."""

    specs: dict[str, tuple[tuple[int, ...], torch.dtype]]
    aliases: dict[str, str]


def manifest_of(model: torch.nn.Module) -> Manifest:
    """The Manifest of ``model`` (a tied parameter's later names are aliases of its first name)."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    specs = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    return Manifest(specs, aliases)


def send_specs(
    trainer: Mapping[str, tuple[int, ...]], engine: Manifest
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """What to send: the trainer's tensors (name -> shape) in the engine's dtypes, tied aliases once.

    Raises ValueError naming the tensors that differ when the two models are not the same shape."""
    sent = {k for k in trainer if not (k in engine.aliases and engine.aliases[k] in trainer)}
    unknown = sorted(k for k in sent if k not in engine.specs)
    missing = sorted(k for k in engine.specs if k not in trainer and k not in engine.aliases)
    shapes = sorted(
        f"{k}: trainer {tuple(trainer[k])} vs engine {engine.specs[k][0]}"
        for k in sent
        if k in engine.specs and tuple(trainer[k]) != engine.specs[k][0]
    )
    if unknown or missing or shapes:
        raise ValueError(
            "weight sync: the trainer's and the engine's models differ "
            f"(trainer-only tensors {unknown[:3]} [{len(unknown)}], engine-only tensors {missing[:3]} "
            f"[{len(missing)}], shape mismatches {shapes[:3]} [{len(shapes)}]); both must load the same "
            "model (actor_rollout_ref.model.path)"
        )
    return {k: (engine.specs[k][0], engine.specs[k][1]) for k in trainer if k in sent}


def gpu_uuid(device: torch.device) -> str | None:
    """The GPU's UUID (what colocation means, across processes), None on CPU."""
    if device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(device).uuid)


def _state(actor: Any) -> dict[str, Any]:
    ext: dict[str, Any] = actor.extensions.setdefault(_EXT, {})
    return ext


def _join_group(addr: str, port: int, rank: int, size: int, backend: str, timeout_s: float) -> Any:
    """This process's member of the weight-sync group (its own TCPStore, not the default group)."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    tcp = dist.TCPStore(addr, port, size, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    store = dist.PrefixStore("agentloop-weight-sync", tcp)
    pg: Any
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        pg = dist.ProcessGroupNCCL(store, rank, size, options)
        probe = torch.zeros(1, device="cuda")
    else:
        pg = dist.ProcessGroupGloo(store, rank, size, timeout)
        probe = torch.zeros(1)
    _broadcast(pg, [probe])  # rendezvous now, so a broken setup fails in setup, not mid-training
    return pg


def _broadcast(pg: Any, tensors: list[torch.Tensor]) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    with no_graph_capture():  # on a replica, its engine may be capturing a CUDA graph in its thread
        works = [pg.broadcast([t], opts) for t in tensors]
        for w in works:
            w.wait()
        if tensors and tensors[0].is_cuda:
            torch.cuda.synchronize()


# ---------------------------------------------------------------- in a trainer rank (DPWorker.call)


def rank_info(worker: Any) -> dict[str, Any]:
    actor = worker._ready()
    shapes = {k: tuple(v.shape) for k, v in actor.model.state_dict().items()}  # DTensor: global shape
    return {"rank": worker.rank, "device_id": gpu_uuid(actor.device), "shapes": shapes}


def rank_join(worker: Any, addr: str, port: int, size: int, backend: str, timeout_s: float) -> None:
    _state(worker)["group"] = _join_group(addr, port, 0, size, backend, timeout_s)


@torch.no_grad()
def rank_pack(worker: Any, layout: Layout, keep: bool, ipc: bool) -> list[Any] | None:
    """Gather every tensor (all ranks: collective) and, with ``keep``, pack them into buckets held
    until ``rank_release``. With ``ipc`` returns one CUDA IPC handle per bucket."""
    from torch.distributed.tensor import DTensor

    actor = worker._ready()
    buckets = alloc_buckets(layout, actor.device) if keep else []
    index = entry_index(layout)
    for name, value in actor.model.state_dict().items():
        if name not in index:  # a tied alias: the engine shares it
            continue
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if keep:
            pack_one(buckets, index, name, full)
        del full
    if actor.device.type == "cuda":
        torch.cuda.synchronize()
    _state(worker)["buckets"] = buckets
    if not ipc:
        return None
    from torch.multiprocessing.reductions import reduce_tensor

    return [reduce_tensor(b)[1] for b in buckets]


def rank_broadcast(worker: Any) -> None:
    st = _state(worker)
    _broadcast(st["group"], st["buckets"])


def rank_release(worker: Any) -> None:
    _state(worker).pop("buckets", None)


def leave(actor: Any) -> None:
    actor.extensions.pop(_EXT, None)


# ---------------------------------------------------------------- in an engine replica (EngineReplica.call)


def _engine_device(replica: Any) -> torch.device:
    return next(replica.engine.model.parameters()).device


async def replica_info(replica: Any) -> dict[str, Any]:
    return {"device_id": gpu_uuid(_engine_device(replica)), "manifest": manifest_of(replica.engine.model)}


async def replica_join(
    replica: Any, addr: str, port: int, rank: int, size: int, backend: str, timeout_s: float
) -> None:
    pg = await asyncio.to_thread(_join_group, addr, port, rank, size, backend, timeout_s)
    _state(replica)["group"] = pg


async def _load(replica: Any, buckets: list[torch.Tensor], layout: Layout) -> int:
    version = int(await replica.engine.update_weights(unpack(buckets, layout)))
    if buckets[0].is_cuda:
        await asyncio.to_thread(synchronize)  # the copies are done before the buckets go
    return version


def synchronize(device: torch.device | None = None) -> None:
    """``torch.cuda.synchronize(device)`` from a thread beside an engine's: never during one of its
    CUDA graph captures (agentloop/engine/capture.py)."""
    with no_graph_capture():
        torch.cuda.synchronize(device)


async def replica_receive(replica: Any, layout: Layout) -> int:
    device = _engine_device(replica)

    def receive() -> list[torch.Tensor]:
        buckets = alloc_buckets(layout, device)
        _broadcast(_state(replica)["group"], buckets)
        return buckets

    return await _load(replica, await asyncio.to_thread(receive), layout)


async def replica_load_ipc(replica: Any, layout: Layout, handles: list[Any]) -> int:
    device = _engine_device(replica)

    def open_() -> list[torch.Tensor]:
        return open_ipc(handles, device.index or 0)

    return await _load(replica, await asyncio.to_thread(open_), layout)


def open_ipc(handles: list[Any], device_index: int) -> list[torch.Tensor]:
    """The tensors behind ``reduce_tensor`` handles, mapped on this process's ``device_index``."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    out = []
    with no_graph_capture():  # an engine of this process may be capturing a CUDA graph in its thread
        for h in handles:
            args = list(h)
            args[6] = device_index  # the storage device as this process numbers it
            out.append(rebuild_cuda_tensor(*args))
        torch.cuda.synchronize()
    return out


async def replica_weights(replica: Any) -> dict[str, torch.Tensor]:
    """The engine's state dict on CPU (checks and benchmarks)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in replica.engine.model.state_dict().items()}


# ---------------------------------------------------------------- the driver


@dataclass(frozen=True)
class SyncReport:
    """One sync: the new weights version and where the time went."""

    version: int
    seconds: float  # the whole sync, as the trainer waits for it
    gather_s: float  # full_tensor() on every rank + packing into buckets
    transfer_s: float  # IPC loads and the broadcast, replicas in parallel
    bytes: int  # bytes of one copy of the weights (in the engine's dtype)
    ipc_replicas: int
    broadcast_replicas: int

    def metrics(self) -> dict[str, float]:
        return {
            "timing/sync_gather_s": self.gather_s,
            "timing/sync_transfer_s": self.transfer_s,
            "sync/gbytes": self.bytes / 1e9,
        }


def supports(worker: Any, engine: Any) -> bool:
    """True when ``worker`` is a DataParallelGroup and ``engine`` an EngineReplicaPool."""
    from agentloop.engine.replicas import EngineReplicaPool
    from trainer.distributed.data_parallel import DataParallelGroup

    return isinstance(worker, DataParallelGroup) and isinstance(engine, EngineReplicaPool)


class WeightSync:
    """Sync a DataParallelGroup's weights into an EngineReplicaPool (see the module docstring).

    ``await sync()`` (which runs ``setup()`` the first time) after every update; ``close()`` at the end.
    """

    def __init__(
        self, group: Any, pool: Any, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float = 300.0
    ) -> None:
        if not supports(group, pool):
            raise TypeError(
                "WeightSync needs a trainer.distributed.data_parallel.DataParallelGroup and an agentloop EngineReplicaPool, got "
                f"{type(group).__name__} and {type(pool).__name__}; use engine.update_weights otherwise"
            )
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < ALIGN_BYTES:
            raise ValueError(f"bucket_bytes must be an int >= {ALIGN_BYTES}, got {bucket_bytes!r}")
        self.group, self.pool = group, pool
        self.bucket_bytes, self.timeout_s = bucket_bytes, timeout_s
        self.layout: Layout | None = None
        self.ipc_source: dict[int, int] = {}  # replica index -> the rank on its GPU
        self.broadcast: list[int] = []  # replicas in the weight-sync group (member rank: 1 + position)

    async def setup(self) -> None:
        """Exchange manifests, pair colocated replicas with ranks, join the broadcast group."""
        ranks, replicas = self.group.workers, self.pool.replicas
        r_info = await asyncio.gather(*[w.call.remote(rank_info) for w in ranks])
        e_info = await asyncio.gather(*[r.call.remote(replica_info) for r in replicas])
        manifest: Manifest = e_info[0]["manifest"]
        for j, info in enumerate(e_info[1:], start=1):
            if info["manifest"] != manifest:
                raise ValueError(f"weight sync: replica {j} serves a different model than replica 0")
        layout = plan_layout(send_specs(r_info[0]["shapes"], manifest), self.bucket_bytes)
        by_gpu = {info["device_id"]: i for i, info in enumerate(r_info) if info["device_id"] is not None}
        self.ipc_source = {
            j: by_gpu[i["device_id"]] for j, i in enumerate(e_info) if i["device_id"] in by_gpu
        }
        self.broadcast = [j for j in range(len(replicas)) if j not in self.ipc_source]
        if self.broadcast:
            await self._join([r_info[0]["device_id"]] + [e_info[j]["device_id"] for j in self.broadcast])
        self.layout = layout  # set last: a setup that failed runs again on the next sync
        log.info(
            "weight_sync.ready",
            tensors=len(layout.names),
            buckets=len(layout.buckets),
            gbytes=round(layout.nbytes / 1e9, 3),
            ipc=sorted(self.ipc_source),
            broadcast=self.broadcast,
        )

    async def _join(self, devices: list[str | None]) -> None:
        on_gpu = [d is not None for d in devices]
        if any(on_gpu) and not all(on_gpu):
            raise ValueError(
                "weight sync: trainer rank 0 and the replicas it broadcasts to must all be on GPUs or all on "
                f"CPU, got GPU ids {devices}"
            )
        if all(on_gpu) and len(set(devices)) != len(devices):
            raise ValueError(f"weight sync: NCCL needs one GPU per member, got GPU ids {devices}")
        backend, size = ("nccl" if all(on_gpu) else "gloo"), 1 + len(self.broadcast)
        rank0 = self.group.workers[0]
        addr, port = await rank0.address.remote()
        await asyncio.gather(
            rank0.call.remote(rank_join, addr, port, size, backend, self.timeout_s),
            *[
                self.pool.replicas[j].call.remote(
                    replica_join, addr, port, k + 1, size, backend, self.timeout_s
                )
                for k, j in enumerate(self.broadcast)
            ],
        )

    async def sync(self) -> SyncReport:
        """Send the trainer's current weights to every replica; returns the new version and timings."""
        if self.layout is None:
            await self.setup()
        layout = self.layout
        assert layout is not None
        t0 = time.perf_counter()
        sources = set(self.ipc_source.values())
        handles = await asyncio.gather(
            *[
                w.call.remote(
                    rank_pack, layout, i in sources or (i == 0 and bool(self.broadcast)), i in sources
                )
                for i, w in enumerate(self.group.workers)
            ]
        )
        t1 = time.perf_counter()
        calls: list[Any] = []
        order: list[int] = []
        if self.broadcast:
            calls.append(self.group.workers[0].call.remote(rank_broadcast))
            for j in self.broadcast:
                calls.append(self.pool.replicas[j].call.remote(replica_receive, layout))
                order.append(j)
        for j, i in self.ipc_source.items():
            calls.append(self.pool.replicas[j].call.remote(replica_load_ipc, layout, handles[i]))
            order.append(j)
        try:
            results = await asyncio.gather(*calls)
        finally:
            await asyncio.gather(*[w.call.remote(rank_release) for w in self.group.workers])
        versions = [int(v) for v in results[1:]] if self.broadcast else [int(v) for v in results]
        t2 = time.perf_counter()
        version = self.pool.note_sync(versions, t2 - t0)
        report = SyncReport(
            version, t2 - t0, t1 - t0, t2 - t1, layout.nbytes, len(self.ipc_source), len(self.broadcast)
        )
        log.info("weight_sync.done", version=version, seconds=round(report.seconds, 4),
                 gather_s=round(report.gather_s, 4), transfer_s=round(report.transfer_s, 4))  # fmt: skip
        return report

    async def close(self) -> None:
        """Leave the weight-sync group on every member (the actors stay)."""
        if self.layout is None:
            return
        self.layout = None
        await asyncio.gather(
            *[w.call.remote(leave) for w in self.group.workers],
            *[r.call.remote(leave) for r in self.pool.replicas],
            return_exceptions=True,
        )


async def fetch_engine_weights(pool: Any, replica: int = 0) -> dict[str, torch.Tensor]:
    """Replica ``replica``'s engine state dict on CPU (to check a sync)."""
    if not 0 <= replica < len(pool.replicas):
        raise ValueError(f"replica must be in [0, {len(pool.replicas)}), got {replica}")
    return dict(await pool.replicas[replica].call.remote(replica_weights))


__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "Bucket",
    "Entry",
    "Layout",
    "Manifest",
    "SyncReport",
    "WeightSync",
    "alloc_buckets",
    "fetch_engine_weights",
    "gpu_uuid",
    "manifest_of",
    "open_ipc",
    "pack",
    "plan_layout",
    "send_specs",
    "supports",
    "unpack",
]
