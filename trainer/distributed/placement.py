"""Where trainer ranks and engine replicas run: a plan from the config, checked against the Ray cluster.

    trainer ranks  = placement.train_ranks or trainer.nnodes x trainer.n_gpus_per_node
    engine replicas = actor_rollout_ref.rollout.replicas
    colocated (placement.colocate): replica i shares rank i's GPU (half a GPU each, one Ray bundle)
    split:                          every rank and every replica has a GPU of its own

GPUs needed: ``max(ranks, replicas)`` colocated, ``ranks + replicas`` split. A request for more GPUs
(or nodes) than ``ray.cluster_resources()`` shows fails at start with PlacementError. On CPU the
ranks are gloo processes and replicas CPU engines; nothing is reserved.

With one rank and one replica nothing here runs: the trainer keeps its single TrainerWorker and an
engine in the driver (the default, unchanged). Otherwise the trainer is a DataParallelGroup (FSDP2,
even with one rank) and, with several replicas, the engine an EngineReplicaPool.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import structlog

from agentloop.errors import ConfigError
from agentloop.logging import write_run_log
from trainer.config import TrainerConfig, engine_kwargs, shard_group_size

log = structlog.get_logger("agentloop.trainer.placement")
T = TypeVar("T")


class PlacementError(ConfigError):
    """The config asks for more GPUs or nodes than the Ray cluster has."""


@dataclass(frozen=True)
class Plan:
    """How many trainer ranks and engine replicas, on which device, colocated or not."""

    device: str  # "cpu" or "cuda"
    train_ranks: int
    replicas: int
    colocate: bool
    nnodes: int

    @property
    def gpu(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def gpus_needed(self) -> int:
        if not self.gpu:
            return 0
        return max(self.train_ranks, self.replicas) if self.colocate else self.train_ranks + self.replicas

    @property
    def scaled(self) -> bool:
        """True when Ray actor groups are needed (more than one rank or replica)."""
        return self.train_ranks > 1 or self.replicas > 1

    def describe(self) -> str:
        how = "colocated" if self.colocate else "split"
        return (
            f"{self.train_ranks} trainer rank(s) + {self.replicas} engine replica(s), {how}, on {self.device}"
        )


def plan_placement(config: TrainerConfig, device: str) -> Plan:
    """The Plan for ``config`` on ``device`` (a resolved device: cpu, cuda or cuda:N)."""
    if not isinstance(config, TrainerConfig):
        raise TypeError(f"plan_placement takes a TrainerConfig, got {type(config).__name__}")
    t, p = config.trainer, config.placement
    ranks = p.train_ranks or t.nnodes * t.n_gpus_per_node
    fsdp_size = config.actor_rollout_ref.actor.fsdp_config.fsdp_size
    try:
        shard_group_size(fsdp_size, ranks)
    except ValueError:
        raise PlacementError(
            f"actor_rollout_ref.actor.fsdp_config.fsdp_size={fsdp_size} must divide the {ranks} trainer "
            "rank(s) (trainer.nnodes x trainer.n_gpus_per_node or placement.train_ranks); set it to a "
            "divisor, or to -1 (or at least the number of ranks) to shard the model over all of them"
        ) from None
    return Plan(
        device="cuda" if device.startswith("cuda") else "cpu",
        train_ranks=ranks,
        replicas=config.actor_rollout_ref.rollout.replicas,
        colocate=p.colocate,
        nnodes=t.nnodes,
    )


def check_cluster(plan: Plan, resources: dict[str, float], alive_nodes: int) -> None:
    """Raise PlacementError when ``resources`` (``ray.cluster_resources()``) cannot hold ``plan``."""
    have = int(resources.get("GPU", 0))
    if plan.gpus_needed > have:
        how = (
            f"max({plan.train_ranks} trainer ranks, {plan.replicas} replicas) colocated"
            if plan.colocate
            else f"{plan.train_ranks} trainer ranks + {plan.replicas} replicas, split"
        )
        raise PlacementError(
            f"placement needs {plan.gpus_needed} GPUs ({how}; trainer ranks = trainer.nnodes x "
            f"trainer.n_gpus_per_node or placement.train_ranks, replicas = actor_rollout_ref.rollout.replicas) "
            f"but the Ray cluster has {have}; lower those numbers, set placement.colocate=true, or join a "
            "bigger cluster with trainer.ray_address"
        )
    if plan.nnodes > alive_nodes:
        raise PlacementError(
            f"trainer.nnodes={plan.nnodes} but the Ray cluster has {alive_nodes} node(s); start the other "
            "nodes with `ray start --address=<head>:6379` first"
        )


GiB = 1024**3
# bytes per parameter a trained model holds on its rank: fp32 weights, fp32 gradients, AdamW's two fp32
# moments (bf16 autocast keeps the master weights in fp32); a frozen reference model: fp32 weights only
_TRAINED_BYTES, _FROZEN_BYTES = 16, 4


def model_parameters(model_path: str | Path) -> int:
    """Parameters of the Hugging Face folder ``model_path``, from its safetensors headers (no weights
    are read); 0 when the folder has none (the memory check is then skipped)."""
    import json
    import struct

    total = 0
    for file in sorted(Path(model_path).glob("*.safetensors")):
        with file.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, info in header.items():
            if name != "__metadata__":
                count = 1
                for dim in info["shape"]:
                    count *= int(dim)
                total += count
    return total


def shard_ranks(config: TrainerConfig, ranks: int) -> int:
    """How many of ``ranks`` trainer ranks share one copy of the model state (``fsdp_config.fsdp_size``,
    -1: all of them); each holds 1/shard_ranks of it."""
    return shard_group_size(config.actor_rollout_ref.actor.fsdp_config.fsdp_size, ranks)


def state_memory(config: TrainerConfig, model_path: str | Path, ranks: int) -> dict[str, float]:
    """GiB of model state per trainer rank (FSDP2 shards it over ``ranks``, or over groups of
    ``fsdp_config.fsdp_size`` of them): the actor, the critic when
    one is configured (its own weights, gradients and AdamW moments, colocated with the actor), the
    frozen reference model when a KL term needs it (a whole copy on every rank). Activations come on top (they depend on the
    micro-batch token budget)."""
    actor = model_parameters(model_path)
    critic_path = config.critic.model.path
    critic = (model_parameters(critic_path) if critic_path else actor) if config.uses_critic else 0
    arr = config.actor_rollout_ref
    ref = actor if (arr.actor.use_kl_loss or config.algorithm.use_kl_in_reward) else 0
    share = shard_ranks(config, ranks)
    out = {
        "actor_gib": actor * _TRAINED_BYTES / share / GiB,
        "critic_gib": critic * _TRAINED_BYTES / share / GiB,
        "ref_gib": ref
        * _FROZEN_BYTES
        / GiB,  # not sharded: a whole copy on every rank (trainer/distributed/data_parallel.py)
    }
    out["total_gib"] = sum(out.values())
    return out


def check_memory(
    config: TrainerConfig, model_path: str | Path, plan: Plan, gpu_gib: float
) -> dict[str, float]:
    """Raise PlacementError when one trainer rank's model state cannot fit its GPU (``gpu_gib``; with
    ``placement.colocate`` and vLLM the engine's ``gpu_memory_utilization`` share is taken first)."""
    need = state_memory(config, model_path, plan.train_ranks)
    rollout = config.actor_rollout_ref.rollout
    engine_share = (
        rollout.gpu_memory_utilization if plan.colocate and rollout.engine_backend == "vllm" else 0.0
    )
    have = gpu_gib * (1.0 - engine_share)
    if need["total_gib"] > have:
        parts = ", ".join(
            f"{k.removesuffix('_gib')} {v:.1f}" for k, v in need.items() if k != "total_gib" and v
        )
        raise PlacementError(
            f"one trainer rank needs {need['total_gib']:.1f} GiB of model state ({parts}; weights, gradients "
            f"and AdamW moments in fp32, sharded over {shard_ranks(config, plan.train_ranks)} rank(s)) but "
            f"has {have:.1f} GiB of its GPU{' after the engine share' if engine_share else ''}; use more "
            "trainer ranks (trainer.n_gpus_per_node) or a larger (or -1) "
            "actor_rollout_ref.actor.fsdp_config.fsdp_size, a smaller critic.model.path, or "
            "placement.colocate=false"
        )
    return need


# glibc gives freed memory back to the system only for blocks above its mmap threshold, and it raises that
# threshold by itself as large blocks are freed (up to 32 MiB); a trainer's CPU tensors of ever-changing
# shapes then fragment the heap, which keeps them. Measured on examples/coding_tasks (SmolLM2-135M,
# ~3k-token micro-batches, 2-core CPU): a TrainerWorker idle between steps held 13.6 GB after 3 steps
# (and Ray's OOM killer ended the run) without these settings, 3.0 GB with them.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20), "MALLOC_TRIM_THRESHOLD_": str(4 << 20)}


def worker_env() -> dict[str, str]:
    """Environment for Ray's worker processes: :data:`MALLOC_ENV`, less what the user has set."""
    return {k: v for k, v in MALLOC_ENV.items() if k not in os.environ}


def init_ray(config: TrainerConfig) -> None:
    """Join ``trainer.ray_address`` (or start a local Ray) unless Ray is already initialised; the
    workers' output goes to the run's log.txt (:func:`route_worker_output`), not the console, and
    they start with :func:`worker_env`. A local Ray starts no idle workers ahead of need (on 2 cores
    their imports, ~1.5 CPU-s, slowed the engine's load and the first rollout)."""
    import ray

    if not ray.is_initialized():
        env = worker_env()
        local = config.trainer.ray_address is None and not os.environ.get("RAY_ADDRESS")
        with _quiet_thread_warning():
            ray.init(
                address=config.trainer.ray_address,
                include_dashboard=False,
                logging_level=logging.WARNING,
                log_to_driver=True,
                configure_logging=False,
                runtime_env={"env_vars": env} if env else None,
                # a joined cluster keeps its own settings (Ray refuses a _system_config there)
                _system_config={"prestart_worker_first_driver": False} if local else None,
            )
        route_worker_output()


@contextlib.contextmanager
def _quiet_thread_warning() -> Iterator[None]:
    """Drop Ray's "SIGTERM handler is not set ... not the main thread" warning: on the Ray thread
    (:func:`on_ray_thread`) not replacing the process's SIGTERM handler is what we want."""
    ray_worker_log = logging.getLogger("ray._private.worker")

    def keep(record: logging.LogRecord) -> bool:
        return "SIGTERM handler is not set" not in record.getMessage()

    ray_worker_log.addFilter(keep)
    try:
        yield
    finally:
        ray_worker_log.removeFilter(keep)


_ray_calls: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] | None = None
_ray_calls_lock = threading.Lock()


def on_ray_thread(call: Callable[[], T]) -> concurrent.futures.Future[T]:
    """Run ``call`` on agentloop's Ray thread and return its future. The thread lives as long as the
    process: Ray's processes die with the thread that started them (PR_SET_PDEATHSIG), so a
    ``ray.init`` there keeps them for the process's life, as one on the main thread does, while the
    main thread's event loop serves rollouts (``ray.init`` blocks for seconds while they start)."""
    global _ray_calls
    with _ray_calls_lock:
        if _ray_calls is None:
            _ray_calls = queue.SimpleQueue()
            threading.Thread(
                target=_serve_ray_calls, args=(_ray_calls,), name="agentloop-ray", daemon=True
            ).start()
    future: concurrent.futures.Future[T] = concurrent.futures.Future()
    _ray_calls.put((call, future))
    return future


def _serve_ray_calls(
    calls: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]],
) -> None:
    while True:
        call, future = calls.get()
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(call())
        except BaseException as exc:  # handed to the caller, who awaits the future
            future.set_exception(exc)


def route_worker_output() -> bool:
    """Send what Ray's worker processes print (``(TrainerWorker pid=...)`` lines: loading bars, library
    warnings) to the run's log file (``agentloop.logging.write_run_log``) instead of the driver's
    console. Ray's own printer is the handler ``ray_print_logs`` of its stdout dispatcher (Ray 2.x);
    where that is not found nothing changes (the lines still print) and False is returned. Lines that
    come with no run log open are dropped here; Ray's session folder keeps every worker's output."""
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:
        return False
    if not any(name == "ray_print_logs" for name, _ in getattr(dispatcher, "handlers", [])):
        return False

    def to_run_log(data: dict[str, Any]) -> None:
        if data.get("pid") == "autoscaler":  # its status every 5 s (Ray prints only its events)
            return
        who = data.get("actor_name") or data.get("task_name") or "worker"
        prefix = f"({who} pid={data.get('pid')}) "
        write_run_log("".join(prefix + str(line) + "\n" for line in data.get("lines", [])))

    dispatcher.remove_handler("ray_print_logs")
    dispatcher.add_handler("agentloop_run_log", to_run_log)
    return True


@dataclass
class Layout:
    """What ``place`` started: a DataParallelGroup and/or an EngineReplicaPool (None: the default)."""

    plan: Plan
    worker: Any = None
    engine: Any = None
    placement_group: Any = None

    async def aclose(self) -> None:
        import ray

        if self.engine is not None:
            await self.engine.stop()
        if self.worker is not None:
            self.worker.shutdown()
        if self.placement_group is not None:
            ray.util.remove_placement_group(self.placement_group)


def place(config: TrainerConfig, model_path: str, device: str, *, engine_given: bool = False) -> Layout:
    """Check the cluster and start the trainer ranks and engine replicas the config asks for."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    plan = plan_placement(config, device)
    layout = Layout(plan)
    if plan.gpu:
        import torch

        if torch.cuda.is_available():  # the driver's GPU stands for the ranks' (one kind of card per run)
            gpu_gib = torch.cuda.get_device_properties(0).total_memory / GiB
            need = check_memory(config, model_path, plan, gpu_gib)
            log.info(
                "placement.memory", gpu_gib=round(gpu_gib, 1), **{k: round(v, 2) for k, v in need.items()}
            )
    if not plan.scaled:
        return layout
    init_ray(config)
    import ray

    alive = sum(1 for n in ray.nodes() if n.get("Alive"))
    check_cluster(plan, ray.cluster_resources(), alive)
    log.info("placement", plan=plan.describe(), gpus=plan.gpus_needed)

    def opts(bundle: int, share: float) -> dict[str, Any]:
        if layout.placement_group is None:
            return {"num_cpus": 0}
        strategy = PlacementGroupSchedulingStrategy(
            layout.placement_group, placement_group_bundle_index=bundle
        )
        return {"num_cpus": 0, "num_gpus": share, "scheduling_strategy": strategy}

    share = 0.5 if plan.colocate else 1.0
    if plan.gpu:
        layout.placement_group = placement_group([{"GPU": 1}] * plan.gpus_needed, strategy="PACK")
        ray.get(layout.placement_group.ready(), timeout=120)
    first_replica_bundle = 0 if plan.colocate else plan.train_ranks
    from trainer.distributed.data_parallel import (
        DataParallelGroup,  # scaled: data-parallel ranks, also with one rank
    )

    layout.worker = DataParallelGroup.create(
        config, model_path, device, plan.train_ranks, actor_options=lambda r: opts(r, share)
    )
    if plan.replicas > 1 and not engine_given:
        from agentloop.engine.replicas import EngineReplicaPool

        layout.engine = EngineReplicaPool.create(
            model_path,
            plan.replicas,
            device,
            actor_options=lambda i: opts(first_replica_bundle + i, share),
            cpu_binding=config.placement.cpu_binding,
            **engine_kwargs(config.actor_rollout_ref.rollout),
        )
    return layout


async def serve_store(config: TrainerConfig, store: Any) -> Any:
    """A started StoreServer for ``store`` when ``placement.store_server`` is on, else None."""
    if not config.placement.store_server:
        return None
    from agentloop.store.server import StoreServer

    p = config.placement
    key = p.store_api_key.get_secret_value() if p.store_api_key is not None else None  # SecretStr
    server = StoreServer(store, host=p.store_host, port=p.store_port, api_key=key)
    await server.start()
    log.info("store.served", url=server.url, hint=f"agentloop runner --store {server.url} --agent module:obj")
    return server


__all__ = [
    "Layout",
    "PlacementError",
    "Plan",
    "check_cluster",
    "init_ray",
    "on_ray_thread",
    "place",
    "plan_placement",
    "serve_store",
]
