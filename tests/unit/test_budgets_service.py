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
from gateway.budgets.models import BudgetLimits, ReserveRequest
from gateway.config import BudgetSettings
from tests.clock import ManualClock

GiB = 1 << 30


def settings(**kw: object) -> BudgetSettings:
    return BudgetSettings.model_validate(kw)


def test_constructor_does_no_io_and_starts_no_tasks() -> None:
    """Built outside any event loop: it must not need one."""
    BudgetService(settings(store="redis", redis_url="redis://127.0.0.1:1/0"))


async def test_background_renewal_keeps_held_leases_alive_until_release() -> None:
    held = BudgetService(settings(lease_ttl_s=0.3, defaults={"inflight_requests": 1}))
    await held.start()
    try:
        r = await held.admit("s1", None, GiB, 1)
        await asyncio.sleep(0.8)  # > 2 leases; renewed every 0.1 s
        with pytest.raises(Exception, match="requests in flight"):
            await held.admit("s1", None, GiB, 1)
        assert await held.session("s1") is not None
        await held.release(r)
        await held.release(await held.admit("s1", None, GiB, 1))
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
        await dead.admit("s1", None, GiB, 1)
        with pytest.raises(KVBudgetExceededError):
            await alive.admit("s1", None, GiB, 1)
        await asyncio.sleep(0.3)
        await alive.release(await alive.admit("s1", None, GiB, 1))
    finally:
        await dead.close()
        await alive.close()


async def test_hold_releases_on_exit_even_after_an_explicit_release() -> None:
    svc = BudgetService(settings(defaults={"inflight_kv_bytes": GiB}), clock=ManualClock())
    await svc.start()
    r = await svc.admit("s1", None, GiB, 10)
    async with svc.hold(r):
        await svc.release(r, actual_tokens=5)
    with pytest.raises(RuntimeError):
        async with svc.hold(await svc.admit("s1", None, GiB, 10)):
            raise RuntimeError("upstream failed")
    await svc.release(await svc.admit("s1", None, GiB, 10))
    assert svc.stats().inflight_local == 0
    await svc.close()


async def test_anonymous_reservation_holds_nothing_and_releases_as_a_noop() -> None:
    svc = BudgetService(settings(defaults={"inflight_kv_bytes": GiB}), clock=ManualClock())
    r = await svc.admit(None, "key", GiB, 1)
    assert r.session_id is None and r.store == "none"
    assert await svc.renew(r) == r
    await svc.release(r)
    await svc.release(r)
    assert svc.stats().inflight_local == 0


async def test_throttle_arguments_are_validated() -> None:
    svc = BudgetService(settings(), clock=ManualClock())
    with pytest.raises(ValueError):
        await svc.throttle("s1", "throttled")
    with pytest.raises(ValueError):
        await svc.throttle("s1", "throttled", ttl_s=10, expires_at=1e10)
    with pytest.raises(ValueError):
        await svc.throttle("s1", "throttled", ttl_s=-1)
    with pytest.raises(ValueError):
        await svc.throttle("s1", "throttled", ttl_s=10, max_inflight_requests=None)
    with pytest.raises(ValueError):
        await svc.throttle("s1", "paused", ttl_s=10)
    with pytest.raises(ValueError):
        await svc.throttle("  ", "blocked", ttl_s=10)
    with pytest.raises(ValueError):
        await svc.admit("s1", None, -1, 1)


async def test_memory_store_forgets_idle_sessions() -> None:
    """Idle sessions must not accumulate in a long-running gateway."""
    store = MemoryBudgetStore()
    now = 1_700_000_000.0
    for i in range(100):
        req = ReserveRequest(
            session_id=f"s{i}",
            reservation_id=f"r{i}",
            key_name=None,
            kv_bytes=1,
            tokens=1,
            limits=BudgetLimits(requests_per_minute=10),
            window_s=300,
            lease_ttl_s=30,
            now=now,
        )
        await store.reserve(req)
        await store.release(f"s{i}", f"r{i}", now + 1, None)
    assert len(store._sessions) == 100  # hold history and one request to refill
    later = ReserveRequest(
        session_id="late",
        reservation_id="late",
        key_name=None,
        kv_bytes=1,
        tokens=1,
        limits=BudgetLimits(),
        window_s=300,
        lease_ttl_s=30,
        now=now + 120,
    )
    await store.reserve(later)  # triggers the sweep
    assert set(store._sessions) == {"late"}


async def test_real_clock_is_the_default() -> None:
    svc = BudgetService(settings())
    r = await svc.admit("s1", None, 1, 1)
    assert abs(r.started_at - time.time()) < 5
    await svc.release(r)
