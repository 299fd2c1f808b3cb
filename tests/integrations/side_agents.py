"""Agents written with a framework that cannot share the test venv (Strands, AutoGen: their pins conflict with
it, pyproject says which). test_frameworks.py runs this file with the python of the framework's own virtualenv
(``make frameworks``: ``.venv/frameworks/<name>``) as a subprocess against a rollout attempt's proxy URL, as a
user's agent process would run. It imports nothing of agentloop or of the tests.

    python side_agents.py FRAMEWORK '{"url": ..., "question": ..., "instructions": ..., "weather": ...}'

prints one JSON line: ``{"answer": <the agent's final text>, "cities": <what get_weather was called with>}``.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable
from typing import Any


def weather_tool(cities: list[str], weather: str) -> Callable[[str], str]:
    def get_weather(city: str) -> str:
        """Get the current weather in a city.

        Args:
            city: The city's name, e.g. Paris.
        """
        cities.append(city)
        return f"{weather} in {city}"

    return get_weather


async def strands_agent(cfg: dict[str, Any], tool: Callable[[str], str]) -> str:
    import strands
    from strands.models.openai import OpenAIModel

    model = OpenAIModel(
        client_args={"base_url": cfg["url"], "api_key": "x", "max_retries": 0, "timeout": 60},
        model_id="tiny",
        params={"max_tokens": 256},
    )
    agent = strands.Agent(
        model=model,
        tools=[strands.tool(tool)],
        system_prompt=cfg["instructions"],
        callback_handler=None,  # the default prints the stream
    )
    result = await agent.invoke_async(cfg["question"])
    return str(result).strip()


# what AutoGen must be told of a model it does not know by name
AUTOGEN_MODEL_INFO = {"vision": False, "function_calling": True, "json_output": False, "family": "unknown",
                      "structured_output": False}  # fmt: skip


async def autogen_agent(cfg: dict[str, Any], tool: Callable[[str], str]) -> str:
    from autogen_agentchat.agents import AssistantAgent
    from autogen_ext.models.openai import OpenAIChatCompletionClient

    client = OpenAIChatCompletionClient(
        model="tiny",
        base_url=cfg["url"],
        api_key="x",
        max_retries=0,
        timeout=60,
        model_info=AUTOGEN_MODEL_INFO,
    )
    agent = AssistantAgent(
        "forecaster",
        model_client=client,
        tools=[tool],
        system_message=cfg["instructions"],
        # the model is called again, with the same tools, until it answers in text (reflect_on_tool_use would
        # make that call without tools: a new prompt, not the conversation extended)
        max_tool_iterations=4,
    )
    try:
        result = await agent.run(task=cfg["question"])
    finally:
        await client.close()
    content = result.messages[-1].content
    return content if isinstance(content, str) else json.dumps(content, default=str)


AGENTS = {"strands": strands_agent, "autogen": autogen_agent}


def main(argv: list[str]) -> None:
    if len(argv) != 3 or argv[1] not in AGENTS:
        raise SystemExit(f"usage: {argv[0]} {{{','.join(AGENTS)}}} CONFIG_JSON")
    cfg = json.loads(argv[2])
    cities: list[str] = []
    answer = asyncio.run(AGENTS[argv[1]](cfg, weather_tool(cities, cfg["weather"])))
    print(json.dumps({"answer": answer, "cities": cities}))


if __name__ == "__main__":
    main(sys.argv)
