"""The MCP boundary's conversions: the model's arguments checked against a tool's ``inputSchema``
(JSON Schema, ``jsonschema``; no ``$ref`` fetched from the network; its regular expressions matched
within a time budget, :mod:`agentloop.tools._bounded_patterns`) before anything is sent, and an
MCP ``CallToolResult`` turned into agentloop's ``ToolResult`` (text, images as data: URLs, bounded).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import jsonschema
from mcp import types
from referencing import Registry

from agentloop.errors import ToolArgumentError, ToolDefinitionError
from agentloop.logging import get_logger
from agentloop.tools import _bounded_patterns
from agentloop.tools.base import ToolResponse, ToolResult
from agentloop.tools.mcp_connection import short

__all__ = ["ERROR_META", "check_arguments", "error_result", "result_from_mcp", "schema_validator"]

log = get_logger("agentloop.tools.mcp")

ERROR_META = "agentloop/error"  # the _meta key of an error result MCPTool.call made: the kind of fault
_MAX_PROBLEMS = 5  # argument problems named in one error message


def _where(path: Sequence[Any]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _problem(err: jsonschema.ValidationError) -> str:
    where, kind, instance = _where(err.absolute_path), err.validator, err.instance
    field = f"argument {where!r}" if where else "arguments"
    if kind == "required" and isinstance(instance, dict):
        missing = [r for r in err.validator_value if r not in instance]
        names = ", ".join(repr(m) for m in missing)
        return (
            f"missing required argument {names}" if not where else f"{field}: missing required field {names}"
        )
    if kind == "additionalProperties" and isinstance(instance, dict) and isinstance(err.schema, dict):
        known = list(err.schema.get("properties") or {})
        extra = [k for k in instance if k not in known]
        return (
            f"unexpected {'argument' if not where else f'field in {where!r}:'} "
            f"{', '.join(repr(e) for e in extra)} (known: {', '.join(known) or 'none'})"
        )
    if kind == "type":
        expected = (
            err.validator_value if isinstance(err.validator_value, str) else " or ".join(err.validator_value)
        )
        return f"{field}: expected {expected}, got {short(json.dumps(instance, default=repr), 80)}"
    if kind == "enum":
        return f"{field}: expected {' or '.join(json.dumps(v, default=repr) for v in err.validator_value)}, got {short(json.dumps(instance, default=repr), 80)}"
    return f"{field}: {short(err.message, 200)}"


def check_arguments(
    validator: jsonschema.protocols.Validator,
    arguments: dict[str, Any],
    tool_name: str,
    budget_s: float = _bounded_patterns.DEFAULT_BUDGET_S,
) -> None:
    """Raise ToolArgumentError naming up to five problems of ``arguments`` against the tool's schema.

    The schema's patterns share ``budget_s`` of matching time (a match past it is a problem); the
    rest is linear in the arguments. Blocks: MCPTool runs it in a thread, within the call's deadline."""
    with _bounded_patterns.budget(budget_s):
        errors = sorted(
            validator.iter_errors(arguments),
            key=lambda e: (len(e.absolute_path), list(map(str, e.absolute_path))),
        )
    if not errors:
        return
    problems = list(dict.fromkeys(_problem(e) for e in errors))
    more = len(problems) - _MAX_PROBLEMS
    text = "; ".join(problems[:_MAX_PROBLEMS]) + (f"; and {more} more" if more > 0 else "")
    raise ToolArgumentError(f"invalid arguments for tool {tool_name!r}: {text}")


def schema_validator(schema: dict[str, Any], tool_name: str, server: str) -> jsonschema.protocols.Validator:
    """A validator of ``schema`` (its own draft, Draft 2020-12 by default, its patterns matched within a
    time budget); ToolDefinitionError if it is invalid or cannot be checked within a budget."""
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ToolDefinitionError(
            f"MCP server {server!r}: tool {tool_name!r} has an invalid inputSchema ({short(exc.message, 200)}); "
            "leave it out with include=[...]"
        ) from None
    unbounded = _bounded_patterns.refuse_unbounded(schema)
    if unbounded:
        raise ToolDefinitionError(
            f"MCP server {server!r}: tool {tool_name!r} has an inputSchema agentloop cannot check safely "
            f"({unbounded}); leave it out with include=[...]"
        )
    bounded = _bounded_patterns.extend(cls)
    return bounded(schema, registry=Registry())  # type: ignore[no-any-return]  # an empty registry: no $ref is fetched


def result_from_mcp(
    result: types.CallToolResult, tool_name: str, max_output_chars: int | None = None
) -> ToolResult:
    """An MCP tool result as a ToolResult: text blocks joined, images as data: URLs, the rest described.

    ``isError`` results become ``"Error: ..."`` with ``metrics["error"] = "tool_error"``. Text past
    ``max_output_chars`` is cut (marked), and images that do not fit what is left are replaced by a note.
    """
    budget = max_output_chars if max_output_chars is not None else float("inf")
    texts: list[str] = []
    images: list[str] = []
    for block in result.content:
        if isinstance(block, types.TextContent):
            texts.append(block.text)
        elif isinstance(block, types.ImageContent) and block.mimeType.startswith("image/"):
            images.append(f"data:{block.mimeType};base64,{block.data}")
        elif isinstance(block, types.EmbeddedResource):
            res = block.resource
            if isinstance(res, types.TextResourceContents):
                texts.append(res.text)
            elif (res.mimeType or "").startswith("image/"):
                images.append(f"data:{res.mimeType};base64,{res.blob}")
            else:
                texts.append(f"[resource {res.uri} omitted: {res.mimeType or 'binary data'}]")
        elif isinstance(block, types.ResourceLink):
            texts.append(f"[resource {block.uri}{f' ({block.name})' if block.name else ''}]")
        else:
            texts.append(f"[{block.type} content omitted: {getattr(block, 'mimeType', None) or 'no type'}]")
    if not texts and not images and result.structuredContent is not None:
        texts.append(json.dumps(result.structuredContent, ensure_ascii=False))
    text = "\n".join(texts)
    metrics: dict[str, Any] = {}
    if len(text) > budget:
        dropped = len(text) - int(budget)
        text = text[: int(budget)] + f"... [truncated {dropped} chars]"
        metrics["truncated_chars"] = dropped
    kept: list[str] = []
    used = len(text)
    for image in images:
        if used + len(image) <= budget:
            kept.append(image)
            used += len(image)
        else:
            text += f"\n[image omitted: {len(image)} chars over the {max_output_chars} char output limit]"
            metrics["images_omitted"] = metrics.get("images_omitted", 0) + 1
    if result.isError:
        metrics["error"] = (result.meta or {}).get(ERROR_META, "tool_error")
        text = text if text.startswith("Error") else f"Error: {text or f'tool {tool_name!r} failed'}"
    return ToolResult(response=ToolResponse(text=text, images=kept or None), metrics=metrics)


def error_result(kind: str, message: str, tool: str) -> types.CallToolResult:
    """An ``isError`` result for a fault MCPTool.call caught (logged), its kind under ``_meta``."""
    log.warning("mcp tool call failed", tool=tool, error=kind, message=message[:200])
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=f"Error: {message}")],
        isError=True,
        _meta={ERROR_META: kind},
    )
