"""Is a Ray actor's CPU side slower than a plain process's on the same GPUs? (GPU call, Ray kit in /tmp/rsite)

The 4-rank trainer update spends ~1.5x the CPU time per op inside Ray ranks that it spends under torchrun
on the same machine (aten::mm 30 vs 16 us a call), and at 4 ranks the update is bound by it. This times
the same CPU-bound work (tiny CUDA kernel launches, small matmuls, a pure-Python loop) in N plain processes
and in N Ray actors (one GPU each, all at once, then one alone), and reports what differs in their
environment: niceness, scheduler, CPU affinity, cgroup, threads, environment variables. One JSON line.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import sys
import time
from typing import Any


def _work() -> dict[str, Any]:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: a local smoke run, ops not launches
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    x = torch.zeros(1024, device=device)
    a = torch.randn(64, 64, device=device)
    sync()

    def timed(fn: Any, n: int) -> float:
        fn(100)
        sync()
        t0 = time.perf_counter()
        fn(n)
        sync()
        return round((time.perf_counter() - t0) / n * 1e6, 3)  # microseconds an op

    def adds(n: int) -> None:
        for _ in range(n):
            x.add_(1)

    def mms(n: int) -> None:
        for _ in range(n):
            torch.mm(a, a)

    def python(n: int) -> None:
        s = 0
        for i in range(n):
            s += i

    return {
        "add_us": timed(adds, 20000),
        "mm_us": timed(mms, 20000),
        "py_loop_us": timed(python, 2_000_000),
    }


def _context() -> dict[str, Any]:
    def read(path: str) -> str:
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError as e:
            return f"({e.__class__.__name__})"

    status = dict(line.split(":", 1) for line in read("/proc/self/status").splitlines() if ":" in line)
    return {
        "nice": os.nice(0),
        "sched": os.sched_getscheduler(0),
        "cpus": len(os.sched_getaffinity(0)),
        "cgroup": read("/proc/self/cgroup")[:200],
        "threads": int(status.get("Threads", "0")),
        "cpus_allowed": status.get("Cpus_allowed_list", "").strip(),
        "env": dict(os.environ),
    }


def _plain(gpu: str, q: Any) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = gpu  # before torch is imported
    q.put({**_work(), **_context()})


def _plain_runs(n: int) -> list[dict[str, Any]]:
    """``_work`` in ``n`` spawned processes at once, one GPU each (of those this process may see)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(n)]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_plain, args=(gpus[i % len(gpus)], q)) for i in range(n)]
    for p in procs:
        p.start()
    try:
        out = [q.get(timeout=120) for _ in procs]
    except queue.Empty:
        codes = [p.exitcode for p in procs]
        raise SystemExit(f"a plain probe process gave no result in 120 s (exit codes {codes})") from None
    for p in procs:
        p.join()
    return out


def _ray_runs(n: int) -> list[dict[str, Any]]:
    import ray

    gpus = 1 if ray.cluster_resources().get("GPU") else 0

    @ray.remote(num_gpus=gpus, num_cpus=0)
    class Probe:
        def run(self) -> dict[str, Any]:
            return {**_work(), **_context()}

    actors = [Probe.remote() for _ in range(n)]  # type: ignore[attr-defined]
    ray.get([a.__ray_ready__.remote() for a in actors])
    out = ray.get([a.run.remote() for a in actors])
    for a in actors:
        ray.kill(a)
    return out


def _summary(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    keys = ("add_us", "mm_us", "py_loop_us", "nice", "sched", "cpus", "threads", "cgroup")
    return [{k: r[k] for k in keys} for r in runs]


def main() -> None:
    import ray

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    plain_all, plain_one = _plain_runs(n), _plain_runs(1)
    ray.init(include_dashboard=False)
    ray_all, ray_one = _ray_runs(n), _ray_runs(1)
    plain_env, ray_env = plain_all[0]["env"], ray_all[0]["env"]
    env_diff = {
        k: [plain_env.get(k), ray_env.get(k)]
        for k in sorted(set(plain_env) | set(ray_env))
        if plain_env.get(k) != ray_env.get(k) and not k.startswith("RAY_") and "TOKEN" not in k
    }
    print(
        json.dumps(
            {
                "plain_all": _summary(plain_all),
                "plain_one": _summary(plain_one),
                "ray_all": _summary(ray_all),
                "ray_one": _summary(ray_one),
                "env_plain_vs_ray": env_diff,
                "ray_env_keys": sorted(k for k in ray_env if k.startswith("RAY_")),
            }
        )
    )


if __name__ == "__main__":
    main()
