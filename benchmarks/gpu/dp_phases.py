"""Where a data-parallel (FSDP2) trainer update spends its time, per rank (a diagnostic, not a target).

    torchrun --nproc_per_node N benchmarks/gpu/dp_phases.py --rows 128 [--no-compile] [--bf16-params]
        [--bf16-reduce] [--no-reshard] [--grad-sync-per-mini-batch] [--fsdp-size K] [--override KEY=VALUE]

Every rank builds scale_bench's batch (``--rows`` samples in all, prompts and responses of 50-100% of
``--prompt-len`` / ``--response-len``), a ``ShardedActor`` over the N ranks, and times its update with
each phase wrapped in ``cuda.synchronize()`` timers: the old-logprob pass, each micro-batch's forward
and backward, the gradient step (clip + AdamW), and the rest. Prints one JSON line per rank (its
tokens, micro-batch shapes, phase seconds, the FSDP2 collectives it issued in the timed update, and the
options it ran with) and the update time without the timers. No Ray: torchrun starts the ranks, so it
runs where Ray is not installed. The FSDP2 options combine; each sets a key of the trainer's
fsdp_config (``--bf16-params`` and ``--bf16-reduce``: ``mixed_precision.param_dtype`` / ``reduce_dtype``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from scale_bench import _batch, _config, counter_deltas, profiled_update, thread_counters  # noqa: E402

from benchmarks.gpu.random_model import build_random_model  # noqa: E402
from trainer.distributed.data_parallel import ShardedActor  # noqa: E402
from trainer.model.actor import Actor  # noqa: E402


class PhaseTimer:
    """Accumulates synchronized wall time per phase name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.shapes: list[list[int]] = []

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            torch.cuda.synchronize()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
            self.calls[name] = self.calls.get(name, 0) + 1
            return out

        return timed


def _overrides(args: argparse.Namespace) -> list[str]:
    """The trainer config keys the flags set."""
    out = []
    if args.no_compile:
        out.append("actor_rollout_ref.actor.use_torch_compile=false")
    if args.no_reshard:
        out.append("actor_rollout_ref.actor.fsdp_config.reshard_after_forward=false")
    if args.grad_sync_per_mini_batch:
        out.append("actor_rollout_ref.actor.fsdp_config.grad_sync_per_micro_batch=false")
    if args.fsdp_size != -1:
        out.append(f"actor_rollout_ref.actor.fsdp_config.fsdp_size={args.fsdp_size}")
    if args.bf16_params:
        out.append("actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16")
    if args.bf16_reduce:
        out.append("actor_rollout_ref.actor.fsdp_config.mixed_precision.reduce_dtype=bf16")
    return out


_COLLECTIVES = (  # what FSDP2 calls, by torch version (a deprecated name forwards to its successor)
    "all_gather_single",
    "all_gather_into_tensor",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "all_reduce",
)


def _count_collectives(counts: dict[str, int]) -> Callable[[], None]:
    """Count torch.distributed calls by name into ``counts`` (a call made inside another counted call,
    as a deprecated name forwarding, counts once); returns the function that restores them."""
    depth = [0]
    originals = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

    def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if depth[0] == 0:
                counts[name] = counts.get(name, 0) + 1
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1

        return call

    def restore() -> None:
        for name, fn in originals.items():
            setattr(dist, name, fn)

    for name, fn in originals.items():
        setattr(dist, name, counted(name, fn))
    return restore


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--response-len", type=int, default=512)
    ap.add_argument("--token-budget", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bf16-params", action="store_true", help="fsdp_config.mixed_precision.param_dtype=bf16")
    ap.add_argument(
        "--bf16-reduce", action="store_true", help="fsdp_config.mixed_precision.reduce_dtype=bf16"
    )
    ap.add_argument("--no-reshard", action="store_true", help="FSDP2 keeps parameters gathered after forward")
    ap.add_argument(
        "--grad-sync-per-mini-batch",
        action="store_true",
        help="fsdp_config.grad_sync_per_micro_batch=false: one gradient reduce-scatter per mini-batch",
    )
    ap.add_argument(
        "--fsdp-size", type=int, default=-1, help="fsdp_config.fsdp_size (1: replicated, no all-gathers)"
    )
    ap.add_argument("--no-compile", action="store_true", help="actor.use_torch_compile=false")
    ap.add_argument(
        "--override", action="append", default=[], help="a config override KEY=VALUE (repeatable)"
    )
    ap.add_argument(
        "--profile",
        default=None,
        help="one update under torch.profiler; rank r writes its kernel table to PROFILE.rankr",
    )
    ap.add_argument(
        "--single-device",
        action="store_true",
        help="one rank only: the single-device Actor (no FSDP) instead of ShardedActor, for FSDP's own cost",
    )
    args = ap.parse_args()
    args.param_dtype = "bf16" if args.bf16_params else "fp32"  # scale_bench's _config reads these two
    args.reduce_dtype = "bf16" if args.bf16_reduce else "fp32"
    args.cpu_binding = "none"  # torchrun's ranks stay where the OS puts them
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    model = str(build_random_model("qwen2-0.5b")) if rank == 0 else ""
    holder = [model]
    dist.broadcast_object_list(holder)
    args.batch, args.device = args.rows, "cuda"
    overrides = [*_overrides(args), *args.override]
    config = _config(holder[0], args.rows, args).with_overrides(overrides)
    if args.single_device and world != 1:
        raise SystemExit(f"--single-device runs one rank (torchrun --nproc_per_node 1), got {world}")
    actor = (
        Actor(config, holder[0], "cuda")
        if args.single_device
        else ShardedActor(config, holder[0], "cuda", rank, world)
    )
    batch = _batch(args.rows, args.prompt_len, args.response_len)

    actor.update(batch)  # warm-up
    plain, counters = [], []
    for _ in range(args.reps):
        torch.cuda.synchronize()
        dist.barrier()
        before = thread_counters()
        t0 = time.perf_counter()
        actor.update(batch)
        torch.cuda.synchronize()
        plain.append(time.perf_counter() - t0)
        counters.append(counter_deltas(before, thread_counters()))

    profiled = None
    if args.profile:
        profiled = profiled_update(actor, batch, table_rows=40)
        tables = profiled.pop("table") + "\n" + profiled.pop("cpu_table") + "\n"
        Path(f"{args.profile}.rank{rank}").write_text(tables)

    timer = PhaseTimer()
    actor._old_logprobs = timer.wrap("old_logprobs", actor._old_logprobs)  # type: ignore[method-assign]
    actor._apply_gradients = timer.wrap("apply_gradients", actor._apply_gradients)  # type: ignore[method-assign]
    forward = actor._forward

    def forward_noted(model: Any, mb: Any, entropy: bool) -> Any:
        shape = mb.input_ids.shape
        timer.shapes.append([int(shape[0]), int(shape[1]), int(mb.attention_mask.sum())])
        return forward(model, mb, entropy)

    actor._forward = timer.wrap("forward", forward_noted)  # type: ignore[method-assign]
    backward = torch.Tensor.backward
    torch.Tensor.backward = timer.wrap("backward", backward)  # type: ignore[method-assign]
    collectives: dict[str, int] = {}
    restore = _count_collectives(collectives)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    metrics = actor.update(batch)
    torch.cuda.synchronize()
    timed_total = time.perf_counter() - t0
    restore()
    torch.Tensor.backward = backward  # type: ignore[method-assign]
    report = {
        "rank": rank,
        "world": world,
        "rows": args.rows,
        "options": {
            "bf16_params": args.bf16_params,
            "bf16_reduce": args.bf16_reduce,
            "no_reshard": args.no_reshard,
            "grad_sync_per_mini_batch": args.grad_sync_per_mini_batch,
            "fsdp_size": args.fsdp_size,
            "no_compile": args.no_compile,
            "single_device": args.single_device,
            "config_overrides": overrides,
            "env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
        },
        "update_s_median": round(statistics.median(plain), 4),
        "update_s_all": [round(x, 4) for x in plain],
        # each update's main-thread CPU seconds, context switches and niceness (as scale_bench's in-rank loop)
        "main_thread_by_update": counters,
        "timed_update_s": round(timed_total, 4),
        "phase_s": {k: round(v, 4) for k, v in timer.seconds.items()},
        "phase_calls": timer.calls,
        "optimizer_steps": int(metrics["actor/optimizer_steps"]),
        "loss_metrics": {k: metrics.get(k) for k in ("actor/pg_loss", "actor/grad_norm", "actor/entropy")},
        "profiled_update": profiled,
        "collective_calls": collectives,  # in the timed update, by torch.distributed function
        "forward_shapes_rows_width_tokens": timer.shapes,
        "note": "forward includes the old-logprob forwards (also inside old_logprobs) when the update "
        "runs that pass (not on-policy: actor.on_policy_old_logprobs)",
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }
    for r in range(world):  # one rank at a time: whole lines on the shared stdout
        if r == rank:
            print(json.dumps(report), flush=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
