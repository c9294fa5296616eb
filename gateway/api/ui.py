"""A small live status page: ``GET /ui`` (HTML) and ``GET /ui/state`` (the JSON it polls).

The page is one self-contained document (inline CSS and JS, no CDN, no external request) that
fetches ``/ui/state`` every 2 s and redraws pools, workers (up, in flight, KV usage, prefix hit
ratio, vLLM's running/waiting), hit accounting per pool (where the routed prompt tokens went:
delivered from vLLM's prefix cache, never seen, lost to load, KV pressure, a stale index, an
eviction, a tokenizer/template mismatch, or of unknown outcome: ``gateway.routing.accounting``;
this process's totals, and the models flagged for a mismatch), the tenants (API keys) and the
sessions holding the most KV, each session with its tenant. Values a client controls (session ids) are put in the page with
``textContent``, never as HTML.

The state is read from ``request.app.state.services`` at each call: settings (pools), the worker
registry, and the budget service when there is one (``budgets`` absent or ``None``: no sessions).

Who sees the tenants and sessions: anyone where the gateway has no API keys (one tenant: the demo,
one team); where it has keys, only a caller with the admin token (``Authorization: Bearer``),
since session ids are often end users' ids and no key may see another's. Others get
``sessions_hidden: true`` and the rest of the page. The page sends the token it finds in its own
URL's fragment (``/ui#token=TOKEN``: a fragment never leaves the browser, so no log keeps it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol

from fastapi import APIRouter, Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from gateway.auth import require_admin
from gateway.errors import GatewayError

log = logging.getLogger(__name__)

router = APIRouter()

TOP_SESSIONS = 10


class _SessionUsage(Protocol):
    @property
    def tenant(self) -> str: ...
    @property
    def session_id(self) -> str | None: ...
    @property
    def inflight_kv_bytes(self) -> int: ...
    @property
    def inflight_requests(self) -> int: ...
    @property
    def throttle(self) -> Any: ...


class _Budgets(Protocol):
    async def sessions(self, top: int | None = None) -> Sequence[_SessionUsage]: ...
    async def tenants_usage(self) -> Sequence[_SessionUsage]: ...


def _throttle_json(throttle: Any) -> dict[str, Any] | None:
    if throttle is None:
        return None
    state = getattr(throttle, "state", "throttled")
    return {
        "state": str(getattr(state, "value", state)),
        "expires_in_s": max(0.0, round(float(throttle.expires_at) - time.time(), 1)),
        "reason": str(getattr(throttle, "reason", "")),
    }


def _usage_json(rows: Sequence[_SessionUsage]) -> list[dict[str, Any]]:
    return [
        {
            "tenant": u.tenant,
            "session": u.session_id,
            "kv_bytes": int(u.inflight_kv_bytes),
            "requests": int(u.inflight_requests),
            "throttle": _throttle_json(u.throttle),
        }
        for u in rows
    ]


async def _sessions(
    services: Any,
) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]] | None, str | None]:
    """The top sessions and the tenants (``None`` without budgets), or an error to show."""
    budgets: _Budgets | None = getattr(services, "budgets", None)
    if budgets is None:
        return None, None, None
    try:
        sessions = await budgets.sessions(TOP_SESSIONS)
        tenants = await budgets.tenants_usage()
    except Exception as exc:  # a store outage must not take the status page down
        log.warning("ui: cannot read sessions: %s", exc)
        return [], [], f"sessions unavailable: {type(exc).__name__}"
    return _usage_json(sessions), _usage_json(tenants), None


def _hits(services: Any) -> dict[str, Any] | None:
    """Per pool, prompt tokens by outcome and each outcome's share; None without a dispatcher
    (a gateway that routes nothing)."""
    ledger = getattr(getattr(services, "dispatcher", None), "hits", None)
    if ledger is None:
        return None
    pools = []
    for name, outcomes in sorted(ledger.totals().items()):
        total = sum(outcomes.values())
        pools.append({"pool": name, "prompt_tokens": total, "outcomes": outcomes,
                      "shares": {k: (v / total if total else 0.0) for k, v in outcomes.items()}})
    return {"pools": pools, "mismatched_models": sorted(ledger.detector.flagged)}


async def state(services: Any, *, sessions_visible: bool = True) -> dict[str, Any]:
    """What the page shows, as JSON-ready data (tenants and sessions ``None`` when not
    ``sessions_visible``)."""
    workers = [
        {
            "url": w.url,
            "pool": w.pool,
            "healthy": bool(w.healthy),
            "inflight": int(w.gateway_inflight),  # over every gateway process
            "kv_usage_ratio": float(w.stats.kv_usage_ratio),
            "prefix_hit_ratio": float(w.stats.prefix_hit_ratio),
            "running": int(w.stats.running),
            "waiting": int(w.stats.waiting),
        }
        for w in services.workers
    ]
    pools = []
    for p in services.settings.pools:
        mine = [w for w in workers if w["pool"] == p.name]
        pools.append({
            "name": p.name,
            "policy": p.policy,
            "max_context_tokens": p.max_context_tokens,
            "workers": len(mine),
            "healthy": sum(1 for w in mine if w["healthy"]),
            "inflight": sum(w["inflight"] for w in mine),
        })
    sessions, tenants, sessions_error = (await _sessions(services) if sessions_visible
                                         else (None, None, None))
    return {
        "time": time.time(),
        "pools": pools,
        "workers": workers,
        "tenants": tenants,
        "sessions": sessions,
        "sessions_error": sessions_error,
        "sessions_hidden": not sessions_visible,
        "hits": _hits(services),
    }


def sessions_visible(request: Request, services: Any) -> bool:
    """Whether this caller may see tenants and sessions (module docstring)."""
    settings = services.settings
    if not settings.auth.api_keys:
        return True
    try:
        require_admin(request, settings.admin, services.api_keys)
    except GatewayError:
        return False
    return True


@router.get("/ui/state", include_in_schema=False)
async def ui_state(request: Request) -> Response:
    services = request.app.state.services
    return JSONResponse(await state(services,
                                    sessions_visible=sessions_visible(request, services)),
                        headers={"Cache-Control": "no-store"})


@router.get("/ui", include_in_schema=False)
async def ui_page() -> Response:
    return HTMLResponse(PAGE, headers={
        "Cache-Control": "no-store",
        # Nothing but this document and its own /ui/state.
        "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline';"
                                   " style-src 'unsafe-inline'; connect-src 'self'",
    })


PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>kvgate status</title>
<style>
  :root { --bg: #0f1419; --panel: #161c23; --line: #263040; --text: #d8dee9; --dim: #8893a5;
          --ok: #3fb950; --bad: #f85149; --warn: #d29922; --bar: #388bfd; }
  * { box-sizing: border-box; }
  body { margin: 0; padding: 18px 24px; background: var(--bg); color: var(--text);
         font: 14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; }
  header { display: flex; align-items: baseline; gap: 16px; margin-bottom: 14px; }
  h1 { font-size: 20px; margin: 0; }
  h2 { font-size: 15px; margin: 0 0 8px; color: var(--dim); font-weight: 600;
       text-transform: uppercase; letter-spacing: .04em; }
  #updated { color: var(--dim); font-size: 13px; }
  #updated.stale { color: var(--bad); }
  section { background: var(--panel); border: 1px solid var(--line); border-radius: 8px;
            padding: 12px 14px; margin-bottom: 14px; }
  table { width: 100%; border-collapse: collapse; }
  th, td { text-align: left; padding: 5px 8px; border-bottom: 1px solid var(--line);
           white-space: nowrap; }
  th { color: var(--dim); font-weight: 500; font-size: 12px; }
  td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
  tr:last-child td { border-bottom: none; }
  .pill { display: inline-block; padding: 1px 8px; border-radius: 10px; font-size: 12px;
          font-weight: 600; }
  .up { background: rgba(63,185,80,.15); color: var(--ok); }
  .down { background: rgba(248,81,73,.15); color: var(--bad); }
  .throttled { background: rgba(210,153,34,.15); color: var(--warn); }
  .bar { position: relative; width: 140px; height: 14px; background: #0b0f14;
         border: 1px solid var(--line); border-radius: 3px; display: inline-block;
         vertical-align: middle; }
  .bar > i { position: absolute; left: 0; top: 0; bottom: 0; background: var(--bar);
             border-radius: 2px; }
  .bar.hot > i { background: var(--bad); }
  .barval { display: inline-block; width: 48px; text-align: right; margin-left: 6px;
            font-variant-numeric: tabular-nums; }
  .empty { color: var(--dim); font-style: italic; }
  .grid { display: grid; grid-template-columns: 1fr; gap: 0; }
</style>
</head>
<body>
<header>
  <h1>kvgate</h1>
  <span id="updated">loading...</span>
</header>
<section>
  <h2>Pools</h2>
  <table id="pools"><thead><tr>
    <th>pool</th><th>policy</th><th class="num">context limit</th>
    <th class="num">healthy workers</th><th class="num">in flight</th>
  </tr></thead><tbody></tbody></table>
</section>
<section>
  <h2>Workers</h2>
  <table id="workers"><thead><tr>
    <th>worker</th><th>pool</th><th>state</th><th class="num">in flight</th>
    <th>KV cache usage</th><th>prefix hit ratio</th>
    <th class="num">vLLM running</th><th class="num">vLLM waiting</th>
  </tr></thead><tbody></tbody></table>
</section>
<section>
  <h2>Hit accounting</h2>
  <p id="mismatch" class="empty"></p>
  <table id="hits"><thead><tr>
    <th>pool</th><th class="num">prompt tokens</th><th>delivered (hit)</th>
    <th class="num">never seen</th><th class="num">load</th><th class="num">KV pressure</th>
    <th class="num">stale index</th><th class="num">evicted</th><th class="num">mismatch</th>
    <th class="num">unknown</th>
  </tr></thead><tbody></tbody></table>
</section>
<section>
  <h2>Tenants by KV held</h2>
  <table id="tenants"><thead><tr>
    <th>tenant</th><th class="num">KV held</th><th class="num">requests in flight</th>
    <th>throttle</th>
  </tr></thead><tbody></tbody></table>
</section>
<section>
  <h2>Top sessions by KV held</h2>
  <table id="sessions"><thead><tr>
    <th>tenant</th><th>session</th><th class="num">KV held</th>
    <th class="num">requests in flight</th><th>throttle</th>
  </tr></thead><tbody></tbody></table>
</section>
<script>
"use strict";
const STATE_URL = location.pathname.replace(/\\/+$/, "") + "/state";
const REFRESH_MS = 2000;

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}
function row(cells) {
  const tr = document.createElement("tr");
  for (const c of cells) tr.appendChild(c);
  return tr;
}
function num(v) { return el("td", v, "num"); }
function pct(v) { return (100 * v).toFixed(1) + "%"; }
function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : String(n)) + " " + units[i];
}
function bar(ratio, hotAt) {
  const td = el("td");
  const b = el("span", null, "bar" + (ratio >= hotAt ? " hot" : ""));
  const fill = el("i");
  fill.style.width = Math.max(0, Math.min(1, ratio)) * 100 + "%";
  b.appendChild(fill);
  td.appendChild(b);
  td.appendChild(el("span", pct(ratio), "barval"));
  return td;
}
function pill(text, cls) { const td = el("td"); td.appendChild(el("span", text, "pill " + cls)); return td; }
function fill(id, rows, emptyText, cols) {
  const body = document.querySelector("#" + id + " tbody");
  body.replaceChildren();
  if (!rows.length) {
    const td = el("td", emptyText, "empty");
    td.colSpan = cols;
    body.appendChild(row([td]));
    return;
  }
  for (const r of rows) body.appendChild(r);
}

function render(s) {
  fill("pools", s.pools.map(p => row([
    el("td", p.name), el("td", p.policy), num(p.max_context_tokens.toLocaleString("en")),
    num(p.healthy + " / " + p.workers), num(p.inflight),
  ])), "no pools", 5);
  fill("workers", s.workers.map(w => row([
    el("td", w.url), el("td", w.pool), pill(w.healthy ? "up" : "down", w.healthy ? "up" : "down"),
    num(w.inflight), bar(w.kv_usage_ratio, 0.95), bar(w.prefix_hit_ratio, 2),
    num(w.running), num(w.waiting),
  ])), "no workers", 8);
  const throttle = x => x.throttle
    ? pill(x.throttle.state + " (" + Math.round(x.throttle.expires_in_s) + " s)", "throttled")
    : el("td", "-");
  let sessions = [], tenants = [];
  let empty = "no session holds KV now", noTenant = "no tenant holds KV now";
  if (s.sessions_hidden) {
    empty = noTenant = "hidden: this gateway has API keys; open /ui#token=ADMIN_TOKEN to see them";
  } else if (s.sessions === null) empty = noTenant = "budgets are not enabled on this gateway";
  else if (s.sessions_error) empty = noTenant = s.sessions_error;
  else {
    sessions = s.sessions.map(x => row([
      el("td", x.tenant), el("td", x.session), num(bytes(x.kv_bytes)), num(x.requests),
      throttle(x),
    ]));
    tenants = s.tenants.map(x => row([
      el("td", x.tenant), num(bytes(x.kv_bytes)), num(x.requests), throttle(x),
    ]));
  }
  const hits = s.hits ? s.hits.pools : [];
  fill("hits", hits.map(h => row([
    el("td", h.pool), num(h.prompt_tokens.toLocaleString("en")), bar(h.shares.delivered, 2),
    ...["never_seen", "load", "kv_pressure", "stale_index", "evicted", "mismatch", "unknown"]
      .map(k => num(pct(h.shares[k]))),
  ])), s.hits ? "no request accounted yet" : "no routing on this gateway", 10);
  const mm = document.getElementById("mismatch");
  const flagged = s.hits ? s.hits.mismatched_models : [];
  mm.textContent = flagged.length
    ? "tokenizer/template mismatch suspected (vLLM delivers far below the prediction): "
      + flagged.join(", ")
    : "";
  mm.className = flagged.length ? "pill down" : "empty";
  fill("tenants", tenants, noTenant, 4);
  fill("sessions", sessions, empty, 5);
  const u = document.getElementById("updated");
  u.textContent = "updated " + new Date(s.time * 1000).toLocaleTimeString() + ", every 2 s";
  u.className = "";
}

async function refresh() {
  try {
    const token = new URLSearchParams(location.hash.slice(1)).get("token");
    const r = await fetch(STATE_URL, {cache: "no-store",
                                      headers: token ? {Authorization: "Bearer " + token} : {}});
    if (!r.ok) throw new Error("HTTP " + r.status);
    render(await r.json());
  } catch (e) {
    const u = document.getElementById("updated");
    u.textContent = "cannot reach the gateway (" + e.message + ")";
    u.className = "stale";
  }
}
refresh();
setInterval(refresh, REFRESH_MS);
</script>
</body>
</html>
"""
