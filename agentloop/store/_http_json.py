"""The store server's JSON in and out: request body models, JSON answers and error answers."""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from starlette.responses import Response

from agentloop.types import JSON, AttemptStatus, ErrorInfo, RolloutConfig, RolloutMode


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class EnqueueBody(_Body):
    input: JSON
    mode: RolloutMode = "train"
    config: RolloutConfig | None = None
    metadata: dict[str, JSON] | None = None


class DequeueBody(_Body):
    worker_id: str | None = None


class UpdateAttemptBody(_Body):
    status: AttemptStatus | None = None
    error: ErrorInfo | None = None
    heartbeat: bool = False


class WaitBody(_Body):
    rollout_ids: list[str]
    timeout: float = Field(ge=0, description="Seconds; the server waits at most MAX_WAIT_S.")


class ListBody(_Body):
    status: list[str] | None = None
    limit: int | None = Field(None, ge=0)


class _HTTPError(Exception):
    def __init__(self, status: int, type_: str, message: str) -> None:
        super().__init__(message)
        self.status, self.type, self.message = status, type_, message


def _error(status: int, type_: str, message: str) -> Response:
    body = orjson.dumps({"error": {"message": message, "type": type_}})
    return Response(body, status_code=status, media_type="application/json")


def _json(value: Any, adapter: TypeAdapter[Any] | None = None) -> Response:
    if adapter is not None:
        data = adapter.dump_json(value)
    elif isinstance(value, BaseModel):
        data = value.__pydantic_serializer__.to_json(value)
    elif value is None:
        data = b"null"
    else:
        data = orjson.dumps(value)
    return Response(data, media_type="application/json")


def _validation_message(exc: ValidationError) -> tuple[int, str, str]:
    errs = exc.errors(include_url=False, include_input=False)
    if any(e["type"] == "json_invalid" for e in errs):
        return 400, "invalid_json", f"request body is not valid JSON: {errs[0]['msg']}"
    parts = [f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in errs[:10]]
    return 422, "invalid_request", "invalid request: " + "; ".join(parts)
