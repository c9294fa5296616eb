"""The Grafana dashboards: every panel's PromQL against a real Prometheus scraping a real gateway,
and the JSON against Grafana's published schema.

One module-scoped stack: two workers (the no-op backend with a vLLM-shaped /metrics page, one per
pool), the gateway in front of them, and Debian's Prometheus scraping the gateway and the workers
every second with deploy/prometheus/alerts.yml loaded. Traffic (streaming and not, both pools, one
refusal) goes through the real openai client; then every query of every panel is evaluated through
Prometheus' HTTP API the way Grafana would send it.

Schema: Grafana publishes its dashboard schema as code generated from its CUE kinds; the
``grafana-foundation-sdk`` package (Grafana Labs, PyPI) carries it as typed models for the dashboard,
every core panel plugin's options and field config, and the Prometheus query. A dashboard that
round-trips through those models unchanged uses only fields the schema knows (an unknown or
misspelt key is dropped by the models, and the test fails naming it).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.config import build_settings
from gateway.procs.net import wait_until
from tests.harness import serve_app
from tests.integration.observability_fixtures import (
    ALERTS_YML,
    ROOT,
    Prometheus,
    fake_vllm_worker,
    run_prometheus,
    scrape_job,
    vllm_metrics_page,
)

DASHBOARD_DIR = ROOT / "dashboards"
DASHBOARDS = sorted(DASHBOARD_DIR.glob("*.json"))
SHORT_KV, LONG_KV = 0.5, 0.25
# (dashboard uid, panel title): panels that must show data after the traffic below. The others
# (top sessions, rejections) need budgets in play and must only evaluate without error.
KEY_PANELS = {
    ("kvgate-fleet", "Requests / s by pool and status"),
    ("kvgate-fleet", "5xx ratio by pool"),
    ("kvgate-fleet", "TTFT p50 / p95 / p99 by pool"),
    ("kvgate-fleet", "TPOT p50 / p95 / p99 by pool"),
    ("kvgate-fleet", "KV cache usage by worker"),
    ("kvgate-fleet", "Prefix cache hit ratio: predicted vs actual"),
    ("kvgate-fleet", "Routing decisions / s by reason"),
    ("kvgate-sessions", "Throttled sessions"),
    ("kvgate-sessions", "Runaway-session alerts firing"),
    ("kvgate-workers", "Worker up"),
    ("kvgate-workers", "Gateway requests in flight by worker"),
    ("kvgate-workers", "Requests / s by worker"),
    ("kvgate-workers", "KV cache usage"),
    ("kvgate-workers", "Prefix cache hit ratio"),
    ("kvgate-workers", "vLLM requests running"),
    ("kvgate-workers", "vLLM requests waiting"),
    ("kvgate-workers", "vLLM KV cache usage"),
    ("kvgate-workers", "TTFT p95 by worker"),
    ("kvgate-workers", "TPOT p95 by worker"),
}
# What Grafana substitutes: All for multi-value variables, a window that holds several scrapes.
GRAFANA_VARS = {"$__rate_interval": "30s", "$__interval": "1s", "$pool": ".*", "$worker": ".*"}


def load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for p in dashboard["panels"]:
        yield p
        yield from p.get("panels", [])


def substitute(expr: str) -> str:
    # Longest names first: $pool must not eat the start of a longer variable name.
    for name in sorted(GRAFANA_VARS, key=len, reverse=True):
        expr = expr.replace(name, GRAFANA_VARS[name])
    assert "$" not in expr, f"unsubstituted variable in {expr}"
    return expr


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Prometheus, str]]:
    tmp = tmp_path_factory.mktemp("observability")
    short = fake_vllm_worker(vllm_metrics_page(kv_usage=SHORT_KV))
    long_ = fake_vllm_worker(vllm_metrics_page(kv_usage=LONG_KV, running=1))
    with serve_app(short) as short_url, serve_app(long_) as long_url:
        settings = build_settings({
            "models": [{"name": "noop", "tokenizer": "simple"}],
            "pools": [
                {"name": "short-chat", "max_context_tokens": 2048, "workers": [short_url]},
                {"name": "long-context", "max_context_tokens": 65536, "workers": [long_url]},
            ],
            "health": {"interval_s": 0.2, "timeout_s": 30.0,
                       "scrape_interval_s": 0.3, "unhealthy_threshold": 1},
        })
        with serve_app(create_app(settings), ready_path="/ready") as gateway:
            hostport = gateway.removeprefix("http://")
            jobs = [
                scrape_job("kvgate", [hostport]),
                {**scrape_job("vllm", [short_url.removeprefix("http://")],
                              {"pool": "short-chat"}, worker_label=True),
                 "static_configs": [
                     {"targets": [short_url.removeprefix("http://")],
                      "labels": {"pool": "short-chat"}},
                     {"targets": [long_url.removeprefix("http://")],
                      "labels": {"pool": "long-context"}},
                 ]},
            ]
            with run_prometheus(tmp, jobs, rule_files=[ALERTS_YML]) as prom:
                prom.wait_for_targets_up(3)
                # A first round creates every series and gets scraped; the second moves them, so
                # rate() over a window holding both sees an increase.
                sent = send_traffic(gateway, rounds=1)
                wait_for_requests(prom, sent)
                sent += send_traffic(gateway, rounds=3)
                wait_for_requests(prom, sent)
                wait_until(lambda: len(prom.query("kvgate_worker_kv_usage_ratio > 0")) == 2,
                           10, "KV usage of both workers")
                yield prom, gateway


def wait_for_requests(prom: Prometheus, count: int) -> None:
    def scraped() -> bool:
        result = prom.query("sum(kvgate_requests_total)")
        return bool(result) and float(result[0]["value"][1]) >= count

    wait_until(scraped, 15, f"Prometheus to scrape {count} requests")


def send_traffic(gateway: str, rounds: int) -> int:
    """Both pools, streaming and not, and one refusal. Returns the number of answers."""
    client = openai.OpenAI(base_url=gateway + "/v1", api_key="x", max_retries=0)
    n = 0
    for i in range(rounds):
        for stream in (False, True):
            for max_tokens in (16, 4000):  # 4000 does not fit short-chat (2048): long-context
                messages = [{"role": "user", "content": f"hello {i}"}]
                if stream:
                    chunks = list(client.chat.completions.create(
                        model="noop", messages=messages,  # type: ignore[arg-type]
                        max_tokens=max_tokens, stream=True))
                    assert chunks
                else:
                    r = client.chat.completions.create(
                        model="noop", messages=messages,  # type: ignore[arg-type]
                        max_tokens=max_tokens)
                    assert r.choices[0].message.content == "ok"
                n += 1
    r404 = httpx.post(gateway + "/v1/chat/completions",
                      json={"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    assert r404.status_code == 404
    return n + 1


def test_every_panel_query_evaluates_and_key_panels_show_data(
    stack: tuple[Prometheus, str]
) -> None:
    prom, _ = stack
    empty_key_targets = []
    evaluated = 0
    for path in DASHBOARDS:
        dash = load(path)
        for panel in panels(dash):
            for target in panel.get("targets", []):
                result = prom.query(substitute(target["expr"]))  # raises on a query error
                evaluated += 1
                if (dash["uid"], panel["title"]) in KEY_PANELS and not result:
                    empty_key_targets.append(f"{dash['uid']} / {panel['title']}: {target['expr']}")
    assert evaluated >= 30
    assert empty_key_targets == []


def test_key_panels_show_the_values_the_workers_report(stack: tuple[Prometheus, str]) -> None:
    prom, _ = stack
    fleet = load(DASHBOARD_DIR / "kvgate-fleet.json")
    by_title = {p["title"]: p for p in panels(fleet)}

    kv = prom.query(substitute(by_title["KV cache usage by worker"]["targets"][0]["expr"]))
    assert sorted(float(s["value"][1]) for s in kv) == [LONG_KV, SHORT_KV]
    assert {s["metric"]["pool"] for s in kv} == {"short-chat", "long-context"}

    requests = prom.query(substitute(by_title["Requests / s by pool and status"]["targets"][0]["expr"]))
    assert {(s["metric"]["pool"], s["metric"]["code"]) for s in requests} >= {
        ("short-chat", "200"), ("long-context", "200"), ("none", "404")}

    ttft = prom.query(substitute(by_title["TTFT p50 / p95 / p99 by pool"]["targets"][0]["expr"]))
    assert {s["metric"]["pool"] for s in ttft} == {"short-chat", "long-context"}
    assert all(0 < float(s["value"][1]) < 10 for s in ttft), ttft

    tpot = prom.query(substitute(by_title["TPOT p50 / p95 / p99 by pool"]["targets"][0]["expr"]))
    assert any(math.isfinite(float(s["value"][1])) for s in tpot), tpot

    reasons = prom.query(substitute(by_title["Routing decisions / s by reason"]["targets"][0]["expr"]))
    assert {s["metric"]["pool"] for s in reasons} == {"short-chat", "long-context"}
    assert all(s["metric"]["reason"] for s in reasons)

    hit = by_title["Prefix cache hit ratio: predicted vs actual"]["targets"]
    predicted = prom.query(substitute(hit[0]["expr"]))
    assert {s["metric"]["pool"] for s in predicted} == {"short-chat", "long-context"}
    gauge = prom.query(substitute(hit[2]["expr"]))
    assert sorted(float(s["value"][1]) for s in gauge) == [0.6, 0.6]  # 600 hits / 1000 queries


def test_vllm_series_join_gateway_series_on_pool_and_worker(stack: tuple[Prometheus, str]) -> None:
    """The vLLM job's relabelling gives vLLM's series the same (pool, worker) as the gateway's."""
    prom, _ = stack
    joined = prom.query("vllm:kv_cache_usage_perc"
                        " * on (pool, worker) group_left () max by (pool, worker) (kvgate_worker_up)")
    assert len(joined) == 2


def test_template_variable_queries_find_values(stack: tuple[Prometheus, str]) -> None:
    prom, _ = stack
    pattern = re.compile(r"^label_values\((.+),\s*(\w+)\)$")
    for path in DASHBOARDS:
        for var in load(path)["templating"]["list"]:
            if var["type"] != "query":
                continue
            m = pattern.match(var["query"]["query"])
            assert m, var["query"]
            selector, label = substitute(m.group(1)), m.group(2)
            r = httpx.get(f"{prom.url}/api/v1/label/{label}/values",
                          params={"match[]": selector}).json()
            assert r["status"] == "success", r
            assert r["data"], f"{path.name}: variable {var['name']} finds no values"


def test_alert_rules_load_and_evaluate_in_prometheus(stack: tuple[Prometheus, str]) -> None:
    prom, _ = stack
    def evaluated() -> dict[str, str] | None:
        h = prom.rule_health()
        return h if h and all(v != "unknown" for v in h.values()) else None

    health = wait_until(evaluated, 10, "every rule to be evaluated once")
    assert all(v == "ok" for v in health.values()), health
    assert {"KvgateRunawaySession", "KvgateWorkerDown"} <= set(health)


# --- the JSON itself ----------------------------------------------------------------------------

def test_dashboards_are_the_generator_output() -> None:
    r = subprocess.run([sys.executable, str(DASHBOARD_DIR / "generate.py"), "--check"],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_is_ready_for_provisioning(path: Path) -> None:
    dash = load(path)
    assert re.fullmatch(r"[a-z0-9-]{1,40}", dash["uid"])
    assert dash["title"] and dash["schemaVersion"] >= 36
    assert "id" not in dash or dash["id"] is None  # provisioning assigns ids
    names = {v["name"] for v in dash["templating"]["list"]}
    assert "datasource" in names
    ids = [p["id"] for p in panels(dash)]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    occupied: set[tuple[int, int]] = set()
    for p in panels(dash):
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in ("h", "w", "x", "y")), p["title"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                 for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & occupied, f"{path.name}: {p['title']} overlaps another panel"
        occupied |= cells
        if p["type"] == "row":
            continue
        assert p["title"] and p.get("description"), p
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs))
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"] and t["expr"].strip()


def test_dashboard_uids_are_unique() -> None:
    uids = [load(p)["uid"] for p in DASHBOARDS]
    assert len(DASHBOARDS) == 3
    assert len(uids) == len(set(uids))


def _schema_diff(ours: Any, theirs: Any, path: str = "") -> list[str]:
    """Keys and values of ``ours`` that the schema round-trip dropped or changed."""
    out: list[str] = []
    if isinstance(ours, dict) and isinstance(theirs, dict):
        for k, v in ours.items():
            if k not in theirs:
                out.append(f"{path}.{k}: not in Grafana's schema")
            else:
                out += _schema_diff(v, theirs[k], f"{path}.{k}")
    elif isinstance(ours, list) and isinstance(theirs, list):
        if len(ours) != len(theirs):
            out.append(f"{path}: {len(ours)} items became {len(theirs)}")
        for i, (a, b) in enumerate(zip(ours, theirs, strict=False)):
            out += _schema_diff(a, b, f"{path}[{i}]")
    elif ours != theirs:
        out.append(f"{path}: {ours!r} became {theirs!r}")
    return out


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_matches_grafanas_published_schema(path: Path) -> None:
    from grafana_foundation_sdk.cog.plugins import register_default_plugins
    from grafana_foundation_sdk.models.dashboard import Dashboard

    register_default_plugins()  # panel options/field config and Prometheus queries, typed
    ours = load(path)
    theirs = json.loads(json.dumps(Dashboard.from_json(ours).to_json(),
                                   default=lambda o: o.to_json()))
    assert _schema_diff(ours, theirs) == []


def test_schema_check_catches_an_unknown_panel_option() -> None:
    from grafana_foundation_sdk.cog.plugins import register_default_plugins
    from grafana_foundation_sdk.models.dashboard import Dashboard

    register_default_plugins()
    ours = load(DASHBOARD_DIR / "kvgate-fleet.json")
    ours["panels"][1]["options"]["legendd"] = {}
    ours["panels"][1]["targets"][0]["exprr"] = "up"
    theirs = json.loads(json.dumps(Dashboard.from_json(ours).to_json(),
                                   default=lambda o: o.to_json()))
    problems = _schema_diff(ours, theirs)
    assert any("options.legendd" in p for p in problems), problems
    assert any("exprr" in p for p in problems), problems
