"""FSDP2 mechanics of the data-parallel trainer: how a batch is dealt to the ranks, the mesh and the
sharding, the gradient-sync switch, and the full state dicts a checkpoint holds. Why each works as it
does (balance, padding micro-batches, summed gradients) is in trainer/distributed/data_parallel.py's docstring."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from functools import lru_cache, partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from trainer.batch import Batch, HostRows, index_on
from trainer.batch.splits import token_budget_rows
from trainer.config import FSDPConfig, MixedPrecisionConfig, shard_group_size
from trainer.model.hidden import HeadJob, response_logprobs


def balance_by_tokens(lengths: list[int], parts: int) -> list[list[int]]:
    """Deal row indices to ``parts`` lists of near-equal token totals (greedy, longest first).

    Deterministic: ties go to the lowest part index; each part keeps ascending row order.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if any(n < 0 for n in lengths):
        raise ValueError("lengths must be >= 0")
    totals = [0] * parts
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        target = min(range(parts), key=lambda p: (totals[p], len(out[p]), p))
        out[target].append(i)
        totals[target] += lengths[i]
    return [sorted(p) for p in out]


def padded_tokens(host: HostRows, rows: Sequence[int]) -> int:
    """What a padded forward over ``rows`` computes: rows x (longest prompt + longest response)."""
    if not rows:
        return 0
    width = max(host.prompt_tokens[i] for i in rows) + max(host.response_tokens[i] for i in rows)
    return len(rows) * width


def deal_micro_batches(host: HostRows, budget: int, world_size: int) -> list[list[list[int]]]:
    """Each rank's token-budget micro-batches (row indices), dealt so that the slowest rank computes as
    few padded tokens as it can: of two deals, the one whose ranks run fewer micro-batches, then the one
    whose slowest rank has fewer :func:`padded_tokens`.

    - By rows: rows dealt to ranks by real tokens (:func:`balance_by_tokens`), each rank splitting its
      own. Each rank then holds lengths from the whole range, so its micro-batches mix long and short
      rows and pad more (4 ranks of scale_bench's batch: 31,904 padded tokens on the slowest rank against
      29,340 for a quarter of one rank's 117,358).
    - By micro-batches: the whole batch split at once (rows of similar length together, as one rank
      would), into ``world_size`` x k micro-batches of near-equal padded size (the smallest budget
      that still gives no more micro-batches than k per rank), dealt k to a rank, largest first to the
      rank with the least so far (29,410 on that batch).

    Every rank computes the same deal from the rows' lengths on the host, once for each distinct rows,
    budget and ranks (a pass over a batch and PPO's later epochs over its mini-batches deal the same
    rows again: ~2 ms for 128 rows, ~0.3 s for 16k on a 2-core CPU)."""
    return [[list(mb) for mb in mbs] for mbs in _remembered_deal(host, budget, world_size)]


@lru_cache(maxsize=32)
def _remembered_deal(host: HostRows, budget: int, world_size: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """:func:`deal_micro_batches`'s deal, kept (immutable) for the next pass over the same rows."""

    def cost(deal: list[list[list[int]]]) -> tuple[int, int]:
        """The most micro-batches a rank runs (each costs its collectives and launches), then the slowest
        rank's padded tokens."""
        return max(map(len, deal)), max(sum(padded_tokens(host, mb) for mb in mbs) for mbs in deal)

    by_micro_batches = _deal_even_micro_batches(host, budget, world_size)
    deal = min(by_micro_batches, _deal_rows_by_tokens(host, budget, world_size), key=cost)
    return tuple(tuple(tuple(mb) for mb in mbs) for mbs in deal)


def _deal_rows_by_tokens(host: HostRows, budget: int, world_size: int) -> list[list[list[int]]]:
    """The by-rows deal of :func:`deal_micro_batches`."""
    return [
        [[part[i] for i in mb] for mb in token_budget_rows(host.take(part), budget, padded=True)]
        for part in balance_by_tokens(host.sequence_tokens(), world_size)
    ]


def _deal_even_micro_batches(host: HostRows, budget: int, world_size: int) -> list[list[list[int]]]:
    """The by-micro-batches deal of :func:`deal_micro_batches`."""
    micro = token_budget_rows(host, budget, padded=True)
    per_rank = -(-len(micro) // world_size)
    # the split at the least budget giving <= world_size x per_rank micro-batches (the count never
    # rises with the budget): a binary search below ``budget``, keeping the last split that fits
    low, high = 1, budget - 1
    while low <= high:
        mid = (low + high) // 2
        split = token_budget_rows(host, mid, padded=True)
        if len(split) <= world_size * per_rank:
            micro, high = split, mid - 1
        else:
            low = mid + 1
    cost = [padded_tokens(host, mb) for mb in micro]
    deal: list[list[list[int]]] = [[] for _ in range(world_size)]
    totals = [0] * world_size
    for m in sorted(range(len(micro)), key=lambda m: (-cost[m], m)):
        rank = min((r for r in range(world_size) if len(deal[r]) < per_rank), key=lambda r: (totals[r], r))
        deal[rank].append(micro[m])
        totals[rank] += cost[m]
    return deal


def rank_micro_batches(
    batch: Batch, budget: int, rank: int, world_size: int
) -> list[tuple[Batch, torch.Tensor]]:
    """This rank's token-budget micro-batches of ``batch`` (row indices into it; :func:`deal_micro_batches`),
    padded to the most any rank has with zero-mask rows (empty index) so every rank runs the same
    forwards (a collective).

    Every rank holds the whole batch and deals it the same way, so each counts every rank's
    micro-batches itself, from the rows' lengths on the host: no collective, nothing waits for the GPU."""
    deal = deal_micro_batches(batch.rows_on_host(), budget, world_size)
    device = batch.input_ids.device
    mine = [(batch.select(rows), index_on(device, rows)) for rows in deal[rank]]
    most = max(map(len, deal))
    if most > len(mine) and len(batch):
        pad = batch.select([0])
        pad = replace(pad, response_mask=torch.zeros_like(pad.response_mask))
        empty = torch.zeros(0, dtype=torch.long, device=device)
        mine += [(pad, empty)] * (most - len(mine))
    return mine


def data_parallel_mesh(device_type: str, world_size: int, fsdp_size: int) -> DeviceMesh | None:
    """The mesh FSDP2 shards over (``fsdp_config.fsdp_size``, read by ``shard_group_size``): None,
    FSDP2's default 1D mesh over every rank, when all ranks share one copy; else a (world_size / k, k)
    mesh named ("replicate", "shard"): HSDP, the model sharded within each group of k consecutive
    ranks and replicated across the groups. A collective: every rank calls it, in the same order."""
    size = shard_group_size(fsdp_size, world_size)
    if size == world_size:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    shape = (world_size // size, size)
    return init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard"))


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # fsdp_config.mixed_precision's names


def mixed_precision_policy(config: MixedPrecisionConfig) -> Any:
    """FSDP2's MixedPrecisionPolicy for ``fsdp_config.mixed_precision``; None when both dtypes are fp32
    (FSDP2's default: parameters gathered and gradients reduced in their own float32)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if config.param_dtype == "fp32" and config.reduce_dtype == "fp32":
        return None
    return MixedPrecisionPolicy(
        param_dtype=None if config.param_dtype == "fp32" else _DTYPES[config.param_dtype],
        reduce_dtype=_DTYPES[config.reduce_dtype],
    )


def shard(model: nn.Module, layers: Any, fsdp: FSDPConfig, mesh: DeviceMesh | None = None) -> None:
    """FSDP2 over ``model``: one unit per ``fsdp.layers_per_unit`` consecutive decoder layers
    (all-gathered one unit at a time) and the root; the gradients summed over ranks, not averaged (the
    losses use the whole batch's denominators).
    ``fsdp`` gives reshard_after_forward (False keeps gathered parameters until the backward) and the
    mixed-precision dtypes; ``mesh`` (``data_parallel_mesh``) shards within groups of ranks and
    replicates across them."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    options: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": fsdp.reshard_after_forward}
    policy = mixed_precision_policy(fsdp.mixed_precision)
    if policy is not None:
        options["mp_policy"] = policy
    layers = list(layers or [])
    size = fsdp.layers_per_unit
    for start in range(0, len(layers), size):
        group = layers[start : start + size]
        fully_shard(group[0] if len(group) == 1 else group, **options)
    fully_shard(model, **options)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # sum, not mean: losses use global denominators
            if hasattr(module, "set_force_sum_reduction_for_comms"):  # torch >= 2.9
                module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM


HEAD_FORWARD = "agentloop_response_logprobs"  # the sharded model's second forward (register_head_forward)


def _run_head_job(model: nn.Module, job: HeadJob) -> tuple[torch.Tensor, torch.Tensor] | None:
    out = response_logprobs(model, job)
    if out is None:
        return None
    # (b, R) tensors of their own, not views: FSDP's pre-backward hook sits on what a forward returns,
    # and an in-place op on a view of it would drop the hook
    return out[0].clone(), out[1].clone()


def register_head_forward(model: nn.Module) -> None:
    """Give a sharded model ``HEAD_FORWARD(job)``: the response tokens' log-probs and entropies from the
    decoder's hidden states and the LM head run chunked (what the single-device actor computes),
    wrapped in FSDP's forward hooks as ``forward`` is. Calling the decoder and the head outside them
    would skip the root unit's all-gather (embeddings, final norm, head) and its gradient reduce."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    setattr(model, HEAD_FORWARD, partial(_run_head_job, model))
    register_fsdp_forward_method(model, HEAD_FORWARD)


def sync_gradients(model: nn.Module, on: bool) -> None:
    """Turn FSDP2's gradient sync in the next backwards on or off for every unit of ``model`` (the
    reduce-scatter, and on a 2D mesh the all-reduce across the replicas too); while off, each rank
    accumulates its unsharded (full-size) gradients, and the next backward with it on syncs their
    sum. An update that raises mid-mini-batch turns it back on but leaves the unsynced gradients
    inside FSDP2 (the run stops there: an update is not retried)."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        raise TypeError(f"sync_gradients needs a model sharded by shard(), got {type(model).__name__}")
    model.set_requires_gradient_sync(on)  # recurse=True: the root and every layer


def reduce_dtype(fsdp: FSDPConfig) -> torch.dtype | None:
    """The dtype ``mixed_precision.reduce_dtype`` sums gradients in over the ranks (None: their own)."""
    name = fsdp.mixed_precision.reduce_dtype
    return None if name == "fp32" else _DTYPES[name]


GRADIENT_BUCKET_BYTES = 256 << 20  # all_reduce_gradients' flat buffers: few collectives, bounded memory


def all_reduce_gradients(params: list[torch.Tensor], dtype: torch.dtype | None = None) -> None:
    """Sum the gradients of ``params`` over the ranks in place (whole model copies, trained without
    FSDP2): flattened into buckets of about GRADIENT_BUCKET_BYTES of one dtype, one all-reduce each, in
    ``dtype`` (None: the gradients' own). A rank without a parameter's gradient adds zeros, so every rank
    reduces the same buckets; a parameter that no rank has a gradient for keeps none (AdamW skips it, as
    on one device). The first bucket carries each parameter's count of ranks with a gradient, read back
    only on a rank that lacked one. One rank: nothing to do."""
    if dist.get_world_size() == 1 or not params:
        return
    missing = [i for i, p in enumerate(params) if p.grad is None]
    for i in missing:
        params[i].grad = torch.zeros_like(params[i])
    grads = [p.grad for p in params if p.grad is not None]  # every one, now
    buckets: list[list[torch.Tensor]] = [[]]
    size = 0
    for g in grads:  # consecutive gradients of one dtype, in the same order on every rank
        if buckets[-1] and (size >= GRADIENT_BUCKET_BYTES or g.dtype != buckets[-1][0].dtype):
            buckets.append([])
            size = 0
        buckets[-1].append(g)
        size += g.numel() * g.element_size()
    lacking = set(missing)
    have = torch.tensor([i not in lacking for i in range(len(params))], dtype=grads[0].dtype)
    counts = None
    for bucket in buckets:
        parts = [g.reshape(-1) for g in bucket]
        if counts is None:  # the first bucket: the counts ahead of the gradients
            parts.insert(0, have.to(grads[0].device, non_blocking=True))
        flat = torch.cat(parts).to(dtype or bucket[0].dtype)
        dist.all_reduce(flat)
        if counts is None:
            counts, flat = flat[: len(params)], flat[len(params) :]
        values = flat.split([g.numel() for g in bucket])
        torch._foreach_copy_(bucket, [v.view_as(g) for v, g in zip(values, bucket, strict=True)])
    if missing:
        assert counts is not None
        ranks_with_grad = counts.tolist()
        for i in missing:
            if ranks_with_grad[i] == 0:
                params[i].grad = None


def sum_over_ranks(totals: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each rank's share of the loss terms summed over the ranks, on the device (an all-reduce the GPU
    runs in order; nothing is read back)."""
    summed = torch.stack([v.double() for v in totals.values()])
    dist.all_reduce(summed)
    return dict(zip(totals, summed.unbind(), strict=True))


def max_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """A device scalar's maximum over the ranks (an all-reduce; nothing is read back)."""
    out = value.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return out


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {
        "model": get_model_state_dict(model, options=opts),
        "optimizer": get_optimizer_state_dict(model, optimizer, options=opts),
    }


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, state["model"], options=opts)
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=opts)
