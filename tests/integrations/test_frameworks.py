"""Each Python agent framework runs one session against a rollout attempt's proxy URL, exits cleanly, and every
call it made is recorded with the engine's exact token ids.

The real Proxy and MemoryStore; an EchoEngine (the real SmolLM2 tokenizer) stands in for the model with a
script: call the framework's tool (``get_weather``), then, once the tool's result is in the prompt, answer.
Nothing of agentloop reaches the agent code: it gets the attempt's base URL, as it would any OpenAI- or
Anthropic-compatible server. Where the framework sends the conversation back as the model wrote it, each
call's prompt extends the last call's prompt + response token for token (one trajectory to train on).

The frameworks come with ``make frameworks`` (pyproject's ``frameworks`` extra, exact versions); each test
skips with the reason when its package is not importable. Strands and AutoGen are not in the extra (their
pins conflict with the venv's; pyproject says which): their tests run where they are installed.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
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
NOT_IN_EXTRA = "is not installed, nor in the frameworks extra: its pins conflict with the venv's (pyproject)"


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
        """Every engine call is one LLMCall span holding the engine's prompt and response ids; with
        ``resends``, each prompt extends the last call's prompt + response exactly, with no ledger break."""
        spans = await self.store.query_spans(self.attempt.rollout_id)
        calls = [s.payload for s in spans if isinstance(s.payload, LLMCall)]
        assert len(calls) >= 2 and len(calls) == len(self.engine.calls), (len(calls), len(self.engine.calls))
        for call, seen in zip(calls, self.engine.calls, strict=True):
            assert call.error is None and seen.output is not None
            assert call.prompt_ids == seen.prompt_ids and call.response_ids == seen.output.token_ids
        if resends:
            for one, two in itertools.pairwise(calls):
                head = one.prompt_ids + one.response_ids
                assert two.ledger_break is None, two.ledger_break
                assert two.prompt_ids[: len(head)] == head
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


# --- Strands --------------------------------------------------------------------------------------------


async def test_strands_openai_model(weather_session: Session) -> None:
    strands = pytest.importorskip("strands", reason=f"strands-agents {NOT_IN_EXTRA}")
    from strands.models.openai import OpenAIModel

    weather = Weather()
    model = OpenAIModel(
        client_args={"base_url": weather_session.url, "api_key": "x", "max_retries": 0, "timeout": 60},
        model_id="tiny",
        params={"max_tokens": 256},
    )
    agent = strands.Agent(
        model=model,
        tools=[strands.tool(weather.tool())],
        system_prompt=INSTRUCTIONS,
        callback_handler=None,  # the default prints the stream
    )
    with anyio.fail_after(120):
        result = await agent.invoke_async(QUESTION)
    assert str(result).strip() == ANSWER
    assert weather.cities == [CITY]
    assert len(await weather_session.recorded()) == 2


# --- AutoGen --------------------------------------------------------------------------------------------


# what AutoGen must be told of a model it does not know by name
AUTOGEN_MODEL_INFO = {"vision": False, "function_calling": True, "json_output": False, "family": "unknown",
                      "structured_output": False}  # fmt: skip


async def test_autogen_assistant_agent(weather_session: Session) -> None:
    pytest.importorskip("autogen_agentchat", reason=f"autogen-agentchat {NOT_IN_EXTRA}")
    pytest.importorskip("autogen_ext.models.openai", reason=f"autogen-ext[openai] {NOT_IN_EXTRA}")
    from autogen_agentchat.agents import AssistantAgent
    from autogen_ext.models.openai import OpenAIChatCompletionClient

    weather = Weather()
    client = OpenAIChatCompletionClient(
        model="tiny",
        base_url=weather_session.url,
        api_key="x",
        max_retries=0,
        timeout=60,
        model_info=AUTOGEN_MODEL_INFO,
    )
    agent = AssistantAgent(
        "forecaster",
        model_client=client,
        tools=[weather.tool()],
        system_message=INSTRUCTIONS,
        # the model is called again, with the same tools, until it answers in text (reflect_on_tool_use would
        # make that call without tools: a new prompt, not the conversation extended)
        max_tool_iterations=4,
    )
    try:
        with anyio.fail_after(120):
            result = await agent.run(task=QUESTION)
    finally:
        await client.close()
    assert result.messages[-1].content == ANSWER
    assert weather.cities == [CITY]
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
