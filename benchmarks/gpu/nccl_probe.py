"""How fast the ranks' collectives are on their own, with no compute beside them (a diagnostic).

    torchrun --nproc_per_node 4 benchmarks/gpu/nccl_probe.py [--mib 64 519 1884]

Times all-reduce (fsdp_size=1's gradient sync), reduce-scatter and all-gather of fp32 and bf16 tensors of
each size in MiB of fp32 (default: about a Qwen2-0.5B layer's fp32 gradient, its tied embedding's, the
whole model's), the median of 5 after 2 warm-ups. Rank 0 prints one JSON line: per collective, dtype and size, seconds and
bus bandwidth (NCCL's busbw: algbw x 2(n-1)/n for all-reduce, x (n-1)/n for the others), so the time an
update's collectives cost when they are not hidden can be read against the update's phases.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist


def _timed(fn: Callable[[], object], reps: int = 5) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def probe_rows(mibs: list[float]) -> list[dict[str, object]]:
    """Time each collective, dtype and size on the initialised process group (every rank calls it)."""
    n = dist.get_world_size()
    rows = []
    for mib in mibs:
        for dtype in (torch.float32, torch.bfloat16):
            numel = int(mib * 2**20 / 4) // n * n  # the fp32 size's element count, in either dtype
            full = torch.ones(numel, dtype=dtype, device="cuda")
            part = torch.empty(numel // n, dtype=dtype, device="cuda")
            nbytes = numel * full.element_size()
            for name, fn, factor in (
                ("all_reduce", functools.partial(dist.all_reduce, full), 2 * (n - 1) / n),
                ("reduce_scatter", functools.partial(dist.reduce_scatter_tensor, part, full), (n - 1) / n),
                ("all_gather", functools.partial(dist.all_gather_into_tensor, full, part), (n - 1) / n),
            ):
                s = _timed(fn)
                rows.append(
                    {
                        "collective": name,
                        "dtype": str(dtype).removeprefix("torch."),
                        "elements": numel,
                        "mib": round(nbytes / 2**20, 1),
                        "s": round(s, 5),
                        "busbw_gb_s": round(nbytes / s * factor / 1e9, 1),
                    }
                )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=float, nargs="+", default=[64, 519, 1884], help="fp32 sizes in MiB")
    args = ap.parse_args()
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    rows = probe_rows(args.mib)
    if rank == 0:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
        from benchmarks import result_file

        n = dist.get_world_size()
        figures = {"ranks": n, "nccl": ".".join(map(str, torch.cuda.nccl.version())), "rows": rows}
        print(json.dumps(result_file.result(result_file.header("nccl_probe"), figures)))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
