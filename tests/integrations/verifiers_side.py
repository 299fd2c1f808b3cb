"""One verifiers episode end to end, run with the python of ``.venv/frameworks/verifiers`` (verifiers 0.4.0 and
agentloop installed together: verifiers pins what the test venv cannot hold). test_verifiers.py runs it as a
subprocess and checks the JSON line it prints.

    python verifiers_side.py '{"env": "vf_arith", "model": MODEL_DIR, "engine": "torch" | "script"}'

A real Proxy and MemoryStore, the tiny model in a TorchEngine (``torch``) or the tiny model's tokenizer in a
scripted EchoEngine that calls the env's tool once and then answers (``script``), and a Runner playing one
attempt of the env's first task with ``integrations.verifiers.VerifiersAgent``. Printed: the attempt's status,
its reward, the reward the env's rubric gives the recorded completion (recomputed here from the token ids the
proxy recorded), each LLM call's ids, and the merged training sample's mask.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "examples" / "verifiers_envs")]

# per engine: the tiny random model's replies stay short; SmolLM2's tool call (~35 tokens) and the script's fit
MAX_TOKENS = {"torch": 24, "smollm2": 64, "script": 128}
TEMPERATURE = {"torch": 1.0, "smollm2": 0.0, "script": 1.0}  # SmolLM2 greedy, as agentloop validates


def script_reply(tokenizer: Any, task: dict[str, Any]) -> Any:
    """The model's part for the tool env: call multiply, then (once its result is in the prompt) answer."""
    a, b = task["a"], task["b"]
    question, product = f"What is {a} * {b}?", str(a * b)
    # verifiers' chat program names an MCP tool <server>_<tool>: the model sees `calc_multiply`
    call = json.dumps({"name": "calc_multiply", "arguments": {"a": a, "b": b}})

    def reply(ids: list[int], _: Any) -> str:
        # the prompt's worked example holds a call too: the question after the last call means none made yet
        after_call = tokenizer.decode(ids).rpartition("</tool_call>")[2]
        return f"<tool_call>\n{call}\n</tool_call>" if question in after_call else product

    return reply


def record_setenv() -> list[tuple[str, str]]:
    """From now on, every os.putenv this process makes (os.environ[...] = ... calls it), as (name, value)."""
    seen: list[tuple[str, str]] = []
    real = os.putenv

    def putenv(name: Any, value: Any) -> None:
        seen.append((os.fsdecode(name), os.fsdecode(value)))
        real(name, value)

    os.putenv = putenv  # os._Environ.__setitem__ looks putenv up in os's namespace when it runs
    return seen


async def main(cfg: dict[str, Any]) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from agentloop.adapter import merge_turns, spans_to_triplets
    from agentloop.proxy.server import Proxy
    from agentloop.resources import Resources
    from agentloop.runner import Runner
    from agentloop.store.memory import MemoryStore
    from agentloop.types import LLMCall
    from integrations.verifiers import VerifiersAgent, train_tasks

    agent = VerifiersAgent(
        f"{cfg['env']}:ENV",
        sampling={"max_tokens": MAX_TOKENS[cfg["engine"]], "temperature": TEMPERATURE[cfg["engine"]]},
    )
    task = train_tasks(agent.env, limit=1)[0]
    tokenizer = AutoTokenizer.from_pretrained(cfg["model"])
    if cfg["engine"] in ("torch", "smollm2"):
        from agentloop.engine.torch.engine import TorchEngine

        engine: Any = TorchEngine(cfg["model"], max_context=2048, max_batch_size=2)
    else:
        from tests.proxy.engines import EchoEngine

        engine = EchoEngine(tokenizer, reply=script_reply(tokenizer, task), max_context=4096)
    store = MemoryStore()
    proxy = Proxy(engine, store)
    await proxy.start()
    try:
        await store.add_resources(Resources(items={"main_llm": proxy.as_resource("tiny")}))
        rollout = await store.enqueue_rollout(task)
        attempted: list[Any] = []
        setenv = record_setenv()
        stats = await asyncio.wait_for(Runner(agent, store).run(max_rollouts=1), 300)
        setenv_names = sorted({name for name, _ in setenv})
        done = await store.get_rollout(rollout.rollout_id)
        spans = await store.query_spans(rollout.rollout_id)
        spans_all = spans
        error = None
        for span in spans_all:
            attempted.append(span.attempt_id)
        if attempted:
            error = (await store.get_attempt(rollout.rollout_id, attempted[-1])).error
    finally:
        await proxy.stop()
        if hasattr(engine, "shutdown"):
            engine.shutdown()
    calls = [s.payload for s in spans if isinstance(s.payload, LLMCall)]
    last = tokenizer.decode(calls[-1].response_ids, skip_special_tokens=True) if calls else ""
    # the env's own reward method on the completion the proxy recorded
    module = __import__(cfg["env"])
    rubric = float(module.last_number(last) == task["answer"])
    merged = merge_turns(spans_to_triplets(spans, rollout=done).triplets)
    return {
        "status": str(done.status),
        "stats": vars(stats),
        "reward": [t.reward for t in merged],
        "rubric_correct": rubric,
        # vf_calc's reward for its tool called on the question's numbers (0: an env without one)
        "call_bonus": getattr(module, "CALL_BONUS", 0.0),
        "last_text": last,
        "answer": task["answer"],
        "error": error.model_dump() if error is not None else None,
        # variables this process set with a real setenv during the episode (a race with the engine's getenv)
        "setenv_names": setenv_names,
        "calls": [
            {
                "prompt_ids": c.prompt_ids,
                "response_ids": c.response_ids,
                "logprobs": len(c.response_logprobs or []),
                "error": c.error,
                "ledger_break": c.ledger_break,
            }
            for c in calls
        ],
        "engine_calls": [
            {"prompt_ids": e.prompt_ids, "response_ids": e.output.token_ids}
            for e in getattr(engine, "calls", [])
            if e.output is not None
        ],
        "merged": [
            {"prompt_ids": t.prompt_ids, "response_ids": t.response_ids, "mask": t.response_mask}
            for t in merged
        ],
    }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(json.loads(sys.argv[1]))), default=str))
