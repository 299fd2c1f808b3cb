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
``agentloop demo --task tools`` runs the tool-using demo instead (trainer/demos/tools.py).
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

import agentloop as al
from agentloop.types import AttemptedRollout
from trainer.demos.shared import (
    add_async_options,
    check_async_options,
    fit_and_save,
    grpo_config,
    mean_timings,
    new_run_dir,
)

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
    and defaults (trainer.demos.tools), every other command line is this demo's."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        argv = list(sys.argv[1:] if args is None else args)
        peek = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
        peek.add_argument("--task")
        if peek.parse_known_args(argv)[0].task == "tools":
            from trainer.demos.tools import build_parser as tools_parser

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


def run_demo(args: argparse.Namespace) -> dict[str, Any]:
    """Train, evaluate before/after, save the final weights and write the report; returns the summary."""
    from trainer.run_folder.report import write_report

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
        "timing": mean_timings(result.history),
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


def main(args: argparse.Namespace) -> int:
    """The ``agentloop demo`` handler: run, then print before/after accuracy and the run folder."""
    from agentloop.logging import configure_logging

    if getattr(args, "task", "arithmetic") == "tools":
        from trainer.demos.tools import main as tools_main

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
