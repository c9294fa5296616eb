"""Issue 6 end to end: a runaway session is throttled by its own alert, released on resolution.

Everything is real and on loopback: simulated vLLM workers (``SimFleet``, on their own event loop
in a thread), the gateway (uvicorn in a thread), Prometheus scraping the gateway's ``/metrics``
every second and evaluating the production rules (``deploy/prometheus/alerts.yml``, ``for``
shortened to 2 s, the KvgateRunawaySession hysteresis window to 3 s and its threshold lowered to
0.5 by ``fast_rules``), and
Alertmanager with the production routes (``deploy/alertmanager/alertmanager.yml``, second intervals,
the webhook pointed at this gateway with the admin token as a bearer token file).

The story, each step polled against a deadline:

1. a calm session is served and nothing alerts;
2. the runaway session hammers long prompts from several threads, holding (almost) all of its
   in-flight KV budget: ``kvgate_session_kv_budget_ratio{session}`` goes above the threshold;
3. KvgateRunawaySession fires for that session only; Alertmanager calls ``POST /admin/alerts``
   with the admin token; the gateway throttles the session (reason: the alert's name);
4. the runaway session gets 429 ``session_throttled`` while the calm session is served (200);
5. it keeps hammering for several ``for`` periods and hysteresis windows: throttled to one request
   in flight, its share falls under the threshold (as Prometheus sees), yet the alert keeps
   firing and the session stays throttled the whole time, with no resolution and no lift;
6. the runaway session stops: its series goes, the alert resolves one hysteresis window later,
   Alertmanager sends the resolution, the gateway lifts the throttle (only now), and the session
   is served again, two requests at a time (a throttled session gets one).

The gateway is wrapped in an ASGI recorder of ``/admin/alerts`` calls (request and answer), so a
failure can tell "Alertmanager never called" from "the gateway refused the call". On failure the
test prints Prometheus' alerts and series, Alertmanager's alerts, the webhook calls, the gateway's
sessions, the hammer's tally and the tails of both logs.

Design note: the alert's ``throttle`` label is ``throttled`` (one request in flight at a time), so
a throttled session's budget ratio falls to one request's share, below the threshold. Before the
rule had hysteresis the alert then resolved while the session kept hammering, the throttle was
lifted, and the alert fired again ``for`` later (throttled about 1 minute in 6 in production).
Now, once firing, it keeps firing while the session holds anything in the window (step 5 is the
regression test), and resolves only after the session has held nothing for the window (step 6).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.app import create_app
from gateway.config import Settings, build_settings
from gateway.procs.net import wait_until
from gateway.sim import SimFleet, SimWorkerConfig
from tests.harness import serve_app
from tests.integration.observability_fixtures import (
    Alertmanager,
    Prometheus,
    fast_alertmanager_config,
    fast_rules,
    run_alertmanager,
    run_prometheus,
    scrape_job,
)

ALERT = "KvgateRunawaySession"
THRESHOLD = 0.5
FOR_S = 2.0
HOLD_S = 3.0  # the hysteresis window (production: 1m)
# Step 5: how long the throttled session keeps hammering. Without the hysteresis the alert would
# resolve (and the throttle be lifted) about one evaluation after the share drops.
KEEP_HAMMERING_S = max(4 * FOR_S, 3 * HOLD_S)
ADMIN_TOKEN = "admin-token-e2e-7d41"
METRICS_TOKEN = "metrics-token-e2e-90c2"  # Prometheus scrapes with it, as the shipped files do
# Identity is (tenant, session): both sessions belong to this API key's tenant, and the alert
# throttles the runaway (tenant, session) only.
TENANT = "team-a"
API_KEY = "sk-team-a-e2e-5b20"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# Long enough that only Alertmanager's resolution can lift the throttle within the test.
ALERT_THROTTLE_TTL_S = 600.0

MODEL = "sim-llama-3-8b"
KV_BYTES_PER_TOKEN = 131072  # llama-3-8b: 2 x 32 layers x 8 KV heads x 128 dims x 2 bytes
LONG_PROMPT_TOKENS = 2000
LONG_MAX_TOKENS = 64
LONG_FOOTPRINT_BYTES = (LONG_PROMPT_TOKENS + LONG_MAX_TOKENS) * KV_BYTES_PER_TOKEN  # ~258 MiB
BUDGET_REQUESTS = 4
INFLIGHT_BUDGET_BYTES = BUDGET_REQUESTS * LONG_FOOTPRINT_BYTES
# More threads than the budget holds, so the budget stays full between one request's end and
# the next one's start; refused threads back off briefly instead of spinning.
HAMMER_THREADS = BUDGET_REQUESTS + 2
HAMMER_BACKOFF_S = 0.05

# Deadlines (seconds). Scrape and evaluation every 1 s, ``for`` 2 s, Alertmanager group_wait and
# group_interval 1 s: each step normally takes 1-5 s.
STEP_TIMEOUT_S = 20.0
POLL_S = 0.05


# -- simulated workers on their own loop ------------------------------------------------------


@contextlib.contextmanager
def sim_fleet(configs: list[SimWorkerConfig]) -> Iterator[list[str]]:
    """A ``SimFleet`` running on a fresh event loop in a daemon thread; yields the worker URLs."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="sim-fleet", daemon=True)
    thread.start()
    fleet = SimFleet(configs)
    try:
        urls = asyncio.run_coroutine_threadsafe(fleet.start(), loop).result(30)
        yield list(urls)
    finally:
        asyncio.run_coroutine_threadsafe(fleet.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


# -- a recorder of the gateway's webhook ------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WebhookCall:
    at_s: float
    authorization: str
    payload: dict[str, Any]
    status: int
    answer: dict[str, Any]

    def alerts_for(self, session: str) -> list[dict[str, Any]]:
        return [a for a in self.payload.get("alerts", [])
                if a.get("labels", {}).get("session") == session]

    def answered(self, key: str) -> list[str]:
        """The sessions of ``TENANT`` the gateway says it ``throttled`` (or ``lifted``)."""
        return [x["session_id"] for x in self.answer.get(key, []) if x["tenant"] == TENANT]


class WebhookRecorder:
    """Wraps the gateway's ASGI app; records each ``POST /admin/alerts`` and the gateway's answer.
    Everything else (lifespan included) passes straight through."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._calls: list[WebhookCall] = []
        self._lock = threading.Lock()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != "/admin/alerts":
            await self.app(scope, receive, send)
            return
        request_body: list[bytes] = []
        answer_body: list[bytes] = []
        status = 0

        async def recording_receive() -> Message:
            msg = await receive()
            if msg["type"] == "http.request":
                request_body.append(msg.get("body", b""))
            return msg

        async def recording_send(msg: Message) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = int(msg["status"])
            elif msg["type"] == "http.response.body":
                answer_body.append(msg.get("body", b""))
            await send(msg)

        await self.app(scope, recording_receive, recording_send)
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        call = WebhookCall(
            at_s=time.monotonic(),
            authorization=headers.get("authorization", ""),
            payload=_json_or_text(b"".join(request_body)),
            status=status,
            answer=_json_or_text(b"".join(answer_body)),
        )
        with self._lock:
            self._calls.append(call)

    def calls(self) -> list[WebhookCall]:
        with self._lock:
            return list(self._calls)

    def calls_for(self, session: str) -> list[WebhookCall]:
        return [c for c in self.calls() if c.alerts_for(session)]


def _json_or_text(raw: bytes) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except ValueError:
        return {"unparsed": raw.decode(errors="replace")}
    return value if isinstance(value, dict) else {"value": value}


# -- clients ----------------------------------------------------------------------------------


def long_body(seed: int) -> dict[str, Any]:
    """A long prompt of token ids (different per request, so each one is a real prefill)."""
    prompt = [100 + (seed * 31 + i) % 5000 for i in range(LONG_PROMPT_TOKENS)]
    return {"model": MODEL, "prompt": prompt, "max_tokens": LONG_MAX_TOKENS, "ignore_eos": True}


def short_body() -> dict[str, Any]:
    return {"model": MODEL, "prompt": [7] * 32, "max_tokens": 4, "ignore_eos": True}


def complete(client: httpx.Client, session: str, body: dict[str, Any]) -> httpx.Response:
    return client.post("/v1/completions", json=body, headers={"X-Session-ID": session, **AUTH})


def error_code(r: httpx.Response) -> str | None:
    if r.status_code == 200:
        return None
    try:
        code = r.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return f"unparsed: {r.text[:200]}"
    return str(code)


@dataclasses.dataclass(frozen=True)
class Outcome:
    at_s: float
    status: int  # -1: transport error
    code: str | None


class Hammer:
    """``threads`` clients of one session sending long prompts back to back until stopped."""

    def __init__(self, gateway: str, session: str, threads: int) -> None:
        self.gateway = gateway
        self.session = session
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._outcomes: list[Outcome] = []
        self._seq = 0
        self._threads = [threading.Thread(target=self._run, name=f"hammer-{i}", daemon=True)
                         for i in range(threads)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        """Let each thread finish its request in flight; safe to call twice, or before start."""
        self._stop.set()
        for t in self._threads:
            if t.ident is not None:
                t.join(timeout=30)
        alive = [t.name for t in self._threads if t.is_alive()]
        assert not alive, f"hammer threads did not stop: {alive}"

    def outcomes(self) -> list[Outcome]:
        with self._lock:
            return list(self._outcomes)

    def tally(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for o in self.outcomes():
            key = f"{o.status} {o.code}" if o.code else str(o.status)
            out[key] = out.get(key, 0) + 1
        return out

    def _next_seed(self) -> int:
        with self._lock:
            self._seq += 1
            return self._seq

    def _run(self) -> None:
        with httpx.Client(base_url=self.gateway, timeout=30) as client:
            while not self._stop.is_set():
                try:
                    r = complete(client, self.session, long_body(self._next_seed()))
                    outcome = Outcome(time.monotonic(), r.status_code, error_code(r))
                except httpx.HTTPError as exc:
                    outcome = Outcome(time.monotonic(), -1, type(exc).__name__)
                with self._lock:
                    self._outcomes.append(outcome)
                if outcome.status != 200:
                    self._stop.wait(HAMMER_BACKOFF_S)


# -- reads ------------------------------------------------------------------------------------


def admin_session(gw: str, session: str) -> dict[str, Any] | None:
    r = httpx.get(f"{gw}/admin/tenants/{TENANT}/sessions/{session}",
                  headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=5)
    if r.status_code == 404:
        return None
    r.raise_for_status()
    view: dict[str, Any] = r.json()
    return view


def throttle_of(gw: str, session: str) -> dict[str, Any] | None:
    view = admin_session(gw, session)
    throttle: dict[str, Any] | None = None if view is None else view["throttle"]
    return throttle


def alert_throttle_of(gw: str, session: str) -> dict[str, Any] | None:
    """The session's throttle when the alert's webhook set it (its reason names the alert)."""
    throttle = throttle_of(gw, session)
    return throttle if throttle is not None and throttle["reason"] == ALERT else None


def throttled_answer(client: httpx.Client, session: str) -> httpx.Response | None:
    """A short request of ``session``: the answer when it is 429 session_throttled, else None."""
    r = complete(client, session, short_body())
    return r if r.status_code == 429 and error_code(r) == "session_throttled" else None


def prom_alerts_for(prom: Prometheus, session: str) -> list[dict[str, Any]]:
    return [a for a in prom.alerts()
            if a["labels"].get("alertname") == ALERT and a["labels"].get("session") == session]


def prom_ratio(prom: Prometheus, session: str) -> float | None:
    rows = prom.query(f'kvgate_session_kv_budget_ratio{{session="{session}"}}')
    return float(rows[0]["value"][1]) if rows else None


def am_alerts_for(am: Alertmanager, session: str) -> list[dict[str, Any]]:
    return [a for a in am.alerts()
            if a["labels"].get("alertname") == ALERT and a["labels"].get("session") == session]


def settled(am: Alertmanager, gw: str, webhook: WebhookRecorder, session: str) -> bool:
    calls = webhook.calls_for(session)
    return (am_alerts_for(am, session) == [] and throttle_of(gw, session) is None
            and bool(calls)
            and [a["status"] for a in calls[-1].alerts_for(session)] == ["resolved"])


def ratio_above(prom: Prometheus, session: str, threshold: float) -> float | None:
    ratio = prom_ratio(prom, session)
    return ratio if ratio is not None and ratio > threshold else None


def dump_state(prom: Prometheus, am: Alertmanager, gw: str, webhook: WebhookRecorder,
               hammer: Hammer) -> None:
    """Printed when the test fails (pytest shows it under "Captured stdout call")."""

    def show(title: str, read: Any) -> None:
        try:
            value = read()
        except Exception as exc:  # a diagnostic must not hide the real failure
            value = f"<unavailable: {exc!r}>"
        text = value if isinstance(value, str) else json.dumps(value, indent=1, default=str)
        print(f"\n===== {title} =====\n{text}")

    show("Prometheus /api/v1/alerts", prom.alerts)
    show("Prometheus rule health", prom.rule_health)
    show("Prometheus kvgate_session_kv_budget_ratio",
         lambda: prom.query("kvgate_session_kv_budget_ratio"))
    show("Prometheus ALERTS", lambda: prom.query(f'ALERTS{{alertname="{ALERT}"}}'))
    show("Alertmanager /api/v2/alerts", am.alerts)
    show("webhook calls (POST /admin/alerts)", lambda: [
        {"at_s": round(c.at_s, 2), "authorization": c.authorization, "status": c.status,
         "alerts": [(a.get("status"), a.get("labels", {}).get("session"))
                    for a in c.payload.get("alerts", [])],
         "answer": c.answer}
        for c in webhook.calls()])
    show("gateway /admin/sessions", lambda: httpx.get(
        f"{gw}/admin/sessions", params={"top": 20},
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=5).json())
    show("hammer tally", hammer.tally)
    show("prometheus.log (tail)", lambda: prom.log.read_text()[-3000:])
    show("alertmanager.log (tail)", lambda: am.log.read_text()[-3000:])


# -- the test ---------------------------------------------------------------------------------


def gateway_settings(worker_url: str) -> Settings:
    return build_settings({
        "models": [{"name": MODEL, "tokenizer": "simple", "architecture": "llama-3-8b"}],
        "pools": [{"name": "long-context", "max_context_tokens": 32768,
                   "workers": [worker_url]}],
        "health": {"interval_s": 0.2, "timeout_s": 30.0,
                   "scrape_interval_s": 0.5, "unhealthy_threshold": 2},
        "budgets": {"defaults": {"inflight_kv_bytes": INFLIGHT_BUDGET_BYTES}},
        "admin": {"token": ADMIN_TOKEN, "metrics_token": METRICS_TOKEN,
                  "alert_throttle_ttl_s": ALERT_THROTTLE_TTL_S},
        "auth": {"api_keys": [{"name": TENANT,
                               "sha256": hashlib.sha256(API_KEY.encode()).hexdigest()}]},
    })


@pytest.mark.timeout(120)
def test_runaway_session_is_throttled_by_its_alert_while_others_are_served_and_released_on_resolve(
    tmp_path: Path,
) -> None:
    runaway = f"runaway-{uuid.uuid4().hex[:8]}"
    calm = f"calm-{uuid.uuid4().hex[:8]}"
    worker = SimWorkerConfig(model_name=MODEL, time_scale=1.0, num_gpu_blocks=4096,
                             max_model_len=32768)
    started = time.monotonic()
    with sim_fleet([worker]) as (worker_url,):
        webhook = WebhookRecorder(create_app(gateway_settings(worker_url)))
        with serve_app(webhook, ready_path="/ready") as gw, \
                httpx.Client(base_url=gw, timeout=30) as client:
            rules = fast_rules(tmp_path, for_s=FOR_S, thresholds={ALERT: THRESHOLD},
                               hold_s=HOLD_S)
            am_config = fast_alertmanager_config(tmp_path, gw, ADMIN_TOKEN)
            # /metrics names sessions: read with the scrape token alone (deploy/prometheus)
            assert client.get("/metrics").status_code == 401
            token_file = tmp_path / "kvgate_metrics_token"
            token_file.write_text(METRICS_TOKEN + "\n")
            job = scrape_job("kvgate", [gw.removeprefix("http://")])
            job["authorization"] = {"credentials_file": str(token_file)}
            with run_alertmanager(tmp_path, am_config) as am, run_prometheus(
                tmp_path, [job],
                rule_files=[rules], alertmanager=am.hostport,
            ) as prom:
                hammer = Hammer(gw, runaway, HAMMER_THREADS)
                try:
                    # 1. Quiet: the calm session is served; Prometheus scrapes; nothing alerts.
                    prom.wait_for_targets_up(1, timeout_s=STEP_TIMEOUT_S)
                    r = complete(client, calm, short_body())
                    assert r.status_code == 200, r.text
                    assert prom.rule_health()[ALERT] in ("ok", "unknown")
                    assert prom_alerts_for(prom, runaway) == []

                    hammer.start()
                    # 2. The runaway session holds most of its budget, as Prometheus sees.
                    ratio = wait_until(
                        lambda: ratio_above(prom, runaway, THRESHOLD), STEP_TIMEOUT_S,
                        f"Prometheus to scrape a budget ratio > {THRESHOLD} for {runaway}",
                        interval_s=POLL_S)
                    assert ratio <= 1.0 + 1e-9, ratio  # the budget itself is enforced

                    # 3. The alert fires for the runaway session only; Alertmanager calls the
                    # gateway with the admin token; the gateway throttles the session.
                    firing = prom.wait_for_alert(ALERT, "firing", timeout_s=STEP_TIMEOUT_S,
                                                 session=runaway)
                    assert firing["labels"]["throttle"] == "throttled"
                    assert firing["labels"]["tenant"] == TENANT
                    assert {a["labels"]["session"] for a in prom.alerts()
                            if a["labels"].get("alertname") == ALERT} == {runaway}

                    throttle = wait_until(
                        lambda: alert_throttle_of(gw, runaway), STEP_TIMEOUT_S,
                        f"the gateway to throttle {runaway} from the alert",
                        interval_s=POLL_S)
                    assert throttle["state"] == "throttled", throttle
                    set_by = [c for c in webhook.calls_for(runaway)
                              if runaway in c.answered("throttled")]
                    assert set_by, webhook.calls()
                    call = set_by[0]
                    assert call.authorization == f"Bearer {ADMIN_TOKEN}"
                    assert call.status == 200
                    assert call.payload["version"] == "4"
                    assert [a["status"] for a in call.alerts_for(runaway)] == ["firing"]
                    assert all(calm not in c.answered("throttled")
                               for c in webhook.calls())

                    # 4. While it keeps hammering: the runaway session gets 429
                    # session_throttled, the calm session is served.
                    throttled_at = time.monotonic()
                    refused = wait_until(
                        lambda: throttled_answer(client, runaway), STEP_TIMEOUT_S,
                        f"{runaway} to get 429 session_throttled", interval_s=POLL_S)
                    assert "throttled" in refused.json()["error"]["message"]
                    assert float(refused.headers["retry-after"]) > 0
                    served = complete(client, calm, short_body())
                    assert served.status_code == 200, served.text
                    assert served.json()["choices"][0]["text"]
                    wait_until(
                        lambda: any(o.code == "session_throttled" and o.at_s >= throttled_at
                                    for o in hammer.outcomes()) or None,
                        STEP_TIMEOUT_S, "the hammer's own requests to be throttled",
                        interval_s=POLL_S)

                    # 5. It keeps hammering for several `for` periods: throttled to one request
                    # at a time, its share drops under the threshold, and still the alert keeps
                    # firing and the session stays throttled the whole time (hysteresis).
                    hold_started = time.monotonic()
                    shares: list[float | None] = []
                    while time.monotonic() - hold_started < KEEP_HAMMERING_S:
                        assert alert_throttle_of(gw, runaway) is not None, (
                            f"{runaway} lost its throttle "
                            f"{time.monotonic() - hold_started:.1f} s into the hammering")
                        assert [a["state"] for a in prom_alerts_for(prom, runaway)] \
                            == ["firing"], prom_alerts_for(prom, runaway)
                        resolved = [c for c in webhook.calls_for(runaway)
                                    if "resolved" in {a["status"] for a in c.alerts_for(runaway)}
                                    or runaway in c.answered("lifted")]
                        assert resolved == [], resolved
                        shares.append(prom_ratio(prom, runaway))
                        time.sleep(POLL_S)
                    held = [r for r in shares if r is not None]
                    assert held and min(held) <= THRESHOLD, (
                        f"the throttled session's share never fell to {THRESHOLD}: {shares}")
                    assert held[-1] <= THRESHOLD, shares[-10:]  # and it stayed there
                    served_throttled = [o for o in hammer.outcomes()
                                        if o.status == 200 and o.at_s >= hold_started]
                    assert served_throttled, hammer.tally()  # throttled, not blocked

                    # 6. The runaway session stops: the alert resolves, Alertmanager sends the
                    # resolution, the gateway lifts its throttle, the session is served again.
                    stopped_at = time.monotonic()
                    hammer.stop()
                    tally = hammer.tally()
                    assert tally.get("200", 0) >= BUDGET_REQUESTS, tally
                    assert set(tally) <= {"200", "429 kv_budget_exceeded",
                                          "429 session_throttled"}, tally
                    wait_until(lambda: prom_ratio(prom, runaway) is None, STEP_TIMEOUT_S,
                               f"the ratio series of {runaway} to go")
                    wait_until(lambda: prom_alerts_for(prom, runaway) == [], STEP_TIMEOUT_S,
                               f"{ALERT} for {runaway} to resolve in Prometheus",
                               interval_s=POLL_S)
                    # Settled: Alertmanager holds nothing for it, the gateway no throttle, and
                    # the last call about it was the resolution.
                    wait_until(lambda: settled(am, gw, webhook, runaway), STEP_TIMEOUT_S,
                               f"Alertmanager to resolve and the gateway to release {runaway}",
                               interval_s=POLL_S)
                    last = webhook.calls_for(runaway)[-1]
                    assert [a["status"] for a in last.alerts_for(runaway)] == ["resolved"], last
                    assert last.authorization == f"Bearer {ADMIN_TOKEN}"
                    assert last.status == 200
                    lifts = [c for c in webhook.calls_for(runaway)
                             if runaway in c.answered("lifted")]
                    assert lifts, webhook.calls()
                    # Lifted only once the session had stopped, never while it kept hammering.
                    assert all(c.at_s >= stopped_at for c in lifts), (stopped_at, lifts)

                    # Two long requests at once: a throttled session would get only one.
                    with ThreadPoolExecutor(max_workers=2) as pool:
                        pair = list(pool.map(
                            lambda seed: httpx.post(f"{gw}/v1/completions", json=long_body(seed),
                                                    headers={"X-Session-ID": runaway,
                                                             **AUTH},
                                                    timeout=30),
                            (10_001, 10_002)))
                    assert [r.status_code for r in pair] == [200, 200], [
                        (r.status_code, r.text) for r in pair]
                    assert complete(client, calm, short_body()).status_code == 200
                except BaseException:
                    dump_state(prom, am, gw, webhook, hammer)
                    raise
                finally:
                    hammer.stop()
                    print(f"\ne2e throttle test: {time.monotonic() - started:.1f} s; hammer "
                          f"{hammer.tally()}; webhook calls "
                          f"{[(round(c.at_s - started, 1), c.answer) for c in webhook.calls()]}")
