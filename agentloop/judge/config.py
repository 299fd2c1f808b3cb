"""The ``reward:`` section of an ``agentloop train`` job file: the judge a run is rewarded by.

::

    reward:
      judge:
        rubric: |
          - The right answer scores 1, a wrong or missing one 0.
        base_url: null              # null: the served model judges; else an OpenAI-compatible /v1 URL
        model: null                 # the external judge's model name (required with base_url)
        api_key: env:JUDGE_API_KEY  # env:NAME, file:PATH or the key
        on_failure: skip

Every key but ``rubric`` is a ``RewardJudge`` option of the same name; ``task_text`` names a function
(``file.py:name`` or ``module:name``, as ``agent`` does), which the command imports. Without a
``reward`` section (or with ``judge: null``) the agent's own rewards train the model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from agentloop.judge.prompt import DEFAULT_RUBRIC
from agentloop.judge.reward import RewardJudge
from agentloop.keys import KeyRef
from agentloop.resources import LLM

__all__ = ["JudgeConfig", "RewardConfig", "RewardSection"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class JudgeConfig(_Section):
    """An LLM judge that scores each task's group of attempts relative to each other."""

    rubric: str = Field(default=DEFAULT_RUBRIC, description="What makes one trajectory better than another.")
    base_url: str | None = Field(
        default=None, description="The judge's OpenAI-compatible URL (ending in /v1); null: the served model."
    )
    model: str | None = Field(default=None, description="The judge's model name; required with base_url.")
    api_key: KeyRef = Field(
        default=None, description="The judge endpoint's key: env:NAME, file:PATH or the key; null: none."
    )
    max_retries: int = Field(
        default=2, ge=0, description="Requests after a malformed answer; then JudgeError."
    )
    timeout_s: float = Field(default=300.0, gt=0, description="Deadline of one judge request (seconds).")
    max_tokens: int = Field(default=1024, ge=16, description="The judge's answer budget (tokens).")
    max_chars: int = Field(
        default=6000, ge=200, description="Each trajectory cut to this (head and tail kept)."
    )
    task_text: str | None = Field(
        default=None,
        description="file.py:name or module:name of a function task -> text shown to the judge; null: the task's JSON.",
    )
    cache_file: str | None = Field(
        default=None, description="A JSON-lines verdict cache; null: judge.jsonl in the run folder."
    )
    concurrency: int = Field(default=4, ge=1, description="Groups judged at once.")
    on_failure: Literal["raise", "skip"] = Field(
        default="raise", description="A group the judge cannot score: raise (stop the run) or skip it."
    )
    name: str = Field(default="judge", min_length=1, description="The Reward span name of its scores.")
    extra_body: dict[str, Any] = Field(
        default_factory=dict, description="Extra request fields, e.g. {response_format: {type: json_object}}."
    )

    @field_validator("rubric")
    @classmethod
    def _rubric(cls, v: str) -> str:
        if not v.strip():
            raise ValueError(f"must say what makes one trajectory better than another, got {v!r}")
        return v

    @model_validator(mode="after")
    def _endpoint(self) -> JudgeConfig:
        if self.base_url is not None and not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {self.base_url!r}")
        if self.base_url is not None and not self.model:
            raise ValueError(
                f"model is required with base_url ({self.base_url}): the model name that endpoint serves"
            )
        given = [k for k in ("model", "api_key") if getattr(self, k) is not None]
        if self.base_url is None and given:
            raise ValueError(
                f"{' and '.join(given)} set without base_url: set base_url for an external judge, or "
                "leave them out to judge with the served model"
            )
        return self

    def llm(self) -> LLM | None:
        """The external judge endpoint, or None (the served model)."""
        if self.base_url is None:
            return None
        key = self.api_key.get_secret_value() if self.api_key is not None else "EMPTY"
        return LLM(base_url=self.base_url, model=str(self.model), api_key=key)

    def build(self, task_text: Callable[[Any], str] | None = None) -> RewardJudge:
        """The RewardJudge these settings describe (``task_text``: the function the spec names)."""
        options = self.model_dump(exclude={"rubric", "base_url", "model", "api_key", "task_text"})
        return RewardJudge(self.rubric, self.llm(), task_text=task_text, **options)


class RewardConfig(_Section):
    """The job file's ``reward`` section."""

    judge: JudgeConfig | None = Field(
        default=None, description="An LLM judge rewards the attempts; null: the agent's own rewards."
    )


class RewardSection(_Section):
    """A job file's ``reward`` key alone, validated from the top so that errors name ``reward.judge.KEY``."""

    reward: RewardConfig | None = Field(default=None, description="The reward section; null: none.")
