"""Features added since the first adversarial suite, tried as a hostile client would (session 13).

The suite before this one (identity, accounting, template, upstream, fairness, KV events) was
written before latency objectives, the tokenizing routes and the Responses API's background mode
were reachable. A client with its own API key tried to get around an identity, budget, limit or
count through each. The ways around found, each with the test here that failed before its fix:

* latency objectives: requests with an objective no worker can meet (``x-slo-ttft-ms: 1``) were
  still tracked as pending on their worker, and a pending request already due past its deadline
  counted as "made to miss" by any request placed behind it. A tenant sending a few of them
  marked every worker harmed, and another tenant's batch requests with an objective were held
  in the gateway, or refused 503 ``slo_unattainable``, for requests that were late anyway
  (``Promises.harmed``); and one such request made the tightest recent objective 1 ms, so batch
  requests kept no worker clear for other tenants' tight requests (``TightDemand``);
* ``/tokenize``: text was encoded whatever its length (the floor check of ``gateway.prompt.limits``
  was not applied), so one 15 MB body took ~20 s of the tokenizing thread and ~9M ids of memory;
  and that thread (``TokenizePool``) was one FIFO shared by every tenant's prompts, so two such
  requests of one tenant held another tenant's 24 KB chat for 31 s. The floor now bounds
  ``/tokenize`` by the largest pool (vLLM's ``max_model_len`` it reports), and the pool serves
  tenants in turn; and (session 14) ``/tokenize`` read every large body as it came, with no
  admission gate before it, so a tenant's connections each held a whole body in memory while
  they waited: a tenant's large bodies are now read two at a time;
* the Responses API: the map of which worker stores each response was one LRU for all tenants,
  so one tenant's cheap stored responses pushed out another's conversations (their next turn a
  404); and a background response gave back its admission slot with its immediate answer, so
  background work escaped ``limits.max_inflight_requests`` and the fair-share meter.

The probes that held (keys on every route, admin routes, Responses ids across tenants, output
limits, aliases and adapters) are covered by the other modules of this suite and
``tests/integration``; what had no test yet (the sibling header) gets one assertion here.
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.app import KvgateApp, create_app
from gateway.budgets import owners as owners_module
from gateway.budgets.owners import FileOwners, ResponseOwner
from gateway.config import Priority, Settings, build_settings
from gateway.procs.vllm import tiny_model_path
from gateway.routing.router import SloHold, SloUnattainable
from gateway.routing.slo import SLO_HELD_REASON, SloTarget
from gateway.routing.types import RoutingRequest
from gateway.sim.config import SimWorkerConfig
from tests.harness import serve_app
from tests.integration.sim_workers import Workers, up, wait_for
from tests.security.test_template import SLOW, WORDS, any_model_worker, model_copy, refused
from tests.unit.test_slo_placement import URLS, mixed_router, routed

pytestmark = pytest.mark.timeout(120)


# -- latency objectives ------------------------------------------------------------------------


def prompt(tokens: int, tenant: str) -> RoutingRequest:
    return RoutingRequest(model="m", prompt_tokens=tokens, max_tokens=32, stream=True,
                          tenant=tenant)


def test_objectives_no_worker_can_meet_do_not_hold_or_refuse_another_tenants_batch() -> None:
    """Regression: mallory's requests asking for a 1 ms first token, one per worker (each placed
    best-effort where it makes no pending request miss: a worker each), made every worker
    "harmed" for as long as they were pending: alice's batch request, which fits any worker with
    room to spare, was held (``SloHold``) and, later in its objective, refused."""
    router, registry, _ = mixed_router()
    doomed = SloTarget(ttft_s=0.001, priority=Priority.INTERACTIVE)
    for _ in URLS:
        r = router.route(prompt(2048, "mallory"), slo=doomed)
        routed(registry, r.worker.url, 2048)
    for elapsed_s in (0.0, 3.5):
        batch = SloTarget(ttft_s=5.0, priority=Priority.BATCH, elapsed_s=elapsed_s)
        try:
            route = router.route(prompt(6144, "alice"), slo=batch)
        except (SloHold, SloUnattainable) as exc:
            pytest.fail(f"alice's batch request was {type(exc).__name__} for mallory's: {exc}")
        assert route.decision.reason != SLO_HELD_REASON


# -- /tokenize and the tokenizing thread -------------------------------------------------------

KEYS = {"alice": "sk-alice-5b1e0c27d9", "mallory": "sk-mallory-94d2a7f3e1"}
MAX_CONTEXT_TOKENS = 100_000
SLOW_JOB_S = 0.5  # limits.tokenize_timeout_s: how long one of mallory's slow renders holds the thread
FLOOD = 8


@pytest.fixture(scope="module")
def tokenizing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, KvgateApp]]:
    """A gateway with two keys serving the tiny model and a copy whose template is slow on a
    long conversation (``test_template``'s), in front of a worker that answers anything."""
    models = [{"name": "tiny", "tokenizer": str(tiny_model_path())},
              {"name": "slow", "tokenizer": model_copy(tmp_path_factory.mktemp("slow"), "slow",
                                                      SLOW)}]
    with serve_app(any_model_worker) as worker:
        settings = build_settings({
            "models": models,
            "pools": [{"name": "p", "max_context_tokens": MAX_CONTEXT_TOKENS,
                       "workers": [worker]}],
            "auth": {"api_keys": [{"name": n, "sha256": hashlib.sha256(k.encode()).hexdigest()}
                                  for n, k in KEYS.items()]},
            "health": {"interval_s": 0.2, "timeout_s": 30.0},
            "limits": {"tokenize_timeout_s": SLOW_JOB_S},
        })
        app = create_app(settings)
        with serve_app(app) as url:
            yield url, app


def post(url: str, path: str, tenant: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120,
                      headers={"Authorization": f"Bearer {KEYS[tenant]}"})


def test_tokenize_refuses_text_certainly_longer_than_every_pool_before_encoding(
    tokenizing: tuple[str, KvgateApp],
) -> None:
    """Regression: ``/tokenize`` encoded any text the body limit let in (15 MB: ~20 s of the one
    tokenizing thread, which cannot be interrupted, and ~9M ids in memory). Text certainly
    longer than the largest pool (the ``max_model_len`` it answers) is now refused unencoded, as
    the chat route's prompts are; a text within it is still counted."""
    url, _ = tokenizing
    text = WORDS * (2_000_000 // len(WORDS))  # 2 MB: > 100K tokens x 13 characters, the floor
    for body in ({"prompt": text}, {"messages": [{"role": "user", "content": text}]}):
        r = post(url, "/tokenize", "mallory", {"model": "tiny", **body})
        assert r.status_code == 400, r.text[:200]  # not the 400K ids
        refused(r, "context_length_exceeded")
    r = post(url, "/tokenize", "mallory", {"model": "tiny", "prompt": WORDS * 400})  # 29 KB
    assert r.status_code == 200 and r.json()["count"] > 4000, r.text


def test_one_tenants_long_prompts_do_not_hold_another_tenants_behind_them_all(
    tokenizing: tuple[str, KvgateApp],
) -> None:
    """Regression: the tokenizing thread served one queue in arrival order, so mallory's queued
    ``/tokenize`` jobs (each rendering a slow template until ``tokenize_timeout_s``) kept
    alice's long chat waiting until every one of them was done. Now tenants take turns: alice's
    prompt waits for at most the job running and one more of mallory's."""
    url, app = tokenizing
    pool = app.api.state.services.dispatcher.tokenize_pool
    # 16-64 KB: off the loop, and read at once (a larger body waits for its tenant's permit)
    slow = {"model": "slow", "messages": [{"role": "user", "content": "hi"}] * 1500}
    done: dict[str, float] = {}
    lock = threading.Lock()

    def send(name: str, tenant: str, path: str, body: dict[str, Any], code: int) -> None:
        r = post(url, path, tenant, body)
        with lock:
            done[name] = time.monotonic()  # the order of answers survives a stalled machine
        assert r.status_code == code, r.text

    with ThreadPoolExecutor(max_workers=FLOOD + 1) as executor:
        flood = [executor.submit(send, f"mallory-{i}", "mallory", "/tokenize", slow, 400)
                 for i in range(FLOOD)]
        deadline = time.monotonic() + 60
        while pool.waiting < FLOOD - 1:  # one job runs, the others wait for the thread
            assert time.monotonic() < deadline, f"{pool.waiting} of mallory's jobs waiting"
            time.sleep(0.01)
        chat = {"model": "tiny", "max_tokens": 4,
                "messages": [{"role": "user", "content": WORDS * 300}]}  # > 16 KB: the thread
        alice = executor.submit(send, "alice", "alice", "/v1/chat/completions", chat, 200)
        for f in [alice, *flood]:
            f.result()
    after_alice = sorted(t for name, t in done.items() if name != "alice" and t > done["alice"])
    assert len(after_alice) >= FLOOD - 2, f"alice answered after {FLOOD - len(after_alice)}" \
        f" of mallory's {FLOOD} jobs"


def test_one_tenants_connections_cannot_each_hold_a_large_tokenize_body_in_memory(
    tokenizing: tuple[str, KvgateApp],
) -> None:
    """Regression: ``/tokenize`` has no admission gate, and read every large body as it came, so
    a tenant's connections each held up to ``limits.max_body_bytes`` in the gateway's memory
    while they waited for the tokenizing thread (or uploaded slowly): memory grew with
    connections, which the chat route's admission-before-reading had ruled out. Now a tenant's
    large bodies are read two at a time (``TokenizePool.reading``); the rest wait in their
    sockets, unread, and another tenant's are not held behind them."""
    url, app = tokenizing
    pool = app.api.state.services.dispatcher.tokenize_pool
    host, port = url.removeprefix("http://").split(":")
    declared = 400_000  # over EARLY_BODY_BYTES: read only with a permit
    head = (f"POST /tokenize HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {KEYS['mallory']}\r\nContent-Length: {declared}\r\n\r\n")
    uploads = [socket.create_connection((host, int(port)), timeout=30) for _ in range(4)]
    try:
        for sock in uploads:  # each sends its head and a first part, then stalls
            sock.sendall(head.encode() + b'{"model": "tiny", "prompt": "' + b"x" * 20_000)
        deadline = time.monotonic() + 60
        while pool.readers("mallory") < 2:
            assert time.monotonic() < deadline, "mallory's first bodies were never read"
            time.sleep(0.01)
        text = WORDS * 1000  # ~70 KB: alice's large body, read with her own permit
        r = post(url, "/tokenize", "alice", {"model": "tiny", "prompt": text})
        assert r.status_code == 200 and r.json()["count"] > 10_000, r.text[:200]
        assert pool.readers("mallory") == 2  # not 4: the other two wait unread
    finally:
        for sock in uploads:
            sock.close()
    deadline = time.monotonic() + 60
    while pool.readers("mallory"):  # the clients left: the reads end, the permits return
        assert time.monotonic() < deadline, "mallory's permits were never given back"
        time.sleep(0.01)


def test_objectives_no_worker_can_meet_do_not_take_away_the_room_kept_for_tight_requests(
) -> None:
    """Regression: the batch requests' room for the tight requests (``TightDemand``) is sized by
    the tightest recent objective. One request of mallory's asking for 1 ms made it 1 ms: no
    worker was then "clear" for it, so none was kept clear, and alice's batch prefill went to a
    fast worker that alice's own 120 ms interactive traffic needed (held before, as it is now)."""
    router, registry, clock = mixed_router()
    for url in URLS[2:]:
        routed(registry, url, 6144)  # the slow workers are busy: only the fast ones fit
    interactive = SloTarget(ttft_s=0.12, priority=Priority.INTERACTIVE)
    for _ in range(16):  # ~27 interactive requests a second: both fast workers needed
        router.route(prompt(1024, "alice"), slo=interactive)
        clock.now += 0.5 / 16
    router.route(prompt(16, "mallory"), slo=SloTarget(ttft_s=0.001))
    clock.now += 0.1  # every first token due: nothing pending
    with pytest.raises(SloHold):
        router.route(prompt(6144, "alice"), slo=SloTarget(ttft_s=1.0, priority=Priority.BATCH))


# -- the Responses API's stored conversations ----------------------------------------------------

OWNERS_MAX = 4  # routing.response_owners_max


def sim_settings(workers: Workers, **extra: Any) -> Settings:
    """A gateway with the two keys in front of simulated ``workers``, one pool."""
    return build_settings({
        "models": [{"name": "sim", "tokenizer": "simple"}],
        "pools": [{"name": "p", "max_context_tokens": 4096, "workers": workers.urls}],
        "auth": {"api_keys": [{"name": n, "sha256": hashlib.sha256(k.encode()).hexdigest()}
                              for n, k in KEYS.items()]},
        "health": {"interval_s": 0.1, "timeout_s": 30.0},
        **extra,
    })


@pytest.fixture(scope="module")
def responses_gateway() -> Iterator[str]:
    workers = Workers()
    try:
        settings = sim_settings(workers, routing={"response_owners_max": OWNERS_MAX},
                                admin={"token": "admin-surface-7c1f"})
        with serve_app(create_app(settings), ready_path="/ready") as url:
            wait_for(lambda: all(up(url, w) for w in workers.urls), "both workers up")
            yield url
    finally:
        workers.close()


def respond(url: str, tenant: str, **body: Any) -> httpx.Response:
    return post(url, "/v1/responses", tenant,
                {"model": "sim", "input": f"a turn of {tenant}'s", "max_output_tokens": 1,
                 **body})


def test_one_tenants_stored_responses_do_not_push_out_anothers(responses_gateway: str) -> None:
    """Regression: the map of which worker stores each response was one LRU for every tenant
    (``routing.response_owners_max`` entries), so mallory's stored responses, one output token
    each, pushed alice's conversation out: her next turn was a 404. Each tenant now has its
    own bound; mallory's flood forgets only mallory's."""
    first = respond(responses_gateway, "alice")
    assert first.status_code == 200, first.text
    flood = [respond(responses_gateway, "mallory") for _ in range(OWNERS_MAX + 1)]
    assert [r.status_code for r in flood] == [200] * len(flood)

    turn = respond(responses_gateway, "alice", previous_response_id=first.json()["id"])

    assert turn.status_code == 200, turn.text
    oldest = respond(responses_gateway, "mallory", previous_response_id=flood[0].json()["id"])
    assert oldest.status_code == 404, oldest.text  # still bounded: mallory's oldest forgotten


def test_the_processes_shared_owner_file_is_bounded_per_tenant(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same with ``--processes N`` (the memory store's shared SQLite file): it was pruned
    to its newest ``max_entries`` rows whoever wrote them."""
    monkeypatch.setattr(owners_module, "PRUNE_EVERY", 2)

    async def run() -> None:
        owners = FileOwners(tmp_path / "owners.sqlite3", max_entries=OWNERS_MAX)
        await owners.start()
        try:
            alice = ResponseOwner("alice", "http://w0", 12)
            await owners.put("resp_alice", alice)
            for i in range(3 * OWNERS_MAX):
                await owners.put(f"resp_m{i}", ResponseOwner("mallory", "http://w1", 1))
            assert await owners.get("alice", "resp_alice") == alice
            kept = [i for i in range(3 * OWNERS_MAX)
                    if await owners.get("mallory", f"resp_m{i}") is not None]
            assert kept == list(range(2 * OWNERS_MAX, 3 * OWNERS_MAX))
        finally:
            await owners.close()

    asyncio.run(run())


def test_the_sibling_header_from_a_client_opens_no_admin_route(responses_gateway: str) -> None:
    """``x-kvgate-sibling`` (a gateway process asking another) only narrows an admin answer to
    the process reached; a client sending it still needs the admin token."""
    for headers, status in (({}, 401), ({"Authorization": f"Bearer {KEYS['mallory']}"}, 403)):
        r = httpx.get(responses_gateway + "/admin/routing/accounting", timeout=30,
                      headers={**headers, "x-kvgate-sibling": "1"})
        assert r.status_code == status, r.text


@pytest.fixture(scope="module")
def background_gateway() -> Iterator[tuple[str, KvgateApp]]:
    workers = Workers(SimWorkerConfig(model_name="sim", time_scale=4.0))  # ~70 tokens a second
    try:
        settings = sim_settings(workers)
        app = create_app(settings)
        with serve_app(app, ready_path="/ready") as url:
            wait_for(lambda: all(up(url, w) for w in workers.urls), "both workers up")
            yield url, app
    finally:
        workers.close()


def test_running_background_responses_keep_their_admission_slots(
    background_gateway: tuple[str, KvgateApp],
) -> None:
    """Regression: a background response gave its admission slot back with its answer (at once,
    ``queued``) while it went on generating: any number of them ran past
    ``limits.max_inflight_requests``, and the tenant's fair-share meter (KV byte-seconds held)
    stopped at the answer, so a tenant whose work was all background stood first in the fair
    queue. The slot is now held, like the reservation and the worker hold, to the final status."""
    url, app = background_gateway
    services = app.api.state.services
    gate, watchers = services.dispatcher.gate, services.background
    running = [respond(url, "mallory", background=True, max_output_tokens=900, ignore_eos=True)
               for _ in range(2)]
    assert [r.json()["status"] for r in running] == ["queued"] * 2, [r.text for r in running]
    wait_for(lambda: len(watchers) == 2, "both watched", 60)  # their answers are done with

    assert gate.inflight == 2

    for r in running:
        cancel = httpx.post(f"{url}/v1/responses/{r.json()['id']}/cancel", timeout=30,
                            headers={"Authorization": f"Bearer {KEYS['mallory']}"})
        assert cancel.json()["status"] == "cancelled", cancel.text
    wait_for(lambda: gate.inflight == 0, "the slots given back", 60)
