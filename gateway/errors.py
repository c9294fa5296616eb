"""Typed errors -> OpenAI-shaped JSON: ``{"error": {"message", "type", "param", "code"}}``.

Everything the gateway refuses goes through ``GatewayError``; the app installs handlers so that
unknown routes, wrong methods and unexpected exceptions come out in the same shape.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

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


def install_error_handlers(app: FastAPI) -> None:
    async def on_gateway_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, GatewayError)
        return exc.response()

    async def on_http_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        err = GatewayError(exc.status_code, str(exc.detail), code=code)
        resp = err.response()
        if exc.headers:
            resp.headers.update(exc.headers)
        return resp

    async def on_validation_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        msg = f"{loc}: {first.get('msg', 'invalid request')}" if loc else "invalid request"
        return GatewayError(400, msg, param=loc or None).response()

    async def on_unexpected(_: Request, exc: Exception) -> Response:
        log.exception("unhandled error", exc_info=exc)
        return GatewayError(500, "internal error in the gateway", code="internal_error").response()

    app.add_exception_handler(GatewayError, on_gateway_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(Exception, on_unexpected)
