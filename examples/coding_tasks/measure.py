"""How many prompt tokens each harness sends per model call, with each way of trimming it.

A scripted engine (SmolLM2's real tokenizer, no model) plays a perfect model: its first answer runs
the task's reference fix through the harness's shell tool, its next answers say ``Done.``. Every call
goes through the real proxy (so the prompt ids are exactly what SmolLM2 would be given: the chat
template, the tools block in the system message) and the harness runs in the real sandbox. Per
option: the prompt tokens of each call, the calls, whether the check passed, and the wall time.

    python -m examples.coding_tasks.measure                       # every option, one task
    python -m examples.coding_tasks.measure --options claude-trimmed --out /tmp/prompts.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio

import agentloop as al
from agentloop.engine.base import SamplingParams, TokenOutput
from examples.coding_tasks.agent import HARNESS_OPTIONS
from examples.coding_tasks.tasks import check_command, make_tasks, write_repo

# each harness's shell tool as it declares it, and its argument names
SHELL = {
    "codex": ("exec_command", "cmd"),
    "claude": ("Bash", "command"),
    "opencode": ("bash", "command"),
}


class ScriptedEngine:
    """The InferenceEngine contract with scripted text: the fix first, then ``Done.``."""

    def __init__(self, tokenizer: Any, harness: str, fix: str, max_context: int = 65536) -> None:
        self.tokenizer, self.max_context, self.weights_version = tokenizer, max_context, 0
        name, arg = SHELL[harness]
        args = {arg: fix, **({"description": "fix"} if harness == "opencode" else {})}
        self._call = f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"
        self.calls: list[dict[str, Any]] = []

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, request_id: str | None = None
    ) -> TokenOutput:
        answered = any(c["answer"] == "call" for c in self.calls)
        text = "Done." if answered else self._call
        self.calls.append({"prompt_tokens": len(prompt_ids), "answer": "done" if answered else "call",
                           "temperature": sampling.temperature, "prompt_ids": list(prompt_ids)})  # fmt: skip
        ids = [*self.tokenizer.encode(text, add_special_tokens=False), int(self.tokenizer.eos_token_id)]
        return TokenOutput(token_ids=ids, logprobs=[-0.1] * len(ids), finish_reason="stop", weights_version=0)

    async def update_weights(self, named_tensors: Mapping[str, Any]) -> int:
        raise NotImplementedError

    async def abort(self, request_id: str) -> bool:
        return False

    def stats(self) -> dict[str, Any]:
        return {"requests": len(self.calls)}

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None


async def measure(option: str, task: dict[str, Any], tokenizer: Any, timeout_s: float) -> dict[str, Any]:
    from agentloop.proxy.server import Proxy
    from agentloop.resources import Resources
    from agentloop.store.memory import MemoryStore

    spec = HARNESS_OPTIONS[option]
    engine, store = ScriptedEngine(tokenizer, spec["harness"], task["fix"]), MemoryStore()
    async with Proxy(engine, store) as proxy:
        # the trainer's resource samples at 0.6: a harness that sends its own temperature overrides it
        await store.add_resources(
            Resources(items={"llm": proxy.as_resource("smollm2", {"temperature": 0.6})})
        )
        await store.enqueue_rollout({"task": task["id"]})
        att = await store.dequeue_rollout("measure")
        assert att is not None
        llm = al.LLM(
            base_url=proxy.as_resource().get_base_url(att.rollout_id, att.attempt.attempt_id), model="smollm2"
        )
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            result = await al.harness.run(
                spec["harness"], task["prompt"], llm, workspace=write_repo(task, Path(tmp) / "repo"),
                check=check_command(task), timeout_s=timeout_s, args=spec["args"], env=spec["env"],
                home_files=spec.get("home_files"),
            )  # fmt: skip
            wall = time.perf_counter() - t0
    return {
        "option": option,
        "harness": spec["harness"],
        "args": [a if len(a) < 80 else f"<{len(a)} chars>" for a in spec["args"]],
        "prompt_tokens_per_call": [c["prompt_tokens"] for c in engine.calls],
        "calls": len(engine.calls),
        "sampled_temperature": sorted({c["temperature"] for c in engine.calls}),  # the resource's: 0.6
        "exit_code": result.run.exit_code,
        "check_passed": result.check is not None and result.check.exit_code == 0,
        "wall_s": round(wall, 1),
        "stderr_tail": result.run.stderr[-300:] if result.run.exit_code else "",
        "first_prompt": tokenizer.decode(engine.calls[0]["prompt_ids"]) if engine.calls else None,
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    from transformers import AutoTokenizer

    from agentloop.engine.models import _fix_tokenizer, smollm2_tokenizer_dir

    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--options", nargs="*", default=list(HARNESS_OPTIONS), choices=list(HARNESS_OPTIONS))
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per harness session")
    p.add_argument("--out", default=None, help="also write the rows here as JSON")
    p.add_argument("--show", action="store_true", help="print each option's first prompt as text")
    args = p.parse_args(argv)
    tokenizer = _fix_tokenizer(AutoTokenizer.from_pretrained(smollm2_tokenizer_dir()))
    task = make_tasks()[0][0]
    rows = []
    for option in args.options:
        row = anyio.run(measure, option, task, tokenizer, args.timeout)
        first = row.pop("first_prompt")
        rows.append(row)
        print(json.dumps(row), flush=True)  # the script's output: one JSON line per option
        if args.show:
            print(first, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
