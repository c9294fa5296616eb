"""Redis-only budget behaviour: gateways sharing one Redis, the key layout, and outages."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import pytest
import redis.asyncio as aioredis
from redis.crc import key_slot

from gateway.budgets import (
    BudgetError,
    BudgetService,
    BudgetUnavailableError,
    KVBudgetExceededError,
)
from gateway.budgets.session_id import ANONYMOUS_TENANT
from gateway.config import BudgetSettings
from gateway.errors import from_domain
from tests.clock import T0, ManualClock
from tests.harness import eventually

if TYPE_CHECKING:
    from tests.integration.redis_fixture import RedisServer

pytest_plugins = ["tests.integration.redis_fixture"]
pytestmark = pytest.mark.asyncio(loop_scope="session")

GiB = 1 << 30
ANON = ANONYMOUS_TENANT


Factory = Callable[..., Any]


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def prefix() -> str:
    return f"test:{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def make(clock: ManualClock, prefix: str) -> AsyncIterator[Factory]:
    services: list[BudgetService] = []

    async def factory(url: str, **overrides: Any) -> BudgetService:
        fields: dict[str, Any] = {
            "store": "redis",
            "redis_url": url,
            "redis_key_prefix": prefix,
            "redis_timeout_s": 2.0,
            "probe_initial_s": 0.05,
            "probe_max_s": 0.2,
        }
        fields.update(overrides)
        service = BudgetService(BudgetSettings.model_validate(fields), clock=clock)
        await service.start()
        services.append(service)
        return service

    yield factory
    for service in services:
        await service.close()



# -- gateways sharing one Redis ---------------------------------------------------------------


async def test_two_services_sharing_one_redis_enforce_one_budget(
    make: Factory, redis_server: str
) -> None:
    defaults = {"defaults": {"inflight_kv_bytes": 4 * GiB}}
    a = await make(redis_server, **defaults)
    b = await make(redis_server, **defaults)
    ra = await a.admit(ANON, "s1", 3 * GiB, 1)
    rb = await b.admit(ANON, "s1", 1 * GiB, 1)
    for svc in (a, b):
        with pytest.raises(KVBudgetExceededError):
            await svc.admit(ANON, "s1", 1, 1)
    await a.release(ra)
    rb2 = await b.admit(ANON, "s1", 3 * GiB, 1)

    async def one(svc: BudgetService) -> Any:
        try:
            return await svc.admit(ANON, "s2", GiB, 1)
        except KVBudgetExceededError:
            return None

    results = await asyncio.gather(*(one(a if i % 2 else b) for i in range(100)))
    won = [r for r in results if r is not None]
    assert len(won) == 4
    usage = await a.usage(ANON, "s2")
    assert usage is not None and usage.inflight_kv_bytes == 4 * GiB
    for r in won:
        await (a if r.id in a._held else b).release(r)
    for r in (rb, rb2):
        await b.release(r)
    assert await a.sessions() == [] and await b.sessions() == []


async def test_throttle_set_through_one_gateway_applies_to_all(
    make: Factory, redis_server: str
) -> None:
    a = await make(redis_server)
    b = await make(redis_server)
    await a.throttle(ANON, "s1", "blocked", ttl_s=60, reason="alert")
    with pytest.raises(BudgetError) as info:
        await b.admit(ANON, "s1", 1, 1)
    assert info.value.code == "session_throttled"
    assert await b.unthrottle(ANON, "s1") is True
    await b.release(await b.admit(ANON, "s1", 1, 1))


# -- key layout -------------------------------------------------------------------------------


async def test_idle_sessions_leave_no_keys_and_busy_ones_expire(
    make: Factory, redis_server: str, prefix: str, clock: ManualClock
) -> None:
    svc = await make(redis_server, defaults={"requests_per_minute": 60})
    client = aioredis.Redis.from_url(redis_server, decode_responses=True)
    tag = f"{prefix}:{{{ANON}}}"
    try:
        r = await svc.admit(ANON, "s1", GiB, 1)
        keys = sorted([k async for k in client.scan_iter(match=f"{prefix}:*")])
        assert keys == [f"{tag}:{k}" for k in ("leases", "r:s1", "s:s1", "t", "tl", "top", "tr")]
        # one tenant, one hash tag: one Redis Cluster slot for everything a script touches
        assert len({key_slot(k.encode()) for k in keys}) == 1
        assert 0 < await client.ttl(f"{tag}:s:s1") <= 30 + 60 + 1
        assert await client.zscore(f"{tag}:top", "s1") == GiB
        clock.advance(2)
        await svc.release(r)
        keys = sorted([k async for k in client.scan_iter(match=f"{prefix}:*")])
        # the hold EWMA of the session and the tenant (and 1 request to refill)
        assert keys == [f"{tag}:s:s1", f"{tag}:t"]
        assert 0 < await client.ttl(f"{tag}:s:s1") <= 61
        clock.advance(61)
        assert await svc.usage(ANON, "s1") is None
        assert await svc.usage(ANON, None) is None
        assert [k async for k in client.scan_iter(match=f"{prefix}:*")] == []
    finally:
        await client.aclose()


# -- outages ----------------------------------------------------------------------------------


async def test_fail_closed_rejects_with_503_while_redis_is_down_and_recovers(
    make: Factory, redis_control: RedisServer
) -> None:
    svc = await make(redis_control.url, outage_policy="fail_closed")
    held = await svc.admit(ANON, "s1", GiB, 1)
    redis_control.kill()
    with pytest.raises(BudgetUnavailableError) as info:
        await svc.admit(ANON, "s1", GiB, 1)
    err = info.value
    assert (err.code, err.reason) == ("budget_store_unavailable", "store_unavailable")
    mapped = from_domain(err)
    assert mapped is not None and mapped.status == 503
    assert svc.degraded
    await svc.release(held)  # never raises
    with pytest.raises(BudgetUnavailableError):
        await svc.throttle(ANON, "s1", "blocked", ttl_s=60)
    with pytest.raises(BudgetUnavailableError):
        await svc.sessions()
    assert svc.stats().unavailable_rejections == 1
    redis_control.start()
    await eventually(lambda: not svc.degraded)
    r = await svc.admit(ANON, "s1", GiB, 1)
    assert r.store == "redis"
    await svc.release(r)
    assert svc.stats().store_failures == 1


async def test_fail_open_enforces_budgets_locally_while_redis_is_down_and_switches_back(
    make: Factory, redis_control: RedisServer
) -> None:
    svc = await make(
        redis_control.url, outage_policy="fail_open", defaults={"inflight_kv_bytes": 2 * GiB}
    )
    before = await svc.admit(ANON, "s1", GiB, 1)
    redis_control.kill()
    local = [await svc.admit(ANON, "s1", GiB, 1) for _ in range(2)]
    assert [r.store for r in local] == ["fallback", "fallback"]
    with pytest.raises(KVBudgetExceededError):
        await svc.admit(ANON, "s1", GiB, 1)
    assert svc.degraded and svc.stats().fallback_admissions == 3
    top = await svc.sessions()  # reads come from the fallback while degraded
    assert [(u.session_id, u.inflight_kv_bytes) for u in top] == [("s1", 2 * GiB)]
    await svc.release(before)
    redis_control.start()
    await eventually(lambda: not svc.degraded)
    back = await svc.admit(ANON, "s1", 2 * GiB, 1)  # the restarted Redis is empty
    assert back.store == "redis"
    for r in [*local, back]:
        await svc.release(r)
    fallback = await svc._fallback.usage(ANON, "s1", svc._clock())
    assert fallback is None or fallback.inflight_requests == 0
    assert await svc.sessions() == []


async def test_service_started_while_redis_is_down_starts_degraded_and_recovers(
    make: Factory, redis_control: RedisServer
) -> None:
    redis_control.kill()
    svc = await make(redis_control.url, outage_policy="fail_closed")
    assert svc.degraded
    with pytest.raises(BudgetUnavailableError):
        await svc.admit(ANON, "s1", 1, 1)
    redis_control.start()
    await eventually(lambda: not svc.degraded)
    await svc.release(await svc.admit(ANON, "s1", 1, 1))


@pytest.mark.parametrize("policy", ["fail_open", "fail_closed"])
async def test_redis_killed_mid_run_keeps_budgets_and_recovers(
    make: Factory, redis_control: RedisServer, policy: str
) -> None:
    """Concurrent traffic while Redis dies and returns: only the policy's errors, budget kept."""
    budget = 6 * GiB
    svc = await make(
        redis_control.url, outage_policy=policy, defaults={"inflight_kv_bytes": budget}
    )
    errors: dict[str, int] = {}
    stores: set[str] = set()
    current: dict[str, int] = {}
    peak: dict[str, int] = {}
    stop = asyncio.Event()

    async def worker() -> None:
        while not stop.is_set():
            try:
                r = await svc.admit(ANON, "hot", GiB, 1)
            except BudgetError as exc:
                errors[exc.code] = errors.get(exc.code, 0) + 1
                await asyncio.sleep(0.002)
                continue
            stores.add(r.store)
            current[r.store] = current.get(r.store, 0) + 1
            peak[r.store] = max(peak.get(r.store, 0), current[r.store])
            await asyncio.sleep(0.005)
            current[r.store] -= 1
            await svc.release(r)

    tasks = [asyncio.create_task(worker()) for _ in range(12)]
    # Each phase lasts until the traffic has shown it (not a fixed time: a stalled machine
    # would let a phase pass unseen).
    await eventually(lambda: "redis" in stores and errors.get("kv_budget_exceeded", 0) > 0)
    redis_control.kill()
    if policy == "fail_open":
        await eventually(lambda: "fallback" in stores)
    else:
        await eventually(lambda: errors.get("budget_store_unavailable", 0) > 0)
    redis_control.start()
    await eventually(lambda: not svc.degraded)
    stop.set()
    await asyncio.gather(*tasks)

    assert errors.get("kv_budget_exceeded", 0) > 0
    if policy == "fail_open":
        assert set(errors) <= {"kv_budget_exceeded"}
        assert {"redis", "fallback"} <= stores
    else:
        assert errors.get("budget_store_unavailable", 0) > 0
        assert set(errors) <= {"kv_budget_exceeded", "budget_store_unavailable"}
        assert stores == {"redis"}
    # each store enforced the budget on its own
    assert all(n <= budget // GiB for n in peak.values()), peak
    assert svc.stats().store_failures >= 1
    assert await svc.sessions() == []
    fallback = await svc._fallback.usage(ANON, "hot", svc._clock())
    assert fallback is None or fallback.inflight_requests == 0


# -- parity -----------------------------------------------------------------------------------


def _outcome(value: Any) -> Any:
    """A comparable form of a store result or error (floats rounded: Lua and Python sum in
    different orders)."""
    if isinstance(value, BudgetError):
        retry = None if value.retry_after_s is None else round(value.retry_after_s, 3)
        return ("error", value.code, value.reason, value.limit, retry)
    if isinstance(value, float):
        return round(value, 3)
    if isinstance(value, list):
        return [_outcome(v) for v in value]
    if hasattr(value, "__dataclass_fields__"):
        return tuple(
            (name, _outcome(getattr(value, name)))
            for name in value.__dataclass_fields__
            if name != "store"
        )
    return value


@pytest.mark.parametrize("seed", [4, 7, 16])
async def test_memory_and_redis_stores_agree_on_a_random_workload(
    redis_server: str, prefix: str, seed: int
) -> None:
    """The Lua scripts mirror the memory store: same answers, step by step; and so does the
    memory store the processes of one gateway share, through its socket (``budgets.shared``).

    Shrinks (partial releases, ``BudgetStore.shrink``) are in the mix: their charge and the
    tenant's running sums must match too.

    Regressions it caught: a full bucket and no bucket were different states (so deleting a
    fresh session changed later answers when the limits changed), and reads extended a
    session's expiry in one store but not the other. Two tenants share session ids, so the
    tenant level (its running sums, lease index, throttles) is compared too.
    """
    import random
    import tempfile
    from pathlib import Path

    from gateway.budgets.memory import MemoryBudgetStore
    from gateway.budgets.models import BudgetLimits, ReserveRequest, Throttle, ThrottleState
    from gateway.budgets.redis_store import RedisBudgetStore
    from gateway.budgets.shared import SharedBudgetServer, SharedBudgetStore, socket_path

    memory = MemoryBudgetStore()
    redis_store = RedisBudgetStore(redis_server, key_prefix=prefix, timeout_s=5.0)
    await redis_store.start()
    scratch = tempfile.TemporaryDirectory(prefix="kvgate-parity-")
    runtime_dir = Path(scratch.name)
    server = SharedBudgetServer(MemoryBudgetStore(), socket_path(runtime_dir))
    await server.start()
    shared = SharedBudgetStore(socket_path(runtime_dir))
    await shared.start()
    stores = (memory, redis_store, shared)
    rng = random.Random(seed)
    now = T0
    limits = [
        BudgetLimits(
            inflight_kv_bytes=8 * GiB,
            inflight_requests=4,
            kv_byte_seconds=400 * GiB,
            requests_per_minute=30,
            tokens_per_minute=20_000,
        ),
        BudgetLimits(inflight_kv_bytes=16 * GiB, kv_byte_seconds=200 * GiB),
    ]
    tenant_limits = [
        BudgetLimits(inflight_kv_bytes=12 * GiB, inflight_requests=6, requests_per_minute=50,
                     kv_byte_seconds=600 * GiB, tokens_per_minute=30_000),
        BudgetLimits(),
    ]
    held: list[tuple[str, str, str]] = []
    try:
        for step in range(600):
            op = rng.random()
            tenant = rng.choice(["a", "b"])
            sid = f"s{rng.randrange(4)}"
            scope = rng.choice([sid, sid, None])  # a session, or the whole tenant
            calls: list[Any] = []
            if op < 0.4:
                req = ReserveRequest(
                    tenant=tenant,
                    session_id=sid,
                    reservation_id=f"r{step}",
                    kv_bytes=rng.randrange(0, 5) * GiB // 2,
                    tokens=rng.randrange(1, 4000),
                    limits=rng.choice(limits),
                    tenant_limits=rng.choice(tenant_limits),
                    window_s=100.0,
                    lease_ttl_s=20.0,
                    now=now,
                )
                calls = [store.reserve(req) for store in stores]
                held.append((tenant, sid, req.reservation_id))
            elif op < 0.65 and held:
                htenant, hsid, rid = rng.choice(held)
                actual = rng.choice([None, rng.randrange(0, 4000)])
                calls = [s.release(htenant, hsid, rid, now, actual) for s in stores]
            elif op < 0.72 and held:
                htenant, hsid, rid = rng.choice(held)
                calls = [s.renew(htenant, hsid, rid, now, 20.0) for s in stores]
            elif op < 0.75 and held:
                htenant, hsid, rid = rng.choice(held)
                to = rng.randrange(0, 5) * GiB // 4  # at times more than it holds: no change
                calls = [s.shrink(htenant, hsid, rid, now, to) for s in stores]
            elif op < 0.77:
                th = Throttle(
                    state=rng.choice(list(ThrottleState)),
                    expires_at=now + rng.uniform(1, 60),
                    reason="random",
                    max_inflight_requests=rng.choice([None, 1, 2]),
                    budget_factor=rng.choice([0.5, 1.0]),
                    set_at=now,
                )
                calls = [s.set_throttle(tenant, scope, th, now) for s in stores]
            elif op < 0.78:
                calls = [s.clear_throttle(tenant, scope, now) for s in stores]
            elif op < 0.86:
                calls = [s.usage(tenant, scope, now) for s in stores]
            elif op < 0.92:
                calls = [s.top(tenant, 3, now) for s in stores]
            elif op < 0.94:
                calls = [s.throttled(tenant, now, 10) for s in stores]
            else:
                now += rng.choice([0.5, 3.0, 15.0, 45.0])
                continue
            results = []
            for call in calls:
                try:
                    results.append(_outcome(await call))
                except BudgetError as exc:
                    results.append(_outcome(exc))
            assert results[0] == results[1] == results[2], (
                f"step {step}: memory {results[0]}, redis {results[1]}, shared {results[2]}"
            )
            now += rng.choice([0.0, 0.1, 1.0])
    finally:
        await redis_store.close()
        await shared.close()
        await server.close()
        scratch.cleanup()
