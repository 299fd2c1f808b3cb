"""How well an LLM judge agrees with the SQL agent's checker on held-out questions. Prints JSON.

The SQL agent (examples/sql_agent, no reward of its own) attempts each held-out question ``--group``
times on the served model; each question's group is then judged in one request (the SQL rubric,
reference-guided: the judge sees the gold query) and every attempt is also re-checked by the checker
(its query's result set against the gold query's). Each group also holds two scripted attempts shaped
like the agent's (tools really run): one answering with the gold query, one with another question's
gold query, so every group holds attempts the checker tells apart even when the model gets none right.

Reported (examples/sql_agent/judge.py ``agreement``), for all attempts and for the model's alone:
``pairwise`` (over pairs the checker tells apart within a group, the share the judge orders the same
way, ties half: what GRPO's relative advantages use), ``accuracy_at_0.5``, ``pearson``, and the judge's
failures (groups with no usable JSON after the retries: counted, never scored 0).

    python benchmarks/judge_agreement.py [--model smollm2-135m-instruct] [--held-out 6] [--group 3]
        [--judge-url URL --judge-model NAME] [--out benchmarks/results/judge_agreement_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import anyio  # noqa: E402

from agentloop.engine.factory import load_engine  # noqa: E402
from agentloop.resources import LLM  # noqa: E402
from benchmarks import result_file  # noqa: E402
from examples.sql_agent.judge import agreement, judged_run, make_judge  # noqa: E402
from examples.sql_agent.make_db import build_database  # noqa: E402
from examples.sql_agent.questions import QUESTIONS  # noqa: E402


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model", default="smollm2-135m-instruct", help="the agent's model (and the served judge)"
    )
    p.add_argument(
        "--held-out", type=int, default=6, help="the last N questions of questions.py are held out"
    )
    p.add_argument("--group", type=int, default=3, help="model attempts per question (+ 2 scripted)")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--max-tokens", type=int, default=256, help="per agent call")
    p.add_argument("--judge-max-tokens", type=int, default=512)
    p.add_argument("--judge-url", default=None, help="an external judge (default: the served model)")
    p.add_argument("--judge-model", default=None)
    p.add_argument("--judge-key", default="EMPTY")
    p.add_argument("--device", default="cpu")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)

    held = QUESTIONS[-args.held_out :]
    # each question's wrong attempt answers with the gold query of the question before it (another table
    # or filter: a query that runs, returns rows, and is wrong)
    wrong = [QUESTIONS[(QUESTIONS.index(q) - 1) % len(QUESTIONS)]["gold_sql"] for q in held]
    llm = (
        LLM(base_url=args.judge_url, model=args.judge_model, api_key=args.judge_key)
        if args.judge_url
        else None
    )
    judge = make_judge(llm, max_tokens=args.judge_max_tokens, on_failure="skip", concurrency=len(held))
    engine = load_engine(args.model, device=args.device)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="judge-agreement-") as tmp:
        db = build_database(Path(tmp) / "company.db")
        run = anyio.run(
            lambda: judged_run(
                db,
                [dict(q) for q in held],
                engine,
                judge,
                group=args.group,
                concurrency=args.concurrency,
                sampling={"temperature": args.temperature, "max_tokens": args.max_tokens},
                wrong_queries=wrong,
            )
        )
    rows = run["attempts"]
    result = {
        "what": "agreement of an LLM judge with the SQL checker on held-out questions (examples/sql_agent)",
        "agent_model": args.model,
        "judge_model": args.judge_model or f"{args.model} (the served model, temperature 0)",
        "held_out_questions": [q["question"] for q in held],
        "attempts_per_question": {"model": args.group, "scripted_right": 1, "scripted_wrong": 1},
        "judge": {
            "max_retries": judge.max_retries,
            "max_tokens": judge.max_tokens,
            "max_chars": judge.max_chars,
            "requests": judge.requests,
            "reference_guided": True,
        },
        "groups": len(held),
        "groups_failed": len(run["judge_failures"]),
        "judge_failures": [f[:400] for f in run["judge_failures"]],
        "all_attempts": run["agreement"],
        "model_attempts": agreement([r for r in rows if r["source"] == "model"]),
        "attempts": rows,
        "wall_s": round(time.perf_counter() - t0, 1),
        "device": args.device,
    }
    gpu = "auto" if args.device.startswith("cuda") else None
    document = result_file.result(
        result_file.header("judge_agreement", gpu=gpu, platform=platform.platform()), result
    )
    document = json.loads(json.dumps(document, default=str))  # what the file holds: str() of the odd value
    print(json.dumps(document, indent=2))
    if args.out:
        result_file.write(args.out, document)
    return document


if __name__ == "__main__":
    main()
