"""Agents: the ``Agent`` base class, the ``@rollout`` decorator, ``emit_reward`` and the attempt context.

An agent turns one task into a reward. The class form::

    class MyAgent(al.Agent):
        async def rollout(self, task, resources, rollout):   # resolve resources.get_llm() yourself
            ...

The function form resolves the LLM for you (a ProxyLLM becomes this attempt's URL)::

    @al.rollout                       # async or sync; (task, llm) or (task, llm, rollout)
    async def agent(task, llm): ...   # stays callable as before: agent(task, llm)

A returned float/int/bool is the attempt's reward; None means the agent called ``emit_reward``
(or gave no reward at all). Anything else fails the attempt with ``AgentError``.

Rewards and ordering: ``emit_reward`` hands the Reward span to one writer task per attempt, which
stores spans in the order they were emitted. From a sync agent (a worker thread) the call blocks
until the span is stored, so it lands before any LLM call the agent makes afterwards. From async
code the write starts at the agent's next ``await``; ``await al.emit_reward(x)`` waits until it is
stored, which guarantees its place before the next LLM call.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import math
import numbers
import threading
from collections.abc import AsyncIterator, Callable, Generator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, get_args, overload

import anyio
import anyio.from_thread
import anyio.lowlevel
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from agentloop.context import RolloutContext, current_rollout, get_rollout_context
from agentloop.errors import AgentError, RolloutContextError
from agentloop.importing import import_object
from agentloop.logging import get_logger
from agentloop.resources import LLM, ProxyLLM, Resources
from agentloop.store.base import Store
from agentloop.types import MAX_ABS_REWARD, AttemptedRollout, Reward, Span

log = get_logger("agentloop.agent")

__all__ = [
    "Agent",
    "AttemptContext",
    "FunctionAgent",
    "PendingReward",
    "attempt_context",
    "check_reward",
    "emit_reward",
    "resolve_llm",
    "rollout",
    "run_in_daemon_thread",
]


# ---------------------------------------------------------------- span writer


@dataclass
class _Write:
    span: Span
    done: anyio.Event = field(default_factory=anyio.Event)
    stored: Span | None = None
    error: Exception | None = None


class PendingReward:
    """What ``emit_reward`` returns: ``await`` it to wait until the reward span is stored."""

    __slots__ = ("_write",)

    def __init__(self, write: _Write) -> None:
        self._write = write

    @property
    def done(self) -> bool:
        return self._write.done.is_set()

    @property
    def span(self) -> Span | None:
        """The stored span (with its sequence_id), once stored."""
        return self._write.stored

    async def wait(self) -> Span:
        await self._write.done.wait()
        if self._write.error is not None:
            raise self._write.error
        assert self._write.stored is not None
        return self._write.stored

    def __await__(self) -> Generator[Any, None, Span]:
        return self.wait().__await__()


class _SpanWriter:
    """One task per attempt that stores spans in submission order (owned by ``attempt_context``)."""

    def __init__(self, store: Store) -> None:
        self._store = store
        # Unbounded: emit_reward from async code must not block, and an attempt emits few rewards.
        send, recv = anyio.create_memory_object_stream[_Write](max_buffer_size=math.inf)
        self._send: MemoryObjectSendStream[_Write] = send
        self._recv: MemoryObjectReceiveStream[_Write] = recv
        self.error: Exception | None = None

    def submit(self, span: Span) -> PendingReward:
        """Queue a span (event loop thread only)."""
        write = _Write(span)
        try:
            self._send.send_nowait(write)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            raise RolloutContextError(
                f"attempt {span.attempt_id} of rollout {span.rollout_id} has already finished; "
                "the span was not recorded"
            ) from None
        return PendingReward(write)

    async def submit_and_wait(self, span: Span) -> PendingReward:
        pending = self.submit(span)
        await pending.wait()
        return pending

    def close(self) -> None:
        self._send.close()

    async def run(self) -> None:
        async with self._recv:
            async for write in self._recv:
                try:
                    write.stored = await self._store.add_span(write.span)
                except Exception as exc:  # recorded; the attempt fails with it when the context closes
                    write.error = exc
                    self.error = self.error or exc
                    log.warning(
                        "span_write_failed",
                        rollout_id=write.span.rollout_id,
                        attempt_id=write.span.attempt_id,
                        error=repr(exc),
                    )
                write.done.set()


# ---------------------------------------------------------------- attempt context


@dataclass
class AttemptContext(RolloutContext):
    """The rollout context the runner opens for one attempt: adds the ordered span writer."""

    writer: _SpanWriter | None = None
    loop_thread: int = 0  # threading.get_ident() of the event loop thread
    loop_token: Any = None  # anyio EventLoopToken, to reach the loop from any thread
    thread_limiter: anyio.CapacityLimiter | None = None  # worker threads for sync agents

    def submit_span(self, span: Span) -> PendingReward:
        """Store ``span`` in order with the attempt's other writes; blocks when called off the loop thread."""
        if self.writer is None:
            raise RolloutContextError(
                "this rollout context has no span writer; open it with attempt_context()"
            )
        if threading.get_ident() == self.loop_thread:
            return self.writer.submit(span)
        return anyio.from_thread.run(self.writer.submit_and_wait, span, token=self.loop_token)


def resolve_llm(resources: Resources | None, rollout: AttemptedRollout) -> LLM | None:
    """The resources' LLM for this attempt: a ProxyLLM resolves to the attempt's URL; None if there is none."""
    if resources is None:
        return None
    try:
        llm = resources.get_llm()
    except KeyError:
        return None
    return llm.resolve(rollout) if isinstance(llm, ProxyLLM) else llm


@asynccontextmanager
async def attempt_context(
    rollout: AttemptedRollout, store: Store, *, thread_limiter: anyio.CapacityLimiter | None = None
) -> AsyncIterator[AttemptContext]:
    """Set the current rollout for the block and run its span writer; on exit every emitted span is stored.

    Raises the first span write error (for example ``StaleAttemptError``) after the block.
    """
    if not isinstance(rollout, AttemptedRollout):
        raise TypeError(f"attempt_context expects an AttemptedRollout, got {type(rollout).__name__}")
    writer = _SpanWriter(store)
    ctx = AttemptContext(
        rollout=rollout,
        store=store,
        llm=resolve_llm(rollout.resources, rollout),
        writer=writer,
        loop_thread=threading.get_ident(),
        loop_token=anyio.lowlevel.current_token(),
        thread_limiter=thread_limiter,
    )
    token = current_rollout.set(ctx)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(writer.run)
            try:
                yield ctx
            finally:
                writer.close()  # the writer stores what is queued, then ends
    except BaseExceptionGroup as group:  # anyio wraps the block's exception; hand back the plain one
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
    finally:
        current_rollout.reset(token)
    if writer.error is not None:
        raise writer.error


def emit_reward(value: float, name: str | None = None) -> PendingReward:
    """Record a reward for the current attempt as a Reward span, in order with its other spans.

    Several calls are allowed (per-turn rewards). Works from async agents (``await`` the result to
    wait until it is stored) and from sync agents running in a worker thread (blocks until stored).
    Raises RolloutContextError outside a rollout.
    """
    if not isinstance(value, numbers.Real):  # bool and int are Real too
        raise TypeError(f"emit_reward takes a number (float, int or bool), got {type(value).__name__}")
    reward = float(value)
    if not math.isfinite(reward) or abs(reward) > MAX_ABS_REWARD:
        raise ValueError(f"emit_reward takes a finite number within +-{MAX_ABS_REWARD:g}, got {reward:g}")
    if name is not None and not isinstance(name, str):
        raise TypeError(f"emit_reward name must be a str or None, got {type(name).__name__}")
    ctx = get_rollout_context("emit_reward")
    if not isinstance(ctx, AttemptContext):
        raise RolloutContextError(
            "emit_reward needs the context the Runner opens (agentloop.agent.attempt_context); "
            "this rollout context was set up without one"
        )
    span = Span(
        rollout_id=ctx.rollout.rollout_id,
        attempt_id=ctx.rollout.attempt.attempt_id,
        payload=Reward(value=reward, name=name),
    )
    pending = ctx.submit_span(span)
    ctx.rewards.append(reward)
    return pending


def check_reward(value: Any, agent: object) -> float | None:
    """An agent's return value as a reward: numbers become float, None stays None, anything else fails."""
    if value is None:
        return None
    if isinstance(value, numbers.Real):  # bool, int, float and numpy reals
        reward = float(value)
        if not math.isfinite(reward) or abs(reward) > MAX_ABS_REWARD:
            raise AgentError(
                f"agent {agent!r} returned {reward:g}; a reward must be a finite number within "
                f"+-{MAX_ABS_REWARD:g} (MAX_ABS_REWARD)"
            )
        return reward
    hint = " (call .item() on a tensor or array)" if hasattr(value, "item") else ""
    raise AgentError(
        f"agent {agent!r} returned a {type(value).__module__}.{type(value).__qualname__}; an agent must return "
        f"a reward (float, int or bool) or None after calling emit_reward{hint}"
    )


# ---------------------------------------------------------------- agents


class Agent:
    """Class-based agent: implement ``async def rollout(self, task, resources, rollout) -> float | None``.

    ``resources`` are the versioned resources the attempt runs with (None if the store has none);
    resolve a ProxyLLM with ``resources.get_llm().resolve(rollout)``.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        method = cls.__dict__.get("rollout")
        if method is not None and not inspect.iscoroutinefunction(method):
            raise TypeError(f"{cls.__qualname__}.rollout must be an `async def` method")

    async def rollout(
        self, task: Any, resources: Resources | None, rollout: AttemptedRollout
    ) -> float | None:
        raise NotImplementedError(f"{type(self).__qualname__} must implement `async def rollout(...)`")

    def __repr__(self) -> str:
        return f"<{type(self).__qualname__}>"


def _is_rollout_annotation(annotation: Any) -> bool:
    """``AttemptedRollout`` (or a subclass, a union holding it, or the name as a string annotation)."""
    if annotation is inspect.Parameter.empty:
        return False
    if isinstance(annotation, str):  # `from __future__ import annotations`
        return "AttemptedRollout" in annotation
    if isinstance(annotation, type):
        return issubclass(annotation, AttemptedRollout)
    return any(_is_rollout_annotation(arg) for arg in get_args(annotation))


def _arity(fn: Callable[..., Any]) -> int:
    """2 for ``(task, llm)``, 3 for ``(task, llm, rollout)``; TypeError for anything else.

    The third parameter receives the ``AttemptedRollout``, so it must say so: it is named ``rollout``
    or annotated ``AttemptedRollout``. A third parameter meant for something else (``tokenizer``)
    would silently receive the rollout: refused here, unless it has a default (then it keeps it).
    """
    what = getattr(fn, "__qualname__", repr(fn))
    expected = (
        "@rollout expects a function taking (task, llm) or (task, llm, rollout), where the third "
        "parameter receives the AttemptedRollout (name it `rollout` or annotate it al.AttemptedRollout)"
    )
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{expected}; cannot read the signature of {what}: {exc}") from None
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    var_positional = any(p.kind is p.VAR_POSITIONAL for p in params)
    kw_required = [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
    if kw_required:
        raise TypeError(f"{expected}; {what}{sig} also requires the keyword-only arguments {kw_required}")
    if len(required) > 3:
        raise TypeError(f"{expected}; {what}{sig} requires {len(required)} positional arguments")
    if len(positional) >= 3:
        third = positional[2]
        if third.name == "rollout" or _is_rollout_annotation(third.annotation):
            return 3
        if third.default is third.empty:
            raise TypeError(
                f"{expected}; {what}{sig} has a third parameter {third.name!r} that is neither named "
                "`rollout` nor annotated AttemptedRollout, so it would receive the rollout. Get other "
                "objects elsewhere (a closure, a class agent's attribute), or give it a default"
            )
    if len(positional) >= 2 or var_positional:
        return 2
    raise TypeError(f"{expected}; {what}{sig} takes {len(positional)} positional argument(s)")


def _import_agent(module: str, qualname: str) -> Any:
    """The agent a pickle names by reference (see ``FunctionAgent.__reduce__``)."""
    return import_object(f"{module}:{qualname}", "agent")


class FunctionAgent(Agent):
    """An agent made from a function by ``@rollout``; calling it calls the original function."""

    def __init__(self, fn: Callable[..., Any], name: str | None = None) -> None:
        if inspect.isclass(fn):
            raise TypeError(
                f"@rollout decorates functions; for the class {fn.__qualname__}, subclass al.Agent"
            )
        if not callable(fn):
            raise TypeError(f"@rollout expects a function, got {type(fn).__name__}")
        if inspect.isasyncgenfunction(fn) or inspect.isgeneratorfunction(fn):
            raise TypeError(
                f"@rollout expects a function that returns a reward; {fn.__qualname__} is a generator"
            )
        self.fn = fn
        self.arity = _arity(fn)
        self.is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            getattr(fn, "__call__", None)  # noqa: B004 - an object with an async __call__
        )
        functools.update_wrapper(self, fn)
        self.name = name or getattr(fn, "__qualname__", type(fn).__name__)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<agent {self.name}>"

    def __reduce__(self) -> Any:  # pickle by reference when the agent is a module-level name
        module, qualname = getattr(self, "__module__", None), getattr(self.fn, "__qualname__", "")
        if module and "<" not in qualname:
            try:
                if _import_agent(module, qualname) is self:
                    return (_import_agent, (module, qualname))
            except ImportError:  # ImportObjectError: not importable under that name
                pass
        return (FunctionAgent, (self.fn, self.name))

    async def rollout(
        self, task: Any, resources: Resources | None, rollout: AttemptedRollout
    ) -> float | None:
        ctx = current_rollout.get()
        llm = ctx.llm if ctx is not None and ctx.rollout is rollout else resolve_llm(resources, rollout)
        args = (task, llm, rollout) if self.arity == 3 else (task, llm)
        if self.is_async:
            return await self.fn(*args)
        limiter = ctx.thread_limiter if isinstance(ctx, AttemptContext) else None
        return await run_in_daemon_thread(
            functools.partial(self.fn, *args), limiter, name=f"agent {self.name}"
        )


async def run_in_daemon_thread(
    fn: Callable[[], Any], limiter: anyio.CapacityLimiter | None = None, name: str = "agentloop agent"
) -> Any:
    """Run ``fn()`` in a new daemon thread, in a copy of the current context (so ``emit_reward`` finds the
    rollout), and return its result.

    Why not ``anyio.to_thread.run_sync``: a sync agent cannot be interrupted, so on timeout or stop it
    is abandoned; an abandoned anyio worker thread keeps the process alive at exit, a daemon thread does
    not. Its later writes are refused (the attempt has finished). Inside ``fn`` reach the event loop
    with ``anyio.from_thread.run(..., token=...)``; ``emit_reward`` does this for you.
    """
    context = contextvars.copy_context()
    token = anyio.lowlevel.current_token()
    done = anyio.Event()
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = context.run(fn)
        except BaseException as exc:  # handed to the awaiting task
            outcome["error"] = exc
        try:
            anyio.from_thread.run_sync(done.set, token=token)
        except Exception:  # the event loop has finished: nobody waits for this result
            pass

    async with limiter if limiter is not None else contextlib.nullcontext():
        threading.Thread(target=target, name=name, daemon=True).start()
        await done.wait()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


@overload
def rollout(fn: Callable[..., Any], *, name: str | None = None) -> FunctionAgent: ...
@overload
def rollout(fn: None = None, *, name: str | None = None) -> Callable[[Callable[..., Any]], FunctionAgent]: ...
def rollout(
    fn: Callable[..., Any] | None = None, *, name: str | None = None
) -> FunctionAgent | Callable[[Callable[..., Any]], FunctionAgent]:
    """Make an agent from an async or sync function ``(task, llm)`` or ``(task, llm, rollout)``.

    Usable bare (``@rollout``) or with arguments (``@rollout(name="calc")``). The signature is checked
    here; the LLM (ProxyLLM resolved to the attempt's URL) is passed at run time.
    """
    if fn is None:
        return functools.partial(FunctionAgent, name=name)
    return FunctionAgent(fn, name=name)
