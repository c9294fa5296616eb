"""BudgetService over the in-memory store: lifecycle, leases renewed while held, validation."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.budgets import (
    BudgetService,
    KVBudgetExceededError,
    MemoryBudgetStore,
)
from gateway.budgets.errors import StoreUnavailableError
from gateway.budgets.models import BudgetLimits, ReserveRequest
from gateway.budgets.session_id import ANONYMOUS_TENANT
from gateway.config import BudgetSettings
from tests.clock import ManualClock

GiB = 1 << 30
ANON = ANONYMOUS_TENANT


def settings(**kw: object) -> BudgetSettings:
    return BudgetSettings.model_validate(kw)


def test_constructor_does_no_io_and_starts_no_tasks() -> None:
    """Built outside any event loop: it must not need one."""
    BudgetService(settings(store="redis", redis_url="redis://127.0.0.1:1/0"))


async def test_background_renewal_keeps_held_leases_alive_until_release() -> None:
    held = BudgetService(settings(lease_ttl_s=0.3, defaults={"inflight_requests": 1}))
    await held.start()
    try:
        r = await held.admit(ANON, "s1", GiB, 1)
        await asyncio.sleep(0.8)  # > 2 leases; renewed every 0.1 s
        with pytest.raises(Exception, match="requests in flight"):
            await held.admit(ANON, "s1", GiB, 1)
        assert await held.usage(ANON, "s1") is not None
        await held.release(r)
        await held.release(await held.admit(ANON, "s1", GiB, 1))
    finally:
        await held.close()


async def test_leases_of_a_service_that_stopped_renewing_expire() -> None:
    store = MemoryBudgetStore()
    dead = BudgetService(settings(lease_ttl_s=0.2, auto_renew=False), store=store)
    alive = BudgetService(
        settings(lease_ttl_s=0.2, defaults={"inflight_kv_bytes": GiB}), store=store
    )
    await dead.start()
    await alive.start()
    try:
        await dead.admit(ANON, "s1", GiB, 1)
        with pytest.raises(KVBudgetExceededError):
            await alive.admit(ANON, "s1", GiB, 1)
        await asyncio.sleep(0.3)
        await alive.release(await alive.admit(ANON, "s1", GiB, 1))
    finally:
        await dead.close()
        await alive.close()


async def test_a_second_release_after_an_explicit_one_frees_nothing_twice() -> None:
    """The proxy's finish releases with ``actual_tokens``; a later release of the same
    reservation (a cleanup path) must not free the session's bytes a second time."""
    svc = BudgetService(settings(defaults={"inflight_kv_bytes": GiB}), clock=ManualClock())
    await svc.start()
    r = await svc.admit(ANON, "s1", GiB, 10)
    await svc.release(r, actual_tokens=5)
    await svc.release(r)
    held = await svc.admit(ANON, "s1", GiB, 10)  # the one GiB is free again, once
    with pytest.raises(KVBudgetExceededError):
        await svc.admit(ANON, "s1", 1, 1)
    await svc.release(held)
    assert svc.stats().inflight_local == 0
    await svc.close()


async def test_request_without_session_id_holds_its_tenants_default_session() -> None:
    """Regression: a request without a session id held nothing (store "none")."""
    svc = BudgetService(settings(defaults={"inflight_kv_bytes": GiB}), clock=ManualClock(),
                        tenants=("key",))
    r = await svc.admit("key", None, GiB, 1)
    assert (r.tenant, r.session_id, r.store) == ("key", "default", "memory")
    with pytest.raises(KVBudgetExceededError):
        await svc.admit("key", None, 1, 1)
    await svc.release(r)
    await svc.release(r)
    assert svc.stats().inflight_local == 0
    assert await svc.usage("key", "default") is not None  # hold history


async def test_throttle_arguments_are_validated() -> None:
    svc = BudgetService(settings(), clock=ManualClock())
    with pytest.raises(ValueError):
        await svc.throttle(ANON, "s1", "throttled")
    with pytest.raises(ValueError):
        await svc.throttle(ANON, "s1", "throttled", ttl_s=10, expires_at=1e10)
    with pytest.raises(ValueError):
        await svc.throttle(ANON, "s1", "throttled", ttl_s=-1)
    with pytest.raises(ValueError):
        await svc.throttle(ANON, "s1", "throttled", ttl_s=10, max_inflight_requests=None)
    with pytest.raises(ValueError):
        await svc.throttle(ANON, "s1", "paused", ttl_s=10)
    with pytest.raises(ValueError):
        await svc.throttle(ANON, "  ", "blocked", ttl_s=10)
    with pytest.raises(ValueError):  # a tenant this gateway does not serve
        await svc.throttle("someone", "s1", "blocked", ttl_s=10)
    with pytest.raises(ValueError):
        await svc.admit(ANON, "s1", -1, 1)


async def test_memory_store_forgets_idle_sessions() -> None:
    """Idle sessions must not accumulate in a long-running gateway."""
    store = MemoryBudgetStore()
    now = 1_700_000_000.0
    for i in range(100):
        req = ReserveRequest(
            tenant=f"t{i % 3}",
            session_id=f"s{i}",
            reservation_id=f"r{i}",
            kv_bytes=1,
            tokens=1,
            limits=BudgetLimits(requests_per_minute=10),
            tenant_limits=BudgetLimits(requests_per_minute=1000),
            window_s=300,
            lease_ttl_s=30,
            now=now,
        )
        await store.reserve(req)
        await store.release(f"t{i % 3}", f"s{i}", f"r{i}", now + 1, None)
    # hold history and one request to refill
    assert sum(len(s) for s in store._sessions.values()) == 100
    assert len(store._tenants) == 3
    later = ReserveRequest(
        tenant="t0",
        session_id="late",
        reservation_id="late",
        kv_bytes=1,
        tokens=1,
        limits=BudgetLimits(),
        tenant_limits=BudgetLimits(),
        window_s=300,
        lease_ttl_s=30,
        now=now + 120,
    )
    await store.reserve(later)  # triggers the sweep
    assert {t: set(s) for t, s in store._sessions.items()} == {"t0": {"late"}}
    assert set(store._tenants) == {"t0"}


async def test_real_clock_is_the_default() -> None:
    svc = BudgetService(settings())
    r = await svc.admit(ANON, "s1", 1, 1)
    assert abs(r.started_at - time.time()) < 5
    await svc.release(r)


class ShrinkUnreachable(MemoryBudgetStore):
    """A store whose shrink calls fail as an unreachable Redis's do."""

    async def shrink(self, tenant: str, session_id: str, reservation_id: str, now: float,
                     kv_bytes: int) -> int | None:
        raise StoreUnavailableError("redis: connection refused")


async def test_shrink_never_raises_for_a_store_outage_and_keeps_the_full_charge() -> None:
    svc = BudgetService(settings(probe_initial_s=60, probe_max_s=60), clock=ManualClock(),
                        store=ShrinkUnreachable())
    await svc.start()
    try:
        r = await svc.admit(ANON, "s1", 4 * GiB, 10)
        assert await svc.shrink(r, GiB) == r  # unchanged: still charged in full
        assert svc.degraded and svc.stats().store_errors == 1
        usage = await svc.usage(ANON, "s1")
        assert usage is None or usage.inflight_kv_bytes == 4 * GiB
        await svc.release(r)
    finally:
        await svc.close()


async def test_shrink_asks_the_store_only_for_a_reservation_held_here_that_gets_smaller() -> None:
    store = ShrinkUnreachable()  # any call to its shrink would mark the service degraded
    svc = BudgetService(settings(), clock=ManualClock(), store=store)
    await svc.start()
    try:
        r = await svc.admit(ANON, "s1", 4 * GiB, 10)
        assert await svc.shrink(r, 4 * GiB) == r
        assert await svc.shrink(r, 5 * GiB) == r  # never grown
        with pytest.raises(ValueError):
            await svc.shrink(r, -1)
        await svc.release(r)
        assert await svc.shrink(r, GiB) is None  # released: not held here any more
        assert not svc.degraded
    finally:
        await svc.close()


async def test_renewal_after_a_shrink_keeps_the_shrunk_size() -> None:
    """A renewal that was away while a shrink landed wrote the reservation back as it was
    before the shrink (its kv_bytes), undoing the shrink in the service's own record."""
    svc = BudgetService(settings(), clock=ManualClock())
    await svc.start()
    try:
        r = await svc.admit(ANON, "s1", 4 * GiB, 10)
        shrunk = await svc.shrink(r, GiB)
        assert shrunk is not None and shrunk.kv_bytes == GiB
        renewed = await svc.renew(r)  # the reservation as admitted, as the renewer holds it
        assert renewed is not None and renewed.kv_bytes == GiB
        assert await svc.shrink(r, GiB) == renewed  # the same size: nothing to do
        await svc.release(r)
    finally:
        await svc.close()
