"""``cancel_and_wait``: every task ends, even one that lost its first cancellation."""

from __future__ import annotations

import asyncio
import gc

import pytest

from gateway.tasks import cancel_and_wait


async def _loses_one_cancellation() -> None:
    """A loop whose library call swallowed the first cancellation, as redis-py 8.1 can."""
    swallowed = False
    while True:
        try:
            await asyncio.sleep(0.001)
        except asyncio.CancelledError:
            if swallowed:
                raise
            swallowed = True  # the library returned normally: the loop goes round again


async def test_a_task_that_lost_its_cancellation_is_cancelled_again_until_it_ends() -> None:
    task = asyncio.create_task(_loses_one_cancellation())
    await asyncio.sleep(0.01)
    async with asyncio.timeout(2.0):
        await cancel_and_wait([task], retry_s=0.05)
    assert task.cancelled()
    # the loop did go round after the first cancellation: a single cancel would never end it
    task2 = asyncio.create_task(_loses_one_cancellation())
    await asyncio.sleep(0.01)
    task2.cancel()
    await asyncio.sleep(0.05)
    assert not task2.done()
    await cancel_and_wait([task2])


async def test_failed_and_finished_tasks_are_retrieved_and_none_is_left_pending(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    async def sleeps() -> None:
        await asyncio.sleep(60)

    failed = asyncio.create_task(fails())
    finished = asyncio.create_task(asyncio.sleep(0))
    sleeping = asyncio.create_task(sleeps())
    await asyncio.sleep(0.01)
    await cancel_and_wait(t for t in (failed, finished, sleeping))  # any iterable, read once
    assert failed.done() and finished.done() and sleeping.cancelled()
    del failed
    gc.collect()
    assert "never retrieved" not in caplog.text
    await cancel_and_wait([])  # nothing to stop
