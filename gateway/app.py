"""create_app(settings): the ASGI app. Services are built in the lifespan and closed on exit.

The two completion routes (and the pooling routes, ``request.POOLING_PATHS``) are the hot path:
``KvgateApp`` hands them straight to the dispatcher and everything else (models, probes, metrics,
admin, the OpenAPI schema) to FastAPI. FastAPI's middleware and dependency machinery cost about
as much as the proxying itself: with the same dispatcher, the direct hand-off served 1.7-2x the
requests per second of the FastAPI route here. The FastAPI routes for the same paths stay
declared (they call the same dispatcher), so the schema documents them and an app mounted
without the wrapper still works.

Errors take one path: whatever escapes a route, the fast path's or FastAPI's, becomes its response
in ``gateway.errors.error_response``. FastAPI's own refusals (unknown route, wrong method, a body
that fails a route's schema) are turned into ``GatewayError`` here, next to the framework that
raises them, so ``gateway.errors`` needs nothing of FastAPI.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.api import admin, openai, probes, ui
from gateway.config import Settings
from gateway.errors import DOMAIN_ERRORS, GatewayError, error_response
from gateway.processes import SINGLE_PROCESS, ProcessRole
from gateway.request import POOLING_PATHS, Endpoint
from gateway.services import Services

HOT_PATHS = {"/v1/chat/completions": Endpoint.CHAT, "/v1/completions": Endpoint.COMPLETIONS,
             "/v1/responses": Endpoint.RESPONSES,
             **POOLING_PATHS}
GC_GEN0_THRESHOLD = 10_000  # Python's default is 700


@contextmanager
def long_lived_heap() -> Iterator[None]:
    """While the app serves: the objects built at start-up are frozen out of garbage collection
    and the youngest generation is collected after 10,000 net allocations instead of 700.

    Start-up objects (tokenizers, settings, the libraries' own) live as long as the process, yet
    every full collection walked all ~130K of them: with the defaults, the collector took ~50 us
    of CPU per short chat (thread time in ``gc.callbacks``, kv_aware + HF tokenizer, c=32), 13
    full collections of ~70 ms in 20K requests, each a pause of every request in flight. Frozen,
    with the larger threshold (a request's objects mostly die by reference count before a
    collection sees them, instead of being promoted mid-request), it took ~7 us. Start-up
    garbage that is cyclic is frozen too; ``unfreeze`` on exit hands it back. What still set
    off the young collections then (one per ~1,000 requests, ~5 ms each) was nearly all one
    reference cycle per request in the server (``gateway.httpd.protocol.Cycle``, since
    broken): now one per ~40,000 short requests, ~0.1 us per request
    (``python -m gateway.bench.overhead.ab --gc``). 50,000 instead of 10,000 was measured again
    then (README, session 13): no gain for short requests, ~4 us less GC per stream; not kept.
    """
    previous = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(GC_GEN0_THRESHOLD, *previous[1:])
    try:
        yield
    finally:
        gc.set_threshold(*previous)
        gc.unfreeze()


class KvgateApp:
    def __init__(self, api: FastAPI) -> None:
        self.api = api
        api.state.draining = False
        self._services: Services | None = None  # set by the lifespan while it serves

    def attach(self, services: Services | None) -> None:
        """The services the hot paths hand requests to (``None``: none now, e.g. on exit; the
        hot paths then fall through to FastAPI's routes, whose dependency says why)."""
        self._services = services

    def start_draining(self) -> None:
        """From now on /ready fails (requests are still served): see ``gateway.server``."""
        self.api.state.draining = True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        services = self._services
        if services is not None and scope["type"] == "http" and scope["method"] == "POST":
            endpoint = HOT_PATHS.get(scope["path"])
            if endpoint is not None:
                request = Request(scope, receive)
                try:
                    response = await services.dispatcher.handle(request, endpoint)
                except Exception as exc:
                    response = error_response(exc, request.url.path)
                await response(scope, receive, send)
                return
        await self.api(scope, receive, send)


class _Lifespan:
    """FastAPI's lifespan (``create_app``): the services started and handed to the app, the heap
    frozen while it serves (``long_lived_heap``), the services closed on exit. A class, not an
    ``asynccontextmanager`` generator, so the module compiles with mypyc (``gateway.native``)."""

    def __init__(self, app: KvgateApp, settings: Settings, role: ProcessRole) -> None:
        self._app = app
        self._settings = settings
        self._role = role
        self._services: Services | None = None
        self._heap: contextlib.AbstractContextManager[None] | None = None

    async def __aenter__(self) -> None:
        services = self._services = await Services.start(self._settings, self._role)
        self._app.api.state.services = services
        self._heap = long_lived_heap()
        self._heap.__enter__()
        self._app.attach(services)

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self._app.attach(None)
        try:
            if self._heap is not None:
                self._heap.__exit__(kind, exc, tb)
        finally:
            if self._services is not None:
                await self._services.close()


def create_app(settings: Settings, role: ProcessRole = SINGLE_PROCESS) -> KvgateApp:
    app: KvgateApp | None = None

    def lifespan(_: FastAPI) -> _Lifespan:
        assert app is not None
        return _Lifespan(app, settings, role)

    api = FastAPI(title="kvgate", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(api)
    api.include_router(openai.router)
    api.include_router(probes.router)
    api.include_router(admin.router)
    if settings.admin.ui_enabled:
        api.include_router(ui.router)
    app = KvgateApp(api)
    return app


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
