"""Budget values: the never-fits rule, footprints, throttle validation, error mapping."""

from __future__ import annotations

import pytest

from gateway.budgets import (
    REJECTION_REASONS,
    BudgetLimits,
    KVBudgetExceededError,
    KVByteSecondsExceededError,
    RateLimitExceededError,
    SessionThrottledError,
    Throttle,
    ThrottleState,
    kv_footprint_bytes,
)
from gateway.budgets.errors import rejection, too_large, unavailable


def test_footprint_is_prompt_plus_max_output_times_bytes_per_token() -> None:
    # Llama-3-8B: 2 x 32 layers x 8 kv heads x 128 head dim x 2 bytes = 128 KiB per token
    assert kv_footprint_bytes(1000, 24, 131072) == 1024 * 131072
    with pytest.raises(ValueError):
        kv_footprint_bytes(-1, 0, 1)


@pytest.mark.parametrize(
    ("limits", "kv_bytes", "tokens", "limit"),
    [
        (BudgetLimits(request_kv_bytes=10), 11, 1, "request_kv_bytes"),
        (BudgetLimits(inflight_kv_bytes=10), 11, 1, "inflight_kv_bytes"),
        (BudgetLimits(inflight_requests=0), 1, 1, "inflight_requests"),
        (BudgetLimits(kv_byte_seconds=0), 1, 1, "kv_byte_seconds"),
        (BudgetLimits(requests_per_minute=0), 1, 1, "requests_per_minute"),
        (BudgetLimits(tokens_per_minute=100), 1, 101, "tokens_per_minute"),
        (BudgetLimits(request_kv_bytes=10, inflight_kv_bytes=10), 10, 1, None),
        (BudgetLimits(), 10**15, 10**9, None),
    ],
)
def test_never_fits_names_the_limit_no_wait_would_satisfy(
    limits: BudgetLimits, kv_bytes: int, tokens: int, limit: str | None
) -> None:
    assert limits.never_fits(kv_bytes, tokens) == limit


def test_limits_reject_negative_values() -> None:
    with pytest.raises(ValueError):
        BudgetLimits(inflight_kv_bytes=-1)


def test_throttle_validates_factor_and_expiry() -> None:
    with pytest.raises(ValueError):
        Throttle(ThrottleState.THROTTLED, expires_at=1.0, budget_factor=0.0)
    with pytest.raises(ValueError):
        Throttle(ThrottleState.THROTTLED, expires_at=1.0, budget_factor=1.5)
    with pytest.raises(ValueError):
        Throttle(ThrottleState.BLOCKED, expires_at=float("inf"))


@pytest.mark.parametrize(
    ("limit", "throttle", "cls", "code", "reason"),
    [
        (
            "inflight_kv_bytes",
            None,
            KVBudgetExceededError,
            "kv_budget_exceeded",
            "inflight_kv_bytes",
        ),
        (
            "kv_byte_seconds",
            None,
            KVByteSecondsExceededError,
            "kv_byte_seconds_exceeded",
            "kv_byte_seconds",
        ),
        (
            "requests_per_minute",
            None,
            RateLimitExceededError,
            "rate_limit_exceeded",
            "requests_per_minute",
        ),
        (
            "tokens_per_minute",
            None,
            RateLimitExceededError,
            "rate_limit_exceeded",
            "tokens_per_minute",
        ),
        (
            "inflight_requests",
            None,
            RateLimitExceededError,
            "rate_limit_exceeded",
            "inflight_requests",
        ),
        ("inflight_kv_bytes", "throttled", SessionThrottledError, "session_throttled", "throttled"),
        ("blocked", "blocked", SessionThrottledError, "session_throttled", "blocked"),
    ],
)
def test_rejections_map_to_429_codes_and_metric_reasons(
    limit: str, throttle: str | None, cls: type, code: str, reason: str
) -> None:
    err = rejection(limit, 2.2, throttle, "s1")
    assert isinstance(err, cls)
    assert (err.code, err.http_status, err.type, err.reason) == (
        code,
        429,
        "rate_limit_error",
        reason,
    )
    assert err.retry_after_header == "3"
    assert err.reason in REJECTION_REASONS
    assert "s1" in err.message


def test_never_fits_is_400_without_retry_after() -> None:
    err = too_large("request_kv_bytes", 10, 1, "s1")
    assert (err.code, err.http_status, err.type) == (
        "kv_request_too_large",
        400,
        "invalid_request_error",
    )
    assert err.retry_after_header is None and err.reason in REJECTION_REASONS


def test_unavailable_is_503() -> None:
    err = unavailable("down")
    assert (err.code, err.http_status, err.reason) == (
        "budget_store_unavailable",
        503,
        "store_unavailable",
    )


def test_retry_after_header_is_at_least_one_second() -> None:
    assert rejection("inflight_kv_bytes", 0.0, None, "s").retry_after_header == "1"
    assert rejection("inflight_kv_bytes", -1.0, None, "s").retry_after_header is None
