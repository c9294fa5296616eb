"""create_app(settings): the ASGI app. Services are built in the lifespan and closed on exit.

The two completion routes are the hot path: ``KvgateApp`` hands them straight to the dispatcher and
everything else (models, probes, metrics, admin, the OpenAPI schema) to FastAPI. FastAPI's
middleware and dependency machinery cost about as much as the proxying itself: with the same
dispatcher, the direct hand-off served 1.7-2x the requests per second of the FastAPI route here.
The FastAPI routes for the same paths stay declared (they call the same dispatcher), so the schema
documents them and an app mounted without the wrapper still works.

Errors take one path: whatever escapes a route, the fast path's or FastAPI's, becomes its response
in ``gateway.errors.error_response``. FastAPI's own refusals (unknown route, wrong method, a body
that fails a route's schema) are turned into ``GatewayError`` here, next to the framework that
raises them, so ``gateway.errors`` needs nothing of FastAPI.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.api import admin, openai, probes, ui
from gateway.config import Settings
from gateway.errors import DOMAIN_ERRORS, GatewayError, error_response
from gateway.request import Endpoint
from gateway.services import Services

HOT_PATHS = {"/v1/chat/completions": Endpoint.CHAT, "/v1/completions": Endpoint.COMPLETIONS}


class KvgateApp:
    def __init__(self, api: FastAPI) -> None:
        self.api = api
        api.state.draining = False

    def start_draining(self) -> None:
        """From now on /ready fails (requests are still served): see ``gateway.server``."""
        self.api.state.draining = True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = HOT_PATHS.get(scope["path"])
            if endpoint is not None:
                response = await self._complete(Request(scope, receive), endpoint)
                await response(scope, receive, send)
                return
        await self.api(scope, receive, send)

    async def _complete(self, request: Request, endpoint: Endpoint) -> Response:
        services: Services = self.api.state.services
        try:
            return await services.dispatcher.handle(request, endpoint)
        except Exception as exc:
            return error_response(exc, request.url.path)


def create_app(settings: Settings) -> KvgateApp:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        services = await Services.start(settings)
        app.state.services = services
        try:
            yield
        finally:
            await services.close()

    api = FastAPI(title="kvgate", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(api)
    api.include_router(openai.router)
    api.include_router(probes.router)
    api.include_router(admin.router)
    if settings.admin.ui_enabled:
        api.include_router(ui.router)
    return KvgateApp(api)


def install_error_handlers(app: FastAPI) -> None:
    async def on_error(request: Request, exc: Exception) -> Response:
        return error_response(exc, request.url.path)

    async def on_http_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        resp = GatewayError(exc.status_code, str(exc.detail), code=code).response()
        if exc.headers:
            resp.headers.update(exc.headers)
        return resp

    async def on_validation_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        msg = f"{loc}: {first.get('msg', 'invalid request')}" if loc else "invalid request"
        return GatewayError(400, msg, param=loc or None).response()

    for error in DOMAIN_ERRORS:
        app.add_exception_handler(error, on_error)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(Exception, on_error)
