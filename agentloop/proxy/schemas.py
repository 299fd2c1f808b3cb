"""OpenAI request schemas and the OpenAI-style error the proxy answers with.

Requests are validated strictly (``"1"`` is not a number); unknown top-level OpenAI fields that
change nothing here (``user``, ``metadata``, penalties, ...) are accepted and ignored. A body nested
deeper than ``MAX_JSON_DEPTH`` is refused with a 400 before anything else reads it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from agentloop.types import MAX_ABS_REWARD

JSONDict = dict[str, Any]
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class ProxyError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> JSONDict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ProxyError:
    return ProxyError(400, message, "invalid_request_error", param, code)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "json-or-python"})


def _is_field(loc: int | str) -> bool:
    """pydantic puts union member tags (``str``, ``list[ContentPart]``) into ``loc``; skip them."""
    return isinstance(loc, int) or (loc.isidentifier() and loc not in _TYPE_TAGS)


def from_validation_error(exc: ValidationError, what: str) -> ProxyError:
    """The first pydantic error as a 400 naming the parameter (``messages.1.role``)."""
    err = exc.errors(include_url=False)[0]
    param = ".".join(str(p) for p in err["loc"] if _is_field(p)) or None
    got = err.get("input")
    got_text = f"; got {got!r:.80}" if not isinstance(got, dict | list) else ""
    return bad_request(f"invalid {what}: {param or 'body'}: {err['msg']}{got_text}", param=param)


class Strict(BaseModel):
    """Strict types (``"1"`` is not a number); unknown fields are kept and ignored."""

    model_config = ConfigDict(strict=True, extra="allow")


class FunctionCallIn(Strict):
    name: str
    arguments: str | JSONDict = "{}"


class ToolCallIn(Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ContentPart(Strict):
    type: str
    text: str | None = None


class ChatMessage(Strict):
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionSpec(Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: JSONDict | None = None


class ToolSpec(Strict):
    type: Literal["function"] = "function"
    function: FunctionSpec


class _SamplingFields(Strict):
    model: str | None = None
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = None
    stream: bool = False
    stream_options: JSONDict | None = None
    return_token_ids: bool = False

    @field_validator("max_tokens", "max_completion_tokens", check_fields=False)
    @classmethod
    def _positive(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError(f"must be a positive number of tokens, got {value}")
        return value

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise ValueError(f"only n=1 is supported (one sample per request), got {value}")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> str | list[str] | None:
        items = [value] if isinstance(value, str) else value or []
        if len(items) > 16 or any(not s for s in items):
            raise ValueError("stop takes at most 16 non-empty strings")
        return value

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | JSONDict | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    parallel_tool_calls: bool | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo=true is not supported")
        return value


class RewardRequest(Strict):
    """``{"value": 1.0}`` (or ``{"reward": 1.0}``, the usual first guess), with an optional ``name``;
    the value is finite and within +-MAX_ABS_REWARD (1e6), as every Reward span."""

    value: float = Field(allow_inf_nan=False)
    name: str | None = None

    @field_validator("value")
    @classmethod
    def _bounded(cls, value: float) -> float:
        if not -MAX_ABS_REWARD <= value <= MAX_ABS_REWARD:
            raise ValueError(f"a reward must be within +-{MAX_ABS_REWARD:g} (MAX_ABS_REWARD), got {value:g}")
        return value

    @model_validator(mode="before")
    @classmethod
    def _reward_alias(cls, data: Any) -> Any:
        if isinstance(data, dict) and "reward" in data:
            if "value" in data:
                raise ValueError('give the reward as "value" or as "reward", not both')
            data = {("value" if k == "reward" else k): v for k, v in data.items()}
        return data


# Deeper bodies get a 400. An OpenAI request is a few levels deep (a tool's JSON schema maybe 20);
# messages keep their extra fields and are recorded as they came, and the recorders' JSON encoders
# stop at 254 levels (orjson), so without this a 256-deep extra field lost the call with a 503.
MAX_JSON_DEPTH = 64


def json_too_deep(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether ``value`` nests dicts/lists more than ``limit`` levels (iterative: no recursion limit)."""
    if not isinstance(value, dict | list):
        return False
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return False


def parse_model(cls: type[BaseModel], body: Any, what: str) -> Any:
    """Validate a JSON body against ``cls``; a failure is a 400 naming the field."""
    if not isinstance(body, dict):
        raise bad_request(f"the {what} body must be a JSON object, got {type(body).__name__}")
    if json_too_deep(body):
        raise bad_request(
            f"the {what} body nests JSON more than {MAX_JSON_DEPTH} levels deep; flatten it",
            code="json_too_deep",
        )
    try:
        return cls.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc, what) from None
