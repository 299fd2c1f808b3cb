"""``agentloop bench``: run the scripts under benchmarks/ and print one table of figures vs targets.

Each script prints one JSON object; a target names a dotted key in it, a comparison and a threshold.
``--results`` prints the table from the committed benchmarks/results/*.json without running anything.

The scripts and their committed results live in a source checkout's ``benchmarks/`` folder (they use
its ``tests/`` and ``results/``), not in the installed package, so the folder is looked for, not
assumed next to the package: ``--dir``, else the working folder or one above it (a checkout you are
in), else the checkout the package was imported from (an editable install). An installed package with
no checkout in reach says so and how to fix it instead of printing a table of n/a.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentloop.errors import UsageError

MARKER = "store_bench.py"  # a folder holding this script is a benchmarks/ folder


@dataclass(frozen=True)
class Target:
    script: str  # file under benchmarks/
    result: str  # file under benchmarks/results/ that keeps the committed figures
    key: str  # dotted path into the script's JSON
    op: str  # ">=" or "<="
    threshold: float
    label: str
    runs_here: bool = True  # False: a GPU figure, always read from the committed result


TARGETS: tuple[Target, ...] = (
    Target(
        "store_bench.py",
        "store_bench.json",
        "throughput.memory.32",
        ">=",
        2000,
        "memory store lifecycles/s @32",
    ),
    Target(
        "store_bench.py",
        "store_bench.json",
        "throughput.sqlite.32",
        ">=",
        500,
        "SQLite store lifecycles/s @32",
    ),
    Target(
        "store_bench.py", "store_bench.json", "throughput.http.32", ">=", 300, "HTTP store lifecycles/s @32"
    ),
    Target("engine_bench.py", "engine_bench_cpu.json", "ratio", ">=", 2.0, "engine vs HF generate (CPU)"),
    Target(
        "proxy_bench.py", "proxy_bench.json", "added_latency_p50_ms", "<=", 2.0, "proxy added latency p50 ms"
    ),
    Target("proxy_bench.py", "proxy_bench.json", "max_rps", ">=", 500, "proxy requests/s"),
    Target("reliability.py", "reliability.json", "server_5xx", "<=", 0, "reliability: server 5xx"),
    Target("reliability.py", "reliability.json", "lost_rollouts", "<=", 0, "reliability: lost rollouts"),
    Target(
        "engine_bench.py",
        "engine_bench_gpu.json",
        "torch.ratio",
        ">=",
        5.0,
        "GPU engine vs HF generate",
        False,
    ),
    Target(
        "engine_bench.py",
        "engine_bench_gpu.json",
        "vllm.ratio",
        ">=",
        0.9,
        "GPU vLLM engine vs raw vLLM",
        False,
    ),
    Target(
        "weight_sync_bench.py",
        "weight_sync_gpu.json",
        "sync_s_median",
        "<=",
        1.0,
        "GPU weight sync into vLLM s",
        False,
    ),
    Target(
        "gpu/vllm_cross_gpu_sync.py",
        "vllm_cross_gpu_sync.json",
        "cross_gpu_ipc.total_s_median",
        "<=",
        1.0,
        "weight sync into vLLM on another GPU s",
        False,
    ),
    Target("trainer_bench.py", "trainer_bench_gpu.json", "mfu", ">=", 0.35, "GPU trainer MFU (0.5B)", False),
    Target(
        "scale_bench.py",
        "scale_bench_2gpu.json",
        "trainer.speedup",
        ">=",
        1.8,
        "2-GPU trainer speedup",
        False,
    ),
    Target(
        "scale_bench.py",
        "scale_bench_2gpu.json",
        "rollout.speedup",
        ">=",
        1.8,
        "2-replica rollout speedup",
        False,
    ),
    Target("scale_bench.py", "weight_sync_2gpu.json", "weight_sync.sync_s", "<=", 1.0, "2-replica weight sync s (IPC)", False),
    Target("scale_bench.py", "scale_bench_4gpu.json", "trainer.speedup", ">=", 3.5, "4-GPU trainer speedup", False),
    Target("scale_bench.py", "scale_bench_4gpu.json", "rollout.speedup", ">=", 3.6, "4-replica rollout speedup", False),
    Target("scale_bench.py", "scale_bench_4gpu.json", "weight_sync.sync_s", "<=", 0.5, "4-replica weight sync s (IPC)", False),
    Target("scale_bench.py", "weight_sync_2gpu.json", "weight_sync_split.sync_s", "<=", 1.0, "split weight sync s (NCCL)", False),
    Target("async_bench.py", "async_bench_gpu.json", "speedup_steps_per_hour", ">=", 1.8, "fully async vs sync steps/h (long tail)", False),
)  # fmt: skip


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("bench", help="run benchmarks/ and print their figures against the targets")
    p.add_argument("--results", action="store_true", help="use the committed results, run nothing")
    p.add_argument("--only", default=None, help="run only this script (e.g. store_bench.py)")
    p.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="the benchmarks/ folder of a source checkout (default: found from the working folder up, "
        "else next to the imported package)",
    )
    p.set_defaults(func=run)


def find_benchmarks(explicit: Path | None = None, cwd: Path | None = None) -> Path:
    """The benchmarks/ folder to use (see the module docstring for the order); a UsageError if none."""
    if explicit is not None:
        folder = explicit.expanduser().resolve()
        if not (folder / MARKER).is_file():
            raise UsageError(f"--dir {str(explicit)!r} is not a benchmarks/ folder (it has no {MARKER})")
        return folder
    here = (cwd or Path.cwd()).resolve()
    package_checkout = Path(__file__).resolve().parents[2]
    candidates = [here, *here.parents, package_checkout]
    for base in candidates:
        for folder in (base / "benchmarks", base):
            if (folder / MARKER).is_file():
                return folder
    raise UsageError(
        f"no benchmarks/ folder found: agentloop bench runs the scripts of a source checkout (they use its "
        f"tests/ and results/), and none is in {here}, a folder above it, or next to the installed package "
        f"({package_checkout}); run it inside a checkout of agentloop or pass --dir PATH/TO/benchmarks"
    )


def lookup(doc: Any, key: str) -> Any:
    for part in key.split("."):
        if not isinstance(doc, dict) or part not in doc:
            return None
        doc = doc[part]
    return doc


def last_json_object(text: str) -> dict[str, Any] | None:
    """The last line-started JSON object in a script's stdout."""
    starts = [i for i, line in enumerate(text.splitlines()) if line.startswith("{")]
    lines = text.splitlines()
    for i in reversed(starts):
        try:
            doc = json.loads("\n".join(lines[i:]))
        except json.JSONDecodeError:
            continue
        if isinstance(doc, dict):
            return doc
    return None


def run_script(script: str, folder: Path) -> dict[str, Any] | None:
    """Run ``folder/script`` from the checkout's root (the scripts import ``tests`` and ``benchmarks``)."""
    proc = subprocess.run(
        [sys.executable, str(folder / script)], capture_output=True, text=True, cwd=folder.parent
    )
    if proc.returncode != 0:
        sys.stderr.write(f"{script} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}\n")
        return None
    return last_json_object(proc.stdout)


def run(args: argparse.Namespace) -> int:
    scripts = sorted({t.script for t in TARGETS if args.only in (None, t.script) and t.runs_here})
    if not scripts:
        raise UsageError(f"no benchmark named {args.only!r}; have {sorted({t.script for t in TARGETS})}")
    folder = find_benchmarks(getattr(args, "dir", None))
    docs: dict[str, dict[str, Any] | None] = {}
    for script in scripts:
        if not args.results:
            sys.stderr.write(f"running {script} ...\n")
            docs[script] = run_script(script, folder)
    for t in TARGETS:  # everything not run here comes from the committed results
        if args.only in (None, t.script) and (t.result not in docs):
            path = folder / "results" / t.result
            docs.setdefault(t.result, json.loads(path.read_text()) if path.exists() else None)
    w = sys.stdout.write
    w(f"{'figure':<36} {'value':>12} {'target':>12}  ok\n")
    failed = 0
    for t in TARGETS:
        doc = docs.get(t.script) if (t.runs_here and not args.results) else docs.get(t.result)
        if args.only not in (None, t.script):
            continue
        value = lookup(doc, t.key)
        if not isinstance(value, int | float):
            w(f"{t.label:<36} {'n/a':>12} {t.op + ' ' + str(t.threshold):>12}  -\n")
            failed += 1
            continue
        ok = value >= t.threshold if t.op == ">=" else value <= t.threshold
        failed += not ok
        w(f"{t.label:<36} {value:>12.3f} {t.op + ' ' + str(t.threshold):>12}  {'yes' if ok else 'NO'}\n")
    machine = next((lookup(d, "machine") for d in docs.values() if d and lookup(d, "machine")), None)
    if machine:
        w(f"machine: {json.dumps(machine)}\n")
    return 0 if failed == 0 else 1
