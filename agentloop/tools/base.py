"""The tool contract: BaseTool, what a call returns (ToolResponse, ToolResult), and its lifecycle.

A tool lives per trajectory: ``create`` makes an instance (a sandbox, a DB connection, a
counter), ``execute`` runs one call in it, ``release`` frees it. ``tool.session()`` pairs
create with release, and release runs even when execute raises or the caller is cancelled::

    async with tool.session() as run:
        result = await run.execute('{"a": 1, "b": 2}')   # parsed, checked, run; errors propagate

Tools made from typed functions are in ``agentloop.tools.function``; registries and calls that
never raise (``execute_tool_call``) in ``agentloop.tools.registry``.
"""

from __future__ import annotations

import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import anyio
from pydantic import BaseModel, ConfigDict, Field, model_validator

from agentloop.errors import ToolDefinitionError
from agentloop.tools.schema import decode_arguments, validate_against_schema

__all__ = ["DEFAULT_TIMEOUT_S", "BaseTool", "ToolResponse", "ToolResult", "ToolSession", "run_tool"]

DEFAULT_TIMEOUT_S = 60.0  # a tool call that takes longer is reported to the model as timed out
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
