"""The budget store contract: every behaviour, run against the memory store, the memory store
shared by the processes of one gateway (``gateway.budgets.shared``, over its unix socket) and a
real Redis. Identity is (tenant, session): most tests use the ``anonymous`` tenant's sessions;
the tenant section proves the tenant level (sums over sessions, scoping, tenant throttles).

Each test drives a ``BudgetService`` over one store kind with a manual clock (Redis and the shared
store get the clock's time as an argument, so leases and refills are tested without sleeping).
Services made by one test share one store, as the processes of a gateway do.
"""

from __future__ import annotations

import asyncio
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from gateway.budgets import (
    BudgetService,
    KVBudgetExceededError,
    KVByteSecondsExceededError,
    KVRequestTooLargeError,
    RateLimitExceededError,
    SessionThrottledError,
)
from gateway.budgets.memory import MemoryBudgetStore
from gateway.budgets.models import BudgetLimits, ReserveRequest, ThrottleState
from gateway.budgets.session_id import ANONYMOUS_TENANT
from gateway.budgets.shared import (
    SHARED_STORE_NAME,
    SharedBudgetServer,
    SharedBudgetStore,
    socket_path,
)
from gateway.budgets.store import BudgetStore
from gateway.config import BudgetSettings
from gateway.errors import error_response
from tests.clock import ManualClock

pytest_plugins = ["tests.integration.redis_fixture"]
pytestmark = pytest.mark.asyncio(loop_scope="session")

GiB = 1 << 30
ANON = ANONYMOUS_TENANT
TENANTS = (ANON, "a", "b", "batch", "other")
"""The tenants the services of these tests serve (API keys' names)."""


Factory = Callable[..., Any]


REDIS_URL_FIXTURES = {"redis": "redis_server", "redis-cluster": "redis_cluster"}
"""The Redis store kinds: one server, and a Redis Cluster of three primaries."""


@pytest.fixture(params=["memory", "shared", *REDIS_URL_FIXTURES])
def store_kind(request: pytest.FixtureRequest) -> str:
    kind: str = request.param
    if kind in REDIS_URL_FIXTURES:
        request.getfixturevalue(REDIS_URL_FIXTURES[kind])
    return kind


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
async def make(
    store_kind: str, clock: ManualClock, request: pytest.FixtureRequest
) -> AsyncIterator[Factory]:
    """Build started services over one store (shared Redis prefix per test); closes them."""
    prefix = f"test:{uuid.uuid4().hex[:12]}"
    redis = store_kind in REDIS_URL_FIXTURES
    url = request.getfixturevalue(REDIS_URL_FIXTURES[store_kind]) if redis else None
    services: list[BudgetService] = []
    shared_memory = MemoryBudgetStore()
    # A short directory: a unix socket's path must fit in 108 bytes.
    scratch = tempfile.TemporaryDirectory(prefix="kvgate-contract-")
    runtime_dir = Path(scratch.name)
    server = SharedBudgetServer(MemoryBudgetStore(name=SHARED_STORE_NAME), socket_path(runtime_dir))
    if store_kind == "shared":
        await server.start()

    def store_for() -> BudgetStore | None:
        if store_kind == "memory":
            return shared_memory
        if store_kind == "shared":
            return SharedBudgetStore(socket_path(runtime_dir))
        return None

    async def factory(**overrides: Any) -> BudgetService:
        fields: dict[str, Any] = {
            "store": "redis" if redis else "memory",
            "redis_url": url,
            "redis_key_prefix": prefix,
            "redis_timeout_s": 5.0,  # a loaded CI machine must not look like an outage
        }
        fields.update(overrides)
        settings = BudgetSettings.model_validate(fields)
        service = BudgetService(settings, clock=clock, store=store_for(), tenants=TENANTS)
        await service.start()
        services.append(service)
        return service

    yield factory
    for service in services:
        await service.close()
    await server.close()
    scratch.cleanup()


def limits(**kw: Any) -> dict[str, Any]:
    return {"defaults": kw}


# -- reserve / release ------------------------------------------------------------------------


async def test_reserve_then_release_returns_session_to_zero(make: Factory) -> None:
    svc = await make(**limits(inflight_kv_bytes=10 * GiB))
    r1 = await svc.admit(ANON, "s1", 3 * GiB, 100)
    r2 = await svc.admit(ANON, "s1", 2 * GiB, 100)
    usage = await svc.usage(ANON, "s1")
    assert usage is not None
    assert (usage.inflight_kv_bytes, usage.inflight_requests) == (5 * GiB, 2)
    await svc.release(r1)
    await svc.release(r2)
    usage = await svc.usage(ANON, "s1")
    assert usage is None or (usage.inflight_kv_bytes, usage.inflight_requests) == (0, 0)
    assert await svc.sessions() == []


async def test_release_called_twice_releases_once(make: Factory) -> None:
    svc = await make(**limits(inflight_kv_bytes=4 * GiB))
    r1 = await svc.admit(ANON, "s1", 3 * GiB, 10)
    r2 = await svc.admit(ANON, "s1", 1 * GiB, 10)
    await svc.release(r1)
    await svc.release(r1)
    usage = await svc.usage(ANON, "s1")
    assert usage is not None and usage.inflight_kv_bytes == 1 * GiB
    await svc.release(r2)
    await svc.release(r2)


async def test_store_release_of_unknown_reservation_is_a_noop(
    make: Factory, clock: ManualClock
) -> None:
    svc = await make()
    store: BudgetStore = svc._store
    r = await svc.admit(ANON, "s1", GiB, 10)
    assert await store.release(ANON, "s1", r.id, clock(), None) is True
    assert await store.release(ANON, "s1", r.id, clock(), None) is False
    assert await store.release(ANON, "nobody", "nothing", clock(), None) is False


async def test_reserve_is_idempotent_on_reservation_id(make: Factory, clock: ManualClock) -> None:
    svc = await make()
    store: BudgetStore = svc._store
    req = ReserveRequest(
        tenant=ANON,
        session_id="s1",
        reservation_id="r-1",
        kv_bytes=GiB,
        tokens=10,
        limits=BudgetLimits(inflight_kv_bytes=GiB, requests_per_minute=5),
        tenant_limits=BudgetLimits(requests_per_minute=50),
        window_s=300,
        lease_ttl_s=30,
        now=clock(),
    )
    first = await store.reserve(req)
    again = await store.reserve(req)
    assert again.lease_expires_at == first.lease_expires_at
    usage = await store.usage(ANON, "s1", clock())
    assert usage is not None and usage.inflight_requests == 1
    assert usage.requests_available == 4
    tenant = await store.usage(ANON, None, clock())
    assert tenant is not None and tenant.inflight_requests == 1
    assert tenant.requests_available == 49


async def test_inflight_bytes_over_budget_is_429_kv_budget_exceeded_with_retry_after(
    make: Factory, clock: ManualClock
) -> None:
    svc = await make(**limits(inflight_kv_bytes=4 * GiB))
    # history: requests of this session are held ~10 s
    warm = await svc.admit(ANON, "s1", GiB, 1)
    clock.advance(10)
    await svc.release(warm)
    held = await svc.admit(ANON, "s1", 3 * GiB, 1)
    clock.advance(4)
    with pytest.raises(KVBudgetExceededError) as info:
        await svc.admit(ANON, "s1", 2 * GiB, 1)
    err = info.value
    assert (err.code, err.reason) == ("kv_budget_exceeded", "inflight_kv_bytes")
    assert err.retry_after_s == pytest.approx(6.0)  # started 4 s ago, typically held 10 s
    assert error_response(err, "/v1/chat/completions").headers["retry-after"] == "6"
    # a smaller one still fits
    small = await svc.admit(ANON, "s1", 1 * GiB, 1)
    await svc.release(small)
    await svc.release(held)


async def test_request_that_can_never_fit_is_400_for_sessions_and_anonymous(
    make: Factory,
) -> None:
    svc = await make(**limits(request_kv_bytes=2 * GiB, inflight_kv_bytes=8 * GiB))
    for sid in ("s1", None):
        with pytest.raises(KVRequestTooLargeError) as info:
            await svc.admit(ANON, sid, 3 * GiB, 10)
        assert info.value.limit == "request_kv_bytes"
        assert info.value.retry_after_s is None
    svc2 = await make(**limits(inflight_kv_bytes=GiB, tokens_per_minute=1000))
    with pytest.raises(KVRequestTooLargeError) as info:
        await svc2.admit(ANON, "s1", 2 * GiB, 10)
    assert info.value.limit == "inflight_kv_bytes"
    with pytest.raises(KVRequestTooLargeError) as info:
        await svc2.admit(ANON, "s1", 1, 1001)
    assert info.value.limit == "tokens_per_minute"


async def test_requests_without_a_session_id_are_charged_to_the_default_session(
    make: Factory,
) -> None:
    """Regression: a request without an id reserved nothing at all, so omitting it walked
    around every budget. It is now its tenant's ``default`` session's."""
    svc = await make(**limits(inflight_kv_bytes=GiB, requests_per_minute=2))
    held = await svc.admit(ANON, None, GiB, 10)
    assert (held.tenant, held.session_id) == (ANON, "default")
    with pytest.raises(KVBudgetExceededError):
        await svc.admit(ANON, None, 1, 10)
    await svc.release(held)
    await svc.admit(ANON, "  ", 1, 10)  # a blank id is no id
    with pytest.raises(RateLimitExceededError):
        await svc.admit(ANON, None, 1, 10)


async def test_inflight_requests_limit_is_429_rate_limit_exceeded(make: Factory) -> None:
    svc = await make(**limits(inflight_requests=2))
    a = await svc.admit(ANON, "s1", 1, 1)
    b = await svc.admit(ANON, "s1", 1, 1)
    with pytest.raises(RateLimitExceededError) as info:
        await svc.admit(ANON, "s1", 1, 1)
    assert info.value.reason == "inflight_requests"
    await svc.admit(ANON, "s2", 1, 1)  # other sessions are unaffected
    await svc.release(a)
    c = await svc.admit(ANON, "s1", 1, 1)
    for r in (b, c):
        await svc.release(r)


async def test_per_key_override_replaces_only_the_fields_it_sets(make: Factory) -> None:
    svc = await make(
        defaults={"inflight_kv_bytes": GiB, "inflight_requests": 1},
        per_key={"batch": {"inflight_kv_bytes": 4 * GiB}},
    )
    await svc.admit("batch", "s-batch", 3 * GiB, 1)
    with pytest.raises(RateLimitExceededError):
        await svc.admit("batch", "s-batch", 1, 1)
    with pytest.raises(KVRequestTooLargeError):
        await svc.admit("other", "s-other", 3 * GiB, 1)


# -- leases -----------------------------------------------------------------------------------


async def test_expired_lease_of_a_crashed_holder_is_reaped_on_next_reserve(
    make: Factory, clock: ManualClock
) -> None:
    crashed = await make(**limits(inflight_kv_bytes=4 * GiB), lease_ttl_s=30, auto_renew=False)
    await crashed.admit(ANON, "s1", 4 * GiB, 1)  # its gateway dies: never released or renewed
    alive = await make(**limits(inflight_kv_bytes=4 * GiB), lease_ttl_s=30, auto_renew=False)
    with pytest.raises(KVBudgetExceededError):
        await alive.admit(ANON, "s1", GiB, 1)
    clock.advance(29.9)
    with pytest.raises(KVBudgetExceededError):
        await alive.admit(ANON, "s1", GiB, 1)
    clock.advance(0.2)
    r = await alive.admit(ANON, "s1", 4 * GiB, 1)
    usage = await alive.usage(ANON, "s1")
    assert usage is not None and usage.inflight_kv_bytes == 4 * GiB
    await alive.release(r)


async def test_expired_leases_are_reaped_by_top_sessions_read(
    make: Factory, clock: ManualClock
) -> None:
    svc = await make(lease_ttl_s=10, auto_renew=False)
    for sid in ("a", "b", "c"):
        await svc.admit(ANON, sid, GiB, 1)
    assert len(await svc.sessions()) == 3
    clock.advance(11)
    assert await svc.sessions() == []
    assert await svc.usage(ANON, "a") is None


async def test_renew_keeps_a_lease_alive_and_a_reaped_lease_cannot_be_renewed(
    make: Factory, clock: ManualClock
) -> None:
    svc = await make(lease_ttl_s=10, auto_renew=False)
    r = await svc.admit(ANON, "s1", GiB, 1)
    for _ in range(5):
        clock.advance(8)
        renewed = await svc.renew(r)
        assert renewed is not None and renewed.lease_expires_at == clock() + 10
    usage = await svc.usage(ANON, "s1")
    assert usage is not None and usage.inflight_requests == 1
    clock.advance(10.5)
    assert await svc.renew(r) is None
    assert svc.stats().leases_lost == 1
    await svc.release(r)  # harmless


async def test_reaped_lease_is_charged_byte_seconds_until_it_expired(
    make: Factory, clock: ManualClock
) -> None:
    svc = await make(
        **limits(kv_byte_seconds=1000 * GiB), window_s=1000, lease_ttl_s=10, auto_renew=False
    )
    await svc.admit(ANON, "s1", 10 * GiB, 1)
    clock.advance(20)
    usage = await svc.usage(ANON, "s1")
    # refilled to full while held; charged 10 GiB x 10 s at lease expiry, +10 s of refill since
    assert usage is not None and usage.inflight_requests == 0
    assert usage.kv_byte_seconds_available == pytest.approx((1000 - 100 + 10) * GiB)


# -- token buckets ----------------------------------------------------------------------------


async def test_byte_seconds_bucket_charges_at_release_and_refills_continuously(
    make: Factory, clock: ManualClock
) -> None:
    # capacity 100 GiB-s per 100 s window: refill 1 GiB-s per second
    svc = await make(**limits(kv_byte_seconds=100 * GiB), window_s=100)
    r = await svc.admit(ANON, "s1", 10 * GiB, 1)
    clock.advance(12)  # holds 10 GiB for 12 s = 120 GiB-s: 20 GiB-s of debt
    await svc.release(r)
    usage = await svc.usage(ANON, "s1")
    assert usage is not None
    assert usage.kv_byte_seconds_available == pytest.approx(-20 * GiB)
    with pytest.raises(KVByteSecondsExceededError) as info:
        await svc.admit(ANON, "s1", GiB, 1)
    assert info.value.code == "kv_byte_seconds_exceeded"
    assert info.value.retry_after_s == pytest.approx(20.0)
    clock.advance(19)
    with pytest.raises(KVByteSecondsExceededError):
        await svc.admit(ANON, "s1", GiB, 1)
    clock.advance(1.5)
    await svc.release(await svc.admit(ANON, "s1", GiB, 1))
    clock.advance(1000)
    usage = await svc.usage(ANON, "s1")
    assert usage is None or usage.kv_byte_seconds_available == pytest.approx(100 * GiB)


async def test_byte_seconds_debt_is_capped_at_one_window(make: Factory, clock: ManualClock) -> None:
    svc = await make(**limits(kv_byte_seconds=100 * GiB), window_s=100, lease_ttl_s=10_000)
    r = await svc.admit(ANON, "s1", 100 * GiB, 1)
    clock.advance(50)  # 5000 GiB-s: capped at -100
    await svc.release(r)
    usage = await svc.usage(ANON, "s1")
    assert usage is not None and usage.kv_byte_seconds_available == pytest.approx(-100 * GiB)


async def test_byte_seconds_counts_what_requests_in_flight_have_accrued(
    make: Factory, clock: ManualClock
) -> None:
    svc = await make(**limits(kv_byte_seconds=100 * GiB), window_s=100, lease_ttl_s=1000)
    long = await svc.admit(ANON, "s1", 10 * GiB, 1)
    clock.advance(9)  # accrued 90 of a full 100
    await svc.release(await svc.admit(ANON, "s1", 0, 1))
    clock.advance(3)  # accrued 120 > 100 + 12
    with pytest.raises(KVByteSecondsExceededError):
        await svc.admit(ANON, "s1", 0, 1)
    await svc.release(long)


async def test_requests_per_minute_refill_continuously(make: Factory, clock: ManualClock) -> None:
    svc = await make(**limits(requests_per_minute=3))
    for _ in range(3):
        await svc.release(await svc.admit(ANON, "s1", 1, 1))
    with pytest.raises(RateLimitExceededError) as info:
        await svc.admit(ANON, "s1", 1, 1)
    assert info.value.reason == "requests_per_minute"
    assert info.value.retry_after_s == pytest.approx(20.0)
    clock.advance(20.001)
    await svc.release(await svc.admit(ANON, "s1", 1, 1))
    with pytest.raises(RateLimitExceededError):
        await svc.admit(ANON, "s1", 1, 1)


async def test_tokens_per_minute_refund_unused_tokens_at_release(
    make: Factory, clock: ManualClock
) -> None:
    svc = await make(**limits(tokens_per_minute=1000))
    r = await svc.admit(ANON, "s1", 1, 800)
    with pytest.raises(RateLimitExceededError) as info:
        await svc.admit(ANON, "s1", 1, 300)
    assert info.value.reason == "tokens_per_minute"
    assert info.value.retry_after_s == pytest.approx(100 * 60 / 1000)
    await svc.release(r, actual_tokens=200)  # 600 of 800 come back
    await svc.release(await svc.admit(ANON, "s1", 1, 750))


# -- throttles --------------------------------------------------------------------------------


async def test_throttled_session_gets_one_request_in_flight_until_expiry(
    make: Factory, clock: ManualClock
) -> None:
    svc = await make(**limits(inflight_requests=10))
    th = await svc.throttle(ANON, "s1", "throttled", ttl_s=60, reason="alert KVHog")
    assert th.state is ThrottleState.THROTTLED and th.max_inflight_requests == 1
    a = await svc.admit(ANON, "s1", 1, 1)
    clock.advance(5)
    with pytest.raises(SessionThrottledError) as info:
        await svc.admit(ANON, "s1", 1, 1)
    err = info.value
    assert (err.code, err.reason, err.limit) == (
        "session_throttled",
        "throttled",
        "inflight_requests",
    )
    assert err.retry_after_s is not None and err.retry_after_s <= 55
    await svc.admit(ANON, "s2", 1, 1)
    clock.advance(56)  # expired
    b = await svc.admit(ANON, "s1", 1, 1)
    for r in (a, b):
        await svc.release(r)
    usage = await svc.usage(ANON, "s1")
    assert usage is None or usage.throttle is None


async def test_throttle_budget_factor_scales_the_inflight_budget(make: Factory) -> None:
    svc = await make(**limits(inflight_kv_bytes=8 * GiB))
    await svc.throttle(ANON, "s1", ThrottleState.THROTTLED, ttl_s=60, max_inflight_requests=None, budget_factor=0.25
    )
    await svc.admit(ANON, "s1", 2 * GiB, 1)
    with pytest.raises(SessionThrottledError) as info:
        await svc.admit(ANON, "s1", 1, 1)
    assert info.value.limit == "inflight_kv_bytes"
    # a request the reduced budget can never hold waits for the throttle to expire, not 400
    with pytest.raises(SessionThrottledError) as info:
        await svc.admit(ANON, "s1", 4 * GiB, 1)
    assert info.value.retry_after_s == pytest.approx(60.0)


async def test_blocked_session_is_refused_until_unthrottled(
    make: Factory, clock: ManualClock
) -> None:
    svc = await make()
    await svc.throttle(ANON, "s1", "blocked", expires_at=clock() + 300, reason="abuse")
    with pytest.raises(SessionThrottledError) as info:
        await svc.admit(ANON, "s1", 1, 1)
    assert info.value.reason == "blocked"
    assert info.value.retry_after_s == pytest.approx(300.0)
    listed = await svc.throttled()
    assert [u.session_id for u in listed] == ["s1"]
    assert listed[0].throttle is not None and listed[0].throttle.reason == "abuse"
    assert await svc.unthrottle(ANON, "s1") is True
    assert await svc.unthrottle(ANON, "s1") is False
    await svc.release(await svc.admit(ANON, "s1", 1, 1))
    assert await svc.throttled() == []


async def test_throttle_expires_on_its_own(make: Factory, clock: ManualClock) -> None:
    svc = await make()
    await svc.throttle(ANON, "s1", "blocked", ttl_s=10)
    await svc.throttle(ANON, "s2", "throttled", ttl_s=20)
    assert [u.session_id for u in await svc.throttled()] == ["s1", "s2"]
    clock.advance(10)
    assert [u.session_id for u in await svc.throttled()] == ["s2"]
    await svc.release(await svc.admit(ANON, "s1", 1, 1))
    clock.advance(10)
    assert await svc.throttled() == []
    assert await svc.usage(ANON, "s2") is None


# -- top sessions -----------------------------------------------------------------------------


async def test_top_sessions_are_ordered_by_kv_in_flight(make: Factory) -> None:
    svc = await make(top_k=2)
    held = []
    for sid, gib in (("a", 1), ("b", 5), ("c", 3), ("d", 3)):
        held.append(await svc.admit(ANON, sid, gib * GiB, 1))
    assert [u.session_id for u in await svc.sessions()] == ["b", "d"]
    top = await svc.sessions(10)
    assert [(u.session_id, u.inflight_kv_bytes) for u in top] == [
        ("b", 5 * GiB),
        ("d", 3 * GiB),
        ("c", 3 * GiB),
        ("a", 1 * GiB),
    ]
    await svc.release(held[1])
    assert [u.session_id for u in await svc.sessions(10)] == ["d", "c", "a"]


async def test_session_ids_are_sanitized_before_accounting(make: Factory) -> None:
    svc = await make(**limits(inflight_requests=1))
    r = await svc.admit(ANON, "user 42/ü", GiB, 1)
    assert r.session_id is not None and " " not in r.session_id
    with pytest.raises(RateLimitExceededError):
        await svc.admit(ANON, "user 42/ü", GiB, 1)
    assert [u.session_id for u in await svc.sessions()] == [r.session_id]


# -- concurrency ------------------------------------------------------------------------------


async def test_concurrent_reserves_of_one_session_never_exceed_its_budget(make: Factory) -> None:
    svc = await make(**limits(inflight_kv_bytes=10 * GiB))

    async def one() -> Any:
        try:
            return await svc.admit(ANON, "hot", GiB, 1)
        except KVBudgetExceededError:
            return None

    results = await asyncio.gather(*(one() for _ in range(200)))
    won = [r for r in results if r is not None]
    assert len(won) == 10
    usage = await svc.usage(ANON, "hot")
    assert usage is not None and usage.inflight_kv_bytes == 10 * GiB
    await asyncio.gather(*(svc.release(r) for r in won), *(svc.release(r) for r in won))
    usage = await svc.usage(ANON, "hot")
    assert usage is None or usage.inflight_kv_bytes == 0


async def test_interleaved_reserves_and_releases_stay_within_budget(make: Factory) -> None:
    """Workers admit, hold briefly, release (twice); the budget holds throughout."""
    svc = await make(**limits(inflight_kv_bytes=8 * GiB))
    current = 0
    peak = 0
    admitted = 0

    async def worker(i: int) -> None:
        nonlocal current, peak, admitted
        for j in range(15):
            size = (1 + (i + j) % 3) * GiB
            try:
                r = await svc.admit(ANON, "hot", size, 1)
            except KVBudgetExceededError:
                await asyncio.sleep(0)
                continue
            admitted += 1
            current += size
            peak = max(peak, current)
            await asyncio.sleep(0.001 * (j % 3))
            current -= size
            await svc.release(r)
            await svc.release(r)

    async def observer() -> None:
        for _ in range(20):
            usage = await svc.usage(ANON, "hot")
            assert usage is None or usage.inflight_kv_bytes <= 8 * GiB
            await asyncio.sleep(0.002)

    await asyncio.gather(*(worker(i) for i in range(24)), observer())
    assert admitted > 24
    assert peak <= 8 * GiB
    usage = await svc.usage(ANON, "hot")
    assert usage is None or (usage.inflight_kv_bytes, usage.inflight_requests) == (0, 0)
    assert await svc.sessions() == []


async def test_crashed_holders_leases_expire_while_others_keep_working(
    make: Factory, clock: ManualClock
) -> None:
    crashed = await make(**limits(inflight_kv_bytes=6 * GiB), lease_ttl_s=30, auto_renew=False)
    lost = await asyncio.gather(*(crashed.admit(ANON, "hot", GiB, 1) for _ in range(4)))
    alive = await make(**limits(inflight_kv_bytes=6 * GiB), lease_ttl_s=30, auto_renew=False)
    mine = await asyncio.gather(*(alive.admit(ANON, "hot", GiB, 1) for _ in range(2)))
    with pytest.raises(KVBudgetExceededError):
        await alive.admit(ANON, "hot", GiB, 1)
    clock.advance(20)
    assert all([await alive.renew(r) for r in mine])
    clock.advance(15)  # the crashed holder's leases are gone, ours were renewed
    more = await asyncio.gather(*(alive.admit(ANON, "hot", GiB, 1) for _ in range(4)))
    usage = await alive.usage(ANON, "hot")
    assert usage is not None and usage.inflight_requests == 6
    for r in [*mine, *more, *mine]:
        await alive.release(r)
    for r in lost:
        await crashed.release(r)  # a late release of a reaped lease is a no-op
    usage = await alive.usage(ANON, "hot")
    assert usage is None or usage.inflight_kv_bytes == 0


# -- tenants: identity is (tenant, session) ---------------------------------------------------


def tenant_limits(session: dict[str, Any], tenant: dict[str, Any]) -> dict[str, Any]:
    return {"defaults": {**session, "tenant": tenant}}


async def test_same_session_id_in_two_tenants_is_two_sessions(make: Factory) -> None:
    """Regression: key B sending ``X-Session-ID: alice`` spent A's alice's budget (A got 429)."""
    svc = await make(**limits(inflight_kv_bytes=2 * GiB, inflight_requests=2))
    spoofed = [await svc.admit("b", "alice", GiB, 1) for _ in range(2)]
    own = await svc.admit("a", "alice", 2 * GiB, 1)  # A's alice is untouched
    a_alice, b_alice = await svc.usage("a", "alice"), await svc.usage("b", "alice")
    assert a_alice is not None and (a_alice.tenant, a_alice.inflight_kv_bytes) == ("a", 2 * GiB)
    assert b_alice is not None and (b_alice.tenant, b_alice.inflight_requests) == ("b", 2)
    assert {(u.tenant, u.session_id) for u in await svc.sessions()} == {
        ("a", "alice"), ("b", "alice")}
    assert [u.tenant for u in await svc.sessions(tenant="a")] == ["a"]
    for r in (*spoofed, own):
        await svc.release(r)


async def test_rotating_session_ids_hit_the_tenant_budget(make: Factory) -> None:
    """Regression: six requests under six rotating ids all passed a per-session budget."""
    svc = await make(**tenant_limits({"inflight_requests": 1},
                                     {"inflight_requests": 3, "inflight_kv_bytes": 4 * GiB}))
    held = [await svc.admit("a", f"rot-{i}", GiB, 1) for i in range(3)]
    with pytest.raises(RateLimitExceededError) as info:
        await svc.admit("a", "rot-3", GiB, 1)
    assert (info.value.level, info.value.limit) == ("tenant", "inflight_requests")
    assert "Tenant 'a'" in info.value.message
    await svc.admit("b", "rot-0", GiB, 1)  # another tenant is not affected
    await svc.release(held[0])
    with pytest.raises(KVBudgetExceededError) as kv:
        await svc.admit("a", "rot-4", 3 * GiB, 1)
    assert kv.value.level == "tenant"
    tenant = await svc.usage("a", None)
    assert tenant is not None and (tenant.session_id, tenant.inflight_kv_bytes) == (None, 2 * GiB)
    assert tenant.inflight_requests == 2


async def test_tenant_rate_and_byte_second_buckets_sum_over_sessions(
    make: Factory, clock: ManualClock
) -> None:
    svc = await make(**tenant_limits({}, {"requests_per_minute": 3,
                                          "kv_byte_seconds": 10 * GiB}), window_s=100)
    for i in range(3):
        await svc.release(await svc.admit("a", f"s{i}", GiB, 1))
    with pytest.raises(RateLimitExceededError) as info:
        await svc.admit("a", "fresh", GiB, 1)
    assert info.value.level == "tenant" and info.value.retry_after_s == pytest.approx(20.0)
    clock.advance(20)
    r = await svc.admit("a", "fresh", GiB, 1)
    clock.advance(11)  # 11 GiB-s accrued: the tenant's bucket (10 GiB-s) is empty
    with pytest.raises(KVByteSecondsExceededError) as bs:
        await svc.admit("a", "other", 1, 1)
    assert bs.value.level == "tenant"
    await svc.release(r)
    usage = await svc.usage("a", None)
    assert usage is not None and usage.kv_byte_seconds_available == pytest.approx(-GiB)


async def test_a_request_over_the_tenant_budget_can_never_fit(make: Factory) -> None:
    svc = await make(**tenant_limits({"inflight_kv_bytes": 8 * GiB}, {"inflight_kv_bytes": GiB}))
    with pytest.raises(KVRequestTooLargeError) as info:
        await svc.admit("a", "s1", 2 * GiB, 1)
    assert (info.value.level, info.value.limit) == ("tenant", "inflight_kv_bytes")


async def test_blocked_session_is_served_again_under_no_other_key_and_tenant_block_covers_new_ids(
    make: Factory,
) -> None:
    """Regression: a session blocked by an operator was served again as ``bob-2``; and a
    blocked id reused by another key must be that key's own, unaffected session."""
    svc = await make()
    await svc.throttle("a", "bob", "blocked", ttl_s=60, reason="abuse")
    with pytest.raises(SessionThrottledError):
        await svc.admit("a", "bob", 1, 1)
    await svc.release(await svc.admit("b", "bob", 1, 1))  # B's bob is another session
    await svc.throttle("a", None, "blocked", ttl_s=120, reason="abuse")
    for sid in ("bob-2", "x", None):
        with pytest.raises(SessionThrottledError) as info:
            await svc.admit("a", sid, 1, 1)
        assert info.value.level == "tenant" and info.value.reason == "blocked"
    listed = await svc.throttled()
    assert [(u.tenant, u.session_id) for u in listed] == [("a", "bob"), ("a", None)]
    assert await svc.unthrottle("a", None) is True
    await svc.release(await svc.admit("a", "bob-2", 1, 1))
    with pytest.raises(SessionThrottledError):
        await svc.admit("a", "bob", 1, 1)


async def test_throttled_tenant_is_capped_over_all_its_session_ids(make: Factory) -> None:
    svc = await make()
    await svc.throttle("a", None, "throttled", ttl_s=60, max_inflight_requests=2)
    held = [await svc.admit("a", f"s{i}", GiB, 1) for i in range(2)]
    with pytest.raises(SessionThrottledError) as info:
        await svc.admit("a", "s9", GiB, 1)
    assert (info.value.reason, info.value.level) == ("throttled", "tenant")
    await svc.release(held[0])
    held[0] = await svc.admit("a", "s9", GiB, 1)
    for r in held:
        await svc.release(r)


async def test_tenant_accounting_reaps_a_crashed_holders_lease_and_returns_to_zero(
    make: Factory, clock: ManualClock
) -> None:
    crashed = await make(**tenant_limits({}, {"inflight_kv_bytes": 4 * GiB}), lease_ttl_s=30,
                         auto_renew=False)
    await crashed.admit("a", "s1", 3 * GiB, 1)  # its gateway dies
    alive = await make(**tenant_limits({}, {"inflight_kv_bytes": 4 * GiB}), lease_ttl_s=30,
                       auto_renew=False)
    with pytest.raises(KVBudgetExceededError):
        await alive.admit("a", "s2", 2 * GiB, 1)
    clock.advance(31)
    r = await alive.admit("a", "s2", 4 * GiB, 1)
    await alive.release(r)
    tenant = await alive.usage("a", None)
    assert tenant is not None and (tenant.inflight_kv_bytes, tenant.inflight_requests) == (0, 0)
    assert await alive.tenants_usage() == [tenant]


# -- shrink: a partial release (prefill/decode) -------------------------------------------------


async def test_shrunk_reservation_frees_room_another_request_of_the_session_can_take(
    make: Factory,
) -> None:
    svc = await make(**tenant_limits({"inflight_kv_bytes": 10 * GiB},
                                     {"inflight_kv_bytes": 12 * GiB}))
    pd = await svc.admit("a", "s1", 8 * GiB, 100)  # the prompt held twice, until the pull
    with pytest.raises(KVBudgetExceededError):
        await svc.admit("a", "s1", 4 * GiB, 1)
    shrunk = await svc.shrink(pd, 5 * GiB)
    assert shrunk is not None and (shrunk.kv_bytes, shrunk.tokens) == (5 * GiB, 100)
    other = await svc.admit("a", "s1", 4 * GiB, 1)
    session, tenant = await svc.usage("a", "s1"), await svc.usage("a", None)
    assert session is not None and tenant is not None
    assert (session.inflight_kv_bytes, session.inflight_requests) == (9 * GiB, 2)
    assert (tenant.inflight_kv_bytes, tenant.inflight_requests) == (9 * GiB, 2)
    # the tenant's sum shrank too: 3 GiB left of its 12, whichever session asks
    with pytest.raises(KVBudgetExceededError) as info:
        await svc.admit("a", "s2", 4 * GiB, 1)
    assert info.value.level == "tenant"
    third = await svc.admit("a", "s2", 3 * GiB, 1)
    for r in (pd, other, third):
        await svc.release(r)


async def test_shrink_never_grows_a_reservation_and_repeating_it_changes_nothing(
    make: Factory, clock: ManualClock
) -> None:
    svc = await make(**limits(inflight_kv_bytes=10 * GiB))
    store: BudgetStore = svc._store
    r = await svc.admit(ANON, "s1", 4 * GiB, 10)
    grown = await svc.shrink(r, 6 * GiB)
    assert grown is not None and grown.kv_bytes == 4 * GiB
    # the store itself refuses to grow it (the service does not even ask)
    assert await store.shrink(ANON, "s1", r.id, clock(), 9 * GiB) == 4 * GiB
    assert await store.shrink(ANON, "s1", r.id, clock(), 3 * GiB) == 3 * GiB
    assert await store.shrink(ANON, "s1", r.id, clock(), 3 * GiB) == 3 * GiB  # a retried call
    assert await store.shrink(ANON, "s1", r.id, clock(), 5 * GiB) == 3 * GiB
    session, tenant = await svc.usage(ANON, "s1"), await svc.usage(ANON, None)
    assert session is not None and session.inflight_kv_bytes == 3 * GiB
    assert tenant is not None and tenant.inflight_kv_bytes == 3 * GiB
    await svc.release(r)


async def test_shrink_of_a_released_or_reaped_reservation_is_a_noop(
    make: Factory, clock: ManualClock
) -> None:
    svc = await make(**limits(inflight_kv_bytes=10 * GiB), lease_ttl_s=10, auto_renew=False)
    store: BudgetStore = svc._store
    released = await svc.admit(ANON, "s1", 2 * GiB, 1)
    await svc.release(released)
    assert await svc.shrink(released, GiB) is None
    assert await store.shrink(ANON, "s1", released.id, clock(), GiB) is None
    assert await store.shrink(ANON, "nobody", "nothing", clock(), 0) is None
    reaped = await svc.admit(ANON, "s2", 2 * GiB, 1)  # its lease runs out unrenewed
    clock.advance(11)
    assert await svc.shrink(reaped, GiB) is None
    for sid in ("s1", "s2", None):
        usage = await svc.usage(ANON, sid)
        assert usage is None or (usage.inflight_kv_bytes, usage.inflight_requests) == (0, 0)
    assert await svc.sessions() == []
    await svc.release(reaped)  # harmless


async def test_release_after_a_shrink_returns_session_and_tenant_to_zero(
    make: Factory, clock: ManualClock
) -> None:
    svc = await make(**tenant_limits({"inflight_kv_bytes": 10 * GiB},
                                     {"inflight_kv_bytes": 10 * GiB}))
    r = await svc.admit("a", "s1", 6 * GiB, 10)
    clock.advance(1)
    await svc.shrink(r, 2 * GiB)
    clock.advance(1)
    await svc.release(r)
    for sid in ("s1", None):
        usage = await svc.usage("a", sid)
        assert usage is not None  # its hold history is kept a while
        assert (usage.inflight_kv_bytes, usage.inflight_requests) == (0, 0)
    assert await svc.sessions(tenant="a") == []
    # the whole budget is free again
    await svc.release(await svc.admit("a", "s2", 10 * GiB, 1))


async def test_top_sessions_and_usage_report_the_shrunk_bytes(make: Factory) -> None:
    svc = await make()
    big = await svc.admit(ANON, "big", 8 * GiB, 1)
    mid = await svc.admit(ANON, "mid", 5 * GiB, 1)
    assert [u.session_id for u in await svc.sessions()] == ["big", "mid"]
    await svc.shrink(big, 3 * GiB)
    top = await svc.sessions()
    assert [(u.session_id, u.inflight_kv_bytes) for u in top] == [("mid", 5 * GiB),
                                                                  ("big", 3 * GiB)]
    tenants = await svc.tenants_usage()
    assert [(u.tenant, u.inflight_kv_bytes) for u in tenants] == [(ANON, 8 * GiB)]
    await svc.release(big)
    await svc.release(mid)


async def test_shrink_charges_the_bytes_shed_only_for_the_time_they_were_held(
    make: Factory, clock: ManualClock
) -> None:
    """Each side of a prefill/decode request pays byte-seconds while it holds the KV: the prompt's
    second copy until the pull, the rest until the release."""
    svc = await make(**limits(kv_byte_seconds=1000 * GiB), window_s=1_000_000, lease_ttl_s=1000)
    r = await svc.admit(ANON, "s1", 10 * GiB, 1)
    clock.advance(2)
    await svc.shrink(r, 4 * GiB)  # 6 GiB held 2 s: 12 GiB-s charged now
    clock.advance(3)  # the 4 GiB left have accrued 5 s: 20 GiB-s
    usage = await svc.usage(ANON, "s1")
    refill = 1000 / 1_000_000  # GiB-s per second
    assert usage is not None
    assert usage.kv_byte_seconds_available == pytest.approx((1000 - 12 - 20) * GiB, abs=GiB * refill * 6)
    await svc.release(r)
    usage = await svc.usage(ANON, "s1")
    assert usage is not None
    assert usage.kv_byte_seconds_available == pytest.approx((1000 - 12 - 20) * GiB, abs=GiB * refill * 6)
