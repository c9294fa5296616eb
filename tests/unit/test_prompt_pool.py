"""gateway.prompt.pool.TokenizePool: long prompts are tokenized in a bounded number of threads."""

from __future__ import annotations

import asyncio
import threading
import time

import anyio
import pytest

from gateway.prompt.pool import TokenizePool


class Probe:
    """A blocking job that records how many of its kind run at once, and in which threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.running = 0
        self.most_running = 0
        self.threads: set[int] = set()
        self.started: list[int] = []

    def __call__(self, job: int, seconds: float) -> int:
        with self._lock:
            self.running += 1
            self.most_running = max(self.most_running, self.running)
            self.threads.add(threading.get_ident())
            self.started.append(job)
        time.sleep(seconds)
        with self._lock:
            self.running -= 1
        return job * 10


async def test_at_most_max_workers_jobs_run_at_once_and_each_returns_its_result() -> None:
    pool, probe = TokenizePool(max_workers=2), Probe()

    results = await asyncio.gather(*(pool.run(probe, job, 0.02) for job in range(8)))

    assert results == [job * 10 for job in range(8)]
    assert probe.most_running == 2
    assert threading.get_ident() not in probe.threads  # off the event loop


async def test_the_event_loop_keeps_running_while_the_pool_is_full() -> None:
    pool, probe = TokenizePool(max_workers=1), Probe()
    flood = [asyncio.ensure_future(pool.run(probe, job, 0.05)) for job in range(4)]

    started = time.perf_counter()
    await asyncio.sleep(0.01)
    assert time.perf_counter() - started < 0.15  # not behind the 0.2 s of queued jobs

    await asyncio.gather(*flood)


async def test_a_job_cancelled_while_waiting_never_runs() -> None:
    pool, probe = TokenizePool(max_workers=1), Probe()
    first = asyncio.ensure_future(pool.run(probe, 1, 0.05))
    await asyncio.sleep(0.01)
    waiting = asyncio.ensure_future(pool.run(probe, 2, 0.0))
    await asyncio.sleep(0.01)

    waiting.cancel()
    await first
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await anyio.sleep(0.02)

    assert probe.started == [1]


def test_a_pool_needs_at_least_one_worker() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        TokenizePool(max_workers=0)


def held(probe: Probe, go: threading.Event, job: int) -> int:
    """``probe``'s job, running until the test sets ``go`` (not for a time a stall could use up)."""
    result = probe(job, 0.0)
    go.wait(30)
    return result


async def test_waiting_jobs_are_served_tenant_by_tenant() -> None:
    """A tenant's queued jobs do not keep another tenant's behind them all: after the job
    running, tenants take turns (each one's jobs in arrival order)."""
    pool, probe, go = TokenizePool(max_workers=1), Probe(), threading.Event()
    jobs = [asyncio.ensure_future(pool.run(held, probe, go, 0, tenant="a"))]
    await asyncio.sleep(0)  # it takes the free thread
    jobs += [asyncio.ensure_future(pool.run(probe, job, 0.0, tenant="a")) for job in (1, 2, 3)]
    await asyncio.sleep(0)
    jobs += [asyncio.ensure_future(pool.run(probe, job, 0.0, tenant="b")) for job in (10, 11)]
    await asyncio.sleep(0)
    assert pool.waiting == 5
    go.set()

    await asyncio.gather(*jobs)

    assert probe.started == [0, 1, 10, 2, 11, 3]
    assert pool.waiting == 0


async def test_a_job_cancelled_as_its_turn_comes_never_runs_and_the_next_one_does() -> None:
    pool, probe, go = TokenizePool(max_workers=1), Probe(), threading.Event()
    first = asyncio.ensure_future(pool.run(held, probe, go, 1, tenant="a"))
    await asyncio.sleep(0)  # it takes the free thread
    second = asyncio.ensure_future(pool.run(probe, 2, 0.0, tenant="b"))
    third = asyncio.ensure_future(pool.run(probe, 3, 0.0, tenant="c"))
    await asyncio.sleep(0)
    assert pool.waiting == 2
    go.set()
    await first  # the thread is handed to the second job ...
    second.cancel()  # ... as its client leaves
    assert await third == 30
    with pytest.raises(asyncio.CancelledError):
        await second
    assert probe.started == [1, 3]


async def test_a_tenant_reads_at_most_its_permits_of_large_bodies_at_a_time() -> None:
    """``reading``: one tenant's third large body waits (unread) while two hold its permits;
    another tenant's is not held behind them; a tenant with nothing read is forgotten."""
    pool = TokenizePool()
    held = [asyncio.Event() for _ in range(2)]
    release = asyncio.Event()
    entered: list[str] = []

    async def read(tenant: str, name: str, started: asyncio.Event | None = None) -> None:
        async with pool.reading(tenant):
            entered.append(name)
            if started is not None:
                started.set()
            await release.wait()

    first = [asyncio.create_task(read("mallory", f"m{i}", held[i])) for i in range(2)]
    await asyncio.gather(*(e.wait() for e in held))
    third = asyncio.create_task(read("mallory", "m2"))
    alice = asyncio.create_task(read("alice", "a0"))
    for _ in range(5):
        await asyncio.sleep(0)
    assert entered == ["m0", "m1", "a0"]  # mallory's third waits, alice's does not
    assert (pool.readers("mallory"), pool.readers("alice")) == (2, 1)
    release.set()
    await asyncio.gather(*first, third, alice)
    assert entered[3:] == ["m2"]  # its turn came once the first two let go
    assert (pool.readers("mallory"), pool.readers("alice")) == (0, 0)
    assert pool._readers == {}  # nothing kept for tenants with nothing to read


async def test_a_reader_cancelled_while_waiting_gives_back_nothing_it_did_not_take() -> None:
    pool = TokenizePool()
    release = asyncio.Event()

    async def read() -> None:
        async with pool.reading("mallory"):
            await release.wait()

    holders = [asyncio.create_task(read()) for _ in range(2)]
    await asyncio.sleep(0.01)
    waiting = asyncio.create_task(read())
    await asyncio.sleep(0.01)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert pool.readers("mallory") == 2
    release.set()
    await asyncio.gather(*holders)
    assert pool.readers("mallory") == 0 and pool._readers == {}
