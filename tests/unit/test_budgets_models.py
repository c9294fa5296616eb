"""Budget values: the never-fits rule, footprints, throttle validation, errors and what a client
receives for each (mapped by ``gateway.errors``)."""

from __future__ import annotations

import orjson
import pytest

from gateway.budgets import (
    REJECTION_REASONS,
    BudgetError,
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
from gateway.budgets.models import rotation_gaps
from gateway.config import BudgetSettings
from gateway.errors import error_response


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
    err = rejection(limit, 2.2, throttle, "session", "t1", "s1")
    assert isinstance(err, cls)
    assert (err.code, err.reason) == (code, reason)
    assert _http(err) == (429, "rate_limit_error", "3")
    assert err.reason in REJECTION_REASONS
    assert "s1" in err.message


def test_never_fits_is_400_without_retry_after() -> None:
    err = too_large("session", "request_kv_bytes", 10, 1)
    assert err.code == "kv_request_too_large"
    assert _http(err) == (400, "invalid_request_error", None)
    assert err.reason in REJECTION_REASONS


def test_unavailable_is_503() -> None:
    err = unavailable("down")
    assert (err.code, err.reason) == ("budget_store_unavailable", "store_unavailable")
    assert _http(err) == (503, "service_unavailable_error", "1")


def test_retry_after_header_is_at_least_one_second() -> None:
    assert _http(rejection("inflight_kv_bytes", 0.0, None, "session", "t", "s"))[2] == "1"
    assert _http(rejection("inflight_kv_bytes", -1.0, None, "tenant", "t", "s"))[2] is None


def _http(err: BudgetError) -> tuple[int, str, str | None]:
    """Status, ``error.type`` and Retry-After a client receives for ``err`` (``gateway.errors``)."""
    resp = error_response(err, "/v1/chat/completions")
    error_type = orjson.loads(bytes(resp.body))["error"]["type"]
    return resp.status_code, error_type, resp.headers.get("retry-after")


def test_session_limits_without_tenant_limits_are_reported_as_rotatable() -> None:
    """A config with only per-session limits let a client rotate session ids around them."""
    settings = BudgetSettings.model_validate({
        "defaults": {"inflight_kv_bytes": "1GiB", "request_kv_bytes": "1GiB",
                     "tenant": {"inflight_kv_bytes": "4GiB"}},
        "per_key": {"batch": {"requests_per_minute": 10}},
    })
    assert rotation_gaps(settings) == ["batch.requests_per_minute"]
    covered = BudgetSettings.model_validate({
        "defaults": {"requests_per_minute": 10, "tenant": {"requests_per_minute": 100}},
    })
    assert rotation_gaps(covered) == []
