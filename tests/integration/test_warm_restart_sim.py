"""A gateway that starts in front of workers already holding prompts routes them to their holders
from its first request: its prefix index is rebuilt from each worker's KV event history (the
replay socket, ``gateway.kvindex.events`` "Warm start"), not learned again one miss at a time.

Four simulated workers publishing vLLM's KV events with a replay socket; one gateway serves
distinct prompts (each lands on one worker) and is stopped; a second one, started afresh as a
restarted replica would be, must send every prompt to the worker that holds it, with vLLM's
usage saying the prompt was cached there.
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
from gateway.sim.config import SimWorkerConfig
from tests.harness import serve_app
from tests.integration.sim_workers import Workers, ask, up, wait_for, words

CONFIG = SimWorkerConfig(
    model_name="sim", kv_events=True, kv_events_endpoint="tcp://127.0.0.1:*",
    kv_replay_endpoint="tcp://127.0.0.1:*", time_scale=0.0, enable_prompt_tokens_details=True,
)


@pytest.fixture(scope="module")
def workers() -> Iterator[Workers]:
    w = Workers(configs=[CONFIG] * 4)
    try:
        yield w
    finally:
        w.close()


def settings(workers: Workers) -> Any:
    ws = []
    for url in workers.urls:
        pub, replay = workers.endpoints(url)
        ws.append({"url": url, "kv_events_endpoint": pub, "kv_replay_endpoint": replay})
    return build_settings({
        "models": [{"name": "sim", "tokenizer": "simple"}],
        "pools": [{"name": "p", "max_context_tokens": 4096, "policy": "kv_aware", "workers": ws}],
        "health": {"interval_s": 0.1, "timeout_s": 30.0, "scrape_interval_s": 0.1},
    })


def test_a_restarted_gateway_sends_each_prompt_to_its_holder_from_the_first_request(
    workers: Workers,
) -> None:
    prompts = [words(seed) for seed in range(16)]
    first = create_app(settings(workers))
    with serve_app(first, ready_path="/ready") as gw:
        wait_for(lambda: all(up(gw, w) for w in workers.urls), "every worker up")
        holders = {p: ask(gw, p)[0] for p in prompts}
    assert len(set(holders.values())) >= 2  # spread over the workers: a cold index cannot guess

    started = time.monotonic()
    second = create_app(settings(workers))
    with serve_app(second, ready_path="/ready") as gw:
        wait_for(lambda: all(up(gw, w) for w in workers.urls), "every worker up")
        index = second.api.state.services.prefix_index
        assert index is not None
        busy = set(holders.values())
        # The product's own signal: each worker that holds something has replayed its history.
        wait_for(lambda: {w for w, s in index.subscriber_stats().items() if s.warm_starts} >= busy,
                 "every holder's history replayed")
        warm_s = time.monotonic() - started
        again = {p: ask(gw, p) for p in prompts}
        exported = httpx.get(gw + "/metrics").text
    # And an operator sees it: the subscriber's counts are on /metrics per worker.
    for w in busy:
        assert (promtext.value(exported, "kvgate_kv_events_total", worker=w, what="warm_starts")
                or 0) >= 1, w
        assert (promtext.value(exported, "kvgate_kv_events_total", worker=w, what="warm_batches")
                or 0) >= 1, w
    assert promtext.value(exported, "kvgate_kv_events_total", what="resets") in (None, 0.0)
    print(f"warm {warm_s:.2f} s after the gateway's start")
    for p, (worker, cached) in again.items():
        assert worker == holders[p], "a prompt went to a worker that does not hold it"
        assert cached >= 384, cached  # vLLM (the simulator) says it was cached there
