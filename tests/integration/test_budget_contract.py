"""The budget store contract: every behaviour, run against the memory store, the memory store
shared by the processes of one gateway (``gateway.budgets.shared``, over its unix socket) and a
real Redis.

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


Factory = Callable[..., Any]


@pytest.fixture(params=["memory", "shared", "redis"])
def store_kind(request: pytest.FixtureRequest) -> str:
    kind: str = request.param
    if kind == "redis":
        request.getfixturevalue("redis_server")
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
    url = request.getfixturevalue("redis_server") if store_kind == "redis" else None
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
            "store": "redis" if store_kind == "redis" else "memory",
            "redis_url": url,
            "redis_key_prefix": prefix,
            "redis_timeout_s": 5.0,  # a loaded CI machine must not look like an outage
        }
        fields.update(overrides)
        settings = BudgetSettings.model_validate(fields)
        service = BudgetService(settings, clock=clock, store=store_for())
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
    r1 = await svc.admit("s1", None, 3 * GiB, 100)
    r2 = await svc.admit("s1", None, 2 * GiB, 100)
    usage = await svc.session("s1")
    assert usage is not None
    assert (usage.inflight_kv_bytes, usage.inflight_requests) == (5 * GiB, 2)
    await svc.release(r1)
    await svc.release(r2)
    usage = await svc.session("s1")
    assert usage is None or (usage.inflight_kv_bytes, usage.inflight_requests) == (0, 0)
    assert await svc.sessions() == []


async def test_release_called_twice_releases_once(make: Factory) -> None:
    svc = await make(**limits(inflight_kv_bytes=4 * GiB))
    r1 = await svc.admit("s1", None, 3 * GiB, 10)
    r2 = await svc.admit("s1", None, 1 * GiB, 10)
    await svc.release(r1)
    await svc.release(r1)
    usage = await svc.session("s1")
    assert usage is not None and usage.inflight_kv_bytes == 1 * GiB
    await svc.release(r2)
    await svc.release(r2)


async def test_store_release_of_unknown_reservation_is_a_noop(
    make: Factory, clock: ManualClock
) -> None:
    svc = await make()
    store: BudgetStore = svc._store
    r = await svc.admit("s1", None, GiB, 10)
    assert await store.release("s1", r.id, clock(), None) is True
    assert await store.release("s1", r.id, clock(), None) is False
    assert await store.release("nobody", "nothing", clock(), None) is False


async def test_reserve_is_idempotent_on_reservation_id(make: Factory, clock: ManualClock) -> None:
    svc = await make()
    store: BudgetStore = svc._store
    req = ReserveRequest(
        session_id="s1",
        reservation_id="r-1",
        key_name=None,
        kv_bytes=GiB,
        tokens=10,
        limits=BudgetLimits(inflight_kv_bytes=GiB, requests_per_minute=5),
        window_s=300,
        lease_ttl_s=30,
        now=clock(),
    )
    first = await store.reserve(req)
    again = await store.reserve(req)
    assert again.lease_expires_at == first.lease_expires_at
    usage = await store.usage("s1", clock())
    assert usage is not None and usage.inflight_requests == 1
    assert usage.requests_available == 4


async def test_inflight_bytes_over_budget_is_429_kv_budget_exceeded_with_retry_after(
    make: Factory, clock: ManualClock
) -> None:
    svc = await make(**limits(inflight_kv_bytes=4 * GiB))
    # history: requests of this session are held ~10 s
    warm = await svc.admit("s1", None, GiB, 1)
    clock.advance(10)
    await svc.release(warm)
    held = await svc.admit("s1", None, 3 * GiB, 1)
    clock.advance(4)
    with pytest.raises(KVBudgetExceededError) as info:
        await svc.admit("s1", None, 2 * GiB, 1)
    err = info.value
    assert (err.code, err.reason) == ("kv_budget_exceeded", "inflight_kv_bytes")
    assert err.retry_after_s == pytest.approx(6.0)  # started 4 s ago, typically held 10 s
    assert error_response(err, "/v1/chat/completions").headers["retry-after"] == "6"
    # a smaller one still fits
    small = await svc.admit("s1", None, 1 * GiB, 1)
    await svc.release(small)
    await svc.release(held)


async def test_request_that_can_never_fit_is_400_for_sessions_and_anonymous(
    make: Factory,
) -> None:
    svc = await make(**limits(request_kv_bytes=2 * GiB, inflight_kv_bytes=8 * GiB))
    for sid in ("s1", None):
        with pytest.raises(KVRequestTooLargeError) as info:
            await svc.admit(sid, None, 3 * GiB, 10)
        assert info.value.limit == "request_kv_bytes"
        assert info.value.retry_after_s is None
    svc2 = await make(**limits(inflight_kv_bytes=GiB, tokens_per_minute=1000))
    with pytest.raises(KVRequestTooLargeError) as info:
        await svc2.admit("s1", None, 2 * GiB, 10)
    assert info.value.limit == "inflight_kv_bytes"
    with pytest.raises(KVRequestTooLargeError) as info:
        await svc2.admit("s1", None, 1, 1001)
    assert info.value.limit == "tokens_per_minute"


async def test_anonymous_requests_only_get_the_per_request_check(make: Factory) -> None:
    svc = await make(**limits(inflight_kv_bytes=GiB, requests_per_minute=1))
    held = [await svc.admit(None, None, GiB, 10) for _ in range(5)]
    assert all(r.session_id is None for r in held)
    assert await svc.sessions() == []
    for r in held:
        await svc.release(r)


async def test_inflight_requests_limit_is_429_rate_limit_exceeded(make: Factory) -> None:
    svc = await make(**limits(inflight_requests=2))
    a = await svc.admit("s1", None, 1, 1)
    b = await svc.admit("s1", None, 1, 1)
    with pytest.raises(RateLimitExceededError) as info:
        await svc.admit("s1", None, 1, 1)
    assert info.value.reason == "inflight_requests"
    await svc.admit("s2", None, 1, 1)  # other sessions are unaffected
    await svc.release(a)
    c = await svc.admit("s1", None, 1, 1)
    for r in (b, c):
        await svc.release(r)


async def test_per_key_override_replaces_only_the_fields_it_sets(make: Factory) -> None:
    svc = await make(
        defaults={"inflight_kv_bytes": GiB, "inflight_requests": 1},
        per_key={"batch": {"inflight_kv_bytes": 4 * GiB}},
    )
    await svc.admit("s-batch", "batch", 3 * GiB, 1)
    with pytest.raises(RateLimitExceededError):
        await svc.admit("s-batch", "batch", 1, 1)
    with pytest.raises(KVRequestTooLargeError):
        await svc.admit("s-other", "other", 3 * GiB, 1)


# -- leases -----------------------------------------------------------------------------------


async def test_expired_lease_of_a_crashed_holder_is_reaped_on_next_reserve(
    make: Factory, clock: ManualClock
) -> None:
    crashed = await make(**limits(inflight_kv_bytes=4 * GiB), lease_ttl_s=30, auto_renew=False)
    await crashed.admit("s1", None, 4 * GiB, 1)  # its gateway dies: never released or renewed
    alive = await make(**limits(inflight_kv_bytes=4 * GiB), lease_ttl_s=30, auto_renew=False)
    with pytest.raises(KVBudgetExceededError):
        await alive.admit("s1", None, GiB, 1)
    clock.advance(29.9)
    with pytest.raises(KVBudgetExceededError):
        await alive.admit("s1", None, GiB, 1)
    clock.advance(0.2)
    r = await alive.admit("s1", None, 4 * GiB, 1)
    usage = await alive.session("s1")
    assert usage is not None and usage.inflight_kv_bytes == 4 * GiB
    await alive.release(r)


async def test_expired_leases_are_reaped_by_top_sessions_read(
    make: Factory, clock: ManualClock
) -> None:
    svc = await make(lease_ttl_s=10, auto_renew=False)
    for sid in ("a", "b", "c"):
        await svc.admit(sid, None, GiB, 1)
    assert len(await svc.sessions()) == 3
    clock.advance(11)
    assert await svc.sessions() == []
    assert await svc.session("a") is None


async def test_renew_keeps_a_lease_alive_and_a_reaped_lease_cannot_be_renewed(
    make: Factory, clock: ManualClock
) -> None:
    svc = await make(lease_ttl_s=10, auto_renew=False)
    r = await svc.admit("s1", None, GiB, 1)
    for _ in range(5):
        clock.advance(8)
        renewed = await svc.renew(r)
        assert renewed is not None and renewed.lease_expires_at == clock() + 10
    usage = await svc.session("s1")
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
    await svc.admit("s1", None, 10 * GiB, 1)
    clock.advance(20)
    usage = await svc.session("s1")
    # refilled to full while held; charged 10 GiB x 10 s at lease expiry, +10 s of refill since
    assert usage is not None and usage.inflight_requests == 0
    assert usage.kv_byte_seconds_available == pytest.approx((1000 - 100 + 10) * GiB)


# -- token buckets ----------------------------------------------------------------------------


async def test_byte_seconds_bucket_charges_at_release_and_refills_continuously(
    make: Factory, clock: ManualClock
) -> None:
    # capacity 100 GiB-s per 100 s window: refill 1 GiB-s per second
    svc = await make(**limits(kv_byte_seconds=100 * GiB), window_s=100)
    r = await svc.admit("s1", None, 10 * GiB, 1)
    clock.advance(12)  # holds 10 GiB for 12 s = 120 GiB-s: 20 GiB-s of debt
    await svc.release(r)
    usage = await svc.session("s1")
    assert usage is not None
    assert usage.kv_byte_seconds_available == pytest.approx(-20 * GiB)
    with pytest.raises(KVByteSecondsExceededError) as info:
        await svc.admit("s1", None, GiB, 1)
    assert info.value.code == "kv_byte_seconds_exceeded"
    assert info.value.retry_after_s == pytest.approx(20.0)
    clock.advance(19)
    with pytest.raises(KVByteSecondsExceededError):
        await svc.admit("s1", None, GiB, 1)
    clock.advance(1.5)
    await svc.release(await svc.admit("s1", None, GiB, 1))
    clock.advance(1000)
    usage = await svc.session("s1")
    assert usage is None or usage.kv_byte_seconds_available == pytest.approx(100 * GiB)


async def test_byte_seconds_debt_is_capped_at_one_window(make: Factory, clock: ManualClock) -> None:
    svc = await make(**limits(kv_byte_seconds=100 * GiB), window_s=100, lease_ttl_s=10_000)
    r = await svc.admit("s1", None, 100 * GiB, 1)
    clock.advance(50)  # 5000 GiB-s: capped at -100
    await svc.release(r)
    usage = await svc.session("s1")
    assert usage is not None and usage.kv_byte_seconds_available == pytest.approx(-100 * GiB)


async def test_byte_seconds_counts_what_requests_in_flight_have_accrued(
    make: Factory, clock: ManualClock
) -> None:
    svc = await make(**limits(kv_byte_seconds=100 * GiB), window_s=100, lease_ttl_s=1000)
    long = await svc.admit("s1", None, 10 * GiB, 1)
    clock.advance(9)  # accrued 90 of a full 100
    await svc.release(await svc.admit("s1", None, 0, 1))
    clock.advance(3)  # accrued 120 > 100 + 12
    with pytest.raises(KVByteSecondsExceededError):
        await svc.admit("s1", None, 0, 1)
    await svc.release(long)


async def test_requests_per_minute_refill_continuously(make: Factory, clock: ManualClock) -> None:
    svc = await make(**limits(requests_per_minute=3))
    for _ in range(3):
        await svc.release(await svc.admit("s1", None, 1, 1))
    with pytest.raises(RateLimitExceededError) as info:
        await svc.admit("s1", None, 1, 1)
    assert info.value.reason == "requests_per_minute"
    assert info.value.retry_after_s == pytest.approx(20.0)
    clock.advance(20.001)
    await svc.release(await svc.admit("s1", None, 1, 1))
    with pytest.raises(RateLimitExceededError):
        await svc.admit("s1", None, 1, 1)


async def test_tokens_per_minute_refund_unused_tokens_at_release(
    make: Factory, clock: ManualClock
) -> None:
    svc = await make(**limits(tokens_per_minute=1000))
    r = await svc.admit("s1", None, 1, 800)
    with pytest.raises(RateLimitExceededError) as info:
        await svc.admit("s1", None, 1, 300)
    assert info.value.reason == "tokens_per_minute"
    assert info.value.retry_after_s == pytest.approx(100 * 60 / 1000)
    await svc.release(r, actual_tokens=200)  # 600 of 800 come back
    await svc.release(await svc.admit("s1", None, 1, 750))


# -- throttles --------------------------------------------------------------------------------


async def test_throttled_session_gets_one_request_in_flight_until_expiry(
    make: Factory, clock: ManualClock
) -> None:
    svc = await make(**limits(inflight_requests=10))
    th = await svc.throttle("s1", "throttled", ttl_s=60, reason="alert KVHog")
    assert th.state is ThrottleState.THROTTLED and th.max_inflight_requests == 1
    a = await svc.admit("s1", None, 1, 1)
    clock.advance(5)
    with pytest.raises(SessionThrottledError) as info:
        await svc.admit("s1", None, 1, 1)
    err = info.value
    assert (err.code, err.reason, err.limit) == (
        "session_throttled",
        "throttled",
        "inflight_requests",
    )
    assert err.retry_after_s is not None and err.retry_after_s <= 55
    await svc.admit("s2", None, 1, 1)
    clock.advance(56)  # expired
    b = await svc.admit("s1", None, 1, 1)
    for r in (a, b):
        await svc.release(r)
    usage = await svc.session("s1")
    assert usage is None or usage.throttle is None


async def test_throttle_budget_factor_scales_the_inflight_budget(make: Factory) -> None:
    svc = await make(**limits(inflight_kv_bytes=8 * GiB))
    await svc.throttle(
        "s1", ThrottleState.THROTTLED, ttl_s=60, max_inflight_requests=None, budget_factor=0.25
    )
    await svc.admit("s1", None, 2 * GiB, 1)
    with pytest.raises(SessionThrottledError) as info:
        await svc.admit("s1", None, 1, 1)
    assert info.value.limit == "inflight_kv_bytes"
    # a request the reduced budget can never hold waits for the throttle to expire, not 400
    with pytest.raises(SessionThrottledError) as info:
        await svc.admit("s1", None, 4 * GiB, 1)
    assert info.value.retry_after_s == pytest.approx(60.0)


async def test_blocked_session_is_refused_until_unthrottled(
    make: Factory, clock: ManualClock
) -> None:
    svc = await make()
    await svc.throttle("s1", "blocked", expires_at=clock() + 300, reason="abuse")
    with pytest.raises(SessionThrottledError) as info:
        await svc.admit("s1", None, 1, 1)
    assert info.value.reason == "blocked"
    assert info.value.retry_after_s == pytest.approx(300.0)
    listed = await svc.throttled()
    assert [u.session_id for u in listed] == ["s1"]
    assert listed[0].throttle is not None and listed[0].throttle.reason == "abuse"
    assert await svc.unthrottle("s1") is True
    assert await svc.unthrottle("s1") is False
    await svc.release(await svc.admit("s1", None, 1, 1))
    assert await svc.throttled() == []


async def test_throttle_expires_on_its_own(make: Factory, clock: ManualClock) -> None:
    svc = await make()
    await svc.throttle("s1", "blocked", ttl_s=10)
    await svc.throttle("s2", "throttled", ttl_s=20)
    assert [u.session_id for u in await svc.throttled()] == ["s1", "s2"]
    clock.advance(10)
    assert [u.session_id for u in await svc.throttled()] == ["s2"]
    await svc.release(await svc.admit("s1", None, 1, 1))
    clock.advance(10)
    assert await svc.throttled() == []
    assert await svc.session("s2") is None


# -- top sessions -----------------------------------------------------------------------------


async def test_top_sessions_are_ordered_by_kv_in_flight(make: Factory) -> None:
    svc = await make(top_k=2)
    held = []
    for sid, gib in (("a", 1), ("b", 5), ("c", 3), ("d", 3)):
        held.append(await svc.admit(sid, None, gib * GiB, 1))
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
    r = await svc.admit("user 42/ü", None, GiB, 1)
    assert r.session_id is not None and " " not in r.session_id
    with pytest.raises(RateLimitExceededError):
        await svc.admit("user 42/ü", None, GiB, 1)
    assert [u.session_id for u in await svc.sessions()] == [r.session_id]


# -- concurrency ------------------------------------------------------------------------------


async def test_concurrent_reserves_of_one_session_never_exceed_its_budget(make: Factory) -> None:
    svc = await make(**limits(inflight_kv_bytes=10 * GiB))

    async def one() -> Any:
        try:
            return await svc.admit("hot", None, GiB, 1)
        except KVBudgetExceededError:
            return None

    results = await asyncio.gather(*(one() for _ in range(200)))
    won = [r for r in results if r is not None]
    assert len(won) == 10
    usage = await svc.session("hot")
    assert usage is not None and usage.inflight_kv_bytes == 10 * GiB
    await asyncio.gather(*(svc.release(r) for r in won), *(svc.release(r) for r in won))
    usage = await svc.session("hot")
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
                r = await svc.admit("hot", None, size, 1)
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
            usage = await svc.session("hot")
            assert usage is None or usage.inflight_kv_bytes <= 8 * GiB
            await asyncio.sleep(0.002)

    await asyncio.gather(*(worker(i) for i in range(24)), observer())
    assert admitted > 24
    assert peak <= 8 * GiB
    usage = await svc.session("hot")
    assert usage is None or (usage.inflight_kv_bytes, usage.inflight_requests) == (0, 0)
    assert await svc.sessions() == []


async def test_crashed_holders_leases_expire_while_others_keep_working(
    make: Factory, clock: ManualClock
) -> None:
    crashed = await make(**limits(inflight_kv_bytes=6 * GiB), lease_ttl_s=30, auto_renew=False)
    lost = await asyncio.gather(*(crashed.admit("hot", None, GiB, 1) for _ in range(4)))
    alive = await make(**limits(inflight_kv_bytes=6 * GiB), lease_ttl_s=30, auto_renew=False)
    mine = await asyncio.gather(*(alive.admit("hot", None, GiB, 1) for _ in range(2)))
    with pytest.raises(KVBudgetExceededError):
        await alive.admit("hot", None, GiB, 1)
    clock.advance(20)
    assert all([await alive.renew(r) for r in mine])
    clock.advance(15)  # the crashed holder's leases are gone, ours were renewed
    more = await asyncio.gather(*(alive.admit("hot", None, GiB, 1) for _ in range(4)))
    usage = await alive.session("hot")
    assert usage is not None and usage.inflight_requests == 6
    for r in [*mine, *more, *mine]:
        await alive.release(r)
    for r in lost:
        await crashed.release(r)  # a late release of a reaped lease is a no-op
    usage = await alive.session("hot")
    assert usage is None or usage.inflight_kv_bytes == 0
