"""OpenAI-compatible routes: thin; the request path lives in ``gateway.dispatch``.

Every route here requires a valid API key when ``auth.api_keys`` is set (401 otherwise).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from gateway.api.deps import ServicesDep
from gateway.errors import json_response
from gateway.request import POOLING_PATHS, Endpoint
from gateway.services import Services

router = APIRouter()
_CREATED = int(time.time())


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(request: Request, services: ServicesDep) -> Response:
    return await services.dispatcher.handle(request, Endpoint.CHAT)


@router.post("/v1/completions", response_model=None)
async def completions(request: Request, services: ServicesDep) -> Response:
    return await services.dispatcher.handle(request, Endpoint.COMPLETIONS)


# The Responses API: created like chat; a stored response is read and cancelled on the worker
# that holds it (``gateway.budgets.owners``).
@router.post("/v1/responses", response_model=None)
async def responses(request: Request, services: ServicesDep) -> Response:
    return await services.dispatcher.handle(request, Endpoint.RESPONSES)


@router.get("/v1/responses/{response_id}", response_model=None)
async def retrieve_response(response_id: str, request: Request,
                            services: ServicesDep) -> Response:
    return await services.dispatcher.stored_response(request, response_id)


@router.post("/v1/responses/{response_id}/cancel", response_model=None)
async def cancel_response(response_id: str, request: Request,
                          services: ServicesDep) -> Response:
    return await services.dispatcher.stored_response(request, response_id, cancel=True)


def _pooling_route(endpoint: Endpoint) -> Callable[[Request, Services], Awaitable[Response]]:
    async def pooling(request: Request, services: ServicesDep) -> Response:
        return await services.dispatcher.handle(request, endpoint)
    return pooling


# vLLM's pooling routes, for models declared `runner: pooling` (``gateway.prompt.pooling``).
for _path, _endpoint in POOLING_PATHS.items():
    router.add_api_route(_path, _pooling_route(_endpoint), methods=["POST"], response_model=None,
                         name=f"{_endpoint.value} ({_path})")


@router.post("/tokenize", response_model=None)
async def tokenize(request: Request, services: ServicesDep) -> Response:
    return await services.dispatcher.tokenize(request)


@router.post("/detokenize", response_model=None)
async def detokenize(request: Request, services: ServicesDep) -> Response:
    return await services.dispatcher.tokenize(request, detokenize=True)


@router.get("/v1/models")
async def models(request: Request, services: ServicesDep) -> Response:
    # Every /v1 route needs a key when keys are configured (the completions check theirs in
    # the dispatcher): the model list is no exception.
    tenant = services.api_keys.identify(request)
    may_use = functools.partial(services.api_keys.may_use, tenant)  # the key's models only
    served = services.workers.served_models()
    bases = {m.name for m in services.settings.models if m.name in served}
    data: list[dict[str, Any]] = [
        {"id": m.name, "object": "model", "created": _CREATED, "owned_by": "kvgate",
         "root": m.name, "parent": None}
        for m in services.settings.models
        if m.name in bases and may_use(m.name)
    ]
    # Loaded LoRA adapters, with their base model as `parent` (vLLM's cards), then aliases,
    # each with its served name as `root`, listed while that name is.
    listed = {card["id"] for card in data}
    adapters = {a: p for a, p in services.dispatcher.catalog.loaded_adapters().items()
                if p in bases and may_use(a)}
    data += [{"id": a, "object": "model", "created": _CREATED, "owned_by": "kvgate",
              "root": a, "parent": p} for a, p in sorted(adapters.items())]
    listed |= adapters.keys()
    data += [{"id": alias, "object": "model", "created": _CREATED, "owned_by": "kvgate",
              "root": served_name, "parent": None}
             for alias, served_name in services.settings.model_aliases.items()
             if served_name in listed]
    return json_response(200, {"object": "list", "data": data})
