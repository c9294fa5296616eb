"""The alerting path of the runaway-session alert, with real Prometheus and Alertmanager.

A stand-in exporter serves ``kvgate_session_kv_budget_ratio`` as the gateway does; Prometheus
evaluates the production rules (``for`` shortened by ``fast_rules``); Alertmanager, with the
production routes (``fast_alertmanager_config``), calls a recording webhook in place of the
gateway's ``POST /admin/alerts``. The webhook must get the firing alert with its ``session`` and
``throttle`` labels and the admin token as a bearer token, only for the runaway session, and then
the resolution. The end-to-end test with the real gateway (429 ``session_throttled``) builds on
the same fixtures.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from starlette.types import Receive, Scope, Send

from gateway.procs.net import wait_until
from tests.harness import read_asgi_body, serve_app
from tests.integration.observability_fixtures import (
    fast_alertmanager_config,
    fast_rules,
    run_alertmanager,
    run_prometheus,
    scrape_job,
)

TOKEN = "admin-token-for-tests"
FOR_S = 1.0
HOLD_S = 3.0  # fast_rules' hysteresis window (production: 1m)


class Exporter:
    """/metrics with the budget ratio of two sessions; ``runaway`` can be changed, None: the
    session holds nothing, so it has no series (as the gateway exports it)."""

    def __init__(self) -> None:
        self.runaway: float | None = 0.97

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        runaway = ("" if self.runaway is None else
                   f'kvgate_session_kv_budget_ratio{{session="tenant-a:run-42"}} {self.runaway}\n')
        body = (
            "# TYPE kvgate_session_kv_budget_ratio gauge\n"
            + runaway
            + 'kvgate_session_kv_budget_ratio{session="calm"} 0.2\n'
        ).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain; version=0.0.4")]})
        await send({"type": "http.response.body", "body": body})


class Webhook:
    """Records every POST to /admin/alerts: (authorization header, JSON body)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self._lock = threading.Lock()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        body = await read_asgi_body(receive)
        if scope["method"] == "POST" and scope["path"] == "/admin/alerts":
            headers = dict(scope["headers"])
            with self._lock:
                self.calls.append((headers.get(b"authorization", b"").decode(), json.loads(body)))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    def alerts(self, status: str) -> list[dict[str, Any]]:
        with self._lock:
            return [a for _, payload in self.calls for a in payload["alerts"]
                    if a["status"] == status]


def test_runaway_session_alert_reaches_the_gateway_webhook_with_token_and_resolves(
    tmp_path: Path,
) -> None:
    exporter, webhook = Exporter(), Webhook()
    with serve_app(exporter, ready_path="/metrics") as exporter_url, \
            serve_app(webhook) as webhook_url:
        rules = fast_rules(tmp_path, for_s=FOR_S, hold_s=HOLD_S)
        am_config = fast_alertmanager_config(tmp_path, webhook_url, TOKEN)
        with run_alertmanager(tmp_path, am_config) as am, run_prometheus(
            tmp_path, [scrape_job("kvgate", [exporter_url.removeprefix("http://")])],
            rule_files=[rules], alertmanager=am.hostport,
        ) as prom:
            prom.wait_for_alert("KvgateRunawaySession", "firing", timeout_s=20,
                                session="tenant-a:run-42")
            firing = wait_until(lambda: webhook.alerts("firing"), 20, "the webhook call")
            assert {a["labels"]["session"] for a in firing} == {"tenant-a:run-42"}
            labels = firing[0]["labels"]
            assert labels["alertname"] == "KvgateRunawaySession"
            assert labels["throttle"] == "throttled"
            assert firing[0]["annotations"]["runbook_url"].endswith("#kvgaterunawaysession")
            assert {auth for auth, _ in webhook.calls} == {f"Bearer {TOKEN}"}
            assert all(p["version"] == "4" for _, p in webhook.calls)

            # Throttled to one request at a time: a small share, far under the threshold. The
            # alert keeps firing (hysteresis) for longer than its window and two `for` periods.
            exporter.runaway = 0.3
            hold_until = time.monotonic() + HOLD_S + 2 * FOR_S
            while time.monotonic() < hold_until:
                assert webhook.alerts("resolved") == [], webhook.calls
                prom.wait_for_alert("KvgateRunawaySession", "firing", timeout_s=1,
                                    session="tenant-a:run-42")
                time.sleep(0.2)

            exporter.runaway = None  # the session lets go: it holds nothing, its series goes
            resolved = wait_until(lambda: webhook.alerts("resolved"), 30, "the resolution")
            assert resolved[0]["labels"]["session"] == "tenant-a:run-42"
            assert prom.query('ALERTS{alertname="KvgateRunawaySession"}') == []
