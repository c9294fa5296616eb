"""The admin API (admin token required): sessions, throttles, and Alertmanager's webhook.

``POST /admin/alerts`` takes Alertmanager's webhook payload (version 4). Every alert carrying a
``session`` label throttles that session while it fires (state from its ``throttle`` label:
``throttled`` by default, or ``blocked``; for ``admin.alert_throttle_ttl_s``, renewed each time
Alertmanager repeats it) and lifts the throttle when it resolves.

A ``BudgetError`` (the Redis store down under ``fail_closed``) is left to the app's error handler:
``gateway.errors`` maps it as for completions.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response

from gateway.api.deps import ServicesDep
from gateway.auth import require_admin
from gateway.budgets.models import BudgetLimits, SessionUsage
from gateway.errors import GatewayError, json_response

log = logging.getLogger(__name__)


async def admin_only(request: Request, services: ServicesDep) -> None:
    require_admin(request, services.settings.admin, services.api_keys)


router = APIRouter(prefix="/admin", dependencies=[Depends(admin_only)])


class ThrottleBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    state: Literal["throttled", "blocked"] = "throttled"
    ttl_s: float = Field(900.0, gt=0, le=30 * 86400)
    reason: str = Field("operator", max_length=200)
    max_inflight_requests: int | None = Field(1, ge=1)
    budget_factor: float = Field(1.0, gt=0, le=1)


class AlertmanagerAlert(BaseModel):
    model_config = ConfigDict(extra="allow")

    status: Literal["firing", "resolved"]
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class AlertmanagerPayload(BaseModel):
    """Alertmanager's webhook body (version 4); fields the gateway does not use are kept aside."""

    model_config = ConfigDict(extra="allow")

    version: str = "4"
    status: Literal["firing", "resolved"]
    alerts: list[AlertmanagerAlert]


def usage_json(u: SessionUsage, limits: BudgetLimits) -> dict[str, Any]:
    out = dataclasses.asdict(u)
    out["throttle"] = None if u.throttle is None else {
        **dataclasses.asdict(u.throttle), "state": str(u.throttle.state.value)}
    out["limits"] = dataclasses.asdict(limits)
    return out


@router.get("/sessions")
async def sessions(services: ServicesDep,
                   top: Annotated[int | None, Query(ge=1, le=1000)] = None) -> Response:
    """The top sessions by KV held (``budgets.top_k`` unless ``top`` is given)."""
    rows = await services.budgets.sessions(top)
    data = [usage_json(u, services.limits_of(u.session_id)) for u in rows]
    return json_response(200, {"object": "list", "data": data})


@router.get("/sessions/{session_id}")
async def session(session_id: str, services: ServicesDep) -> Response:
    usage = await services.budgets.session(session_id)
    if usage is None:
        raise GatewayError(404, f"session {session_id!r} holds nothing and has no throttle",
                           code="session_not_found")
    return json_response(200, usage_json(usage, services.limits_of(session_id)))


@router.post("/sessions/{session_id}/throttle")
async def throttle(session_id: str, body: ThrottleBody, services: ServicesDep) -> Response:
    try:
        t = await services.budgets.throttle(
            session_id, body.state, ttl_s=body.ttl_s, reason=body.reason,
            max_inflight_requests=body.max_inflight_requests, budget_factor=body.budget_factor,
        )
    except ValueError as exc:
        raise GatewayError(400, str(exc), param="session_id") from None
    log.info("session %s %s by operator for %.0f s", session_id, body.state, body.ttl_s)
    return json_response(200, {**dataclasses.asdict(t), "state": str(t.state.value)})


@router.delete("/sessions/{session_id}/throttle")
async def unthrottle(session_id: str, services: ServicesDep) -> Response:
    lifted = await services.budgets.unthrottle(session_id)
    return json_response(200, {"session_id": session_id, "lifted": lifted})


@router.post("/alerts")
async def alerts(payload: AlertmanagerPayload, services: ServicesDep) -> Response:
    ttl_s = services.settings.admin.alert_throttle_ttl_s
    throttled: list[str] = []
    lifted: list[str] = []
    for alert in payload.alerts:
        session_id = alert.labels.get("session")
        if not session_id:
            continue
        name = alert.labels.get("alertname", "alert")
        reason = name  # the throttle's reason names the alert that manages it
        try:
            usage = await services.budgets.session(session_id)
            current = usage.throttle if usage is not None else None
            # An alert never loosens or lifts what someone else (an operator, another alert)
            # set: it only manages the throttle that carries its own reason.
            if alert.status == "firing":
                state = "blocked" if alert.labels.get("throttle") == "blocked" else "throttled"
                if current is not None and current.reason != reason and (
                    current.state.value == "blocked" or state == "throttled"):
                    continue
                await services.budgets.throttle(session_id, state, ttl_s=ttl_s, reason=reason)
                throttled.append(session_id)
            elif (current is not None and current.reason == reason
                  and await services.budgets.unthrottle(session_id)):
                lifted.append(session_id)
        except ValueError:
            continue  # a label that is not a usable session id
    if throttled or lifted:
        log.info("alerts: throttled %s, lifted %s", throttled, lifted)
    return json_response(200, {"throttled": throttled, "lifted": lifted})
