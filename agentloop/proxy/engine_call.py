"""One engine call: a request id, the engine timeout, an abort when the call is left, the answer checked.

Every generation the proxy asks of the engine goes through ``generate``. A timeout, a cancellation
or a client that left aborts the request in the engine. Every failure but a cancellation (which
propagates) becomes a ``ProxyError`` (503; 400 for a prompt over the context; 499 when its client
left), and an answer whose logprobs do not match its tokens or are not finite, or that holds an id
outside the tokenizer, is refused before anything records it.
"""

from __future__ import annotations

import math
import secrets

import anyio
import structlog

from agentloop.engine.base import InferenceEngine, SamplingParams, TokenOutput
from agentloop.errors import ContextLengthExceededError, EngineError, RequestAbortedError
from agentloop.proxy.disconnect import ClientGone, _unless_gone, client_gone_error
from agentloop.proxy.schemas import ProxyError

log = structlog.get_logger("agentloop.proxy")


def context_error(n_prompt: int, limit: int) -> ProxyError:
    return ProxyError(
        400,
        f"this model's maximum context length is {limit} tokens; the prompt has {n_prompt} tokens "
        "(shorten the messages)",
        param="messages",
        code="context_length_exceeded",
    )


async def generate(
    engine: InferenceEngine,
    prompt_ids: list[int],
    sampling: SamplingParams,
    *,
    timeout_s: float,
    id_bound: int,
    routing_key: str | None = None,
    client_gone: ClientGone | None = None,
) -> TokenOutput:
    """One engine call under ``timeout_s``; aborted in the engine when it times out, is cancelled,
    or (``client_gone``) its client leaves (then 499, see ``client_gone_error``). ``id_bound``: token
    ids at or above it mean the engine's vocabulary and the tokenizer's differ (503)."""
    # "<routing key>/req-<random>": engine replica pools keep one attempt's calls on one replica
    request_id = (f"{routing_key}/" if routing_key else "") + "req-" + secrets.token_hex(8)
    try:
        with anyio.fail_after(timeout_s):
            work = engine.generate(prompt_ids, sampling, request_id=request_id)
            got = await (work if client_gone is None else _unless_gone(work, client_gone))
    except anyio.get_cancelled_exc_class():
        await _abort(engine, request_id)
        raise
    except TimeoutError:
        await _abort(engine, request_id)
        raise ProxyError(
            503,
            f"the engine did not answer within {timeout_s}s",
            "service_unavailable",
            code="engine_timeout",
        ) from None
    except ContextLengthExceededError:
        raise context_error(len(prompt_ids), engine.max_context) from None
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
        await _abort(engine, request_id)
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
    bad = next((t for t in out.token_ids if not 0 <= t < id_bound), None)
    if bad is not None:
        log.error("engine returned an id outside the tokenizer's vocabulary", token_id=bad, bound=id_bound)
        message = f"the engine returned token id {bad}, outside the tokenizer's vocabulary (they differ)"
        raise ProxyError(503, message, "service_unavailable", code="engine_error")
    return out


async def _abort(engine: InferenceEngine, request_id: str) -> None:
    with anyio.CancelScope(shield=True), anyio.move_on_after(5):
        try:
            await engine.abort(request_id)
        except Exception as exc:  # the request is gone either way
            log.debug("engine abort failed", error=repr(exc)[:200])
