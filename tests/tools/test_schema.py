"""Schema inference from type hints and docstrings, and argument parsing (agentloop.tools.schema)."""

from __future__ import annotations

import datetime
import enum
from typing import Annotated, Any, Literal, Optional

import pytest
from pydantic import BaseModel, Field

from agentloop.errors import ToolArgumentError, ToolDefinitionError
from agentloop.tools import BaseTool, ToolResult, function_tool
from agentloop.tools.schema import parse_docstring, type_schema
from tests.tools.fixtures import Counter, add


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


class Point(BaseModel):
    x: float
    y: float = Field(0.0, description="Vertical position.")


class Shape(BaseModel):
    """A named polygon."""

    name: str
    points: list[Point]
    center: Point | None = None


class Opaque:
    """Not a type pydantic can describe."""


class Node(BaseModel):
    child: Node | None = None


def obj(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


# ---------------------------------------------------------------- types


def test_primitives_are_required_without_defaults() -> None:
    @function_tool
    def f(s: str, i: int, x: float, b: bool) -> str:
        return ""

    assert f.parameters == obj(
        {
            "s": {"type": "string"},
            "i": {"type": "integer"},
            "x": {"type": "number"},
            "b": {"type": "boolean"},
        },
        ["s", "i", "x", "b"],
    )


def test_containers() -> None:
    @function_tool
    def f(xs: list[int], m: dict[str, float], nested: list[dict[str, bool]], anything: list, d: dict) -> str:
        return ""

    assert f.parameters["properties"] == {
        "xs": {"type": "array", "items": {"type": "integer"}},
        "m": {"type": "object", "additionalProperties": {"type": "number"}},
        "nested": {"type": "array", "items": {"type": "object", "additionalProperties": {"type": "boolean"}}},
        "anything": {"type": "array"},
        "d": {"type": "object"},
    }


def test_optional_forms_and_defaults() -> None:
    @function_tool
    def f(
        a: Optional[int],  # noqa: UP045 - the typing spelling is part of what we test
        b: str | None = None,
        c: list[str] | None = None,
        d: Literal["x", "y"] | None = "x",
        e: int = 3,
        g: Color = Color.GREEN,
        h: list[int] = [1, 2],  # noqa: B006 - a default shown in the schema
    ) -> str:
        return ""

    assert f.parameters == obj(
        {
            "a": {"type": ["integer", "null"]},
            "b": {"type": ["string", "null"], "default": None},
            "c": {"type": ["array", "null"], "items": {"type": "string"}, "default": None},
            "d": {"anyOf": [{"type": "string", "enum": ["x", "y"]}, {"type": "null"}], "default": "x"},
            "e": {"type": "integer", "default": 3},
            "g": {"type": "string", "enum": ["red", "green"], "default": "green"},
            "h": {"type": "array", "items": {"type": "integer"}, "default": [1, 2]},
        },
        ["a"],  # Optional without a default is still required
    )


def test_literal_and_enum() -> None:
    @function_tool
    def f(
        mode: Literal["fast", "slow"], n: Literal[1, 2, 3], mixed: Literal["a", 1], color: Color, level: Level
    ) -> str:
        return ""

    assert f.parameters["properties"] == {
        "mode": {"type": "string", "enum": ["fast", "slow"]},
        "n": {"type": "integer", "enum": [1, 2, 3]},
        "mixed": {"type": ["integer", "string"], "enum": ["a", 1]},
        "color": {"type": "string", "enum": ["red", "green"]},
        "level": {"type": "integer", "enum": [1, 2]},
    }


def test_nested_pydantic_model_is_inlined() -> None:
    @function_tool
    def draw(shape: Shape, scale: float | int = 1) -> str:
        """Draw a shape.

        Args:
            shape: What to draw.
        """
        return ""

    point = {
        "type": "object",
        "properties": {
            "x": {"type": "number"},
            "y": {"type": "number", "description": "Vertical position.", "default": 0.0},
        },
        "required": ["x"],
    }
    assert draw.parameters == obj(
        {
            "shape": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "points": {"type": "array", "items": point},
                    "center": {**point, "type": ["object", "null"], "default": None},
                },
                "required": ["name", "points"],
                "description": "What to draw.",  # the Args entry wins over the model's docstring
            },
            "scale": {"anyOf": [{"type": "number"}, {"type": "integer"}], "default": 1},
        },
        ["shape"],
    )
    assert type_schema(Shape)["description"] == "A named polygon."


def test_other_types_fall_back_to_pydantic_and_annotated_gives_descriptions() -> None:
    @function_tool
    def f(
        when: datetime.date,
        anything: Any,
        k: Annotated[int, "How many."],
        j: Annotated[str, Field(description="J.")],
    ) -> str:
        return ""

    assert f.parameters["properties"] == {
        "when": {"type": "string", "format": "date"},
        "anything": {},
        "k": {"type": "integer", "description": "How many."},
        "j": {"type": "string", "description": "J."},
    }


def test_postponed_annotations_resolve() -> (
    None
):  # tests/tools/fixtures.py uses `from __future__ import annotations`
    assert add.parameters == obj(
        {
            "a": {"type": "integer", "description": "The first addend."},
            "b": {"type": "integer", "description": "The second addend.", "default": 0},
        },
        ["a"],
    )
    assert add.openai_schema() == {
        "type": "function",
        "function": {"name": "add", "description": "Add two integers.", "parameters": add.parameters},
    }


# ---------------------------------------------------------------- docstrings


def test_google_docstring_summary_and_multiline_args() -> None:
    @function_tool
    def search(query: str, limit: int = 5, exact: bool = False) -> str:
        """Search the documentation
        for a phrase.

        A longer explanation that is not part of the description.

        Args:
            query (str): The phrase to look for. It may span
                several lines and they are joined
                with single spaces.
            limit (int, optional): At most this many hits.

            exact: Match the phrase exactly.

        Returns:
            str: The hits, one per line.

        Raises:
            ValueError: never.
        """
        return ""

    assert search.description == "Search the documentation for a phrase."
    props = search.parameters["properties"]
    assert props["query"]["description"] == (
        "The phrase to look for. It may span several lines and they are joined with single spaces."
    )
    assert props["limit"] == {"type": "integer", "description": "At most this many hits.", "default": 5}
    assert props["exact"]["description"] == "Match the phrase exactly."


@pytest.mark.parametrize(
    ("doc", "expected"),
    [
        (None, ("", {})),
        ("One line.", ("One line.", {})),
        (
            "Summary.\n\nArguments:\n    a: First.\n    b: Second\n        continued.\n",
            ("Summary.", {"a": "First.", "b": "Second continued."}),
        ),
        ("Args:\n    a: Only args.", ("", {"a": "Only args."})),
        ("S.\n\nArgs:\n    a: A.\n\nReturns:\n    b: not a parameter.", ("S.", {"a": "A."})),
        ("S.\n\nArgs:\n    a: A.\nTrailing prose ends the section.\n    b: ignored.", ("S.", {"a": "A."})),
    ],
)
def test_parse_docstring(doc: str | None, expected: tuple[str, dict[str, str]]) -> None:
    assert parse_docstring(doc) == expected


def test_no_docstring_and_overrides() -> None:
    @function_tool(name="renamed", description="Told, not inferred.")
    def f(a: int) -> int:
        return a

    assert f.name == "renamed"
    assert f.openai_schema()["function"] == {
        "name": "renamed",
        "description": "Told, not inferred.",
        "parameters": f.parameters,
    }

    @function_tool
    def g() -> str:
        return ""

    assert g.openai_schema() == {"type": "function", "function": {"name": "g", "parameters": obj({}, [])}}


# ---------------------------------------------------------------- rejected signatures


def test_rejects_varargs_kwargs_and_missing_annotations() -> None:
    def star(a: int, *rest: int) -> None: ...
    def kw(a: int, **options: str) -> None: ...
    def bare(a: int, b) -> None: ...  # type: ignore[no-untyped-def]

    with pytest.raises(ToolDefinitionError, match=r"'star', parameter 'rest': \*rest is not allowed"):
        function_tool(star)
    with pytest.raises(ToolDefinitionError, match=r"'kw', parameter 'options': \*\*options is not allowed"):
        function_tool(kw)
    with pytest.raises(ToolDefinitionError, match=r"'bare', parameter 'b': missing type annotation"):
        function_tool(bare)


def test_rejects_unusable_types_and_values() -> None:
    def int_keys(m: dict[int, str]) -> None: ...
    def opaque(o: Opaque) -> None: ...
    def recursive(n: Node) -> None: ...

    with pytest.raises(ToolDefinitionError, match=r"'int_keys', parameter 'm': dict keys must be str"):
        function_tool(int_keys)
    with pytest.raises(ToolDefinitionError, match=r"'opaque', parameter 'o': unsupported type"):
        function_tool(opaque)
    with pytest.raises(ToolDefinitionError, match="recursive model Node"):
        function_tool(recursive)

    def local_type(p: LocalPoint) -> None: ...  # type: ignore[name-defined]  # noqa: F821

    with pytest.raises(ToolDefinitionError, match="'local_type': cannot resolve its type hints"):
        function_tool(local_type)
    with pytest.raises(ToolDefinitionError, match="expects a function, got int"):
        function_tool(3)  # type: ignore[call-overload]
    with pytest.raises(ToolDefinitionError, match="tool name must be 1-64 characters"):
        function_tool(name="has space")(lambda: "")


# ---------------------------------------------------------------- parse_arguments


@function_tool
def configure(
    count: int,
    ratio: float = 0.5,
    verbose: bool = False,
    color: Color = Color.RED,
    shape: Shape | None = None,
) -> str:
    """Configure something."""
    return ""


def test_parse_arguments_coerces_types() -> None:
    args = configure.parse_arguments('{"count": "5", "ratio": 2, "verbose": "true", "color": "green"}')
    assert args == {"count": 5, "ratio": 2.0, "verbose": True, "color": Color.GREEN, "shape": None}
    assert isinstance(args["ratio"], float)
    nested = configure.parse_arguments(
        {"count": 1, "shape": {"name": "tri", "points": [{"x": 1}, {"x": "2", "y": 3}]}}
    )
    assert nested["shape"] == Shape(name="tri", points=[Point(x=1), Point(x=2, y=3)])
    assert configure.parse_arguments(nested) == nested  # parsing is idempotent


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ('{"count": "abc"}', "argument 'count': expected integer, got 'abc'"),
        (
            '{"count": 1.5}',
            "argument 'count': expected integer, got 1.5",
        ),
        ('{"count": 1, "ratio": "half"}', "argument 'ratio': expected number, got 'half'"),
        ('{"count": 1, "verbose": "maybe"}', "argument 'verbose': expected boolean, got 'maybe'"),
        ('{"count": 1, "color": "blue"}', "argument 'color': expected 'red' or 'green', got 'blue'"),
        ("{}", "missing required argument 'count'"),
        (
            '{"count": 1, "colour": "red"}',
            "unexpected argument 'colour' (known arguments: count, ratio, verbose, color, shape)",
        ),
        (
            '{"count": 1, "shape": {"name": "t", "points": [{"x": 0}, {"x": "?"}]}}',
            "argument 'shape.points[1].x': expected number, got '?'",
        ),
        ('{"count": 1, "shape": "square"}', "argument 'shape': expected object, got 'square'"),
        (
            '{"count": 1',
            "arguments for tool 'configure' are not valid JSON (Expecting ',' delimiter at position 11)",
        ),
        ("[1, 2]", "arguments for tool 'configure' must be a JSON object, got array"),
    ],
)
def test_parse_arguments_errors_read_well(raw: str, message: str) -> None:
    with pytest.raises(ToolArgumentError) as info:
        configure.parse_arguments(raw)
    assert message in str(info.value)


def test_parse_arguments_edge_inputs() -> None:
    @function_tool
    def ping() -> str:
        return "pong"

    assert ping.parse_arguments("") == {} and ping.parse_arguments(None) == {}
    with pytest.raises(ToolArgumentError, match="must be a JSON object string or a dict, got int"):
        ping.parse_arguments(5)  # type: ignore[arg-type]
    with pytest.raises(ToolArgumentError) as info:  # every problem is listed, not just the first
        configure.parse_arguments('{"shape": {}}')
    assert str(info.value) == (
        "invalid arguments for tool 'configure': missing required argument 'count'; "
        "missing required argument 'shape.name'; missing required argument 'shape.points'"
    )


def test_schema_only_tools_check_required_unknown_and_types() -> None:
    tool = Counter()
    assert tool.parse_arguments('{"step": 2}') == {"step": 2}
    with pytest.raises(ToolArgumentError) as info:
        tool.parse_arguments('{"stp": "x"}')
    assert str(info.value) == (
        "invalid arguments for tool 'counter': missing required argument 'step'; "
        "unexpected argument 'stp' (known arguments: step)"
    )
    with pytest.raises(ToolArgumentError, match="argument 'step': expected integer, got 'two'"):
        tool.parse_arguments({"step": "two"})

    class Pick(BaseTool):
        name = "pick"
        parameters = {
            "type": "object",
            "properties": {"c": {"type": "string", "enum": ["a", "b"]}, "w": {"type": ["number", "null"]}},
        }

        async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
            raise NotImplementedError

    assert Pick().parse_arguments({"c": "a", "w": 1}) == {"c": "a", "w": 1}
    assert Pick().parse_arguments({"w": None}) == {"w": None}
    with pytest.raises(ToolArgumentError, match="argument 'c': expected 'a' or 'b', got 'z'"):
        Pick().parse_arguments({"c": "z"})
