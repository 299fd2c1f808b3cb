"""The tool contract (agentloop.tools.base): responses, a tool's checked spec and its lifecycle."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from pydantic import ValidationError

from agentloop.errors import ToolArgumentError, ToolDefinitionError
from agentloop.tools import ToolResponse, ToolResult, run_tool
from tests.tools.fixtures import Counter, Exploding

pytestmark = pytest.mark.anyio  # parametrized async tests need the marker at collection time


# ---------------------------------------------------------------- ToolResponse / ToolResult


def test_tool_response_needs_text_or_images() -> None:
    assert ToolResponse(text="").to_openai_content() == ""
    with pytest.raises(ValidationError, match="needs text"):
        ToolResponse()
    with pytest.raises(ValidationError, match="needs text"):
        ToolResponse(images=[])
    with pytest.raises(ValidationError, match=r"images\[1\] must be an http\(s\) URL"):
        ToolResponse(images=["https://x/a.png", "not an image!"])
    both = ToolResponse(text="see", images=["https://x/a.png", "iVBORw0KGgo="])
    assert both.to_openai_content() == [
        {"type": "text", "text": "see"},
        {"type": "image_url", "image_url": {"url": "https://x/a.png"}},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
    ]


# ---------------------------------------------------------------- lifecycle


async def test_session_reuses_one_instance_and_releases_it() -> None:
    counter = Counter(start=1)
    async with counter.session() as run:
        assert (await run.execute({"step": 2})).response.text == "3"
        assert (await run.execute('{"step": 4}')).reward == 7.0
        assert counter.counts == {run.instance_id: 7}
    assert counter.released == [run.instance_id] and counter.counts == {}
    async with counter.session(instance_id="mine") as run:
        assert run.instance_id == "mine"


async def test_release_runs_even_when_execute_raises() -> None:
    tool = Exploding()
    with pytest.raises(RuntimeError, match="boom in"):
        await run_tool(tool, {"step": 1})
    assert len(tool.created) == 1 and tool.released == tool.created

    with pytest.raises(ToolArgumentError):  # bad arguments: created, then released
        await run_tool(tool, {"step": "x"})
    assert tool.released == tool.created and len(tool.created) == 2


async def test_release_runs_when_the_caller_is_cancelled() -> None:
    class Slow(Counter):
        name = "slow"

        async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
            await anyio.sleep(10)
            raise AssertionError("not reached")

    tool = Slow()
    with anyio.fail_after(5), anyio.move_on_after(0.05):
        await run_tool(tool, {"step": 1})
    assert len(tool.created) == 1 and tool.released == tool.created


# ---------------------------------------------------------------- spec checks


def test_base_tool_subclasses_are_checked() -> None:
    class Nameless(Counter):
        name = None  # type: ignore[assignment]

    class FlatParams(Counter):
        name = "flat"
        parameters = {"type": "array"}

    with pytest.raises(ToolDefinitionError, match=r"Nameless: tool name must be 1-64 characters.*got None"):
        Nameless()
    with pytest.raises(
        ToolDefinitionError, match="tool 'flat': parameters must be a JSON schema dict with \"type\""
    ):
        FlatParams()
    with pytest.raises(ToolDefinitionError, match="timeout_s must be a positive number or None, got -1"):
        Counter(timeout_s=-1)
    assert (
        Counter(timeout_s=None).timeout_s is None
        and Counter(name="c2").openai_schema()["function"]["name"] == "c2"
    )
