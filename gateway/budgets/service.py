"""``BudgetService``: the facade the request path, admin routes and alert webhook call.

Steps of ``admit(tenant, session_id, request_kv_bytes, tokens)``:

1. sanitize the session id (``sanitize_session_id``; no id: the tenant's ``DEFAULT_SESSION``,
   so no request is charged to nothing) and resolve the tenant's limits (its API key's);
2. per-request check, pure and without I/O: a request that could never fit (over
   ``request_kv_bytes``, or alone over the session's or the tenant's in-flight budget, or over
   tokens per minute ...) is refused with 400 ``kv_request_too_large``;
3. the store reserves atomically against the session's limits and the tenant's (the sum over
   all its sessions), or raises the matching 429;
4. the reservation is remembered locally, so a background task renews its lease every
   ``lease_ttl_s / 3`` while the request runs, and ``release`` is idempotent without I/O.

Outage policy (Redis store only): when a Redis call fails the service marks the store degraded,
logs once, and starts a probe task that pings with exponential backoff (``probe_initial_s`` ..
``probe_max_s``). While degraded, ``fail_open`` admits against a local ``MemoryBudgetStore``
(named ``fallback``: each gateway enforces the budget alone, so a session may get up to N gateways
x its budget, and Redis throttles are not seen) and ``fail_closed`` raises 503
``budget_store_unavailable``. When the probe succeeds admissions go back to Redis; reservations made
in the fallback are released there. Releases and renewals never raise: a release Redis missed is
reaped when its lease expires. Admin writes (throttle, unthrottle) raise 503 while Redis is down
under either policy, so an operator's action is never silently lost; admin reads fall back under
``fail_open``.

Reads over every tenant (the top sessions, the throttled list, the tenants' usage) ask the store
once per tenant the gateway knows (its API keys' names, or ``anonymous``): a bounded set, and each
call stays within one tenant's keys (one Redis Cluster slot).

``shrink(reservation, kv_bytes)`` is a partial release, for a request whose KV shrinks while it
runs (a prefill/decode request, once the decode worker has pulled the prompt's KV from the
prefill worker: ``gateway.upstream.disagg``); like ``release`` it never raises for an outage.

Cost on top of the store: a reservation id (``ReservationIds``) and a dict insert per admission; renewals are batched per
``lease_ttl_s / 3`` tick (one store call per request in flight per tick).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from gateway.budgets.errors import (
    BudgetError,
    BudgetUnavailableError,
    StoreUnavailableError,
    describe_limit,
    too_large,
    unavailable,
    who,
)
from gateway.budgets.memory import MemoryBudgetStore
from gateway.budgets.models import (
    Clock,
    Limits,
    Reservation,
    ReserveRequest,
    SessionUsage,
    Throttle,
    ThrottleState,
    limits_for,
    rotation_gaps,
)
from gateway.budgets.session_id import ANONYMOUS_TENANT, DEFAULT_SESSION, sanitize_session_id
from gateway.budgets.store import SWEEP_LIMIT, BudgetStore
from gateway.config import BudgetSettings
from gateway.kvmath import format_bytes
from gateway.tasks import cancel_and_wait

log = logging.getLogger("gateway.budgets")

T = TypeVar("T")

MAX_REASON_LEN = 256
"""Longest throttle reason kept (an alert may send a whole description)."""


class ReservationIds:
    """Reservation ids unique over every process and replica that shares a store: 16 random hex
    digits drawn once per ``BudgetService`` (a process), then a counter. A ``uuid4`` per
    admission read ``os.urandom`` each time: 2 % of a short request's CPU in the profile."""

    __slots__ = ("_count", "_prefix")

    def __init__(self) -> None:
        self._prefix = secrets.token_hex(8)
        self._count = itertools.count()

    def next(self) -> str:
        return f"{self._prefix}{next(self._count):x}"


@dataclass(frozen=True)
class BudgetStats:
    """Counters for the gateway's metrics (read them on scrape)."""

    store: str
    degraded: bool
    store_failures: int
    """Transitions from healthy to degraded."""
    store_errors: int
    """Failed store calls, including those while degraded."""
    fallback_admissions: int
    """Admissions decided by the local fallback store under ``fail_open``."""
    unavailable_rejections: int
    """Admissions refused with 503 under ``fail_closed``."""
    leases_lost: int
    """Renewals that found the reservation already reaped."""
    inflight_local: int
    """Reservations this gateway holds now."""


_BYTE_LIMITS = ("inflight_kv_bytes", "kv_byte_seconds")


class BudgetService:
    """Admission, release, throttles and reads over one ``BudgetStore``; see the module doc."""

    def __init__(
        self,
        settings: BudgetSettings,
        *,
        clock: Clock = time.time,
        store: BudgetStore | None = None,
        tenants: Sequence[str] = (ANONYMOUS_TENANT,),
    ) -> None:
        self._settings = settings
        self._tenants = tuple(tenants)
        self._clock = clock
        self._store: BudgetStore = store if store is not None else self._build_store(settings)
        self._fallback = MemoryBudgetStore(name="fallback")
        self._degraded = False
        self._probe_task: asyncio.Task[None] | None = None
        self._renew_task: asyncio.Task[None] | None = None
        self._held: dict[str, Reservation] = {}
        self._ids = ReservationIds()
        self._limits: dict[str, Limits] = {}
        self._started = False
        self._store_failures = 0
        self._store_errors = 0
        self._fallback_admissions = 0
        self._unavailable_rejections = 0
        self._leases_lost = 0

    @staticmethod
    def _build_store(settings: BudgetSettings) -> BudgetStore:
        if settings.store == "redis":
            from gateway.budgets.redis_store import RedisBudgetStore

            assert settings.redis_url is not None  # the settings validator guarantees it
            return RedisBudgetStore(
                settings.redis_url,
                key_prefix=settings.redis_key_prefix,
                timeout_s=settings.redis_timeout_s,
                max_connections=settings.redis_max_connections,
                pool_timeout_s=settings.redis_pool_timeout_s,
            )
        return MemoryBudgetStore(name="memory")

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect the store and start the lease renewer; an unreachable Redis does not fail
        the start: the service starts degraded and probes until Redis answers."""
        if self._started:
            return
        self._started = True
        gaps = rotation_gaps(self._settings)
        if gaps:
            log.warning("session limits without a tenant limit on the same field (%s): a client "
                        "can multiply them by rotating session ids; set budgets.defaults.tenant "
                        "(or per_key.<key>.tenant)", ", ".join(gaps))
        try:
            await self._store.start()
            await self._store.ping()
        except StoreUnavailableError as exc:
            self._on_store_error(exc)
        if self._settings.auto_renew:
            self._renew_task = asyncio.create_task(self._renew_loop(), name="budget-renew")

    async def close(self) -> None:
        """Stop background tasks and close the store; held reservations are left to expire."""
        await cancel_and_wait(t for t in (self._renew_task, self._probe_task) if t is not None)
        self._renew_task = self._probe_task = None
        await self._store.close()
        self._started = False

    @property
    def degraded(self) -> bool:
        """True while the shared store is unreachable."""
        return self._degraded

    def stats(self) -> BudgetStats:
        return BudgetStats(
            store=self._store.name,
            degraded=self._degraded,
            store_failures=self._store_failures,
            store_errors=self._store_errors,
            fallback_admissions=self._fallback_admissions,
            unavailable_rejections=self._unavailable_rejections,
            leases_lost=self._leases_lost,
            inflight_local=len(self._held),
        )

    # -- outage handling -------------------------------------------------------------------

    def _on_store_error(self, exc: BaseException) -> None:
        self._store_errors += 1
        if not self._degraded:
            self._degraded = True
            self._store_failures += 1
            log.warning(
                "budget store %s unavailable (%s); policy %s",
                self._store.name,
                exc,
                self._settings.outage_policy,
            )
        if self._started and (self._probe_task is None or self._probe_task.done()):
            self._probe_task = asyncio.create_task(self._probe_loop(), name="budget-probe")

    async def _probe_loop(self) -> None:
        delay = self._settings.probe_initial_s
        while self._degraded:
            await asyncio.sleep(delay)
            try:
                await self._store.start()
                await self._store.ping()
            except StoreUnavailableError:
                delay = min(delay * 2, self._settings.probe_max_s)
                continue
            self._degraded = False
            log.warning("budget store %s reachable again", self._store.name)

    async def _call(self, op: Callable[[BudgetStore], Awaitable[T]]) -> T:
        """Run ``op`` on the shared store; raise ``BudgetUnavailableError`` if it is down."""
        if self._degraded:
            raise unavailable(f"{self._store.name} unreachable")
        try:
            return await op(self._store)
        except StoreUnavailableError as exc:
            self._on_store_error(exc)
            raise unavailable(str(exc)) from exc

    async def _read(self, op: Callable[[BudgetStore], Awaitable[T]]) -> T:
        """A read: from the fallback store while degraded under ``fail_open``."""
        try:
            return await self._call(op)
        except BudgetUnavailableError:
            if self._settings.outage_policy == "fail_open":
                return await op(self._fallback)
            raise

    def _store_named(self, name: str) -> BudgetStore | None:
        if name == self._store.name:
            return self._store
        if name == self._fallback.name:
            return self._fallback
        return None

    @property
    def tenants(self) -> tuple[str, ...]:
        """The tenants this gateway serves: its API keys' names, or ``anonymous``."""
        return self._tenants

    # -- admission -------------------------------------------------------------------------

    def limits_for(self, tenant: str) -> Limits:
        """The session and tenant limits of a tenant (defaults when its key has no override)."""
        limits = self._limits.get(tenant)
        if limits is None:
            limits = limits_for(self._settings, tenant)
            self._limits[tenant] = limits
        return limits

    def check_request(self, tenant: str, request_kv_bytes: int, tokens: int) -> None:
        """Raise 400 ``kv_request_too_large`` if the request could never be admitted."""
        if request_kv_bytes < 0 or tokens < 0:
            raise ValueError("request_kv_bytes and tokens must be >= 0")
        never = self.limits_for(tenant).never_fits(request_kv_bytes, tokens)
        if never is not None:
            level, limit, value = never
            raise too_large(level, limit, request_kv_bytes, tokens, value)

    async def admit(
        self,
        tenant: str,
        session_id: str | None,
        request_kv_bytes: int,
        tokens: int,
    ) -> Reservation:
        """Reserve ``request_kv_bytes`` of KV and ``tokens`` for the session of ``tenant`` (no
        id: its ``DEFAULT_SESSION``), or raise a ``BudgetError`` (400 / 429 / 503). ``tokens``
        is prompt + max output tokens."""
        sid = sanitize_session_id(session_id) or DEFAULT_SESSION
        self.check_request(tenant, request_kv_bytes, tokens)
        limits = self._limits[tenant]  # check_request looked them up
        request = ReserveRequest(
            tenant=tenant,
            session_id=sid,
            reservation_id=self._ids.next(),
            kv_bytes=request_kv_bytes,
            tokens=tokens,
            limits=limits.session,
            tenant_limits=limits.tenant,
            window_s=self._settings.window_s,
            lease_ttl_s=self._settings.lease_ttl_s,
            now=self._clock(),
        )
        try:
            # ``_call`` inlined (no closure and no coroutine more per request)
            if self._degraded:
                raise unavailable(f"{self._store.name} unreachable")
            try:
                reservation = await self._store.reserve(request)
            except StoreUnavailableError as exc:
                self._on_store_error(exc)
                raise unavailable(str(exc)) from exc
        except BudgetUnavailableError:
            if self._settings.outage_policy == "fail_closed":
                self._unavailable_rejections += 1
                raise
            self._fallback_admissions += 1
            reservation = await self._fallback.reserve(request)
        except BudgetError as err:
            # Tell the client the numbers: the limit it hit and what this request asked for.
            level = limits.tenant if err.level == "tenant" else limits.session
            value = getattr(level, err.limit or "", None)
            if isinstance(value, int) and err.limit in _BYTE_LIMITS:
                err.message = (
                    f"{who(err.level or 'session', tenant, sid)} is at its"
                    f" {describe_limit(err.limit, value)}; this request needs {request_kv_bytes}"
                    f" KV bytes ({format_bytes(request_kv_bytes)}). Retry later."
                )
            raise
        self._held[reservation.id] = reservation
        return reservation

    async def release(self, reservation: Reservation, actual_tokens: int | None = None) -> None:
        """Give the reservation back; safe to call twice, never raises for store outages.

        ``actual_tokens`` (prompt + generated) refunds unused reserved tokens to tokens/minute.
        """
        if self._held.pop(reservation.id, None) is None:
            return
        store = self._store_named(reservation.store)
        if store is None:
            return
        try:
            await store.release(reservation.tenant, reservation.session_id, reservation.id,
                                self._clock(), actual_tokens)
        except StoreUnavailableError as exc:
            # The lease will expire and be reaped; the charge then runs to the lease's end.
            self._on_store_error(exc)

    async def renew(self, reservation: Reservation) -> Reservation | None:
        """Extend the lease of a reservation this gateway holds; ``None`` if it was reaped
        (or is unknown here). Never raises for store outages (returns the old reservation)."""
        if reservation.id not in self._held:
            return None
        store = self._store_named(reservation.store)
        if store is None:
            return None
        try:
            expires = await store.renew(reservation.tenant, reservation.session_id,
                                        reservation.id, self._clock(), self._settings.lease_ttl_s)
        except StoreUnavailableError as exc:
            self._on_store_error(exc)
            return reservation
        if expires is None:
            self._leases_lost += 1
            self._held.pop(reservation.id, None)
            log.warning(
                "lease of reservation %s of session %s of tenant %s was reaped while held",
                reservation.id,
                reservation.session_id,
                reservation.tenant,
            )
            return None
        # from the entry held now: a shrink may have changed it while the renewal was away
        renewed = dataclasses.replace(self._held.get(reservation.id, reservation),
                                      lease_expires_at=expires)
        if reservation.id in self._held:
            self._held[reservation.id] = renewed
        return renewed

    async def shrink(self, reservation: Reservation, kv_bytes: int) -> Reservation | None:
        """Lower a held reservation's KV bytes to ``kv_bytes`` (a partial release: the bytes
        shed are charged for the time they were held; never raises them). The reservation as it
        is now, or ``None`` when it is no longer held (released, reaped, or not this
        gateway's). Never raises for store outages (returns it unchanged: it stays charged in
        full until its release, which is what a store that missed the shrink then charges)."""
        if kv_bytes < 0:
            raise ValueError("kv_bytes must be >= 0")
        current = self._held.get(reservation.id)
        if current is None:
            return None
        if kv_bytes >= current.kv_bytes:
            return current  # never grown; already this small: no store call
        store = self._store_named(current.store)
        if store is None:
            return None
        try:
            held = await store.shrink(current.tenant, current.session_id, current.id,
                                      self._clock(), kv_bytes)
        except StoreUnavailableError as exc:
            self._on_store_error(exc)
            return current
        latest = self._held.get(reservation.id)
        if held is None or latest is None:
            # reaped while held (the renewer will say so) or released meanwhile
            return None
        shrunk = dataclasses.replace(latest, kv_bytes=min(held, latest.kv_bytes))
        self._held[reservation.id] = shrunk
        return shrunk

    async def renew_all(self) -> None:
        """Renew every lease this gateway holds (what the background task does each tick)."""
        held = list(self._held.values())
        for start in range(0, len(held), 64):
            await asyncio.gather(*(self.renew(r) for r in held[start : start + 64]))

    async def _renew_loop(self) -> None:
        interval = self._settings.lease_ttl_s / 3
        while True:
            await asyncio.sleep(interval)
            try:
                await self.renew_all()
            except Exception:  # the renewer must outlive any single failure
                log.exception("renewing budget leases failed")

    # -- throttles -------------------------------------------------------------------------

    def _scope(self, tenant: str, session_id: str | None) -> str | None:
        """The sanitized session id (``None``: the whole tenant); ValueError for a tenant this
        gateway does not serve or an empty session id."""
        if tenant not in self._tenants:
            raise ValueError(f"unknown tenant {tenant!r}")
        if session_id is None:
            return None
        sid = sanitize_session_id(session_id)
        if sid is None:
            raise ValueError("a session throttle needs a session id")
        return sid

    async def throttle(
        self,
        tenant: str,
        session_id: str | None,
        state: ThrottleState | str,
        *,
        ttl_s: float | None = None,
        expires_at: float | None = None,
        reason: str = "",
        max_inflight_requests: int | None = 1,
        budget_factor: float = 1.0,
    ) -> Throttle:
        """Throttle or block a session of ``tenant`` (``session_id`` ``None``: the whole tenant,
        whatever session ids it uses) until ``expires_at`` (or for ``ttl_s``); replaces any
        throttle it had. ``throttled`` allows at most ``max_inflight_requests`` in flight
        (``None``: no extra cap) and scales every budget by ``budget_factor``."""
        sid = self._scope(tenant, session_id)
        if (ttl_s is None) == (expires_at is None):
            raise ValueError("give exactly one of ttl_s and expires_at")
        now = self._clock()
        until = now + ttl_s if ttl_s is not None else expires_at
        assert until is not None
        if until <= now:
            raise ValueError("a throttle must expire in the future")
        th_state = ThrottleState(state)
        if (
            th_state is ThrottleState.THROTTLED
            and max_inflight_requests is None
            and budget_factor >= 1.0
        ):
            raise ValueError("a throttle needs max_inflight_requests or budget_factor < 1")
        throttle = Throttle(
            state=th_state,
            expires_at=until,
            reason=reason[:MAX_REASON_LEN],
            max_inflight_requests=max_inflight_requests,
            budget_factor=budget_factor,
            set_at=now,
        )
        await self._call(lambda store: store.set_throttle(tenant, sid, throttle, now))
        log.info("tenant %s session %s %s until %.0f: %s", tenant, sid or "(all)",
                 th_state.value, until, reason)
        return throttle

    async def unthrottle(self, tenant: str, session_id: str | None) -> bool:
        """Lift the throttle or block of a session (``None``: of the whole tenant); ``False``
        when it had none."""
        sid = self._scope(tenant, session_id)
        now = self._clock()
        return await self._call(lambda store: store.clear_throttle(tenant, sid, now))

    # -- reads -----------------------------------------------------------------------------

    async def usage(self, tenant: str, session_id: str | None) -> SessionUsage | None:
        """A session's usage (``None``: the whole tenant's); ``None`` when it holds nothing and
        has no state."""
        sid = self._scope(tenant, session_id)
        return await self._usage(tenant, sid, self._clock())

    async def _usage(self, tenant: str, sid: str | None, now: float) -> SessionUsage | None:
        return await self._read(lambda store: store.usage(tenant, sid, now))

    async def tenants_usage(self) -> list[SessionUsage]:
        """The usage of every tenant with state, most KV in flight first."""
        now = self._clock()
        rows = [u for t in self._tenants if (u := await self._usage(t, None, now)) is not None]
        return sorted(rows, key=lambda u: (u.inflight_kv_bytes, u.tenant), reverse=True)

    async def sessions(self, top: int | None = None, tenant: str | None = None
                       ) -> list[SessionUsage]:
        """The ``top`` sessions (default ``top_k``) by KV bytes in flight, most first, of one
        tenant or of all."""
        k = self._settings.top_k if top is None else top
        now = self._clock()
        tenants = self._tenants
        if tenant is not None:
            self._scope(tenant, None)  # a tenant this gateway serves, or ValueError
            tenants = (tenant,)
        rows: list[SessionUsage] = []
        for t in tenants:
            rows += await self._top(t, k, now)
        rows.sort(key=lambda u: (u.inflight_kv_bytes, u.tenant, u.session_id or ""),
                  reverse=True)
        return rows[:k]

    async def throttled(self, limit: int = SWEEP_LIMIT) -> list[SessionUsage]:
        """Tenants and sessions with an unexpired throttle or block, soonest expiry first."""
        now = self._clock()
        rows: list[SessionUsage] = []
        for t in self._tenants:
            own = await self._usage(t, None, now)
            if own is not None and own.throttle is not None:
                rows.append(own)
            rows += await self._throttled(t, now, limit)
        rows.sort(key=lambda u: u.throttle.expires_at if u.throttle is not None else 0.0)
        return rows[:limit]

    async def _top(self, tenant: str, k: int, now: float) -> list[SessionUsage]:
        return await self._read(lambda store: store.top(tenant, k, now))

    async def _throttled(self, tenant: str, now: float, limit: int) -> list[SessionUsage]:
        return await self._read(lambda store: store.throttled(tenant, now, limit))
