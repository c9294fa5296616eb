"""The admin API (admin token required): tenants, sessions, throttles, Alertmanager's webhook.

Identity is (tenant, session): a session is addressed inside its tenant
(``/admin/tenants/{tenant}/sessions/{session_id}``), and a whole tenant (every session id its key
uses) has its own usage and throttle (``/admin/tenants/{tenant}``). Tenants are the configured API
keys' names, or ``anonymous`` when there are none; any other tenant is 404.

``POST /admin/alerts`` takes Alertmanager's webhook payload (version 4). Every alert carrying a
``tenant`` label throttles, while it fires, the session its ``session`` label names in that
tenant, or the whole tenant when it has no ``session`` label (an alert with only ``session`` is
the ``anonymous`` tenant's). The state comes from its ``throttle`` label (``throttled`` by
default, or ``blocked``), for ``admin.alert_throttle_ttl_s``, renewed each time Alertmanager
repeats it; the throttle is lifted when the alert resolves.

``GET /admin/routing/explain?request_id=ID`` answers "why did this request hit so little?" for
one of the last ``routing.explain_requests`` routed chat/completions requests of this gateway
process (``ID``: the ``x-request-id`` the gateway answered with): pool, policy, reason, the chosen
worker, every candidate's cached and pending tokens, load and (``kv_aware``) cost terms, the
fleet's best, what vLLM delivered, and where each lost token went
(``gateway.routing.accounting``). The cost terms are recomputed here, off the request path, from
the snapshot the policy saw, by the pool's ``kv_aware`` weights. With ``--processes N`` each
process keeps the requests it served; an id it does not hold is asked of the other processes
(``gateway.api.siblings``). ``GET /admin/routing/accounting``: the gateway's totals per pool by
outcome (every process's added up), and the models flagged for a tokenizer/template mismatch.

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
from gateway.api.siblings import ask_siblings, asked_by_sibling
from gateway.auth import require_admin
from gateway.budgets.models import Limits, SessionUsage
from gateway.budgets.session_id import ANONYMOUS_TENANT
from gateway.config import PolicyName
from gateway.errors import GatewayError, json_response
from gateway.routing.accounting import HitLedger, HitRecord
from gateway.routing.kv_aware import KvAware
from gateway.routing.types import RoutingRequest

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


def usage_json(u: SessionUsage, limits: Limits) -> dict[str, Any]:
    out = dataclasses.asdict(u)
    out["throttle"] = None if u.throttle is None else {
        **dataclasses.asdict(u.throttle), "state": str(u.throttle.state.value)}
    out["limits"] = dataclasses.asdict(limits.session if u.session_id is not None
                                       else limits.tenant)
    return out


def _known(services: ServicesDep, tenant: str) -> str:
    """``tenant`` if this gateway serves it, else 404."""
    if tenant not in services.budgets.tenants:
        raise GatewayError(404, f"no tenant {tenant!r}: tenants are the API keys' names",
                           param="tenant", code="tenant_not_found")
    return tenant


async def _usage(services: ServicesDep, tenant: str, session_id: str | None) -> Response:
    usage = await services.budgets.usage(_known(services, tenant), session_id)
    if usage is None:
        what = "tenant" if session_id is None else "session"
        name = tenant if session_id is None else session_id
        raise GatewayError(404, f"{what} {name!r} holds nothing and has no throttle",
                           code=f"{what}_not_found")
    return json_response(200, usage_json(usage, services.budgets.limits_for(tenant)))


async def _throttle(services: ServicesDep, tenant: str, session_id: str | None,
                    body: ThrottleBody) -> Response:
    try:
        t = await services.budgets.throttle(
            _known(services, tenant), session_id, body.state, ttl_s=body.ttl_s,
            reason=body.reason, max_inflight_requests=body.max_inflight_requests,
            budget_factor=body.budget_factor,
        )
    except ValueError as exc:
        raise GatewayError(400, str(exc), param="session_id") from None
    log.info("tenant %s session %s %s by operator for %.0f s", tenant, session_id or "(all)",
             body.state, body.ttl_s)
    return json_response(200, {**dataclasses.asdict(t), "state": str(t.state.value),
                               "tenant": tenant, "session_id": session_id})


async def _unthrottle(services: ServicesDep, tenant: str, session_id: str | None) -> Response:
    try:
        lifted = await services.budgets.unthrottle(_known(services, tenant), session_id)
    except ValueError as exc:
        raise GatewayError(400, str(exc), param="session_id") from None
    return json_response(200, {"tenant": tenant, "session_id": session_id, "lifted": lifted})


@router.get("/sessions")
async def sessions(services: ServicesDep,
                   top: Annotated[int | None, Query(ge=1, le=1000)] = None,
                   tenant: str | None = None) -> Response:
    """The top sessions by KV held (``budgets.top_k`` unless ``top`` is given), of every tenant
    or of ``tenant``."""
    rows = await services.budgets.sessions(
        top, tenant=None if tenant is None else _known(services, tenant))
    data = [usage_json(u, services.budgets.limits_for(u.tenant)) for u in rows]
    return json_response(200, {"object": "list", "data": data})


@router.get("/tenants")
async def tenants(services: ServicesDep) -> Response:
    """Every tenant holding KV or with state, most KV held first."""
    rows = await services.budgets.tenants_usage()
    data = [usage_json(u, services.budgets.limits_for(u.tenant)) for u in rows]
    return json_response(200, {"object": "list", "data": data})


@router.get("/tenants/{tenant}")
async def tenant_usage(tenant: str, services: ServicesDep) -> Response:
    return await _usage(services, tenant, None)


@router.get("/tenants/{tenant}/sessions/{session_id}")
async def session(tenant: str, session_id: str, services: ServicesDep) -> Response:
    return await _usage(services, tenant, session_id)


@router.post("/tenants/{tenant}/throttle")
async def throttle_tenant(tenant: str, body: ThrottleBody, services: ServicesDep) -> Response:
    """Throttle or block the whole tenant, whatever session ids it uses."""
    return await _throttle(services, tenant, None, body)


@router.delete("/tenants/{tenant}/throttle")
async def unthrottle_tenant(tenant: str, services: ServicesDep) -> Response:
    return await _unthrottle(services, tenant, None)


@router.post("/tenants/{tenant}/sessions/{session_id}/throttle")
async def throttle(tenant: str, session_id: str, body: ThrottleBody,
                   services: ServicesDep) -> Response:
    return await _throttle(services, tenant, session_id, body)


@router.delete("/tenants/{tenant}/sessions/{session_id}/throttle")
async def unthrottle(tenant: str, session_id: str, services: ServicesDep) -> Response:
    return await _unthrottle(services, tenant, session_id)


MAX_REQUEST_ID_CHARS = 128


def _ledger(services: ServicesDep) -> HitLedger:
    ledger: HitLedger = services.dispatcher.hits
    return ledger


def explain_json(record: HitRecord, ledger: HitLedger) -> dict[str, Any]:
    """One routed request, explained (see the module docstring)."""
    pool = record.pool
    kv_aware = KvAware(pool.kv_aware) if pool.policy == PolicyName.KV_AWARE else None
    asked = RoutingRequest(model=record.model, prompt_tokens=record.prompt_tokens, max_tokens=0)
    candidates = []
    for i, c in enumerate(record.candidates):
        # Every field of the candidate as the policy saw it (cached and pending tokens, load,
        # block size, saturation, and whatever a policy comes to read).
        row: dict[str, Any] = {"worker": c.worker_id, "chosen": c.worker_id == record.worker,
                               **dataclasses.asdict(c)}
        del row["worker_id"]
        if kv_aware is not None:
            score = kv_aware.score(asked, c, i)
            row["cost"] = {f.name: getattr(score, f.name) for f in dataclasses.fields(score)
                           if f.name not in ("index", "candidate")}
        candidates.append(row)
    b = record.buckets
    return {
        "request_id": record.request_id,
        "state": "ended" if b is not None else "in_flight",
        "model": record.model,
        "pool": pool.name,
        "policy": record.policy,
        "reason": record.reason,
        "worker": record.worker,
        "moves": record.moves,
        "routed_at": record.routed_at_s,
        "prompt_tokens": record.prompt_tokens,
        "fleet_best_tokens": record.fleet_best_tokens,
        "predicted_cached_tokens": record.predicted_tokens,
        "delivered_cached_tokens": record.delivered_tokens,
        "ceiling_tokens": None if b is None else b.ceiling_tokens,
        "lost_tokens": None if b is None else b.lost_tokens,
        "outcomes": None if b is None else dict(b.items()),
        "model_mismatch": record.model in ledger.detector.flagged,
        "candidates": candidates,
        "held_back": [{"worker": w, "cached_tokens": t} for w, t in record.held_back],
    }


@router.get("/routing/explain")
async def routing_explain(request: Request, services: ServicesDep,
                          request_id: str | None = None) -> Response:
    """Why one recent request was routed where it was, and where its prompt tokens went."""
    if not request_id:
        raise GatewayError(400, "request_id is required: the x-request-id the gateway answered"
                           " with", param="request_id", code="missing_request_id")
    ledger = _ledger(services)
    known = len(request_id) <= MAX_REQUEST_ID_CHARS
    record = ledger.get(request_id) if known else None
    if record is not None:
        return json_response(200, explain_json(record, ledger))
    if known and not asked_by_sibling(request.headers):
        # With --processes N another process may have served it (its own ring).
        asked = await ask_siblings(services.role, request.url.path,
                                   {"request_id": request_id}, request.headers)
        for status, body in asked.answers:
            if status == 200:
                return json_response(200, body)
    where = ("this gateway process" if services.role.count == 1 or asked_by_sibling(
        request.headers) else f"each of this gateway's {services.role.count} processes")
    raise GatewayError(404, f"no request {request_id[:MAX_REQUEST_ID_CHARS]!r} among the last"
                       f" {ledger.capacity} routed chat/completions requests of {where}"
                       " (routing.explain_requests)", param="request_id",
                       code="request_not_found")


@router.get("/routing/accounting")
async def routing_accounting(request: Request, services: ServicesDep) -> Response:
    """Prompt tokens per pool by outcome, with the hit rate and its ceiling: the whole
    gateway's (every process's totals added up), or one process's when a sibling asks."""
    ledger = _ledger(services)
    totals = {name: dict(t) for name, t in ledger.totals().items()}
    kept, flagged = len(ledger), set(ledger.detector.flagged)
    processes, answered = 1, 1
    if services.role.count > 1 and not asked_by_sibling(request.headers):
        asked = await ask_siblings(services.role, request.url.path, {}, request.headers)
        processes += asked.asked
        for status, body in asked.answers:
            if status != 200:
                continue
            answered += 1
            kept += int(body.get("requests_kept", 0))
            flagged.update(body.get("mismatched_models", []))
            for row in body.get("data", []):
                pool = totals.setdefault(str(row["pool"]), {})
                for outcome, tokens in row["outcomes"].items():
                    pool[outcome] = pool.get(outcome, 0) + int(tokens)
    pools = []
    for name, t in sorted(totals.items()):
        total = sum(t.values())
        # Over every prompt token accounted: with tokens of unknown outcome (workers without
        # --enable-prompt-tokens-details) the hit ratio is a lower bound.
        pools.append({
            "pool": name, "prompt_tokens": total, "outcomes": t,
            "hit_ratio": t.get("delivered", 0) / total if total else None,
            "ceiling_ratio": (total - t.get("never_seen", 0)) / total if total else None,
        })
    return json_response(200, {
        "object": "list", "data": pools, "requests_kept": kept,
        "mismatched_models": sorted(flagged), "processes": processes,
        "processes_answered": answered,
    })


@router.post("/alerts")
async def alerts(payload: AlertmanagerPayload, services: ServicesDep) -> Response:
    ttl_s = services.settings.admin.alert_throttle_ttl_s
    throttled: list[dict[str, str | None]] = []
    lifted: list[dict[str, str | None]] = []
    for alert in payload.alerts:
        session_id = alert.labels.get("session") or None
        tenant = alert.labels.get("tenant") or (ANONYMOUS_TENANT if session_id else None)
        if tenant is None or tenant not in services.budgets.tenants:
            continue
        who = {"tenant": tenant, "session_id": session_id}
        reason = alert.labels.get("alertname", "alert")  # names the alert that manages it
        try:
            usage = await services.budgets.usage(tenant, session_id)
            current = usage.throttle if usage is not None else None
            # An alert never loosens or lifts what someone else (an operator, another alert)
            # set: it only manages the throttle that carries its own reason.
            if alert.status == "firing":
                state = "blocked" if alert.labels.get("throttle") == "blocked" else "throttled"
                if current is not None and current.reason != reason and (
                    current.state.value == "blocked" or state == "throttled"):
                    continue
                await services.budgets.throttle(tenant, session_id, state, ttl_s=ttl_s,
                                                reason=reason)
                throttled.append(who)
            elif (current is not None and current.reason == reason
                  and await services.budgets.unthrottle(tenant, session_id)):
                lifted.append(who)
        except ValueError:
            continue  # a label that is not a usable session id
    if throttled or lifted:
        log.info("alerts: throttled %s, lifted %s", throttled, lifted)
    return json_response(200, {"throttled": throttled, "lifted": lifted})
