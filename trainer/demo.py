"""The main job: GRPO teaches SmolLM2-135M-Instruct to answer "a + b" in a tag, on a laptop CPU.

The whole stack runs: the Trainer enqueues tasks in a SQLite store, a Runner runs ``arithmetic_agent``
(the openai client against the proxy), the proxy tokenizes once and asks the TorchEngine, the Ray
worker updates the policy and the new weights go back to the engine after every step.

Task: ``What is a + b? Put the final answer inside <answer></answer> tags.`` with a, b drawn from
0..operand_max, after one worked example turn (``15 + 23`` -> ``15 + 23 = 38\n<answer>38</answer>``,
not a dataset question). Zero-shot, SmolLM2 almost never writes the tag (0 of ~200 sampled replies
were strictly right when we measured), so RL gets no signal; with the example it uses the tag about
half the time and gets the sum right in a minority of replies: RL has to make the format reliable
and the arithmetic right. All (a, b) pairs are
shuffled with a fixed seed; the first ``val_size`` are the held-out set, the rest the training set,
so no held-out question is ever trained on. Accuracy is strict: the first ``<answer>N</answer>`` in
the reply must hold exactly a + b; validation decodes greedily and gives no format bonus.

Run it with ``agentloop demo`` (``make demo``); ``run_demo(args)`` is the same from Python.
``agentloop demo --task tools`` runs the tool-using demo instead (trainer/demo_tools.py).
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

import agentloop as al
from agentloop.types import AttemptedRollout

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam

log = structlog.get_logger("agentloop.demo")

PROMPT = "What is {a} + {b}? Put the final answer inside <answer></answer> tags."
# one worked turn; 23 lies outside the default operand range 0..20
EXAMPLE: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": PROMPT.format(a=15, b=23)},
    {"role": "assistant", "content": "15 + 23 = 38\n<answer>38</answer>"},
]
_ANSWER_RE = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")


# ---------------------------------------------------------------- data and reward


def make_datasets(operand_max: int, val_size: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, held-out) tasks: every pair (a, b) in 0..operand_max, shuffled by ``seed`` and split.

    The two sets are disjoint by construction; the same seed always gives the same split.
    """
    if operand_max < 1:
        raise ValueError(f"operand_max must be >= 1, got {operand_max}")
    pairs = [(a, b) for a in range(operand_max + 1) for b in range(operand_max + 1)]
    if not 1 <= val_size < len(pairs):
        raise ValueError(
            f"val_size must be between 1 and {len(pairs) - 1} (operands 0..{operand_max} give "
            f"{len(pairs)} questions), got {val_size}"
        )
    random.Random(seed).shuffle(pairs)
    tasks = [{"a": a, "b": b, "question": PROMPT.format(a=a, b=b), "answer": a + b} for a, b in pairs]
    return tasks[val_size:], tasks[:val_size]


def parse_answer(text: str) -> int | None:
    """The integer in the first ``<answer>N</answer>`` tag of ``text``, or None when there is none."""
    match = _ANSWER_RE.search(text)
    return int(match.group(1)) if match else None


def score(text: str, answer: int, format_bonus: float = 0.0) -> float:
    """1.0 when the first tag holds exactly ``answer``; ``format_bonus`` for a well-formed wrong one."""
    got = parse_answer(text)
    if got is None:
        return 0.0
    return 1.0 if got == answer else format_bonus


# ---------------------------------------------------------------- the agent


@dataclass
class AgentSettings:
    """What the agent reads at rollout time (module-level, set by run_demo before training)."""

    max_tokens: int = 32
    format_bonus: float = 0.1
    request_timeout_s: float = 60.0  # a reply is <= 24 tokens: a stuck request fails fast and is retried


SETTINGS = AgentSettings()


@al.rollout
async def arithmetic_agent(task: dict, llm: al.LLM, rollout: AttemptedRollout) -> float:
    """Ask the question once; training samples at the trainer's temperature, validation greedily."""
    import openai

    val = rollout.mode != "train"
    temperature = 0.0 if val else float(llm.sampling.get("temperature", 1.0))
    # closed on return: an unclosed client holds its connection (a socket on each side) until GC
    async with openai.AsyncOpenAI(
        base_url=llm.base_url, api_key=llm.api_key, max_retries=0, timeout=SETTINGS.request_timeout_s
    ) as client:
        resp = await client.chat.completions.create(
            model=llm.model,
            messages=[*EXAMPLE, {"role": "user", "content": task["question"]}],
            max_tokens=SETTINGS.max_tokens,
            temperature=temperature,
        )
    text = resp.choices[0].message.content or ""
    return score(text, int(task["answer"]), 0.0 if val else SETTINGS.format_bonus)


# ---------------------------------------------------------------- the run


class _TaskParser(argparse.ArgumentParser):
    """Hands the command line to the chosen task's parser: ``--task tools`` has its own options
    and defaults (trainer.demo_tools), every other command line is this demo's."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        argv = list(sys.argv[1:] if args is None else args)
        peek = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
        peek.add_argument("--task")
        if peek.parse_known_args(argv)[0].task == "tools":
            from trainer.demo_tools import build_parser as tools_parser

            return tools_parser().parse_known_args(argv, namespace)
        return super().parse_known_args(argv, namespace)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The demo's options (``agentloop demo --help``); defaults are the measured CPU recipe."""
    p = parser or _TaskParser(prog="agentloop demo", description=__doc__.splitlines()[0])
    p.add_argument(
        "--task", choices=("arithmetic", "tools"), default="arithmetic",
        help="arithmetic: this demo; tools: ToolAgent with a calculator (demo --task tools --help: its options)",
    )  # fmt: skip
    p.add_argument("--model", default="smollm2-135m-instruct", help="model alias or HF folder")
    p.add_argument("--name", default=None, help="run folder name under --out (default: demo-<time>)")
    p.add_argument("--out", default="runs", help="parent folder of the run folder")
    p.add_argument("--steps", type=int, default=24, help="training steps")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="samples per prompt (GRPO group)")
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate")
    p.add_argument("--temperature", type=float, default=0.8, help="training sampling temperature")
    p.add_argument("--max-tokens", type=int, default=24, help="max tokens per reply")
    p.add_argument("--format-bonus", type=float, default=0.1, help="train reward for a wrong tagged answer")
    p.add_argument("--operand-max", type=int, default=20, help="operands are drawn from 0..operand-max")
    p.add_argument("--val-size", type=int, default=150, help="held-out questions")
    p.add_argument("--test-freq", type=int, default=0, help="validate every N steps (0: before/after only)")
    p.add_argument("--seed", type=int, default=0, help="data split and sampling seed")
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    add_async_options(p)
    return p


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


def _check_args(args: argparse.Namespace) -> None:
    for key in ("steps", "batch_size", "n", "max_tokens", "val_size"):
        if getattr(args, key) < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if args.n < 2:
        raise ValueError(f"--n must be >= 2 (GRPO compares the samples of one prompt), got {args.n}")
    if not args.lr > 0:
        raise ValueError(f"--lr must be > 0, got {args.lr}")
    check_async_options(args)
    if not 0.0 <= args.format_bonus < 1.0:
        raise ValueError(f"--format-bonus must be in [0, 1), got {args.format_bonus}")


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
    from trainer.ray_trainer import Trainer

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


def run_demo(args: argparse.Namespace) -> dict[str, Any]:
    """Train, evaluate before/after, save the final weights and write the report; returns the summary."""
    from trainer.report import write_report

    _check_args(args)
    t_start = time.perf_counter()
    run_dir = new_run_dir(args, "demo")
    train, val = make_datasets(args.operand_max, args.val_size, args.seed)
    if len(train) < args.batch_size:
        raise ValueError(f"only {len(train)} training questions for --batch-size {args.batch_size}")
    SETTINGS.max_tokens, SETTINGS.format_bonus = args.max_tokens, args.format_bonus
    result, load_s, fit_s = fit_and_save(args, run_dir, grpo_config, arithmetic_agent, train, val)
    run_dir = Path(result.run_dir)  # fit keeps one run per folder: the folder it used

    before, after = result.val_history[0], result.val_history[-1]
    summary: dict[str, Any] = {
        "run_dir": str(run_dir),
        "model": args.model,
        "steps": result.steps,
        "accuracy_before": before["val/success_rate"],
        "accuracy_after": after["val/success_rate"],
        "val_size": len(val),
        "train_size": len(train),
        "wall_s": time.perf_counter() - t_start,
        "load_s": load_s,
        "fit_s": fit_s,
        "timing": _mean_timings(result.history),
        "settings": {k: v for k, v in vars(args).items() if k not in ("func", "command")},
        "prompt": PROMPT,
        "agent": asdict(SETTINGS),
    }
    summary["accuracy_gain"] = summary["accuracy_after"] - summary["accuracy_before"]
    write_report(run_dir, summary, result.history, result.val_history)
    log.info(
        "demo.done", **{k: summary[k] for k in ("run_dir", "accuracy_before", "accuracy_after", "wall_s")}
    )
    return summary


def _mean_timings(history: list[dict[str, float]]) -> dict[str, float]:
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


def main(args: argparse.Namespace) -> int:
    """The ``agentloop demo`` handler: run, then print before/after accuracy and the run folder."""
    from agentloop.logging import configure_logging

    if getattr(args, "task", "arithmetic") == "tools":
        from trainer.demo_tools import main as tools_main

        return tools_main(args)
    configure_logging(level="WARNING")  # keep the progress bar readable: per-rollout events are INFO
    summary = run_demo(args)
    sys.stdout.write(
        f"\nheld-out accuracy ({summary['val_size']} questions, greedy, strict <answer> match): "
        f"{summary['accuracy_before']:.1%} before -> {summary['accuracy_after']:.1%} after "
        f"({summary['accuracy_gain'] * 100:+.1f} points) in {summary['wall_s'] / 60:.1f} min\n"
        f"run folder: {summary['run_dir']} (report.md, metrics.jsonl, curves.png, final_model/)\n"
    )
    return 0


__all__ = [
    "PROMPT",
    "add_async_options",
    "arithmetic_agent",
    "build_parser",
    "check_async_options",
    "main",
    "make_datasets",
    "parse_answer",
    "run_demo",
    "score",
]
