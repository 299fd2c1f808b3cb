"""What one request does, independent of HTTP: check the attempt, build the prompt, generate, record.

Order for a chat request: the attempt is live (else 404/409, store_call.py) -> canonical messages ->
token ledger (delta or full render) -> context check -> ``engine.generate`` under a timeout
(engine_call.py) -> decode, cut stop strings, parse tool calls -> one LLMCall span in the store (or
the session) -> ledger entry. Every failure is a ``ProxyError`` with an HTTP status; nothing here hangs.

A client retry is not a second training sample. Two mechanisms, both at the HTTP layer's choice:

- ``request_key`` (the app passes the ``Idempotency-Key`` or ``X-Request-Id`` header): a retry under
  the key of an earlier call gets that call's answer and records nothing (``RequestReplays``,
  replays.py). A keyed call runs to its end even when its client leaves: the retry collects the answer.
- ``client_gone`` (the app passes ``ClientWatch.gone``, disconnect.py), for requests without a key: a client
  that closed its connection (an openai client timing out does) aborts the generation, and a call
  whose client left before its answer was ready is not recorded (and not added to the ledger), so
  the retry that follows is the only sample. The narrow race left (the client leaves after the
  check, while the answer is being written) is what ``request_key`` closes.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

import structlog

from agentloop.engine.base import InferenceEngine, SamplingParams, TokenOutput, mixed_versions
from agentloop.proxy import engine_call
from agentloop.proxy.chat import ChatTemplate, canonical_message, canonical_response, tool_dicts
from agentloop.proxy.detok import text_decoder
from agentloop.proxy.disconnect import DISCONNECT_POLL_S as DISCONNECT_POLL_S
from agentloop.proxy.disconnect import ClientGone, _has_left, client_gone_error
from agentloop.proxy.engine_call import context_error
from agentloop.proxy.generation import Generation, Target
from agentloop.proxy.ledger import TokenLedger
from agentloop.proxy.replays import RequestReplays, _fingerprint
from agentloop.proxy.responses_store import ResponseStore
from agentloop.proxy.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    JSONDict,
    ProxyError,
    bad_request,
)
from agentloop.proxy.sessions import SessionRecord, SessionTable
from agentloop.proxy.store_call import store_errors
from agentloop.proxy.tool_parser import parse_tool_calls
from agentloop.resources import ProxyLLM
from agentloop.store.base import Store
from agentloop.types import LLMCall, Reward, Span

log = structlog.get_logger("agentloop.proxy")

_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "seed", "max_tokens", "stop")
_ENFORCEABLE = ("temperature", "top_p", "top_k")  # what an enforce_sampling resource fixes
_ENFORCED = "__enforced__"  # marks the LLM defaults of a resource with enforce_sampling
_REQUEST_KEYS = ("model", "temperature", "top_p", "top_k", "max_tokens", "stop", "seed")


class ProxyService:
    """The proxy's logic; the Starlette app (app.py, routes.py) only parses HTTP and writes responses."""

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
        # recent Responses answers and calls (previous_response_id), dropped with the conversation's ledger
        self.responses = ResponseStore()
        ledger.on_forget = self.responses.forget
        # a session dropped from the table (TTL, caps, taken by a trainer) takes its token ledger along
        sessions.on_drop = lambda session_id: ledger.forget(Target(session_id=session_id).key)

    # ------------------------------------------------------------ store access

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
        # one store call (was get_rollout + get_attempt)
        with store_errors("get_rollout_attempt", self.store_timeout_s):
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
            with store_errors("get_resources", self.store_timeout_s):
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
            if not self.sessions.add_call(target.session_id, call, target.owner, any_owner=target.admin):
                log.warning("session call not recorded: over the session's byte cap", key=target.key)
            with store_errors("saving the session call", self.store_timeout_s):
                await self.sessions.flush()
            return
        assert target.rollout_id is not None and target.attempt_id is not None
        span = Span(
            rollout_id=target.rollout_id, attempt_id=target.attempt_id, sequence_id=None, payload=call
        )
        with store_errors("add_span", self.store_timeout_s):
            await self.store.add_span(span)

    async def add_session_reward(
        self, session_id: str, reward: Reward, owner: str = "", *, any_owner: bool = False
    ) -> SessionRecord:
        """Record an app session's reward and wait until the store saved it (404: unknown session, or
        another owner's unless ``any_owner``; 409: too many rewards, 503: the store failed)."""
        try:
            rec = self.sessions.add_reward(session_id, reward, owner, any_owner=any_owner)
        except KeyError:
            raise ProxyError(404, f"session {session_id!r} not found (no calls recorded under it)",
                             "not_found_error", code="not_found") from None  # fmt: skip
        with store_errors("saving the session reward", self.store_timeout_s):
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
        return await engine_call.generate(
            self.engine, prompt_ids, sampling, timeout_s=self.engine_timeout_s, id_bound=self._id_bound,
            routing_key=routing_key, client_gone=client_gone,
        )  # fmt: skip

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
        any_model: bool = False,
    ) -> Generation:
        """A chat completion, recorded once (see the module docstring for ``request_key`` and
        ``client_gone``); ``any_model``: a session request may name any model (``check_model``)."""
        if not any_model:
            self.check_model(target, req.model)
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
            "parent_call_id": plan.extends_call,  # the call tree (ledger.py): call_id is set when recorded
            "branch": plan.branch,
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
                # the model's own mistake, common early in training: debug, counted per step in the
                # trainer's metrics (rollout/tool_call_parse_errors), scored by the reward function
                log.debug("failed to decode tool call", key=target.key, error=parsed.error)
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
        call["call_id"] = call_id = self.ledger.new_call_id(target.key)
        await self.record(target, call)
        self.ledger.record(
            target.key, plan, messages, tools, out.token_ids, canonical_response(content, tool_calls), call_id
        )
        return Generation(
            "chatcmpl-" + secrets.token_hex(12), int(time.time()), req.model or self.model_name, plan.prompt_ids,
            out.token_ids, out.logprobs, text_ids, content, tool_calls, finish,
        )  # fmt: skip

    def count_prompt_tokens(self, req: ChatCompletionRequest) -> int:
        """The number of ids a fresh conversation of ``req``'s messages and tools would prompt with
        (a full render; nothing generated or recorded)."""
        messages = [canonical_message(m, i) for i, m in enumerate(req.messages)]
        tools = tool_dicts(req.tools) if req.tools is not None and req.tool_choice != "none" else None
        return len(self.template.encode(self.template.render(messages, tools, add_generation_prompt=True)))

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
        call["call_id"] = self.ledger.new_call_id(target.key)  # a root: the ledger keeps no text prompts
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
                call["call_id"] = self.ledger.new_call_id(target.key)
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
