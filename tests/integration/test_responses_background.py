"""Background Responses (``background: true``) through the gateway, on two simulated workers.

vLLM answers a background request at once (``queued``) and generates afterwards; the gateway
keeps the request's budget reservation and a hold on its worker until the response reaches a
final status (``gateway.upstream.background``). These tests read the session's accounting
through the admin API while responses run, and show that no way of sending background requests
(many at once, several session ids, a stream left early, a deadline, a restarted owner, a
gateway shutdown) lets a session hold more than its limits or leaves a task behind. The proof
against real vLLM is in ``test_responses_vllm.py``.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from gateway import promtext
from gateway.app import create_app
from gateway.config import Settings, build_settings
from gateway.sim.config import SimWorkerConfig
from tests.harness import serve_app
from tests.integration.sim_workers import Workers, up, wait_for

pytestmark = pytest.mark.timeout(120)

MODEL = "sim"
KEYS = {"acme": "acme-key", "mallory": "mallory-key"}
ADMIN = "admin-token"
SESSION_REQUESTS = 2
TENANT_REQUESTS = 3
LONG = 900  # output tokens: ~13 s on these slow workers, so it is still running when looked at
SHORT = 20  # ~0.3 s


@pytest.fixture(scope="module")
def workers() -> Iterator[Workers]:
    w = Workers(SimWorkerConfig(model_name=MODEL, time_scale=4.0))
    try:
        yield w
    finally:
        w.close()


def settings_for(workers: Workers, **pool: Any) -> Settings:
    return build_settings({
        "models": [{"name": MODEL, "tokenizer": "simple"}],
        "pools": [{"name": "p", "max_context_tokens": 1024, "policy": "round_robin",
                   "workers": workers.urls, **pool}],
        "auth": {"api_keys": [{"name": name, "sha256": hashlib.sha256(key.encode()).hexdigest()}
                              for name, key in KEYS.items()]},
        "admin": {"token": ADMIN},
        "budgets": {"defaults": {"inflight_requests": SESSION_REQUESTS,
                                 "tenant": {"inflight_requests": TENANT_REQUESTS}}},
        "health": {"interval_s": 0.1, "timeout_s": 30.0, "unhealthy_threshold": 1,
                   "healthy_threshold": 1, "breaker_open_s": 0.2, "scrape_interval_s": 0.2},
    })


@pytest.fixture(scope="module")
def gateway(workers: Workers) -> Iterator[str]:
    with serve_app(create_app(settings_for(workers)), ready_path="/ready") as url:
        wait_for(lambda: all(up(url, w) for w in workers.urls), "both workers up")
        yield url


def create(base: str, session: str, tokens: int = LONG, tenant: str = "acme",
           **body: Any) -> httpx.Response:
    return httpx.post(base + "/v1/responses", timeout=30, json={
        "model": MODEL, "input": f"background work for {session}", "max_output_tokens": tokens,
        "ignore_eos": True, "background": True, **body},
        headers={"authorization": f"Bearer {KEYS[tenant]}", "x-session-id": session})


def retrieve(base: str, rid: str, tenant: str = "acme", cancel: bool = False) -> httpx.Response:
    headers = {"authorization": f"Bearer {KEYS[tenant]}"}
    if cancel:
        return httpx.post(f"{base}/v1/responses/{rid}/cancel", headers=headers, timeout=30)
    return httpx.get(f"{base}/v1/responses/{rid}", headers=headers, timeout=30)


def held(base: str, session: str, tenant: str = "acme") -> int:
    """Requests the session holds in flight, as the budget store counts them."""
    r = httpx.get(f"{base}/admin/tenants/{tenant}/sessions/{session}", timeout=10,
                  headers={"authorization": f"Bearer {ADMIN}"})
    if r.status_code == 404:
        return 0  # holds nothing
    assert r.status_code == 200, r.text
    return int(r.json()["inflight_requests"])


def worker_inflight(base: str, worker: str) -> float:
    value = promtext.value(httpx.get(base + "/metrics", timeout=10).text,
                           "kvgate_worker_inflight", worker=worker)
    return value or 0.0


def until_final(base: str, rid: str) -> dict[str, Any]:
    final: dict[str, Any] = {}

    def done() -> bool:
        final.update(retrieve(base, rid).json())
        return final["status"] not in ("queued", "in_progress")
    wait_for(done, f"{rid} to finish", 60)
    return final


def test_a_background_response_is_answered_at_once_and_held_until_it_completes(
    gateway: str,
) -> None:
    r = create(gateway, "one", tokens=120)
    assert r.status_code == 200, r.text
    answer, owner = r.json(), r.headers["x-kvgate-worker"]
    assert answer["status"] == "queued" and answer["background"] is True
    assert answer["output"] == [] and answer["usage"] is None
    # the answer is out; the generation runs on, still counted for the session and the worker
    assert held(gateway, "one") == 1
    assert worker_inflight(gateway, owner) >= 1
    final = until_final(gateway, answer["id"])  # retrieved through the gateway, from the owner
    assert final["status"] == "incomplete" and final["usage"]["output_tokens"] == 120
    # the retrieve that saw the final status ended the hold before it answered
    assert held(gateway, "one") == 0
    wait_for(lambda: worker_inflight(gateway, owner) == 0, "the worker hold released", 60)


def test_running_background_responses_count_against_the_session_and_tenant_limits(
    gateway: str,
) -> None:
    """The (N+1)th of a session is refused while N run, foreground or background; other session
    ids buy only up to the tenant's limit; a cancel through the gateway frees its place before
    the cancel's answer returns."""
    running = [create(gateway, "many") for _ in range(SESSION_REQUESTS)]
    assert all(r.status_code == 200 for r in running), [r.text for r in running]
    assert held(gateway, "many") == SESSION_REQUESTS
    for extra in (create(gateway, "many"), create(gateway, "many", background=False, tokens=2)):
        assert extra.status_code == 429, extra.text
        assert extra.json()["error"]["code"] == "rate_limit_exceeded"
    rotated = create(gateway, "many-2")  # a new session id: the tenant's third
    assert rotated.status_code == 200, rotated.text
    r = create(gateway, "many-3")
    assert r.status_code == 429 and "tenant" in r.json()["error"]["message"].lower(), r.text
    assert create(gateway, "many", tenant="mallory", tokens=SHORT).status_code == 200
    cancelled = retrieve(gateway, running[0].json()["id"], cancel=True)
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert held(gateway, "many") == SESSION_REQUESTS - 1  # no wait: released before answering
    again = create(gateway, "many", tokens=SHORT)
    assert again.status_code == 200, again.text
    for rid in (running[1].json()["id"], rotated.json()["id"]):
        assert retrieve(gateway, rid, cancel=True).json()["status"] == "cancelled"
    until_final(gateway, again.json()["id"])
    assert held(gateway, "many") == 0 and held(gateway, "many-2") == 0


def test_a_background_stream_whose_client_leaves_is_held_until_the_response_ends(
    gateway: str,
) -> None:
    body = {"model": MODEL, "input": "stream and leave", "max_output_tokens": LONG,
            "ignore_eos": True, "background": True, "stream": True}
    headers = {"authorization": f"Bearer {KEYS['acme']}", "x-session-id": "leaver"}
    with httpx.stream("POST", gateway + "/v1/responses", json=body, headers=headers,
                      timeout=30) as r:
        assert r.status_code == 200
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
    rid = orjson.loads(first[6:])["response"]["id"]
    time.sleep(0.3)  # the gateway has noticed the client leave
    assert held(gateway, "leaver") == 1  # vLLM generates on (for ~13 s): so does the hold
    final = until_final(gateway, rid)
    assert final["status"] == "incomplete" and final["usage"]["output_tokens"] == LONG
    assert held(gateway, "leaver") == 0


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"store": False}, "background", "background can only be used when `store` is true"),
    ({"store": None}, "background", "background can only be used when `store` is true"),
    ({"store": "yes"}, "store", "`store` must be a boolean"),
    ({"background": "true"}, "background", "`background` must be a boolean"),
    ({"background": 1}, "background", "`background` must be a boolean"),
])
def test_background_is_refused_where_vllm_refuses_it_or_could_read_it_otherwise(
    gateway: str, body: dict[str, Any], param: str, message: str,
) -> None:
    r = create(gateway, "refused", tokens=SHORT, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"] == message
    assert held(gateway, "refused") == 0


def test_a_client_named_request_id_is_still_refused_with_background(gateway: str) -> None:
    r = create(gateway, "named", tokens=SHORT, request_id="resp_mine")
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_id", r.text


def test_past_its_deadline_a_background_response_is_cancelled_on_its_owner_and_released(
    workers: Workers,
) -> None:
    """The pool's ``timeouts.read_s`` bounds a background response as it bounds a whole answer."""
    # A deadline long enough that a stalled machine still finds the response held first.
    settings = settings_for(workers, timeouts={"read_s": 5.0})
    with serve_app(create_app(settings), ready_path="/ready") as url:
        wait_for(lambda: all(up(url, w) for w in workers.urls), "both workers up")
        r = create(url, "slow")
        assert r.status_code == 200, r.text
        assert held(url, "slow") == 1
        wait_for(lambda: held(url, "slow") == 0, "the deadline to release it", 60)
        owner = r.headers["x-kvgate-worker"]
        stored = httpx.get(f"{owner}/v1/responses/{r.json()['id']}", timeout=10).json()
        assert stored["status"] == "cancelled"  # it generates no more either


def test_a_background_response_its_restarted_owner_forgot_is_released(
    gateway: str, workers: Workers,
) -> None:
    r = create(gateway, "forgotten")
    owner = r.headers["x-kvgate-worker"]
    workers.stop(owner)
    try:
        wait_for(lambda: not up(gateway, owner), "the owner marked down")
        assert held(gateway, "forgotten") == 1  # down is not gone: it may come back
    finally:
        workers.start(owner)
    wait_for(lambda: held(gateway, "forgotten") == 0, "its 404 to release the hold", 60)
    wait_for(lambda: up(gateway, owner), "the owner back")


def test_a_gateway_shutdown_stops_every_watcher_and_leaves_the_reservation_to_its_lease(
    workers: Workers,
) -> None:
    app = create_app(settings_for(workers))
    with serve_app(app, ready_path="/ready") as url:
        wait_for(lambda: all(up(url, w) for w in workers.urls), "both workers up")
        r = create(url, "shutdown")
        assert r.status_code == 200, r.text
        services = app.api.state.services
        assert len(services.background) == 1
    assert len(services.background) == 0  # no watcher task outlives the app
    assert all(w.inflight == 0 for w in services.workers)  # the worker hold given back
    assert services.budgets.stats().inflight_local == 1  # the reservation: left to its lease
    owner = r.headers["x-kvgate-worker"]
    httpx.post(f"{owner}/v1/responses/{r.json()['id']}/cancel", timeout=10)
