"""What the proxy costs beyond the load generator's own floor, per engine, in one run.

Runs, on one machine and back to back: ``client_floor.py`` (the agents' clients and HTTP alone against
a server answering at once), ``engine_bench.py --via-proxy`` for each engine (direct rounds and
proxied rounds alternating, one engine warm), then the floor again. Per engine::

    proxy_loss_beyond_floor = 1 - direct_round / (proxied_round - client_floor_round)

with medians of the timed rounds (the floor's over both of its runs): what the proxy adds to a burst
of N calls beyond what N ``openai`` clients cost against any server. The target is <= 0.10.

    python benchmarks/proxy_loss.py --device cuda --engines torch vllm --out benchmarks/results/proxy_loss_gpu.json
    python benchmarks/proxy_loss.py --quick        # CPU smoke: 16 agents x 16 tokens, TorchEngine
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import result_file

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TARGET = 0.10


def _run(cmd: list[str], out: Path, timeout_s: float) -> dict[str, Any]:
    """Run one benchmark script to its ``--out`` file; its stderr tail in the error when it fails."""
    proc = subprocess.run(
        [*cmd, "--out", str(out)], capture_output=True, text=True, timeout=timeout_s, cwd=REPO
    )
    if proc.returncode != 0 or not out.exists():
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise RuntimeError(f"{' '.join(cmd[1:3])} exited {proc.returncode}:\n{tail}")
    return json.loads(out.read_text())


def round_ms(tokens: list[int], tokens_per_s: list[float]) -> list[float]:
    """Each round's wall time from its tokens and tokens/s."""
    return [t / x * 1e3 for t, x in zip(tokens, tokens_per_s, strict=True)]


def beyond_floor(direct_ms: float, proxied_ms: float, floor_ms: float) -> float:
    """``1 - direct / (proxied - floor)``: the share of a proxied round, less the clients' floor,
    that the direct engine would not have spent. 0 when the proxy adds nothing beyond the floor."""
    if proxied_ms <= floor_ms:
        raise ValueError(f"a proxied round ({proxied_ms:.1f} ms) at or below the floor ({floor_ms:.1f} ms)")
    return 1 - direct_ms / (proxied_ms - floor_ms)


def engine_row(bench: dict[str, Any], floor_ms: float) -> dict[str, Any]:
    """The figures of one engine's ``--via-proxy`` run against the floor."""
    tokens = bench["tokens_per_round"]
    direct = round_ms(tokens["direct"], bench["rounds_direct"])
    proxied = round_ms(tokens["proxy"], bench["rounds_proxy"])
    d_med, p_med = statistics.median(direct), statistics.median(proxied)
    return {
        "direct_round_ms": round(d_med, 1),
        "proxied_round_ms": round(p_med, 1),
        "client_floor_round_ms": round(floor_ms, 1),
        "proxy_loss": bench["proxy_loss"],
        "proxy_loss_beyond_floor": round(beyond_floor(d_med, p_med, floor_ms), 4),
        "rounds_direct_ms": [round(x, 1) for x in direct],
        "rounds_proxied_ms": [round(x, 1) for x in proxied],
        "direct_tokens_per_s": bench["direct_tokens_per_s"],
        "proxy_tokens_per_s": bench["proxy_tokens_per_s"],
        "engine_work_in_timed_rounds": bench.get("engine_work_in_timed_rounds"),
        "proxied_round_critical_path_ms": bench.get("proxied_round_critical_path_ms"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", nargs="+", choices=["torch", "vllm"], default=["torch"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--random-config", default="qwen2-0.5b-smol-vocab")
    ap.add_argument("--agents", type=int, default=128)
    ap.add_argument("--agent-procs", type=int, default=4)
    ap.add_argument("--proxy-workers", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--quick", action="store_true", help="CPU smoke: 16 agents x 16 tokens, 3 rounds")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--raw-dir", type=Path, default=None, help="keep each script's own JSON here")
    args = ap.parse_args()
    if args.quick:
        args.agents, args.new_tokens, args.reps, args.random_config = 16, 16, 3, None
    if min(args.agents, args.agent_procs, args.reps) < 1:
        raise SystemExit("--agents, --agent-procs and --reps must be >= 1")
    py = sys.executable
    floor_cmd = [py, str(HERE / "client_floor.py"), "--agents", str(args.agents), "--agent-procs",
                 str(args.agent_procs), "--server-procs", str(max(1, args.proxy_workers)), "--reps", str(args.reps)]  # fmt: skip
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        raw = args.raw_dir or Path(tmp)
        raw.mkdir(parents=True, exist_ok=True)
        floors = [_run(floor_cmd, raw / "floor0.json", 300)]
        benches: dict[str, dict[str, Any]] = {}
        errors: dict[str, str] = {}
        for engine in args.engines:
            cmd = [py, str(HERE / "engine_bench.py"), "--via-proxy", "--backend", engine, "--device", args.device,
                   "--prompts", str(args.agents), "--new-tokens", str(args.new_tokens), "--reps", str(args.reps),
                   "--temperature", "1.0", "--top-p", "1.0", "--agent-procs", str(args.agent_procs),
                   "--proxy-workers", str(args.proxy_workers)]  # fmt: skip
            if args.random_config:
                cmd += ["--random-config", args.random_config]
            if args.quick:
                cmd += ["--quick"]
            try:
                benches[engine] = _run(cmd, raw / f"{engine}.json", 600)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:  # the other engine still runs
                errors[engine] = str(exc)[-3000:]
                print(f"{engine}: {exc}", file=sys.stderr)
        floors.append(_run(floor_cmd, raw / "floor1.json", 300))
    floor_rounds = [x for f in floors for x in f["rounds_ms"]]
    floor_ms = statistics.median(floor_rounds)
    rows = {engine: engine_row(bench, floor_ms) for engine, bench in benches.items()}
    if not benches:
        raise SystemExit(f"no engine finished: {errors}")
    first = next(iter(benches.values()))
    # the engine runs' own machine facts (torch, platform) beside the header's CPU, cores and memory
    extra = {k: v for k, v in first["machine"].items() if k not in ("cpu", "cores", "memory_gb")}
    head = result_file.header("proxy_loss", gpu=first["card"], **extra)
    result = {
        "formula": "proxy_loss_beyond_floor = 1 - direct_round / (proxied_round - client_floor_round), medians",
        "target": TARGET,
        "met": not errors and all(r["proxy_loss_beyond_floor"] <= TARGET for r in rows.values()),
        "workload": {**first["workload"], "proxy_workers": args.proxy_workers, "model": first["model"]},
        "client_floor": {
            "rounds_ms": floor_rounds,
            "median_ms": round(floor_ms, 1),
            "runs": [{k: f[k] for k in ("median_ms", "rounds_ms")} for f in floors],
        },
        "engines": rows,
        "errors": errors,
        "wall_s": round(time.time() - t0, 1),
    }
    document = result_file.result(head, result)
    print(json.dumps(document, indent=2))
    if args.out:
        result_file.write(args.out, document)


if __name__ == "__main__":
    main()
