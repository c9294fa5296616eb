"""AdmissionGate: a cap on requests in flight with a bounded FIFO queue and a queue timeout."""

from __future__ import annotations

import asyncio

import pytest

from gateway.overload import AdmissionGate, Overloaded


async def test_admits_up_to_the_cap_then_queues_in_order() -> None:
    gate = AdmissionGate(max_inflight=2, max_queued=5, queue_timeout_s=5)
    await gate.acquire()
    await gate.acquire()
    order: list[int] = []

    async def waiter(i: int) -> None:
        await gate.acquire()
        order.append(i)

    tasks = [asyncio.create_task(waiter(i)) for i in range(3)]
    await asyncio.sleep(0.01)
    assert (gate.inflight, gate.queued, order) == (2, 3, [])
    for _ in range(3):
        gate.release()
        await asyncio.sleep(0.01)
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2]
    assert gate.inflight == 2 and gate.queued == 0


async def test_full_queue_refuses_at_once() -> None:
    gate = AdmissionGate(max_inflight=1, max_queued=1, queue_timeout_s=5)
    await gate.acquire()
    queued = asyncio.create_task(gate.acquire())
    await asyncio.sleep(0.01)
    with pytest.raises(Overloaded):
        await gate.acquire()
    gate.release()
    await queued
    assert gate.inflight == 1


async def test_queue_timeout_refuses_and_leaves_no_trace() -> None:
    gate = AdmissionGate(max_inflight=1, max_queued=3, queue_timeout_s=0.05)
    await gate.acquire()
    with pytest.raises(Overloaded) as info:
        await gate.acquire()
    assert info.value.retry_after_s == pytest.approx(0.05)
    assert gate.queued == 0
    gate.release()
    assert gate.inflight == 0


async def test_cancelled_waiter_does_not_leak_a_slot() -> None:
    """A client that goes away while queued must neither hold a slot nor lose one."""
    gate = AdmissionGate(max_inflight=1, max_queued=3, queue_timeout_s=5)
    await gate.acquire()
    queued = asyncio.create_task(gate.acquire())
    await asyncio.sleep(0.01)
    queued.cancel()
    await asyncio.sleep(0.01)
    gate.release()
    assert (gate.inflight, gate.queued) == (0, 0)
    await gate.acquire()
    assert gate.inflight == 1
