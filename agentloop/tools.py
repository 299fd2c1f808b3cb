"""Tools an agent can call: BaseTool, ToolResponse, @function_tool, ToolRegistry.

A tool lives per trajectory: ``create`` makes an instance (a sandbox, a DB connection, a
counter), ``execute`` runs one call in it, ``release`` frees it. ``tool.session()`` pairs
create with release, and release runs even when execute raises or the caller is cancelled::

    @function_tool
    def add(a: int, b: int) -> int:
        '''Add two integers.'''
        return a + b

    registry = ToolRegistry([add])
    result = await execute_tool_call(registry, "add", '{"a": 1, "b": 2}')   # never raises
    result.response.text  # "3"

``execute_tool_call`` turns every failure (unknown tool, bad arguments, an exception or a
timeout inside the tool) into a ToolResult whose text the model can read.

Where a sync function tool runs (``function_tool(run_in=...)``); model output is hostile input:

- ``"thread"`` (default): a worker thread. Fine for I/O and for Python code, which gives the GIL
  back every few milliseconds. At the deadline the call is *abandoned*, not stopped: the thread
  runs on until the function returns, and a C-level computation that holds the GIL (``10**10**8``,
  a regex backtracking) stalls the event loop while it runs. Bound the work in the tool itself
  (as ``examples/calc_x`` bounds operand sizes before computing) or use a process.
- ``"process"``: an anyio worker process (``anyio.to_process``), *killed* (SIGKILL) at the deadline,
  so nothing the tool computes can stall the loop or outlive its deadline. Traps: the function
  must be importable by module and name (defined at module level), its arguments and result
  picklable; the first call pays a worker start (a fresh interpreter importing the tool's module,
  counted in the call's deadline), later calls reuse the idle worker (~1 ms); at most
  ``os.cpu_count()`` calls run at once, the others wait (also counted); like multiprocessing's
  spawn, a worker loads the parent's ``__main__`` file as ``__mp_main__``, so a script that
  starts training must do so under ``if __name__ == "__main__":``.
  ``max_memory_mb`` caps what one call may allocate on top of the worker's own size (RLIMIT_AS,
  Linux): past it the call fails with MemoryError and the worker lives on.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import os
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Literal, overload

import anyio
import anyio.to_process
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticSerializationError, to_jsonable_python

from agentloop.errors import ToolDefinitionError
from agentloop.tool_schema import (
    SignatureSpec,
    decode_arguments,
    format_validation_error,
    signature_spec,
    validate_against_schema,
)

if TYPE_CHECKING:  # re-exported lazily by __getattr__ below (tool_registry imports this module)
    from agentloop.tool_registry import RegistrySession, ToolRegistry, execute_tool_call

__all__ = [
    "BaseTool",
    "FunctionTool",
    "RegistrySession",
    "ToolRegistry",
    "ToolResponse",
    "ToolResult",
    "ToolSession",
    "execute_tool_call",
    "function_tool",
    "run_tool",
    "to_tool_result",
]

DEFAULT_TIMEOUT_S = 60.0  # a tool call that takes longer is reported to the model as timed out
RunIn = Literal["thread", "process"]  # where a sync function tool runs (see the module docstring)
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # what the OpenAI API accepts as a function name
_IMAGE = re.compile(r"^(https?://|data:image/)|^[A-Za-z0-9+/\s]+={0,2}$")


class ToolResponse(BaseModel):
    """What a tool shows the model: text, images, or both (text may be empty)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    text: str | None = Field(default=None, description="Text for the model; '' is a valid (empty) answer.")
    images: list[str] | None = Field(
        default=None, description="Images as http(s) URLs, data: URLs or base64."
    )

    @model_validator(mode="after")
    def _some_content(self) -> ToolResponse:
        if self.text is None and not self.images:
            raise ValueError("a ToolResponse needs text (may be '') or at least one image; got neither")
        for i, image in enumerate(self.images or []):
            if not image or not _IMAGE.match(image[:64]):
                raise ValueError(f"images[{i}] must be an http(s) URL, a data:image/ URL or base64 data")
        return self

    def to_openai_content(self) -> str | list[dict[str, Any]]:
        """The `content` of an OpenAI `tool` message: a string, or parts when there are images."""
        if not self.images:
            return self.text or ""
        parts: list[dict[str, Any]] = [{"type": "text", "text": self.text}] if self.text else []
        for image in self.images:
            url = (
                image
                if image.startswith(("http://", "https://", "data:"))
                else f"data:image/png;base64,{image}"
            )
            parts.append({"type": "image_url", "image_url": {"url": url}})
        return parts


class ToolResult(BaseModel):
    """One finished tool call: the response, an optional reward, and metrics."""

    model_config = ConfigDict(extra="forbid")

    response: ToolResponse
    reward: float | None = Field(default=None, description="A reward the tool gives for this call, if any.")
    metrics: dict[str, Any] = Field(default_factory=dict, description="Free-form numbers or labels.")

    @property
    def is_error(self) -> bool:
        """True when execute_tool_call turned a failure into this result."""
        return "error" in self.metrics


def _check_spec(tool: BaseTool) -> None:
    name = getattr(tool, "name", None)
    if not isinstance(name, str) or not _NAME.match(name):
        raise ToolDefinitionError(
            f"{type(tool).__name__}: tool name must be 1-64 characters of letters, digits, '_' or '-', "
            f"got {name!r}"
        )
    if not isinstance(getattr(tool, "description", None), str):
        raise ToolDefinitionError(f"tool {name!r}: description must be a str, got {tool.description!r}")
    params = getattr(tool, "parameters", None)
    if not isinstance(params, dict) or params.get("type") != "object":
        raise ToolDefinitionError(
            f'tool {name!r}: parameters must be a JSON schema dict with "type": "object", got {params!r}'
        )


class BaseTool(ABC):
    """A tool with a per-trajectory lifecycle. Subclasses set `name`, `description`,
    `parameters` (a JSON schema with ``"type": "object"``) and implement `execute`."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = {"type": "object", "properties": {}, "required": []}
    timeout_s: float | None = DEFAULT_TIMEOUT_S  # None: no limit

    def __init__(
        self,
        *,
        name: str | None = None,
        description: str | None = None,
        parameters: dict[str, Any] | None = None,
        timeout_s: Any = ...,  # float | None; ... keeps the class default
    ) -> None:
        if name is not None:
            self.name = name
        if description is not None:
            self.description = description
        if parameters is not None:
            self.parameters = parameters
        if timeout_s is not ...:
            if timeout_s is not None and (not isinstance(timeout_s, int | float) or timeout_s <= 0):
                raise ToolDefinitionError(f"timeout_s must be a positive number or None, got {timeout_s!r}")
            self.timeout_s = timeout_s
        _check_spec(self)

    def openai_schema(self) -> dict[str, Any]:
        """The entry for the OpenAI `tools` field."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}

    def parse_arguments(self, raw: str | Mapping[str, Any] | None) -> dict[str, Any]:
        """Decode and check the model's arguments; raises ToolArgumentError with a model-readable message."""
        args = decode_arguments(raw, self.name)
        validate_against_schema(args, self.parameters, self.name)
        return args

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> str:
        """Start an instance for one trajectory and return its id (default: keeps no state)."""
        return instance_id or uuid.uuid4().hex

    @abstractmethod
    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        """Run one call with already-parsed arguments."""

    async def release(self, instance_id: str) -> None:  # noqa: B027 - a no-op default on purpose
        """Free what `create` made; called exactly once per instance, also after errors."""

    @asynccontextmanager
    async def session(self, instance_id: str | None = None, **kwargs: Any) -> AsyncIterator[ToolSession]:
        """``async with tool.session() as run: await run.execute(args)``; release always runs."""
        iid = await self.create(instance_id, **kwargs)
        try:
            yield ToolSession(self, iid)
        finally:
            with anyio.CancelScope(shield=True):  # release even when the caller is being cancelled
                await self.release(iid)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {getattr(self, 'name', '?')!r}>"


class ToolSession:
    """One live instance of a tool (see `BaseTool.session`)."""

    def __init__(self, tool: BaseTool, instance_id: str) -> None:
        self.tool = tool
        self.instance_id = instance_id

    async def execute(self, arguments: str | Mapping[str, Any] | None) -> ToolResult:
        """Parse raw arguments and run the call; errors propagate (see execute_tool_call for the safe form)."""
        return await self.tool.execute(self.instance_id, self.tool.parse_arguments(arguments))


async def run_tool(
    tool: BaseTool, arguments: str | Mapping[str, Any] | None, **create_kwargs: Any
) -> ToolResult:
    """create + execute + release in one call; release runs even when execute raises."""
    async with tool.session(**create_kwargs) as run:
        return await run.execute(arguments)


# ---------------------------------------------------------------- function tools


def _to_response(value: Any, tool_name: str) -> ToolResponse:
    if isinstance(value, ToolResponse):
        return value
    if isinstance(value, str):
        return ToolResponse(text=value)
    if isinstance(value, BaseModel):
        return ToolResponse(text=value.model_dump_json())
    try:  # dicts, lists, numbers, None; datetimes, enums and models inside them too
        return ToolResponse(text=json.dumps(to_jsonable_python(value), ensure_ascii=False))
    except (TypeError, ValueError, PydanticSerializationError) as exc:
        raise ToolDefinitionError(
            f"tool {tool_name!r} returned {type(value).__name__}, which cannot be shown to the model ({exc})"
        ) from None


def to_tool_result(value: Any, tool_name: str) -> ToolResult:
    """A function's return value as a ToolResult: str / dict / ToolResponse / (response, reward[, metrics])."""
    if isinstance(value, ToolResult):
        return value
    if not isinstance(value, tuple):
        return ToolResult(response=_to_response(value, tool_name))
    if len(value) not in (2, 3):
        raise ToolDefinitionError(
            f"tool {tool_name!r} returned a tuple of {len(value)} items; expected (response, reward) "
            "or (response, reward, metrics)"
        )
    reward, metrics = value[1], value[2] if len(value) == 3 else {}
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, int | float)):
        raise ToolDefinitionError(f"tool {tool_name!r} returned reward {reward!r}; expected a number or None")
    if not isinstance(metrics, dict):
        raise ToolDefinitionError(f"tool {tool_name!r} returned metrics {metrics!r}; expected a dict")
    reward = None if reward is None else float(reward)
    return ToolResult(response=_to_response(value[0], tool_name), reward=reward, metrics=metrics)


def _run_by_name(
    module: str,
    qualname: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    max_memory_mb: int | None = None,
) -> Any:
    """In a worker process: import the tool's function by name and call it (a FunctionTool is unwrapped),
    with its address space capped at its current size + ``max_memory_mb`` for the call's duration."""
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    fn = obj.fn if isinstance(obj, FunctionTool) else obj
    if max_memory_mb is None or not os.path.exists("/proc/self/statm"):
        return fn(*args, **kwargs)
    import resource

    with open("/proc/self/statm") as f:  # first field: the virtual size in pages
        size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = size + max_memory_mb * 1024 * 1024
    resource.setrlimit(
        resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard)
    )
    try:
        return fn(*args, **kwargs)
    finally:  # the next call (maybe another tool's) gets the worker's own limit back
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _check_run_in(fn: Callable[..., Any], run_in: Any) -> None:
    if run_in not in ("thread", "process"):
        raise ToolDefinitionError(
            f"function_tool {fn.__name__!r}: run_in must be 'thread' or 'process', got {run_in!r}"
        )
    if run_in == "thread":
        return
    if inspect.iscoroutinefunction(fn):
        raise ToolDefinitionError(
            f"function_tool {fn.__name__!r}: run_in='process' is for sync functions; an async tool runs "
            "in the event loop (make it sync, or keep its CPU work bounded)"
        )
    if "<locals>" in fn.__qualname__ or not inspect.isfunction(fn):
        raise ToolDefinitionError(
            f"function_tool {fn.__qualname__!r}: run_in='process' needs a function defined at module level "
            f"(a worker process imports it as {fn.__module__}.{fn.__qualname__}); move it out of the "
            "function or class that defines it"
        )


class FunctionTool(BaseTool):
    """A tool made from a typed function by `@function_tool`; still callable as the function."""

    fn: Callable[..., Any]  # the decorated function, unchanged
    spec: SignatureSpec
    run_in: RunIn  # where a sync function runs: a thread (abandoned at the deadline) or a killed process
    max_memory_mb: int | None  # run_in="process": what one call may allocate (None: no cap)

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        run_in: RunIn = "thread",
        max_memory_mb: int | None = None,
    ) -> None:
        if isinstance(fn, FunctionTool):
            fn = fn.fn
        if not inspect.isfunction(fn) and not inspect.ismethod(fn):
            raise ToolDefinitionError(f"function_tool expects a function, got {type(fn).__name__}: {fn!r}")
        if inspect.isasyncgenfunction(fn) or inspect.isgeneratorfunction(fn):
            raise ToolDefinitionError(f"function_tool {fn.__name__!r}: generators cannot be tools")
        _check_run_in(fn, run_in)
        self.fn = fn
        self.spec = signature_spec(fn)
        self.is_async = inspect.iscoroutinefunction(fn)
        self.run_in = run_in
        if max_memory_mb is not None and (
            run_in != "process"
            or isinstance(max_memory_mb, bool)
            or not isinstance(max_memory_mb, int)
            or max_memory_mb < 1
        ):
            raise ToolDefinitionError(
                f"function_tool {fn.__name__!r}: max_memory_mb must be an int >= 1 with run_in='process' "
                f"(a thread shares the process's memory), got {max_memory_mb!r} with run_in={run_in!r}"
            )
        self.max_memory_mb = max_memory_mb
        functools.update_wrapper(self, fn)  # __name__, __doc__, __wrapped__, __module__
        super().__init__(
            name=name or fn.__name__,
            description=self.spec.description if description is None else description,
            parameters=self.spec.parameters,
            timeout_s=timeout_s,
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def parse_arguments(self, raw: str | Mapping[str, Any] | None) -> dict[str, Any]:
        """Validate against the signature (coercing "3" to 3, dicts to models, values to Enums)."""
        args = decode_arguments(raw, self.name)
        try:
            model = self.spec.arguments_model.model_validate(args)
        except ValidationError as exc:
            raise format_validation_error(exc, self.name, list(self.spec.field_names)) from None
        return {pname: getattr(model, field) for pname, field in self.spec.field_names.items()}

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        args = self.parse_arguments(arguments)  # idempotent on parsed arguments
        positional = [args.pop(p) for p in self.spec.positional_only]
        call = functools.partial(self.fn, *positional, **args)
        if self.is_async:
            value = await call()
        elif self.run_in == "process":  # the caller's deadline cancels this: the worker is killed
            value = await anyio.to_process.run_sync(
                _run_by_name, self.fn.__module__, self.fn.__qualname__, tuple(positional), args, self.max_memory_mb,
                cancellable=True,
            )  # fmt: skip
        else:  # a hung sync tool is abandoned (not killed) when the caller's timeout fires
            value = await anyio.to_thread.run_sync(call, abandon_on_cancel=True)
        return to_tool_result(value, self.name)


@overload
def function_tool(fn: Callable[..., Any], /) -> FunctionTool: ...
@overload
def function_tool(
    *,
    name: str | None = None,
    description: str | None = None,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    run_in: RunIn = "thread",
    max_memory_mb: int | None = None,
) -> Callable[[Callable[..., Any]], FunctionTool]: ...
def function_tool(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    run_in: RunIn = "thread",
    max_memory_mb: int | None = None,
) -> FunctionTool | Callable[[Callable[..., Any]], FunctionTool]:
    """Make a tool of a typed function: ``@function_tool`` or ``@function_tool(name=..., run_in="process")``.

    ``run_in="process"`` runs a sync function in a worker process that is killed at the deadline
    (for CPU-bound work on model input), ``max_memory_mb`` caps what a call there may allocate; the
    default thread is abandoned, not stopped (module docstring).
    """
    kwargs: dict[str, Any] = {"name": name, "description": description, "timeout_s": timeout_s}
    kwargs.update(run_in=run_in, max_memory_mb=max_memory_mb)
    if fn is not None:
        return FunctionTool(fn, **kwargs)
    return lambda f: FunctionTool(f, **kwargs)


_REGISTRY_NAMES = ("ToolRegistry", "RegistrySession", "execute_tool_call")


def __getattr__(name: str) -> Any:
    # The registry lives in agentloop.tool_registry (which imports this module); re-exported lazily.
    if name in _REGISTRY_NAMES:
        from agentloop import tool_registry

        return getattr(tool_registry, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
