"""JSON schemas and argument validation for tools, inferred from a function's signature.

``signature_spec(fn)`` reads type hints and a Google-style docstring once, at decoration
time, and returns the tool's description, its JSON schema and a pydantic model that
validates (and coerces) the arguments a model sends. Errors from that model are rewritten
into short sentences a model can act on: ``argument 'x': expected integer, got 'abc'``.

Type mapping (anything else falls back to pydantic's own schema when it needs no ``$ref``)::

    str / int / float / bool   -> {"type": "string" | "integer" | "number" | "boolean"}
    list[T]                    -> {"type": "array", "items": T}
    dict[str, T]               -> {"type": "object", "additionalProperties": T}
    Optional[X] / X | None     -> {"type": [X, "null"]}  (or anyOf when X has no single type)
    Literal[...] / Enum        -> {"type": ..., "enum": [...]}
    pydantic model             -> {"type": "object", "properties": ..., "required": [...]} (inlined)
"""

from __future__ import annotations

import enum
import inspect
import json
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, create_model
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined, to_jsonable_python

from agentloop.errors import ToolArgumentError, ToolDefinitionError

__all__ = [
    "SignatureSpec",
    "decode_arguments",
    "format_validation_error",
    "parse_docstring",
    "signature_spec",
    "type_schema",
    "validate_against_schema",
]

_SECTION = re.compile(
    r"^(Args|Arguments|Parameters|Params|Keyword Args|Keyword Arguments|Returns?|Yields?|Raises|"
    r"Examples?|Notes?|Attributes|See Also|Todo|Warnings?|References)\s*:\s*$"
)
_ARG_SECTIONS = {"Args", "Arguments", "Parameters", "Params", "Keyword Args", "Keyword Arguments"}
_ARG_LINE = re.compile(r"^\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
_PRIMITIVES: dict[type, str] = {str: "string", bool: "boolean", int: "integer", float: "number"}


# ---------------------------------------------------------------- docstrings


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """Split a Google-style docstring into (summary, {parameter: description}).

    The summary is the first paragraph joined into one line. Under ``Args:`` each
    ``name (type): text`` line starts a parameter; more-indented lines continue it.
    """
    if not doc:
        return "", {}
    lines = inspect.cleandoc(doc).splitlines()
    summary: list[str] = []
    i = 0
    while i < len(lines) and lines[i].strip() and not _SECTION.match(lines[i].strip()):
        summary.append(lines[i].strip())
        i += 1
    params: dict[str, str] = {}
    section: str | None = None
    arg_indent: int | None = None
    current: str | None = None
    for line in lines[i:]:
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        header = _SECTION.match(stripped)
        if header and (arg_indent is None or indent < arg_indent):
            section, arg_indent, current = header.group(1), None, None
            continue
        if section not in _ARG_SECTIONS or not stripped:
            continue
        if arg_indent is None:
            arg_indent = indent
        match = _ARG_LINE.match(stripped)
        if indent <= arg_indent and match:
            current = match.group(1)
            params[current] = match.group(2).strip()
        elif indent > arg_indent and current is not None:  # continuation of a multi-line description
            params[current] = f"{params[current]} {stripped}".strip()
        else:
            section, current = None, None  # unindented prose ends the section
    return " ".join(summary), params


# ---------------------------------------------------------------- type -> JSON schema


def _where(fn_name: str, param: str) -> str:
    return f"function_tool {fn_name!r}, parameter {param!r}"


def _literal_schema(values: tuple[Any, ...]) -> dict[str, Any]:
    kinds = set()
    for v in values:
        kind = next((name for tp, name in _PRIMITIVES.items() if type(v) is tp), None)
        kinds.add("null" if v is None else kind)
    if None in kinds:
        return {"enum": list(values)}
    if len(kinds) == 1:
        return {"type": kinds.pop(), "enum": list(values)}
    return {"type": sorted(kinds), "enum": list(values)}


def _model_schema(model: type[BaseModel], where: str, seen: frozenset[type]) -> dict[str, Any]:
    if model in seen:
        raise ToolDefinitionError(f"{where}: recursive model {model.__name__} is not supported")
    properties: dict[str, Any] = {}
    required: list[str] = []
    for fname, field in model.model_fields.items():
        key = field.alias or fname
        prop = type_schema(field.annotation, f"{where} ({model.__name__}.{fname})", seen | {model})
        if field.description:
            prop["description"] = field.description
        if field.is_required():
            required.append(key)
        elif field.default is not PydanticUndefined:
            _set_default(prop, field.default)
        properties[key] = prop
    out: dict[str, Any] = {"type": "object", "properties": properties, "required": required}
    if model.__doc__ and "__doc__" in model.__dict__:
        out["description"] = inspect.cleandoc(model.__doc__).split("\n\n")[0].replace("\n", " ")
    return out


def type_schema(tp: Any, where: str = "type", seen: frozenset[type] = frozenset()) -> dict[str, Any]:
    """The JSON schema of one annotation; raises ToolDefinitionError naming `where` if unsupported."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return {}
    if tp is None or tp is type(None):
        return {"type": "null"}
    if origin is Annotated:
        return type_schema(args[0], where, seen)
    if isinstance(tp, type) and tp in _PRIMITIVES:
        return {"type": _PRIMITIVES[tp]}
    if origin is Literal:
        return _literal_schema(args)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _literal_schema(tuple(member.value for member in tp))
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return _model_schema(tp, where, seen)
    if tp is list or origin is list:
        return {"type": "array", "items": type_schema(args[0], where, seen)} if args else {"type": "array"}
    if tp is dict or origin is dict:
        if not args:
            return {"type": "object"}
        if args[0] is not str:
            raise ToolDefinitionError(f"{where}: dict keys must be str (JSON objects), got {args[0]!r}")
        return {"type": "object", "additionalProperties": type_schema(args[1], where, seen)}
    if origin is Union or origin is types.UnionType:
        members = [a for a in args if a is not type(None)]
        inner = (
            type_schema(members[0], where, seen)
            if len(members) == 1
            else {"anyOf": [type_schema(m, where, seen) for m in members]}
        )
        if len(members) == len(args):
            return inner
        if isinstance(inner.get("type"), str) and "enum" not in inner:
            return {**inner, "type": [inner["type"], "null"]}
        return {"anyOf": [inner, {"type": "null"}]}
    try:  # datetime, UUID, ...: whatever pydantic can describe without references
        schema = TypeAdapter(tp).json_schema()
    except Exception as exc:
        raise ToolDefinitionError(f"{where}: unsupported type {tp!r} ({exc})") from None
    if "$ref" in json.dumps(schema) or "$defs" in schema:
        raise ToolDefinitionError(f"{where}: unsupported type {tp!r}")
    schema.pop("title", None)
    return schema


def _set_default(prop: dict[str, Any], default: Any) -> None:
    try:
        prop["default"] = to_jsonable_python(default)
    except Exception:  # a default with no JSON form is left out of the schema, still applied on call
        pass


# ---------------------------------------------------------------- the whole signature


@dataclass(frozen=True)
class SignatureSpec:
    """What a function's signature says about its tool: description, schema, validator."""

    description: str
    parameters: dict[str, Any]  # the JSON schema of the arguments object
    arguments_model: type[BaseModel]  # validates and coerces a dict of arguments
    field_names: dict[str, str]  # parameter name -> the model's field name
    positional_only: tuple[str, ...]  # parameters that must be passed by position, in order


def signature_spec(fn: Callable[..., Any]) -> SignatureSpec:
    """Read `fn`'s signature and docstring; rejects *args, **kwargs and missing annotations."""
    name = getattr(fn, "__name__", repr(fn))
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise ToolDefinitionError(f"function_tool {name!r}: cannot read its signature ({exc})") from None
    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except Exception as exc:
        raise ToolDefinitionError(f"function_tool {name!r}: cannot resolve its type hints ({exc})") from None
    summary, docs = parse_docstring(fn.__doc__)
    properties: dict[str, Any] = {}
    required: list[str] = []
    fields: dict[str, Any] = {}
    field_names: dict[str, str] = {}
    positional_only: list[str] = []
    for i, (pname, param) in enumerate(sig.parameters.items()):
        where = _where(name, pname)
        if param.kind is param.VAR_POSITIONAL or param.kind is param.VAR_KEYWORD:
            star = "*" if param.kind is param.VAR_POSITIONAL else "**"
            raise ToolDefinitionError(
                f"{where}: {star}{pname} is not allowed; a tool takes named, annotated parameters only"
            )
        if pname not in hints:
            raise ToolDefinitionError(f"{where}: missing type annotation (write e.g. `{pname}: str`)")
        annotation = hints[pname]
        prop = type_schema(annotation, where)
        description = docs.get(pname) or _annotated_description(annotation)
        if description:
            prop["description"] = description
        if param.default is param.empty:
            required.append(pname)
        else:
            _set_default(prop, param.default)
        properties[pname] = prop
        default = ... if param.default is param.empty else param.default
        field_names[pname] = f"p{i}"  # aliases keep names like `model_config` or `_x` legal
        fields[f"p{i}"] = (annotation, Field(default, alias=pname))
        if param.kind is param.POSITIONAL_ONLY:
            positional_only.append(pname)
    model = create_model(  # type: ignore[call-overload]
        f"{name}_arguments", __config__=ConfigDict(extra="forbid", arbitrary_types_allowed=True), **fields
    )
    parameters = {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }
    return SignatureSpec(summary, parameters, model, field_names, tuple(positional_only))


def _annotated_description(annotation: Any) -> str | None:
    if typing.get_origin(annotation) is not Annotated:
        return None
    for meta in typing.get_args(annotation)[1:]:
        if isinstance(meta, str):
            return meta
        if isinstance(meta, FieldInfo) and meta.description:
            return meta.description
    return None


# ---------------------------------------------------------------- arguments from the model


def decode_arguments(raw: str | Mapping[str, Any] | None, tool_name: str) -> dict[str, Any]:
    """Raw arguments (a JSON string or a mapping) as a dict; empty or None means no arguments."""
    if raw is None:
        return {}
    if isinstance(raw, Mapping):
        return dict(raw)
    if not isinstance(raw, str):
        raise ToolArgumentError(
            f"arguments for tool {tool_name!r} must be a JSON object string or a dict, got {type(raw).__name__}"
        )
    if not raw.strip():
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ToolArgumentError(
            f"arguments for tool {tool_name!r} are not valid JSON ({exc.msg} at position {exc.pos}); "
            f'send a JSON object such as {{"name": value}}'
        ) from None
    if not isinstance(value, dict):
        raise ToolArgumentError(
            f"arguments for tool {tool_name!r} must be a JSON object, got {_json_type(value)}"
        )
    return value


_EXPECTED = [
    ("int_", "expected integer"),
    ("float_", "expected number"),
    ("bool_", "expected boolean"),
    ("string_type", "expected string"),
    ("list_type", "expected array"),
    ("dict_type", "expected object"),
    ("model_type", "expected object"),
    ("model_attributes_type", "expected object"),
]


def _got(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def format_validation_error(
    exc: ValidationError, tool_name: str, known: list[str], limit: int = 5
) -> ToolArgumentError:
    """Rewrite pydantic's errors as model-readable sentences, one per problem."""
    problems: list[str] = []
    for err in exc.errors()[:limit]:
        where, kind = _loc(err["loc"]), err["type"]
        if kind == "missing":
            problems.append(f"missing required argument {where!r}")
        elif kind == "extra_forbidden":
            problems.append(f"unexpected argument {where!r} (known arguments: {', '.join(known) or 'none'})")
        elif kind in ("literal_error", "enum"):
            problems.append(
                f"argument {where!r}: expected {err['ctx']['expected']}, got {_got(err['input'])}"
            )
        else:
            expected = next((text for prefix, text in _EXPECTED if kind.startswith(prefix)), None)
            if expected is None:
                msg = err["msg"]
                expected = msg[0].lower() + msg[1:]
            problems.append(f"argument {where!r}: {expected}, got {_got(err['input'])}")
    more = len(exc.errors()) - limit
    if more > 0:
        problems.append(f"and {more} more")
    return ToolArgumentError(f"invalid arguments for tool {tool_name!r}: " + "; ".join(problems))


# ---------------------------------------------------------------- a small JSON-schema check


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    for name, tps in _JSON_TYPES.items():
        if name != "number" and isinstance(value, tps):
            return name
    return "number" if isinstance(value, float) else type(value).__name__


def validate_against_schema(args: dict[str, Any], schema: Mapping[str, Any], tool_name: str) -> None:
    """Top-level checks for tools that only have a JSON schema: required, unknown names, types, enums."""
    props: Mapping[str, Any] = schema.get("properties") or {}
    problems = [f"missing required argument {k!r}" for k in schema.get("required", []) if k not in args]
    if schema.get("additionalProperties") is False:
        problems += [
            f"unexpected argument {k!r} (known arguments: {', '.join(props) or 'none'})"
            for k in args
            if k not in props
        ]
    for key, value in args.items():
        prop = props.get(key) or {}
        allowed = prop.get("type")
        allowed = [allowed] if isinstance(allowed, str) else (allowed or [])
        got = _json_type(value)
        fits = got in allowed or (got == "integer" and "number" in allowed)
        if allowed and not fits:
            problems.append(f"argument {key!r}: expected {' or '.join(allowed)}, got {_got(value)}")
        elif "enum" in prop and value not in prop["enum"]:
            options = " or ".join(repr(v) for v in prop["enum"])
            problems.append(f"argument {key!r}: expected {options}, got {_got(value)}")
    if problems:
        raise ToolArgumentError(f"invalid arguments for tool {tool_name!r}: " + "; ".join(problems))
