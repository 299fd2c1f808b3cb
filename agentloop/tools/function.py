"""Tools made from typed functions: ``@function_tool``, FunctionTool, and return values as ToolResults.

::

    @function_tool
    def add(a: int, b: int) -> int:
        '''Add two integers.'''
        return a + b

    registry = ToolRegistry([add])
    result = await execute_tool_call(registry, "add", '{"a": 1, "b": 2}')   # never raises
    result.response.text  # "3"

The signature and docstring become the tool's JSON schema (``agentloop.tools.schema``); a return
value becomes a ToolResult (``to_tool_result``: str, dict, ToolResponse, ``(response, reward[, metrics])``).

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
import inspect
import json
import os
from collections.abc import Callable, Mapping
from typing import Any, Literal, overload

import anyio
import anyio.to_process
from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticSerializationError, to_jsonable_python

from agentloop.errors import ToolDefinitionError
from agentloop.importing import import_object
from agentloop.tools.base import DEFAULT_TIMEOUT_S, BaseTool, ToolResponse, ToolResult
from agentloop.tools.schema import SignatureSpec, decode_arguments, format_validation_error, signature_spec

__all__ = ["FunctionTool", "RunIn", "function_tool", "to_tool_result"]

RunIn = Literal["thread", "process"]  # where a sync function tool runs (see the module docstring)


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
    obj = import_object(f"{module}:{qualname}", "function_tool(run_in='process')")
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
