"""OpenAI-compatible routes: thin; the request path lives in ``gateway.dispatch``.

Every route here requires a valid API key when ``auth.api_keys`` is set (401 otherwise).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from gateway.api.deps import ServicesDep
from gateway.errors import json_response
from gateway.request import Endpoint

router = APIRouter()
_CREATED = int(time.time())


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(request: Request, services: ServicesDep) -> Response:
    return await services.dispatcher.handle(request, Endpoint.CHAT)


@router.post("/v1/completions", response_model=None)
async def completions(request: Request, services: ServicesDep) -> Response:
    return await services.dispatcher.handle(request, Endpoint.COMPLETIONS)


@router.get("/v1/models")
async def models(request: Request, services: ServicesDep) -> Response:
    # Every /v1 route needs a key when keys are configured (the completions check theirs in
    # the dispatcher): the model list is no exception.
    services.api_keys.identify(request)
    served = services.workers.served_models()
    data: list[dict[str, Any]] = [
        {"id": m.name, "object": "model", "created": _CREATED, "owned_by": "kvgate"}
        for m in services.settings.models
        if m.name in served
    ]
    return json_response(200, {"object": "list", "data": data})
