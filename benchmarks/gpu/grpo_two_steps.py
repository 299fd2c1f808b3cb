"""Two GRPO steps through the whole stack on a chosen engine backend: does the weights version advance
and is the engine/train logprob gap reported?

``Trainer(config).fit(arithmetic_agent, train)`` for exactly 2 steps with the demo's task (trainer/demos/arithmetic.py:
"What is a + b?", answer in a tag, the openai client against the proxy), the engine from ``--backend``
(``actor_rollout_ref.rollout.engine_backend`` is set to it too), ``actor.use_engine_logprobs`` False so
the trainer recomputes old logprobs and reports ``actor/engine_logprob_gap_mean``/``max``. Prints one
JSON object (also to ``--out``): per step the weights versions its samples were generated with (read
from the LLM calls the proxy recorded in the run's store), the engine's version after the sync, the gap,
the reward and the timings; then the card and library versions. Exits 1 unless every step's samples
came from the version the previous step's sync produced, the engine's version went up by one per step,
and the gap metric is there and finite in both steps.

    python benchmarks/gpu/grpo_two_steps.py --backend torch --device cpu --model tiny   # CPU proof, ~1 min
    python benchmarks/gpu/grpo_two_steps.py --backend vllm --device cuda                # the GPU machine

``--model``: an alias (default smollm2-135m-instruct), a Hugging Face folder, or ``tiny`` (a random
2-layer model with the SmolLM2 tokenizer: rewards are all 0, so the update moves nothing, but versions
and the gap are exercised). The script builds the engine itself and hands it to ``fit``: the trainer
does not read ``rollout.engine_backend`` when it builds one (see ``engine_built_by`` in the output).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

GAP_KEYS = ("actor/engine_logprob_gap_mean", "actor/engine_logprob_gap_max")
TIMING_KEYS = ("timing/rollout_s", "timing/update_wall_s", "timing/sync_s", "timing/step_s")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=["torch", "vllm"], default="torch")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="alias, HF folder, or 'tiny'")
    ap.add_argument(
        "--device", default="auto", help="trainer device (and the torch engine's): cpu, cuda, auto"
    )
    ap.add_argument("--batch-size", type=int, default=4, help="prompts per step")
    ap.add_argument("--n", type=int, default=4, help="samples per prompt (GRPO group)")
    ap.add_argument("--max-tokens", type=int, default=24, help="max tokens per reply (the demo's)")
    ap.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (the demo's)")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--dtype", default="bfloat16", help="vllm backend: the engine's dtype")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="vllm backend")
    ap.add_argument("--enforce-eager", action="store_true", help="vllm backend: no CUDA graphs")
    ap.add_argument("--run-dir", default=None, help="the run folder (default: a new temp folder)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    return ap.parse_args(argv)


def resolve(model: str) -> str:
    from agentloop.engine.models import resolve_model
    from tests.tiny_model import build_tiny_model

    if model == "tiny":
        return str(build_tiny_model(Path(tempfile.gettempdir()) / "agentloop-grpo-two-steps-tiny"))
    return str(resolve_model(model))


def make_engine(args: argparse.Namespace, model_path: str) -> Any:
    from agentloop.engine.factory import load_engine

    if args.backend == "vllm":  # vLLM is imported only here
        engine = load_engine(model_path, device="cuda", backend="vllm", dtype=args.dtype,
                             gpu_memory_utilization=args.gpu_memory_utilization,
                             enforce_eager=args.enforce_eager, max_batch_size=64)  # fmt: skip
        # vLLM takes tens of seconds to start: not inside the first agent's request (60 s timeout).
        # It runs on its own thread's loop, so starting it from this short-lived loop is fine.
        asyncio.run(engine.start())
        return engine
    return load_engine(model_path, device=args.device, backend="torch", max_batch_size=64)


def trainer_config(args: argparse.Namespace, model_path: str, run_dir: Path) -> dict[str, Any]:
    """The demo's GRPO config (trainer/demos/arithmetic.py) for two steps on ``--backend``, without validation or
    checkpoints, recomputing old logprobs so the engine/trainer gap metric is computed."""
    from trainer.demos.arithmetic import grpo_config

    config = grpo_config(argparse.Namespace(**vars(args), steps=2, test_freq=0, seed=0), run_dir, model_path)
    config["actor_rollout_ref"]["rollout"]["engine_backend"] = args.backend
    config["actor_rollout_ref"]["actor"]["use_engine_logprobs"] = False
    config["trainer"].update(val_before_train=False, test_freq=-1, save_freq=-1)
    return config


async def sample_versions(store_path: Path) -> dict[int, list[int | None]]:
    """Training step (0-based, from the rollout's metadata) -> the weights versions of its LLM calls."""
    from agentloop.store.sqlite import SQLiteStore
    from agentloop.types import LLMCall

    store = SQLiteStore(store_path)
    try:
        out: dict[int, set[int | None]] = {}
        for rollout in await store.list_rollouts():
            if rollout.mode != "train" or "step" not in rollout.metadata:
                continue
            versions = out.setdefault(int(rollout.metadata["step"]), set())  # type: ignore[arg-type]
            for span in await store.query_spans(rollout.rollout_id):
                if isinstance(span.payload, LLMCall) and span.payload.error is None:
                    versions.add(span.payload.weights_version)
    finally:
        await store.close()
    return {step: sorted(v, key=lambda x: -1 if x is None else x) for step, v in sorted(out.items())}


def versions_info(backend: str, device: str) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "python": sys.version.split()[0]}
    for name in ("transformers", "ray", "vllm"):
        try:
            info[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            info[name] = None
    return info


def card(backend: str, device: str) -> str | None:
    """The GPU the run used (the header's card), None for a run on the CPU."""
    import torch

    if torch.cuda.is_available() and (backend == "vllm" or device.startswith(("cuda", "auto"))):
        return torch.cuda.get_device_name(0)
    return None


def check(steps: list[dict[str, Any]], start_version: int) -> list[str]:
    """What is wrong with the run (empty: the versions advanced and the gap was reported)."""
    problems = []
    if len(steps) != 2:
        problems.append(f"expected 2 training steps, got {len(steps)}")
    expected = start_version  # the version the step's samples must come from
    for s in steps:
        if s["sample_weights_versions"] != [expected]:
            problems.append(
                f"step {s['step']}: samples came from versions {s['sample_weights_versions']}, "
                f"expected [{expected}] (the version the previous sync produced)"
            )
        if s["engine_weights_version_after_sync"] != expected + 1:
            problems.append(
                f"step {s['step']}: the engine's version after the sync is "
                f"{s['engine_weights_version_after_sync']}, expected {expected + 1}"
            )
        expected += 1
        for key in GAP_KEYS:
            value = s.get(key.removeprefix("actor/"))
            if value is None or not math.isfinite(value):
                problems.append(f"step {s['step']}: {key} is missing or not finite ({value})")
    return problems


def main(argv: list[str] | None = None) -> int:
    from agentloop.logging import configure_logging

    args = parse_args(argv)
    # before the imports below: their module loggers take the configuration in force when imported
    configure_logging(level=os.environ.get("AGENTLOOP_LOG_LEVEL", "WARNING"))
    import anyio

    from trainer import Trainer
    from trainer.demos.arithmetic import SETTINGS, arithmetic_agent, make_datasets

    t0 = time.perf_counter()
    model_path = resolve(args.model)
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="grpo-two-steps-"))
    train, _ = make_datasets(operand_max=20, val_size=1, seed=0)
    SETTINGS.max_tokens, SETTINGS.format_bonus = args.max_tokens, 0.1  # the demo's training reward
    SETTINGS.request_timeout_s = 300.0  # a first vLLM request may wait on a compile
    engine = make_engine(args, model_path)
    start_version = int(engine.weights_version)
    t_engine = time.perf_counter()
    try:
        result = Trainer(trainer_config(args, model_path, run_dir)).fit(
            arithmetic_agent, train, engine=engine
        )
    finally:
        anyio.run(engine.stop)
        import ray

        if ray.is_initialized():
            ray.shutdown()
    t_fit = time.perf_counter()
    by_step = anyio.run(sample_versions, run_dir / "store.db")
    steps = []
    for i, row in enumerate(result.history):
        steps.append(
            {
                "step": int(row["step"]),
                "sample_weights_versions": by_step.get(i, []),
                "engine_weights_version_after_sync": int(row.get("weights_version", -1)),
                **{k.removeprefix("actor/"): row.get(k) for k in GAP_KEYS},
                "reward_mean": row.get("reward/mean"),
                "reward_std": row.get("reward/std"),
                "samples": row.get("batch/samples"),
                "rollouts_failed": row.get("rollout/failed"),
                **{k.removeprefix("timing/"): round(row[k], 3) for k in TIMING_KEYS if k in row},
            }
        )
    problems = check(steps, start_version)
    report = {
        "ok": not problems,
        "problems": problems,
        "backend": args.backend,
        "engine": type(engine).__name__,
        "engine_built_by": "this script, handed to fit(engine=...)",
        "model": args.model,
        "device": args.device,
        "steps": steps,
        "final_engine_weights_version": int(engine.weights_version),
        "last_weight_update": {k: round(v, 4) for k, v in getattr(engine, "last_update", {}).items()},
        "load_s": round(t_engine - t0, 1),
        "fit_s": round(t_fit - t_engine, 1),
        "run_dir": str(run_dir),
        "metrics_jsonl": str(run_dir / "metrics.jsonl"),
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "run_dir")},
        **versions_info(args.backend, args.device),
    }
    from benchmarks import result_file

    document = result_file.result(
        result_file.header("grpo_two_steps", gpu=card(args.backend, args.device)), report
    )
    print(json.dumps(document, indent=2))
    if args.out:
        result_file.write(args.out, document)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
