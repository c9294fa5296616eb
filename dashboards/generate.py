"""Write kvgate's Grafana dashboards (fleet, sessions, workers) as JSON, ready for provisioning.

The JSON files next to this script are its output and are committed; edit this file and run
``python dashboards/generate.py`` (``--check`` exits 1 when a committed file differs; a test runs
it). Every panel queries the Prometheus datasource chosen in the ``datasource`` variable;
tests/integration/test_observability_dashboards.py evaluates every query against a real Prometheus
scraping a real gateway.

Grafana variables used in queries: ``$datasource``, ``$pool``, ``$worker`` (workers dashboard) and
``$__rate_interval``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DS = {"type": "prometheus", "uid": "${datasource}"}
SCHEMA_VERSION = 39
RI = "$__rate_interval"
P = 'pool=~"$pool"'


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str = ""
    instant: bool = False


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    targets: tuple[Target, ...]
    kind: str = "timeseries"  # timeseries | stat | table | bargauge
    unit: str = "short"
    width: int = 12
    height: int = 8
    max: float | None = None
    thresholds: tuple[tuple[float, str], ...] = ()
    stack: bool = False


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...] = field(default_factory=tuple)


def _target(t: Target, ref: str) -> dict[str, Any]:
    out: dict[str, Any] = {
        "datasource": DS,
        "editorMode": "code",
        "expr": t.expr,
        "legendFormat": t.legend or "__auto",
        "range": not t.instant,
        "instant": t.instant,
        "refId": ref,
    }
    if t.instant:
        out["format"] = "table"
    return out


def _thresholds(p: Panel) -> dict[str, Any]:
    steps: list[dict[str, Any]] = [{"color": "green", "value": None}]
    steps += [{"color": color, "value": value} for value, color in p.thresholds]
    return {"mode": "absolute", "steps": steps}


def _panel(p: Panel, pid: int, x: int, y: int) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": p.unit, "thresholds": _thresholds(p)}
    if p.max is not None:
        defaults["min"] = 0
        defaults["max"] = p.max
    options: dict[str, Any]
    if p.kind == "timeseries":
        defaults["custom"] = {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 10 if p.stack else 0,
            "showPoints": "never",
            "spanNulls": False,
            "stacking": {"mode": "normal" if p.stack else "none", "group": "A"},
            "thresholdsStyle": {"mode": "dashed" if p.thresholds else "off"},
        }
        options = {
            "legend": {"displayMode": "table", "placement": "right", "showLegend": True,
                       "calcs": ["lastNotNull", "max"]},
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
    elif p.kind == "stat":
        options = {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
            "justifyMode": "auto",
            "textMode": "auto",
            "orientation": "auto",
        }
    elif p.kind == "bargauge":
        options = {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "displayMode": "gradient",
            "orientation": "horizontal",
            "showUnfilled": True,
        }
    elif p.kind == "table":
        options = {"showHeader": True, "cellHeight": "sm",
                   "footer": {"show": False, "reducer": ["sum"], "fields": ""}}
    else:
        raise ValueError(f"unknown panel kind {p.kind}")
    refs = "ABCDEFGH"
    return {
        "id": pid,
        "type": p.kind,
        "title": p.title,
        "description": p.description,
        "datasource": DS,
        "gridPos": {"h": p.height, "w": p.width, "x": x, "y": y},
        "targets": [_target(t, refs[i]) for i, t in enumerate(p.targets)],
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": options,
    }


def _datasource_var() -> dict[str, Any]:
    return {
        "name": "datasource",
        "label": "Prometheus",
        "type": "datasource",
        "query": "prometheus",
        "current": {"selected": False, "text": "Prometheus", "value": "kvgate-prometheus"},
        "hide": 0,
        "refresh": 1,
        "regex": "",
        "options": [],
        "includeAll": False,
        "multi": False,
    }


def _query_var(name: str, label: str, query: str) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DS,
        "query": {"query": query, "refId": f"{name}-var"},
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "includeAll": True,
        "allValue": ".*",
        "multi": True,
        "hide": 0,
        "refresh": 2,
        "regex": "",
        "sort": 1,
        "options": [],
    }


def dashboard(uid: str, title: str, description: str, rows: list[Row],
              variables: list[dict[str, Any]]) -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    pid = 1
    y = 0
    for row in rows:
        panels.append({
            "id": pid, "type": "row", "title": row.title, "collapsed": False,
            "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": [],
        })
        pid += 1
        y += 1
        x = 0
        line_height = 0
        for p in row.panels:
            if x + p.width > 24:
                x = 0
                y += line_height
                line_height = 0
            panels.append(_panel(p, pid, x, y))
            pid += 1
            x += p.width
            line_height = max(line_height, p.height)
        y += line_height
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["kvgate"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "weekStart": "",
        "links": [
            {"title": "kvgate", "type": "dashboards", "tags": ["kvgate"], "asDropdown": True,
             "icon": "external link", "includeVars": True, "keepTime": True,
             "targetBlank": False, "tooltip": "", "url": ""},
        ],
        "annotations": {"list": [{
            "builtIn": 1,
            "datasource": {"type": "grafana", "uid": "-- Grafana --"},
            "enable": True,
            "hide": True,
            "iconColor": "rgba(0, 211, 255, 1)",
            "name": "Annotations & Alerts",
            "type": "dashboard",
        }]},
        "templating": {"list": variables},
        "panels": panels,
    }


def _quantiles(metric: str, by: str, selector: str) -> tuple[Target, ...]:
    return tuple(
        Target(
            f"histogram_quantile({q}, sum by ({by}, le) (rate({metric}_bucket{{{selector}}}[{RI}])))",
            f"{{{{{by.split(',')[0]}}}}} p{int(q * 100)}",
        )
        for q in (0.5, 0.95, 0.99)
    )


def hit_accounting_row() -> Row:
    """Where the routed prompt tokens went (``kvgate_prefix_tokens_total``, by outcome) and the
    models whose predictions vLLM does not deliver (``kvgate_prefix_cache_mismatch``)."""
    tokens = f"sum by (pool) (rate(kvgate_prefix_tokens_total{{{P}}}[{RI}]))"
    return Row("Hit accounting", (
        Panel("Prompt tokens by outcome (share)",
              "Every prompt token of a routed chat/completions request lands in one outcome:"
              " delivered (vLLM's cached_tokens), never_seen (no worker held it), load /"
              " kv_pressure (a holder was passed over), stale_index / evicted (predicted at the"
              " chosen worker, not delivered), mismatch (the model's tokenizer or template"
              " differs from the server's), unknown (the worker reports no cached_tokens:"
              " --enable-prompt-tokens-details). GET /admin/routing/explain?request_id= explains"
              " one request.",
              (Target(f"sum by (pool, outcome) (rate(kvgate_prefix_tokens_total{{{P}}}[{RI}]))"
                      f" / ignoring (outcome) group_left {tokens}", "{{pool}} {{outcome}}"),),
              unit="percentunit", max=1, width=12, stack=True),
        Panel("Hit rate vs ceiling",
              "Delivered cached tokens over prompt tokens, against the ceiling: the share some"
              " healthy worker held when the request was routed (all but never_seen). The gap"
              " is the lost tokens of the panel beside.",
              (
                  Target(f'sum by (pool) (rate(kvgate_prefix_tokens_total{{outcome="delivered",'
                         f"{P}}}[{RI}])) / {tokens}", "{{pool}} delivered"),
                  Target(f'1 - sum by (pool) (rate(kvgate_prefix_tokens_total{{outcome='
                         f'"never_seen",{P}}}[{RI}])) / {tokens}', "{{pool}} ceiling"),
              ),
              unit="percentunit", max=1, width=8),
        Panel("Tokenizer/template mismatch",
              "1: vLLM serves far below the predicted cached tokens for the whole model (the"
              " silent 0% hit rate of a tokenizer or chat template that differs from the"
              " server's); the gateway logs which model.",
              (Target("max by (model) (kvgate_prefix_cache_mismatch)", "{{model}}",
                      instant=True),),
              kind="stat", width=4, max=1, thresholds=((1, "red"),)),
    ))


def slo_row() -> Row:
    """Latency objectives (``gateway.routing.slo``): attainment per pool and objective, the
    requests shed, and how well each worker's calibrated model predicts it."""
    slo = f"kvgate_slo_requests_total{{{P}}}"
    return Row("Latency objectives (SLO)", (
        Panel("SLO attainment by pool",
              "Requests with an objective (x-slo-ttft-ms / x-slo-tpot-ms, a key's or a pool's"
              " default) that met it, over those met, missed or shed; streamed answers only"
              " (a whole answer's first byte comes after its last token).",
              (Target(f'sum by (pool, slo) (rate(kvgate_slo_requests_total{{outcome="met",{P}}}'
                      f"[{RI}])) / sum by (pool, slo) (rate({slo}[{RI}]))", "{{pool}} {{slo}}"),),
              unit="percentunit", max=1, width=10, thresholds=((0.95, "green"),)),
        Panel("SLO outcomes / s",
              "met, missed, and shed: refused 503 slo_unattainable because no worker was"
              " predicted to meet the objective and the request's class is shed"
              " (pools[].slo.shed, default batch).",
              (Target(f"sum by (pool, slo, outcome) (rate({slo}[{RI}]))",
                      "{{pool}} {{slo}} {{outcome}}"),),
              unit="reqps", width=8, stack=True),
        Panel("Prediction calibration (observed / predicted)",
              "Per worker: observed TTFT (from routing) or TPOT over the calibrated model's"
              " prediction, recent requests (kvgate_slo_prediction_ratio). 1: calibrated;"
              " above: the worker is slower than predicted.",
              (Target(f"max by (pool, worker, slo) (kvgate_slo_prediction_ratio{{{P}}})",
                      "{{worker}} {{slo}}"),),
              width=6),
    ))


def fleet() -> dict[str, Any]:
    rows = [
        Row("Traffic", (
            Panel("Requests / s by pool and status",
                  "Answers of every gateway replica, per pool and HTTP status. Pool `none`: refused"
                  " before routing (bad request, unknown model, budget).",
                  (Target(f"sum by (pool, code) (rate(kvgate_requests_total{{{P}}}[{RI}]))",
                          "{{pool}} {{code}}"),),
                  unit="reqps", width=16, stack=True),
            Panel("5xx ratio by pool",
                  "Share of answers that were 5xx (the KvgateHighErrorRate alert fires over 5%).",
                  (Target(
                      f'(sum by (pool) (rate(kvgate_requests_total{{code=~"5..",{P}}}[{RI}]))'
                      f" or sum by (pool) (rate(kvgate_requests_total{{{P}}}[{RI}])) * 0)"
                      f" / sum by (pool) (rate(kvgate_requests_total{{{P}}}[{RI}]))",
                      "{{pool}}"),),
                  unit="percentunit", width=8, thresholds=((0.05, "red"),)),
        )),
        Row("Latency", (
            Panel("TTFT p50 / p95 / p99 by pool",
                  "Time to first token measured at the gateway (kvgate_ttft_seconds).",
                  _quantiles("kvgate_ttft_seconds", "pool", P), unit="s"),
            Panel("TPOT p50 / p95 / p99 by pool",
                  "Time per output token after the first, streamed requests (kvgate_tpot_seconds).",
                  _quantiles("kvgate_tpot_seconds", "pool", P), unit="s"),
        )),
        Row("KV cache", (
            Panel("KV cache usage by worker",
                  "vLLM's KV cache usage per worker, as the gateway last scraped it"
                  " (KvgateWorkerKvCacheNearFull fires over 95% for 10 minutes).",
                  (Target(f"max by (pool, worker) (kvgate_worker_kv_usage_ratio{{{P}}})",
                          "{{worker}}"),),
                  unit="percentunit", max=1, thresholds=((0.95, "red"),)),
            Panel("Prefix cache hit ratio: predicted vs actual",
                  "Predicted: prompt tokens the router expected the chosen worker to hold, over"
                  " prompt tokens routed. Actual: vLLM's prefix cache hits over queries (tokens),"
                  " over the same window, and the gateway's per-worker gauge averaged by pool.",
                  (
                      Target(f"sum by (pool) (rate(kvgate_predicted_cached_tokens_total{{{P}}}[{RI}]))"
                             f" / sum by (pool) (rate(kvgate_prompt_tokens_total{{{P}}}[{RI}]))",
                             "{{pool}} predicted"),
                      Target(f"sum by (pool) (rate(vllm:prefix_cache_hits_total{{{P}}}[{RI}]))"
                             f" / sum by (pool) (rate(vllm:prefix_cache_queries_total{{{P}}}[{RI}]))",
                             "{{pool}} actual (vLLM)"),
                      Target(f"avg by (pool) (kvgate_worker_prefix_cache_hit_ratio{{{P}}})",
                             "{{pool}} actual (gateway gauge)"),
                  ),
                  unit="percentunit", max=1),
        )),
        Row("Prefill/decode", (
            Panel("TTFT split: prefill step, KV transfer, decode first token",
                  "Disaggregated pools (pools[].prefill_workers): the prefill step on the prefill"
                  " worker (kvgate_prefill_seconds), the KV pull as the decode workers' vLLM"
                  " reports it (vllm:nixl_xfer_time_seconds), and the decode step to its first"
                  " token, the pull included (kvgate_decode_first_token_seconds). Empty without"
                  " such a pool.",
                  tuple(
                      Target(f"histogram_quantile({q}, sum by (pool, le)"
                             f" (rate({metric}_bucket{{{P}}}[{RI}])))",
                             f"{{{{pool}}}} {part} p{int(q * 100)}")
                      for metric, part in (("kvgate_prefill_seconds", "prefill"),
                                           ("vllm:nixl_xfer_time_seconds", "transfer"),
                                           ("kvgate_decode_first_token_seconds", "decode"))
                      for q in (0.5, 0.99)),
                  unit="s"),
            Panel("Prefill steps / s by outcome",
                  "Prefill steps per pool and status (200: KV ready to pull; 502/504: failed,"
                  " the request answered so; 499: the client left), and why each prefill worker"
                  " was chosen.",
                  (
                      Target(f"sum by (pool, code) (rate(kvgate_prefill_requests_total{{{P}}}"
                             f"[{RI}]))", "{{pool}} {{code}}"),
                      Target(f"sum by (pool, reason) (rate(kvgate_prefill_decisions_total{{{P}}}"
                             f"[{RI}]))", "{{pool}} chosen: {{reason}}"),
                  ),
                  unit="ops"),
        )),
        Row("Routing", (
            Panel("Routing decisions / s by reason",
                  "Why the router picked each worker (prefix_hit, least_loaded, spill, fallback...).",
                  (Target(f"sum by (pool, policy, reason)"
                          f" (rate(kvgate_routing_decisions_total{{{P}}}[{RI}]))",
                          "{{pool}} {{policy}} {{reason}}"),),
                  unit="ops", stack=True),
            Panel("Prompt tokens / s and upstream retries / s",
                  "Prompt tokens routed per pool, and requests retried on another worker after a"
                  " connection failure.",
                  (
                      Target(f"sum by (pool) (rate(kvgate_prompt_tokens_total{{{P}}}[{RI}]))",
                             "{{pool}} prompt tokens/s"),
                      Target(f"sum by (pool) (rate(kvgate_upstream_retries_total{{{P}}}[{RI}]))",
                             "{{pool}} retries/s"),
                  ),
                  unit="short"),
        )),
        hit_accounting_row(),
        slo_row(),
    ]
    return dashboard(
        "kvgate-fleet", "kvgate / Fleet overview",
        "Requests, errors, TTFT/TPOT per pool, KV occupancy per worker, prefix cache hit ratio"
        " (predicted vs actual), routing reasons.",
        rows,
        [_datasource_var(), _query_var("pool", "Pool", "label_values(kvgate_worker_up, pool)")],
    )


def sessions() -> dict[str, Any]:
    rows = [
        Row("Throttles and rejections", (
            Panel("Throttled sessions",
                  "Sessions throttled or blocked now (by an operator or by the runaway-session"
                  " alert through /admin/alerts), the most any replica reports.",
                  (Target("max(kvgate_throttled_sessions)", "throttled"),),
                  kind="stat", width=6, height=6, thresholds=((1, "orange"),)),
            Panel("Runaway-session alerts firing",
                  "KvgateRunawaySession alerts firing now (each throttles its session).",
                  (Target('count(ALERTS{alertname="KvgateRunawaySession",alertstate="firing"})'
                          " or vector(0)", "firing"),),
                  kind="stat", width=6, height=6, thresholds=((1, "red"),)),
            Panel("Budget rejections / s by reason",
                  "Requests refused by budgets, throttles or rate limits, by error code"
                  " (kv_budget_exceeded, session_throttled, rate_limit_exceeded...).",
                  (Target(f"sum by (reason) (rate(kvgate_budget_rejections_total[{RI}]))",
                          "{{reason}}"),),
                  unit="reqps", width=12, height=6, stack=True),
        )),
        Row("Top KV holders", (
            Panel("KV bytes held in flight, top sessions",
                  "KV bytes held by the sessions with most in flight (the gateway exports its"
                  " top K only).",
                  (Target("topk(10, max by (tenant, session) (kvgate_session_kv_bytes))",
                          "{{tenant}} / {{session}}"),),
                  unit="bytes"),
            Panel("Share of in-flight KV budget, top sessions",
                  "KV bytes held / the session's in-flight KV budget. KvgateRunawaySession fires"
                  " over 90% for 5 minutes.",
                  (Target("topk(10, max by (tenant, session) (kvgate_session_kv_budget_ratio))",
                          "{{tenant}} / {{session}}"),),
                  unit="percentunit", thresholds=((0.9, "red"),)),
            Panel("Top KV holders now",
                  "The same top sessions, as they are now.",
                  (Target("topk(20, max by (tenant, session) (kvgate_session_kv_bytes))",
                          "{{tenant}} / {{session}}", instant=True),),
                  kind="bargauge", unit="bytes", width=12),
            Panel("429 answers / s by pool",
                  "Requests answered 429 (budgets, throttles, rate limits) per pool.",
                  (Target('sum by (pool) (rate(kvgate_requests_total{code="429"}[' + RI + "]))",
                          "{{pool}}"),),
                  unit="reqps", width=12),
        )),
    ]
    return dashboard(
        "kvgate-sessions", "kvgate / Sessions",
        "Who holds the KV cache: top sessions, their share of budget, rejections and throttles.",
        rows, [_datasource_var()],
    )


def workers() -> dict[str, Any]:
    sel = 'pool=~"$pool",worker=~"$worker"'
    rows = [
        Row("Health and load", (
            Panel("Worker up",
                  "1 when the worker passes the gateway's health checks (the most any replica"
                  " says).",
                  (Target(f"max by (pool, worker) (kvgate_worker_up{{{sel}}})", "{{worker}}",
                          instant=True),),
                  kind="stat", width=24, height=5, thresholds=()),
            Panel("Gateway requests in flight by worker",
                  "Requests the gateway replicas have open on each worker (summed over replicas).",
                  (Target(f"sum by (pool, worker) (kvgate_worker_inflight{{{sel}}})", "{{worker}}"),)),
            Panel("Requests / s by worker",
                  "Answers per worker, every status.",
                  (Target(f"sum by (pool, worker) (rate(kvgate_requests_total{{{sel}}}[{RI}]))",
                          "{{worker}}"),),
                  unit="reqps"),
        )),
        Row("KV cache", (
            Panel("KV cache usage",
                  "kvgate_worker_kv_usage_ratio (the gateway's last scrape) per worker.",
                  (Target(f"max by (pool, worker) (kvgate_worker_kv_usage_ratio{{{sel}}})",
                          "{{worker}}"),),
                  unit="percentunit", max=1, thresholds=((0.95, "red"),)),
            Panel("Prefix cache hit ratio",
                  "Gateway gauge (since the worker started) and vLLM's counters over the window.",
                  (
                      Target(f"max by (pool, worker) (kvgate_worker_prefix_cache_hit_ratio{{{sel}}})",
                             "{{worker}} (gateway)"),
                      Target(f"sum by (pool, worker) (rate(vllm:prefix_cache_hits_total{{{sel}}}[{RI}]))"
                             f" / sum by (pool, worker)"
                             f" (rate(vllm:prefix_cache_queries_total{{{sel}}}[{RI}]))",
                             "{{worker}} (vLLM, window)"),
                  ),
                  unit="percentunit", max=1),
            Panel("KV event view: resets, gaps, warm starts",
                  "What each worker's KV event subscriber saw (kvgate_kv_events_total): resets"
                  " (the gateway's view of the worker dropped: publisher restart, gap not closed),"
                  " gaps and replays (closed from the worker's replay socket), warm starts (history"
                  " replayed). Most per replica.",
                  (Target(f"max by (worker, what) (increase(kvgate_kv_events_total{{{sel},"
                          f'what=~"resets|gaps|replays|warm_starts|disconnects"}}[{RI}]))',
                          "{{worker}} {{what}}"),),
                  unit="short"),
        )),
        Row("vLLM's own view", (
            Panel("vLLM requests running",
                  "vllm:num_requests_running: requests in the worker's batch.",
                  (Target(f"sum by (pool, worker) (vllm:num_requests_running{{{sel}}})",
                          "{{worker}}"),),
                  width=8),
            Panel("vLLM requests waiting",
                  "vllm:num_requests_waiting: requests queued in the worker (the gateway counts a"
                  " worker with waiting requests as saturated).",
                  (Target(f"sum by (pool, worker) (vllm:num_requests_waiting{{{sel}}})",
                          "{{worker}}"),),
                  width=8, thresholds=((1, "orange"),)),
            Panel("vLLM KV cache usage",
                  "vllm:kv_cache_usage_perc as Prometheus scrapes it from the worker.",
                  (Target(f"max by (pool, worker) (vllm:kv_cache_usage_perc{{{sel}}})",
                          "{{worker}}"),),
                  unit="percentunit", max=1, width=8),
            Panel("TTFT p95 by worker",
                  "Time to first token at the gateway, per worker.",
                  (Target(f"histogram_quantile(0.95, sum by (worker, le)"
                          f" (rate(kvgate_ttft_seconds_bucket{{{sel}}}[{RI}])))", "{{worker}}"),),
                  unit="s"),
            Panel("TPOT p95 by worker",
                  "Time per output token at the gateway, per worker.",
                  (Target(f"histogram_quantile(0.95, sum by (worker, le)"
                          f" (rate(kvgate_tpot_seconds_bucket{{{sel}}}[{RI}])))", "{{worker}}"),),
                  unit="s"),
        )),
    ]
    return dashboard(
        "kvgate-workers", "kvgate / Workers",
        "Each vLLM worker: up, in flight, KV usage, prefix cache hit ratio, vLLM's running and"
        " waiting queues.",
        rows,
        [
            _datasource_var(),
            _query_var("pool", "Pool", "label_values(kvgate_worker_up, pool)"),
            _query_var("worker", "Worker", 'label_values(kvgate_worker_up{pool=~"$pool"}, worker)'),
        ],
    )


DASHBOARDS = {"kvgate-fleet.json": fleet, "kvgate-sessions.json": sessions,
              "kvgate-workers.json": workers}


def render(build: Any) -> str:
    return json.dumps(build(), indent=2, sort_keys=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when a committed dashboard differs from what this writes")
    args = parser.parse_args(argv)
    stale = []
    for name, build in DASHBOARDS.items():
        path = HERE / name
        text = render(build)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print(f"stale: {', '.join(stale)} (run python dashboards/generate.py)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
