"""Is a Ray actor's CPU side slower than a plain process's on the same GPUs? (GPU call, Ray kit in /tmp/rsite)

The 4-rank trainer update spends ~1.5x the CPU time per op inside Ray ranks that it spends under torchrun
on the same machine (aten::mm 30 vs 16 us a call), and at 4 ranks the update is bound by it. This times
the same CPU-bound work (tiny CUDA kernel launches, small matmuls, a pure-Python loop) in N plain processes
and in N Ray actors (one GPU each, all at once, then one alone), and reports what differs in their
environment: niceness, scheduler, CPU affinity, cgroup, threads, environment variables, speculation
controls, interpreter hooks, loaded libraries. Each process times the work a second time at another
niceness (plain: 15, Ray's; Ray: 0, where permitted), and every timed loop reports the threads of the
whole machine that used CPU meanwhile (a busy thread beside the loop, in or outside the process, slows
it through a shared core). One JSON line.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import sys
import time
from typing import Any


def _thread_cpu() -> dict[tuple[int, int], tuple[str, float]]:
    """CPU seconds so far of every thread on the machine that /proc shows: (pid, tid) -> (name, s)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            name, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
            out[(int(pid), int(tid))] = (name, (int(rest[11]) + int(rest[12])) / tick)  # utime + stime
    return out


def _busy_beside(before: dict[tuple[int, int], tuple[str, float]], wall_s: float) -> list[list[Any]]:
    """The threads other than this one that used over 5% of a CPU since ``before``, busiest first:
    [process's own thread?, name, share of one CPU]."""
    me, tid = os.getpid(), __import__("threading").get_native_id()
    rows = []
    for key, (name, cpu) in _thread_cpu().items():
        share = (cpu - before.get(key, (name, 0.0))[1]) / wall_s
        if key != (me, tid) and share > 0.05:
            rows.append([key[0] == me, name, round(share, 2)])
    return sorted(rows, key=lambda r: -r[2])[:12]


def _work() -> dict[str, Any]:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: a local smoke run, ops not launches
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    x = torch.zeros(1024, device=device)
    a = torch.randn(64, 64, device=device)
    sync()

    busy: dict[str, list[list[Any]]] = {}

    def timed(fn: Any, n: int) -> float:
        fn(100)
        sync()
        before = _thread_cpu()
        t0 = time.perf_counter()
        fn(n)
        sync()
        wall = time.perf_counter() - t0
        busy[fn.__name__] = _busy_beside(before, wall)
        return round(wall / n * 1e6, 3)  # microseconds an op

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
        "nice_now": os.nice(0),
        "busy_beside": busy,
    }


def _twice(nice: int) -> dict[str, Any]:
    """``_work`` at this process's niceness, then again at ``nice`` (None where not permitted)."""
    first = _work()
    try:
        for tid in os.listdir("/proc/self/task"):
            os.setpriority(os.PRIO_PROCESS, int(tid), nice)
        second: dict[str, Any] | None = _work()
    except (PermissionError, ProcessLookupError):
        second = None
    return {**first, "at_other_nice": second}


def _context() -> dict[str, Any]:
    def read(path: str) -> str:
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError as e:
            return f"({e.__class__.__name__})"

    import sys
    import tracemalloc

    status = {
        k: v.strip()
        for k, v in (line.split(":", 1) for line in read("/proc/self/status").splitlines() if ":" in line)
    }
    libs = sorted(
        {
            line.split()[-1].rsplit("/", 1)[-1]
            for line in read("/proc/self/maps").splitlines()
            if ".so" in line
        }
    )
    return {
        "speculation": {
            k: status.get(k)
            for k in ("Seccomp", "NoNewPrivs", "Speculation_Store_Bypass", "SpeculationIndirectBranch")
        },
        "python": {
            "executable": sys.executable,
            "dev_mode": sys.flags.dev_mode,
            "trace": repr(sys.gettrace()),
            "profile": repr(sys.getprofile()),
            "tracemalloc": tracemalloc.is_tracing(),
            "switch_interval": sys.getswitchinterval(),
            "thread_names": sorted(t.name for t in __import__("threading").enumerate()),
        },
        "libs": libs,
        "nice": os.nice(0),
        "sched": os.sched_getscheduler(0),
        "cpus": len(os.sched_getaffinity(0)),
        "cgroup": read("/proc/self/cgroup")[:200],
        "threads": int(status.get("Threads", "0")),
        "cpus_allowed": status.get("Cpus_allowed_list", ""),
        "env": dict(os.environ),
    }


def _plain(gpu: str, q: Any) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = gpu  # before torch is imported
    context = _context()  # before _twice changes the niceness
    q.put({**_twice(15), **context})


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
            context = _context()
            return {**_twice(0), **context}

    actors = [Probe.remote() for _ in range(n)]  # type: ignore[attr-defined]
    ray.get([a.__ray_ready__.remote() for a in actors])
    out = ray.get([a.run.remote() for a in actors])
    for a in actors:
        ray.kill(a)
    return out


def _summary(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    keys = ("add_us", "mm_us", "py_loop_us", "nice", "sched", "cpus", "threads", "cgroup", "at_other_nice",
            "busy_beside", "speculation", "python")  # fmt: skip
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
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from benchmarks import result_file

    print(
        json.dumps(
            result_file.result(
                result_file.header("ray_launch_probe"),
                {
                    "plain_all": _summary(plain_all),
                    "plain_one": _summary(plain_one),
                    "ray_all": _summary(ray_all),
                    "ray_one": _summary(ray_one),
                    "env_plain_vs_ray": env_diff,
                    "libs_only_plain": sorted(set(plain_all[0]["libs"]) - set(ray_all[0]["libs"])),
                    "libs_only_ray": sorted(set(ray_all[0]["libs"]) - set(plain_all[0]["libs"])),
                    "ray_env_keys": sorted(k for k in ray_env if k.startswith("RAY_")),
                },
            )
        )
    )


if __name__ == "__main__":
    main()
