"""Budgets shared through a real Redis, end to end through HTTP gateways.

Two gateway replicas share one ``redis-server`` (the ``redis_server`` fixture) and must enforce one
budget per session; a private server (``redis_control``) is killed mid-run to check the outage
policies (``fail_closed``: 503 ``budget_store_unavailable``; ``fail_open``: served, budgets kept
locally) and that the gateway goes back to Redis by itself when it returns. The worker is the
``HeldBackend`` of ``test_gateway_budgets``: its completions wait until the test lets them go.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import redis

from gateway.app import create_app
from gateway.budgets.session_id import ANONYMOUS_TENANT
from gateway.config import Settings
from tests.harness import serve_app
from tests.integration.test_gateway_budgets import (
    ADMIN_TOKEN,
    FOOTPRINT_BYTES,
    INFLIGHT_BUDGET_BYTES,
    HeldBackend,
    admin,
    assert_holds,
    assert_openai_error,
    assert_released,
    completion_body,
    eventually,
    gateway_settings,
    gauge,
    new_session,
    post,
    retry_after_s,
    session_view,
    start,
)

if TYPE_CHECKING:
    from tests.integration.redis_fixture import RedisServer

pytest_plugins = ["tests.integration.redis_fixture"]

RECOVERY_TIMEOUT_S = 10.0
ANON = ANONYMOUS_TENANT  # no API keys here: every session is the anonymous tenant's


def redis_settings(backend: str, url: str, prefix: str, **budgets: Any) -> Settings:
    return gateway_settings(
        [backend],
        budgets={
            "store": "redis",
            "redis_url": url,
            "redis_key_prefix": prefix,
            "redis_timeout_s": 0.5,
            "probe_initial_s": 0.05,
            "probe_max_s": 0.2,
            "defaults": {"request_kv_bytes": "64MiB", "inflight_kv_bytes": "24MiB"},
            **budgets,
        },
        admin={"token": ADMIN_TOKEN},
    )


@pytest.fixture(scope="module")
def backend_app() -> HeldBackend:
    return HeldBackend()


@pytest.fixture(scope="module")
def backend(backend_app: HeldBackend) -> Iterator[str]:
    with serve_app(backend_app) as url:
        yield url


@pytest.fixture
def worker(backend_app: HeldBackend, backend: str) -> Iterator[HeldBackend]:
    backend_app.wait_holding(0)
    backend_app.reset_peak()
    try:
        yield backend_app
    finally:
        backend_app.release_all()
        backend_app.wait_holding(0)


@pytest.fixture(scope="module")
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=20) as executor:
        yield executor


@pytest.fixture
def prefix() -> str:
    return f"gwtest:{uuid.uuid4().hex[:12]}"


@pytest.fixture
def replicas(backend: str, redis_server: str, prefix: str) -> Iterator[tuple[str, str]]:
    """Two gateways sharing one Redis (and one worker)."""
    settings = redis_settings(backend, redis_server, prefix)
    with ExitStack() as stack:
        a = stack.enter_context(serve_app(create_app(settings), ready_path="/ready"))
        b = stack.enter_context(serve_app(create_app(settings), ready_path="/ready"))
        yield a, b


def reservation_keys(url: str, prefix: str, session: str) -> int:
    """How many reservations Redis itself holds for ``session``."""
    with redis.Redis.from_url(url, decode_responses=True) as client:
        return int(client.hlen(f"{prefix}:{{{ANON}}}:r:{session}"))


# -- replicas ---------------------------------------------------------------------------------


def test_two_gateways_sharing_one_redis_enforce_one_budget_for_a_session(
    replicas: tuple[str, str], worker: HeldBackend, pool: ThreadPoolExecutor,
    redis_server: str, prefix: str,
) -> None:
    a, b = replicas
    session = new_session("shared")
    futures = [start(pool, post, (a, b)[i % 2], completion_body(x_hold=True), session=session,
                     key=None) for i in range(12)]
    eventually(lambda: sum(f.done() for f in futures) + worker.holding == 12,
               "every request answered or held")
    assert worker.holding == 3
    assert worker.peak_holding == 3  # one budget of three requests, not one per gateway
    for f in futures:
        if f.done():
            assert_openai_error(f.result(), 429, "kv_budget_exceeded")
            retry_after_s(f.result())
    refused_by = {i % 2 for i, f in enumerate(futures) if f.done()}
    assert refused_by == {0, 1}
    assert reservation_keys(redis_server, prefix, session) == 3
    for gateway in (a, b):  # both replicas read the same accounting
        assert_holds(gateway, session, 3, INFLIGHT_BUDGET_BYTES, ANON)
        assert gauge(gateway, "kvgate_session_kv_bytes")[session] == INFLIGHT_BUDGET_BYTES
    worker.release_all()
    assert sorted(f.result().status_code for f in futures) == [200] * 3 + [429] * 9
    for gateway in (a, b):
        assert_released(gateway, session, ANON)
    assert reservation_keys(redis_server, prefix, session) == 0


def test_throttle_set_through_one_gateway_applies_on_the_other(
    replicas: tuple[str, str], worker: HeldBackend,
) -> None:
    a, b = replicas
    session = new_session("blocked")
    r = admin("POST", a, f"/admin/tenants/{ANON}/sessions/{session}/throttle", {"state": "blocked", "ttl_s": 60})
    assert r.status_code == 200, r.text
    assert_openai_error(post(b, completion_body(), session=session, key=None), 429,
                        "session_throttled")
    assert gauge(b, "kvgate_throttled_sessions")[""] >= 1
    assert admin("DELETE", b, f"/admin/tenants/{ANON}/sessions/{session}/throttle").json()["lifted"] is True
    assert post(a, completion_body(), session=session, key=None).status_code == 200


# -- outages ----------------------------------------------------------------------------------


def test_redis_killed_mid_run_fail_closed_refuses_with_503_then_recovers(
    backend: str, worker: HeldBackend, pool: ThreadPoolExecutor, redis_control: RedisServer,
    prefix: str,
) -> None:
    settings = redis_settings(backend, redis_control.url, prefix, outage_policy="fail_closed")
    with serve_app(create_app(settings), ready_path="/ready") as gw:
        before = new_session("before")
        held = start(pool, post, gw, completion_body(x_hold=True), session=before, key=None)
        worker.wait_holding(1)
        assert reservation_keys(redis_control.url, prefix, before) == 1

        redis_control.kill()
        r = post(gw, completion_body(), session=new_session("during"), key=None)
        err = assert_openai_error(r, 503, "budget_store_unavailable", "service_unavailable_error")
        assert "unavailable" in err["message"]
        retry_after_s(r)
        assert_openai_error(admin("GET", gw, "/admin/sessions"), 503, "budget_store_unavailable")
        assert httpx.get(gw + "/metrics").status_code == 200
        # The request admitted before the outage still completes (its release is best effort).
        worker.release_all()
        assert held.result().status_code == 200

        redis_control.start()  # comes back empty, as a Redis without persistence does
        after = new_session("after")
        eventually(
            lambda: post(gw, completion_body(), session=after, key=None).status_code == 200,
            "admissions to work again", RECOVERY_TIMEOUT_S,
        )
        back = start(pool, post, gw, completion_body(x_hold=True), session=after, key=None)
        worker.wait_holding(1)
        assert reservation_keys(redis_control.url, prefix, after) == 1  # on Redis again
        assert_holds(gw, after, 1, FOOTPRINT_BYTES, ANON)
        worker.release_all()
        assert back.result().status_code == 200
        assert_released(gw, after, ANON)


def test_redis_killed_mid_run_fail_open_keeps_serving_with_local_budgets_then_recovers(
    backend: str, worker: HeldBackend, pool: ThreadPoolExecutor, redis_control: RedisServer,
    prefix: str,
) -> None:
    settings = redis_settings(backend, redis_control.url, prefix, outage_policy="fail_open")
    with serve_app(create_app(settings), ready_path="/ready") as gw:
        before = new_session("before")
        held = start(pool, post, gw, completion_body(x_hold=True), session=before, key=None)
        worker.wait_holding(1)

        redis_control.kill()
        assert post(gw, completion_body(), session=new_session("during"), key=None
                    ).status_code == 200
        # Budgets still hold, per gateway, from the local store.
        local = new_session("local")
        local_held = [start(pool, post, gw, completion_body(x_hold=True), session=local,
                            key=None) for _ in range(3)]
        worker.wait_holding(4)
        assert_openai_error(post(gw, completion_body(), session=local, key=None), 429,
                            "kv_budget_exceeded")
        view = session_view(gw, local, ANON)  # admin reads fall back to the local store
        assert view is not None and view["inflight_requests"] == 3
        # An operator's write is refused rather than silently lost.
        r = admin("POST", gw, f"/admin/tenants/{ANON}/sessions/{local}/throttle", {"state": "blocked"})
        assert_openai_error(r, 503, "budget_store_unavailable")
        worker.release_all()
        assert [f.result().status_code for f in [held, *local_held]] == [200] * 4
        assert_released(gw, local, ANON)

        redis_control.start()
        after = new_session("after")

        def admitted_on_redis() -> bool:
            fut = start(pool, post, gw, completion_body(x_hold=True), session=after, key=None)
            worker.wait_holding(1)
            on_redis = reservation_keys(redis_control.url, prefix, after) == 1
            worker.release_all()
            assert fut.result().status_code == 200
            worker.wait_holding(0)
            return on_redis

        eventually(admitted_on_redis, "admissions to go back to Redis", RECOVERY_TIMEOUT_S)
        assert_released(gw, after, ANON)
        assert reservation_keys(redis_control.url, prefix, after) == 0


def test_client_disconnect_mid_stream_gives_the_redis_reservation_back(
    replicas: tuple[str, str], worker: HeldBackend, redis_server: str, prefix: str,
) -> None:
    """The release after a disconnect runs in the cancelled (then uncancelled) serving task and
    must still reach Redis, where the other replica sees it."""
    a, b = replicas
    session = new_session("gone")
    aborted = worker.aborted
    with httpx.stream("POST", a + "/v1/completions", headers={"X-Session-ID": session},
                      json=completion_body(stream=True, x_hold=True), timeout=10) as r:
        chunks = r.iter_bytes()  # kept: a dropped iterator closes the response
        assert b"first" in next(chunks)
        worker.wait_holding(1)
        assert_holds(b, session, 1, FOOTPRINT_BYTES, ANON)
    eventually(lambda: worker.aborted == aborted + 1, "the worker to see the abort")
    assert_released(b, session, ANON)
    assert reservation_keys(redis_server, prefix, session) == 0


def test_request_held_past_the_lease_ttl_keeps_its_reservation_by_renewal(
    backend: str, worker: HeldBackend, pool: ThreadPoolExecutor, redis_server: str, prefix: str,
) -> None:
    """A generation longer than lease_ttl_s is renewed every lease_ttl_s / 3, so it is not
    reaped as if its gateway had died and the session cannot start a second one. The lease is
    5 s here: a stall of the test process (the gateway runs in it) longer than a lease would
    let it expire, and CI machines stall for seconds."""
    settings = redis_settings(backend, redis_server, prefix, lease_ttl_s=5.0,
                              defaults={"inflight_kv_bytes": "8MiB"})
    with serve_app(create_app(settings), ready_path="/ready") as gw:
        session = new_session("long")
        held = start(pool, post, gw, completion_body(x_hold=True), session=session, key=None)
        worker.wait_holding(1)
        time.sleep(8.0)  # over one and a half leases: without renewal it was reaped at 5 s
        assert_holds(gw, session, 1, FOOTPRINT_BYTES, ANON)
        assert reservation_keys(redis_server, prefix, session) == 1
        assert_openai_error(post(gw, completion_body(), session=session, key=None), 429,
                            "kv_budget_exceeded")
        worker.release_all()
        assert held.result().status_code == 200
        assert_released(gw, session, ANON)
