"""``ToolAgent``: a built-in ReAct loop over the OpenAI API, with tools and a reward function.

Each turn sends the conversation (and the tools' schemas) to the attempt's proxy URL; when the model
answers with tool calls, they run (concurrently with ``parallel_tool_calls``) and their outputs go
back as ``tool`` messages; the first answer without tool calls is the final answer::

    agent = al.ToolAgent([calculator], reward_fn=lambda task, answer: float(answer == task["answer"]))
    al.Runner(agent, store).run(...)

Task format: a dict with ``messages`` (a list of OpenAI chat messages), or ``question`` / ``prompt``
(a string, sent as the user message); a plain string is taken as the question. Other keys (the gold
answer, ids) are left for the reward function.

Rewards: ``reward_fn(task, answer)`` or ``reward_fn(task, answer, messages)`` (sync or async) scores
the final answer (``None`` when the loop ended without one: max turns, context full); the rollout
returns it. A sync reward function runs in a worker thread (it may re-run model output: code, SQL),
so a slow one never stalls the event loop the other rollouts share; the attempt's ``timeout_s``
bounds it. A tool that gives a reward (``ToolResult.reward``) has it emitted as its own Reward span
named ``tool:<name>`` right after the call, so with the adapter's default ``identical`` strategy the
attempt's reward is ``reward_fn`` + the sum of tool rewards, and ``per_call`` credits each to the turn
that made the call.

Recorded per tool execution: a ``ToolCall`` span (name, arguments, the text shown to the model, the
error kind if it failed, latency). Tool faults (unknown tool, bad arguments, exceptions, timeouts)
never end the rollout: the model reads ``"Error: ..."`` and goes on. Tool and observation tokens get
mask 0 when the trainer merges the turns of one attempt into one sample (``agentloop.adapter.merge_turns``).
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal, cast

import anyio
import openai

from agentloop.agent import Agent, AttemptContext, check_reward, emit_reward, run_in_daemon_thread
from agentloop.context import current_rollout
from agentloop.errors import AgentError, RolloutContextError
from agentloop.logging import get_logger
from agentloop.resources import LLM, ProxyLLM, Resources
from agentloop.tools.base import BaseTool, ToolResult
from agentloop.tools.registry import RegistrySession, ToolRegistry
from agentloop.types import AttemptedRollout, Log, Span, ToolCall

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageFunctionToolCall, ChatCompletionMessageParam

log = get_logger("agentloop.tools.agent")

__all__ = ["ToolAgent", "sampling_kwargs", "task_messages", "truncate_text"]

TruncateSide = Literal["left", "right", "middle"]
_OPENAI_SAMPLING = ("temperature", "top_p", "max_tokens", "seed", "stop", "n", "max_completion_tokens")


def truncate_text(text: str, max_chars: int | None, side: TruncateSide = "middle") -> str:
    """Cut ``text`` to about ``max_chars`` characters, marking what was dropped.

    ``right`` keeps the start, ``left`` keeps the end, ``middle`` keeps both ends. The marker
    (``... [truncated N chars] ...``) comes on top of the ``max_chars`` kept characters.
    """
    if side not in ("left", "right", "middle"):
        raise ValueError(f"truncate side must be 'left', 'right' or 'middle', got {side!r}")
    if max_chars is None or len(text) <= max_chars:
        return text
    marker = f"... [truncated {len(text) - max_chars} chars] ..."
    if side == "right":
        return text[:max_chars] + marker
    if side == "left":
        return marker + text[len(text) - max_chars :]
    head = (max_chars + 1) // 2
    tail = max_chars - head
    return text[:head] + marker + (text[len(text) - tail :] if tail else "")


def sampling_kwargs(sampling: dict[str, Any]) -> dict[str, Any]:
    """Sampling settings as ``chat.completions.create`` keyword arguments (others go in ``extra_body``)."""
    kwargs = {k: v for k, v in sampling.items() if k in _OPENAI_SAMPLING}
    extra = {k: v for k, v in sampling.items() if k not in _OPENAI_SAMPLING}
    if extra:
        kwargs["extra_body"] = extra
    return kwargs


def task_messages(task: Any, system_prompt: str | None = None) -> list[dict[str, Any]]:
    """The opening messages of a task (see the module docstring for the accepted forms)."""
    if isinstance(task, str):
        messages: list[dict[str, Any]] = [{"role": "user", "content": task}]
    elif isinstance(task, dict) and "messages" in task:
        raw = task["messages"]
        if not isinstance(raw, list) or not raw or not all(isinstance(m, dict) and "role" in m for m in raw):
            raise ValueError(
                f"task['messages'] must be a non-empty list of chat messages (dicts with a 'role'), got {raw!r:.200}"
            )
        messages = [dict(m) for m in raw]
    elif isinstance(task, dict) and isinstance(task.get("question", task.get("prompt")), str):
        messages = [{"role": "user", "content": task.get("question", task.get("prompt"))}]
    else:
        keys = sorted(task) if isinstance(task, dict) else type(task).__name__
        raise ValueError(
            "a task must be a string or a dict with 'messages' (a list of chat messages) or "
            f"'question' / 'prompt' (a string); got {keys}"
        )
    if system_prompt and messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def _reward_arity(fn: Callable[..., Any]) -> int:
    expected = "reward_fn must take (task, answer) or (task, answer, messages)"
    if not callable(fn):
        raise TypeError(f"{expected}; got a {type(fn).__name__}")
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{expected}; cannot read its signature: {exc}") from None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if any(p.kind is p.VAR_POSITIONAL for p in params) or len(positional) >= 3:
        return 3
    if len(positional) == 2:
        return 2
    raise TypeError(
        f"{expected}; {getattr(fn, '__qualname__', fn)!r} takes {len(positional)} positional arguments"
    )


def _assistant_dict(message: Any) -> dict[str, Any]:
    """The assistant message to append to the history, exactly as the server returned it."""
    out: dict[str, Any] = {"role": "assistant", "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.function.name, "arguments": c.function.arguments},
            }
            for c in message.tool_calls
        ]
    return out


class ToolAgent(Agent):
    """A ReAct loop with tools (functions, BaseTools or a ToolRegistry) scored by ``reward_fn``.

    Args:
        tools: typed functions (wrapped with ``function_tool``), ``BaseTool``s, or a ``ToolRegistry``.
        reward_fn: ``(task, answer)`` or ``(task, answer, messages)`` -> number, sync or async.
        system_prompt: prepended when the task's messages do not start with a system message.
        max_turns: most model calls per rollout; the loop then ends without a final answer.
        parallel_tool_calls: run one turn's tool calls concurrently (else one after another).
        max_tool_response_chars: longer tool output is truncated (None: never).
        truncate_side: which part of long tool output is dropped ("middle" keeps both ends).
        sampling: request fields (temperature, max_tokens, seed, top_k, ...) over the LLM's defaults.
        llm_name: the LLM resource to use when the resources hold several.
        tool_timeout_s: per-call limit over each tool's own ``timeout_s`` (None: the tool's).
        request_timeout_s: limit on one model request.
    """

    def __init__(
        self,
        tools: ToolRegistry | Iterable[BaseTool | Callable[..., Any]],
        reward_fn: Callable[..., Any],
        system_prompt: str | None = None,
        max_turns: int = 8,
        parallel_tool_calls: bool = True,
        max_tool_response_chars: int | None = 4000,
        truncate_side: TruncateSide = "middle",
        sampling: dict[str, Any] | None = None,
        llm_name: str | None = None,
        tool_timeout_s: float | None = None,
        request_timeout_s: float = 300.0,
    ) -> None:
        if isinstance(tools, str | bytes | dict) or not isinstance(tools, ToolRegistry | Iterable):
            raise TypeError(
                f"tools must be a ToolRegistry or a list of tools/functions, got {type(tools).__name__}"
            )
        self.registry = tools if isinstance(tools, ToolRegistry) else ToolRegistry(tools)
        self._reward_arity = _reward_arity(reward_fn)
        self.reward_fn = reward_fn
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise TypeError(f"system_prompt must be a str or None, got {type(system_prompt).__name__}")
        self.system_prompt = system_prompt
        if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"max_turns must be an int >= 1, got {max_turns!r}")
        self.max_turns = max_turns
        self.parallel_tool_calls = bool(parallel_tool_calls)
        if max_tool_response_chars is not None and (
            isinstance(max_tool_response_chars, bool)
            or not isinstance(max_tool_response_chars, int)
            or max_tool_response_chars < 1
        ):
            raise ValueError(
                f"max_tool_response_chars must be an int >= 1 or None, got {max_tool_response_chars!r}"
            )
        self.max_tool_response_chars = max_tool_response_chars
        truncate_text("", None, truncate_side)  # validates the side
        self.truncate_side: TruncateSide = truncate_side
        if sampling is not None and not isinstance(sampling, dict):
            raise TypeError(f"sampling must be a dict or None, got {type(sampling).__name__}")
        self.sampling = dict(sampling or {})
        self.llm_name = llm_name
        for name, value in (("tool_timeout_s", tool_timeout_s), ("request_timeout_s", request_timeout_s)):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int | float) or value <= 0
            ):
                raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
        self.tool_timeout_s = tool_timeout_s
        self.request_timeout_s = float(request_timeout_s)

    def __repr__(self) -> str:
        return f"<ToolAgent tools={self.registry.names} max_turns={self.max_turns}>"

    # ------------------------------------------------------------ one rollout

    def _llm(self, resources: Resources | None, rollout: AttemptedRollout, ctx: AttemptContext) -> LLM:
        if self.llm_name is None and ctx.llm is not None:
            return ctx.llm
        if resources is None:
            raise RolloutContextError(
                "ToolAgent needs an LLM resource: store.add_resources(Resources(items={'llm': proxy.as_resource()}))"
            )
        llm = resources.get_llm(self.llm_name)
        return llm.resolve(rollout) if isinstance(llm, ProxyLLM) else llm

    async def rollout(
        self, task: Any, resources: Resources | None, rollout: AttemptedRollout
    ) -> float | None:
        ctx = current_rollout.get()
        if (
            not isinstance(ctx, AttemptContext)
            or ctx.rollout.attempt.attempt_id != rollout.attempt.attempt_id
        ):
            raise RolloutContextError("ToolAgent.rollout runs inside an attempt opened by al.Runner")
        messages = task_messages(task, self.system_prompt)
        llm = self._llm(resources, rollout, ctx)
        client = openai.AsyncOpenAI(
            base_url=llm.base_url, api_key=llm.api_key, max_retries=0, timeout=self.request_timeout_s
        )
        schemas = self.registry.schemas()
        answer: str | None = None
        stop_reason, turns, n_calls = "max_turns", 0, 0
        async with client, self.registry.session() as tools:
            for _ in range(self.max_turns):
                turns += 1
                try:
                    response = await client.chat.completions.create(
                        model=llm.model, messages=cast("list[ChatCompletionMessageParam]", messages),
                        # NOT_GIVEN works on every openai>=1.40; newer openai types this sentinel as Omit
                        tools=schemas or openai.NOT_GIVEN,  # type: ignore[arg-type]
                        **sampling_kwargs(self.sampling),
                    )  # fmt: skip
                except openai.BadRequestError as exc:
                    if getattr(exc, "code", None) != "context_length_exceeded":
                        raise
                    stop_reason = "context_length_exceeded"  # recorded by the proxy; score what we have
                    break
                if not response.choices:
                    raise AgentError(f"the model server answered without choices: {response!r:.200}")
                message = response.choices[0].message
                messages.append(_assistant_dict(message))
                if not message.tool_calls:
                    answer, stop_reason = message.content or "", "answer"
                    break
                n_calls += len(message.tool_calls)
                results = await self._run_calls(tools, message.tool_calls, ctx)
                for call, result in zip(message.tool_calls, results, strict=True):
                    messages.append(
                        {
                            "role": "tool",
                            "tool_call_id": call.id,
                            # only function tools are offered, so only function calls come back
                            "name": cast("ChatCompletionMessageFunctionToolCall", call).function.name,
                            "content": self._text(result),
                        }
                    )
        reward = await self._score(task, answer, messages)
        await ctx.submit_span(
            Span(
                rollout_id=rollout.rollout_id,
                attempt_id=rollout.attempt.attempt_id,
                payload=Log(
                    message="tool_agent_finished",
                    fields={
                        "turns": turns,
                        "tool_calls": n_calls,
                        "stop_reason": stop_reason,
                        "answer": answer,
                    },
                ),
            )
        )
        return reward

    def _text(self, result: ToolResult) -> str:
        text = result.response.text or ""
        if result.response.images:  # the proxy serves text models: say that images were left out
            text += f"\n[{len(result.response.images)} image(s) omitted]"
        return truncate_text(text, self.max_tool_response_chars, self.truncate_side)

    async def _run_calls(
        self, tools: RegistrySession, calls: Sequence[Any], ctx: AttemptContext
    ) -> list[ToolResult]:
        results: list[ToolResult | None] = [None] * len(calls)
        spans: list[Span | None] = [None] * len(calls)

        async def one(i: int) -> None:
            call = calls[i]
            start = time.monotonic()
            result = await tools.call(
                call.function.name, call.function.arguments, timeout_s=self.tool_timeout_s
            )
            results[i] = result
            spans[i] = Span(
                rollout_id=ctx.rollout.rollout_id,
                attempt_id=ctx.rollout.attempt.attempt_id,
                payload=ToolCall(
                    name=call.function.name,
                    arguments=_decoded(call.function.arguments),
                    result=self._text(result),
                    error=result.metrics.get("error"),
                    latency_s=time.monotonic() - start,
                ),
            )

        if self.parallel_tool_calls and len(calls) > 1:
            async with anyio.create_task_group() as tg:
                for i in range(len(calls)):
                    tg.start_soon(one, i)
        else:
            for i in range(len(calls)):
                await one(i)
        # Spans go in call order, each tool reward right after its call, all stored before the next turn.
        for call, result, span in zip(calls, results, spans, strict=True):
            assert result is not None and span is not None
            await ctx.submit_span(span)
            if result.reward is not None and math.isfinite(result.reward):
                await emit_reward(result.reward, name=f"tool:{call.function.name}")
        return [r for r in results if r is not None]

    async def _score(self, task: Any, answer: str | None, messages: list[dict[str, Any]]) -> float | None:
        args = (task, answer, messages) if self._reward_arity == 3 else (task, answer)
        if _is_async(self.reward_fn):
            value = await self.reward_fn(*args)
        else:  # off the event loop, in the attempt's context (emit_reward works in it)
            ctx = current_rollout.get()
            limiter = ctx.thread_limiter if isinstance(ctx, AttemptContext) else None
            value = await run_in_daemon_thread(
                functools.partial(self.reward_fn, *args), limiter, name="agentloop reward_fn"
            )
            if inspect.isawaitable(value):  # a sync callable that returned a coroutine
                value = await value
        return check_reward(value, self.reward_fn)


def _is_async(fn: Callable[..., Any]) -> bool:
    """An ``async def`` function, or an object whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def _decoded(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments  # kept as the model wrote it
