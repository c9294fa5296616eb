"""Hot prefixes through the gateway on two simulated workers (``pools[].kv_aware.hot_prefix``).

The pool is set so that growth is decided by demand alone (``wait_fraction: 0``: even an idle
holder counts as busy enough; ``headroom: 0``; a 16-request window): one prefix sent again and
again is, after 8 requests, every request of the pool (2 fair shares of 2 workers, 1 holder), so
the gateway grows a second holder on purpose. What is checked is the plumbing a unit test cannot
see: the setting reaches the policy, the grown holder is recorded in the index (the next
requests find the prefix on both workers, and the simulator delivers it cached there), the reason
``hot_prefix`` reaches ``kvgate_routing_decisions_total`` and ``/admin/routing/explain``, and a
pool without the setting keeps the prefix on one worker.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway import promtext
from gateway.app import create_app
from gateway.config import build_settings
from gateway.sim.config import SimWorkerConfig
from tests.harness import explained, serve_app
from tests.integration.sim_workers import Workers

MODEL = "sim"
TOKEN = "admin-secret"
SYSTEM = "You answer questions about paged attention, block tables and prefix caching. " * 12


@pytest.fixture(scope="module")
def workers() -> Iterator[list[str]]:
    fleet = Workers(SimWorkerConfig(model_name=MODEL, time_scale=0.05,
                                    enable_prompt_tokens_details=True))
    try:
        yield fleet.urls
    finally:
        fleet.close()


def start(workers: list[str], hot: dict[str, Any]) -> Any:
    settings = build_settings({
        "models": [{"name": MODEL, "tokenizer": "simple"}],
        "pools": [{"name": "p", "max_context_tokens": 16384, "policy": "kv_aware",
                   "kv_aware": {"hot_prefix": hot}, "workers": workers}],
        "health": {"interval_s": 0.2, "timeout_s": 30.0, "scrape_interval_s": 0.2},
        "admin": {"token": TOKEN},
    })
    return serve_app(create_app(settings), ready_path="/ready")


def ask(gateway: str, question: int) -> dict[str, Any]:
    r = httpx.post(gateway + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "max_tokens": 2,
        "messages": [{"role": "system", "content": SYSTEM},
                     {"role": "user", "content": f"Question {question}: why?"}]})
    assert r.status_code == 200, r.text
    return explain(gateway, r.headers["x-request-id"])


def explain(gateway: str, request_id: str) -> dict[str, Any]:
    return explained(gateway, request_id, TOKEN)


def reset(workers: list[str]) -> None:
    for w in workers:
        assert httpx.post(w + "/reset_prefix_cache").status_code == 200


def test_a_prefix_asked_for_by_every_request_gets_a_second_holder_on_purpose(
    workers: list[str],
) -> None:
    reset(workers)
    hot = {"enabled": True, "min_prefix_tokens": 64, "window_requests": 16, "headroom": 0.0,
           "wait_fraction": 0.0}
    with start(workers, hot) as gateway:
        answers = [ask(gateway, q) for q in range(16)]
        metrics = httpx.get(gateway + "/metrics").text
    grown = [i for i, a in enumerate(answers) if a["reason"] == "hot_prefix"]
    assert len(grown) == 1, [a["reason"] for a in answers]
    first, new = answers[0]["worker"], answers[grown[0]]["worker"]
    assert new != first
    assert all(a["worker"] == first for a in answers[:grown[0]])
    assert answers[grown[0]]["predicted_cached_tokens"] == 0
    # from then on both hold it: each later request is predicted, and delivered, cached
    later = answers[grown[0] + 1:]
    assert later and all(a["predicted_cached_tokens"] > 0 for a in later)
    assert all(a["delivered_cached_tokens"] >= a["predicted_cached_tokens"] - 16 for a in later)
    assert {a["worker"] for a in later} == {first, new}
    assert promtext.value(metrics, "kvgate_routing_decisions_total", pool="p",
                          policy="kv_aware", reason="hot_prefix") == 1.0


def test_without_hot_prefixes_an_idle_holder_keeps_the_prefix_alone(workers: list[str]) -> None:
    reset(workers)
    with start(workers, {"enabled": False}) as gateway:
        answers = [ask(gateway, 100 + q) for q in range(16)]
    assert Counter(a["worker"] for a in answers).most_common(1)[0][1] == 16
    assert "hot_prefix" not in {a["reason"] for a in answers}
