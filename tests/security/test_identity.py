"""Identity is (tenant, session) (issue 12, item 1), tried as a hostile client would.

Before the fix the session was whatever ``X-Session-ID`` or ``user`` said, whatever the API key:
key B opening two streams as ``X-Session-ID: alice`` made alice's own request get 429; a session
blocked by an operator or an alert was served again as ``bob-2``; six requests under six rotating
ids all got 200; and a request naming no session reserved nothing at all. Each way gets a test
here, over real sockets (a gateway with two API keys, budgets and an admin token in front of
``HeldBackend``, a worker that holds requests until the test lets them go), on the memory and the
Redis budget stores. The store-level contract (``tests/integration/test_budget_contract.py``, its
tenant section) proves the same on the memory store shared by the processes of one gateway
(``--processes N``).
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from gateway import promtext
from gateway.app import create_app
from tests.harness import serve_app
from tests.integration.test_gateway_budgets import (
    ADMIN_TOKEN,
    FOOTPRINT_BYTES,
    HeldBackend,
    am_alert,
    am_payload,
    assert_openai_error,
    completion_body,
    gateway_settings,
)

pytest_plugins = ["tests.integration.redis_fixture"]
pytestmark = pytest.mark.timeout(120)

KEYS = {"team-a": "sk-team-a-4f1c0d9e2b7a", "team-b": "sk-team-b-8e3a1f6c5d20"}
SESSION_REQUESTS = 2  # in flight per session
TENANT_REQUESTS = 3  # in flight per tenant, over all its sessions


def settings(backend: str, store: dict[str, Any]) -> Any:
    return gateway_settings(
        [backend],
        budgets={**store, "defaults": {"inflight_requests": SESSION_REQUESTS,
                                       "tenant": {"inflight_requests": TENANT_REQUESTS}}},
        auth={"api_keys": [{"name": name, "sha256": hashlib.sha256(key.encode()).hexdigest()}
                           for name, key in KEYS.items()]},
        admin={"token": ADMIN_TOKEN},
    )


@pytest.fixture(scope="module")
def backend_app() -> HeldBackend:
    return HeldBackend()


@pytest.fixture(scope="module")
def backend(backend_app: HeldBackend) -> Iterator[str]:
    with serve_app(backend_app) as url:
        yield url


@pytest.fixture(scope="module", params=["memory", "redis"])
def gw(request: pytest.FixtureRequest, backend: str) -> Iterator[str]:
    store: dict[str, Any] = {"store": "memory"}
    if request.param == "redis":
        store = {"store": "redis", "redis_url": request.getfixturevalue("redis_server"),
                 "redis_key_prefix": f"identity:{uuid.uuid4().hex[:8]}"}
    with serve_app(create_app(settings(backend, store)), ready_path="/ready") as url:
        yield url


@pytest.fixture(scope="module")
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=16) as executor:
        yield executor


@pytest.fixture
def worker(backend_app: HeldBackend) -> Iterator[HeldBackend]:
    """The shared worker, idle before and after each test (nothing held leaks into the next)."""
    backend_app.wait_holding(0)
    try:
        yield backend_app
    finally:
        backend_app.release_all()
        backend_app.wait_holding(0)


def post(gw: str, tenant: str, session: str | None = None, **body: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    if session is not None:
        headers["X-Session-ID"] = session
    return httpx.post(gw + "/v1/completions", json=completion_body(**body), headers=headers,
                      timeout=15)


def hold(pool: ThreadPoolExecutor, gw: str, tenant: str,
         session: str | None) -> Future[httpx.Response]:
    return pool.submit(post, gw, tenant, session, x_hold=True)


def admin(method: str, gw: str, path: str, body: Any = None) -> httpx.Response:
    return httpx.request(method, gw + path, json=body, timeout=10,
                         headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})


def new(label: str) -> str:
    return f"{label}-{uuid.uuid4().hex[:8]}"


def finish(worker: HeldBackend, held: list[Future[httpx.Response]]) -> None:
    worker.release_all()
    assert [f.result().status_code for f in held] == [200] * len(held)


def test_another_key_using_my_session_id_cannot_use_up_my_budget(
    gw: str, worker: HeldBackend, pool: ThreadPoolExecutor
) -> None:
    """Regression: key B holding two requests as ``alice`` made A's ``alice`` get 429."""
    alice = new("alice")
    spoofed = [hold(pool, gw, "team-b", alice) for _ in range(SESSION_REQUESTS)]
    worker.wait_holding(SESSION_REQUESTS)
    assert post(gw, "team-a", alice).status_code == 200  # A's alice is A's own
    assert_openai_error(post(gw, "team-b", alice), 429, "rate_limit_exceeded")  # B's is full
    a_alice = admin("GET", gw, f"/admin/tenants/team-a/sessions/{alice}")
    assert a_alice.status_code == 200 and a_alice.json()["inflight_requests"] == 0
    b_alice = admin("GET", gw, f"/admin/tenants/team-b/sessions/{alice}").json()
    assert (b_alice["tenant"], b_alice["inflight_requests"]) == ("team-b", SESSION_REQUESTS)
    finish(worker, spoofed)


def test_rotating_session_ids_hit_the_tenant_budget(
    gw: str, worker: HeldBackend, pool: ThreadPoolExecutor
) -> None:
    """Regression: six requests under six rotating ids all got 200 past a per-session budget."""
    held = [hold(pool, gw, "team-a", new("rot")) for _ in range(TENANT_REQUESTS)]
    worker.wait_holding(TENANT_REQUESTS)
    for _ in range(3):
        err = assert_openai_error(post(gw, "team-a", new("rot")), 429, "rate_limit_exceeded")
        assert "Tenant 'team-a'" in err["message"]
    assert post(gw, "team-b", new("rot")).status_code == 200  # another tenant is not affected
    tenant = admin("GET", gw, "/admin/tenants/team-a").json()
    assert (tenant["session_id"], tenant["inflight_requests"]) == (None, TENANT_REQUESTS)
    finish(worker, held)


def test_requests_naming_no_session_are_charged_to_the_tenants_default_session(
    gw: str, worker: HeldBackend, pool: ThreadPoolExecutor
) -> None:
    """Regression: a request without ``X-Session-ID`` or ``user`` reserved nothing at all."""
    held = [hold(pool, gw, "team-a", None) for _ in range(SESSION_REQUESTS)]
    worker.wait_holding(SESSION_REQUESTS)
    assert_openai_error(post(gw, "team-a"), 429, "rate_limit_exceeded")
    view = admin("GET", gw, "/admin/tenants/team-a/sessions/default").json()
    assert (view["inflight_requests"], view["inflight_kv_bytes"]) == (
        SESSION_REQUESTS, SESSION_REQUESTS * FOOTPRINT_BYTES)
    assert post(gw, "team-b").status_code == 200  # B's default session is B's
    finish(worker, held)


def test_blocked_session_stays_blocked_for_its_key_and_new_ids_hit_the_tenant_budget(
    gw: str, worker: HeldBackend, pool: ThreadPoolExecutor
) -> None:
    """Regression: a session blocked by an operator was served again as ``bob-2``. Now new ids
    still count against the tenant, a tenant block refuses every id, and a blocked id reused by
    another key is that key's own session."""
    bob = new("bob")
    r = admin("POST", gw, f"/admin/tenants/team-a/sessions/{bob}/throttle",
              {"state": "blocked", "ttl_s": 300})
    assert r.status_code == 200 and r.json()["tenant"] == "team-a"
    try:
        assert_openai_error(post(gw, "team-a", bob), 429, "session_throttled")
        assert post(gw, "team-b", bob).status_code == 200
        escaped = [hold(pool, gw, "team-a", f"{bob}-{i}") for i in range(TENANT_REQUESTS)]
        worker.wait_holding(TENANT_REQUESTS)
        assert_openai_error(post(gw, "team-a", f"{bob}-x"), 429, "rate_limit_exceeded")
        finish(worker, escaped)
        r = admin("POST", gw, "/admin/tenants/team-a/throttle", {"state": "blocked", "ttl_s": 300})
        assert r.status_code == 200 and r.json()["session_id"] is None
        for sid in (f"{bob}-2", new("fresh"), None):
            err = assert_openai_error(post(gw, "team-a", sid), 429, "session_throttled")
            assert "Tenant 'team-a' is blocked" in err["message"]
        assert post(gw, "team-b", new("fresh")).status_code == 200
    finally:
        admin("DELETE", gw, "/admin/tenants/team-a/throttle")
        admin("DELETE", gw, f"/admin/tenants/team-a/sessions/{bob}/throttle")
    assert post(gw, "team-a", f"{bob}-2").status_code == 200
    assert post(gw, "team-a", bob).status_code == 200


def test_alerts_throttle_only_the_tenant_and_session_they_name(gw: str) -> None:
    alice = new("alice")
    fired = admin("POST", gw, "/admin/alerts", am_payload([
        am_alert(alice, "firing", throttle="blocked", tenant="team-a"),
        am_alert(alice, "firing", throttle="blocked", tenant="someone-else"),  # not a tenant
    ]))
    assert fired.json() == {"throttled": [{"tenant": "team-a", "session_id": alice}],
                            "lifted": []}
    try:
        assert_openai_error(post(gw, "team-a", alice), 429, "session_throttled")
        assert post(gw, "team-b", alice).status_code == 200
    finally:
        admin("POST", gw, "/admin/alerts", am_payload([
            am_alert(alice, "resolved", throttle="blocked", tenant="team-a")]))
    assert post(gw, "team-a", alice).status_code == 200
    # An alert with a `tenant` label and no `session` one throttles the whole tenant.
    whole = am_alert(None, "firing", alertname="KvgateRunawayTenant", throttle="blocked")
    whole["labels"]["tenant"] = "team-b"
    assert admin("POST", gw, "/admin/alerts", am_payload([whole])).json()["throttled"] == [
        {"tenant": "team-b", "session_id": None}]
    try:
        assert_openai_error(post(gw, "team-b", new("any")), 429, "session_throttled")
        assert post(gw, "team-a", new("any")).status_code == 200
    finally:
        admin("DELETE", gw, "/admin/tenants/team-b/throttle")


def test_admin_api_names_only_tenants_the_gateway_serves(gw: str) -> None:
    for method, path in (("GET", "/admin/tenants/anonymous"),
                         ("POST", "/admin/tenants/nobody/sessions/s/throttle"),
                         ("GET", "/admin/sessions?tenant=nobody")):
        r = admin(method, gw, path, {} if method == "POST" else None)
        assert_openai_error(r, 404, "tenant_not_found")


def test_metrics_and_ui_show_each_session_with_its_tenant(
    gw: str, worker: HeldBackend, pool: ThreadPoolExecutor
) -> None:
    shared = new("shared")
    held = [hold(pool, gw, tenant, shared) for tenant in KEYS]
    worker.wait_holding(len(KEYS))
    try:
        text = httpx.get(gw + "/metrics", timeout=10).text
        for tenant in KEYS:
            assert promtext.value(text, "kvgate_session_kv_bytes", tenant=tenant,
                                  session=shared) == FOOTPRINT_BYTES
            assert promtext.value(text, "kvgate_tenant_kv_bytes", tenant=tenant) == FOOTPRINT_BYTES
        state = admin("GET", gw, "/ui/state").json()
        assert {(s["tenant"], s["session"]) for s in state["sessions"]} == {
            (tenant, shared) for tenant in KEYS}
        assert {t["tenant"] for t in state["tenants"]} == set(KEYS)
        # Regression: anyone reaching the port saw every key's session ids (often end users').
        for headers in ({}, {"Authorization": f"Bearer {KEYS['team-a']}"},
                        {"Authorization": "Bearer not-the-admin-token"}):
            hidden = httpx.get(gw + "/ui/state", headers=headers, timeout=10)
            assert hidden.status_code == 200 and shared not in hidden.text
            body = hidden.json()
            assert (body["sessions_hidden"], body["sessions"], body["tenants"]) == (
                True, None, None)
            assert body["workers"]  # the rest of the page is still there
    finally:
        finish(worker, held)


def test_a_blocked_key_or_session_cannot_use_the_gateways_tokenizer(gw: str) -> None:
    """Regression: ``/tokenize`` and ``/detokenize`` checked the key alone, so a tenant or a
    session blocked by an operator or an alert kept the gateway's tokenizer (its CPU) for any
    body up to ``limits.max_body_bytes``. They are refused as the request path refuses."""
    body = {"model": completion_body()["model"], "prompt": "hello " * 200}

    def call(tenant: str, path: str = "/tokenize", session: str | None = None,
             json: Any = body) -> httpx.Response:
        headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
        if session is not None:
            headers["X-Session-ID"] = session
        return httpx.post(gw + path, json=json, headers=headers, timeout=15)

    tokens = call("team-a").json()["tokens"]
    untokenize = {"model": body["model"], "tokens": tokens}
    bob = new("bob")
    assert admin("POST", gw, f"/admin/tenants/team-a/sessions/{bob}/throttle",
                 {"state": "blocked", "ttl_s": 300}).status_code == 200
    try:
        assert_openai_error(call("team-a", session=bob), 429, "session_throttled")
        assert call("team-a", session=new("other")).status_code == 200
        assert call("team-b", session=bob).status_code == 200  # another key's bob
        assert admin("POST", gw, "/admin/tenants/team-a/throttle",
                     {"state": "blocked", "ttl_s": 300}).status_code == 200
        for path, json in (("/tokenize", body), ("/detokenize", untokenize)):
            err = assert_openai_error(call("team-a", path, new("fresh"), json), 429,
                                      "session_throttled")
            assert "Tenant 'team-a' is blocked" in err["message"]
        assert call("team-b", "/detokenize", json=untokenize).status_code == 200
    finally:
        admin("DELETE", gw, "/admin/tenants/team-a/throttle")
        admin("DELETE", gw, f"/admin/tenants/team-a/sessions/{bob}/throttle")
    assert call("team-a", session=bob).json()["tokens"] == tokens
    # nothing stays reserved by a call that holds no KV
    view = admin("GET", gw, f"/admin/tenants/team-a/sessions/{bob}").json()
    assert (view["inflight_requests"], view["inflight_kv_bytes"]) == (0, 0)


METRICS_TOKEN = "metrics-token-3b9e51"


def test_metrics_with_a_scrape_token_are_read_only_with_it(backend: str) -> None:
    """``/metrics``'s top-K series name tenants and session ids (often end users' ids): with
    ``admin.metrics_token`` set, a scrape needs it (or the admin token); a client key, a wrong
    token or none gets 401. Unset, it stays open, as vLLM's is (the test above scrapes so)."""
    base = settings(backend, {"store": "memory"})
    configured = base.model_copy(update={"admin": base.admin.model_copy(
        update={"metrics_token": SecretStr(METRICS_TOKEN)})})
    with serve_app(create_app(configured), ready_path="/ready") as url:
        assert post(url, "team-a", "user-1729").status_code == 200
        for token, code in ((None, "missing_metrics_token"),
                            (KEYS["team-a"], "invalid_metrics_token"),
                            ("not-the-token", "invalid_metrics_token")):
            headers = {} if token is None else {"Authorization": f"Bearer {token}"}
            refused = httpx.get(url + "/metrics", headers=headers, timeout=10)
            assert_openai_error(refused, 401, code)
            assert "user-1729" not in refused.text
        for token in (METRICS_TOKEN, ADMIN_TOKEN):
            scraped = httpx.get(url + "/metrics", timeout=10,
                                headers={"Authorization": f"Bearer {token}"})
            assert scraped.status_code == 200 and "kvgate_requests_total" in scraped.text


def test_a_key_uses_only_its_models_and_is_not_told_the_others_exist(backend: str) -> None:
    """``auth.api_keys[].models``: a key limited to some models gets, for any other, the 404 a
    model nobody serves gets (same message: whether it exists is not told), on the request
    path, ``/tokenize`` and ``/v1/models``."""
    model = completion_body()["model"]
    base = settings(backend, {"store": "memory"})
    keys = [k.model_copy(update={"models": [model] if k.name == "team-a" else ["elsewhere"]})
            for k in base.auth.api_keys]
    configured = base.model_copy(update={"auth": base.auth.model_copy(update={"api_keys": keys})})
    with serve_app(create_app(configured), ready_path="/ready") as url:
        def call(tenant: str, method: str, path: str, json: Any = None) -> httpx.Response:
            return httpx.request(method, url + path, json=json, timeout=15,
                                 headers={"Authorization": f"Bearer {KEYS[tenant]}"})

        assert call("team-a", "POST", "/v1/completions", completion_body()).status_code == 200
        refused = call("team-b", "POST", "/v1/completions", completion_body())
        unknown = call("team-a", "POST", "/v1/completions", {**completion_body(), "model": "nope"})
        assert_openai_error(refused, 404, "model_not_found")
        assert_openai_error(unknown, 404, "model_not_found")
        assert (refused.json()["error"]["message"]
                == unknown.json()["error"]["message"].replace("`nope`", f"`{model}`"))
        body = {"model": model, "prompt": "hi"}
        assert call("team-a", "POST", "/tokenize", body).status_code == 200
        assert_openai_error(call("team-b", "POST", "/tokenize", body), 404, "model_not_found")
        assert [m["id"] for m in call("team-a", "GET", "/v1/models").json()["data"]] == [model]
        assert call("team-b", "GET", "/v1/models").json()["data"] == []
