"""Typed budget errors, each carrying what an OpenAI-shaped error response needs.

Every error has ``code`` (the OpenAI ``error.code``), ``type`` (``error.type``), ``http_status``,
``message``, ``param`` (always ``None`` here), ``retry_after_s`` (seconds, ``None`` when retrying
cannot help) and ``reason`` (the ``kvgate_budget_rejections_total{reason}`` label, one of
``REJECTION_REASONS``). ``limit`` names the limit that refused the request.

=========================  ======  ============================================================
code                       status  when
=========================  ======  ============================================================
kv_request_too_large       400     the request alone exceeds a limit it can never pass (per-request
                                   KV, the in-flight budget, tpm ...): retrying will not help
kv_budget_exceeded         429     the session's in-flight KV bytes would exceed its budget
kv_byte_seconds_exceeded   429     the session's KV byte-seconds bucket is empty
rate_limit_exceeded        429     requests per minute, tokens per minute or requests in flight
session_throttled          429     the session is blocked, or throttled and over its reduced limits
budget_store_unavailable   503     the Redis store is unreachable and the policy is ``fail_closed``
=========================  ======  ============================================================
"""

from __future__ import annotations

import math
from typing import ClassVar

from gateway.planner import format_bytes

REJECTION_REASONS: tuple[str, ...] = (
    "request_too_large",
    "inflight_kv_bytes",
    "inflight_requests",
    "kv_byte_seconds",
    "requests_per_minute",
    "tokens_per_minute",
    "throttled",
    "blocked",
    "store_unavailable",
)
"""Every ``reason`` label value, to pre-create the rejection counter's series."""


class BudgetError(Exception):
    """Base of every error ``BudgetService.admit`` raises."""

    code: ClassVar[str] = "budget_error"
    type: ClassVar[str] = "invalid_request_error"
    http_status: ClassVar[int] = 400
    param: ClassVar[str | None] = None

    def __init__(
        self,
        message: str,
        *,
        reason: str,
        limit: str | None = None,
        retry_after_s: float | None = None,
        session_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.session_id = session_id

    @property
    def retry_after_header(self) -> str | None:
        """The ``Retry-After`` header value: whole seconds, at least 1; ``None`` for no header."""
        if self.retry_after_s is None:
            return None
        return str(max(1, math.ceil(self.retry_after_s)))


class KVRequestTooLargeError(BudgetError):
    """The request can never be admitted under the session's limits (HTTP 400)."""

    code = "kv_request_too_large"


class KVBudgetExceededError(BudgetError):
    """The session's in-flight KV bytes plus this request's would exceed its budget (429)."""

    code = "kv_budget_exceeded"
    type = "rate_limit_error"
    http_status = 429


class KVByteSecondsExceededError(BudgetError):
    """The session has used up its KV byte-seconds for the window (429)."""

    code = "kv_byte_seconds_exceeded"
    type = "rate_limit_error"
    http_status = 429


class RateLimitExceededError(BudgetError):
    """Requests per minute, tokens per minute or requests in flight exceeded (429)."""

    code = "rate_limit_exceeded"
    type = "rate_limit_error"
    http_status = 429


class SessionThrottledError(BudgetError):
    """The session is blocked, or throttled and over its reduced limits (429)."""

    code = "session_throttled"
    type = "rate_limit_error"
    http_status = 429


class BudgetUnavailableError(BudgetError):
    """The budget store cannot be reached and the outage policy is ``fail_closed`` (503)."""

    code = "budget_store_unavailable"
    type = "service_unavailable_error"
    http_status = 503


class StoreUnavailableError(Exception):
    """Raised by a store when its backend cannot be reached; the service applies the policy."""


_LIMIT_TEXT = {
    "request_kv_bytes": "per-request KV bytes",
    "inflight_kv_bytes": "in-flight KV bytes",
    "inflight_requests": "requests in flight",
    "kv_byte_seconds": "KV byte-seconds",
    "requests_per_minute": "requests per minute",
    "tokens_per_minute": "tokens per minute",
}


def describe_limit(limit: str, value: int | None) -> str:
    """``in-flight KV bytes limit of 6442450944 (6 GiB)``: a limit as the client reads it."""
    what = _LIMIT_TEXT.get(limit, limit)
    if value is None:
        return f"{what} limit"
    if limit in ("request_kv_bytes", "inflight_kv_bytes", "kv_byte_seconds"):
        return f"{what} limit of {value} ({format_bytes(value)})"
    return f"{what} limit of {value}"


def too_large(
    limit: str, kv_bytes: int, tokens: int, session_id: str | None,
    limit_value: int | None = None,
) -> BudgetError:
    """The 400 for a request that no amount of waiting would admit."""
    return KVRequestTooLargeError(
        f"This request ({kv_bytes} KV bytes = {format_bytes(kv_bytes)}, {tokens} tokens of"
        f" prompt + max output) exceeds the session's {describe_limit(limit, limit_value)} and"
        " can never be served; reduce the prompt or max_tokens.",
        reason="request_too_large",
        limit=limit,
        session_id=session_id,
    )


def rejection(
    limit: str, retry_after_s: float | None, throttle: str | None, session_id: str
) -> BudgetError:
    """The 429 for a store's refusal of ``limit``; ``throttle`` is the session's throttle state.

    ``limit`` is ``blocked`` for a blocked session, otherwise a ``BudgetLimits`` field name. Under
    a throttle every refusal is ``session_throttled``: the client sees why it is being held back.
    """
    retry = None if retry_after_s is None or retry_after_s < 0 else retry_after_s
    if throttle == "blocked" or limit == "blocked":
        return SessionThrottledError(
            f"Session {session_id!r} is blocked by an operator or an alert.",
            reason="blocked",
            limit="blocked",
            retry_after_s=retry,
            session_id=session_id,
        )
    what = _LIMIT_TEXT.get(limit, limit)
    if throttle == "throttled":
        return SessionThrottledError(
            f"Session {session_id!r} is throttled and has reached its reduced {what} limit.",
            reason="throttled",
            limit=limit,
            retry_after_s=retry,
            session_id=session_id,
        )
    cls: type[BudgetError]
    if limit == "inflight_kv_bytes":
        cls = KVBudgetExceededError
    elif limit == "kv_byte_seconds":
        cls = KVByteSecondsExceededError
    else:
        cls = RateLimitExceededError
    return cls(
        f"Session {session_id!r} has reached its {what} limit; retry later.",
        reason=limit,
        limit=limit,
        retry_after_s=retry,
        session_id=session_id,
    )


def unavailable(detail: str) -> BudgetUnavailableError:
    """The 503 under ``fail_closed`` while the store is unreachable."""
    return BudgetUnavailableError(
        f"The KV budget store is unavailable ({detail}); try again shortly.",
        reason="store_unavailable",
        retry_after_s=1.0,
    )
