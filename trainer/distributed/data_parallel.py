"""Data-parallel training: the actor as N Ray actors, one per GPU, each sharded with FSDP2.

Layout of one update on N ranks (every rank receives the whole Batch through the Ray object store)::

    rank r: deal_micro_batches(batch, N)[r] ─► forward/backward (FSDP2 all-gathers params per unit,
            reduce-scatters grads: each rank keeps 1/N of params, grads, AdamW state)

* Balance: the ranks run in step, so the slowest sets the pace; micro-batches are dealt so that the
  rank with the most padded tokens (rows x width) has as few as possible: either rows dealt by tokens
  and split on each rank, or the whole batch split into micro-batches of similar lengths and near-equal
  size that are dealt to the ranks, whichever pads less (``deal_micro_batches``).
* Equivalence with one rank: every loss term is divided by the *whole* mini-batch's token (or
  sequence) count, which each rank reads from the full mini-batch it holds; gradients are then
  summed across ranks (FSDP's divide factor is set to 1), so N ranks take the same step as one rank
  on the whole batch, up to float summation order.
* Collectives must line up: a rank with fewer micro-batches runs padding micro-batches (one row with
  an all-zero response mask: zero loss, zero gradient) so every rank runs the same number of
  forwards and backwards. Old/ref logprobs computed on each rank's rows are summed (all-reduce) into
  the full (B, R) tensor, so advantages are computed on the whole batch, identically everywhere.
* Gradient reduce-scatters: one per FSDP unit (a decoder layer, or ``layers_per_unit`` of them) and
  micro-batch by default; with ``fsdp_config.grad_sync_per_micro_batch=false`` one per unit and
  mini-batch, in its last backward (the same micro-batch index on every rank, the counts being
  padded), the others accumulating full-size gradients on each rank (``sync_gradients``; fp32, or
  bf16 with ``mixed_precision.reduce_dtype=bf16``).
* ``fsdp_config.fsdp_size`` (verl's key): -1 shards over every rank; k shards within groups of k ranks
  and replicates across the groups (HSDP: a 2D mesh, gradients reduce-scattered within a group, then
  all-reduced across groups); 1 is plain data parallelism, where FSDP2 issues no all-gather at all
  (a shard group of one rank) and the gradients cross the ranks in one all-reduce per unit.
* ``fsdp_config.layers_per_unit``: the decoder layers form FSDP units of that many consecutive layers
  (one all-gather and one gradient reduce per unit instead of per layer; fewer per-unit hooks).
* ``fsdp_config.skip_fsdp_when_replicated`` (off by default): where every rank holds the whole model
  (``fsdp_size`` resolves to 1, also on one rank), no FSDP2 at all: each rank trains its copy with the
  single-device Actor's (and Critic's) own code and optimizer, and sums its accumulated gradients with
  the other ranks' before the step, one all-reduce per 256 MiB bucket (``all_reduce_gradients``, in
  ``reduce_dtype``). FSDP2's per-unit hooks, parameter copies and DTensor dispatch cost one H200 rank
  ~20% of a 32-row update (0.253 s against 0.205 s without FSDP2, one call) and 22% of its CPU time.
* The ranks score response tokens as one device does: the LM head run chunked on the response
  positions only (trainer/model/head.py), through a second forward of the model that FSDP's hooks wrap
  (``register_head_forward``), and the optimizer is the fused AdamW on CUDA.
* CPU: FSDP2 (``fully_shard``) runs over gloo in torch 2.13 (checked: forward, backward,
  reduce-scatter, ``clip_grad_norm_`` over DTensors and ``full_tensor()`` all work), so CI runs the
  same code path as the GPUs.

The FSDP2 mechanics (dealing rows to ranks, the mesh, ``shard``, the gradient-sync switch, the full
state dicts) are in trainer/distributed/_sharding.py; this module holds the sharded actor and critic and the Ray side.

Not supported with FSDP: LoRA (``model.lora_rank > 0``). The reference model (KL only) stays a full,
unsharded copy on each rank. Checkpoints hold full (unsharded) state dicts written by rank 0.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from agentloop.cpu_binding import bind_gpu_process, usable_cpus
from trainer.algorithms import entropy_from_logits, logprobs_from_logits
from trainer.batch import Batch
from trainer.config import TrainerConfig
from trainer.distributed._sharding import (
    HEAD_FORWARD,
    all_reduce_gradients,
    balance_by_tokens,
    data_parallel_mesh,
    full_state,
    load_full_state,
    max_over_ranks,
    rank_micro_batches,
    reduce_dtype,
    register_head_forward,
    shard,
    sum_over_ranks,
    sync_gradients,
)
from trainer.model.actor import Actor
from trainer.model.attention_mask import attention_mask_for
from trainer.model.compiled import model_inputs
from trainer.model.critic import Critic
from trainer.run_folder import checkpoint as ck

log = structlog.get_logger("agentloop.trainer.dp")


class ShardedCritic(Critic):
    """The Critic's update over the same ranks as ``ShardedActor``: FSDP2, or whole copies without it."""

    def __init__(
        self,
        config: TrainerConfig,
        model_path: str | Path,
        device: torch.device,
        rank: int,
        world_size: int,
        mesh: DeviceMesh | None = None,
    ) -> None:
        super().__init__(config, model_path, device, shared_prompts=False)
        self.rank, self.world_size = rank, world_size
        fsdp = config.actor_rollout_ref.actor.fsdp_config  # the critic shards as the actor does
        self.grad_sync_per_micro_batch = fsdp.grad_sync_per_micro_batch
        self.replicated = fsdp.replicated_without_fsdp(world_size)
        self.reduce_dtype = reduce_dtype(fsdp)
        if self.replicated:  # whole copies: the Critic's model and optimizer, gradients summed at the step
            return
        shard(self.model, getattr(self.model.decoder, "layers", None), fsdp, mesh)
        optim = config.critic.optim
        self.optimizer = torch.optim.AdamW(  # over the DTensor shards now; fused as the Critic's
            self.model.parameters(),
            lr=optim.lr,
            betas=optim.betas,
            weight_decay=optim.weight_decay,
            fused=device.type == "cuda",
        )

    def _split_micro_batches(self, batch: Batch) -> list[tuple[Batch, torch.Tensor]]:
        return rank_micro_batches(batch, self.token_budget, self.rank, self.world_size)

    def _gather_rows(self, out: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(out)  # each row was filled by exactly one rank
        return out

    def _sync_gradients(self, on: bool) -> None:
        if not self.grad_sync_per_micro_batch and not self.replicated:
            sync_gradients(self.model, on)

    def _reduce_gradients(self) -> None:
        if self.replicated:
            all_reduce_gradients([p for p in self.model.parameters() if p.requires_grad], self.reduce_dtype)

    def _summed_over_ranks(self, totals: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return sum_over_ranks(totals)  # the grad norm is global already (a DTensor norm, or summed)

    def state(self) -> dict[str, Any]:
        return {**full_state(self.model, self.optimizer), "step": self.step}

    def load_state(self, state: dict[str, Any]) -> None:
        load_full_state(self.model, self.optimizer, state)
        self.step = int(state["step"])


class ShardedActor(Actor):
    """The Actor's update over a torch.distributed group of ``world_size`` ranks: sharded with FSDP2, or
    whole copies without it (``fsdp_config.skip_fsdp_when_replicated``)."""

    warm_up_on_init = False  # Actor.__init__ runs before the sharding: this __init__ warms up after it

    def __init__(
        self, config: TrainerConfig, model_path: str, device: str, rank: int, world_size: int
    ) -> None:

        if config.actor_rollout_ref.model.lora_rank > 0:
            raise ValueError(
                "data-parallel training (FSDP2) does not support LoRA yet: set "
                "actor_rollout_ref.model.lora_rank=0 or train on one rank"
            )
        if not dist.is_initialized():
            raise RuntimeError("ShardedActor needs torch.distributed initialised (see DPWorker.setup)")
        self.rank, self.world_size = rank, world_size
        fsdp = config.actor_rollout_ref.actor.fsdp_config
        device_type = torch.device(device).type
        self.replicated = fsdp.replicated_without_fsdp(world_size)
        self.reduce_dtype = reduce_dtype(fsdp)
        # the mesh before the critic's (a collective); whole copies need none
        self.mesh = None if self.replicated else data_parallel_mesh(device_type, world_size, fsdp.fsdp_size)
        super().__init__(config, model_path, device)
        self.shared_prompts = False  # not measured sharded yet (the head forward's job would carry it)
        self.grad_sync_per_micro_batch = fsdp.grad_sync_per_micro_batch
        if self.replicated:  # whole copies: the Actor's own model, optimizer and forward; summed at the step
            if self.compiled:
                self.warm_up_compiled()
            return
        layers = getattr(getattr(self.model, "model", None), "layers", None)
        shard(self.model, layers, fsdp, self.mesh)
        optim = config.actor_rollout_ref.actor.optim
        params = [p for p in self.model.parameters() if p.requires_grad]  # DTensor shards now
        self.optimizer = torch.optim.AdamW(  # fused as the Actor's: DTensor has the fused AdamW op
            params,
            lr=optim.lr,
            betas=optim.betas,
            weight_decay=optim.weight_decay,
            fused=self.device.type == "cuda",
        )
        if self.fused_head:  # the LM head run chunked on the response positions, inside FSDP's hooks
            register_head_forward(self.model)
        if self.compiled:  # every rank runs the same passes, so their collectives pair up
            self.warm_up_compiled()

    def _make_critic(self, model_path: str | Path) -> Critic:
        return ShardedCritic(self.config, model_path, self.device, self.rank, self.world_size, self.mesh)

    # ------------------------------------------------------------ forward passes

    def _forward(
        self, model: nn.Module, mb: Batch, entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if model is not self.model or self.replicated:
            return super()._forward(model, mb, entropy)
        p, r = mb.prompt_length, mb.response_length
        assert mb.input_ids.shape[1] == p + r, "a micro-batch is cut to its own P + R columns"
        inputs = model_inputs(mb) if self.compiled else mb  # compiled layers: a mask, a width of 8k
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            if self.fused_head:
                fused = getattr(model, HEAD_FORWARD)(self._head_job(mb, inputs))
                if fused is not None:
                    logprobs, ent = fused
                    return logprobs, (ent if entropy else None)
            # the root forward (FSDP's hooks all-gather the root unit); the head runs on the last
            # r + 1 + extra positions, extra being the padding columns after the response
            extra = inputs.input_ids.shape[1] - (p + r)
            out = model(
                input_ids=inputs.input_ids,
                attention_mask=attention_mask_for(model, inputs.attention_mask, inputs.fully_real()),
                position_ids=inputs.position_ids,
                logits_to_keep=r + 1 + extra,
                use_cache=False,
            )
            logits = out.logits[:, :r]  # (b, R, V): positions p-1 .. p+r-2
        logits = logits.float() / mb.logit_temperatures()[:, :r, None]  # the sampling policy's logits
        logprobs = logprobs_from_logits(logits, mb.responses)  # (b, R)
        return logprobs, (entropy_from_logits(logits) if entropy else None)

    def _split_micro_batches(self, batch: Batch) -> list[tuple[Batch, torch.Tensor]]:
        budget = self.config.actor_rollout_ref.actor.ppo_max_token_len_per_gpu
        return rank_micro_batches(batch, budget, self.rank, self.world_size)

    def _gather_rows(self, out: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(out)  # each row was filled by exactly one rank: the sum is the whole (B, R)
        return out

    def _sync_gradients(self, on: bool) -> None:
        if not self.grad_sync_per_micro_batch and not self.replicated:  # one reduce-scatter a mini-batch
            sync_gradients(self.model, on)

    def _reduce_gradients(self) -> None:
        if self.replicated:
            all_reduce_gradients([p for p in self.model.parameters() if p.requires_grad], self.reduce_dtype)

    def _summed_over_ranks(self, totals: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return sum_over_ranks(totals)  # the grad norm is global already (a DTensor norm, or summed)

    def _max_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        return max_over_ranks(value)

    # ------------------------------------------------------------ weights and checkpoints

    def named_weights(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Full tensors on CPU on rank 0 (an empty dict on the others); every rank must call it."""
        from torch.distributed.tensor import DTensor

        out: dict[str, torch.Tensor] = {}
        for name, value in self.model.state_dict().items():
            full = value.full_tensor() if isinstance(value, DTensor) else value  # all-gather: collective
            if self.rank == 0:
                out[name] = full.detach().to("cpu", dtype=dtype or full.dtype, copy=True)
        return out

    def state(self) -> dict[str, Any]:
        return {**full_state(self.model, self.optimizer), "step": self.step, "world_size": self.world_size}

    def load_state(self, state: dict[str, Any]) -> None:
        load_full_state(self.model, self.optimizer, state)
        self.step = int(state["step"])


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class DPWorker:
    """One rank (a Ray actor): joins the process group, then holds a ShardedActor."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.actor: ShardedActor | None = None
        self.extensions: dict[str, Any] = {}  # state of functions run through ``call`` (weight sync)

    def address(self) -> tuple[str, int]:
        """Rank 0's node IP and a free port there: the group's MASTER_ADDR / MASTER_PORT."""
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def setup(self, config: TrainerConfig, model_path: str, device: str, addr: str, port: int) -> None:
        os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port))
        threads = max(1, usable_cpus() // self.world_size)  # a share of the CPUs the ranks all see
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if device.startswith("cuda"):
            device = "cuda:0"  # Ray's CUDA_VISIBLE_DEVICES shows this actor one GPU
            torch.cuda.set_device(0)
            bound = bind_gpu_process(config.placement.cpu_binding)  # before NCCL starts its threads
            threads = min(threads, len(bound)) if bound else threads
        torch.set_num_threads(threads)  # Ray sets OMP threads to 1 for actors
        dist.init_process_group(backend, rank=self.rank, world_size=self.world_size)
        self.actor = ShardedActor(config, model_path, device, self.rank, self.world_size)
        log.info(
            "dp.rank_ready",
            rank=self.rank,
            world_size=self.world_size,
            backend=backend,
            without_fsdp=self.actor.replicated,
        )

    def _ready(self) -> ShardedActor:
        if self.actor is None:
            raise RuntimeError("DPWorker.setup must run before any other call")
        return self.actor

    def update(self, batch: Batch) -> dict[str, float]:
        return self._ready().update(batch)

    def named_weights(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        return self._ready().named_weights(dtype)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(self, *args)`` in this rank (trainer/distributed/weight_sync.py's rank side uses it)."""
        return fn(self, *args)

    def save_checkpoint(self, path: str) -> None:
        """Weights (safetensors) and optimizer state into a checkpoint's step folder, as a single-device
        worker writes them; gathered to rank 0, which writes."""
        actor = self._ready()
        state = actor.state()  # collective
        critic = actor.critic.state() if actor.critic is not None else None  # collective
        if self.rank == 0:
            ck.save_policy_state(state["model"], state["optimizer"], actor.step, 0, Path(path))
            if critic is not None:
                (Path(path) / ck.CRITIC_DIR).mkdir(exist_ok=True)
                ck.save_policy_state(
                    critic["model"], critic["optimizer"], critic["step"], 0, Path(path) / ck.CRITIC_DIR
                )
        dist.barrier()

    def load_checkpoint(self, path: str) -> int:
        """Load a checkpoint's step folder (``save_checkpoint``'s files, or an older ``actor.pt``)."""
        actor = self._ready()
        actor.load_state(ck.read_policy_state(Path(path)))
        if actor.critic is not None:
            actor.critic.load_state(ck.read_critic_state(Path(path)))
        return actor.step

    def save_model(self, model_path: str, out_dir: str, adapter_dir: str | None) -> None:
        """The trained policy as a Hugging Face folder (rank 0 writes; LoRA is refused for FSDP)."""
        weights = self._ready().named_weights()  # collective
        if self.rank == 0:
            ck.export_hf_model(weights, model_path, Path(out_dir))
        dist.barrier()

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class _Method:
    """``group.update.remote(batch)``: the same call on every rank, awaited together; rank 0's answer."""

    def __init__(self, group: DataParallelGroup, name: str) -> None:
        self._group, self._name = group, name

    def remote(self, *args: Any) -> Awaitable[Any]:
        import ray

        # one copy in the object store, whatever the number of ranks
        refs = [ray.put(a) if isinstance(a, Batch) else a for a in args]
        calls = [getattr(w, self._name).remote(*refs) for w in self._group.workers]
        return _first(calls)


async def _first(calls: list[Any]) -> Any:
    import asyncio

    results = await asyncio.gather(*calls)
    return results[0]


class DataParallelGroup:
    """N DPWorker Ray actors (one per GPU; CPU processes with gloo) behaving as one TrainerWorker.

    ``update``, ``named_weights``, ``save_checkpoint``, ``load_checkpoint`` and ``save_model`` have a
    ``.remote(...)`` that runs on every
    rank and resolves to rank 0's result, as ``await worker.update.remote(batch)`` expects.
    """

    def __init__(self, workers: list[Any]) -> None:
        self.workers = workers
        self.update = _Method(self, "update")
        self.named_weights = _Method(self, "named_weights")
        self.save_checkpoint = _Method(self, "save_checkpoint")
        self.load_checkpoint = _Method(self, "load_checkpoint")
        self.save_model = _Method(self, "save_model")

    @classmethod
    def create(
        cls,
        config: TrainerConfig,
        model_path: str,
        device: str,
        world_size: int,
        *,
        actor_options: Callable[[int], dict[str, Any]] | None = None,
    ) -> DataParallelGroup:
        """Start ``world_size`` ranks (Ray must be initialised) and wait until all joined the group.

        ``actor_options(rank)`` gives Ray options per rank (placement group bundle, resources); by
        default one GPU per rank on CUDA, no reserved CPU on CPU.
        """
        import ray

        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        gpu = device.startswith("cuda")
        default = {"num_gpus": 1, "num_cpus": 0} if gpu else {"num_cpus": 0}
        workers = [
            ray.remote(DPWorker)
            .options(**(actor_options(rank) if actor_options else default))
            .remote(rank, world_size)
            for rank in range(world_size)
        ]
        # ray's stubs type actor-handle methods as plain functions, without .remote
        addr, port = ray.get(workers[0].address.remote())  # type: ignore[attr-defined]
        ray.get([w.setup.remote(config, model_path, device, addr, port) for w in workers])  # type: ignore[attr-defined]
        log.info("dp.group_ready", world_size=world_size, device=device, master=f"{addr}:{port}")
        return cls(workers)

    def shutdown(self) -> None:
        import ray

        ray.get([w.shutdown.remote() for w in self.workers])
        for w in self.workers:
            ray.kill(w)


__all__ = [
    "DPWorker",
    "DataParallelGroup",
    "ShardedActor",
    "ShardedCritic",
    "balance_by_tokens",
    "data_parallel_mesh",
    "free_port",
    "rank_micro_batches",
    "shard",
    "sync_gradients",
]
