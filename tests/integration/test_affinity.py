"""Session affinity (``pools[].affinity: session``) through the gateway, on two simulated workers.

A conversation naming a session sticks to one worker while requests without a session are
balanced; it moves when its worker goes down or saturates, and stays where it moved when the old
worker is fine again (its KV cache is now on the new one). Another tenant naming the same session
id is routed as its own session. Each worker is a ``SimFleet`` of one, so one can be stopped and
started again on the same port while the other serves.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from gateway import promtext
from gateway.app import create_app
from gateway.config import build_settings
from gateway.routing.affinity import rendezvous_score
from tests.harness import serve_app
from tests.integration.sim_workers import MODEL, Workers, up, wait_for

pytestmark = pytest.mark.timeout(120)

KEYS = {"acme": "acme-key", "mallory": "mallory-key"}


@pytest.fixture(scope="module")
def workers() -> Iterator[Workers]:
    w = Workers()
    try:
        yield w
    finally:
        w.close()


@pytest.fixture(scope="module")
def gateway(workers: Workers) -> Iterator[str]:
    settings = build_settings({
        "models": [{"name": MODEL, "tokenizer": "simple"}],
        "pools": [{"name": "p", "max_context_tokens": 8192, "policy": "least_loaded",
                   "affinity": "session", "saturation_inflight": 2, "workers": workers.urls}],
        "auth": {"api_keys": [{"name": name, "sha256": hashlib.sha256(key.encode()).hexdigest()}
                              for name, key in KEYS.items()]},
        # A stopped worker refuses connections at once, so one failed check marks it down
        # quickly; the generous timeout keeps a busy machine from marking the other down too
        # (the conversation would then move back: seen once in a full run).
        "health": {"interval_s": 0.1, "timeout_s": 30.0, "unhealthy_threshold": 1,
                   "healthy_threshold": 1, "breaker_open_s": 0.2, "scrape_interval_s": 0.2},
    })
    with serve_app(create_app(settings), ready_path="/ready") as url:
        wait_for(lambda: all(up(url, w) for w in workers.urls), "both workers up")
        yield url


def ask(gateway: str, session: str | None, tenant: str = "acme", *, turn: int = 0,
        max_tokens: int = 2) -> httpx.Response:
    headers = {"authorization": f"Bearer {KEYS[tenant]}"}
    if session is not None:
        headers["x-session-id"] = session
    messages = [{"role": "user", "content": f"turn {i} of a conversation about KV caches"}
                for i in range(turn + 1)]
    r = httpx.post(gateway + "/v1/chat/completions", headers=headers, timeout=60,
                   json={"model": MODEL, "messages": messages, "max_tokens": max_tokens})
    assert r.status_code == 200, r.text
    return r


def worker_of(r: httpx.Response) -> str:
    return r.headers["x-kvgate-worker"]


def quiet(gateway: str) -> bool:
    """Every worker up, with nothing in flight from the gateway and nothing waiting in the
    gateway's last scrape of it. A scrape that caught the previous turn queued in the engine marks
    that worker saturated until the next one (0.2 s): a turn sent then moves the conversation (a
    CI run saw it), as it should, so the tests that mean an idle worker wait for one."""
    state = httpx.get(gateway + "/ui/state").json()
    return all(w["healthy"] and w["inflight"] == 0 and w["waiting"] == 0
               for w in state["workers"])


def ask_quiet(gateway: str, session: str, tenant: str = "acme", *, turn: int = 0) -> httpx.Response:
    wait_for(lambda: quiet(gateway), "every worker idle in the gateway's view")
    return ask(gateway, session, tenant, turn=turn)


def affinity_decisions(gateway: str) -> float:
    text = httpx.get(gateway + "/metrics").text
    return promtext.value(text, "kvgate_routing_decisions_total", reason="affinity") or 0.0


def test_a_conversation_sticks_to_one_worker_while_others_are_balanced(gateway: str) -> None:
    before = affinity_decisions(gateway)
    turns = [ask_quiet(gateway, "conv-stick", turn=i) for i in range(6)]
    assert len({worker_of(r) for r in turns}) == 1
    assert {r.headers["x-kvgate-route-reason"] for r in turns} <= {"affinity", "least_loaded"}
    # least_loaded alone rotates over the idle workers: affinity overrode it along the way
    assert affinity_decisions(gateway) > before
    unnamed = {worker_of(ask(gateway, None)) for _ in range(6)}
    assert len(unnamed) == 2


def test_a_conversation_moves_when_its_worker_goes_down_and_stays_when_it_returns(
    gateway: str, workers: Workers,
) -> None:
    home = worker_of(ask(gateway, "conv-down"))
    workers.stop(home)
    try:
        wait_for(lambda: not up(gateway, home), "the worker marked down")
        moved = worker_of(ask(gateway, "conv-down", turn=1))
        assert moved != home
    finally:
        workers.start(home)
    wait_for(lambda: up(gateway, home), "the worker back up")
    assert {worker_of(ask_quiet(gateway, "conv-down", turn=t)) for t in range(2, 6)} == {moved}


def test_a_conversation_moves_when_its_worker_saturates(gateway: str) -> None:
    home = worker_of(ask(gateway, "conv-busy"))
    with ThreadPoolExecutor(2) as pool:
        # two long answers of the same conversation fill its worker (saturation_inflight: 2);
        # long enough (seconds) that a stalled CI machine still sees both in flight (400 tokens,
        # ~1 s, once finished inside a stall and the wait below never saw two)
        long = [pool.submit(ask, gateway, "conv-busy", turn=1, max_tokens=2000)
                for _ in range(2)]
        wait_for(lambda: inflight(gateway, home) >= 2, "two requests in flight on the worker")
        probe = ask(gateway, "conv-busy", turn=2)
        assert worker_of(probe) != home
        assert probe.headers["x-kvgate-route-reason"] == "least_loaded"
        assert {worker_of(f.result()) for f in long} == {home}
    # the old worker is idle again; the conversation stays where it moved
    assert worker_of(ask_quiet(gateway, "conv-busy", turn=3)) == worker_of(probe)


def inflight(gateway: str, worker: str) -> float:
    text = httpx.get(gateway + "/metrics").text
    return promtext.value(text, "kvgate_worker_inflight", worker=worker) or 0.0


def test_another_tenant_naming_the_same_session_gets_none_of_its_affinity(
    gateway: str, workers: Workers,
) -> None:
    """The session id is scoped by the tenant: ``mallory`` sending ``acme``'s session id lands
    where its own session of that name belongs, not on ``acme``'s worker."""
    def home(tenant: str, session: str) -> str:
        return max(workers.urls, key=lambda w: rendezvous_score((tenant, session), w))

    session = next(s for s in (f"shared-{i}" for i in range(100))
                   if home("acme", s) != home("mallory", s))
    # on idle workers (a saturated holder would rightly lose the session to the policy)
    assert worker_of(ask_quiet(gateway, session, "acme")) == home("acme", session)
    assert worker_of(ask_quiet(gateway, session, "mallory")) == home("mallory", session)
    assert worker_of(ask_quiet(gateway, session, "acme", turn=1)) == home("acme", session)
