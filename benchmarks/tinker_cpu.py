"""tinker-cookbook's own training loops against ``agentloop tinker`` on a CPU, with SmolLM2-135M.

    make frameworks                                  # .venv/frameworks/tinker: the tinker SDK + tinker-cookbook 0.6.1
    OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python benchmarks/tinker_cpu.py   # 1 thread: 2 spin-wait on a busy machine

1. Starts ``agentloop tinker --model smollm2-135m-instruct`` (a subprocess of the main virtualenv).
2. Supervised: ``tinker_cookbook.supervised.train.main`` unchanged, on a dataset written here (the
   cookbook's ``conversation_to_datum`` over arithmetic conversations, no hub): ``train_mean_nll`` of
   its first and last steps.
3. RL: ``tinker_cookbook.rl.train.main`` unchanged, on the cookbook's own ``ArithmeticEnv`` (x + y) with
   a dataset written here that keeps the numbers small enough for a 135M model to get some right:
   the mean reward (``reward/total``) of its first and last steps.

Only ``base_url`` (and the model's local folder as ``model_name``, so the tokenizer loads without the
hub) differ from a run against Tinker itself. Prints JSON and writes ``benchmarks/results/tinker_cpu.json``.
The cookbook lives in its own virtualenv; run under the main one, the script runs itself there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SIDE_PYTHON = ROOT / ".venv" / "frameworks" / "tinker" / "bin" / "python"
MAIN_PYTHON = ROOT / ".venv" / "bin" / "python"
RESULT = ROOT / "benchmarks" / "results" / "tinker_cpu.json"
KEY = "tml-agentloop-bench"
RENDERER = "qwen3_instruct"  # <|im_start|>role ... <|im_end|>: SmolLM2-Instruct's own chat format


def _reexec_in_side_venv() -> None:
    try:
        import tinker_cookbook  # noqa: F401
    except ImportError:
        if SIDE_PYTHON.exists() and Path(sys.prefix).resolve() != SIDE_PYTHON.parents[1].resolve():
            os.execv(str(SIDE_PYTHON), [str(SIDE_PYTHON), __file__, *sys.argv[1:]])
        sys.exit(
            f"tinker-cookbook is not installed here and {SIDE_PYTHON} does not exist: run `make frameworks`"
        )


def start_server(model: str, state_dir: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """``agentloop tinker`` on a free port; returns the process and its base URL."""
    env = {**os.environ, "TINKER_API_KEY": KEY}
    out = log.open("wb")
    proc = subprocess.Popen(
        [
            str(MAIN_PYTHON),
            "-m",
            "agentloop.cli",
            "tinker",
            "--model",
            model,
            "--port",
            "0",
            "--state-dir",
            str(state_dir),
        ],
        stdout=out,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=ROOT,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        m = re.search(r"base URL:\s+(http://\S+)", log.read_text(errors="replace"))
        if m:
            return proc, m.group(1)
        if proc.poll() is not None:
            raise RuntimeError(f"agentloop tinker exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("agentloop tinker did not start within 300 s")


# ---------------------------------------------------------------- the supervised dataset (written here)


def sl_builder(model_dir: str, batch_size: int, n_batches: int) -> Any:
    import chz
    import numpy as np
    import tinker
    from tinker_cookbook import renderers
    from tinker_cookbook.supervised.data import conversation_to_datum
    from tinker_cookbook.supervised.types import SupervisedDataset, SupervisedDatasetBuilder
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    class ArithmeticConversations(SupervisedDataset):
        """Chats "What is x + y?" -> "x + y = z", trained on the assistant's message."""

        def __init__(self, renderer: Any) -> None:
            self.renderer = renderer

        def get_batch(self, index: int) -> list[tinker.Datum]:
            rng = np.random.RandomState(1000 + index)
            out = []
            for _ in range(batch_size):
                x, y = int(rng.randint(0, 50)), int(rng.randint(0, 50))
                convo = [
                    {"role": "user", "content": f"What is {x} + {y}?"},
                    {"role": "assistant", "content": f"{x} + {y} = {x + y}"},
                ]
                out.append(
                    conversation_to_datum(
                        convo, self.renderer, 256, renderers.TrainOnWhat.LAST_ASSISTANT_MESSAGE
                    )
                )
            return out

        def __len__(self) -> int:
            return n_batches

    @chz.chz
    class ArithmeticSFTBuilder(SupervisedDatasetBuilder):
        model_dir: str

        def __call__(self) -> tuple[SupervisedDataset, SupervisedDataset | None]:
            renderer = renderers.get_renderer(RENDERER, get_tokenizer(self.model_dir))
            return ArithmeticConversations(renderer), None

    return ArithmeticSFTBuilder(model_dir=model_dir)


# ---------------------------------------------------------------- the RL dataset (written here; the env is the cookbook's)


def rl_builder(model_dir: str, batch_size: int, group_size: int, n_batches: int, max_operand: int) -> Any:
    import chz
    import numpy as np
    from tinker_cookbook import renderers
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticEnv
    from tinker_cookbook.rl.problem_env import ProblemGroupBuilder
    from tinker_cookbook.rl.types import EnvGroupBuilder, RLDataset, RLDatasetBuilder
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    class SmallArithmetic(RLDataset):
        """The cookbook's ArithmeticEnv with operands in [0, max_operand] (its own dataset draws [0, 100])."""

        def __init__(self, renderer: Any) -> None:
            self.renderer = renderer

        def get_batch(self, index: int) -> list[EnvGroupBuilder]:
            rng = np.random.RandomState(index)
            prefix = ArithmeticEnv.standard_fewshot_prefix()
            return [
                ProblemGroupBuilder(
                    env_thunk=partial(
                        ArithmeticEnv,
                        int(rng.randint(0, max_operand + 1)),
                        int(rng.randint(0, max_operand + 1)),
                        convo_prefix=prefix,
                        renderer=self.renderer,
                    ),
                    num_envs=group_size,
                    dataset_name="arithmetic",
                )
                for _ in range(batch_size)
            ]

        def __len__(self) -> int:
            return n_batches

    @chz.chz
    class SmallArithmeticBuilder(RLDatasetBuilder):
        model_dir: str

        async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
            return SmallArithmetic(renderers.get_renderer(RENDERER, get_tokenizer(self.model_dir))), None

    return SmallArithmeticBuilder(model_dir=model_dir)


def read_metrics(log_path: Path) -> list[dict[str, Any]]:
    path = log_path / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def first_last(rows: list[dict[str, Any]], suffix: str, k: int) -> tuple[float, float, list[float]]:
    """The mean of ``key`` (the first key ending with ``suffix``) over the first and the last ``k`` steps."""
    key = next((key for row in rows for key in row if key.endswith(suffix)), None)
    if key is None:
        raise KeyError(f"no metric ending with {suffix!r} in {sorted(rows[0]) if rows else 'no rows'}")
    values = [float(r[key]) for r in rows if key in r]
    return sum(values[:k]) / len(values[:k]), sum(values[-k:]) / len(values[-k:]), values


def main() -> None:
    _reexec_in_side_venv()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--sl-steps", type=int, default=16)
    p.add_argument("--sl-batch", type=int, default=8)
    p.add_argument("--sl-lr", type=float, default=5e-4)
    p.add_argument("--rl-steps", type=int, default=14)
    p.add_argument("--rl-groups", type=int, default=4, help="problems per step")
    p.add_argument("--rl-group-size", type=int, default=4, help="samples per problem")
    p.add_argument("--rl-lr", type=float, default=1e-3)
    p.add_argument("--rl-max-operand", type=int, default=9)
    p.add_argument("--rl-max-tokens", type=int, default=8, help="the answer and its stop token fit in 8")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--out", type=Path, default=RESULT)
    p.add_argument(
        "--skip-sl",
        action="store_true",
        help="only the RL loop (for tuning; the result then has no SL figures)",
    )
    p.add_argument(
        "--rl-budget-minutes",
        type=float,
        default=None,
        help="stop the RL loop after this long and report the steps it finished (a busy machine)",
    )
    p.add_argument(
        "--from-logs",
        type=Path,
        default=None,
        metavar="DIR",
        help="write the result from a run's folder (DIR/sl, DIR/rl: the cookbook's metrics.jsonl) without running; "
        "for a run stopped by hand at a time limit",
    )
    p.add_argument(
        "--started", type=float, default=None, help="with --from-logs: the run's start (Unix time)"
    )
    args = p.parse_args()

    import tinker
    from tinker_cookbook.rl import train as rl_train
    from tinker_cookbook.supervised import train as sl_train

    sys.path.insert(0, str(ROOT))
    from agentloop.engine.models import resolve_model

    if args.from_logs is not None:
        rows = read_metrics(args.from_logs / "rl")
        ended = (args.from_logs / "rl" / "metrics.jsonl").stat().st_mtime
        started = (
            args.started if args.started is not None else (args.from_logs / "server.log").stat().st_mtime
        )
        sl_rows = read_metrics(args.from_logs / "sl")
        write_result(
            args, sl_rows, rows, (ended - started) / 60, None, None, tinker.__version__,
            note=f"written from the logs of a run stopped at a time limit ({len(rows)} of {args.rl_steps} RL steps done)"
            if len(rows) < args.rl_steps else None,
        )  # fmt: skip
        return

    model_dir = str(resolve_model(args.model))
    os.environ["TINKER_API_KEY"] = KEY  # how the cookbook's ServiceClient gets its key, as against Tinker
    t0 = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="tinker-cpu-"))
    server, url = start_server(args.model, work / "state", work / "server.log")
    print(f"agentloop tinker at {url} (log {work / 'server.log'})", file=sys.stderr)
    try:
        sl_rows: list[dict[str, Any]] = []
        sl_minutes = 0.0
        if not args.skip_sl:
            t_sl = time.monotonic()
            sl_log = work / "sl"
            asyncio.run(
                sl_train.main(
                    sl_train.Config(
                        log_path=str(sl_log),
                        model_name=model_dir,
                        recipe_name="agentloop_tinker_cpu_sl",
                        renderer_name=RENDERER,
                        dataset_builder=sl_builder(model_dir, args.sl_batch, args.sl_steps),
                        learning_rate=args.sl_lr,
                        lora_rank=args.lora_rank,
                        base_url=url,
                        save_every=0,
                        eval_every=0,
                        infrequent_eval_every=0,
                        lr_schedule="constant",
                    )
                )
            )
            sl_minutes = (time.monotonic() - t_sl) / 60
            sl_rows = read_metrics(sl_log)

        t_rl = time.monotonic()
        rl_log = work / "rl"
        rl_run = rl_train.main(
            rl_train.Config(
                log_path=str(rl_log),
                model_name=model_dir,
                recipe_name="agentloop_tinker_cpu_rl",
                renderer_name=RENDERER,
                learning_rate=args.rl_lr,
                max_tokens=args.rl_max_tokens,
                lora_rank=args.lora_rank,
                dataset_builder=rl_builder(
                    model_dir, args.rl_groups, args.rl_group_size, args.rl_steps, args.rl_max_operand
                ),
                loss_fn="importance_sampling",
                base_url=url,
                save_every=0,
                eval_every=0,
                num_groups_to_log=0,
                rollout_json_export=False,
            )
        )
        stopped = False
        try:
            asyncio.run(
                asyncio.wait_for(
                    rl_run, None if args.rl_budget_minutes is None else 60 * args.rl_budget_minutes
                )
            )
        except TimeoutError:
            stopped = True  # the steps finished so far are in metrics.jsonl
        rl_minutes = (time.monotonic() - t_rl) / 60
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    rl_rows = read_metrics(rl_log)
    note = f"RL stopped at its budget of {args.rl_budget_minutes} minutes" if stopped else None
    write_result(
        args,
        sl_rows,
        rl_rows,
        (time.monotonic() - t0) / 60,
        sl_minutes,
        rl_minutes,
        tinker.__version__,
        note,
    )


def write_result(
    args: argparse.Namespace,
    sl_rows: list[dict[str, Any]],
    rl_rows: list[dict[str, Any]],
    wall_minutes: float,
    sl_minutes: float | None,
    rl_minutes: float | None,
    sdk_version: str,
    note: str | None = None,
) -> None:
    """Print the result as JSON (benchmarks/result_file.py's header, then the figures) and write it to
    ``args.out``."""
    from benchmarks import result_file

    sl_first, sl_last, sl_curve = (
        first_last(sl_rows, "train_mean_nll", 3) if sl_rows else (float("nan"),) * 2 + ([],)
    )
    rl_first, rl_last, rl_curve = first_last(rl_rows, "reward/total", 3)
    correct = [float(r[k]) for r in rl_rows for k in r if k.endswith("/correct")]
    result = {
        "sl_loss_first": round(sl_first, 4),
        "sl_loss_last": round(sl_last, 4),
        "rl_reward_first": round(rl_first, 4),
        "rl_reward_last": round(rl_last, 4),
        "wall_minutes": round(wall_minutes, 2),
        "sdk_version": sdk_version,
        "cookbook_version": __import__("tinker_cookbook").__version__,
        "model": args.model,
        "sl": {
            "loop": "tinker_cookbook.supervised.train.main",
            "metric": "train_mean_nll, mean of the first / last 3 steps",
            "steps": len(sl_curve), "batch": args.sl_batch, "learning_rate": args.sl_lr,
            "minutes": None if sl_minutes is None else round(sl_minutes, 2), "curve": [round(v, 4) for v in sl_curve],
        },
        "rl": {
            "loop": "tinker_cookbook.rl.train.main (loss_fn importance_sampling)",
            "env": f"tinker_cookbook.recipes.math_rl.arithmetic_env.ArithmeticEnv, operands 0..{args.rl_max_operand}",
            "metric": "reward/total (1 if correct, -0.1 if not stopped cleanly), mean of the first / last 3 steps",
            "steps": len(rl_curve), "steps_planned": args.rl_steps, "groups": args.rl_groups,
            "group_size": args.rl_group_size, "learning_rate": args.rl_lr,
            "minutes": None if rl_minutes is None else round(rl_minutes, 2),
            "curve": [round(v, 4) for v in rl_curve], "correct_curve": [round(v, 4) for v in correct],
        },
        "lora_rank": args.lora_rank,
        "note": note,
    }  # fmt: skip
    # the machine's niceness and load as the run ends: on a shared machine its minutes say as much of them
    load = [round(x, 2) for x in os.getloadavg()]
    head = result_file.header("tinker_cpu", gpu=None, nice=os.nice(0), load_average_at_end=load)
    document = result_file.result(head, result)
    print(json.dumps(document, indent=2))
    result_file.write(args.out, document)


if __name__ == "__main__":
    main()
