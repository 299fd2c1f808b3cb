"""The ranks' collectives as DataParallelGroup places them (Ray GPU actors, each shown only its own GPU
through CUDA_VISIBLE_DEVICES) against the same actors shown every GPU (a diagnostic: does NCCL keep
NVLink peer-to-peer when each process sees one GPU?).

    NCCL_DEBUG=INFO python benchmarks/gpu/ray_nccl_probe.py [--ranks 4] [--mib 64 1884]

Prints one JSON line per placement: nccl_probe.py's rows and the transports NCCL logged (its " via "
lines, e.g. P2P/CUMEM or SHM), read from the Ray workers' logs.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import socket
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


class Rank:
    def __init__(self, rank: int, world: int, all_visible: bool) -> None:
        self.rank, self.world, self.all_visible = rank, world, all_visible

    def address(self) -> tuple[str, int]:
        with socket.socket() as s:
            s.bind(("", 0))
            return "127.0.0.1", int(s.getsockname()[1])

    def probe(self, addr: str, port: int, mibs: list[float]) -> dict[str, Any]:
        import ray
        import torch
        import torch.distributed as dist
        from nccl_probe import probe_rows

        os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port))
        device = int(ray.get_gpu_ids()[0]) if self.all_visible else 0
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=self.rank, world_size=self.world)
        rows = probe_rows(mibs)
        dist.destroy_process_group()
        return {"visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "device": device, "rows": rows}


def _placement(world: int, all_visible: bool, mibs: list[float]) -> dict[str, Any]:
    import ray

    if all_visible:
        os.environ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
    else:
        os.environ.pop("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", None)
    ray.init(num_gpus=world, include_dashboard=False, log_to_driver=False)
    try:
        ranks = [ray.remote(num_gpus=1)(Rank).remote(r, world, all_visible) for r in range(world)]
        addr, port = ray.get(ranks[0].address.remote())
        out = ray.get([r.probe.remote(addr, port, mibs) for r in ranks])
        logs = "".join(
            Path(f).read_text(errors="replace") for f in glob.glob("/tmp/ray/session_latest/logs/worker-*")
        )
    finally:
        ray.shutdown()
    via = sorted({m.strip() for m in re.findall(r" via ([^\n]+)", logs)})
    return {"all_visible": all_visible, "rank0": out[0], "visible": [o["visible"] for o in out], "via": via}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--mib", type=float, nargs="+", default=[64, 1884])
    args = ap.parse_args()
    for all_visible in (False, True):
        print(json.dumps(_placement(args.ranks, all_visible, args.mib)), flush=True)


if __name__ == "__main__":
    main()
