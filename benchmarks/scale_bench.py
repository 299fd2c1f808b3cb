"""Scale-out figures: trainer tokens/s on 1 vs N ranks, rollout tokens/s on 1 vs N engine replicas,
and the time to sync a 0.5B-class model's weights into every replica. Prints JSON (and writes --out).

    # N = every visible GPU (NCCL; Qwen2-0.5B shape with random weights, built locally: no hub)
    python benchmarks/scale_bench.py --device cuda --out benchmarks/results/scale_bench_2gpu.json
    python benchmarks/scale_bench.py --device cuda --out benchmarks/results/scale_bench_4gpu.json  # 4 GPUs
    # CPU smoke run (gloo; the tiny test model)
    python benchmarks/scale_bench.py --device cpu

Trainer: one PPO/GRPO update (old-logprob pass + forward/backward + AdamW) of a synthetic batch, through
trainer/distributed/data_parallel.py (FSDP2) with world size 1 and then N; the batch grows with N (32 samples a GPU) so
every rank keeps a full micro-batch. Rollout: ``engine_batch`` x N concurrent requests with distinct
attempt keys through agentloop/engine/replicas.py (one replica runs them in N waves, N replicas in
one each). Sync (``--only-sync`` measures just this): trainer/distributed/weight_sync.py
with N ranks and N replicas colocated (CUDA IPC; ``weight_sync.sync_s``) and with 1 rank and 1 replica
on different GPUs (NCCL broadcast; ``weight_sync_split.sync_s``); as a baseline the old path,
``EngineReplicaPool.update_weights`` of the bf16 weights (``ray.put`` once, every replica loads) and
the same from the trainer ranks (``named_weights`` gathered to rank 0, then the pool).

    python benchmarks/scale_bench.py --device cuda --only-sync --out benchmarks/results/weight_sync_2gpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import result_file


def _model(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    if args.device == "cuda":
        from random_model import build_random_model

        return str(build_random_model("qwen2-0.5b"))
    from tests.tiny_model import build_tiny_model

    return str(build_tiny_model(Path(tempfile.gettempdir()) / "agentloop-scale-bench-tiny"))


def _batch(n: int, prompt_len: int, response_len: int, seed: int = 0) -> Any:
    from agentloop.types import Triplet
    from trainer.batch import build_batch

    rng = random.Random(seed)
    triplets = []
    for i in range(n):  # lengths vary 50-100% so the token balancing matters
        p = rng.randint(prompt_len // 2, prompt_len)
        r = rng.randint(response_len // 2, response_len)
        triplets.append(
            Triplet(
                prompt_ids=[rng.randrange(3, 30000) for _ in range(p)],
                response_ids=[rng.randrange(3, 30000) for _ in range(r)],
                reward=float(rng.random() < 0.5),
                metadata={"group_id": i // 4},
            )
        )
    batch, _ = build_batch(triplets, max_prompt_length=prompt_len, max_response_length=response_len)
    return batch


def _config(model: str, n: int, args: argparse.Namespace) -> Any:
    from trainer.config import TrainerConfig

    return TrainerConfig.from_dict(
        {
            "data": {
                "train_batch_size": n // 4,
                "max_prompt_length": args.prompt_len,
                "max_response_length": args.response_len,
            },
            "actor_rollout_ref": {
                "model": {"path": model},
                "rollout": {"n": 4},
                "actor": {
                    "ppo_mini_batch_size": n // 4,
                    "ppo_max_token_len_per_gpu": args.token_budget,
                    "fsdp_config": _fsdp_config(args),
                },
            },
            "trainer": {"device": args.device},
            "placement": {"cpu_binding": args.cpu_binding},
        }
    )


def _fsdp_config(args: argparse.Namespace) -> dict[str, Any]:
    """The trainer ranks' fsdp_config from ``--no-reshard``, ``--grad-sync-per-mini-batch``,
    ``--fsdp-size``, ``--param-dtype``, ``--reduce-dtype``, ``--layers-per-unit`` and
    ``--skip-fsdp-when-replicated`` (dp_phases.py passes no such flag: its ``--override`` sets the key)."""
    return {
        "reshard_after_forward": not args.no_reshard,
        "grad_sync_per_micro_batch": not args.grad_sync_per_mini_batch,
        "fsdp_size": args.fsdp_size,
        "mixed_precision": {"param_dtype": args.param_dtype, "reduce_dtype": args.reduce_dtype},
        "layers_per_unit": getattr(args, "layers_per_unit", 1),
        "skip_fsdp_when_replicated": getattr(args, "skip_fsdp_when_replicated", False),
    }


def _busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of ``(start, end)`` intervals given in microseconds."""
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return busy / 1e6


def profiled_update(actor: Any, batch: Any, table_rows: int = 12) -> dict[str, Any]:
    """One ``actor.update(batch)`` under torch.profiler (every rank must call it): its wall time, the
    GPU's busy time (the union of its kernels' intervals; wall minus busy is time the GPU waited on the
    CPU or on other ranks), the busy time of compute and of NCCL kernels, and two op tables of the top
    ``table_rows``: ``table`` by device time, ``cpu_table`` by CPU time (children included)."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    gpu = torch.cuda.is_available()
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    sync()
    if dist.is_initialized():
        dist.barrier()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        actor.update(batch)
        sync()
        wall = time.perf_counter() - t0
    cuda = torch.autograd.DeviceType.CUDA
    kernels = [e for e in prof.events() if getattr(e, "device_type", None) == cuda]

    def busy(nccl: bool | None) -> float:
        chosen = [e for e in kernels if nccl is None or ("nccl" in e.name.lower()) == nccl]
        return round(_busy_seconds([(e.time_range.start, e.time_range.end) for e in chosen]), 4)

    return {
        "wall_s": round(wall, 4),
        "gpu_busy_s": busy(None),
        "compute_busy_s": busy(False),
        "nccl_busy_s": busy(True),
        "kernels": len(kernels),
        "table": prof.key_averages().table(sort_by="self_device_time_total", row_limit=table_rows),
        "cpu_table": prof.key_averages().table(sort_by="cpu_time_total", row_limit=table_rows),
    }


def _process_cpus(_actor: Any = None) -> dict[str, Any]:
    """Where a GPU process (a DPWorker rank, an engine replica: through their ``call``) may run: its
    CPUs, and its GPU's PCI address and NUMA node."""
    from agentloop.cpu_binding import cuda_pci_address, pci_numa_node

    cpus = sorted(os.sched_getaffinity(0))
    out: dict[str, Any] = {"cpus": len(cpus), "first_cpu": cpus[0], "last_cpu": cpus[-1]}
    if torch.cuda.is_available():
        address = cuda_pci_address(0)
        out.update(gpu=address, gpu_numa_node=pci_numa_node(address))
    return out


def _update_at(worker: Any, batch: Any) -> tuple[float, float]:
    """A DPWorker's update (through ``worker.call``), with the wall-clock times it began and ended."""
    start = time.time()
    worker._ready().update(batch)
    return start, time.time()


async def _rank_times(group: Any, batch: Any, reps: int) -> list[dict[str, Any]]:
    """``reps`` updates as ``group.update.remote`` runs them (the batch put once, every rank called),
    each rank timing its own: where a Ray update's time goes beyond the ranks' work (the calls reaching
    the ranks, the ranks' spread, the answers coming back)."""
    import ray

    out = []
    for _ in range(reps):
        t0 = time.time()
        ref = ray.put(batch)
        spans = await asyncio.gather(*[w.call.remote(_update_at, ref) for w in group.workers])
        wall = time.time() - t0
        out.append(
            {
                "wall_s": round(wall, 4),
                "rank_start_s": [round(a - t0, 4) for a, _ in spans],
                "rank_update_s": [round(b - a, 4) for a, b in spans],
                "answered_after_last_rank_s": round(wall - max(b - t0 for _, b in spans), 4),
            }
        )
    return out


def _set_threads(worker: Any, threads: int) -> int:
    """Set a rank's torch intra-op threads (0: as ``DPWorker.setup`` set them); the count."""
    setup = worker.extensions.setdefault("setup_threads", torch.get_num_threads())
    torch.set_num_threads(threads or setup)
    return torch.get_num_threads()


def _unfreeze_gc(worker: Any) -> None:
    import gc

    gc.unfreeze()


def _freeze_gc(worker: Any) -> int:
    """Collect, then move every object the rank holds into the garbage collector's permanent
    generation (later collections skip them); how many were frozen."""
    import gc

    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def thread_counters() -> dict[str, float]:
    """The calling thread's CPU seconds, its context switches (voluntary: it waited, e.g. on the GPU
    or a collective; involuntary: the scheduler gave its CPU to another thread) and its niceness (Ray
    starts workers at 15, torchrun's ranks inherit the shell's). Zeros where Linux's /proc is absent."""
    import threading

    out = {"cpu_s": time.thread_time(), "voluntary": 0.0, "involuntary": 0.0, "nice": 0.0}
    try:
        status = Path("/proc/thread-self/status").read_text().splitlines()
    except OSError:
        return out
    fields = dict(line.split(":", 1) for line in status if ":" in line)
    out["voluntary"] = float(fields.get("voluntary_ctxt_switches", 0))
    out["involuntary"] = float(fields.get("nonvoluntary_ctxt_switches", 0))
    out["nice"] = float(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
    return out


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """``thread_counters`` between two readings: CPU seconds and switches spent, the niceness after."""
    return {
        "main_cpu_s": round(after["cpu_s"] - before["cpu_s"], 4),
        "voluntary_switches": int(after["voluntary"] - before["voluntary"]),
        "involuntary_switches": int(after["involuntary"] - before["involuntary"]),
        "nice": int(after["nice"]),
    }


def _set_nice(worker: Any, nice: int | None) -> dict[str, Any]:
    """Every thread of a rank to niceness ``nice``; None puts each back to what it had before the
    first call (a thread started since then: to what the main thread had). Lowering it needs
    CAP_SYS_NICE, so ``set`` says whether every thread took it."""
    import threading

    saved: dict[int, int] = worker.extensions.setdefault("saved_nice", {})
    if not os.path.isdir("/proc/self/task"):
        return {"nice": nice, "set": False}
    main = threading.main_thread().native_id
    baseline = worker.extensions.setdefault("baseline_nice", os.getpriority(os.PRIO_PROCESS, main or 0))
    ok = True
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        try:
            if nice is not None:
                saved.setdefault(tid, os.getpriority(os.PRIO_PROCESS, tid))
            os.setpriority(os.PRIO_PROCESS, tid, saved.get(tid, baseline) if nice is None else nice)
        except ProcessLookupError:
            continue  # the thread ended meanwhile
        except PermissionError:
            ok = False
    return {"nice": nice, "set": ok}


class _GcClock:
    """Wall time the garbage collector spends, and its collections by generation, while installed."""

    def __init__(self) -> None:
        self.seconds, self.by_generation, self._t0 = 0.0, [0, 0, 0], 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0
            self.by_generation[info["generation"]] += 1


def _update_loop(worker: Any, batch: Any, reps: int) -> list[dict[str, Any]]:
    """``reps`` updates timed inside a rank, as dp_phases times them under torchrun (synchronized,
    ranks lined up by a barrier): the rank's own update time, without Ray's call or answer, and the
    garbage collector's share of it."""
    import gc

    import torch.distributed as dist

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    actor, out = worker._ready(), []
    for _ in range(reps):
        sync()
        dist.barrier()
        clock = _GcClock()
        gc.callbacks.append(clock)
        before = thread_counters()
        t0 = time.perf_counter()
        try:
            actor.update(batch)
            sync()
        finally:
            gc.callbacks.remove(clock)
        out.append(
            {
                "s": round(time.perf_counter() - t0, 4),
                "gc_s": round(clock.seconds, 4),
                "gc_collections": clock.by_generation,
                **counter_deltas(before, thread_counters()),
            }
        )
    return out


@dataclass(frozen=True)
class _Leg:
    """One setting of :func:`_thread_sweep`: intra-op threads (0: as setup set them), whether the
    rank's objects are frozen out of the garbage collector, the niceness of its threads (None: Ray's)."""

    threads: int
    frozen: bool = False
    nice: int | None = None


async def _thread_sweep(
    group: Any, batch: Any, sweep: list[int], reps: int, freeze_gc: bool, nice: int | None = None
) -> list[dict[str, Any]]:
    """For each intra-op thread count in ``sweep`` (0: as setup set it), ``reps`` updates through
    ``group.update.remote`` and ``reps`` more looped inside every rank: whether a rank's threads, its
    garbage collector, its niceness or Ray's calls make a Ray update slower than the same update under
    torchrun. ``freeze_gc`` adds a leg, at the last thread count, with every rank's objects frozen;
    ``nice`` one with every rank thread at that niceness. The ranks are left as they were (threads
    as setup set them, nothing frozen, Ray's niceness)."""
    import ray

    ref = ray.put(batch)
    legs = [_Leg(t) for t in sweep] + ([_Leg(sweep[-1], frozen=True)] if freeze_gc else [])
    legs += [_Leg(sweep[-1], nice=nice)] if nice is not None else []
    try:
        return [await _sweep_leg(group, batch, ref, leg, reps) for leg in legs]
    finally:
        await asyncio.gather(*[w.call.remote(_set_threads, 0) for w in group.workers])
        await asyncio.gather(*[w.call.remote(_unfreeze_gc) for w in group.workers])
        restored = await asyncio.gather(*[w.call.remote(_set_nice, None) for w in group.workers])
        if not all(r["set"] for r in restored):  # back to a lower niceness needs CAP_SYS_NICE
            print(
                "warning: the ranks' niceness could not be restored; later figures ran at --rank-nice",
                file=sys.stderr,
            )


async def _sweep_leg(group: Any, batch: Any, ref: Any, leg: _Leg, reps: int) -> dict[str, Any]:
    """One leg of :func:`_thread_sweep`."""
    counts = await asyncio.gather(*[w.call.remote(_set_threads, leg.threads) for w in group.workers])
    gc_setting = _freeze_gc if leg.frozen else _unfreeze_gc  # a leg after the frozen one starts thawed
    await asyncio.gather(*[w.call.remote(gc_setting) for w in group.workers])
    nice = await asyncio.gather(*[w.call.remote(_set_nice, leg.nice) for w in group.workers])
    await group.update.remote(batch)  # a first update at this setting, untimed
    through_ray = []
    for _ in range(reps):
        t0 = time.perf_counter()
        await group.update.remote(batch)
        through_ray.append(round(time.perf_counter() - t0, 4))
    loops = await asyncio.gather(*[w.call.remote(_update_loop, ref, reps) for w in group.workers])
    slowest = [max(rank[i]["s"] for rank in loops) for i in range(reps)]
    by_rank = {  # each rank's figure, a list over the reps
        f"in_rank_{key}": [[rep[key] for rep in rank] for rank in loops]
        for key in ("main_cpu_s", "voluntary_switches", "involuntary_switches")
    }
    return {
        "threads": counts,
        "gc_frozen": leg.frozen,
        "nice": [rank[0]["nice"] for rank in loops],
        "nice_set": all(n["set"] for n in nice) if leg.nice is not None else None,
        "ray_update_s": through_ray,
        "ray_update_s_median": statistics.median(through_ray),
        "in_rank_update_s": [[rep["s"] for rep in rank] for rank in loops],
        "in_rank_gc_s": [[rep["gc_s"] for rep in rank] for rank in loops],
        "in_rank_gc_collections": [[rep["gc_collections"] for rep in rank] for rank in loops],
        **by_rank,
        "in_rank_slowest_s_median": statistics.median(slowest),
    }


def _profile_rank(worker: Any, batch: Any) -> dict[str, Any]:
    """``profiled_update`` in a DPWorker rank (through ``worker.call``)."""
    return profiled_update(worker._ready(), batch)


async def _train_tokens_per_s(
    model: str, world: int, args: argparse.Namespace, share: float
) -> dict[str, Any]:
    from trainer.distributed.data_parallel import DataParallelGroup

    batch = _batch(args.batch, args.prompt_len, args.response_len)
    opts = {"num_gpus": share, "num_cpus": 0} if args.device == "cuda" else {"num_cpus": 0}
    group = DataParallelGroup.create(
        _config(model, args.batch, args), model, args.device, world, actor_options=lambda r: opts
    )
    profiles = None
    try:
        placement = await asyncio.gather(*[w.call.remote(_process_cpus) for w in group.workers])
        await group.update.remote(batch)  # warm-up (allocations, kernels)
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            await group.update.remote(batch)
            times.append(time.perf_counter() - t0)
        rank_times = await _rank_times(group, batch, args.reps) if args.rank_times else None
        sweep = (
            await _thread_sweep(
                group, batch, args.rank_threads, args.reps, args.rank_gc_freeze, args.rank_nice
            )
            if args.rank_threads
            else None
        )
        if args.profile_trainer:  # after the timed updates: one more, profiled on every rank
            profiles = await asyncio.gather(*[w.call.remote(_profile_rank, batch) for w in group.workers])
    finally:
        group.shutdown()
    tokens = int(batch.attention_mask.sum())
    best = statistics.median(times)
    out: dict[str, Any] = {
        "tokens_per_update": tokens,
        "update_s": best,
        "update_s_all": times,
        "tokens_per_s": tokens / best,
        "rank_cpus": placement,
    }
    if rank_times is not None:
        out["rank_times"] = rank_times
    if sweep is not None:
        out["thread_sweep"] = sweep
    if profiles is not None:
        out["profiled_update_by_rank"] = profiles
    return out


async def _rollout_tokens_per_s(
    model: str, replicas: int, args: argparse.Namespace, batch_submit: bool = True
) -> dict[str, Any]:
    from agentloop.engine.base import SamplingParams
    from agentloop.engine.replicas import EngineReplicaPool

    pool = EngineReplicaPool.create(
        model, replicas, args.device, cpu_binding=args.cpu_binding, max_batch_size=args.engine_batch
    )
    pool.batch_submit = batch_submit
    rng = random.Random(1)
    sampling = SamplingParams(temperature=1.0, max_tokens=args.gen_tokens, ignore_eos=True, seed=0)
    try:

        async def wave(tag: str) -> tuple[int, float, dict[str, Any]]:
            prompts = [[rng.randrange(3, 30000) for _ in range(64)] for _ in range(args.requests)]
            before = await pool.replica_stats()
            done_at: list[float] = [0.0] * replicas  # when each replica's last result reached the driver

            async def one(i: int, prompt: list[int]) -> int:
                rid = f"{tag}-{i}/attempt/req-0"
                out = await pool.generate(prompt, sampling, request_id=rid)
                idx = pool.pick(rid)  # the attempt's sticky replica
                done_at[idx] = max(done_at[idx], time.perf_counter() - t0)
                return len(out.token_ids)

            t0 = time.perf_counter()
            counts = await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])
            wall = time.perf_counter() - t0
            after = await pool.replica_stats()
            engine = {  # per replica: its engine's own step time in this wave, against the wall time
                k: [round(a.get(k, 0) - b.get(k, 0), 4) for a, b in zip(after, before, strict=True)]
                for k in ("step_s", "prefill_s", "prefill_batches", "decode_s", "decode_steps")
            }
            return sum(counts), wall, {"replica_done_s": [round(d, 4) for d in done_at], **engine}

        replica_cpus = await asyncio.gather(*[r.call.remote(_process_cpus) for r in pool.replicas])
        await wave("warm")  # CUDA-graph captures, allocator
        settled_s = 0.0
        if not args.no_settle:  # the replicas' idle captures of the other batch sizes, before any timed wave
            from engine_bench import idle_captures_settled

            settled_s = await idle_captures_settled(pool.replica_stats)
        waves = [await wave(f"timed{i}") for i in range(args.reps)]
        rates = [tokens / wall for tokens, wall, _ in waves]
        return {
            "generated_tokens": waves[0][0],
            "wall_s": statistics.median(w for _, w, _ in waves),
            "tokens_per_s": statistics.median(rates),
            "tokens_per_s_waves": rates,
            "routed": pool.stats()["routed"],
            "waves": [detail for _, _, detail in waves],
            "idle_captures_settled_s": round(settled_s, 2),
            "replica_cpus": replica_cpus,
        }
    finally:
        await pool.stop()
        import ray

        for r in pool.replicas:
            ray.kill(r)


def _engine_sums(replica: Any) -> dict[str, float]:
    """Per-tensor float64 sums of a replica's engine weights (runs inside the replica via ``call``)."""
    return {k: float(v.detach().cpu().double().sum()) for k, v in replica.engine.model.state_dict().items()}


def _check(trained: dict[str, torch.Tensor], sums: dict[str, float], dtype: torch.dtype) -> bool:
    """True when the engine holds the trainer's weights (as cast to the engine's dtype)."""
    return all(float(v.to(dtype).double().sum()) == sums[k] for k, v in trained.items())


async def _new_sync(group: Any, pool: Any, args: argparse.Namespace) -> dict[str, Any]:
    """trainer/distributed/weight_sync.py: warm-up (setup + first sync), then ``args.reps`` timed syncs."""
    from trainer.distributed.weight_sync import WeightSync

    sync = WeightSync(group, pool)
    try:
        await sync.sync()
        reports = [await sync.sync() for _ in range(args.reps)]
        assert sync.layout is not None
        return {
            "sync_s": statistics.median(r.seconds for r in reports),
            "gather_s": statistics.median(r.gather_s for r in reports),
            "transfer_s": statistics.median(r.transfer_s for r in reports),
            "all_s": [r.seconds for r in reports],
            "gbytes_sent": reports[0].bytes / 1e9,
            "buckets": len(sync.layout.buckets),
            "ipc_replicas": reports[0].ipc_replicas,
            "broadcast_replicas": reports[0].broadcast_replicas,
        }
    finally:
        await sync.close()


async def _weight_sync(
    model: str, args: argparse.Namespace, on_direct: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    """Colocated (rank i and replica i on GPU i): the new path (CUDA IPC) and the old one (object store).
    ``on_direct`` gets the new path's figures before the slow baseline runs, so a time limit hit there
    keeps them."""
    import ray

    from agentloop.engine.replicas import EngineReplicaPool
    from trainer.distributed.data_parallel import DataParallelGroup

    bundles = None

    def colocated(i: int) -> dict[str, Any]:
        """Rank i and replica i share GPU i: a bundle per GPU, half of it each (Ray would otherwise
        pack both halves of two actors onto one GPU)."""
        if bundles is None:
            return {"num_cpus": 0}
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(bundles, placement_group_bundle_index=i)
        return {"num_gpus": 0.5, "num_cpus": 0, "scheduling_strategy": strategy}

    n = args.gpus
    if args.device == "cuda":
        from ray.util.placement_group import placement_group

        bundles = placement_group([{"GPU": 1}] * n, strategy="PACK")
        ray.get(bundles.ready())
    pool = EngineReplicaPool.create(model, n, args.device, actor_options=colocated, max_batch_size=8)
    group = DataParallelGroup.create(
        _config(model, args.batch, args), model, args.device, n, actor_options=colocated
    )
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    try:
        new = await _new_sync(group, pool, args)
        weights = await group.named_weights.remote(dtype)
        sums = await asyncio.gather(*[r.call.remote(_engine_sums) for r in pool.replicas])
        new["verified"] = all(_check(weights, s, dtype) for s in sums)
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        result = {"replicas": n, "weights_gb": nbytes / 1e9, "dtype": str(dtype)}
        result |= {"direct": new, "sync_s": new["sync_s"]}  # CUDA IPC on GPUs; gloo broadcast on CPU
        on_direct(result)
        await pool.update_weights(weights)  # warm-up
        pool_times, full_times = [], []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            await pool.update_weights(weights)
            pool_times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await pool.update_weights(await group.named_weights.remote(dtype))
            full_times.append(time.perf_counter() - t0)
        return result | {
            "baseline_object_store": {
                "pool_sync_s": statistics.median(pool_times),
                "gather_and_sync_s": statistics.median(full_times),
            }
        }
    finally:
        group.shutdown()
        await pool.stop()
        for r in pool.replicas:
            ray.kill(r)
        if bundles is not None:
            ray.util.remove_placement_group(bundles)


async def _split_sync(model: str, args: argparse.Namespace) -> dict[str, Any]:
    """Split: 1 trainer rank on GPU 0, 1 replica on GPU 1; the new path broadcasts over NCCL."""
    import ray

    from agentloop.engine.replicas import EngineReplicaPool
    from trainer.distributed.data_parallel import DataParallelGroup

    opts = {"num_gpus": 1, "num_cpus": 0} if args.device == "cuda" else {"num_cpus": 0}
    group = DataParallelGroup.create(
        _config(model, args.batch, args), model, args.device, 1, actor_options=lambda r: opts
    )
    pool = EngineReplicaPool.create(model, 1, args.device, actor_options=lambda i: opts, max_batch_size=8)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    try:
        new = await _new_sync(group, pool, args)
        weights = await group.named_weights.remote(dtype)
        new["verified"] = _check(weights, await pool.replicas[0].call.remote(_engine_sums), dtype)
        return {"replicas": 1, "train_ranks": 1, "broadcast": new, "sync_s": new["sync_s"]}
    finally:
        group.shutdown()
        await pool.stop()
        for r in pool.replicas:
            ray.kill(r)


TARGETS = {  # 2 GPUs: the first scale-out targets; 4 GPUs: issue 20's
    2: {"trainer": 1.8, "rollout": 1.8, "sync_s": 1.0},
    4: {"trainer": 3.5, "rollout": 3.6, "sync_s": 0.5},
}


async def main() -> None:
    from agentloop.cpu_binding import CpuBinding, numa_node_count

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    ap.add_argument(
        "--model", default=None, help="HF folder; default: Qwen2-0.5B shape (cuda) or the tiny model (cpu)"
    )
    ap.add_argument("--batch", type=int, default=None, help="samples per update (a multiple of 4)")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--response-len", type=int, default=None)
    ap.add_argument("--token-budget", type=int, default=None, help="ppo_max_token_len_per_gpu")
    ap.add_argument("--requests", type=int, default=None, help="concurrent rollout requests")
    ap.add_argument("--gen-tokens", type=int, default=None, help="tokens generated per request")
    ap.add_argument("--engine-batch", type=int, default=None, help="engine max_batch_size")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--no-reshard", action="store_true", help="fsdp_config.reshard_after_forward false (trainer ranks)"
    )
    ap.add_argument(
        "--grad-sync-per-mini-batch",
        action="store_true",
        help="fsdp_config.grad_sync_per_micro_batch false: one gradient reduce-scatter per mini-batch",
    )
    ap.add_argument(
        "--fsdp-size",
        type=int,
        default=-1,
        help="fsdp_config.fsdp_size: ranks sharing one copy of the model (-1 all: FSDP; 1: replicated)",
    )
    ap.add_argument(
        "--layers-per-unit",
        type=int,
        default=1,
        help="fsdp_config.layers_per_unit: consecutive decoder layers in one FSDP unit (trainer ranks)",
    )
    ap.add_argument(
        "--skip-fsdp-when-replicated",
        action="store_true",
        help="fsdp_config.skip_fsdp_when_replicated: with --fsdp-size 1 (and on one rank) whole copies "
        "trained without FSDP2, gradients summed before each step in one all-reduce per 256 MiB bucket",
    )
    for name, what in (("param", "parameters are all-gathered"), ("reduce", "gradients are reduced")):
        ap.add_argument(
            f"--{name}-dtype",
            choices=["fp32", "bf16"],
            default="fp32",
            help=f"fsdp_config.mixed_precision.{name}_dtype: the dtype {what} in",
        )
    ap.add_argument(
        "--only-sync", action="store_true", help="measure the weight sync only (skip trainer, rollout)"
    )
    ap.add_argument(
        "--no-split-sync", action="store_true", help="skip the weight sync into replicas on GPUs of their own"
    )
    ap.add_argument(
        "--profile-trainer",
        action="store_true",
        help="after the timed updates, one more under torch.profiler on every rank (GPU busy vs wall)",
    )
    ap.add_argument(
        "--rank-times",
        action="store_true",
        help="after the timed updates, --reps more with each rank timing its own update (where Ray's time goes)",
    )
    ap.add_argument(
        "--rank-threads",
        type=lambda text: [int(t) for t in text.split(",")],
        default=None,
        help="after the timed updates, for each of these intra-op thread counts a rank (comma-separated; "
        "0: as DPWorker.setup sets them), --reps updates through Ray and --reps looped inside the ranks",
    )
    ap.add_argument(
        "--rank-gc-freeze",
        action="store_true",
        help="with --rank-threads: a last leg with every rank's objects frozen out of the garbage collector",
    )
    ap.add_argument(
        "--rank-nice",
        type=int,
        default=None,
        help="with --rank-threads: a last leg with every rank thread at this niceness (Ray starts workers "
        "at 15; lowering it needs CAP_SYS_NICE, the leg reports nice_set)",
    )
    ap.add_argument(
        "--no-settle",
        action="store_true",
        help="time the rollout waves right after the warm-up wave, without waiting for the replicas' idle "
        "CUDA-graph captures to end (then a wave may stop for a capture)",
    )
    ap.add_argument(
        "--cpu-binding",
        choices=get_args(CpuBinding),
        default="none",
        help="placement.cpu_binding of the trainer ranks and the engine replicas (agentloop/cpu_binding.py)",
    )
    ap.add_argument("--only-rollout", action="store_true", help="measure only rollout on 1 vs N replicas")
    ap.add_argument("--only-trainer", action="store_true", help="measure only the trainer on 1 vs N ranks")
    ap.add_argument(
        "--gpus", type=int, default=None, help="N: ranks and replicas to scale to (default: every GPU)"
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    for flag, given in (
        ("--rank-gc-freeze", args.rank_gc_freeze),
        ("--rank-nice", args.rank_nice is not None),
    ):
        if given and not args.rank_threads:
            raise SystemExit(f"{flag} adds a leg to --rank-threads' sweep: give --rank-threads too")
    if args.skip_fsdp_when_replicated and args.fsdp_size != 1 and args.gpus != 1:
        # the 1-rank leg would run without FSDP2 and the N-rank one with it: two code paths in one ratio
        raise SystemExit(
            "--skip-fsdp-when-replicated compares like with like only with --fsdp-size 1 (or --gpus 1)"
        )
    gpu = args.device == "cuda"
    n_gpus = torch.cuda.device_count() if gpu else 0
    args.gpus = args.gpus or (n_gpus if gpu else 2)
    low = 1 if args.only_trainer else 2  # one trainer rank alone: a rank's own update, Ray vs torchrun
    if args.gpus < low or (gpu and args.gpus > n_gpus):
        raise SystemExit(
            f"--gpus must be in [{low}, {n_gpus if gpu else 'any'}] (GPUs visible: {n_gpus}), got {args.gpus}"
            + ("; --gpus 1 needs --only-trainer" if args.gpus == 1 else "")
        )
    n = args.gpus
    engine_batch = args.engine_batch or (64 if gpu else 8)
    defaults = dict(batch=32 * n if gpu else 4 * n, prompt_len=512 if gpu else 32, response_len=512 if gpu else 16,
                    token_budget=16384 if gpu else 256, requests=engine_batch * n, gen_tokens=128 if gpu else 8,
                    engine_batch=engine_batch)  # fmt: skip
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    import ray

    root = str(Path(__file__).resolve().parents[1])  # Ray workers import agentloop/trainer from here
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    ray.init(num_gpus=n_gpus, include_dashboard=False, configure_logging=False, log_to_driver=False)
    model = _model(args)
    head = result_file.header(
        "scale_bench", gpu="auto" if gpu else None, torch=torch.__version__, ray=ray.__version__
    )
    result: dict[str, Any] = {
        "device": args.device,
        "gpus": [torch.cuda.get_device_name(i) for i in range(n_gpus)],
        "model": model,
        "settings": {k: getattr(args, k) for k in defaults},
        "fsdp_config": _fsdp_config(args),
        "cpu_binding": args.cpu_binding,
        "numa_nodes": numa_node_count(),
        "scale_to": n,
    }
    target = TARGETS.get(n, TARGETS[2])

    def save() -> None:  # after each part, so a later failure keeps the figures measured so far
        if args.out:
            result_file.write(args.out, result_file.result(head, result))

    if not args.only_sync and not args.only_rollout:
        t1 = await _train_tokens_per_s(model, 1, args, share=1.0)
        result["trainer"] = {"1": t1}
        if n > 1:
            tn = await _train_tokens_per_s(model, n, args, share=1.0)
            speedup = tn["tokens_per_s"] / t1["tokens_per_s"]
            result["trainer"].update({str(n): tn, "speedup": speedup, "target": target["trainer"]})
        save()
    if not args.only_sync and not args.only_trainer:
        r1 = await _rollout_tokens_per_s(model, 1, args)
        rn = await _rollout_tokens_per_s(model, n, args)
        result["rollout"] = {
            "1": r1,
            str(n): rn,
            "speedup": rn["tokens_per_s"] / r1["tokens_per_s"],
            "target": target["rollout"],
            "submission": "one streaming actor call per replica per event-loop tick",
        }
        save()
        if args.only_rollout:  # A/B: one actor call per request, as before batched submission
            a1 = await _rollout_tokens_per_s(model, 1, args, batch_submit=False)
            an = await _rollout_tokens_per_s(model, n, args, batch_submit=False)
            result["rollout_one_call_per_request"] = {
                "1": a1,
                str(n): an,
                "speedup": an["tokens_per_s"] / a1["tokens_per_s"],
            }
            save()
    if not args.only_rollout and not args.only_trainer:

        def direct(part: dict[str, Any]) -> None:
            result["weight_sync"] = {**part, "target_s": target["sync_s"]}
            save()

        direct(await _weight_sync(model, args, direct))
        if not args.no_split_sync:
            result["weight_sync_split"] = {**await _split_sync(model, args), "target_s": 1.0}
            save()
    sys.stdout.write(json.dumps(result_file.result(head, result), indent=2) + "\n")
    ray.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
