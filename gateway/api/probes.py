"""Liveness, readiness and Prometheus exposition."""

from __future__ import annotations

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import Response

from gateway.api.deps import ServicesDep
from gateway.auth import require_metrics_reader
from gateway.errors import json_response

router = APIRouter()


@router.get("/health")
async def health() -> Response:
    return json_response(200, {"status": "ok"})


@router.get("/ready")
async def ready(request: Request, services: ServicesDep) -> Response:
    ok, pools = services.ready()
    draining = bool(request.app.state.draining)
    return json_response(200 if ok and not draining else 503,
                         {"ready": ok and not draining, "draining": draining,
                          "healthy_workers": pools})


@router.get("/metrics")
async def metrics(request: Request, services: ServicesDep) -> Response:
    require_metrics_reader(request, services.settings.admin)
    services.metrics.backlog.flush()  # every request ended so far counted (gateway.backlog)
    await services.refresh_session_metrics()
    services.sync_kv_event_metrics()
    services.metrics.flush_adds()  # counts summed this loop iteration (Metrics.add)
    return Response(services.exposition.render(), media_type=CONTENT_TYPE_LATEST)
