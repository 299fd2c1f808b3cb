"""Where the seconds before the first rollout go: ``agentloop train job.yaml`` for one step, timed by phase.

Run: ``python benchmarks/startup_bench.py [--model smollm2-135m-instruct] [--device cpu]``. The script
starts itself again as a child process (so the command's own imports are timed from a cold interpreter),
and the child runs ``agentloop train`` in-process on a one-step job written to a temporary folder, with
the trainer's waits timed where they happen. Printed JSON, seconds since the child process started:

    imports_s          agentloop, the CLI and the trainer imported (torch, transformers, ray, ...)
    job_loaded_s       the job file read, the agent imported, the tasks loaded
    phases             each wait of the fit, [start, end]: the engine loading its model, Ray starting
                       and the trainer worker loading its model (Ray actor), the proxy starting
    first_rollout_s    the agent was called for the first time (issue 46's target: 15 s on 2 cores)
    first_response_s   its first model response came back
    step_s             the command returned (one step trained, final model written)
    phases_cpu         CPU seconds used by the process tree (driver, Ray's processes, the worker) at
                       each phase's start and end: on a loaded machine the wall times stretch, these
                       barely do, so they say what a quiet 2-core machine has to get through

Also the machine (CPU, cores) and its load average at start: figures on a loaded machine are inflated.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

AGENT = """
import json, os, time
import openai
import agentloop as al

MARKS = os.environ["STARTUP_BENCH_MARKS"]

def mark(name):
    from startup_bench import tree_cpu_s
    with open(MARKS, "a") as f:
        row = {"name": name, "t": time.time(), "cpu": tree_cpu_s(), "by_process": tree_cpu_s(by_process=True)}
        f.write(json.dumps(row) + "\\n")

@al.rollout
async def agent(task, llm):
    mark("rollout")
    client = openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
    out = await client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": task["prompt"]}], temperature=1.0,
        extra_body={"return_token_ids": True},
    )
    mark("response")
    return ((out.model_extra or {})["token_ids"][0] % 97) / 97
"""


def tree_cpu_s(root: int | None = None, by_process: bool = False) -> Any:
    """CPU seconds (user + system) used so far by process ``root`` (this one) and every live descendant:
    the driver, Ray's GCS, raylet and workers. Unlike wall time it barely moves with the machine's load.
    ``by_process``: a dict of CPU seconds per process name instead (driver, ray::TrainerWorker, raylet, ...)."""
    root = os.getpid() if root is None else root
    tick = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    used: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(entry.name)] = int(fields[1])
        used[int(entry.name)] = (int(fields[11]) + int(fields[12])) / tick
    total = 0.0
    names: dict[str, float] = {}
    for pid in used:
        p = pid
        while p not in (0, 1) and p != root:
            p = parent.get(p, 0)
        if p == root:
            total += used[pid]
            name = "driver" if pid == root else _process_name(pid)
            names[name] = round(names.get(name, 0.0) + used[pid], 2)
    return names if by_process else round(total, 2)


def _process_name(pid: int) -> str:
    """``ray::TrainerWorker``, ``gcs_server``, ``raylet``, or the script a Python process runs."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return "gone"
    if argv[0].startswith("ray::"):
        return argv[0].split()[0]
    scripts = [Path(a).name for a in argv[1:3] if a.endswith(".py")]
    return scripts[0] if scripts else Path(argv[0]).name


def job(model: str, device: str) -> dict[str, Any]:
    return {
        "agent": "agent.py:agent",
        "train_data": "tasks.jsonl",
        "data": {"train_batch_size": 2, "max_prompt_length": 64, "max_response_length": 8},
        "actor_rollout_ref": {
            "model": {"path": model},
            "rollout": {"n": 2},
            "actor": {"ppo_mini_batch_size": 2},
        },
        "trainer": {"total_training_steps": 1, "device": device, "logger": ["jsonl"], "save_last": False},
    }


def child(folder: Path, t0: float) -> dict[str, Any]:
    """In the child: time the imports, then ``agentloop train`` with the fit's waits timed."""
    import trainer.fit.trainer as rt
    from agentloop.cli import main

    imports_s, imports_cpu = time.time() - t0, tree_cpu_s()
    marks = Path(os.environ["STARTUP_BENCH_MARKS"])
    phases: dict[str, list[float]] = {}
    deadline = rt.deadline

    cpu: dict[str, list[float]] = {}

    async def timed_deadline(awaitable: Any, limit: float, what: str, key: str) -> Any:
        start, start_cpu = time.time() - t0, tree_cpu_s()
        try:
            return await deadline(awaitable, limit, what, key)
        finally:
            phases.setdefault(what, [round(start, 2), round(time.time() - t0, 2)])
            cpu.setdefault(what, [start_cpu, tree_cpu_s()])

    rt.deadline = timed_deadline  # type: ignore[assignment]
    import trainer.fit.worker_loading as wl

    wl.deadline = timed_deadline  # type: ignore[assignment]  # the worker's load, awaited where first needed
    init_ray = rt.init_ray

    def timed_init_ray(config: Any) -> Any:
        start, start_cpu = time.time() - t0, tree_cpu_s()
        try:
            return init_ray(config)
        finally:
            phases.setdefault("ray.init", [round(start, 2), round(time.time() - t0, 2)])
            cpu.setdefault("ray.init", [start_cpu, tree_cpu_s()])

    rt.init_ray = timed_init_ray  # type: ignore[assignment]
    from agentloop.commands import train as train_cmd

    load_job = train_cmd.load_job
    loaded: list[float] = []

    def timed_load_job(*args: Any, **kwargs: Any) -> Any:
        out = load_job(*args, **kwargs)
        loaded.append(time.time() - t0)
        cpu["job_loaded"] = [imports_cpu, tree_cpu_s()]
        return out

    train_cmd.load_job = timed_load_job  # type: ignore[assignment]
    rc = main(["train", str(folder / "job.yaml")])
    step_s = time.time() - t0
    seen: dict[str, float] = {}
    by_process: dict[str, dict[str, float]] = {}
    for line in marks.read_text().splitlines() if marks.exists() else []:
        row = json.loads(line)
        seen.setdefault(row["name"], row["t"] - t0)
        cpu.setdefault(f"until_first_{row['name']}", [0.0, row["cpu"]])
        by_process.setdefault(f"until_first_{row['name']}", row["by_process"])
    return {
        "rc": rc,
        "imports_s": round(imports_s, 2),
        "imports_cpu_s": imports_cpu,
        # CPU seconds of the process tree in each phase, [at start, at end]: what 2 idle cores must do
        "phases_cpu": cpu,
        "cpu_by_process": by_process,  # CPU seconds of each live process at the first rollout and response
        "job_loaded_s": round(loaded[0], 2) if loaded else None,
        "phases": phases,
        "first_rollout_s": round(seen["rollout"], 2) if "rollout" in seen else None,
        "first_response_s": round(seen["response"], 2) if "response" in seen else None,
        "step_s": round(step_s, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a model alias or folder")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--t0", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.t0)))
        return
    sys.path.insert(0, str(ROOT))
    from benchmarks import result_file

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "agent.py").write_text(AGENT)
        (folder / "tasks.jsonl").write_text(
            "".join(json.dumps({"prompt": f"Say {i}."}) + "\n" for i in range(4))
        )
        (folder / "job.yaml").write_text(json.dumps(job(args.model, args.device)))  # JSON is YAML
        env = {**os.environ, "STARTUP_BENCH_MARKS": str(folder / "marks.jsonl")}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        load = os.getloadavg()
        t0 = time.time()
        out = subprocess.run(
            [sys.executable, __file__, "--child", str(folder), "--t0", str(t0), "--model", args.model],
            env=env,
            cwd=folder,
            capture_output=True,
            text=True,
            timeout=1800,
        )
        wall = time.time() - t0
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        sys.stderr.write(out.stderr[-5000:])
        raise SystemExit(f"the child run failed (exit {out.returncode})")
    result = json.loads(lines[-1])
    if result["rc"] != 0:
        result["stderr_tail"] = out.stderr[-3000:]
    result.update(model=args.model, device=args.device, wall_s=round(wall, 2))
    loadavg = [round(x, 2) for x in load]
    gpu = "auto" if args.device.startswith("cuda") else None
    document = result_file.result(
        result_file.header("startup_bench", gpu=gpu, loadavg_at_start=loadavg), result
    )
    print(json.dumps(document, indent=2))
    if args.out is not None:
        result_file.write(args.out, document)


if __name__ == "__main__":
    main()
