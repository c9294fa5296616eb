"""``RedisBudgetStore``: tenant and session accounting shared by every gateway through one Redis.

Each operation is one ``EVALSHA`` of a script from ``gateway.budgets.lua`` (key layout and
invariants are documented there), so it is atomic across gateways: many gateways reserving for one
session (or one tenant) never exceed its budget, and a gateway that dies mid-request leaves leases
that the next script touching that session or tenant (or the top-K sweep) reaps. Every script's
keys are one tenant's, under its hash tag, and passed as ``KEYS``: one Cluster slot per tenant.
The top-K and throttled-list reads are a few plain commands and one script per session listed,
so they too touch one slot per call.

The client is built in ``start`` (no I/O in the constructor) over a blocking pool of at most
``max_connections`` (callers beyond it wait up to ``pool_timeout_s`` for a connection), with short
socket timeouts and one immediate retry: every script is idempotent (reserve is keyed by the reservation id), so a retry
after a lost reply cannot reserve twice. Connection errors, timeouts and a read-only replica become
``StoreUnavailableError``; the service applies the outage policy. After a Redis restart the
scripts are reloaded on their first ``NOSCRIPT``.

Redis Cluster (or Valkey cluster): a ``redis+cluster://`` (``rediss+cluster://``) URL names any one
node; redis-py's ``RedisCluster`` reads the slot map from it, sends each command to the primary of
its keys' slot and follows ``MOVED``/``ASK`` while slots migrate. The same limits hold: at most
``max_connections`` commands in flight (``_WaitingCluster``), the same timeouts; a cluster that is
down, a slot with no primary (during a failover) or ``TRYAGAIN`` (a migrating slot) is an outage
like a lost connection. The scripts load on each primary on their first ``NOSCRIPT`` there.

Cost: one round trip per operation (a top-K or throttled-list read: two, plus one per session it
sweeps or lists); the scripts run in O(reservations in flight of the session + log of the
tenant's).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ClusterError, ReadOnlyError, RedisClusterException, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.budgets import lua
from gateway.budgets.errors import StoreUnavailableError, rejection
from gateway.budgets.models import (
    BudgetLimits,
    Reservation,
    ReserveRequest,
    SessionUsage,
    Throttle,
    ThrottleState,
)
from gateway.budgets.store import MIN_STATE_TTL_S, SWEEP_LIMIT

_UNAVAILABLE = (RedisConnectionError, RedisTimeoutError, ReadOnlyError, OSError,
                # a cluster that is down, a slot no primary serves, a slot being migrated
                ClusterError, RedisClusterException, TryAgainError)
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
"""URL schemes of a Redis Cluster, and the plain scheme of its nodes."""


class _WaitingCluster(RedisCluster):
    """A ``RedisCluster`` whose callers beyond ``max_connections`` in flight wait for one to end
    (up to ``pool_timeout_s``), as with ``BlockingConnectionPool``: redis-py's cluster client
    raises ``MaxConnectionsError`` at once instead, and a burst of admissions would count as an
    outage. Every command, scripts included, goes through ``execute_command``."""

    def __init__(self, *args: Any, wait_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.in_flight = asyncio.Semaphore(kwargs["max_connections"])
        self.wait_s = wait_s

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        try:
            async with asyncio.timeout(self.wait_s):
                await self.in_flight.acquire()
        except TimeoutError:
            raise RedisConnectionError("no connection available") from None
        try:
            return await super().execute_command(*args, **kwargs)
        finally:
            self.in_flight.release()


def _opt(value: int | float | None) -> str:
    return "-1" if value is None else repr(value)


def _float_or_none(text: str) -> float | None:
    return None if text == "" else float(text)


def _limits(lim: BudgetLimits) -> tuple[str, ...]:
    return (_opt(lim.inflight_kv_bytes), _opt(lim.inflight_requests), _opt(lim.kv_byte_seconds),
            _opt(lim.requests_per_minute), _opt(lim.tokens_per_minute))


def _usage_from_row(tenant: str, row: Sequence[str]) -> SessionUsage:
    (sid, ib, cnt, bs, bs_c, rq, rq_c, tk, tk_c, ew, th, th_e, th_m, th_f, th_why, th_at) = row
    throttle = None
    if th:
        max_n = round(float(th_m))
        throttle = Throttle(
            state=ThrottleState(th),
            expires_at=float(th_e),
            reason=th_why,
            max_inflight_requests=None if max_n < 0 else max_n,
            budget_factor=float(th_f),
            set_at=float(th_at),
        )
    return SessionUsage(
        tenant=tenant,
        session_id=sid or None,
        inflight_kv_bytes=round(float(ib)),
        inflight_requests=round(float(cnt)),
        kv_byte_seconds_available=_float_or_none(bs),
        kv_byte_seconds_capacity=_float_or_none(bs_c),
        requests_available=_float_or_none(rq),
        requests_capacity=_float_or_none(rq_c),
        tokens_available=_float_or_none(tk),
        tokens_capacity=_float_or_none(tk_c),
        hold_ewma_s=_float_or_none(ew),
        throttle=throttle,
    )


class RedisBudgetStore:
    """The shared ``BudgetStore``; see the module docstring."""

    def __init__(
        self,
        url: str,
        *,
        key_prefix: str = "kvgate:budget",
        timeout_s: float = 1.0,
        max_connections: int = 64,
        pool_timeout_s: float = 2.0,
        name: str = "redis",
    ) -> None:
        self._url = url
        self._prefix = key_prefix
        self._timeout_s = timeout_s
        self._max_connections = max_connections
        self._pool_timeout_s = pool_timeout_s
        self._name = name
        self._client: aioredis.Redis | RedisCluster | None = None
        self._scripts: dict[str, Any] = {}

    @property
    def name(self) -> str:
        return self._name

    async def start(self) -> None:
        if self._client is not None:
            return
        client = self._connect()
        self._scripts = {
            "reserve": client.register_script(lua.RESERVE),
            "release": client.register_script(lua.RELEASE),
            "renew": client.register_script(lua.RENEW),
            "shrink": client.register_script(lua.SHRINK),
            "set_throttle": client.register_script(lua.SET_THROTTLE),
            "clear_throttle": client.register_script(lua.CLEAR_THROTTLE),
            "usage": client.register_script(lua.USAGE),
        }
        self._client = client

    async def close(self) -> None:
        client, self._client = self._client, None
        self._scripts = {}
        if client is not None:
            await client.aclose()

    def _connect(self) -> aioredis.Redis | RedisCluster:
        """The client of the URL (no I/O until its first command)."""
        common: dict[str, Any] = {
            "decode_responses": True,
            "socket_timeout": self._timeout_s,
            "socket_connect_timeout": self._timeout_s,
            "retry": Retry(NoBackoff(), 1),
        }
        scheme, _, rest = self._url.partition("://")
        if scheme in CLUSTER_SCHEMES:
            return _WaitingCluster.from_url(
                f"{CLUSTER_SCHEMES[scheme]}://{rest}", max_connections=self._max_connections,
                wait_s=self._pool_timeout_s, **common)
        # A blocking pool: a burst of admissions waits for a connection instead of failing
        # with "Too many connections", which would count as an outage.
        pool = aioredis.BlockingConnectionPool.from_url(
            self._url, max_connections=self._max_connections, timeout=self._pool_timeout_s,
            **common)
        return aioredis.Redis.from_pool(pool)

    def _require_client(self) -> aioredis.Redis | RedisCluster:
        if self._client is None:
            raise StoreUnavailableError("redis store not started")
        return self._client

    async def ping(self) -> None:
        client = self._require_client()
        try:
            await client.ping()
        except _UNAVAILABLE as exc:
            raise StoreUnavailableError(f"redis: {exc}") from exc

    # -- keys: one hash tag per tenant --------------------------------------------------------

    def _tag(self, tenant: str) -> str:
        return f"{self._prefix}:{{{tenant}}}"

    def _session_keys(self, tenant: str, session_id: str) -> list[str]:
        t = self._tag(tenant)
        return [f"{t}:s:{session_id}", f"{t}:r:{session_id}", f"{t}:top", f"{t}:leases",
                f"{t}:throttled"]

    def _tenant_keys(self, tenant: str) -> list[str]:
        t = self._tag(tenant)
        return [f"{t}:t", f"{t}:tr", f"{t}:tl"]

    def _keys(self, tenant: str, session_id: str | None) -> list[str]:
        """The keys of one account: a session's, or (``None``) the tenant's."""
        if session_id is None:
            return self._tenant_keys(tenant)
        return self._session_keys(tenant, session_id)

    async def _run(
        self, script: str, keys: list[str], now: float, *args: str | int | float
    ) -> Any:
        self._require_client()
        try:
            return await self._scripts[script](
                keys=keys, args=(repr(now), repr(MIN_STATE_TTL_S), *args))
        except _UNAVAILABLE as exc:
            raise StoreUnavailableError(f"redis: {exc}") from exc

    async def _command(self, name: str, *args: str | int | float, **kwargs: Any) -> Any:
        client = self._require_client()
        try:
            return await getattr(client, name)(*args, **kwargs)
        except _UNAVAILABLE as exc:
            raise StoreUnavailableError(f"redis: {exc}") from exc

    # -- operations ----------------------------------------------------------------------------

    async def reserve(self, request: ReserveRequest) -> Reservation:
        tenant, sid = request.tenant, request.session_id
        out = await self._run(
            "reserve",
            self._session_keys(tenant, sid) + self._tenant_keys(tenant),
            request.now,
            sid,
            request.reservation_id,
            repr(request.lease_ttl_s),
            request.kv_bytes,
            request.tokens,
            repr(request.window_s),
            *_limits(request.limits),
            *_limits(request.tenant_limits),
        )
        if int(out[0]) != 1:
            _, limit, wait, throttle, level = out
            raise rejection(limit, float(wait), throttle or None, level, tenant, sid)
        return Reservation(
            id=request.reservation_id,
            tenant=tenant,
            session_id=sid,
            kv_bytes=request.kv_bytes,
            tokens=request.tokens,
            started_at=request.now,
            lease_expires_at=float(out[1]),
            store=self._name,
        )

    async def release(
        self, tenant: str, session_id: str, reservation_id: str, now: float,
        actual_tokens: int | None,
    ) -> bool:
        out = await self._run(
            "release",
            self._session_keys(tenant, session_id) + self._tenant_keys(tenant),
            now,
            session_id,
            reservation_id,
            -1 if actual_tokens is None else actual_tokens,
        )
        return int(out) == 1

    async def renew(
        self, tenant: str, session_id: str, reservation_id: str, now: float, lease_ttl_s: float
    ) -> float | None:
        out = await self._run(
            "renew", self._session_keys(tenant, session_id) + self._tenant_keys(tenant), now,
            session_id, reservation_id, repr(lease_ttl_s))
        return None if out is None else float(out)

    async def shrink(
        self, tenant: str, session_id: str, reservation_id: str, now: float, kv_bytes: int
    ) -> int | None:
        out = await self._run(
            "shrink", self._session_keys(tenant, session_id) + self._tenant_keys(tenant), now,
            session_id, reservation_id, kv_bytes)
        return None if out is None else round(float(out))

    async def set_throttle(
        self, tenant: str, session_id: str | None, throttle: Throttle, now: float
    ) -> None:
        await self._run(
            "set_throttle",
            self._keys(tenant, session_id),
            now,
            session_id or "",
            throttle.state.value,
            repr(throttle.expires_at),
            _opt(throttle.max_inflight_requests),
            repr(throttle.budget_factor),
            throttle.reason,
            repr(throttle.set_at),
        )

    async def clear_throttle(self, tenant: str, session_id: str | None, now: float) -> bool:
        out = await self._run("clear_throttle", self._keys(tenant, session_id), now,
                              session_id or "")
        return int(out) == 1

    async def usage(
        self, tenant: str, session_id: str | None, now: float, *expired_leases: str
    ) -> SessionUsage | None:
        row = await self._run("usage", self._keys(tenant, session_id), now, session_id or "",
                              *expired_leases)
        return None if row is None else _usage_from_row(tenant, row)

    async def _sweep(self, tenant: str, now: float) -> None:
        """Open every session of ``tenant`` that the indexes show with an expired lease or
        throttle (at most ``SWEEP_LIMIT`` of each), dropping the expired lease members."""
        t = self._tag(tenant)
        leases = await self._command("zrangebyscore", f"{t}:leases", "-inf", repr(now),
                                     start=0, num=SWEEP_LIMIT)
        throttled = await self._command("zrangebyscore", f"{t}:throttled", "-inf", repr(now),
                                        start=0, num=SWEEP_LIMIT)
        expired: dict[str, list[str]] = {}
        for member in leases:
            expired.setdefault(member.partition(" ")[0], []).append(member)
        for sid in throttled:
            expired.setdefault(sid, [])
        for sid, members in expired.items():
            await self.usage(tenant, sid, now, *members)

    async def top(self, tenant: str, k: int, now: float) -> list[SessionUsage]:
        rows = await self._listed(tenant, now, "zrevrange", "top", k)
        return [u for u in rows if u.inflight_kv_bytes > 0]

    async def throttled(self, tenant: str, now: float, limit: int) -> list[SessionUsage]:
        rows = await self._listed(tenant, now, "zrange", "throttled", limit)
        return [u for u in rows if u.throttle is not None]

    async def _listed(self, tenant: str, now: float, command: str, index: str,
                      n: int) -> list[SessionUsage]:
        """After the sweep, the usage of the first ``n`` sessions of an index (``top`` by KV
        bytes, most first; ``throttled`` by expiry, soonest first), each opened on its own."""
        await self._sweep(tenant, now)
        if n <= 0:
            return []
        sids = await self._command(command, f"{self._tag(tenant)}:{index}", 0, n - 1)
        return [u for sid in sids if (u := await self.usage(tenant, sid, now)) is not None]
