"""One result file per benchmark run: a fixed header, then the benchmark's own figures.

Every file under ``benchmarks/results/`` is one JSON object whose first keys are the header, filled in by
the script that ran, never by hand:

- ``benchmark``: the benchmark's short name (``"store_bench"``);
- ``command``: the command line that ran it (``python benchmarks/store_bench.py --out ...``);
- ``commit``: ``git rev-parse HEAD`` of the checkout, ``-dirty`` appended when tracked files differ from it
  (``$AGENTLOOP_BENCH_COMMIT`` where the checkout has no ``.git``, as on a GPU machine given a copy), else
  ``"unknown"``;
- ``machine``: ``{"cpu": model name, "cores": logical CPUs, "memory_gb": RAM}`` plus what the script adds
  (its load average, torch's threads);
- ``card``: the GPUs (``"NVIDIA H200"``, ``"4 x NVIDIA H200"``), or null for a run on the CPU;
- ``date``: when the file was written, UTC, ISO 8601.

The benchmark's own keys follow at the top level, not under one key: ``agentloop bench --results`` reads
figures by dotted key from the top of a file (``throughput.memory.32``). So a figure may not be named as a
header field (the header would hide it); :func:`result` refuses one. A file holds one run: history goes
to ``benchmarks/NOTES.md``, not into dated keys beside the run. ``docs/gen_results.py`` renders the docs'
results page from these files.

Imported as ``benchmarks.result_file`` (the scripts put the checkout's root on ``sys.path``).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from benchmarks.bench_machine import card, cpu_model, memory_gb

ROOT = Path(__file__).resolve().parents[1]
HEADER = ("benchmark", "command", "commit", "machine", "card", "date")
COMMIT_ENV = "AGENTLOOP_BENCH_COMMIT"  # the commit of a copy without .git (a GPU machine's working tree)


def machine(**extra: Any) -> dict[str, Any]:
    """The header's ``machine``: CPU model, logical cores and RAM, then ``extra`` (load average, threads)."""
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "memory_gb": memory_gb(), **extra}


def commit() -> str:
    """``git rev-parse HEAD`` (+ ``-dirty`` when tracked files changed), ``$AGENTLOOP_BENCH_COMMIT``
    where there is no git checkout, else "unknown"."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=30
        )
        if head.returncode == 0:
            status = subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=60,
            )
            dirty = status.returncode != 0 or bool(status.stdout.strip())
            return head.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get(COMMIT_ENV) or "unknown"


def command_line(argv: list[str] | None = None) -> str:
    """This process's command as one could type it from the checkout's root: ``python benchmarks/x.py ...``."""
    args = list(sys.argv if argv is None else argv)
    if args:
        script = Path(args[0])
        try:
            args[0] = str(script.resolve().relative_to(ROOT))
        except ValueError:
            pass
    return shlex.join(["python", *args])


def header(
    benchmark: str,
    command: str | None = None,
    gpu: str | Literal["auto"] | None = "auto",
    **machine_extra: Any,
) -> dict[str, Any]:
    """The fixed header of a run of ``benchmark`` now, on this machine.

    ``command``: the command line (default: this process's); ``gpu``: the card (default: the GPUs this
    process sees; None for a CPU run on a machine that has GPUs); ``machine_extra``: added to ``machine``."""
    return {
        "benchmark": benchmark,
        "command": command if command is not None else command_line(),
        "commit": commit(),
        "machine": machine(**machine_extra),
        "card": card() if gpu == "auto" else gpu,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def result(head: dict[str, Any], figures: dict[str, Any]) -> dict[str, Any]:
    """The run's document: ``head`` (from :func:`header`), then ``figures``, whose keys may not be header fields."""
    missing = [k for k in HEADER if k not in head]
    if missing:
        raise ValueError(f"the header lacks {missing}: build it with header(...)")
    clash = [k for k in figures if k in HEADER]
    if clash:
        raise ValueError(
            f"figures {clash} are named as header fields {list(HEADER)}: rename them (the header is written "
            "by header(), machine facts go in header(..., **machine_extra))"
        )
    return {**{k: head[k] for k in HEADER}, **figures}


def write(path: str | Path, document: dict[str, Any]) -> None:
    """Write ``document`` (from :func:`result`) as indented JSON, creating the folder."""
    missing = [k for k in HEADER if k not in document]
    if missing:
        raise ValueError(
            f"{path}: a result file needs the header fields {missing} (see benchmarks/result_file.py)"
        )
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=2) + "\n")
