"""The proxy's route handlers (``Routes``): the model routes under both prefixes and the session routes."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import orjson
import structlog
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from agentloop.proxy import anthropic, anthropic_output, openai_responses, responses, responses_output
from agentloop.proxy.access import AppKeys, Caller, check_browser, check_json
from agentloop.proxy.bearer_auth import BearerAuth, unauthorized
from agentloop.proxy.disconnect import ClientWatch
from agentloop.proxy.http_io import (
    ErrorShape,
    error_response,
    json_response,
    request_key,
    sse_response,
    want_ids,
)
from agentloop.proxy.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    ProxyError,
    RewardRequest,
    bad_request,
    parse_model,
)
from agentloop.proxy.service import ProxyService, Target
from agentloop.proxy.sessions import new_session_id, session_not_found, valid_session_id
from agentloop.types import Reward

log = structlog.get_logger("agentloop.proxy")

SESSION_HEADER = "x-session-id"
CODEX_SESSION_HEADER = "session-id"


Handler = Callable[[Request, Target, dict[str, str]], Awaitable[Response]]


class Routes:
    """The routes' handlers and what they share: the service, who may call (``auth``: the per-attempt
    routes; ``access``: the session routes) and the request body's limits."""

    def __init__(
        self,
        service: ProxyService,
        *,
        auth: BearerAuth,
        access: AppKeys,
        max_body_bytes: int,
        body_timeout_s: float,
        bound_host: str | None,
    ) -> None:
        self.service, self.auth, self.access = service, auth, access
        self.max_body_bytes, self.body_timeout_s, self.bound_host = max_body_bytes, body_timeout_s, bound_host

    def app_caller(self, request: Request) -> Caller:
        """The caller of an app-facing route: 401 without an accepted key; 403 from a web page (another
        origin, or a foreign Host on loopback); 415 for a POST that is not JSON."""
        caller = self.access.caller(request)
        if caller is None:
            raise unauthorized()
        check_browser(request, self.bound_host)
        check_json(request)
        return caller

    async def read_json(self, request: Request) -> Any:
        max_body_bytes, body_timeout_s = self.max_body_bytes, self.body_timeout_s
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
            raise ProxyError(
                413, f"the body has {declared} bytes; the limit is {max_body_bytes}", code="request_too_large"
            )
        chunks, size = [], 0
        try:
            with anyio.fail_after(body_timeout_s):  # also the server's body deadline (http_limits)
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > max_body_bytes:
                        raise ProxyError(
                            413,
                            f"the body exceeds the limit of {max_body_bytes} bytes",
                            code="request_too_large",
                        )
                    chunks.append(chunk)
        except TimeoutError:
            raise ProxyError(
                408, f"the body did not arrive within {body_timeout_s:g}s", code="request_timeout"
            ) from None
        except ClientDisconnect:  # gone (or cut off by the server's body deadline): nobody to answer
            raise ProxyError(
                408, "the client disconnected before its body arrived", code="request_timeout"
            ) from None
        try:
            return orjson.loads(b"".join(chunks))
        except orjson.JSONDecodeError as exc:
            raise bad_request(f"the body is not valid JSON: {exc}") from None

    def session_target(self, request: Request) -> tuple[Target, dict[str, str]]:
        caller = self.app_caller(request)
        # Codex CLI names its thread in a ``session-id`` header: its calls then form one session
        sid = (
            request.headers.get(SESSION_HEADER)
            or request.headers.get(CODEX_SESSION_HEADER)
            or new_session_id()
        )
        if not valid_session_id(sid):
            raise bad_request(
                f"{SESSION_HEADER} must be 1-128 characters of [A-Za-z0-9._:-], got {sid!r:.60}"
            )
        held = self.service.sessions.get(sid)
        if held is not None and not caller.may_use(held.owner):  # another key's session: as if unknown
            raise session_not_found(sid)
        return Target(session_id=sid, owner=caller.owner, admin=caller.admin), {"X-Session-Id": sid}

    def guarded(
        self, handler: Handler, session: bool, shape: ErrorShape = ProxyError.body
    ) -> Callable[..., Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            headers: dict[str, str] = {}
            try:
                if session:
                    target, headers = self.session_target(request)
                else:
                    if not self.auth.allows(request):
                        raise unauthorized()
                    params = request.path_params
                    target = Target(rollout_id=params["rollout_id"], attempt_id=params["attempt_id"])
                return await handler(request, target, headers)
            except ProxyError as exc:
                return error_response(exc, headers, shape)
            except Exception as exc:  # never a 500: log it and say the service is unavailable
                log.exception("unexpected proxy error", path=request.url.path, error=repr(exc)[:300])
                return error_response(
                    ProxyError(503, f"internal proxy error: {type(exc).__name__}", "service_unavailable"),
                    headers,
                    shape,
                )

        return endpoint

    # ------------------------------------------------------------ the model routes (both prefixes)

    async def chat(self, request: Request, target: Target, headers: dict[str, str]) -> Response:
        service = self.service
        body = await self.read_json(request)
        req: ChatCompletionRequest = parse_model(ChatCompletionRequest, body, "chat completion request")
        with ClientWatch(request.receive) as client:
            gen = await service.chat(
                target, req, body["messages"], request_key=request_key(request), client_gone=client.gone
            )
        ids, lps = want_ids(request, body), bool(req.logprobs)
        if req.stream:
            chunks = responses.chat_chunks(gen, service.tokenizer, lps, ids, req.include_usage)
            return sse_response(chunks, headers)
        return json_response(responses.chat_json(gen, service.tokenizer, lps, ids), headers)

    async def completions(self, request: Request, target: Target, headers: dict[str, str]) -> Response:
        service = self.service
        body = await self.read_json(request)
        req: CompletionRequest = parse_model(CompletionRequest, body, "completion request")
        with ClientWatch(request.receive) as client:
            gen = await service.complete(
                target, req, request_key=request_key(request), client_gone=client.gone
            )
        ids, lps = want_ids(request, body), req.logprobs is not None
        if req.stream:
            return sse_response(
                responses.completion_chunks(gen, service.tokenizer, ids, req.include_usage), headers
            )
        return json_response(responses.completion_json(gen, service.tokenizer, lps, ids), headers)

    async def messages(self, request: Request, target: Target, headers: dict[str, str]) -> Response:
        service = self.service
        body = await self.read_json(request)
        req, chat_req, chat_messages = anthropic.parse(body)
        with ClientWatch(request.receive) as client:
            gen = await service.chat(
                target, chat_req, chat_messages, request_key=request_key(request), client_gone=client.gone,
                any_model=req.model.startswith("claude"),
            )  # fmt: skip
        ids, stops = want_ids(request, body), req.stop_sequences or []
        if req.stream:
            return sse_response(
                anthropic_output.message_events(gen, service.tokenizer, stops, ids, req.thinks), headers
            )
        return json_response(
            anthropic_output.message_json(gen, service.tokenizer, stops, ids, req.thinks), headers
        )

    async def count_tokens(self, request: Request, target: Target, headers: dict[str, str]) -> Response:
        service = self.service
        body = await self.read_json(request)
        chat_req = anthropic.parse_count(body)
        if not str(chat_req.model).startswith("claude"):
            service.check_model(target, chat_req.model)
        await service.check_live(target)
        return json_response(orjson.dumps({"input_tokens": service.count_prompt_tokens(chat_req)}), headers)

    async def responses_api(self, request: Request, target: Target, headers: dict[str, str]) -> Response:
        service = self.service
        body = await self.read_json(request)
        parsed = openai_responses.parse(body, service.responses, target.key)
        with ClientWatch(request.receive) as client:
            gen = await service.chat(
                target,
                parsed.chat,
                parsed.messages,
                request_key=request_key(request),
                client_gone=client.gone,
            )
        answer = responses_output.answer(gen, parsed)
        responses_output.keep(answer, service.responses, target.key)
        ids = want_ids(request, body)
        if parsed.req.stream:
            return sse_response(responses_output.response_events(answer, service.tokenizer, ids), headers)
        return json_response(responses_output.response_json(answer, service.tokenizer, ids), headers)

    async def models(self, request: Request, target: Target, headers: dict[str, str]) -> Response:
        service = self.service
        if target.session_id is None:
            await service.check_live(target)
        card = {"id": service.model_name, "object": "model", "created": int(time.time()), "owned_by": "agentloop",
                "max_model_len": service.engine.max_context}  # fmt: skip
        return json_response(orjson.dumps({"object": "list", "data": [card]}), headers)

    # ------------------------------------------------------------ the session routes

    async def post_reward(self, request: Request) -> Response:
        session_id = request.path_params["session_id"]
        try:
            caller = self.app_caller(request)
            body = await self.read_json(request)
            req: RewardRequest = parse_model(RewardRequest, body, "reward")
            rec = await self.service.add_session_reward(
                session_id, Reward(value=req.value, name=req.name), caller.owner, any_owner=caller.admin
            )
            return json_response(orjson.dumps({"session_id": session_id, "num_calls": len(rec.calls),
                                       "rewards": [r.model_dump() for r in rec.rewards]}))  # fmt: skip
        except ProxyError as exc:
            return error_response(exc)

    async def get_session(self, request: Request) -> Response:
        session_id = request.path_params["session_id"]
        try:
            caller = self.app_caller(request)
        except ProxyError as exc:
            return error_response(exc)
        rec = self.service.sessions.get(session_id)
        if rec is None or not caller.may_use(rec.owner):  # another key's session: as if unknown
            return error_response(session_not_found(session_id))
        return json_response(orjson.dumps(rec.to_json()))

    async def list_sessions(self, request: Request) -> Response:
        try:
            caller = self.app_caller(request)
        except ProxyError as exc:
            return error_response(exc)
        data = [rec.summary() for rec in self.service.sessions.records() if caller.may_use(rec.owner)]
        return json_response(orjson.dumps({"object": "list", "data": data}))
