"""Two gateway processes' worth of Services sharing one runtime_dir (``--processes 2``): health
checks and scrapes happen once (the leader's) and both see them; per-worker load is summed.

Most tests run both Services in this test's event loop, against one real HTTP worker that counts
what it is asked; the shared state goes through the same files two processes share (the load
table's cross-process behaviour is proven with forked processes in tests/unit/test_load_table.py).
The last one runs ``kvgate serve --processes 2`` as real processes.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import pytest_asyncio
from starlette.types import Receive, Scope, Send

from gateway.config import build_settings
from gateway.processes import ProcessRole
from gateway.procs.kvgate import GatewayProcess
from gateway.procs.process import ProcessSet
from gateway.routing.router import candidate
from gateway.routing.types import RoutingRequest
from gateway.services import Services
from gateway.upstream.hold import WorkerHold
from gateway.workers.health_board import HealthBoard
from gateway.workers.worker import Worker
from tests.harness import eventually, serve_app

pytestmark = pytest.mark.timeout(60)

VLLM_METRICS = b"""\
vllm:num_requests_running{engine="0",model_name="noop"} 3.0
vllm:num_requests_waiting{engine="0",model_name="noop"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="noop"} 0.25
vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="1000"} 1.0
"""


class CountingWorker:
    """Answers /health, /metrics and /v1/models, and counts each."""

    def __init__(self) -> None:
        self.hits: Counter[str] = Counter()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        self.hits[path] += 1
        body = {"/health": b"", "/metrics": VLLM_METRICS,
                "/v1/models": orjson.dumps({"data": [{"id": "noop"}]})}.get(path)
        await send({"type": "http.response.start", "status": 404 if body is None else 200,
                    "headers": []})
        await send({"type": "http.response.body", "body": body or b""})


@pytest.fixture(scope="module")
def worker() -> Iterator[tuple[str, CountingWorker]]:
    app = CountingWorker()
    with serve_app(app) as url:
        yield url, app


@pytest.fixture
def runtime_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="kvg") as d:
        yield Path(d)


def settings(worker_url: str) -> Any:
    return build_settings({
        "models": [{"name": "noop", "tokenizer": "simple"}],
        "pools": [{"name": "p", "max_context_tokens": 4096, "workers": [worker_url]}],
        "health": {"interval_s": 0.1, "timeout_s": 30.0, "scrape_interval_s": 0.1},
    })


@pytest_asyncio.fixture(loop_scope="function")
async def gateway(
    worker: tuple[str, CountingWorker], runtime_dir: Path
) -> AsyncIterator[tuple[Services, Services]]:
    url, app = worker
    app.hits.clear()
    leader = await Services.start(settings(url), ProcessRole(0, 2, runtime_dir))
    follower = await Services.start(settings(url), ProcessRole(1, 2, runtime_dir))
    try:
        yield leader, follower
    finally:
        await follower.close()
        await leader.close()



def the_worker_in_each(url: str, gateway: tuple[Services, Services]) -> tuple[Worker, Worker]:
    """The worker as (the follower, the leader) see it."""
    leader, follower = gateway
    mine, theirs = follower.workers.get(url), leader.workers.get(url)
    assert mine is not None and theirs is not None
    return mine, theirs


async def test_only_the_leader_checks_and_scrapes_and_the_follower_sees_its_results(
    worker: tuple[str, CountingWorker], gateway: tuple[Services, Services], runtime_dir: Path
) -> None:
    url, app = worker
    leader, follower = gateway
    seen = follower.workers.get(url)
    assert seen is not None
    await eventually(lambda: seen.healthy and seen.stats.running == 3)
    assert (seen.models, seen.stats.block_size_tokens, seen.stats.kv_usage_ratio) == (
        frozenset({"noop"}), 32, 0.25)
    def leaders_checks() -> int:
        board = HealthBoard(runtime_dir / "health.json", leader=False).read_if_changed()
        report = board.workers.get(url) if board is not None else None
        return report.checks if report is not None else 0

    # A few more intervals (waited for, not slept: a loaded machine runs fewer per second).
    await eventually(lambda: leaders_checks() >= 4, timeout_s=20.0)

    await leader.health.close()  # freeze the counts (closing may cut one check short)
    await follower.health.close()
    board = HealthBoard(runtime_dir / "health.json", leader=False).read_if_changed()

    assert board is not None
    report = board.workers[url]
    assert report.checks >= 4
    # One check and one scrape per interval, the leader's (two processes checking would double
    # them); a request in flight when the leader closed reached the worker but was not counted.
    assert app.hits["/health"] - report.checks in (0, 1)
    assert app.hits["/metrics"] - report.scrapes in (0, 1)
    assert app.hits["/v1/models"] == 1


async def test_a_follower_serves_only_once_it_has_the_leaders_first_checks(
    worker: tuple[str, CountingWorker], runtime_dir: Path
) -> None:
    """The processes start together; one that took connections before the leader's first round
    would answer them 503 no_healthy_worker (a single process checks before serving)."""
    url = worker[0]
    starting = asyncio.create_task(Services.start(settings(url), ProcessRole(1, 2, runtime_dir)))
    await asyncio.sleep(0.3)
    assert not starting.done()  # still waiting for the leader
    leader = await Services.start(settings(url), ProcessRole(0, 2, runtime_dir))
    follower = await starting
    try:
        seen = follower.workers.get(url)
        assert seen is not None and seen.healthy
        assert follower.ready() == (True, {"p": 1})
    finally:
        await follower.close()
        await leader.close()


async def test_request_failures_seen_by_a_follower_open_only_its_own_circuit(
    worker: tuple[str, CountingWorker], gateway: tuple[Services, Services]
) -> None:
    mine, theirs = the_worker_in_each(worker[0], gateway)
    follower = gateway[1]
    await eventually(lambda: mine.healthy)

    for _ in range(follower.settings.health.unhealthy_threshold):
        follower.health.report_failure(mine)

    assert (mine.healthy, mine.circuit) == (False, "open")
    assert (theirs.healthy, theirs.circuit) == (True, "closed")


async def test_routing_in_each_process_sees_the_load_of_both(
    worker: tuple[str, CountingWorker], gateway: tuple[Services, Services]
) -> None:
    mine, theirs = the_worker_in_each(worker[0], gateway)
    leader, follower = gateway

    holds = [WorkerHold(mine, "p", 500, follower.metrics) for _ in range(2)]
    WorkerHold(theirs, "p", 100, leader.metrics)
    await asyncio.sleep(0.01)  # past the table's refresh interval

    assert (candidate(theirs).load.inflight, candidate(theirs).load.inflight_prompt_tokens) == (
        3, 1100)
    assert (candidate(mine).load.inflight, candidate(mine).load.inflight_prompt_tokens) == (
        3, 1100)
    assert (mine.inflight, theirs.inflight) == (2, 1)  # each process's own, as its metric shows

    for hold in holds:
        hold.release()
    await asyncio.sleep(0.01)
    assert candidate(theirs).load.inflight == 1


async def test_a_route_made_by_one_process_is_routed_on_by_the_other(
    worker: tuple[str, CountingWorker], runtime_dir: Path
) -> None:
    """Each process keeps its own prefix index; the routes one makes reach the other's at once
    (``gateway.kvindex.siblings``), not only when the worker's events confirm them: the next
    request of a new prefix finds its holder whichever process takes it."""
    url = worker[0]
    cfg = settings(url).model_dump(mode="json")
    cfg["pools"][0]["policy"] = "kv_aware"
    two = [await Services.start(build_settings(cfg), ProcessRole(i, 2, runtime_dir))
           for i in (0, 1)]
    try:
        first, second = two
        assert first.siblings is not None and second.siblings is not None
        for s in two:
            seen = s.workers.get(url)
            assert seen is not None
            await eventually(lambda seen=seen: seen.healthy)  # type: ignore[misc]
        prompt = tuple(range(1000, 1000 + 640))
        request = RoutingRequest(model="noop", prompt_tokens=len(prompt), max_tokens=8,
                                 token_ids=prompt)
        assert second.router.route(request).decision.predicted_cached_tokens == 0
        await eventually(lambda: (first.router.route(request).decision
                                  .predicted_cached_tokens) == 608, timeout_s=5)
    finally:
        for s in reversed(two):
            await s.close()


async def test_one_process_shares_nothing(worker: tuple[str, CountingWorker]) -> None:
    url, _ = worker
    services = await Services.start(settings(url))
    try:
        assert services.load_table is None and services.health.follower is False
        assert services.siblings is None
        w = services.workers.get(url)
        assert w is not None
        w.inflight += 1
        assert candidate(w).load.inflight == 1
    finally:
        await services.close()


def test_two_real_gateway_processes_check_each_worker_once_per_interval(
    worker: tuple[str, CountingWorker], tmp_path: Path
) -> None:
    """``kvgate serve --processes 2`` as real processes: both become ready (the follower only
    from the leader's board) and the worker sees one process's checks, not two."""
    url, app = worker
    interval_s = 0.1
    config = {"models": [{"name": "noop", "tokenizer": "simple"}],
              "pools": [{"name": "p", "max_context_tokens": 4096, "workers": [url]}],
              "health": {"interval_s": interval_s, "timeout_s": 30.0,
                         "scrape_interval_s": interval_s}}
    with ProcessSet(tmp_path / "logs") as procs:
        gw = procs.start("gateway", GatewayProcess(config, tmp_path / "kvgate.yaml", processes=2),
                         timeout_s=60)
        for _ in range(20):  # fresh connections: the kernel spreads them over both processes
            assert httpx.get(gw.url + "/ready", timeout=10).status_code == 200
        before, started = app.hits.copy(), time.monotonic()
        time.sleep(2.0)
        seen, elapsed = app.hits - before, time.monotonic() - started

    one_process = elapsed / interval_s + 1
    # Two processes checking would make about twice this.
    assert 0 < seen["/health"] <= 1.3 * one_process, (seen, one_process)
    assert 0 < seen["/metrics"] <= 1.3 * one_process, (seen, one_process)
