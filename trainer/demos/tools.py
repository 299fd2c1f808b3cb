"""Proof that a tool-using agent learns: GRPO teaches SmolLM2-135M-Instruct to use a calculator tool.

The built-in ``al.ToolAgent`` runs each attempt through the proxy: the model writes a tool call, the
``calculator`` tool answers, the model writes ``Answer: N`` (two model calls; ``--max-turns 3`` leaves
one spare for a retry after a tool error). The proxy renders the tool schema into SmolLM2's system
message in the hermes format (SmolLM2's own template knows no tools) and parses hermes calls,
``<tool_call>{"name": "calculator", "arguments": {"expression": "23 * 47"}}</tool_call>``, back
into OpenAI ``tool_calls``; earlier assistant calls in the history are rendered as that same text, so a
worked example given as earlier turns (user question, assistant tool call, ``tool`` result, assistant
``Answer: N``) shows the model the exact text the parser accepts. That is the format used here.

Problems, easy to hard (``KINDS``): level 1 ``What is 347 * 86?``; level 2 word problems in the form
of the worked example (``buys 12 boxes ... with 30 in each box, then loses / finds 7``: a product,
then a difference or sum); level 3 other two-step forms (``has 420, gets 385 more and then gives away
97``; ``shares 96 among 8 friends, then gives each 5 more``). All are generated from a seed, shuffled
and split: the first ``--val-size`` are held out, the rest train, so no held-out question is trained on.

Reward: 1.0 when the first ``Answer: N`` of the final message is exactly the answer, else 0.
``--call-bonus B`` gives a wrong answer after a well-formed call (parsed by the proxy and run by the
tool without an error) B in training; it is 0 by default: the untrained model already makes a
well-formed call in half of its sampled attempts, so nothing needs bootstrapping, and GRPO's
division by the group's standard deviation turns any bonus into a full-size advantage in groups
where no attempt is right, which then teaches well-formed calls with wrong expressions. In the CPU
run with B = 0.1, 16 of its 48 groups had only rewards 0 and 0.1 (plus_minus 5 of 8, share 3 of 6),
and level 3 went from 10% to 0%, nearly every such problem then answered with a product of two of
its numbers. Validation decodes greedily and gives no bonus; it reports accuracy, the share of attempts
with a well-formed call and model calls per attempt, before and after.

Measured before building the run (untrained SmolLM2, this 2-core CPU, fp32, 3 turns, 48 tokens a
call, every kind in equal shares; "call": attempts with a well-formed calculator call; "first set":
an earlier problem set with one-step word problems, see below; "final": ``KINDS``)::

    prompt                                    problems        decoding          call        exact answer
    calc_x's system prompt, no example        24, first set   greedy / T 0.8    0% / 0%     0% / 0%
    + one worked word problem                 40, first set   greedy / T 0.8    45% / 8%    18% / 0%
    + a worked product and a word problem     40, first set   greedy / T 0.5    75% / 70%   42% / 38%
      (chosen)                                                T 0.65 / T 0.8    43% / 23%   20% / 5%
                                              50, final       greedy / T 0.6    88% / 50%   42% / 20%
    + a word problem and a share problem      40, first set   greedy            68%         28%
    chosen examples, one-line system prompt   40, first set   greedy / T 0.5    80% / 50%   40% / 30%

Zero-shot the model never calls the tool (it computes in its head, ``808 * 68 = 5448``), so GRPO
would get no signal. A worked example makes it copy the format; a product example is needed for
bare products (with only a word-problem example it calls for none of them). Sampling breaks the JSON
fast (``"type": "function"`` instead of ``"name"`` from the tools block, invented argument names,
unclosed tags), so training samples at T 0.6, not the arithmetic demo's 0.8: half the attempts make
a well-formed call and a fifth are right, which gives GRPO groups with mixed rewards. Whenever the
tool returned the right number the model copied it into ``Answer: N`` (greedy: every time; T 0.6:
91%), so the final step is learnable; what training has to fix is the call's format and the
expression. A first problem set with one-step word problems (``has 23 boxes with 86 in each``) was
dropped: the example's ``- 9`` was copied into them, and RL then learned to drop every third number,
taking two-step accuracy to 0% (CPU trial, 5 steps: 15% -> 0%; on an H100, one of three seeds:
30% -> 0%). Every word problem now needs both of its operations.

One sample per attempt (``adapter.trajectory``, the default here): the calls of an attempt are merged
into one sample, the tool result and template tokens between them masked. Each attempt then votes
once in its GRPO group whatever the trainer's grouping, and the ~420-token prompt (tools block, two
examples) is computed once per attempt instead of once per call: the update (~170 tokens/s on this
CPU) takes 72-94 s of a ~100 s step with 32 merged samples; per-call samples would nearly double it.

The recipe is trainer.demos.arithmetic's (GRPO, lr 1e-5, engine log-probs, 2048-token micro-batches) at T 0.6,
with 4 problems x 8 attempts a step for 24 steps. The trainer's shared-prompt forward
(``actor.shared_prompt_forward``) runs the ~420-token prompt once per GRPO group instead of once per
attempt (1.87x the update's tokens/s, benchmarks/results/shared_prompt_cpu.json), and a group whose
attempts all scored the same costs no forward at all, more of them as the model learns: an update took
~29 s on average instead of ~76 s, a step ~49 s (rollout ~18 s), plus ~87 s per validation of 100
problems: about 23 minutes on this CPU.

Measured with these defaults on the idle 2-core CPU (benchmarks/results/demo_tools_cpu.json): 41% ->
98% held-out (+57 points) in 23.2 min; well-formed calls 84% -> 100%; level 2 45% -> 100%, level 3
10% -> 95%. Train reward rose from 0.06-0.5 in the first steps to 0.7-0.9 from step 10.

Earlier runs: with the defaults of then (12 steps, no shared-prompt forward, ``--call-bonus 0.1``),
41% -> 47% on this CPU in 22.5 min (level 3 10% -> 0%, see Reward). On an H100 (bf16; a check of
the design, not this CPU), 24 steps: +45, +53 and +40 points for seeds 1, 2, 3; 12 steps without a
bonus: +41, +33 and +14 for seeds 0, 1, 2 (benchmarks/results/demo_tools_gpu.json); seeds differ most
on level 3.

Trials of 5 steps on this CPU, shared with other work, while the problems were designed: with the
first problem set, 38% -> 47% held-out and 78% -> 98% well-formed calls in 12.0 min; with the final
set, train reward 0.09, 0.71, 0.13, 0.65 over steps 1-4 (the mix of 4 problems a step makes it jump).

Run it with ``agentloop demo --task tools``; ``run_tools_demo(args)`` is the same from Python.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import structlog

import agentloop as al
from agentloop.resources import Resources
from agentloop.tools import ToolAgent
from agentloop.types import AttemptedRollout
from trainer.demos._calculator import calculator, evaluate, format_number
from trainer.demos._tool_tasks import (
    EXAMPLES,
    KINDS,
    SYSTEM_PROMPT,
    make_datasets,
    make_problems,
    parse_answer,
    score,
    task_messages,
    well_formed_calls,
)
from trainer.demos.shared import (
    add_async_options,
    check_async_options,
    fit_and_save,
    grpo_config,
    mean_timings,
    new_run_dir,
)

log = structlog.get_logger("agentloop.demo_tools")

# ---------------------------------------------------------------- the agent

# the measured CPU recipe (see the module docstring)
DEFAULTS: dict[str, Any] = {
    "steps": 24,
    "batch_size": 4,
    "n": 8,
    "lr": 1e-5,
    "temperature": 0.6,
    "train_size": 400,
    "val_size": 100,
}


@dataclass
class AgentSettings:
    """What the agent does per attempt (defaults: the measured CPU recipe)."""

    max_turns: int = 3  # call -> result -> answer is 2; one spare for a retry after a tool error
    max_tokens: int = 48  # per model call: a tool call is ~30 tokens, "Answer: N" ~6
    call_bonus: float = 0.0  # train reward for a well-formed call with a wrong answer (see Reward)
    max_tool_response_chars: int = 100  # tool errors are short; results are numbers
    # A reply is <= 48 tokens, but a request can wait behind 63 others' ~450-token prefills: on this
    # 2-core CPU under other load 180 s failed half of one validation (a held-out attempt gets no retry).
    request_timeout_s: float = 600.0


class CalculatorAgent(al.Agent):
    """``al.ToolAgent`` with the calculator: sampled (training temperature) when training, greedy
    and without the call bonus when validating."""

    def __init__(self, settings: AgentSettings | None = None) -> None:
        self.settings = s = settings or AgentSettings()
        common: dict[str, Any] = {
            "max_turns": s.max_turns,
            "max_tool_response_chars": s.max_tool_response_chars,
            "request_timeout_s": s.request_timeout_s,
            "parallel_tool_calls": False,
        }
        # training: temperature and top_p come from the trainer's LLM resource
        self.train_agent = ToolAgent(
            [calculator], self._train_reward, sampling={"max_tokens": s.max_tokens}, **common
        )
        self.val_agent = ToolAgent(
            [calculator],
            self._val_reward,
            sampling={"max_tokens": s.max_tokens, "temperature": 0.0},
            **common,
        )

    def _train_reward(
        self, task: dict[str, Any], answer: str | None, messages: list[dict[str, Any]]
    ) -> float:
        made_call = well_formed_calls(messages) > 0
        return score(answer, int(task["answer"]), made_call, self.settings.call_bonus)

    def _val_reward(self, task: dict[str, Any], answer: str | None) -> float:
        return score(answer, int(task["answer"]), made_call=False)

    async def rollout(
        self, task: Any, resources: Resources | None, rollout: AttemptedRollout
    ) -> float | None:
        agent = self.train_agent if rollout.mode == "train" else self.val_agent
        return await agent.rollout({**task, "messages": task_messages(task)}, resources, rollout)


# ---------------------------------------------------------------- held-out metrics from the store


def validation_metrics(store_path: Path) -> dict[int, dict[str, Any]]:
    """Per validation step: accuracy, tool-call rate, mean turns and accuracy per level, read from
    the run's SQLite store (the store is the record: every held-out attempt's spans are in it).

    accuracy: share of held-out questions whose final answer is exactly right (a failed attempt
    counts as wrong); tool_call_rate: share whose attempt made at least one calculator call that the
    proxy parsed and the tool ran; mean_turns: model calls per attempt (attempts that finished).
    """
    import anyio

    from agentloop.store.sqlite import SQLiteStore
    from agentloop.types import Log, Reward, RolloutStatus, ToolCall

    async def read() -> dict[int, dict[str, Any]]:
        store = SQLiteStore(store_path)
        rows: dict[int, list[dict[str, Any]]] = {}
        try:
            for rollout in await store.list_rollouts():
                if rollout.mode != "val":
                    continue
                step = int(rollout.metadata.get("step", 0))  # type: ignore[arg-type]
                spans = await store.query_spans(rollout.rollout_id, "latest")
                ok = rollout.status is RolloutStatus.SUCCEEDED
                finished = [
                    s.payload.fields
                    for s in spans
                    if isinstance(s.payload, Log) and s.payload.message == "tool_agent_finished"
                ]
                task = rollout.input if isinstance(rollout.input, dict) else {}
                rows.setdefault(step, []).append(
                    {
                        "failed": not ok,
                        "correct": ok
                        and sum(s.payload.value for s in spans if isinstance(s.payload, Reward)) >= 1.0,
                        "called": any(
                            isinstance(s.payload, ToolCall) and s.payload.error is None for s in spans
                        ),
                        "turns": finished[0].get("turns") if finished else None,
                        "level": task.get("level"),
                    }
                )
        finally:
            await store.close()
        return {step: _summarise(r) for step, r in sorted(rows.items())}

    return anyio.run(read)


def _summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    turns = [r["turns"] for r in rows if isinstance(r["turns"], int)]
    by_level: dict[str, float] = {}
    for level in sorted({r["level"] for r in rows if r["level"] is not None}):
        mine = [r for r in rows if r["level"] == level]
        by_level[str(level)] = sum(r["correct"] for r in mine) / len(mine)
    return {
        "n": len(rows),
        "failed": sum(r["failed"] for r in rows),  # attempts that errored or timed out (count as wrong)
        "accuracy": sum(r["correct"] for r in rows) / len(rows),
        "tool_call_rate": sum(r["called"] for r in rows) / len(rows),
        "mean_turns": sum(turns) / len(turns) if turns else 0.0,
        "accuracy_by_level": by_level,
    }


# ---------------------------------------------------------------- the run


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The tools demo's options (``agentloop demo --task tools --help``); defaults: the CPU recipe."""
    p = parser or argparse.ArgumentParser(
        prog="agentloop demo --task tools", description=(__doc__ or "").splitlines()[0]
    )
    p.add_argument(
        "--task", choices=("arithmetic", "tools"), default="tools", help="which demo (this: tools)"
    )
    p.add_argument("--model", default="smollm2-135m-instruct", help="model alias or HF folder")
    p.add_argument("--name", default=None, help="run folder name under --out (default: demo-tools-<time>)")
    p.add_argument("--out", default="runs", help="parent folder of the run folder")
    p.add_argument("--steps", type=int, default=DEFAULTS["steps"], help="training steps")
    p.add_argument("--batch-size", type=int, default=DEFAULTS["batch_size"], help="problems per step")
    p.add_argument("--n", type=int, default=DEFAULTS["n"], help="attempts per problem (GRPO group)")
    p.add_argument("--lr", type=float, default=DEFAULTS["lr"], help="AdamW learning rate")
    p.add_argument(
        "--temperature", type=float, default=DEFAULTS["temperature"], help="training sampling temperature"
    )
    p.add_argument(
        "--max-tokens", type=int, default=AgentSettings.max_tokens, help="max tokens per model call"
    )
    p.add_argument("--max-turns", type=int, default=AgentSettings.max_turns, help="model calls per attempt")
    p.add_argument(
        "--call-bonus", type=float, default=AgentSettings.call_bonus,
        help="train reward for a well-formed calculator call when the answer is wrong (never in validation)",
    )  # fmt: skip
    p.add_argument("--train-size", type=int, default=DEFAULTS["train_size"], help="training problems")
    p.add_argument("--val-size", type=int, default=DEFAULTS["val_size"], help="held-out problems")
    p.add_argument("--test-freq", type=int, default=0, help="validate every N steps (0: before/after only)")
    p.add_argument(
        "--trajectory", action=argparse.BooleanOptionalAction, default=True,
        help="one sample per attempt, tool tokens masked (adapter.trajectory); --no-trajectory: one per call",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="data split and sampling seed")
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    p.add_argument(
        "--estimator", choices=("grpo", "gae"), default="grpo",
        help="grpo: group baselines; gae: PPO with a critic (a value model trained beside the policy)",
    )  # fmt: skip
    p.add_argument(
        "--critic-lr", type=float, default=5e-5, help="the critic's learning rate (--estimator gae)"
    )
    p.add_argument(
        "--critic-warmup",
        type=int,
        default=1,
        help="steps that train only the critic first (--estimator gae)",
    )
    add_async_options(p)
    return p


def trainer_config(args: argparse.Namespace, run_dir: Path, model_path: str) -> dict[str, Any]:
    """trainer.demos.arithmetic's GRPO recipe, sized for multi-turn attempts (verl keys)."""
    config = grpo_config(args, run_dir, model_path)
    # A merged sample's response holds every turn plus the tool turns between them (masked):
    # per tool turn ~12 template tokens + the result (<= 100 chars). Nothing gets near the cap.
    config["data"]["max_response_length"] = args.max_turns * args.max_tokens + (args.max_turns - 1) * 64
    config["data"]["max_prompt_length"] = 1024  # system + tools block + examples: ~420 tokens
    config["adapter"] = {"trajectory": args.trajectory}
    if getattr(args, "estimator", "grpo") == "gae":  # PPO: advantages from a critic's values, GAE per attempt
        config["algorithm"]["adv_estimator"] = "gae"
        config["critic"] = {
            "optim": {"lr": args.critic_lr, "weight_decay": 0.0},
            "ppo_max_token_len_per_gpu": config["actor_rollout_ref"]["actor"]["ppo_max_token_len_per_gpu"],
        }
        config["trainer"]["critic_warmup"] = args.critic_warmup
    return config


def _check_args(args: argparse.Namespace) -> None:
    for key in ("steps", "batch_size", "n", "max_tokens", "max_turns", "train_size", "val_size"):
        if getattr(args, key) < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if args.n < 2 and getattr(args, "estimator", "grpo") == "grpo":
        raise ValueError(f"--n must be >= 2 (GRPO compares the attempts at one problem), got {args.n}")
    if getattr(args, "estimator", "grpo") == "gae" and not (args.critic_lr > 0 and args.critic_warmup >= 0):
        raise ValueError(
            f"--critic-lr must be > 0 and --critic-warmup >= 0, got {args.critic_lr}, {args.critic_warmup}"
        )
    if args.max_turns < 2:
        raise ValueError(f"--max-turns must be >= 2 (a tool call, then the answer), got {args.max_turns}")
    if not args.lr > 0:
        raise ValueError(f"--lr must be > 0, got {args.lr}")
    check_async_options(args)
    if not 0.0 <= args.call_bonus < 1.0:
        raise ValueError(f"--call-bonus must be in [0, 1), got {args.call_bonus}")
    if args.train_size < args.batch_size:
        raise ValueError(f"--train-size ({args.train_size}) must be >= --batch-size ({args.batch_size})")


def run_tools_demo(args: argparse.Namespace) -> dict[str, Any]:
    """Train, evaluate before/after, save the final weights and write the report; returns the summary."""
    _check_args(args)
    t_start = time.perf_counter()
    run_dir = new_run_dir(args, "demo-tools")
    train, val = make_datasets(args.train_size, args.val_size, args.seed)
    settings = AgentSettings(max_turns=args.max_turns, max_tokens=args.max_tokens, call_bonus=args.call_bonus)
    agent = CalculatorAgent(settings)
    result, load_s, fit_s = fit_and_save(args, run_dir, trainer_config, agent, train, val)
    run_dir = Path(result.run_dir)  # fit keeps one run per folder: the folder it used

    by_step = validation_metrics(run_dir / "store.db")
    before, after = by_step[min(by_step)], by_step[max(by_step)]
    wall_s = time.perf_counter() - t_start
    summary: dict[str, Any] = {
        "title": "agentloop demo --task tools",
        "run_dir": str(run_dir),
        "model": args.model,
        "steps": result.steps,
        # the trainer's own count (reward >= 1 per held-out attempt) is the headline number
        "accuracy_before": result.val_history[0]["val/success_rate"],
        "accuracy_after": result.val_history[-1]["val/success_rate"],
        "tool_call_rate_before": before["tool_call_rate"],
        "tool_call_rate_after": after["tool_call_rate"],
        "mean_turns_before": before["mean_turns"],
        "mean_turns_after": after["mean_turns"],
        "accuracy_by_level_before": before["accuracy_by_level"],
        "accuracy_by_level_after": after["accuracy_by_level"],
        "val_failed_before": before["failed"],
        "val_failed_after": after["failed"],
        "validations": {str(k): v for k, v in by_step.items()},
        "val_size": len(val),
        "train_size": len(train),
        "wall_s": wall_s,
        "wall_minutes": wall_s / 60,
        "load_s": load_s,
        "fit_s": fit_s,
        "timing": mean_timings(result.history),
        "settings": {k: v for k, v in vars(args).items() if k not in ("func", "command")},
        "prompt": SYSTEM_PROMPT,
        "agent": asdict(settings),
    }
    summary["accuracy_gain"] = summary["accuracy_after"] - summary["accuracy_before"]
    write_tools_report(run_dir, summary, result.history, result.val_history)
    log.info(
        "demo_tools.done",
        **{k: summary[k] for k in ("run_dir", "accuracy_before", "accuracy_after", "wall_s")},
    )
    return summary


def write_tools_report(
    run_dir: Path,
    summary: dict[str, Any],
    history: list[dict[str, float]],
    val_history: list[dict[str, float]],
) -> Path:
    """trainer.run_folder.report's files (curves.png, summary.json, report.md) with a tool-use table in report.md."""
    from trainer.run_folder.report import write_report

    path = write_report(run_dir, summary, history, val_history)
    rows = [
        ("held-out accuracy (greedy, exact `Answer: N`)", "accuracy", "{:.1%}"),
        ("attempts with a well-formed calculator call", "tool_call_rate", "{:.1%}"),
        ("model calls per attempt", "mean_turns", "{:.2f}"),
    ]
    lines = ["", "## Tool use on the held-out problems", "", "| metric | before | after |", "|---|---|---|"]
    for label, key, fmt in rows:
        lines.append(
            f"| {label} | {fmt.format(summary[key + '_before'])} | {fmt.format(summary[key + '_after'])} |"
        )
    lines.append(
        f"| held-out attempts that failed (timeout, error; counted wrong) | {summary['val_failed_before']} "
        f"| {summary['val_failed_after']} |"
    )
    levels = sorted(set(summary["accuracy_by_level_before"]) | set(summary["accuracy_by_level_after"]))
    for level in levels:
        b = summary["accuracy_by_level_before"].get(level, float("nan"))
        a = summary["accuracy_by_level_after"].get(level, float("nan"))
        kinds = ", ".join(k for k, lv, _ in KINDS if str(lv) == level)
        lines.append(f"| accuracy, level {level} ({kinds}) | {b:.1%} | {a:.1%} |")
    lines += ["", "Worked examples shown before every question (as earlier turns):", "", "```json"]
    lines += [json.dumps(m) for m in EXAMPLES]
    lines += ["```", ""]
    path.write_text(path.read_text() + "\n".join(lines))
    return path


def main(args: argparse.Namespace) -> int:
    """The ``agentloop demo --task tools`` handler: run, then print before/after and the run folder."""
    import sys

    from agentloop.logging import configure_logging

    configure_logging(level="WARNING")  # keep the progress bar readable: per-rollout events are INFO
    s = run_tools_demo(args)
    failed = s["val_failed_before"] + s["val_failed_after"]
    sys.stdout.write(
        f"\nheld-out accuracy ({s['val_size']} problems, greedy, exact 'Answer: N'): "
        f"{s['accuracy_before']:.1%} before -> {s['accuracy_after']:.1%} after "
        f"({s['accuracy_gain'] * 100:+.1f} points) in {s['wall_minutes']:.1f} min\n"
        f"well-formed calculator calls: {s['tool_call_rate_before']:.1%} -> {s['tool_call_rate_after']:.1%}; "
        f"model calls per attempt: {s['mean_turns_before']:.2f} -> {s['mean_turns_after']:.2f}\n"
        + (
            f"held-out attempts that failed (counted wrong): {s['val_failed_before']} before, "
            f"{s['val_failed_after']} after\n"
            if failed
            else ""
        )
        + f"run folder: {s['run_dir']} (report.md, metrics.jsonl, curves.png, final_model/)\n"
    )
    return 0


__all__ = [
    "KINDS",
    "AgentSettings",
    "CalculatorAgent",
    "build_parser",
    "calculator",
    "evaluate",
    "format_number",
    "main",
    "make_datasets",
    "make_problems",
    "parse_answer",
    "run_tools_demo",
    "score",
    "task_messages",
    "trainer_config",
    "validation_metrics",
    "well_formed_calls",
    "write_tools_report",
]
