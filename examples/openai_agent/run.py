"""Run the minimal openai agent: ``python -m examples.openai_agent.run --rollouts 6`` (prints a JSON summary)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python examples/openai_agent/run.py` works too
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples._harness import parser, run_cli
from examples.openai_agent.agent import agent, make_tasks


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parser("openai_agent: a plain openai client agent with @al.rollout").parse_args(argv)
    return run_cli(args, agent, make_tasks(args.rollouts))


if __name__ == "__main__":
    main()
