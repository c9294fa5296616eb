"""The shared budget store's own wire behaviour (``gateway.budgets.shared``), beyond the store
contract that ``test_budget_contract`` proves for it: releases without a reply, calls coalesced
into one write, what a lost connection and a restarted server do.

Each test runs a real ``SharedBudgetServer`` on a unix socket and two ``SharedBudgetStore``
clients on it, ``a`` and ``b``, standing for two gateway processes.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gateway.budgets.errors import BudgetError, StoreUnavailableError
from gateway.budgets.memory import MemoryBudgetStore
from gateway.budgets.models import BudgetLimits, Reservation, ReserveRequest, SessionUsage
from gateway.budgets.shared import (
    RELEASE_NOWAIT_MARGIN_S,
    SHARED_STORE_NAME,
    SharedBudgetServer,
    SharedBudgetStore,
    socket_path,
)
from tests.clock import T0

pytestmark = pytest.mark.asyncio(loop_scope="session")

LEASE_TTL_S = 20.0
TENANT = "anonymous"


@dataclass
class Gateway:
    """A server and two processes' clients of it."""

    runtime_dir: Path
    server: SharedBudgetServer
    a: SharedBudgetStore
    b: SharedBudgetStore


@pytest.fixture
async def gw() -> AsyncIterator[Gateway]:
    # A short directory: a unix socket's path must fit in 108 bytes.
    with tempfile.TemporaryDirectory(prefix="kvgate-shared-") as scratch:
        runtime_dir = Path(scratch)
        server = SharedBudgetServer(MemoryBudgetStore(name=SHARED_STORE_NAME),
                                    socket_path(runtime_dir))
        await server.start()
        a, b = SharedBudgetStore(socket_path(runtime_dir)), SharedBudgetStore(
            socket_path(runtime_dir))
        await a.start()
        await b.start()
        gateway = Gateway(runtime_dir, server, a, b)
        yield gateway
        await gateway.a.close()
        await gateway.b.close()
        await gateway.server.close()


def request(rid: str, now: float = T0, *, inflight_requests: int | None = 1,
            session_id: str = "s1") -> ReserveRequest:
    return ReserveRequest(
        tenant=TENANT, session_id=session_id, reservation_id=rid, kv_bytes=1000, tokens=10,
        limits=BudgetLimits(inflight_requests=inflight_requests), tenant_limits=BudgetLimits(),
        window_s=300.0, lease_ttl_s=LEASE_TTL_S, now=now)


def completes_without_suspending(coro: Any) -> Any:
    """The coroutine's result if it ran to its end without waiting for anything; else fails."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    pytest.fail("the call waited (for the server's reply)")


async def wait_for_usage(store: SharedBudgetStore, session_id: str, now: float,
                         inflight_requests: int) -> SessionUsage | None:
    """The session's usage once it shows ``inflight_requests`` (polled: another connection's
    bytes may be read after this one's), or the last seen after a second."""
    usage = None
    for _ in range(100):
        usage = await store.usage(TENANT, session_id, now)
        seen = 0 if usage is None else usage.inflight_requests
        if seen == inflight_requests:
            return usage
        await asyncio.sleep(0.01)
    return usage


async def test_release_of_a_reservation_made_here_returns_without_waiting_for_the_server(
    gw: Gateway,
) -> None:
    r = await gw.a.reserve(request("r1"))
    assert completes_without_suspending(gw.a.release(TENANT, "s1", r.id, T0 + 1, 5)) is True
    usage = await wait_for_usage(gw.b, "s1", T0 + 1, 0)
    assert usage is None or usage.inflight_requests == 0


async def test_release_without_reply_is_run_before_the_next_reserve_of_the_same_process(
    gw: Gateway,
) -> None:
    r = await gw.a.reserve(request("r1", inflight_requests=1))
    await gw.a.release(TENANT, "s1", r.id, T0 + 1, None)
    # At one request in flight, this admission needs the release to have run first.
    again = await gw.a.reserve(request("r2", T0 + 1, inflight_requests=1))
    assert again.id == "r2"


async def test_release_near_its_lease_expiry_returns_the_servers_answer(gw: Gateway) -> None:
    """Within the margin another process (whose clock may run ahead) can reap the lease before
    the release arrives: the answer must be the server's, not the guess that it is held."""
    r = await gw.a.reserve(request("r1", inflight_requests=None))
    await gw.b.reserve(request("r2", r.lease_expires_at, inflight_requests=None))  # reaps r1
    near = r.lease_expires_at - RELEASE_NOWAIT_MARGIN_S / 2
    assert await gw.a.release(TENANT, "s1", r.id, near, None) is False


async def test_release_of_a_lease_another_process_reaped_returns_false(gw: Gateway) -> None:
    r = await gw.a.reserve(request("r1", inflight_requests=None))
    late = r.lease_expires_at + 1
    await gw.b.reserve(request("r2", late, inflight_requests=None))  # reaps r1
    assert await gw.a.release(TENANT, "s1", r.id, late, None) is False


async def test_release_of_a_reservation_made_by_another_process_asks_the_server(
    gw: Gateway,
) -> None:
    r = await gw.a.reserve(request("r1"))
    assert await gw.b.release(TENANT, "s1", r.id, T0 + 1, None) is True
    assert await gw.b.release(TENANT, "s1", r.id, T0 + 1, None) is False


async def test_reservation_released_with_another_session_id_is_not_released(
    gw: Gateway,
) -> None:
    r = await gw.a.reserve(request("r1"))
    assert await gw.a.release(TENANT, "other", r.id, T0 + 1, None) is False
    usage = await gw.b.usage(TENANT, "s1", T0 + 1)
    assert usage is not None and usage.inflight_requests == 1


async def test_calls_of_one_event_loop_iteration_go_out_in_one_write_and_stay_exact(
    gw: Gateway,
) -> None:
    conn = gw.a._conn
    assert conn is not None and conn.transport is not None
    transport = conn.transport
    writes: list[bytes] = []

    class CountingTransport:
        def write(self, data: bytes) -> None:
            writes.append(data)
            transport.write(data)

        def __getattr__(self, name: str) -> Any:
            return getattr(transport, name)

    conn.transport = CountingTransport()  # type: ignore[assignment]
    outcomes = await asyncio.gather(
        *(gw.a.reserve(request(f"r{i}", inflight_requests=7)) for i in range(10)),
        return_exceptions=True)
    conn.transport = transport
    assert len(writes) == 1
    assert sum(isinstance(o, Reservation) for o in outcomes) == 7
    assert sum(isinstance(o, BudgetError) for o in outcomes) == 3


async def test_releases_buffered_when_the_store_closes_still_reach_the_server(
    gw: Gateway,
) -> None:
    """Regression: releases sent without a reply wait in a buffer for the end of the event-loop
    iteration; closing the store dropped them, so their reservations stayed until reaped."""
    r = await gw.a.reserve(request("r1"))
    await gw.a.release(TENANT, "s1", r.id, T0 + 1, None)
    await gw.a.close()
    usage = await wait_for_usage(gw.b, "s1", T0 + 1, 0)
    assert usage is None or usage.inflight_requests == 0


async def test_a_lost_server_fails_calls_and_a_restarted_one_answers_releases_itself(
    gw: Gateway,
) -> None:
    r = await gw.a.reserve(request("r1"))
    await gw.server.close()
    await asyncio.sleep(0.05)  # the client sees the connection go
    with pytest.raises(StoreUnavailableError):
        await gw.a.reserve(request("r2"))
    with pytest.raises(StoreUnavailableError):
        await gw.a.release(TENANT, "s1", r.id, T0 + 1, None)
    gw.server = SharedBudgetServer(MemoryBudgetStore(name=SHARED_STORE_NAME),
                                   socket_path(gw.runtime_dir))
    await gw.server.start()
    await gw.a.start()
    r3 = await gw.a.reserve(request("r3"))
    await gw.server.close()
    gw.server = SharedBudgetServer(MemoryBudgetStore(name=SHARED_STORE_NAME),
                                   socket_path(gw.runtime_dir))
    await gw.server.start()
    await asyncio.sleep(0.05)
    await gw.a.start()
    # The new server never saw r3: only it can say so.
    assert await gw.a.release(TENANT, "s1", r3.id, T0 + 1, None) is False


async def test_a_store_operation_that_fails_fails_its_call_and_the_server_keeps_serving(
    gw: Gateway,
) -> None:
    # The server runs the store's synchronous operations (``usage_sync``...): nothing it calls
    # can suspend, so each call stays atomic across processes; one that raises fails its own
    # call only.
    class FailingStore(MemoryBudgetStore):
        def usage_sync(self, tenant: str, session_id: str | None, now: float
                       ) -> SessionUsage | None:
            raise ValueError("broken usage")

    await gw.server.close()
    gw.server = SharedBudgetServer(FailingStore(name=SHARED_STORE_NAME),
                                   socket_path(gw.runtime_dir))
    await gw.server.start()
    await asyncio.sleep(0.05)
    await gw.a.start()
    with pytest.raises(RuntimeError, match="ValueError: broken usage"):
        await gw.a.usage(TENANT, "s1", T0)
    reservation = await gw.a.reserve(request("r1"))
    assert await gw.a.release(TENANT, "s1", reservation.id, T0 + 1, None) is True
    await gw.a.ping()
