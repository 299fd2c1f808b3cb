"""The minimal agent: one ``openai`` chat completion inside ``@al.rollout``; reward = the expected word appears."""

from __future__ import annotations

from typing import Any

import openai

from agentloop.agent import rollout
from agentloop.resources import LLM

TASKS: list[dict[str, str]] = [
    {"question": "What is the capital of France? Answer with one word.", "expected": "Paris"},
    {"question": "What color is the sky on a clear day? Answer with one word.", "expected": "blue"},
    {"question": "How many legs does a spider have? Answer with a number.", "expected": "8"},
    {"question": "What is the opposite of hot? Answer with one word.", "expected": "cold"},
    {"question": "Which planet do we live on? Answer with one word.", "expected": "Earth"},
    {"question": "What is 3 + 4? Answer with a number.", "expected": "7"},
]


def make_tasks(n: int) -> list[dict[str, str]]:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    return [dict(TASKS[i % len(TASKS)]) for i in range(n)]


@rollout
async def agent(task: dict[str, Any], llm: LLM) -> float:
    """Ask the question at the attempt's proxy URL; 1.0 when the expected word is in the answer."""
    async with openai.AsyncOpenAI(
        base_url=llm.base_url, api_key=llm.api_key, max_retries=0, timeout=300
    ) as client:
        response = await client.chat.completions.create(
            model=llm.model, messages=[{"role": "user", "content": task["question"]}]
        )
    answer = response.choices[0].message.content or ""
    return float(task["expected"].lower() in answer.lower())
