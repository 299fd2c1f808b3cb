"""What both demos (trainer.demos.arithmetic, trainer.demos.tools) share: the async-training options, the GRPO
recipe, the run folder, and one fit that loads the engine, trains, saves and stops Ray.

``trainer.demos.arithmetic`` (the arithmetic demo and the ``agentloop demo`` command, which hands ``--task tools``
to ``trainer.demos.tools``) and ``trainer.demos.tools`` both import this module, never each other.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "add_async_options",
    "check_async_options",
    "fit_and_save",
    "grpo_config",
    "mean_timings",
    "new_run_dir",
]


def add_async_options(p: argparse.ArgumentParser) -> None:
    """``--max-staleness`` and ``--weight-update-policy``: train synchronously (the default) or fully
    asynchronously (e.g. 2 and inflight: the next batches are sampled while one trains)."""
    from agentloop.engine.base import WEIGHT_UPDATE_POLICIES

    p.add_argument(
        "--max-staleness",
        type=int,
        default=0,
        help="actor_rollout_ref.rollout.max_staleness (0: synchronous)",
    )
    p.add_argument(
        "--weight-update-policy",
        choices=WEIGHT_UPDATE_POLICIES,
        default="drain",
        help="actor_rollout_ref.rollout.weight_update_policy",
    )


def grpo_config(args: argparse.Namespace, run_dir: Path, model_path: str) -> dict[str, Any]:
    """The demo's trainer config (verl keys) from its parsed command line."""
    return {
        "data": {
            "train_batch_size": args.batch_size,
            "max_prompt_length": 256,
            "max_response_length": args.max_tokens,
        },
        "actor_rollout_ref": {
            "model": {"path": model_path},
            "rollout": {
                "n": args.n,
                "temperature": args.temperature,
                "concurrency": 64,
                "max_num_seqs": 64,
                "max_staleness": args.max_staleness,
                "weight_update_policy": args.weight_update_policy,
            },
            "actor": {
                "ppo_mini_batch_size": args.batch_size,
                "ppo_max_token_len_per_gpu": 2048,  # small micro-batches keep the (b, R, 49k) logits small
                "use_engine_logprobs": True,  # the engine's logprobs match the policy's (gap ~1e-5): no extra forward
                "optim": {"lr": args.lr, "weight_decay": 0.0},
                "grad_clip": 1.0,
            },
        },
        "algorithm": {"adv_estimator": "grpo"},
        "trainer": {
            "total_training_steps": args.steps,
            "test_freq": args.test_freq if args.test_freq > 0 else args.steps,
            "val_before_train": True,
            "default_local_dir": str(run_dir),
            "device": args.device,
            "logger": ["jsonl"],
            "resume": "disable",
            "save_last": False,  # a fresh folder per demo: nothing continues it, no 1.6 GB checkpoint
            "seed": args.seed,
        },
    }


def check_async_options(args: argparse.Namespace) -> None:
    """Refuse a negative ``--max-staleness`` with a message that names the flag."""
    if args.max_staleness < 0:
        raise ValueError(f"--max-staleness must be >= 0, got {args.max_staleness}")


def new_run_dir(args: argparse.Namespace, prefix: str) -> Path:
    """``--out/--name`` (default ``<prefix>-<time>``); refuses a folder that already holds a run."""
    run_dir = Path(args.out) / (args.name or time.strftime(f"{prefix}-%Y%m%d-%H%M%S"))
    if run_dir.exists() and any(run_dir.iterdir()):
        raise FileExistsError(f"run folder {run_dir} already exists and is not empty; pick another --name")
    return run_dir


def fit_and_save(
    args: argparse.Namespace,
    run_dir: Path,
    make_config: Callable[[argparse.Namespace, Path, str], dict[str, Any]],
    agent: Any,
    train: list[dict],
    val: list[dict],
) -> tuple[Any, float, float]:
    """Load ``--model`` into an engine, train ``agent`` with the config ``make_config`` builds (fit writes
    the trained model to ``run_dir/final_model``) and stop the engine and Ray.

    Returns the FitResult, the seconds loading took and the seconds training took."""
    import anyio

    from agentloop.engine.factory import load_engine
    from agentloop.engine.models import resolve_model
    from trainer.config import TrainerConfig, engine_kwargs
    from trainer.fit.trainer import Trainer

    t_start = time.perf_counter()
    model_path = str(resolve_model(args.model))
    config = TrainerConfig.from_dict(make_config(args, run_dir, model_path))
    # the engine the config describes (slots, weight update policy), as fit would build it
    engine = load_engine(model_path, device=args.device, **engine_kwargs(config.actor_rollout_ref.rollout))
    t_loaded = time.perf_counter()
    result = Trainer(config).fit(agent, train, val, engine=engine)
    t_trained = time.perf_counter()
    anyio.run(engine.stop)
    _shutdown_ray()
    return result, t_loaded - t_start, t_trained - t_loaded


def mean_timings(history: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for row in history for k in row if k.startswith("timing/")})
    out = {}
    for key in keys:
        values = [row[key] for row in history if key in row]
        out[key.removeprefix("timing/")] = sum(values) / len(values)
    return out


def _shutdown_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()
