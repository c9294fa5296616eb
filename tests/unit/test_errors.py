"""gateway.errors: the one map from domain errors to status, type, code, param and Retry-After.

The response shapes of ``GatewayError`` itself and the app's handlers are tested with the request
vocabulary (tests/unit/test_request.py); here, each domain error and what a client receives for it.
"""

from __future__ import annotations

import logging

import orjson
import pytest

from gateway.budgets.errors import (
    BudgetError,
    rejection,
    too_large,
    unavailable,
)
from gateway.errors import GatewayError, error_response, from_domain
from gateway.overload import Overloaded
from gateway.prompt.tokenizer import PromptTooComplexError
from gateway.routing.router import (
    ContextLengthExceeded,
    NoHealthyWorker,
    PoolSaturated,
    RoutingError,
)

# (error, status, type, code, param, Retry-After header or None)
CASES: list[tuple[Exception, int, str, str | None, str | None, str | None]] = [
    (too_large("session", "request_kv_bytes", 10, 5), 400, "invalid_request_error",
     "kv_request_too_large", None, None),
    (rejection("inflight_kv_bytes", 2.5, None, "session", "t", "s"), 429, "rate_limit_error",
     "kv_budget_exceeded", None, "3"),
    (rejection("kv_byte_seconds", 0.2, None, "session", "t", "s"), 429, "rate_limit_error",
     "kv_byte_seconds_exceeded", None, "1"),
    (rejection("requests_per_minute", 7.0, None, "session", "t", "s"), 429, "rate_limit_error",
     "rate_limit_exceeded", None, "7"),
    (rejection("inflight_requests", None, "throttled", "session", "t", "s"), 429, "rate_limit_error",
     "session_throttled", None, None),
    (rejection("blocked", 60.0, "blocked", "session", "t", "s"), 429, "rate_limit_error",
     "session_throttled", None, "60"),
    (unavailable("connection refused"), 503, "service_unavailable_error",
     "budget_store_unavailable", None, "1"),
    (BudgetError("odd", reason="store_unavailable"), 400, "invalid_request_error",
     "budget_error", None, None),
    (ContextLengthExceeded(9000, 4096), 400, "invalid_request_error",
     "context_length_exceeded", "messages", None),
    (NoHealthyWorker("none up"), 503, "service_unavailable_error", "no_healthy_worker", None,
     "2"),
    (PoolSaturated("all busy"), 503, "service_unavailable_error", "pool_saturated", None, "1"),
    (Overloaded("queue full", retry_after_s=10.0), 503, "service_unavailable_error",
     "gateway_overloaded", None, "10"),
    (PromptTooComplexError("chat template failed"), 400, "invalid_request_error", None,
     "messages", None),
]


@pytest.mark.parametrize(
    ("exc", "status", "type_", "code", "param", "retry_after"),
    CASES, ids=[type(c[0]).__name__ + (f"-{c[3]}" if c[3] else "") for c in CASES],
)
def test_each_domain_error_maps_to_its_status_type_code_param_and_retry_after(
    exc: Exception, status: int, type_: str, code: str | None, param: str | None,
    retry_after: str | None,
) -> None:
    resp = error_response(exc, "/v1/chat/completions")

    assert resp.status_code == status
    assert orjson.loads(bytes(resp.body)) == {
        "error": {"message": str(exc), "type": type_, "param": param, "code": code}}
    assert resp.headers.get("retry-after") == retry_after


def test_gateway_error_passes_through_unchanged() -> None:
    err = GatewayError(413, "too big", code="request_too_large")

    assert from_domain(err) is err


@pytest.mark.parametrize("exc", [RuntimeError("secret internals"), RoutingError("bare")])
def test_unexpected_error_is_a_logged_500_that_hides_its_message(
    exc: Exception, caplog: pytest.LogCaptureFixture
) -> None:
    assert from_domain(exc) is None

    with caplog.at_level(logging.ERROR, logger="gateway.errors"):
        resp = error_response(exc, "/admin/sessions")

    assert resp.status_code == 500
    assert orjson.loads(bytes(resp.body))["error"]["code"] == "internal_error"
    assert str(exc) not in bytes(resp.body).decode()
    assert [r.getMessage() for r in caplog.records] == ["unhandled error on /admin/sessions"]
