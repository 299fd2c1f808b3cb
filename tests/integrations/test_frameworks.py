"""Each Python agent framework runs one session against a rollout attempt's proxy URL, exits cleanly, and every
call it made is recorded with the engine's exact token ids.

The real Proxy and MemoryStore; an EchoEngine (the real SmolLM2 tokenizer) stands in for the model with a
script: call the framework's tool (``get_weather``), then, once the tool's result is in the prompt, answer.
Nothing of agentloop reaches the agent code: it gets the attempt's base URL, as it would any OpenAI- or
Anthropic-compatible server. Where the framework sends the conversation back as the model wrote it, each
call's prompt extends the last call's prompt + response token for token (one trajectory to train on).

The frameworks come with ``make frameworks`` (pyproject's ``frameworks`` extra, exact versions); each test
skips with the reason when its package is not importable. Strands and AutoGen are not in the extra (their
pins conflict with the venv's; pyproject says which): ``make frameworks`` gives each its own virtualenv
(``.venv/frameworks/<name>``, exact versions), and their agents (side_agents.py) run there as a subprocess
against the attempt's URL, as a user's agent process would.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest

from agentloop.store.memory import MemoryStore
from agentloop.types import AttemptedRollout, LLMCall
from tests.proxy.conftest import attempt_url, new_attempt, running_proxy
from tests.proxy.conftest import tokenizer as tokenizer  # the fixture
from tests.proxy.engines import EchoEngine

pytestmark = pytest.mark.slow

QUESTION = "What is the weather in Paris? Use the get_weather tool."
INSTRUCTIONS = "Answer with the get_weather tool."
CITY = "Paris"
WEATHER = "sunny and 21 degrees"  # the tool's result: the script answers once it is in the prompt
ANSWER = "It is sunny and 21 degrees in Paris."
MISSING = "is not installed: make frameworks installs pyproject's frameworks extra"
SIDE_MISSING = (
    "has no virtualenv: make frameworks makes one (its pins conflict with the test venv's, pyproject)"
)


def tool_call(name: str, arguments: dict[str, Any]) -> str:
    """What a hermes-style model writes to call a tool; the proxy turns it into the API's tool call."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def weather_then(answer: str) -> Callable[[str], str]:
    """The model's part: call get_weather until its result shows in the prompt, then ``answer``."""
    return lambda prompt: answer if WEATHER in prompt else tool_call("get_weather", {"city": CITY})


class Weather:
    """The agent's tool, and the cities it was called with."""

    def __init__(self) -> None:
        self.cities: list[str] = []

    def tool(self) -> Callable[[str], str]:
        def get_weather(city: str) -> str:
            """Get the current weather in a city.

            Args:
                city: The city's name, e.g. Paris.
            """
            self.cities.append(city)
            return f"{WEATHER} in {city}"

        return get_weather


@dataclass
class Session:
    """One rollout attempt on a running proxy over a scripted engine."""

    engine: EchoEngine
    store: MemoryStore
    attempt: AttemptedRollout
    url: str  # the attempt's OpenAI base URL (.../v1)

    async def recorded(self, *, resends: bool = True) -> list[LLMCall]:
        """Every engine call is one LLMCall span holding the engine's prompt and response ids and its call id;
        with ``resends``, each prompt extends the last call's prompt + response exactly, with no ledger
        break, and the call is linked to it (its parent, on the main branch)."""
        spans = await self.store.query_spans(self.attempt.rollout_id)
        calls = [s.payload for s in spans if isinstance(s.payload, LLMCall)]
        assert len(calls) >= 2 and len(calls) == len(self.engine.calls), (len(calls), len(self.engine.calls))
        for call, seen in zip(calls, self.engine.calls, strict=True):
            assert call.error is None and seen.output is not None
            assert call.prompt_ids == seen.prompt_ids and call.response_ids == seen.output.token_ids
        assert [c.call_id for c in calls] == list(range(1, len(calls) + 1))  # the ledger's ids, in order
        if resends:
            for one, two in itertools.pairwise(calls):
                head = one.prompt_ids + one.response_ids
                assert two.ledger_break is None, two.ledger_break
                assert two.prompt_ids[: len(head)] == head
                assert two.parent_call_id == one.call_id and two.branch == one.branch == "main"
        return calls


@asynccontextmanager
async def session(tokenizer: Any, reply: Callable[[str], str]) -> AsyncIterator[Session]:
    """A proxy whose engine answers each prompt (decoded) with ``reply(prompt)``, and one attempt on it."""
    engine = EchoEngine(tokenizer, reply=lambda ids, _: reply(tokenizer.decode(ids)), max_context=32768)
    store = MemoryStore()
    async with running_proxy(engine, store) as proxy:
        att = await new_attempt(store)
        yield Session(engine, store, att, attempt_url(proxy, att))


@pytest.fixture
async def weather_session(tokenizer: Any) -> AsyncIterator[Session]:
    """The common script: call get_weather, then answer in text."""
    async with session(tokenizer, weather_then(ANSWER)) as s:
        yield s


# --- openai-agents --------------------------------------------------------------------------------------


@pytest.mark.parametrize("api", ["chat_completions", "responses"])
async def test_openai_agents(api: str, weather_session: Session) -> None:
    agents = pytest.importorskip("agents", reason=f"openai-agents {MISSING}")
    import openai

    weather = Weather()
    client = openai.AsyncOpenAI(base_url=weather_session.url, api_key="x", max_retries=0, timeout=60)
    chat = api == "chat_completions"
    model_cls = agents.OpenAIChatCompletionsModel if chat else agents.OpenAIResponsesModel
    agent = agents.Agent(
        name="forecaster",
        instructions=INSTRUCTIONS,
        model=model_cls(model="tiny", openai_client=client),
        tools=[agents.function_tool(weather.tool())],
    )
    try:
        with anyio.fail_after(120):
            result = await agents.Runner.run(
                agent, QUESTION, run_config=agents.RunConfig(tracing_disabled=True), max_turns=4
            )
    finally:
        await client.close()
    assert result.final_output == ANSWER
    assert weather.cities == [CITY]
    assert len(await weather_session.recorded()) == 2


# --- pydantic-ai ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
async def test_pydantic_ai(provider: str, weather_session: Session) -> None:
    pydantic_ai = pytest.importorskip("pydantic_ai", reason=f"pydantic-ai-slim {MISSING}")
    weather = Weather()
    client: Any  # the SDK client: passed in, so that it is closed while the loop runs
    if provider == "openai":
        import openai
        from pydantic_ai.models.openai import OpenAIChatModel
        from pydantic_ai.providers.openai import OpenAIProvider

        client = openai.AsyncOpenAI(base_url=weather_session.url, api_key="x", max_retries=0, timeout=60)
        model: Any = OpenAIChatModel("tiny", provider=OpenAIProvider(openai_client=client))
    else:
        import anthropic
        from pydantic_ai.models.anthropic import AnthropicModel
        from pydantic_ai.providers.anthropic import AnthropicProvider

        base = weather_session.url.removesuffix("/v1")  # the Anthropic client appends /v1/messages
        client = anthropic.AsyncAnthropic(base_url=base, api_key="x", max_retries=0, timeout=60)
        model = AnthropicModel("tiny", provider=AnthropicProvider(anthropic_client=client))
    agent = pydantic_ai.Agent(model, instructions=INSTRUCTIONS, tools=[weather.tool()])
    try:
        with anyio.fail_after(120):
            result = await agent.run(QUESTION)
    finally:
        await client.close()
    assert result.output == ANSWER
    assert weather.cities == [CITY]
    assert len(await weather_session.recorded()) == 2


# --- LangGraph + LangChain's ChatAnthropic -------------------------------------------------------------------


async def test_langgraph_react_agent_with_chat_anthropic(weather_session: Session) -> None:
    """A LangGraph prebuilt ReAct agent over LangChain's ChatAnthropic: the Messages API, the tool call as a
    tool_use block and its result as a tool_result, sent back as the model wrote them."""
    pytest.importorskip("langchain_anthropic", reason=f"langchain-anthropic {MISSING}")
    from langchain_anthropic import ChatAnthropic
    from langchain_core.tools import tool
    from langgraph.prebuilt import create_react_agent
    from pydantic import SecretStr

    weather = Weather()
    base = weather_session.url.removesuffix("/v1")  # the Anthropic client appends /v1/messages
    model = ChatAnthropic(
        model_name="tiny", base_url=base, api_key=SecretStr("x"), max_retries=0, timeout=60, stop=None
    )
    agent = create_react_agent(model, tools=[tool(weather.tool())], prompt=INSTRUCTIONS)
    with anyio.fail_after(120):
        result = await agent.ainvoke({"messages": [("user", QUESTION)]})
    assert result["messages"][-1].content == ANSWER
    assert weather.cities == [CITY]
    assert len(await weather_session.recorded()) == 2


# --- smolagents -----------------------------------------------------------------------------------------


async def test_smolagents_tool_calling_agent(tokenizer: Any) -> None:
    """ToolCallingAgent answers through its own final_answer tool, so the script's second turn calls it. It
    sends its history back re-written (the tool call as text, "Calling tools: [...]", and the result as a user
    "Observation:"), not as the model wrote it: the proxy records the ledger break and renders in full."""
    smolagents = pytest.importorskip("smolagents", reason=f"smolagents {MISSING}")
    weather = Weather()
    async with session(tokenizer, weather_then(tool_call("final_answer", {"answer": ANSWER}))) as s:
        model = smolagents.OpenAIServerModel(
            model_id="tiny", api_base=s.url, api_key="x", client_kwargs={"max_retries": 0, "timeout": 60}
        )
        agent = smolagents.ToolCallingAgent(
            tools=[smolagents.tool(weather.tool())], model=model, max_steps=4, verbosity_level=0
        )
        try:
            with anyio.fail_after(120):
                output = await anyio.to_thread.run_sync(agent.run, QUESTION)  # a sync client
        finally:
            model.client.close()
        assert output == ANSWER
        assert weather.cities == [CITY]
        one, two = await s.recorded(resends=False)
    assert two.ledger_break is not None
    assert two.prompt_ids[: len(one.prompt_ids)] == one.prompt_ids  # the same system prompt and task


# --- Strands and AutoGen: each in its own virtualenv --------------------------------------------------------

SIDE_AGENTS = Path(__file__).with_name("side_agents.py")


SIDE_MODULES = {"strands": ("strands", "strands.models.openai"),
                "autogen": ("autogen_agentchat", "autogen_ext.models.openai")}  # fmt: skip


def side_python(framework: str) -> Path | None:
    """The python of ``make frameworks``' virtualenv for ``framework`` (next to the test venv's own prefix),
    else this one where the framework is installed here, else None."""
    own = Path(sys.prefix) / "frameworks" / framework / "bin" / "python"
    if own.exists():
        return own
    try:
        here = all(importlib.util.find_spec(m) is not None for m in SIDE_MODULES[framework])
    except ImportError:  # a parent package missing
        here = False
    return Path(sys.executable) if here else None


@pytest.mark.parametrize(
    "framework",
    [
        pytest.param("strands", id="strands-openai-model"),
        pytest.param("autogen", id="autogen-assistant-agent"),
    ],
)
async def test_framework_in_its_own_virtualenv(framework: str, weather_session: Session) -> None:
    """Strands' OpenAIModel in an Agent, and AutoGen's AssistantAgent on an OpenAIChatCompletionClient, each
    run by side_agents.py in its own virtualenv as a subprocess against the attempt's URL: the answer and
    the tool call come back on its stdout, and every call is recorded, each extending the last."""
    python = side_python(framework)
    if python is None:
        pytest.skip(f"{framework} {SIDE_MISSING} (.venv/frameworks/{framework})")
    config = {
        "url": weather_session.url,
        "question": QUESTION,
        "instructions": INSTRUCTIONS,
        "weather": WEATHER,
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}  # nothing of the test venv's
    with anyio.fail_after(180):
        done = await anyio.run_process(
            [str(python), str(SIDE_AGENTS), framework, json.dumps(config)], check=False, env=env
        )
    out, err = done.stdout.decode(), done.stderr.decode()
    assert done.returncode == 0, err[-4000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result == {"answer": ANSWER, "cities": [CITY]}, (result, err[-2000:])
    assert len(await weather_session.recorded()) == 2


# --- DSPy -----------------------------------------------------------------------------------------------


def dspy_reply(prompt: str) -> str:
    """DSPy's ChatAdapter reads fields out of text: ReAct's step fields, then its extract step's."""
    if "next_tool_name" not in prompt:  # the extract step (ChainOfThought over the trajectory)
        return f"[[ ## reasoning ## ]]\nThe tool said {WEATHER}.\n\n[[ ## answer ## ]]\n{ANSWER}\n\n[[ ## completed ## ]]"
    name, args = ("finish", {}) if WEATHER in prompt else ("get_weather", {"city": CITY})
    return (
        f"[[ ## next_thought ## ]]\nNext: {name}.\n\n[[ ## next_tool_name ## ]]\n{name}\n\n"
        f"[[ ## next_tool_args ## ]]\n{json.dumps(args)}\n\n[[ ## completed ## ]]"
    )


async def test_dspy_react(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """ReAct through LiteLLM's openai/ provider. DSPy writes each step as a fresh system + user prompt (the
    trajectory inside the user message), so its calls do not extend each other; each is recorded exactly."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # LiteLLM's packaged cost map: no fetch
    monkeypatch.setenv("LITELLM_OFFLINE_MODE", "true")
    dspy = pytest.importorskip("dspy", reason=f"dspy {MISSING}")
    weather = Weather()
    async with session(tokenizer, dspy_reply) as s:
        lm = dspy.LM("openai/tiny", api_base=s.url, api_key="x", cache=False, num_retries=0, max_tokens=256)
        react = dspy.ReAct("question -> answer", tools=[weather.tool()], max_iters=4)

        def run() -> Any:  # dspy.context: this call's LM, no global dspy.configure
            with dspy.context(lm=lm):
                return react(question=QUESTION)

        with anyio.fail_after(120):
            prediction = await anyio.to_thread.run_sync(run)  # LiteLLM's sync client
        assert prediction.answer == ANSWER
        assert weather.cities == [CITY]
        assert [prediction.trajectory[f"tool_name_{i}"] for i in (0, 1)] == ["get_weather", "finish"]
        calls = await s.recorded(resends=False)
    assert len(calls) == 3  # get_weather, finish, the extract step
