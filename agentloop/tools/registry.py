"""Tool registries: tools by name, loaded from functions or a YAML file, and calls that never raise.

A YAML file lists entries; ``class`` is an import path (``pkg.mod:Name``, ``pkg.mod.Name`` or
``file.py:Name``; see agentloop.importing)
of a BaseTool subclass or a ``@function_tool`` function, ``config`` holds constructor
keyword arguments and ``schema`` optionally overrides name, description or parameters::

    tools:
      - class: myproject.tools:Calculator
        config: {precision: 4}
      - class: myproject.tools.search
        schema: {description: "Search the docs."}

Only ``yaml.safe_load`` and ``importlib`` are used: nothing in the file is evaluated.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import structlog
import yaml

from agentloop.errors import ImportObjectError, ToolArgumentError, ToolDefinitionError, ToolNotFoundError
from agentloop.importing import import_object
from agentloop.tools.base import BaseTool, ToolResponse, ToolResult, _check_spec
from agentloop.tools.function import FunctionTool

__all__ = ["RegistrySession", "ToolRegistry", "execute_tool_call"]

log = structlog.get_logger(__name__)


def _apply_schema_override(tool: BaseTool, schema: Any, where: str) -> None:
    if not isinstance(schema, dict):
        raise ToolDefinitionError(f"{where}: schema must be a mapping, got {type(schema).__name__}")
    spec = schema.get("function", schema) if schema.get("type") == "function" else schema
    unknown = set(spec) - {"name", "description", "parameters"}
    if unknown:
        raise ToolDefinitionError(
            f"{where}: schema has unknown keys {sorted(unknown)}; allowed: name, description, parameters"
        )
    params = spec.get("parameters")
    if isinstance(tool, FunctionTool) and isinstance(params, dict):
        taken = tool.spec.parameters["properties"]
        named = set(params.get("properties") or {})
        extra = sorted(named - set(taken))
        missing = sorted(set(tool.spec.parameters["required"]) - named)
        if extra or missing:
            raise ToolDefinitionError(
                f"{where}: schema parameters must describe the function's own parameters {sorted(taken)}; "
                f"unknown: {extra}, required but missing: {missing}"
            )
    for key in ("name", "description", "parameters"):
        if key in spec:
            setattr(tool, key, spec[key])
    _check_spec(tool)


def _tool_from_entry(entry: Any, where: str) -> BaseTool:
    if not isinstance(entry, dict) or "class" not in entry:
        raise ToolDefinitionError(f"{where}: expected a mapping with a 'class' key, got {entry!r}")
    unknown = set(entry) - {"class", "config", "schema"}
    if unknown:
        raise ToolDefinitionError(f"{where}: unknown keys {sorted(unknown)}; allowed: class, config, schema")
    config = entry.get("config") or {}
    if not isinstance(config, dict):
        raise ToolDefinitionError(
            f"{where}: config must be a mapping of constructor arguments, got {config!r}"
        )
    try:
        obj = import_object(str(entry["class"]), f"{where}: class")
    except ImportObjectError as exc:
        raise ToolDefinitionError(str(exc)) from exc.__cause__
    try:
        if isinstance(obj, FunctionTool):
            merged = {
                "name": obj.name, "description": obj.description, "timeout_s": obj.timeout_s,
                "run_in": obj.run_in, "max_memory_mb": obj.max_memory_mb, **config,
            }  # fmt: skip
            tool: BaseTool = FunctionTool(obj.fn, **merged)
        elif isinstance(obj, type) and issubclass(obj, BaseTool):
            tool = obj(**config)
        elif inspect.isfunction(obj):
            tool = FunctionTool(obj, **config)
        else:
            raise ToolDefinitionError(
                f"{where}: {entry['class']!r} is {obj!r}; expected a BaseTool subclass or a @function_tool function"
            )
    except TypeError as exc:  # a config key the constructor does not take
        raise ToolDefinitionError(
            f"{where}: cannot build {entry['class']!r} with config {config!r} ({exc})"
        ) from None
    if "schema" in entry:
        _apply_schema_override(tool, entry["schema"], where)
    return tool


class ToolRegistry:
    """Tools by name. Plain functions are wrapped with `function_tool`; two tools with one name raise."""

    def __init__(self, tools: Iterable[BaseTool | Callable[..., Any]] = ()) -> None:
        self._tools: dict[str, BaseTool] = {}
        for tool in tools:
            self.add(tool)

    def add(self, tool: BaseTool | Callable[..., Any]) -> BaseTool:
        """Register a tool (or a typed function) and return it."""
        if not isinstance(tool, BaseTool):
            if isinstance(tool, type):
                raise ToolDefinitionError(
                    f"ToolRegistry.add expects a tool instance or a function, got class {tool!r}"
                )
            tool = FunctionTool(tool)
        _check_spec(tool)
        if tool.name in self._tools:
            raise ToolDefinitionError(
                f"two tools are named {tool.name!r} ({self._tools[tool.name]!r} and {tool!r}); "
                "give one another name (function_tool(name=...) or the tool's `name`)"
            )
        self._tools[tool.name] = tool
        return tool

    def get(self, name: str) -> BaseTool:
        """The tool called `name`; raises ToolNotFoundError listing the known names."""
        try:
            return self._tools[name]
        except (KeyError, TypeError):
            raise ToolNotFoundError(
                f"unknown tool {name!r}; available: {', '.join(self._tools) or 'none'}"
            ) from None

    @property
    def names(self) -> list[str]:
        return list(self._tools)

    def schemas(self) -> list[dict[str, Any]]:
        """The value for the OpenAI `tools` request field."""
        return [tool.openai_schema() for tool in self._tools.values()]

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __iter__(self) -> Iterator[BaseTool]:
        return iter(self._tools.values())

    def __len__(self) -> int:
        return len(self._tools)

    @classmethod
    def from_yaml(cls, path: str | Path) -> ToolRegistry:
        """Load ``[{class: "pkg.mod:Name", config: {...}, schema: {...}}, ...]`` (or ``{tools: [...]}``)."""
        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise ToolDefinitionError(f"{path}: not valid YAML ({exc})") from None
        entries = data.get("tools") if isinstance(data, dict) else data
        if not isinstance(entries, list):
            raise ToolDefinitionError(
                f"{path}: expected a list of tools (or a mapping with a 'tools' list), got {data!r}"
            )
        return cls(_tool_from_entry(entry, f"{path}: tools[{i}]") for i, entry in enumerate(entries))

    @asynccontextmanager
    async def session(self, **create_kwargs: Any) -> AsyncIterator[RegistrySession]:
        """One trajectory: each tool's instance is created on first use and released at exit."""
        run = RegistrySession(self, create_kwargs)
        try:
            yield run
        finally:
            with anyio.CancelScope(shield=True):
                await run.release_all()


# ---------------------------------------------------------------- calls that never raise


def _error(kind: str, message: str, tool: str) -> ToolResult:
    log.warning("tool call failed", tool=tool, error=kind, message=message[:200])
    return ToolResult(response=ToolResponse(text=f"Error: {message}"), reward=None, metrics={"error": kind})


async def _safe_call(
    registry: ToolRegistry, name: str, raw: Any, timeout_s: float | None, instance: Callable[[BaseTool], Any]
) -> ToolResult:
    try:
        tool = registry.get(name)
    except ToolNotFoundError as exc:
        return _error("unknown_tool", str(exc), str(name))
    try:
        args = tool.parse_arguments(raw)
    except ToolArgumentError as exc:
        return _error("invalid_arguments", str(exc), name)
    except Exception as exc:  # a custom parse_arguments that fails some other way
        return _error("invalid_arguments", f"arguments for tool {name!r}: {type(exc).__name__}: {exc}", name)
    limit = tool.timeout_s if timeout_s is None else timeout_s
    try:
        with anyio.move_on_after(limit) as scope:
            return await tool.execute(await instance(tool), args)
        return _timeout(tool, limit)
    except Exception as exc:
        if not scope.cancelled_caught:
            return _error("tool_exception", f"tool {name!r} raised {type(exc).__name__}: {exc}", name)
        return _timeout(tool, limit)


def _timeout(tool: BaseTool, limit: float | None) -> ToolResult:
    if isinstance(tool, FunctionTool) and not tool.is_async and tool.run_in == "thread":
        log.warning(  # the thread cannot be stopped: say so once per timeout, for whoever reads the logs
            "tool thread abandoned",
            tool=tool.name,
            hint="it runs on until the function returns; function_tool(run_in='process') stops it at the deadline",
        )
    return _error("timeout", f"tool {tool.name!r} did not finish within {limit:g} s", tool.name)


async def execute_tool_call(
    registry: ToolRegistry,
    name: str,
    raw_arguments: str | Mapping[str, Any] | None,
    *,
    timeout_s: float | None = None,
) -> ToolResult:
    """Run one call in a fresh instance (create, execute, release); never raises on tool faults.

    Unknown tool, bad arguments, an exception or a timeout (`timeout_s`, else the tool's own)
    come back as a ToolResult with text ``"Error: ..."``, reward None and ``metrics["error"]``.
    """
    created: list[tuple[BaseTool, str]] = []

    async def instance(tool: BaseTool) -> str:
        created.append((tool, await tool.create()))
        return created[-1][1]

    try:
        return await _safe_call(registry, name, raw_arguments, timeout_s, instance)
    finally:
        with anyio.CancelScope(shield=True):
            for tool, iid in created:
                await _release_quietly(tool, iid)


async def _release_quietly(tool: BaseTool, iid: str) -> None:
    try:
        await tool.release(iid)
    except Exception as exc:
        log.error("tool release failed", tool=tool.name, error=f"{type(exc).__name__}: {exc}")


class RegistrySession:
    """The tools of one trajectory (see `ToolRegistry.session`)."""

    def __init__(self, registry: ToolRegistry, create_kwargs: dict[str, Any]) -> None:
        self.registry = registry
        self.create_kwargs = create_kwargs
        self.instances: dict[str, str] = {}  # tool name -> instance id
        self._lock = anyio.Lock()  # parallel calls to one tool share a single create

    async def _instance(self, tool: BaseTool) -> str:
        async with self._lock:
            if tool.name not in self.instances:
                self.instances[tool.name] = await tool.create(**self.create_kwargs)
        return self.instances[tool.name]

    async def call(
        self, name: str, raw_arguments: str | Mapping[str, Any] | None, *, timeout_s: float | None = None
    ) -> ToolResult:
        """Like execute_tool_call, but reusing this trajectory's instance of the tool."""
        return await _safe_call(self.registry, name, raw_arguments, timeout_s, self._instance)

    async def release_all(self) -> None:
        for name, iid in list(self.instances.items()):
            await _release_quietly(self.registry.get(name), iid)
        self.instances.clear()
