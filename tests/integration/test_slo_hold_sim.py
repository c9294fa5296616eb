"""A batch request held in the gateway rather than delay an interactive request past its latency
objective (``gateway.routing.slo``, step 5), through the gateway, on one simulated worker.

The worker prefills 5 ms per token (a ~400-token prompt: ~2 s), and the pool's latency prior is
set to exactly that, so predictions need no calibration. An interactive request with a 3.5 s
TTFT objective is routed there (~2.3 s predicted); a batch request sent while it waits would
add its own ~2 s of prefill (vLLM runs a waiting request's prefill in one step with the others
admitted) and make it miss: the batch is held until the interactive one's first token is due,
then routed (reason ``slo_held``) and served. The margins are seconds, for a host that stalls.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import pytest

from gateway import promtext
from gateway.app import create_app
from gateway.config import build_settings
from gateway.sim.config import SimWorkerConfig
from gateway.sim.costmodel import LinearCostModel
from gateway.sim.fleet import SimFleet
from tests.harness import serve_app
from tests.integration.sim_workers import up, wait_for

pytestmark = pytest.mark.timeout(180)

MODEL = "sim"
SLOW = LinearCostModel(prefill_s_per_token=5e-3, decode_base_s=0.002)


class OneWorker:
    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._fleet = SimFleet([SimWorkerConfig(model_name=MODEL)], cost_models=[SLOW])
        (self.url,) = asyncio.run_coroutine_threadsafe(self._fleet.start(), self._loop).result(30)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._fleet.stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


@pytest.fixture(scope="module")
def gateway() -> Iterator[tuple[str, str]]:
    worker = OneWorker()
    try:
        settings = build_settings({
            "models": [{"name": MODEL, "tokenizer": "simple"}],
            "pools": [{"name": "p", "max_context_tokens": 8192, "policy": "kv_aware",
                       "workers": [worker.url],
                       "slo": {"ttft_base_ms": 5, "ttft_ms_per_cost_unit": 5.0}}],
            "health": {"interval_s": 0.2, "timeout_s": 30.0, "scrape_interval_s": 0.2},
        })
        with serve_app(create_app(settings), ready_path="/ready") as url:
            wait_for(lambda: up(url, worker.url), "the worker up")
            yield url, worker.url
    finally:
        worker.close()


_rng = random.Random(11)


def stream(gateway: str, headers: dict[str, str]) -> tuple[int, httpx.Headers]:
    words = " ".join(f"w{_rng.randrange(10**6)}" for _ in range(200))
    body = {"model": MODEL, "messages": [{"role": "user", "content": words}],
            "max_tokens": 2, "stream": True}
    with httpx.stream("POST", gateway + "/v1/chat/completions", json=body, headers=headers,
                      timeout=60) as r:
        r.read()
        return r.status_code, r.headers


def metric(gateway: str, name: str, **labels: str) -> float:
    return promtext.value(httpx.get(gateway + "/metrics").text, name, **labels) or 0.0


def test_batch_request_is_held_until_the_interactive_one_ahead_has_its_first_token(
    gateway: tuple[str, str],
) -> None:
    url, worker = gateway
    with ThreadPoolExecutor(2) as pool:
        interactive: Future[tuple[int, httpx.Headers]] = pool.submit(
            stream, url, {"x-slo-ttft-ms": "3500"})
        wait_for(lambda: metric(url, "kvgate_worker_inflight", pool="p", worker=worker) >= 1,
                 "the interactive request routed")
        batch = pool.submit(stream, url, {"x-slo-ttft-ms": "30000", "x-priority": "batch"})
        status, headers = batch.result(timeout=120)
        first_status, first_headers = interactive.result(timeout=120)
    assert (first_status, first_headers["x-kvgate-route-reason"]) == (200, "least_loaded")
    assert (status, headers["x-kvgate-route-reason"]) == (200, "slo_held")
    assert metric(url, "kvgate_routing_decisions_total", pool="p", policy="kv_aware",
                  reason="slo_held") == 1.0


def test_batch_request_with_nobody_ahead_is_not_held(gateway: tuple[str, str]) -> None:
    url, _ = gateway
    status, headers = stream(url, {"x-slo-ttft-ms": "30000", "x-priority": "batch"})
    assert (status, headers["x-kvgate-route-reason"]) == (200, "least_loaded")
