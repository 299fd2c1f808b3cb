"""How long a training batch takes to reach a Ray actor: ``ray.put`` plus an actor call until the actor
holds it, for scale_bench's batch (128 rows of 256-512 + 256-512 tokens, 3.9 MB of tensors). Compares
the batch as it travels now (trainer/batch/_serialization.py: CPU tensors as NumPy arrays, out of band) with the same
tensors pickled by torch, as every Batch travelled before (a dict of its fields). Prints JSON.

    python benchmarks/batch_transfer.py [--reps 20] [--out benchmarks/results/batch_transfer_cpu.json]

The data-parallel trainer puts each update's batch once and every rank receives it (trainer/distributed/data_parallel.py), so
this is part of the dispatch that scale_bench's ``--rank-times`` reports as ``rank_start_s``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import result_file


def _as_torch_pickles(batch: Any) -> dict[str, Any]:
    """The batch's fields in a dict, its calls' too: the tensors pickle as torch pickles them."""
    fields = dict(vars(batch))
    fields["calls"] = dict(vars(batch.calls))
    return fields


async def _measure(actor: Any, payloads: dict[str, Any], reps: int) -> dict[str, dict[str, Any]]:
    """Each payload put and sent ``reps`` times, the payloads taking turns (after one warm-up each), so
    that drift over the run falls on both alike."""
    import ray

    put: dict[str, list[float]] = {name: [] for name in payloads}
    reached: dict[str, list[float]] = {name: [] for name in payloads}
    for rep in range(reps + 1):
        for name, payload in payloads.items():
            t0 = time.time()
            ref = ray.put(payload)
            t1 = time.time()
            arrived = await actor.arrived.remote(ref)
            if rep:  # the first round is a warm-up
                put[name].append(t1 - t0)
                reached[name].append(arrived - t0)
    return {
        name: {
            "put_ms_median": round(1e3 * statistics.median(put[name]), 2),
            "reached_actor_ms_median": round(1e3 * statistics.median(reached[name]), 2),
            "reached_actor_ms_all": [round(1e3 * r, 2) for r in reached[name]],
        }
        for name in payloads
    }


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.reps < 1:
        raise SystemExit(f"--reps must be at least 1, got {args.reps}")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    import torch
    from scale_bench import _batch

    root = str(Path(__file__).resolve().parents[1])  # the actor's process imports trainer/ from here
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    ray.init(num_cpus=1, include_dashboard=False, configure_logging=False, log_to_driver=False)

    @ray.remote(num_cpus=0)
    class Receiver:
        def arrived(self, payload: Any) -> float:
            return time.time()

    actor = Receiver.remote()  # type: ignore[attr-defined]
    batch = _batch(128, 512, 512)
    tensor_bytes = sum(
        t.numel() * t.element_size()
        for fields in (vars(batch), vars(batch.calls))
        for t in fields.values()
        if isinstance(t, torch.Tensor)
    )
    figures = {
        "ray": ray.__version__,
        "torch": torch.__version__,
        "rows": len(batch),
        "tensor_mb": round(tensor_bytes / 1e6, 2),
        "reps": args.reps,
        **await _measure(
            actor,
            {"batch_as_numpy_arrays": batch, "tensors_pickled_by_torch": _as_torch_pickles(batch)},
            args.reps,
        ),
    }
    ray.shutdown()
    new, old = figures["batch_as_numpy_arrays"], figures["tensors_pickled_by_torch"]
    figures["reached_actor_speedup"] = round(
        old["reached_actor_ms_median"] / new["reached_actor_ms_median"], 2
    )
    document = result_file.result(
        result_file.header("batch_transfer", gpu=None), figures
    )  # the host's CPUs only: no GPU is used
    if args.out:
        result_file.write(args.out, document)
    sys.stdout.write(json.dumps(document, indent=2) + "\n")


if __name__ == "__main__":
    asyncio.run(main())
