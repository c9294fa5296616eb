"""Hit accounting through the gateway on two simulated workers that report cached tokens.

A workload where each outcome the simulator can produce occurs: a first prompt (never seen),
its repeat (delivered as predicted), a repeat whose holder is busy with a long stream (load: the
pool's ``active_request_tokens`` is set so that one open request outweighs any prefix), and a
repeat after the holder's prefix cache was reset behind the index's back (no KV events: stale
index). A third worker, of its own model, runs with prefix caching off: the index (routing
history: no KV events) predicts hits it never delivers, and after a window of such answers the
model is flagged as mismatched (gauge, log line) and its shortfalls count as ``mismatch``.
Every answer carries ``x-request-id``; ``GET /admin/routing/explain`` explains it, and
``kvgate_prefix_tokens_total`` sums to the prompt tokens of the requests accounted.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway import promtext
from gateway.app import create_app
from gateway.config import build_settings
from gateway.routing.accounting import LOSSES, OUTCOMES
from gateway.sim.config import SimWorkerConfig
from tests.harness import explained, serve_app
from tests.integration.sim_workers import Workers

MODEL = "sim"
NO_CACHE = "sim-nocache"
TOKEN = "admin-secret"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
ACCOUNTED: list[str] = []  # every request id this module sent through the gateway


@pytest.fixture(scope="module")
def workers() -> Iterator[list[str]]:
    config = SimWorkerConfig(model_name=MODEL, time_scale=0.25, enable_prompt_tokens_details=True)
    no_cache = SimWorkerConfig(model_name=NO_CACHE, time_scale=0.05, enable_prefix_caching=False,
                               enable_prompt_tokens_details=True)
    fleet = Workers(configs=[config, config, no_cache])
    try:
        yield fleet.urls
    finally:
        fleet.close()


@pytest.fixture(scope="module")
def gateway(workers: list[str]) -> Iterator[str]:
    settings = build_settings({
        "models": [{"name": MODEL, "tokenizer": "simple"},
                   {"name": NO_CACHE, "tokenizer": "simple"}],
        "pools": [{"name": "p", "max_context_tokens": 16384, "policy": "kv_aware",
                   "kv_aware": {"active_request_tokens": 100000}, "workers": workers}],
        "health": {"interval_s": 0.2, "timeout_s": 30.0, "scrape_interval_s": 0.2},
        "admin": {"token": TOKEN},
        "routing": {"explain_requests": 64},
    })
    app = create_app(settings)
    with serve_app(app, ready_path="/ready") as url:
        # Each worker's models are read right after its first passing check: until then it
        # would be offered every model.
        deadline = time.monotonic() + 60
        seen = list(app.api.state.services.workers)
        assert len(seen) == len(workers)
        while not all(w.models_read for w in seen):
            assert time.monotonic() < deadline, "the workers' models were never read"
            time.sleep(0.05)
        yield url


def prompt(topic: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Explain {topic} with paged attention and block tables. "
             * 20}]


def chat(gateway: str, topic: str, model: str = MODEL, **extra: Any) -> httpx.Response:
    r = httpx.post(gateway + "/v1/chat/completions", timeout=30,
                   json={"model": model, "messages": prompt(topic), "max_tokens": 2, **extra})
    assert r.status_code == 200, r.text
    ACCOUNTED.append(r.headers["x-request-id"])
    return r


def idle(gateway: str, workers: list[str]) -> None:
    """Wait until the gateway sees nothing on ``workers``: no request of its own open there, and
    nothing running or waiting in its last scrape of them. The client has its answer a moment
    before the gateway lets go of the request, and a scrape (every 0.2 s) that caught the
    request still running counts it until the next one; CI's stalls stretch both moments. One
    request on a worker, open or scraped, outweighs any prefix there (``active_request_tokens``):
    a repeat sent in such a moment is routed elsewhere (seen in CI, twice, and under
    ``scripts/stall_run.py``)."""
    deadline = time.monotonic() + 60
    while any(w["url"] in workers and (w["inflight"] or w["running"] or w["waiting"])
              for w in httpx.get(gateway + "/ui/state").json()["workers"]):
        assert time.monotonic() < deadline, "the gateway kept seeing a request on a worker"
        time.sleep(0.05)


def explain(gateway: str, request_id: str) -> dict[str, Any]:
    """The explanation once the request has ended, its loss buckets checked."""
    data = explained(gateway, request_id, TOKEN)
    check_sums(data)
    return data


def check_sums(e: dict[str, Any]) -> None:
    outcomes = e["outcomes"]
    assert tuple(outcomes) == OUTCOMES
    assert sum(outcomes.values()) == e["prompt_tokens"]
    delivered = e["delivered_cached_tokens"]  # None: the answer had no cached_tokens
    assert (outcomes["unknown"] == 0) == (delivered is not None)
    assert sum(outcomes[k] for k in LOSSES) + outcomes["unknown"] == (
        e["ceiling_tokens"] - (delivered or 0))


def test_a_first_prompt_is_never_seen_and_its_repeat_is_delivered_as_predicted(
    gateway: str, workers: list[str],
) -> None:
    first = explain(gateway, chat(gateway, "prefix caching").headers["x-request-id"])
    assert first["fleet_best_tokens"] == first["predicted_cached_tokens"] == 0
    assert first["delivered_cached_tokens"] == 0
    assert first["outcomes"]["never_seen"] == first["prompt_tokens"]

    idle(gateway, workers)
    again = chat(gateway, "prefix caching")
    e = explain(gateway, again.headers["x-request-id"])
    assert e["worker"] == first["worker"] == again.headers["x-kvgate-worker"]
    assert e["reason"] == "prefix_hit"
    assert e["predicted_cached_tokens"] == e["delivered_cached_tokens"] > 0
    assert e["delivered_cached_tokens"] == again.json()["usage"]["prompt_tokens_details"][
        "cached_tokens"]
    assert e["outcomes"]["delivered"] == e["fleet_best_tokens"]
    assert e["lost_tokens"] == 0
    assert e["outcomes"]["never_seen"] == e["prompt_tokens"] - e["delivered_cached_tokens"]
    chosen = [c for c in e["candidates"] if c["chosen"]]
    assert [c["worker"] for c in chosen] == [e["worker"]]
    assert chosen[0]["cached_tokens"] == e["predicted_cached_tokens"]
    assert set(chosen[0]["cost"]) >= {"cost", "kv_cost", "cached", "over_hard_limit"}
    others = [c for c in e["candidates"] if not c["chosen"]]
    assert others and all(c["cost"]["cost"] > chosen[0]["cost"]["cost"] for c in others)


def test_a_repeat_whose_holder_is_busy_is_lost_to_load(gateway: str, workers: list[str]) -> None:
    holder = chat(gateway, "chunked prefill").headers["x-kvgate-worker"]
    idle(gateway, workers)  # the stream, a repeat, then goes to the holder
    with httpx.stream("POST", gateway + "/v1/chat/completions", timeout=30, json={
            "model": MODEL, "messages": prompt("chunked prefill"), "max_tokens": 8000,
            "stream": True}) as stream:
        assert stream.headers["x-kvgate-worker"] == holder
        ACCOUNTED.append(stream.headers["x-request-id"])
        chunks = stream.iter_raw()  # kept: a dropped iterator closes the stream
        next(chunks)  # in flight on the holder from here on
        idle(gateway, [w for w in workers if w != holder])  # the stream is all the load there is
        r = chat(gateway, "chunked prefill")
    e = explain(gateway, r.headers["x-request-id"])
    assert e["worker"] != holder, e
    assert e["reason"] == "load_balance"
    assert e["predicted_cached_tokens"] == e["delivered_cached_tokens"] == 0
    assert e["fleet_best_tokens"] > 0
    assert e["outcomes"]["load"] == e["fleet_best_tokens"] == e["lost_tokens"]
    busy = next(c for c in e["candidates"] if c["worker"] == holder)
    assert busy["cached_tokens"] == e["fleet_best_tokens"]
    assert busy["load"]["inflight"] >= 1
    # The stream the client left has no usage: what it was predicted is of unknown outcome.
    left = explain(gateway, stream.headers["x-request-id"])
    assert left["delivered_cached_tokens"] is None
    assert left["outcomes"]["unknown"] == left["predicted_cached_tokens"] > 0


def test_a_prefix_cache_reset_the_index_never_heard_of_is_a_stale_index(
    gateway: str, workers: list[str],
) -> None:
    holder = chat(gateway, "block eviction").headers["x-kvgate-worker"]
    deadline = time.monotonic() + 60
    while httpx.post(holder + "/reset_prefix_cache").status_code != 200:
        assert time.monotonic() < deadline, "the worker kept blocks in use"
        time.sleep(0.1)  # the stream of the test before may still be winding down
    idle(gateway, workers)  # ... and until the gateway has let go of it too
    r = chat(gateway, "block eviction")
    e = explain(gateway, r.headers["x-request-id"])
    assert e["worker"] == holder and e["reason"] == "prefix_hit"
    assert e["predicted_cached_tokens"] > 0 and e["delivered_cached_tokens"] == 0
    assert e["outcomes"]["stale_index"] == e["predicted_cached_tokens"] == e["lost_tokens"]
    assert not e["model_mismatch"]  # one stale answer does not flag the model


def test_a_stream_without_include_usage_is_accounted_from_the_usage_the_gateway_asked_for(
    gateway: str, workers: list[str],
) -> None:
    chat(gateway, "streams")
    idle(gateway, workers)
    with httpx.stream("POST", gateway + "/v1/chat/completions", timeout=30, json={
            "model": MODEL, "messages": prompt("streams"), "max_tokens": 2,
            "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    ACCOUNTED.append(r.headers["x-request-id"])
    assert not any("usage" in line for line in lines)
    e = explain(gateway, r.headers["x-request-id"])
    assert e["delivered_cached_tokens"] == e["predicted_cached_tokens"] > 0
    assert e["outcomes"]["unknown"] == 0


def test_prefix_token_metrics_sum_to_the_prompt_tokens_of_every_request_accounted(
    gateway: str,
) -> None:
    if not ACCOUNTED:
        chat(gateway, "metrics")
    prompts = sum(explain(gateway, rid)["prompt_tokens"] for rid in ACCOUNTED)
    text = httpx.get(gateway + "/metrics").text
    by_outcome = {o: promtext.value(text, "kvgate_prefix_tokens_total", pool="p", outcome=o) or 0
                  for o in OUTCOMES}
    assert sum(by_outcome.values()) == prompts
    assert promtext.value(text, "kvgate_prefix_cache_mismatch", model=MODEL) == 0
    totals = httpx.get(gateway + "/admin/routing/accounting", headers=ADMIN).json()
    (pool,) = totals["data"]
    assert pool["pool"] == "p" and pool["prompt_tokens"] == prompts
    assert pool["outcomes"] == {o: int(v) for o, v in by_outcome.items()}
    assert MODEL not in totals["mismatched_models"]


def test_a_model_whose_predictions_are_never_delivered_is_flagged_as_mismatched(
    gateway: str, workers: list[str], caplog: pytest.LogCaptureFixture,
) -> None:
    """The silent 0% hit rate: the gateway predicts hits (the repeats go to the worker that had
    the prompt) that the server never delivers (here: prefix caching off)."""
    text = httpx.get(gateway + "/metrics").text
    assert promtext.value(text, "kvgate_prefix_cache_mismatch", model=NO_CACHE) == 0
    with caplog.at_level("WARNING", "gateway.routing.accounting"):
        explained = [explain(gateway, chat(gateway, "silence", NO_CACHE).headers["x-request-id"])
                     for _ in range(20)]
    assert {e["worker"] for e in explained} == {workers[2]}
    assert all(e["delivered_cached_tokens"] == 0 for e in explained)
    repeats = explained[1:]
    assert all(e["predicted_cached_tokens"] > 0 for e in repeats)
    # the first window of answers is counted stale; once flagged, the shortfall is mismatch
    assert repeats[0]["outcomes"]["stale_index"] == repeats[0]["predicted_cached_tokens"]
    assert not repeats[0]["model_mismatch"]
    last = repeats[-1]
    assert last["model_mismatch"]
    assert last["outcomes"]["mismatch"] == last["predicted_cached_tokens"] == last["lost_tokens"]
    assert last["outcomes"]["stale_index"] == 0
    assert f"prefix cache mismatch for model {NO_CACHE}" in caplog.text
    text = httpx.get(gateway + "/metrics").text
    assert promtext.value(text, "kvgate_prefix_cache_mismatch", model=NO_CACHE) == 1
    assert promtext.value(text, "kvgate_prefix_cache_mismatch", model=MODEL) == 0
    assert (promtext.value(text, "kvgate_prefix_tokens_total", pool="p", outcome="mismatch")
            or 0) >= last["predicted_cached_tokens"]
    totals = httpx.get(gateway + "/admin/routing/accounting", headers=ADMIN).json()
    assert totals["mismatched_models"] == [NO_CACHE]


def test_explain_refuses_unknown_missing_and_unauthenticated_asks_in_openai_shape(
    gateway: str,
) -> None:
    r = httpx.get(gateway + "/admin/routing/explain", params={"request_id": "kvg-nope-1"},
                  headers=ADMIN)
    assert r.status_code == 404
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["code"], err["param"]) == ("request_not_found", "request_id")
    huge = httpx.get(gateway + "/admin/routing/explain", params={"request_id": "x" * 100_00},
                     headers=ADMIN)
    assert huge.status_code == 404 and len(huge.text) < 1000  # not echoed whole
    missing = httpx.get(gateway + "/admin/routing/explain", headers=ADMIN)
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "request_id"
    rid = chat(gateway, "auth").headers["x-request-id"]
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.get(gateway + "/admin/routing/explain", params={"request_id": rid},
                      headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] in (
            "missing_admin_token", "invalid_admin_token")


def test_request_ids_are_unique_per_answer(gateway: str) -> None:
    ids = {chat(gateway, "ids").headers["x-request-id"] for _ in range(5)}
    assert len(ids) == 5
