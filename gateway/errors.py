"""The one error map: every refusal becomes ``{"error": {"message", "type", "param", "code"}}``.

What a client receives is a ``GatewayError`` (status, message, code, param, type, Retry-After).
The domain packages raise their own errors and know nothing of HTTP; ``from_domain`` is the one
place that gives each of them its status, type, code, param and Retry-After, and
``error_response`` is the one place any exception becomes a response (the app's completion fast
path and its FastAPI handlers both call it). ``type`` follows from the status (``_TYPES``);
Retry-After is ``retry_after_s`` rounded up to whole seconds, at least 1, in ``response`` only.

The hierarchy, and what each error maps to::

    GatewayError                  what a client receives; raised as such by the layers that speak
                                  HTTP: auth 401/403, request 400 (invalid_json ...), dispatch 404
                                  model_not_found / 413 request_too_large / 499 client_closed /
                                  400 invalid_priority (X-Priority) / 400 invalid_slo
                                  (x-slo-ttft-ms, x-slo-tpot-ms) / 400 unsupported_endpoint
                                  (a route the model's runner does not serve),
                                  upstream 502 upstream_unreachable / upstream_error /
                                  upstream_unauthorized (a worker refused the pool's key) and 504
                                  upstream_timeout, the app 404 not_found / 405 method_not_allowed
                                  / 400 (a route's schema) / 500 internal_error (anything unknown)

    domain errors, by from_domain:        status  code                      param     Retry-After
    budgets.errors.BudgetError            400     budget_error                        its own
    ├── KVRequestTooLargeError            400     kv_request_too_large                (none)
    ├── KVBudgetExceededError             429     kv_budget_exceeded                  its own
    ├── KVByteSecondsExceededError        429     kv_byte_seconds_exceeded            its own
    ├── RateLimitExceededError            429     rate_limit_exceeded                 its own
    ├── SessionThrottledError             429     session_throttled                   its own
    └── BudgetUnavailableError            503     budget_store_unavailable            its own (1 s)
    routing.router.RoutingError           500     internal_error (never raised bare)
    ├── ContextLengthExceeded             400     context_length_exceeded   messages
    ├── NoHealthyWorker                   503     no_healthy_worker                   2 s
    ├── PoolSaturated                     503     pool_saturated                      1 s
    ├── SloUnattainable                   503     slo_unattainable          x-slo-*   its own
    └── OwnerUnavailable (its worker down)503     response_owner_unavailable          2 s
        (its worker left the fleet)       404     response_owner_gone
    budgets.owners.OwnersUnavailable      503     response_store_unavailable          1 s
    overload.Overloaded                   503     gateway_overloaded                  its own
    prompt.tokenizer.PromptTooComplexError
                                          400     (none)                    messages
    └── TemplateOptionError               400     invalid_template_option   its option
    prompt.limits.PromptTooLongError      400     context_length_exceeded   messages
    prompt.limits.PromptTimeoutError      400     prompt_timeout            messages
    prompt.render.UncountableContentError 400     unsupported_content       its part

Budget errors carry their ``code`` (the budgets package documents when each is raised) and their
``retry_after_s`` ("its own"); the status is the map's.

This module sits above the domain packages (it imports their error classes) and below dispatch,
upstream and the routes; no domain package imports it. It depends on Starlette's ``Response``
only; installing the handlers on FastAPI is the app's business (``gateway.app``).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import orjson
from starlette.responses import Response

from gateway.budgets.errors import (
    BudgetError,
    BudgetUnavailableError,
    KVBudgetExceededError,
    KVByteSecondsExceededError,
    RateLimitExceededError,
    SessionThrottledError,
)
from gateway.budgets.owners import OwnersUnavailable
from gateway.overload import Overloaded
from gateway.prompt.limits import PromptTimeoutError, PromptTooLongError
from gateway.prompt.render import UncountableContentError
from gateway.prompt.tokenizer import PromptTooComplexError, TemplateOptionError
from gateway.routing.router import (
    ContextLengthExceeded,
    NoHealthyWorker,
    OwnerUnavailable,
    PoolSaturated,
    RoutingError,
    SloUnattainable,
)

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    502: "upstream_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}
"""``error.type`` by status (``invalid_request_error`` for any other)."""

class GatewayError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type_: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type_ or _TYPES.get(status, "invalid_request_error")
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> Response:
        headers = {}
        if self.retry_after_s is not None:
            # Rounded up: coming back a fraction early only earns another 429.
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        return json_response(self.status, self.body(), headers)


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def json_response(status: int, content: Any, headers: dict[str, str] | None = None) -> Response:
    return Response(
        orjson.dumps(content), status_code=status, headers=headers, media_type="application/json"
    )


def bad_request(message: str, param: str | None = None, code: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param, code=code)


DOMAIN_ERRORS: tuple[type[Exception], ...] = (
    GatewayError, BudgetError, RoutingError, Overloaded, PromptTooComplexError,
    UncountableContentError, PromptTooLongError, PromptTimeoutError, OwnersUnavailable,
)
"""The bases of every error ``error_response`` answers without logging it as unexpected."""


def from_domain(exc: BaseException) -> GatewayError | None:
    """The ``GatewayError`` a client receives for ``exc`` (the table in the module docstring);
    ``None`` for an error the gateway did not expect."""
    match exc:
        case GatewayError():
            return exc
        case (KVBudgetExceededError() | KVByteSecondsExceededError() | RateLimitExceededError()
              | SessionThrottledError()):
            return _budget(exc, 429)
        case BudgetUnavailableError():
            return _budget(exc, 503)
        case BudgetError():  # KVRequestTooLargeError, and the base
            return _budget(exc, 400)
        case ContextLengthExceeded():
            return GatewayError(400, str(exc), param="messages", code="context_length_exceeded")
        case NoHealthyWorker():
            return GatewayError(503, str(exc), code="no_healthy_worker", retry_after_s=2)
        case PoolSaturated():
            return GatewayError(503, str(exc), code="pool_saturated", retry_after_s=1)
        case SloUnattainable():
            return GatewayError(503, str(exc), param=f"x-slo-{exc.objective}-ms",
                                code="slo_unattainable", retry_after_s=exc.retry_after_s)
        case OwnerUnavailable(gone=True):
            return GatewayError(404, str(exc), param="previous_response_id",
                                code="response_owner_gone")
        case OwnerUnavailable():
            return GatewayError(503, str(exc), param="previous_response_id",
                                code="response_owner_unavailable", retry_after_s=2)
        case OwnersUnavailable():
            return GatewayError(503, f"the response-owner map is unavailable: {exc}",
                                code="response_store_unavailable", retry_after_s=1)
        case Overloaded():
            return GatewayError(503, str(exc), code="gateway_overloaded",
                                retry_after_s=exc.retry_after_s)
        case TemplateOptionError():
            return bad_request(str(exc), param=exc.param, code="invalid_template_option")
        case PromptTooLongError():
            return bad_request(str(exc), param="messages", code="context_length_exceeded")
        case PromptTimeoutError():
            return bad_request(str(exc), param="messages", code="prompt_timeout")
        case PromptTooComplexError():
            return bad_request(str(exc), param="messages")
        case UncountableContentError():
            return bad_request(str(exc), param=exc.param, code="unsupported_content")
    return None


def _budget(err: BudgetError, status: int) -> GatewayError:
    return GatewayError(status, err.message, code=err.code, retry_after_s=err.retry_after_s)


def error_response(exc: Exception, path: str) -> Response:
    """The response for any exception a route on ``path`` lets escape: its mapped error, or a
    500 (logged with its traceback: the gateway did not expect it)."""
    err = from_domain(exc)
    if err is None:
        log.error("unhandled error on %s", path, exc_info=exc)
        err = GatewayError(500, "internal error in the gateway", code="internal_error")
    return err.response()
