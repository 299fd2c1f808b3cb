"""Resources handed to agents: LLM endpoints, versioned together."""

from __future__ import annotations

import time
import zlib
from collections.abc import Iterator, KeysView, Mapping, ValuesView
from typing import Annotated, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Resource(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LLM(_Resource):
    """An OpenAI-compatible endpoint an agent talks to."""

    resource_type: Literal["llm"] = "llm"
    base_url: str = Field(description="OpenAI-compatible base URL, ending in /v1.")
    model: str = Field(description="Model name sent in requests.")
    api_key: str = Field(
        default="EMPTY",
        repr=False,
        description="Bearer token; the proxy accepts anything unless it has a key.",
    )
    sampling: dict[str, Any] = Field(default_factory=dict, description="Default sampling parameters.")


class _HasAttempt(Protocol):
    @property
    def rollout_id(self) -> str: ...

    @property
    def attempt(self) -> Any: ...


_PLACEHOLDERS = ("{rollout_id}", "{attempt_id}")


class ProxyLLM(_Resource):
    """An LLM behind the agentloop proxy; its URL template is resolved per rollout attempt."""

    resource_type: Literal["proxy_llm"] = "proxy_llm"
    url_template: str = Field(description="URL with the placeholders {rollout_id} and {attempt_id}.")
    worker_url_templates: list[str] = Field(
        default_factory=list,
        description="The proxy's worker processes' URL templates (Proxy(workers=N)); when set, each rollout's "
        "calls go to one of them, picked from its rollout id, so a conversation stays with one worker.",
    )
    model: str
    api_key: str = Field(
        default="EMPTY",
        repr=False,  # kept out of logs that print the resource; the trainer's proxy sets a key per run
        description="Bearer token of the proxy, handed to the agent as llm.api_key.",
    )
    sampling: dict[str, Any] = Field(default_factory=dict)
    enforce_sampling: bool = Field(
        default=False,
        description="The proxy applies this sampling's temperature, top_p and top_k even when a request "
        "sets its own (the trainer's validation: greedy whatever the agent asks).",
    )

    @field_validator("url_template")
    @classmethod
    def _has_placeholders(cls, value: str) -> str:
        missing = [p for p in _PLACEHOLDERS if p not in value]
        if missing:
            raise ValueError(f"url_template must contain {' and '.join(_PLACEHOLDERS)}; missing {missing}")
        return value

    @field_validator("worker_url_templates")
    @classmethod
    def _each_has_placeholders(cls, value: list[str]) -> list[str]:
        for template in value:
            cls._has_placeholders(template)
        return value

    def serves(self, url_template: str | None) -> bool:
        """Whether ``url_template`` is this resource's (the proxy's own or one of its workers')."""
        return url_template is not None and (
            url_template == self.url_template or url_template in self.worker_url_templates
        )

    def get_base_url(self, rollout_id: str, attempt_id: str) -> str:
        """The base URL for one attempt of one rollout."""
        if not rollout_id or not attempt_id:
            raise ValueError(
                f"rollout_id and attempt_id must be non-empty, got {rollout_id!r}, {attempt_id!r}"
            )
        template = self.url_template
        if self.worker_url_templates:  # crc32, not hash(): every process picks the same worker
            template = self.worker_url_templates[
                zlib.crc32(rollout_id.encode()) % len(self.worker_url_templates)
            ]
        return template.replace("{rollout_id}", rollout_id).replace("{attempt_id}", attempt_id)

    def resolve(self, rollout: _HasAttempt) -> LLM:
        """A plain LLM pointed at this attempt's URL (``rollout`` is an AttemptedRollout)."""
        url = self.get_base_url(rollout.rollout_id, rollout.attempt.attempt_id)
        return LLM(base_url=url, model=self.model, api_key=self.api_key, sampling=dict(self.sampling))


Resource = Annotated[LLM | ProxyLLM, Field(discriminator="resource_type")]


class Resources(_Resource):
    """A named set of resources; the store gives each added set the next version number.

    It reads as a mapping of names to resources, as code ported from Agent Lightning expects:
    ``latest["main_llm"]``, ``"main_llm" in latest``, ``for name in latest``, ``latest.get(name)``,
    ``latest.keys()``/``values()``, ``dict(latest)``; ``latest.resources`` is that dict (Agent Lightning's
    ``ResourcesUpdate.resources``). Trap: ``items`` is the field holding that dict, not a method, so
    iterate pairs with ``latest.items.items()``. A Resources is true even when empty (None means none).
    """

    version: int | None = Field(default=None, description="Assigned by the store on add_resources.")
    items: dict[str, Resource] = Field(default_factory=dict, description="The resources by name.")
    created_at: float = Field(default_factory=time.time, description="When this set was made (epoch s).")

    @property
    def resources(self) -> dict[str, LLM | ProxyLLM]:
        """The resources by name (``items``), under Agent Lightning's name for them."""
        return self.items

    def __getitem__(self, name: str) -> LLM | ProxyLLM:
        try:
            return self.items[name]
        except KeyError:
            raise KeyError(
                f"no resource named {name!r} in version {self.version}; have {sorted(self.items)}"
            ) from None

    def __contains__(self, name: object) -> bool:
        return name in self.items

    def __iter__(self) -> Iterator[str]:  # type: ignore[override]  # names, as a mapping (not pydantic's pairs)
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def __bool__(self) -> bool:
        return True  # as before __len__ existed: `if resources:` tests for None, not for an empty set

    def get(self, name: str, default: Any = None) -> Any:
        """The resource named ``name``, or ``default``."""
        return self.items.get(name, default)

    def keys(self) -> KeysView[str]:
        return self.items.keys()

    def values(self) -> ValuesView[LLM | ProxyLLM]:
        return self.items.values()

    def get_llm(self, name: str | None = None) -> LLM | ProxyLLM:
        """The LLM named ``name``, or the only/first LLM when no name is given."""
        llms = {k: v for k, v in self.items.items() if isinstance(v, LLM | ProxyLLM)}
        if name is not None:
            if name not in llms:
                raise KeyError(f"no LLM resource named {name!r}; have {sorted(llms)}")
            return llms[name]
        if not llms:
            raise KeyError(f"resources version {self.version} hold no LLM; have {sorted(self.items)}")
        return next(iter(llms.values()))


# What add_resources takes: a Resources, or a mapping of names to resources (Agent Lightning's
# ``add_resources({"main_llm": LLM(...)})``); dicts of the same shapes are accepted at run time too.
ResourcesLike = Resources | Mapping[str, LLM | ProxyLLM]
