"""What one request does, independent of HTTP: check the attempt, build the prompt, generate, record.

Order for a chat request: the attempt is live (else 404/409) -> canonical messages -> token
ledger (delta or full render) -> context check -> ``engine.generate`` under a timeout ->
decode, cut stop strings, parse tool calls -> one LLMCall span in the store (or the session) ->
ledger entry. Every failure is a ``ProxyError`` with an HTTP status; nothing here hangs.

A client retry is not a second training sample. Two mechanisms, both at the HTTP layer's choice:

- ``request_key`` (the app passes the ``Idempotency-Key`` or ``X-Request-Id`` header): the first
  request with a key generates and records once; a request with the same key on the same attempt or
  session, while the first runs or up to ``RequestReplays.ttl_s`` after, gets the first one's answer
  (same id, same tokens) and records nothing. The same key with a different request is a 409.
  A keyed call runs to its end even when its client leaves: the retry collects the answer.
- ``client_gone`` (the app passes ``ClientWatch.gone``, disconnect.py), for requests without a key: a client
  that closed its connection (an openai client timing out does) aborts the generation, and a call
  whose client left before its answer was ready is not recorded (and not added to the ledger), so
  the retry that follows is the only sample. The narrow race left (the client leaves after the
  check, while the answer is being written) is what ``request_key`` closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import orjson
import structlog

from agentloop.engine.base import InferenceEngine, SamplingParams, TokenOutput, mixed_versions
from agentloop.errors import (
    ContextLengthExceededError,
    EngineError,
    NotFoundError,
    RequestAbortedError,
    StaleAttemptError,
)
from agentloop.proxy.chat import ChatTemplate, canonical_message, canonical_response, tool_dicts
from agentloop.proxy.detok import text_decoder
from agentloop.proxy.ledger import TokenLedger
from agentloop.proxy.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    JSONDict,
    ProxyError,
    bad_request,
)
from agentloop.proxy.sessions import SessionRecord, SessionTable
from agentloop.proxy.tool_parser import parse_tool_calls
from agentloop.resources import ProxyLLM
from agentloop.store.base import Store
from agentloop.types import LLMCall, Reward, Span

log = structlog.get_logger("agentloop.proxy")
T = TypeVar("T")
ClientGone = Callable[[], Awaitable[bool]]  # true once the HTTP client has closed its connection
DISCONNECT_POLL_S = 0.5  # how often a running generation asks whether its client is still there

_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "seed", "max_tokens", "stop")
_ENFORCEABLE = ("temperature", "top_p", "top_k")  # what an enforce_sampling resource fixes
_ENFORCED = "__enforced__"  # marks the LLM defaults of a resource with enforce_sampling


@dataclass(frozen=True)
class Target:
    """Where a call is recorded: one rollout attempt, or one app session."""

    rollout_id: str | None = None
    attempt_id: str | None = None
    session_id: str | None = None

    @property
    def key(self) -> str:
        return f"session/{self.session_id}" if self.session_id else f"{self.rollout_id}/{self.attempt_id}"


@dataclass
class Generation:
    """A finished generation, ready to be written as JSON or as SSE chunks."""

    id: str
    created: int
    model: str
    prompt_ids: list[int]
    token_ids: list[int]  # exactly what the engine produced (end-of-turn id included)
    logprobs: list[float] | None
    text_ids: list[int]  # token_ids without a final end-of-turn id: the ids that make the text
    content: str | None
    tool_calls: list[JSONDict] = field(default_factory=list)
    finish_reason: str = "stop"

    @property
    def usage(self) -> JSONDict:
        n, m = len(self.prompt_ids), len(self.token_ids)
        return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}


def client_gone_error() -> ProxyError:
    # 499 (nginx's "client closed request"): nobody reads it; it ends the request without a record
    return ProxyError(
        499, "the client closed the connection before the answer was ready; the call was not recorded",
        code="client_closed",
    )  # fmt: skip


@dataclass
class _Replay:
    fingerprint: bytes
    done: anyio.Event
    created: float
    result: Generation | None = None


class RequestReplays:
    """The answers of calls made with an idempotency key, per attempt or session (module docstring).

    Bounded: an answer is kept ``ttl_s`` seconds (a client retries within its own timeout, minutes),
    and at most ``max_ids`` token ids over all answers are kept (oldest dropped first); a retry after
    its answer was dropped is generated and recorded afresh.
    """

    def __init__(
        self, ttl_s: float = 600.0, max_ids: int = 4_000_000, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl_s, self.max_ids, self.clock = ttl_s, max_ids, clock
        self._entries: OrderedDict[tuple[str, str], _Replay] = OrderedDict()
        self._ids = 0  # token ids held by finished entries

    def __len__(self) -> int:
        return len(self._entries)

    def _drop(self, key: tuple[str, str]) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None and entry.result is not None:
            self._ids -= len(entry.result.prompt_ids) + len(entry.result.token_ids)

    def _sweep(self) -> None:
        cutoff = self.clock() - self.ttl_s
        while self._entries:
            key, entry = next(iter(self._entries.items()))
            if entry.created >= cutoff and self._ids <= self.max_ids:
                break
            self._drop(key)

    async def run(
        self, key: tuple[str, str], fingerprint: bytes, make: Callable[[], Awaitable[Generation]]
    ) -> Generation:
        """The answer already given under ``key``, the one being made (awaited), or ``make()``'s."""
        self._sweep()
        while (entry := self._entries.get(key)) is not None:
            if entry.fingerprint != fingerprint:
                raise ProxyError(
                    409,
                    f"the idempotency key {key[1]!r:.80} was used for a different request; "
                    "use a new key for a new request",
                    "conflict_error",
                    code="idempotency_key_reused",
                )
            if entry.result is None:
                await entry.done.wait()  # the first try is still running (bounded by the engine timeout)
            if entry.result is not None:
                log.info("replayed a retried request", key=key[0])
                return entry.result
            # the first try failed and was forgotten: this one runs (unless another waiter already does)
        mine = _Replay(fingerprint, anyio.Event(), self.clock())
        self._entries[key] = mine
        try:
            mine.result = await make()
        except BaseException:
            if self._entries.get(key) is mine:
                del self._entries[key]
            raise
        finally:
            mine.done.set()
        if self._entries.get(key) is mine:
            self._ids += len(mine.result.prompt_ids) + len(mine.result.token_ids)
            self._sweep()
        return mine.result


def _fingerprint(*parts: Any) -> bytes:
    """A digest of what a request asks for (a reused key must come with the same request)."""
    return hashlib.blake2b(orjson.dumps(parts, default=str), digest_size=16).digest()


def context_error(n_prompt: int, limit: int) -> ProxyError:
    return ProxyError(
        400,
        f"this model's maximum context length is {limit} tokens; the prompt has {n_prompt} tokens "
        "(shorten the messages)",
        param="messages",
        code="context_length_exceeded",
    )


class ProxyService:
    """The proxy's logic; the FastAPI app (app.py) only parses HTTP and writes responses."""

    def __init__(
        self,
        engine: InferenceEngine,
        store: Store,
        *,
        model_name: str,
        model_aliases: tuple[str, ...] = (),
        template: ChatTemplate,
        ledger: TokenLedger,
        sessions: SessionTable,
        engine_timeout_s: float,
        store_timeout_s: float,
        default_max_tokens: int,
        default_sampling: dict[str, Any],
    ) -> None:
        self.engine, self.store, self.model_name = engine, store, model_name
        self.model_names = frozenset((model_name, *model_aliases))  # what a session request may name
        self.template, self.ledger, self.sessions = template, ledger, sessions
        self.tokenizer = template.tokenizer
        self._decode = text_decoder(self.tokenizer)  # = tokenizer.decode(ids, skip_special_tokens=True)
        self.engine_timeout_s, self.store_timeout_s = engine_timeout_s, store_timeout_s
        self.default_max_tokens, self.default_sampling = default_max_tokens, dict(default_sampling)
        self.url_template: str | None = None  # set by Proxy once the port is known
        self._stop_ids = frozenset(template.stop_token_ids)
        # embedding matrices are often padded past the tokenizer (Qwen: +271 rows); beyond that, a mismatch
        self._id_bound = len(self.tokenizer) + 1024
        self._llm_defaults: dict[int, dict[str, Any]] = {}  # resources version -> the LLM's sampling
        self.replays = RequestReplays()  # answers of requests that carried an idempotency key
        # a session dropped from the table (TTL, caps, taken by a trainer) takes its token ledger along
        sessions.on_drop = lambda session_id: ledger.forget(Target(session_id=session_id).key)

    # ------------------------------------------------------------ store access

    @contextlib.contextmanager
    def _store_errors(self, what: str) -> Iterator[None]:
        """One timeout for a group of store calls; store errors become 404 / 409 / 503.

        The timeout is ``anyio.fail_after`` written out (a cancel scope that a timer cancels): one
        generator context manager per store call instead of two, ~9 us less event-loop CPU, and this
        runs twice per request."""
        try:
            with anyio.CancelScope() as scope:
                timer = asyncio.get_running_loop().call_later(self.store_timeout_s, scope.cancel)
                try:
                    yield
                finally:
                    timer.cancel()
            if scope.cancelled_caught:
                raise TimeoutError
        except NotFoundError as exc:
            raise ProxyError(404, str(exc), "not_found_error", code="not_found") from None
        except StaleAttemptError as exc:
            raise ProxyError(409, str(exc), "conflict_error", code="stale_attempt") from None
        except TimeoutError:
            raise ProxyError(
                503, f"the store did not answer {what} within {self.store_timeout_s}s", "store_error"
            ) from None
        except ProxyError:
            raise
        except Exception as exc:
            log.error("store call failed", what=what, error=repr(exc)[:300])
            raise ProxyError(
                503, f"the store failed on {what}: {type(exc).__name__}", "store_error"
            ) from None

    def check_model(self, target: Target, model: str | None) -> None:
        """Session requests name the served model (or its alias, or none); else 404 as OpenAI answers.
        Per-attempt requests may name anything: the agent's LLM resource chose the name."""
        if target.session_id is None or model is None or model in self.model_names:
            return
        raise ProxyError(
            404,
            f"the model {model!r} does not exist; this server serves {self.model_name!r} (GET /v1/models)",
            param="model",
            code="model_not_found",
        )

    async def check_live(self, target: Target) -> dict[str, Any]:
        """404 for an unknown rollout/attempt, 409 for a finished or superseded one; the LLM's defaults."""
        if target.session_id is not None:
            return {}
        rid, aid = target.rollout_id, target.attempt_id
        with self._store_errors("get_rollout_attempt"):  # one store call (was get_rollout + get_attempt)
            rollout, attempt = await self.store.get_rollout_attempt(rid, aid)  # type: ignore[arg-type]
        if attempt.status.is_terminal:
            raise ProxyError(
                409,
                f"attempt {aid} already finished as {attempt.status.value}",
                "conflict_error",
                code="stale_attempt",
            )
        if attempt.sequence_id < rollout.num_attempts or rollout.status.is_terminal:
            raise ProxyError(
                409,
                f"attempt {aid} (#{attempt.sequence_id}) of rollout {rid} was superseded "
                f"(rollout is {rollout.status.value}, {rollout.num_attempts} attempts)",
                "conflict_error",
                code="stale_attempt",
            )
        version = rollout.resources_version
        if version is None:
            return {}
        if version not in self._llm_defaults:
            with self._store_errors("get_resources"):
                resources = await self.store.get_resources(version)
            llms = [v for v in resources.items.values() if hasattr(v, "sampling")]
            mine = [v for v in llms if isinstance(v, ProxyLLM) and v.serves(self.url_template)]
            chosen = mine[0] if mine else (llms[0] if len(llms) == 1 else None)
            defaults = dict(chosen.sampling) if chosen is not None else {}
            if getattr(chosen, "enforce_sampling", False):
                defaults[_ENFORCED] = True
            self._llm_defaults[version] = defaults
        return self._llm_defaults[version]

    async def record(self, target: Target, fields: dict[str, Any]) -> None:
        """Validate the call's fields once as an LLMCall and write it to the store (or the session)."""
        call = LLMCall(**fields)
        if target.session_id is not None:
            if not self.sessions.add_call(target.session_id, call):
                log.warning("session call not recorded: over the session's byte cap", key=target.key)
            with self._store_errors("saving the session call"):
                await self.sessions.flush()
            return
        assert target.rollout_id is not None and target.attempt_id is not None
        span = Span(
            rollout_id=target.rollout_id, attempt_id=target.attempt_id, sequence_id=None, payload=call
        )
        with self._store_errors("add_span"):
            await self.store.add_span(span)

    async def add_session_reward(self, session_id: str, reward: Reward) -> SessionRecord:
        """Record an app session's reward and wait until the store saved it (404: unknown session,
        409: too many rewards, 503: the store failed)."""
        try:
            rec = self.sessions.add_reward(session_id, reward)
        except KeyError:
            raise ProxyError(404, f"session {session_id!r} not found (no calls recorded under it)",
                             "not_found_error", code="not_found") from None  # fmt: skip
        with self._store_errors("saving the session reward"):
            await self.sessions.flush()
        return rec

    # ------------------------------------------------------------ sampling and the engine

    def sampling(
        self, req: ChatCompletionRequest | CompletionRequest, llm: dict[str, Any], n_prompt: int
    ) -> SamplingParams:
        merged = {k: v for k, v in {**self.default_sampling, **llm}.items() if k in _SAMPLING_KEYS}
        enforced = {k for k in _ENFORCEABLE if k in llm} if llm.get(_ENFORCED) else set()
        for key in ("temperature", "top_p", "top_k", "seed"):
            value = getattr(req, key)
            if value is not None and key not in enforced:
                merged[key] = value
        requested = getattr(req, "max_completion_tokens", None) or req.max_tokens
        max_tokens = requested or merged.get("max_tokens") or self.default_max_tokens
        # the resource's max_tokens is the training limit: a ceiling over the request's, not a default
        ceiling = llm.get("max_tokens")
        if isinstance(ceiling, int) and ceiling >= 1:
            max_tokens = min(max_tokens, ceiling)
        room = self.engine.max_context - n_prompt
        if room < 1:
            raise context_error(n_prompt, self.engine.max_context)
        stop = req.stop_list or merged.get("stop") or []
        merged.update(
            max_tokens=min(max_tokens, room),
            stop=[stop] if isinstance(stop, str) else list(stop),
            stop_token_ids=list(self.template.stop_token_ids),
            logprobs=True,  # always: the trainer needs the behaviour logprobs
        )
        try:
            return SamplingParams(**merged)
        except ValueError as exc:
            raise bad_request(
                f"invalid sampling parameters (request merged over the LLM's defaults): {exc}"
            ) from None

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        routing_key: str | None = None,
        client_gone: ClientGone | None = None,
    ) -> TokenOutput:
        """One engine call under the engine timeout; aborted in the engine when it times out, is
        cancelled, or (``client_gone``) its client leaves (then 499, see ``client_gone_error``)."""
        # "<routing key>/req-<random>": engine replica pools keep one attempt's calls on one replica
        request_id = (f"{routing_key}/" if routing_key else "") + "req-" + secrets.token_hex(8)
        try:
            with anyio.fail_after(self.engine_timeout_s):
                work = self.engine.generate(prompt_ids, sampling, request_id=request_id)
                got = await (work if client_gone is None else _unless_gone(work, client_gone))
        except anyio.get_cancelled_exc_class():
            await self._abort(request_id)
            raise
        except TimeoutError:
            await self._abort(request_id)
            raise ProxyError(
                503,
                f"the engine did not answer within {self.engine_timeout_s}s",
                "service_unavailable",
                code="engine_timeout",
            ) from None
        except ContextLengthExceededError:
            raise context_error(len(prompt_ids), self.engine.max_context) from None
        except RequestAbortedError as exc:
            raise ProxyError(
                503, f"the request was aborted: {exc}", "service_unavailable", code="request_aborted"
            ) from None
        except EngineError as exc:
            log.error("engine failed", error=str(exc)[:300])
            raise ProxyError(
                503, f"the engine failed: {exc}", "service_unavailable", code="engine_error"
            ) from None
        except Exception as exc:
            log.error("engine raised", error=repr(exc)[:300])
            raise ProxyError(
                503, f"the engine failed: {type(exc).__name__}", "service_unavailable", code="engine_error"
            ) from None
        if got is None:
            await self._abort(request_id)
            log.info("client gone during generation; aborted, not recorded", key=routing_key)
            raise client_gone_error()
        out = got
        if out.finish_reason == "abort":
            raise ProxyError(
                503, "the request was aborted by the engine", "service_unavailable", code="request_aborted"
            )
        if out.logprobs is not None and len(out.logprobs) != len(out.token_ids):
            raise ProxyError(
                503, "the engine returned logprobs that do not match its tokens", "service_unavailable"
            )
        if out.logprobs is not None and not all(map(math.isfinite, out.logprobs)):
            # a NaN/inf log-prob would poison the trainer's ratios; the store refuses it anyway
            log.error("engine returned non-finite logprobs", key=routing_key)
            raise ProxyError(
                503,
                "the engine returned non-finite log-probs (NaN or infinity); the call is not recorded",
                "service_unavailable",
                code="engine_nonfinite_logprobs",
            )
        bad = next((t for t in out.token_ids if not 0 <= t < self._id_bound), None)
        if bad is not None:
            log.error(
                "engine returned an id outside the tokenizer's vocabulary", token_id=bad, bound=self._id_bound
            )
            message = f"the engine returned token id {bad}, outside the tokenizer's vocabulary (they differ)"
            raise ProxyError(503, message, "service_unavailable", code="engine_error")
        return out

    async def _abort(self, request_id: str) -> None:
        with anyio.CancelScope(shield=True), anyio.move_on_after(5):
            try:
                await self.engine.abort(request_id)
            except Exception as exc:  # the request is gone either way
                log.debug("engine abort failed", error=repr(exc)[:200])

    def _text(self, out: TokenOutput, stop: list[str]) -> tuple[list[int], str]:
        ids = out.token_ids
        text_ids = ids[:-1] if ids and ids[-1] in self._stop_ids else ids
        text = self._decode(text_ids)
        if stop:  # the engine keeps a matched stop string in its output; OpenAI leaves it out
            cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
            if cut >= 0:
                text = text[:cut]
        return text_ids, text

    # ------------------------------------------------------------ the two endpoints

    async def chat(
        self,
        target: Target,
        req: ChatCompletionRequest,
        raw_messages: list[Any],
        *,
        request_key: str | None = None,
        client_gone: ClientGone | None = None,
    ) -> Generation:
        """A chat completion, recorded once (see the module docstring for ``request_key`` and
        ``client_gone``)."""
        if not request_key:
            return await self._chat(target, req, raw_messages, client_gone)
        fingerprint = _fingerprint(
            "chat", raw_messages, req.tools and tool_dicts(req.tools), req.tool_choice,
            *(getattr(req, k) for k in _REQUEST_KEYS), req.max_completion_tokens,
        )  # fmt: skip
        return await self.replays.run(
            (target.key, request_key), fingerprint, lambda: self._chat(target, req, raw_messages, None)
        )

    async def complete(
        self,
        target: Target,
        req: CompletionRequest,
        *,
        request_key: str | None = None,
        client_gone: ClientGone | None = None,
    ) -> Generation:
        """A text completion, recorded once (as ``chat``)."""
        if not request_key:
            return await self._complete(target, req, client_gone)
        fingerprint = _fingerprint("completion", req.prompt, *(getattr(req, k) for k in _REQUEST_KEYS))
        return await self.replays.run(
            (target.key, request_key), fingerprint, lambda: self._complete(target, req, None)
        )

    async def _chat(
        self,
        target: Target,
        req: ChatCompletionRequest,
        raw_messages: list[Any],
        client_gone: ClientGone | None,
    ) -> Generation:
        started = time.perf_counter()
        self.check_model(target, req.model)
        llm = await self.check_live(target)
        messages = [canonical_message(m, i) for i, m in enumerate(req.messages)]
        use_tools = req.tools is not None and req.tool_choice != "none"
        tools = tool_dicts(req.tools) if use_tools else None
        plan = self.ledger.plan(target.key, messages, tools, self.template)
        call: dict[str, Any] = {
            "prompt_ids": plan.prompt_ids,
            "messages": raw_messages,
            "tools": tools,
            "model": req.model,
            "ledger_break": plan.ledger_break,
        }
        if plan.ledger_break:
            log.info("ledger break", key=target.key, reason=plan.ledger_break)
        out = await self._generate_or_record_error(target, call, req, llm, plan.prompt_ids, client_gone)
        text_ids, text = self._text(out, req.stop_list)
        content: str | None = text
        tool_calls: list[JSONDict] = []
        if use_tools:
            parsed = parse_tool_calls(text)
            if parsed.error:
                log.warning("failed to decode tool call", key=target.key, error=parsed.error)
                call["tool_call_parse_error"] = True
            content, tool_calls = parsed.content, parsed.tool_calls
        finish = "tool_calls" if tool_calls else out.finish_reason
        message: JSONDict = {"role": "assistant", "content": content}
        if tool_calls:
            message["tool_calls"] = tool_calls
        call.update(
            response_ids=out.token_ids,
            response_logprobs=out.logprobs,
            response_message=message,
            finish_reason=finish,
            weights_version=out.weights_version,
            response_versions=mixed_versions(out),
            latency_s=time.perf_counter() - started,
        )
        if client_gone is not None and await _has_left(client_gone):
            log.info("client gone before the answer; not recorded", key=target.key)
            raise client_gone_error()
        await self.record(target, call)
        self.ledger.record(
            target.key, plan, messages, tools, out.token_ids, canonical_response(content, tool_calls)
        )
        return Generation(
            "chatcmpl-" + secrets.token_hex(12), int(time.time()), req.model or self.model_name, plan.prompt_ids,
            out.token_ids, out.logprobs, text_ids, content, tool_calls, finish,
        )  # fmt: skip

    async def _complete(
        self, target: Target, req: CompletionRequest, client_gone: ClientGone | None
    ) -> Generation:
        started = time.perf_counter()
        self.check_model(target, req.model)
        llm = await self.check_live(target)
        prompt_ids = self._prompt_ids(req.prompt)
        call: dict[str, Any] = {"prompt_ids": prompt_ids, "model": req.model}
        out = await self._generate_or_record_error(target, call, req, llm, prompt_ids, client_gone)
        text_ids, text = self._text(out, req.stop_list)
        call.update(
            response_ids=out.token_ids,
            response_logprobs=out.logprobs,
            finish_reason=out.finish_reason,
            response_message={"role": "assistant", "content": text},
            weights_version=out.weights_version,
            response_versions=mixed_versions(out),
            latency_s=time.perf_counter() - started,
        )
        if client_gone is not None and await _has_left(client_gone):
            log.info("client gone before the answer; not recorded", key=target.key)
            raise client_gone_error()
        await self.record(target, call)
        return Generation(
            "cmpl-" + secrets.token_hex(12), int(time.time()), req.model or self.model_name, prompt_ids,
            out.token_ids, out.logprobs, text_ids, text, [], out.finish_reason,
        )  # fmt: skip

    async def _generate_or_record_error(
        self,
        target: Target,
        call: dict[str, Any],
        req: Any,
        llm: dict[str, Any],
        prompt_ids: list[int],
        client_gone: ClientGone | None = None,
    ) -> TokenOutput:
        try:
            sampling = self.sampling(req, llm, len(prompt_ids))
            call["sampling"] = sampling.model_dump(mode="json")
            return await self.generate(prompt_ids, sampling, routing_key=target.key, client_gone=client_gone)
        except ProxyError as exc:
            # an attempt's over-context call is recorded so the trainer can count and skip it; a
            # session's is not kept (nothing trains on it, and its messages can be megabytes)
            if exc.code == "context_length_exceeded" and target.session_id is None:
                call["error"] = "context_length_exceeded"
                try:
                    await self.record(target, call)
                except ProxyError as rec_exc:
                    log.warning(
                        "could not record context_length_exceeded", key=target.key, error=rec_exc.message
                    )
            raise

    def _prompt_ids(self, prompt: str | list[int] | list[str] | list[list[int]]) -> list[int]:
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise bad_request(
                    f"only one prompt per request is supported, got {len(prompt)}", param="prompt"
                )
            prompt = prompt[0]  # type: ignore[assignment]
        if isinstance(prompt, str):
            ids = list(self.tokenizer.encode(prompt, add_special_tokens=False))
        else:
            ids = list(prompt)  # type: ignore[arg-type]
            vocab = len(self.tokenizer)
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise bad_request(f"prompt token ids must be in [0, {vocab}), got {bad}", param="prompt")
        if not ids:
            raise bad_request("the prompt is empty", param="prompt")
        return ids


_REQUEST_KEYS = ("model", "temperature", "top_p", "top_k", "max_tokens", "stop", "seed")


async def _has_left(client_gone: ClientGone) -> bool:
    """What ``client_gone()`` says; a check that fails cannot tell, so the client counts as there."""
    try:
        return await client_gone()
    except Exception as exc:
        log.warning("client check failed; taken as still connected", error=repr(exc)[:200])
        return False


async def _unless_gone(work: Awaitable[T], client_gone: ClientGone) -> T | None:
    """``work``'s result, or None once ``client_gone()`` says the client left (``work`` is cancelled).

    ``work`` runs in this very task, so the engine gets the request at once. A timer asks
    ``client_gone`` every ``DISCONNECT_POLL_S`` (first after one period: the client has just sent its
    request) in a short task of its own, and cancels ``work``'s scope once the client left; the
    function's exit cancels the timer and any check still running. Cheaper than a watcher task in a
    task group that asks at once: that cost ~0.1 ms of event-loop CPU per request, 9% of the proxy's
    work in a burst of 128 requests (benchmarks/results/proxy_cpu_profile.json).
    """
    loop = asyncio.get_running_loop()
    checks: set[asyncio.Task[None]] = set()
    timer: asyncio.TimerHandle | None = None
    with anyio.CancelScope() as scope:

        async def check() -> None:
            nonlocal timer
            if await _has_left(client_gone):
                scope.cancel()
            else:
                timer = loop.call_later(DISCONNECT_POLL_S, poll)

        def poll() -> None:
            task = loop.create_task(check())
            checks.add(task)
            task.add_done_callback(checks.discard)

        timer = loop.call_later(DISCONNECT_POLL_S, poll)
        try:
            return await work
        finally:
            timer.cancel()  # the latest one: a check that ran has replaced it
            if checks:
                for task in checks:
                    task.cancel()
                with anyio.CancelScope(shield=True):
                    await asyncio.wait(checks)
    return None
