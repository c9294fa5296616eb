"""The live status page /ui and its JSON /ui/state.

The state is checked against fake Services (budgets absent, present, failing); the page itself is
loaded by Debian's headless Chromium from a real gateway (in front of workers with vLLM-shaped
/metrics, one request held in flight so a session holds KV), which must render the worker URLs
from the JSON it fetched; the screenshot becomes docs/ui.png when ``KVGATE_UPDATE_DOCS=1`` (a
test run leaves the tree as it was). No Chromium: the test fails.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.api import ui
from gateway.app import create_app
from gateway.config import build_settings
from gateway.routing.accounting import HitLedger, MismatchDetector
from gateway.workers.worker import VllmStats, Worker
from tests.harness import serve_app
from tests.integration.observability_fixtures import ROOT, fake_vllm_worker, vllm_metrics_page

SCREENSHOT = ROOT / "docs" / "ui.png"
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", "--hide-scrollbars",
]
HELD_SESSION = "tenant-a:agent-7"


def chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    raise AssertionError("chromium is not installed: run scripts/setup.sh --test (Debian chromium)")


# --- /ui/state against fake Services --------------------------------------------------------------

@dataclass(frozen=True)
class FakeThrottle:
    state: str
    expires_at: float
    reason: str = "alert KvgateRunawaySession"


@dataclass(frozen=True)
class FakeUsage:
    session_id: str | None
    inflight_kv_bytes: int
    inflight_requests: int
    throttle: FakeThrottle | None
    tenant: str = "team-a"


class FakeBudgets:
    def __init__(self, rows: list[FakeUsage], fail: bool = False,
                 tenants: list[FakeUsage] | None = None) -> None:
        self.rows = rows
        self.fail = fail
        self.tenants = tenants or []
        self.asked: list[int | None] = []

    async def sessions(self, top: int | None = None) -> list[FakeUsage]:
        self.asked.append(top)
        if self.fail:
            raise ConnectionError("redis down")
        return self.rows

    async def tenants_usage(self) -> list[FakeUsage]:
        return self.tenants


def fake_services(budgets: Any = None, with_attr: bool = True) -> Any:
    settings = build_settings({
        "models": [{"name": "m", "tokenizer": "simple"}],
        "pools": [
            {"name": "short-chat", "max_context_tokens": 8192, "policy": "kv_aware",
             "workers": ["http://127.0.0.1:8101", "http://127.0.0.1:8102"]},
            {"name": "long-context", "max_context_tokens": 131072,
             "workers": ["http://127.0.0.1:8201"]},
        ],
    })
    workers = [
        Worker("http://127.0.0.1:8101", "short-chat", healthy=True,
               stats=VllmStats(running=3, waiting=1, kv_usage_ratio=0.42,
                               prefix_cache_queries_tokens=1000, prefix_cache_hits_tokens=250)),
        Worker("http://127.0.0.1:8102", "short-chat", healthy=False),
        Worker("http://127.0.0.1:8201", "long-context", healthy=True,
               stats=VllmStats(running=1, kv_usage_ratio=0.97)),
    ]
    workers[0].inflight, workers[2].inflight = 3, 1
    ns = SimpleNamespace(settings=settings, workers=workers)
    if with_attr:
        ns.budgets = budgets
    return ns


def state_of(services: Any) -> dict[str, Any]:
    app = FastAPI()
    app.include_router(ui.router)
    app.state.services = services

    async def get() -> dict[str, Any]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://ui") as client:
            r = await client.get("/ui/state")
            assert r.status_code == 200
            assert r.headers["cache-control"] == "no-store"
            body: dict[str, Any] = r.json()
            return body

    return asyncio.run(get())


def test_state_lists_pools_and_workers_without_budgets() -> None:
    for services in (fake_services(None), fake_services(with_attr=False)):
        s = state_of(services)
        assert s["sessions"] is None and s["sessions_error"] is None
        assert [p["name"] for p in s["pools"]] == ["short-chat", "long-context"]
        short = s["pools"][0]
        assert (short["policy"], short["workers"], short["healthy"], short["inflight"]) == (
            "kv_aware", 2, 1, 3)
        w = {x["url"]: x for x in s["workers"]}
        assert w["http://127.0.0.1:8101"] == {
            "url": "http://127.0.0.1:8101", "pool": "short-chat", "healthy": True, "inflight": 3,
            "kv_usage_ratio": 0.42, "prefix_hit_ratio": 0.25, "running": 3, "waiting": 1,
        }
        assert w["http://127.0.0.1:8102"]["healthy"] is False


def test_state_lists_top_sessions_and_tenants_with_throttles() -> None:
    budgets = FakeBudgets([
        FakeUsage("tenant-a:run-42", 12 * 2**30, 4,
                  FakeThrottle("throttled", time.time() + 600)),
        FakeUsage("bob", 512 * 2**20, 1, None, tenant="team-b"),
    ], tenants=[FakeUsage(None, 13 * 2**30, 5, FakeThrottle("blocked", time.time() + 60))])
    s = state_of(fake_services(budgets))
    assert budgets.asked == [ui.TOP_SESSIONS]
    assert [(x["tenant"], x["session"]) for x in s["sessions"]] == [
        ("team-a", "tenant-a:run-42"), ("team-b", "bob")]
    assert s["tenants"][0]["tenant"] == "team-a" and s["tenants"][0]["session"] is None
    assert s["tenants"][0]["throttle"]["state"] == "blocked"
    assert s["sessions"][0]["kv_bytes"] == 12 * 2**30
    throttle = s["sessions"][0]["throttle"]
    assert throttle["state"] == "throttled" and 590 < throttle["expires_in_s"] <= 600
    assert s["sessions"][1]["throttle"] is None


def test_state_survives_a_budget_store_outage() -> None:
    s = state_of(fake_services(FakeBudgets([], fail=True)))
    assert s["sessions"] == [] and "ConnectionError" in s["sessions_error"]
    assert len(s["workers"]) == 3


def test_state_shows_hit_accounting_per_pool_and_the_mismatched_models() -> None:
    services = fake_services(None)
    assert state_of(services)["hits"] is None  # no dispatcher: nothing routed here
    ledger = HitLedger(8, detector=MismatchDetector(window=2, min_samples=2))
    pool = services.settings.pools[0]
    for rid, delivered in (("a", 512), ("b", None)):
        rec = ledger.routed(rid, "m", pool, "kv_aware", "prefix_hit", "http://127.0.0.1:8101",
                            1000, 512, 512)
        ledger.settle(rec, None if delivered is None else {
            "prompt_tokens_details": {"cached_tokens": delivered}})
    services.dispatcher = SimpleNamespace(hits=ledger)
    hits = state_of(services)["hits"]
    (short,) = hits["pools"]
    assert (short["pool"], short["prompt_tokens"]) == ("short-chat", 2000)
    assert short["outcomes"]["delivered"] == 512 and short["outcomes"]["unknown"] == 512
    assert short["shares"]["never_seen"] == 976 / 2000
    assert hits["mismatched_models"] == []
    for rid in ("c", "d"):
        rec = ledger.routed(rid, "m", pool, "kv_aware", "prefix_hit", "http://127.0.0.1:8101",
                            1000, 512, 512)
        ledger.settle(rec, {"prompt_tokens_details": {"cached_tokens": 0}})
    assert state_of(services)["hits"]["mismatched_models"] == ["m"]


def test_page_is_self_contained() -> None:
    page = ui.PAGE
    assert "<script" in page and "<style>" in page
    for external in ("http://", "https://", "src=", "href=", "@import", "url("):
        assert external not in page, external
    assert "textContent" in page and "innerHTML" not in page  # session ids are never HTML


# --- the page in headless Chromium, on a real gateway ---------------------------------------------

def slow_worker(page: str, delay_s: float) -> ASGIApp:
    """A fake vLLM worker whose completions take ``delay_s`` (a request held in flight)."""
    inner = fake_vllm_worker(page)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].endswith("/completions"):
            await asyncio.sleep(delay_s)
        await inner(scope, receive, send)

    return app


@pytest.fixture(scope="module")
def gateway_with_ui() -> Iterator[str]:
    short_page = vllm_metrics_page(running=3, kv_usage=0.62, prefix_hits_tokens=700)
    long_page = vllm_metrics_page(running=1, waiting=0, kv_usage=0.31, prefix_hits_tokens=150)
    with serve_app(slow_worker(short_page, 8.0)) as short_a, \
            serve_app(fake_vllm_worker(short_page)) as short_b, \
            serve_app(fake_vllm_worker(long_page)) as long_a:
        settings = build_settings({
            "models": [{"name": "noop", "tokenizer": "simple", "architecture": "llama-3-8b"}],
            "pools": [
                {"name": "short-chat", "max_context_tokens": 8192, "policy": "round_robin",
                 "workers": [short_a, short_b]},
                {"name": "long-context", "max_context_tokens": 131072, "workers": [long_a]},
            ],
            "health": {"interval_s": 0.2, "timeout_s": 30.0, "scrape_interval_s": 0.3},
        })
        app = create_app(settings)
        if not any(getattr(r, "path", None) == "/ui" for r in app.api.routes):
            app.api.include_router(ui.router)  # until the lead includes it in create_app
        with serve_app(app, ready_path="/ready") as gateway:
            yield gateway


def hold_a_request(gateway: str, stop: threading.Event) -> threading.Thread:
    """Requests of ``HELD_SESSION`` back to back until ``stop``: round robin sends every other
    one to the slow worker, so the session is in flight whenever the page asks, however long
    Chromium takes to start (it once took longer than one held request, in a full run)."""
    def run() -> None:
        while not stop.is_set():
            httpx.post(gateway + "/v1/chat/completions", timeout=30,
                       headers={"X-Session-ID": HELD_SESSION},
                       json={"model": "noop", "max_tokens": 512,
                             "messages": [{"role": "user", "content": "summarise " * 200}]})

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def run_chromium(url: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    profile = tmp_path / f"chromium-{time.monotonic_ns()}"
    return subprocess.run(
        [chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
         "--virtual-time-budget=5000", *args, url],
        capture_output=True, text=True, timeout=60, check=False,
    )


def test_page_in_chromium_renders_workers_and_sessions_from_state(
    gateway_with_ui: str, tmp_path: Path
) -> None:
    gateway = gateway_with_ui
    stop = threading.Event()
    held = hold_a_request(gateway, stop)
    deadline = time.monotonic() + 60
    state: dict[str, Any] = {}
    while time.monotonic() < deadline:
        state = httpx.get(gateway + "/ui/state").json()
        if (state["sessions"] and all(w["kv_usage_ratio"] > 0 for w in state["workers"])
                and state["hits"]["pools"]):
            break
        time.sleep(0.1)
    assert state["sessions"], state
    urls = [w["url"] for w in state["workers"]]

    dom = run_chromium(gateway + "/ui", tmp_path, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    for url in urls:
        assert url in html, f"{url} not rendered"
    assert HELD_SESSION in html
    assert "updated " in html and "loading..." not in html
    assert "62.0%" in html  # KV usage of the short-chat workers, from their /metrics
    # Hit accounting: a row per pool that routed (the fake workers report no cached tokens,
    # so what was predicted at the chosen worker is of unknown outcome)
    hits = re.search(r'<table id="hits">.*?</table>', html, re.S)
    assert hits is not None and "short-chat" in hits.group(0) and "%" in hits.group(0)
    assert "no request accounted yet" not in hits.group(0)

    png = tmp_path / "ui.png"
    shot = run_chromium(gateway + "/ui", tmp_path, f"--screenshot={png}",
                        "--window-size=1200,800")
    assert shot.returncode == 0, shot.stderr[-2000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000  # a rendered page, not a blank one
    if os.environ.get("KVGATE_UPDATE_DOCS"):  # the docs' screenshot, only when asked
        shutil.copyfile(png, SCREENSHOT)
    stop.set()
    held.join(timeout=30)
