"""LangGraph / LangChain integration: a chat model on the rollout's proxy, and a ReAct agent base class.

``ChatModel`` is a LangChain ``BaseChatModel`` that talks to an OpenAI-compatible endpoint (the
attempt's proxy URL) through the ``openai`` client. The proxy's token ledger keeps the exact token
ids across turns, because the model sends back the history as the proxy returned it. A graph written
for production, taking any chat model, runs unchanged with it::

    model = ChatModel()                       # inside a rollout: bound to this attempt's LLM
    graph = build_my_graph(model)             # your code, unchanged
    state = await graph.ainvoke({"messages": [("user", task["question"])]})

``ReactAgentLoop`` is an ``al.Agent`` whose subclass gives ``tools``, ``system_prompt`` and
``reward(task, final_state)`` (or overrides ``build_graph(llm)`` with its own compiled graph).
"""

from __future__ import annotations

import functools
import inspect
import json
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import openai
from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import AIMessage, BaseMessage, convert_to_openai_messages
from langchain_core.messages.tool import invalid_tool_call, tool_call
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import ConfigDict, Field, model_validator

from agentloop.agent import Agent, AttemptContext, check_reward, run_in_daemon_thread
from agentloop.context import current_rollout
from agentloop.errors import RolloutContextError
from agentloop.logging import get_logger
from agentloop.resources import LLM, ProxyLLM, Resources
from agentloop.tools.agent import sampling_kwargs, task_messages
from agentloop.types import AttemptedRollout

log = get_logger("integrations.langgraph")

__all__ = ["ChatModel", "ReactAgentLoop", "message_from_openai", "react_graph", "small_react_graph"]


def _tool_choice(choice: Any) -> Any:
    """LangChain's tool_choice forms as the OpenAI field."""
    if choice is None or isinstance(choice, dict) or choice in ("auto", "none", "required"):
        return choice
    if choice == "any" or choice is True:
        return "required"
    if isinstance(choice, str):
        return {"type": "function", "function": {"name": choice}}
    raise ValueError(
        f"tool_choice must be 'auto', 'none', 'any', 'required', a tool name or a dict, got {choice!r}"
    )


def message_from_openai(message: Any, response_metadata: dict[str, Any] | None = None) -> AIMessage:
    """An OpenAI assistant message as an AIMessage; tool calls whose arguments are not a JSON object
    become ``InvalidToolCall`` entries (with the raw arguments and the parse error)."""
    calls, invalid = [], []
    for call in getattr(message, "tool_calls", None) or []:
        name, raw = call.function.name, call.function.arguments
        try:
            args = json.loads(raw) if raw else {}
            if not isinstance(args, dict):
                raise ValueError(f"arguments must be a JSON object, got {type(args).__name__}")
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            invalid.append(
                invalid_tool_call(name=name, args=raw, id=call.id, error=f"{type(exc).__name__}: {exc}")
            )
            continue
        calls.append(tool_call(name=name, args=args, id=call.id))
    return AIMessage(
        content=message.content or "",
        tool_calls=calls,
        invalid_tool_calls=invalid,
        response_metadata=response_metadata or {},
    )


class ChatModel(BaseChatModel):
    """A LangChain chat model on an agentloop LLM (the rollout's proxy), through the ``openai`` client.

    Created inside a rollout without ``llm``, it binds to the current attempt's LLM.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    llm: LLM = Field(description="Endpoint, model name, key and default sampling (a ProxyLLM is resolved).")
    sampling: dict[str, Any] = Field(default_factory=dict, description="Request fields over llm.sampling.")
    request_timeout_s: float = Field(default=300.0, gt=0, description="Limit on one request.")
    max_retries: int = Field(
        default=0, ge=0, description="openai client retries (0: a failed call fails the step)."
    )
    return_token_ids: bool = Field(
        default=False, description="Ask the proxy for token ids in response_metadata."
    )

    @model_validator(mode="before")
    @classmethod
    def _bind_llm(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        llm = data.get("llm")
        if isinstance(llm, LLM):
            return data
        ctx = current_rollout.get()
        if llm is None:
            if ctx is None or ctx.llm is None:
                raise RolloutContextError(
                    "ChatModel() without llm= must be created inside a rollout whose resources hold an LLM; "
                    "outside one pass llm=al.LLM(base_url=..., model=...)"
                )
            return {**data, "llm": ctx.llm}
        if isinstance(llm, ProxyLLM):
            if ctx is None:
                raise RolloutContextError(
                    "ChatModel got a ProxyLLM outside a rollout; pass llm.resolve(rollout) or a plain al.LLM"
                )
            return {**data, "llm": llm.resolve(ctx.rollout)}
        if isinstance(llm, dict):
            return data  # validated as an LLM by pydantic
        raise TypeError(f"ChatModel llm must be an al.LLM, al.ProxyLLM or None, got {type(llm).__name__}")

    @property
    def _llm_type(self) -> str:
        return "agentloop"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self.llm.model, "base_url": self.llm.base_url, **self.sampling}

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | Any],
        *,
        tool_choice: str | dict[str, Any] | bool | None = None,
        parallel_tool_calls: bool | None = None,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind LangChain tools, pydantic models, functions or OpenAI tool dicts to every request."""
        if isinstance(tools, str | bytes | dict) or not isinstance(tools, Sequence):
            raise TypeError(f"bind_tools takes a list of tools, got {type(tools).__name__}")
        bound: dict[str, Any] = {"tools": [convert_to_openai_tool(t, strict=strict) for t in tools], **kwargs}
        if tool_choice is not None:
            bound["tool_choice"] = _tool_choice(tool_choice)
        if parallel_tool_calls is not None:
            bound["parallel_tool_calls"] = parallel_tool_calls
        return self.bind(**bound)

    # ------------------------------------------------------------ requests

    def _request(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        sampling = {**self.llm.sampling, **self.sampling}
        request: dict[str, Any] = {"model": self.llm.model, "messages": convert_to_openai_messages(messages)}
        if stop:
            sampling["stop"] = stop
        extra = dict(kwargs.pop("extra_body", None) or {})
        if "tool_choice" in kwargs:
            kwargs["tool_choice"] = _tool_choice(kwargs["tool_choice"])
        if not kwargs.get("tools"):
            kwargs.pop("tools", None)
            kwargs.pop("tool_choice", None)
            kwargs.pop("parallel_tool_calls", None)
        request.update(sampling_kwargs(sampling))
        extra = {**request.pop("extra_body", {}), **extra}
        if self.return_token_ids:
            extra["return_token_ids"] = True
        request.update(kwargs)
        if extra:
            request["extra_body"] = extra
        return request

    def _client_kwargs(self) -> dict[str, Any]:
        return {
            "base_url": self.llm.base_url,
            "api_key": self.llm.api_key,
            "timeout": self.request_timeout_s,
            "max_retries": self.max_retries,
        }

    @staticmethod
    def _result(response: Any) -> ChatResult:
        if not response.choices:
            raise ValueError(f"the model server answered without choices: {response!r:.200}")
        choice = response.choices[0]
        meta: dict[str, Any] = {
            "finish_reason": choice.finish_reason,
            "model_name": response.model,
            "id": response.id,
        }
        extra = response.model_extra or {}
        for key in ("token_ids", "prompt_token_ids"):
            if key in extra:
                meta[key] = extra[key]
        message = message_from_openai(choice.message, meta)
        if response.usage is not None:
            message.usage_metadata = {
                "input_tokens": response.usage.prompt_tokens,
                "output_tokens": response.usage.completion_tokens,
                "total_tokens": response.usage.total_tokens,
            }
        usage = response.usage.model_dump() if response.usage is not None else {}
        return ChatResult(
            generations=[
                ChatGeneration(message=message, generation_info={"finish_reason": choice.finish_reason})
            ],
            llm_output={"model_name": response.model, "token_usage": usage},
        )

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        with openai.OpenAI(**self._client_kwargs()) as client:
            response = client.chat.completions.create(**self._request(messages, stop, kwargs))
        return self._result(response)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        async with openai.AsyncOpenAI(**self._client_kwargs()) as client:
            response = await client.chat.completions.create(**self._request(messages, stop, kwargs))
        return self._result(response)


# ---------------------------------------------------------------- the ReAct agent


def react_graph(model: BaseChatModel, tools: Sequence[Any], system_prompt: str | None = None) -> Any:
    """The default ReAct graph: langgraph's prebuilt ``create_react_agent``, or a StateGraph with a ToolNode."""
    try:
        from langgraph.prebuilt import create_react_agent
    except ImportError:  # langgraph versions without the prebuilt agent
        return small_react_graph(model, tools, system_prompt)
    with warnings.catch_warnings():  # deprecated in langgraph 1.x in favour of langchain's create_agent
        warnings.simplefilter("ignore", DeprecationWarning)
        return create_react_agent(model, list(tools), prompt=system_prompt)


def small_react_graph(model: BaseChatModel, tools: Sequence[Any], system_prompt: str | None = None) -> Any:
    """A ReAct StateGraph (model node + ToolNode), used when langgraph has no prebuilt agent."""
    from langgraph.graph import END, START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    bound = model.bind_tools(list(tools)) if tools else model
    prefix = [{"role": "system", "content": system_prompt}] if system_prompt else []

    async def agent(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await bound.ainvoke(prefix + list(state["messages"]))]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_edge(START, "agent")
    if tools:
        graph.add_node("tools", ToolNode(list(tools)))
        graph.add_conditional_edges("agent", tools_condition, {"tools": "tools", END: END})
        graph.add_edge("tools", "agent")
    else:
        graph.add_edge("agent", END)
    return graph.compile()


class ReactAgentLoop(Agent):
    """An ``al.Agent`` running a LangGraph graph on the rollout's LLM.

    Subclasses set ``tools`` (LangChain tools or functions) and ``system_prompt`` and implement
    ``reward(task, final_state)`` (sync or async; ``final_state`` is the graph's last state, None if
    it produced none); or override ``build_graph(llm)`` to return their own compiled graph. The graph
    runs with ``recursion_limit=max_steps``; running out of steps, or out of context, ends the run and
    the last state is scored.

    Task keys read (by ``graph_input``, which makes the graph input ``{"messages": [...]}``):

    - a ``str`` task: the user message;
    - ``task["messages"]``: a non-empty list of chat messages (dicts with a ``role``), the conversation's start;
    - else ``task["question"]``, or ``task["prompt"]``: a string sent as the user message.

    Any other key (an ``answer``, an id) is not read here: ``reward(task, final_state)`` gets the whole
    task. Anything else raises ``ValueError`` naming the keys it got; override ``graph_input`` for
    another format. ``system_prompt`` goes to the graph (the prebuilt agent's ``prompt``), not the task.
    """

    tools: Sequence[Any] = ()
    system_prompt: str | None = None
    max_steps: int = 25  # langgraph's recursion_limit: each model call and each tool round is a step
    sampling: dict[str, Any] = {}
    llm_name: str | None = None  # the LLM resource to use when the resources hold several

    def reward(self, task: Any, final_state: Any) -> Any:
        raise NotImplementedError(f"{type(self).__qualname__} must implement reward(task, final_state)")

    def build_graph(self, llm: ChatModel) -> Any:
        """A compiled graph taking ``{"messages": [...]}``; the default is the prebuilt ReAct agent."""
        return react_graph(llm, self.tools, self.system_prompt)

    def graph_input(self, task: Any) -> dict[str, Any]:
        """The graph's input state for ``task``."""
        return {"messages": task_messages(task)}

    def _llm(self, resources: Resources | None, rollout: AttemptedRollout) -> LLM:
        ctx = current_rollout.get()
        if self.llm_name is None and ctx is not None and ctx.llm is not None:
            return ctx.llm
        if resources is None:
            raise RolloutContextError(
                f"{type(self).__qualname__} needs an LLM resource (store.add_resources)"
            )
        llm = resources.get_llm(self.llm_name)
        return llm.resolve(rollout) if isinstance(llm, ProxyLLM) else llm

    async def rollout(
        self, task: Any, resources: Resources | None, rollout: AttemptedRollout
    ) -> float | None:
        from langgraph.errors import GraphRecursionError

        if isinstance(self.max_steps, bool) or not isinstance(self.max_steps, int) or self.max_steps < 1:
            raise ValueError(
                f"{type(self).__qualname__}.max_steps must be an int >= 1, got {self.max_steps!r}"
            )
        model = ChatModel(llm=self._llm(resources, rollout), sampling=dict(self.sampling))
        graph = self.build_graph(model)
        state: Any = None
        stop_reason = "end"
        try:
            async for values in graph.astream(
                self.graph_input(task), config={"recursion_limit": self.max_steps}, stream_mode="values"
            ):
                state = values  # the latest full state survives a recursion or context error
        except GraphRecursionError:
            stop_reason = "max_steps"
        except openai.BadRequestError as exc:
            if getattr(exc, "code", None) != "context_length_exceeded":
                raise
            stop_reason = "context_length_exceeded"
        log.debug("graph_finished", rollout_id=rollout.rollout_id, stop_reason=stop_reason)
        if inspect.iscoroutinefunction(self.reward):
            value = await self.reward(task, state)
        else:  # a sync reward (often re-running model output: SQL, code) runs off the event loop
            ctx = current_rollout.get()
            limiter = ctx.thread_limiter if isinstance(ctx, AttemptContext) else None
            value = await run_in_daemon_thread(
                functools.partial(self.reward, task, state), limiter, name="agentloop reward"
            )
        if inspect.isawaitable(value):  # a sync method that returned a coroutine
            value = await value
        return check_reward(value, self)
