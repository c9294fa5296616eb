"""The request path's deferred bookkeeping (``gateway.backlog``): when it runs, that it runs once,
and that one failing item does not stop the others."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry

from gateway.backlog import Backlog
from gateway.metrics import Metrics
from gateway.upstream.hold import WorkerHold
from gateway.workers.worker import Worker


async def turns(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def eventually(cond: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_deferred_work_waits_its_delay_not_the_next_loop_turns() -> None:
    """Work deferred in a wave runs after the wave (``DELAY_S``), not in the loop turns right
    after it, where the wave's other requests and first tokens are still being handled."""
    backlog, ran = Backlog(delay_s=3600.0), list[str]()
    backlog.defer(ran.append, "bookkeeping")
    asyncio.get_running_loop().call_soon(ran.append, "request")
    await turns(5)
    assert ran == ["request"] and len(backlog) == 1
    backlog.flush()
    assert ran == ["request", "bookkeeping"]


async def test_deferred_work_runs_by_itself_once_due() -> None:
    backlog, ran = Backlog(delay_s=0.01), list[int]()
    for i in range(3):
        backlog.defer(ran.append, i)
    await eventually(lambda: len(ran) == 3)
    assert ran == [0, 1, 2] and len(backlog) == 0
    backlog.defer(ran.append, 3)  # a later deferral arms the timer anew
    await eventually(lambda: len(ran) == 4)
    assert ran == [0, 1, 2, 3]


async def test_items_run_once_in_order_and_a_flush_runs_them_at_once() -> None:
    backlog, ran = Backlog(delay_s=0.01), list[int]()
    for i in range(3):
        backlog.defer(ran.append, i)
    assert ran == [] and len(backlog) == 3
    backlog.flush()
    assert ran == [0, 1, 2] and len(backlog) == 0
    backlog.defer(ran.append, 3)
    await eventually(lambda: len(ran) == 4)  # the timer armed before the flush ran nothing twice
    await asyncio.sleep(0.05)
    assert ran == [0, 1, 2, 3]


async def test_work_deferred_by_deferred_work_runs_in_the_same_flush() -> None:
    backlog, ran = Backlog(), list[str]()

    def first() -> None:
        ran.append("first")
        backlog.defer(ran.append, "second")

    backlog.defer(first)
    backlog.flush()
    assert ran == ["first", "second"]


async def test_a_failing_item_is_logged_and_the_others_still_run(
        caplog: pytest.LogCaptureFixture) -> None:
    backlog, ran = Backlog(delay_s=0.01), list[int]()

    def broken() -> None:
        raise ValueError("bad observation")

    backlog.defer(ran.append, 1)
    backlog.defer(broken)
    backlog.defer(ran.append, 2)
    with caplog.at_level(logging.ERROR, logger="gateway.backlog"):
        await eventually(lambda: len(ran) == 2)
    assert ran == [1, 2] and len(backlog) == 0
    assert "deferred bookkeeping failed" in caplog.text


def test_without_a_running_loop_work_runs_at_once() -> None:
    backlog, ran = Backlog(), list[int]()
    backlog.defer(ran.append, 1)
    assert ran == [1] and len(backlog) == 0


async def test_in_flight_count_changes_at_once_and_its_gauge_once_the_backlog_ran() -> None:
    """Routing reads ``Worker.inflight`` (exact, at once); only a scrape reads the gauge."""
    metrics = Metrics(CollectorRegistry())
    worker = Worker("http://w1", "p")
    gauge = metrics.child(metrics.worker_inflight, "p", worker.url)
    holds = [WorkerHold(worker, "p", 100, metrics) for _ in range(2)]
    assert (worker.inflight, worker.inflight_prompt_tokens) == (2, 200)
    assert gauge._value.get() == 0  # not yet: deferred
    metrics.backlog.flush()
    assert gauge._value.get() == 2
    holds[0].release()
    holds[0].release()  # once
    assert worker.inflight == 1
    await eventually(lambda: len(metrics.backlog) == 0)  # by itself, once due
    assert gauge._value.get() == 1


async def test_latest_state_items_queue_once_per_key_until_they_run() -> None:
    """``defer_latest``: an item that shows state as of when it runs is queued once per key;
    further calls while it waits add nothing, and once it ran the next call queues again."""
    backlog, state, shown = Backlog(delay_s=3600.0), {"w1": 0, "w2": 0}, list[tuple[str, int]]()

    def show(key: str) -> None:
        shown.append((key, state[key]))

    for n in range(1, 4):
        state["w1"] = n
        backlog.defer_latest("w1", show, "w1")
    state["w2"] = 7
    backlog.defer_latest("w2", show, "w2")
    assert len(backlog) == 2  # one per key, not one per change
    backlog.flush()
    assert shown == [("w1", 3), ("w2", 7)]  # the latest state of each
    state["w1"] = 4
    backlog.defer_latest("w1", show, "w1")
    assert len(backlog) == 1
    backlog.flush()
    assert shown[-1] == ("w1", 4)


async def test_a_change_made_while_a_latest_state_item_runs_queues_the_next() -> None:
    """The key is released before the item runs: a change made as it runs (or after) is
    shown by an item of its own."""
    backlog, shown, state = Backlog(), list[int](), [0]

    def show() -> None:
        shown.append(state[0])
        if state[0] == 0:
            state[0] = 1  # changed after this item read it
            backlog.defer_latest("k", show)

    backlog.defer_latest("k", show)
    backlog.flush()  # runs what its items defer too
    assert shown == [0, 1] and len(backlog) == 0


async def test_many_holds_on_a_worker_queue_one_gauge_update_showing_the_latest_count() -> None:
    """Taking and releasing holds queues one ``kvgate_worker_inflight`` update per worker at a
    time (two per request before), and what it sets is the count when it runs."""
    metrics = Metrics(CollectorRegistry())
    w1, w2 = Worker("http://w1", "p"), Worker("http://w2", "p")
    gauge1 = metrics.child(metrics.worker_inflight, "p", w1.url)
    gauge2 = metrics.child(metrics.worker_inflight, "p", w2.url)
    holds = [WorkerHold(w1, "p", 10, metrics) for _ in range(5)]
    holds.append(WorkerHold(w2, "p", 10, metrics))
    for hold in holds[:3]:
        hold.release()
    assert len(metrics.backlog) == 2  # one per worker
    metrics.backlog.flush()
    assert (gauge1._value.get(), gauge2._value.get()) == (2, 1)
    holds[3].release()
    assert len(metrics.backlog) == 1
    await eventually(lambda: len(metrics.backlog) == 0)  # by itself, once due
    assert gauge1._value.get() == 1
