"""add_resources takes a Resources or a mapping of names to resources (as Agent Lightning users pass it),
on every backend; any other shape is an error that shows the expected one (issue 17)."""

from __future__ import annotations

from typing import Any

import pytest

from agentloop.errors import InvalidRequestError
from agentloop.resources import LLM, ProxyLLM, Resources
from agentloop.store.base import Store

pytestmark = pytest.mark.anyio

LLM_ = LLM(base_url="http://host/v1", model="m")
PROXY = ProxyLLM(url_template="http://p/rollout/{rollout_id}/attempt/{attempt_id}/v1", model="m")


async def test_a_mapping_of_names_to_resources_is_accepted(store: Store) -> None:
    assert await store.add_resources({"main_llm": LLM_}) == 1
    assert await store.add_resources({"main_llm": LLM_, "judge": PROXY}) == 2
    assert await store.add_resources({"main_llm": LLM_.model_dump(mode="json")}) == 3  # the dict of an LLM
    assert await store.add_resources(Resources(items={"main_llm": LLM_})) == 4  # as before
    assert await store.add_resources({"items": {"main_llm": LLM_}}) == 5  # a Resources-shaped dict, as before
    first, second, third, fourth, fifth = [await store.get_resources(v) for v in range(1, 6)]
    assert first.items == third.items == fourth.items == fifth.items == {"main_llm": LLM_}
    assert second.items == {"main_llm": LLM_, "judge": PROXY} and second.get_llm("judge") == PROXY
    latest = await store.get_latest_resources()
    assert latest is not None and latest.version == 5 and latest.get_llm().model == "m"


EXPECTED = (
    "resources must be a Resources, or a mapping of names to resources such as "
    "{'main_llm': LLM(base_url='http://host/v1', model='m')} (LLM or ProxyLLM values)"
)


@pytest.mark.parametrize(
    ("given", "problem"),
    [
        ([LLM_], f"{EXPECTED}; got list: [LLM("),
        ("main_llm", f"{EXPECTED}; got str: 'main_llm'"),
        ({"main_llm": "http://host/v1"}, "resources['main_llm'] must be an LLM or ProxyLLM (or a dict with "),
        ({"main_llm": {"base_url": "x", "model": "m"}}, "the dict has no resource_type (keys: ['base_url', "),
        ({"main_llm": {"resource_type": "llm", "model": "m"}}, "base_url: Field required; resources must be"),
        ({"main_llm": LLM_, "items": {}}, "resources['items'] must be an LLM or ProxyLLM"),
    ],
)
async def test_any_other_shape_shows_the_expected_one(store: Store, given: Any, problem: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        await store.add_resources(given)
    assert problem in str(info.value) and EXPECTED in str(info.value)
    assert await store.get_latest_resources() is None  # nothing was added


async def test_resources_read_back_as_a_mapping_as_ported_code_reads_them(store: Store) -> None:
    """Agent Lightning code reads ``store.get_latest_resources()["main_llm"]`` or ``.resources[...]``
    (issue 46, item 10), on every backend (the HTTP client gives back a Resources too)."""
    await store.add_resources({"main_llm": LLM_, "judge": PROXY})
    latest = await store.get_latest_resources()
    assert latest is not None
    assert latest["main_llm"] == LLM_ and latest.resources["judge"] == PROXY
    assert "main_llm" in latest and "other" not in latest
    assert list(latest) == ["main_llm", "judge"] and len(latest) == 2
    assert dict(latest) == {"main_llm": LLM_, "judge": PROXY}
    assert list(latest.keys()) == ["main_llm", "judge"] and list(latest.values()) == [LLM_, PROXY]
    assert latest.get("judge") == PROXY and latest.get("other") is None and latest.get("other", 1) == 1
    with pytest.raises(
        KeyError, match=r"no resource named 'other' in version 1; have \['judge', 'main_llm'\]"
    ):
        latest["other"]
    assert Resources()  # empty is still true: `if resources:` tests for None, as before
    assert Resources(items={"main_llm": LLM_}).model_dump()["items"] == {"main_llm": LLM_.model_dump()}
