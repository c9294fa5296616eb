"""The memory store's per-session totals, kept as reservations come and go, against a naive
model that recomputes them from every live reservation."""

from __future__ import annotations

import random

import pytest

from gateway.budgets.memory import MemoryBudgetStore
from gateway.budgets.models import BudgetLimits, ReserveRequest

NO_LIMITS = BudgetLimits()


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_a_busy_sessions_totals_and_lease_expiries_match_a_recount(seed: int) -> None:
    """A tenant's default session holds every request of the tenant in flight, so its totals
    are kept incrementally (they used to be summed per operation). Random reserves, releases,
    renewals (longer and shorter), shrinks and time passing: the in-flight bytes and count the store
    reports, and which leases it reaps as expired, equal a recount of the live reservations (and
    so do the tenant's running sums)."""
    rng = random.Random(seed)
    store = MemoryBudgetStore()
    now = 1000.0
    live: dict[str, tuple[int, float]] = {}  # id -> (kv bytes, lease expiry)
    for step in range(400):
        op = rng.random()
        if op < 0.45 or not live:
            rid = f"r{step}"
            kv = rng.randrange(1, 10_000)
            ttl = rng.choice([5.0, 20.0, 60.0])
            await store.reserve(ReserveRequest(
                tenant="t", session_id="default", reservation_id=rid, kv_bytes=kv, tokens=1,
                limits=NO_LIMITS, tenant_limits=NO_LIMITS, window_s=60.0, lease_ttl_s=ttl,
                now=now))
            live[rid] = (kv, now + ttl)
        elif op < 0.7:
            rid = rng.choice(sorted(live))
            assert await store.release("t", "default", rid, now, None)
            del live[rid]
        elif op < 0.8:
            rid = rng.choice(sorted(live))
            ttl = rng.choice([1.0, 30.0])
            assert await store.renew("t", "default", rid, now, ttl) is not None
            live[rid] = (live[rid][0], now + ttl)
        elif op < 0.85:
            rid = rng.choice(sorted(live))
            to = rng.randrange(0, 10_000)  # more than it holds: unchanged
            kv = min(live[rid][0], to)
            assert await store.shrink("t", "default", rid, now, to) == kv
            live[rid] = (kv, live[rid][1])
        else:
            now += rng.choice([0.5, 3.0, 10.0])
        live = {rid: v for rid, v in live.items() if v[1] > now}  # reaped when opened
        usage = await store.usage("t", "default", now)
        if not live:
            assert usage is None or usage.inflight_requests == 0
            continue
        assert usage is not None
        assert usage.inflight_requests == len(live), step
        assert usage.inflight_kv_bytes == sum(kv for kv, _ in live.values()), step
        tenant = await store.usage("t", None, now)
        assert tenant is not None
        assert (tenant.inflight_requests, tenant.inflight_kv_bytes) == (
            usage.inflight_requests, usage.inflight_kv_bytes), step
