"""Run calc_x rollouts: ``python -m examples.calc_x.run --rollouts 8`` (prints a JSON summary)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python examples/calc_x/run.py` works too
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples._harness import parser, run_cli
from examples.calc_x.agent import make_agent
from examples.calc_x.data import make_problems


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser("calc_x: arithmetic word problems with a calculator tool (al.ToolAgent)")
    p.add_argument("--max-turns", type=int, default=4, help="model calls per rollout")
    args = p.parse_args(argv)
    return run_cli(args, make_agent(args.max_turns), make_problems(args.rollouts, args.seed))


if __name__ == "__main__":
    main()
