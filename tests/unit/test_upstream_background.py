"""``BackgroundWatchers``: how each way a background response can end gives its holds back.

The owner here is a real simulated worker (``gateway.sim``) or a port nobody listens on; the
watchers poll it with a real aiohttp session, at a short interval so the tests run fast.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import httpx
from prometheus_client import CollectorRegistry

from gateway.config import PoolSettings, TimeoutSettings
from gateway.metrics import Metrics
from gateway.procs.net import free_ports
from gateway.sim.config import SimWorkerConfig
from gateway.sim.fleet import SimFleet
from gateway.upstream.background import BackgroundWatchers
from gateway.workers.worker import Worker

POOL = PoolSettings.model_validate({"name": "p", "max_context_tokens": 1024})
TIMEOUTS = TimeoutSettings.model_validate({})


class Ends:
    """What ``on_end`` was called with, once per response."""

    def __init__(self) -> None:
        self.calls: list[Mapping[str, Any] | None] = []
        self.done = asyncio.Event()

    async def __call__(self, final: Mapping[str, Any] | None) -> None:
        self.calls.append(final)
        self.done.set()


@contextlib.asynccontextmanager
async def running() -> AsyncIterator[tuple[aiohttp.ClientSession, str]]:
    """A session to poll with, and a simulated worker slow enough that a 500-token answer runs
    for seconds (made in the test's own event loop, which serves it)."""
    async with aiohttp.ClientSession() as session, SimFleet(
            [SimWorkerConfig(model_name="sim", time_scale=4.0)]) as fleet:
        yield session, fleet.urls[0]


def watchers(session: aiohttp.ClientSession, workers: dict[str, Worker],
             **kwargs: Any) -> BackgroundWatchers:
    return BackgroundWatchers(session, workers.get, Metrics(CollectorRegistry()),
                              poll_interval_s=0.02, **kwargs)


async def background(url: str, tokens: int = 500) -> str:
    async with httpx.AsyncClient() as client:
        r = await client.post(url + "/v1/responses", json={
            "model": "sim", "input": "x", "max_output_tokens": tokens, "ignore_eos": True,
            "background": True})
    assert r.status_code == 200, r.text
    return str(r.json()["id"])


async def test_a_response_is_held_until_its_final_status_then_ends_with_the_final_object() -> None:
    async with running() as (session, owner):
        worker = Worker(owner, "p")
        w = watchers(session, {owner: worker})
        ends = Ends()
        w.watch("t", await background(owner, tokens=30), owner, POOL, TIMEOUTS, ends)
        assert worker.inflight == 1 and len(w) == 1  # taken before watch returned
        await asyncio.wait_for(ends.done.wait(), 30)
        final = ends.calls[0]
        assert final is not None and final["status"] == "incomplete"
        assert final["usage"]["output_tokens"] == 30
        await asyncio.sleep(0)
        assert worker.inflight == 0 and len(w) == 0


async def test_settle_with_a_final_answer_ends_the_hold_before_it_returns() -> None:
    async with running() as (session, owner):
        worker = Worker(owner, "p")
        w = watchers(session, {owner: worker})
        ends = Ends()
        rid = await background(owner)
        w.watch("t", rid, owner, POOL, TIMEOUTS, ends)
        async with httpx.AsyncClient() as client:
            cancelled = await client.post(f"{owner}/v1/responses/{rid}/cancel")
        await w.settle("other-tenant", rid, cancelled.content)  # not this tenant's: ignored
        assert ends.calls == [] and worker.inflight == 1
        await w.settle("t", rid, cancelled.content)
        assert ends.calls and ends.calls[0] is not None and ends.calls[0]["status"] == "cancelled"
        assert worker.inflight == 0


async def test_an_unreachable_owner_is_given_up_after_max_errors() -> None:
    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    worker = Worker(url, "p")
    async with aiohttp.ClientSession() as session:
        w = watchers(session, {url: worker}, max_errors=3)
        ends = Ends()
        w.watch("t", "resp_x", url, POOL, TIMEOUTS, ends)
        await asyncio.wait_for(ends.done.wait(), 10)
    assert ends.calls == [None] and worker.inflight == 0


async def test_an_owner_that_left_the_fleet_ends_the_hold() -> None:
    async with running() as (session, owner):
        workers = {owner: Worker(owner, "p")}
        w = watchers(session, workers)
        ends = Ends()
        w.watch("t", await background(owner), owner, POOL, TIMEOUTS, ends)
        gone = workers.pop(owner)
        await asyncio.wait_for(ends.done.wait(), 10)
        assert ends.calls == [None] and gone.inflight == 0
        # an owner already gone is never held
        w.watch("t", "resp_y", owner, POOL, TIMEOUTS, ends)
        await asyncio.sleep(0.05)
        assert ends.calls == [None, None] and len(w) == 0


async def test_close_stops_every_watcher_without_ending_its_reservation() -> None:
    async with running() as (session, owner):
        worker = Worker(owner, "p")
        w = watchers(session, {owner: worker})
        ends = Ends()
        rid = await background(owner)
        w.watch("t", rid, owner, POOL, TIMEOUTS, ends)
        await w.close()
        assert len(w) == 0 and worker.inflight == 0
        assert ends.calls == []  # the reservation is left to its lease
        w.watch("t", rid, owner, POOL, TIMEOUTS, ends)  # after close: nothing starts
        assert len(w) == 0 and worker.inflight == 0 and ends.calls == []
