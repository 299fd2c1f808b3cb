"""The store seen from the proxy: one timeout for a group of store calls, its errors as HTTP errors.

``NotFoundError`` becomes 404, ``StaleAttemptError`` 409, a timeout or any other failure 503 (the
latter logged); a ``ProxyError`` raised inside the block passes through unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import anyio
import structlog

from agentloop.errors import NotFoundError, StaleAttemptError
from agentloop.proxy.schemas import ProxyError

log = structlog.get_logger("agentloop.proxy")


@contextlib.contextmanager
def store_errors(what: str, timeout_s: float) -> Iterator[None]:
    """One timeout for a group of store calls; store errors become 404 / 409 / 503.

    The timeout is ``anyio.fail_after`` written out (a cancel scope that a timer cancels): one
    generator context manager per store call instead of two, ~9 us less event-loop CPU, and this
    runs twice per request."""
    try:
        with anyio.CancelScope() as scope:
            timer = asyncio.get_running_loop().call_later(timeout_s, scope.cancel)
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
        raise ProxyError(503, f"the store did not answer {what} within {timeout_s}s", "store_error") from None
    except ProxyError:
        raise
    except Exception as exc:
        log.error("store call failed", what=what, error=repr(exc)[:300])
        raise ProxyError(503, f"the store failed on {what}: {type(exc).__name__}", "store_error") from None
