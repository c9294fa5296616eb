"""``RedisBudgetStore``: session accounting shared by every gateway through one Redis.

Each operation is one ``EVALSHA`` of a script from ``gateway.budgets.lua`` (key layout and
invariants are documented there), so it is atomic across gateways: many gateways reserving for one
session never exceed its budget, and a gateway that dies mid-request leaves leases that the next
script touching that session (or the top-K sweep) reaps.

The client is built in ``start`` (no I/O in the constructor) over a blocking pool of at most
``max_connections`` (callers beyond it wait up to ``pool_timeout_s`` for a connection), with short
socket timeouts and one immediate retry: every script is idempotent (reserve is keyed by the reservation id), so a retry
after a lost reply cannot reserve twice. Connection errors, timeouts and a read-only replica become
``StoreUnavailableError``; the service applies the outage policy. After a Redis restart the
scripts are reloaded on their first ``NOSCRIPT``.

Cost: one round trip per operation; the scripts run in O(reservations in flight of the session).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.budgets import lua
from gateway.budgets.errors import StoreUnavailableError, rejection
from gateway.budgets.models import (
    Reservation,
    ReserveRequest,
    SessionUsage,
    Throttle,
    ThrottleState,
)
from gateway.budgets.store import MIN_STATE_TTL_S, SWEEP_LIMIT

_UNAVAILABLE = (RedisConnectionError, RedisTimeoutError, ReadOnlyError, OSError)


def _opt(value: int | float | None) -> str:
    return "-1" if value is None else repr(value)


def _float_or_none(text: str) -> float | None:
    return None if text == "" else float(text)


def _usage_from_row(row: Sequence[str]) -> SessionUsage:
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
        session_id=sid,
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
        self._client: aioredis.Redis | None = None
        self._scripts: dict[str, Any] = {}

    @property
    def name(self) -> str:
        return self._name

    async def start(self) -> None:
        if self._client is not None:
            return
        # A blocking pool: a burst of admissions waits for a connection instead of failing
        # with "Too many connections", which would count as an outage.
        pool = aioredis.BlockingConnectionPool.from_url(
            self._url,
            max_connections=self._max_connections,
            timeout=self._pool_timeout_s,
            decode_responses=True,
            socket_timeout=self._timeout_s,
            socket_connect_timeout=self._timeout_s,
            retry=Retry(NoBackoff(), 1),
        )
        client = aioredis.Redis.from_pool(pool)
        self._scripts = {
            "reserve": client.register_script(lua.RESERVE),
            "release": client.register_script(lua.RELEASE),
            "renew": client.register_script(lua.RENEW),
            "set_throttle": client.register_script(lua.SET_THROTTLE),
            "clear_throttle": client.register_script(lua.CLEAR_THROTTLE),
            "usage": client.register_script(lua.USAGE),
            "top": client.register_script(lua.TOP),
            "throttled": client.register_script(lua.THROTTLED_LIST),
        }
        self._client = client

    async def close(self) -> None:
        client, self._client = self._client, None
        self._scripts = {}
        if client is not None:
            await client.aclose()

    def _require_client(self) -> aioredis.Redis:
        if self._client is None:
            raise StoreUnavailableError("redis store not started")
        return self._client

    async def ping(self) -> None:
        client = self._require_client()
        try:
            await client.ping()
        except _UNAVAILABLE as exc:
            raise StoreUnavailableError(f"redis: {exc}") from exc

    async def _run(self, script: str, now: float, *args: str | int | float) -> Any:
        self._require_client()
        argv = (self._prefix, repr(now), repr(MIN_STATE_TTL_S), *args)
        try:
            return await self._scripts[script](keys=[], args=argv)
        except _UNAVAILABLE as exc:
            raise StoreUnavailableError(f"redis: {exc}") from exc

    async def reserve(self, request: ReserveRequest) -> Reservation:
        lim = request.limits
        out = await self._run(
            "reserve",
            request.now,
            request.session_id,
            request.reservation_id,
            repr(request.lease_ttl_s),
            request.kv_bytes,
            request.tokens,
            _opt(lim.inflight_kv_bytes),
            _opt(lim.inflight_requests),
            _opt(lim.kv_byte_seconds),
            repr(request.window_s),
            _opt(lim.requests_per_minute),
            _opt(lim.tokens_per_minute),
        )
        if int(out[0]) != 1:
            _, limit, wait, throttle = out
            raise rejection(limit, float(wait), throttle or None, request.session_id)
        return Reservation(
            id=request.reservation_id,
            session_id=request.session_id,
            key_name=request.key_name,
            kv_bytes=request.kv_bytes,
            tokens=request.tokens,
            started_at=request.now,
            lease_expires_at=float(out[1]),
            store=self._name,
        )

    async def release(
        self, session_id: str, reservation_id: str, now: float, actual_tokens: int | None
    ) -> bool:
        out = await self._run(
            "release",
            now,
            session_id,
            reservation_id,
            -1 if actual_tokens is None else actual_tokens,
        )
        return int(out) == 1

    async def renew(
        self, session_id: str, reservation_id: str, now: float, lease_ttl_s: float
    ) -> float | None:
        out = await self._run("renew", now, session_id, reservation_id, repr(lease_ttl_s))
        return None if out is None else float(out)

    async def set_throttle(self, session_id: str, throttle: Throttle, now: float) -> None:
        await self._run(
            "set_throttle",
            now,
            session_id,
            throttle.state.value,
            repr(throttle.expires_at),
            _opt(throttle.max_inflight_requests),
            repr(throttle.budget_factor),
            throttle.reason,
            repr(throttle.set_at),
        )

    async def clear_throttle(self, session_id: str, now: float) -> bool:
        return int(await self._run("clear_throttle", now, session_id)) == 1

    async def usage(self, session_id: str, now: float) -> SessionUsage | None:
        row = await self._run("usage", now, session_id)
        return None if row is None else _usage_from_row(row)

    async def top(self, k: int, now: float) -> list[SessionUsage]:
        rows = await self._run("top", now, k, SWEEP_LIMIT)
        return [_usage_from_row(r) for r in rows]

    async def throttled(self, now: float, limit: int) -> list[SessionUsage]:
        rows = await self._run("throttled", now, limit)
        return [_usage_from_row(r) for r in rows]
