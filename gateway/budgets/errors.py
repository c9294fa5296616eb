"""Typed budget errors: why a request was refused, with no HTTP in them.

Every error has ``code`` (the OpenAI ``error.code``), ``message``, ``retry_after_s`` (seconds,
``None`` when retrying cannot help) and ``reason`` (the ``kvgate_budget_rejections_total{reason}``
label, one of ``REJECTION_REASONS``). ``limit`` names the limit that refused the request and
``level`` whose it was: the ``session``'s or the ``tenant``'s (the sum over its sessions). The
HTTP status, type and Retry-After header are the gateway's error map's (``gateway.errors``).

=========================  ============================================================
code                       when
=========================  ============================================================
kv_request_too_large       the request alone exceeds a limit it can never pass (per-request
                           KV, the in-flight budget, tpm ...): retrying will not help
kv_budget_exceeded         the session's (or tenant's) in-flight KV bytes would exceed its budget
kv_byte_seconds_exceeded   the session's (or tenant's) KV byte-seconds bucket is empty
rate_limit_exceeded        requests per minute, tokens per minute or requests in flight
session_throttled          the session or its tenant is blocked, or throttled and over its
                           reduced limits
budget_store_unavailable   the Redis store is unreachable and the policy is ``fail_closed``
=========================  ============================================================
"""

from __future__ import annotations

from typing import ClassVar

from gateway.kvmath import format_bytes

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

    def __init__(
        self,
        message: str,
        *,
        reason: str,
        limit: str | None = None,
        retry_after_s: float | None = None,
        level: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.level = level


class KVRequestTooLargeError(BudgetError):
    """The request can never be admitted under the session's limits."""

    code = "kv_request_too_large"


class KVBudgetExceededError(BudgetError):
    """The session's in-flight KV bytes plus this request's would exceed its budget."""

    code = "kv_budget_exceeded"


class KVByteSecondsExceededError(BudgetError):
    """The session has used up its KV byte-seconds for the window."""

    code = "kv_byte_seconds_exceeded"


class RateLimitExceededError(BudgetError):
    """Requests per minute, tokens per minute or requests in flight exceeded."""

    code = "rate_limit_exceeded"


class SessionThrottledError(BudgetError):
    """The session is blocked, or throttled and over its reduced limits."""

    code = "session_throttled"


class BudgetUnavailableError(BudgetError):
    """The budget store cannot be reached and the outage policy is ``fail_closed``."""

    code = "budget_store_unavailable"


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


def who(level: str, tenant: str, session_id: str) -> str:
    """``Session 'alice' of tenant 'team-a'`` or ``Tenant 'team-a'``: whose limit refused."""
    if level == "tenant":
        return f"Tenant {tenant!r}"
    return f"Session {session_id!r} of tenant {tenant!r}"


def too_large(
    level: str, limit: str, kv_bytes: int, tokens: int, limit_value: int | None = None,
) -> BudgetError:
    """The refusal of a request that no amount of waiting would admit."""
    return KVRequestTooLargeError(
        f"This request ({kv_bytes} KV bytes = {format_bytes(kv_bytes)}, {tokens} tokens of"
        f" prompt + max output) exceeds the {level}'s {describe_limit(limit, limit_value)} and"
        " can never be served; reduce the prompt or max_tokens.",
        reason="request_too_large",
        limit=limit,
        level=level,
    )


def rejection(
    limit: str, retry_after_s: float | None, throttle: str | None, level: str, tenant: str,
    session_id: str,
) -> BudgetError:
    """A store's refusal of ``limit`` at ``level`` (``session`` or ``tenant``; retrying later may
    pass); ``throttle`` is that level's throttle state.

    ``limit`` is ``blocked`` for a blocked session or tenant, otherwise a ``BudgetLimits`` field
    name. Under a throttle every refusal is ``session_throttled``: the client sees why it is being
    held back.
    """
    retry = None if retry_after_s is None or retry_after_s < 0 else retry_after_s
    subject = who(level, tenant, session_id)
    if throttle == "blocked" or limit == "blocked":
        return SessionThrottledError(
            f"{subject} is blocked by an operator or an alert.",
            reason="blocked",
            limit="blocked",
            retry_after_s=retry,
            level=level,
        )
    what = _LIMIT_TEXT.get(limit, limit)
    if throttle == "throttled":
        return SessionThrottledError(
            f"{subject} is throttled and has reached its reduced {what} limit.",
            reason="throttled",
            limit=limit,
            retry_after_s=retry,
            level=level,
        )
    cls: type[BudgetError]
    if limit == "inflight_kv_bytes":
        cls = KVBudgetExceededError
    elif limit == "kv_byte_seconds":
        cls = KVByteSecondsExceededError
    else:
        cls = RateLimitExceededError
    return cls(
        f"{subject} has reached its {what} limit; retry later.",
        reason=limit,
        limit=limit,
        retry_after_s=retry,
        level=level,
    )


def unavailable(detail: str) -> BudgetUnavailableError:
    """The refusal under ``fail_closed`` while the store is unreachable."""
    return BudgetUnavailableError(
        f"The KV budget store is unavailable ({detail}); try again shortly.",
        reason="store_unavailable",
        retry_after_s=1.0,
    )
