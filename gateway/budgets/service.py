"""``BudgetService``: the facade the request path, admin routes and alert webhook call.

Steps of ``admit(session_id, key_name, request_kv_bytes, tokens)``:

1. sanitize the session id (``sanitize_session_id``) and resolve the limits of the API key;
2. per-request check, pure and without I/O: a request that could never fit (over
   ``request_kv_bytes``, or alone over the in-flight budget, or over tokens per minute ...) is
   refused with 400 ``kv_request_too_large``. Anonymous requests (no session id) stop here:
   they are admitted with a reservation that holds nothing, since there is no session to hold
   them against (keying them by API key instead is the caller's choice: pass it as the id);
3. the store reserves atomically or raises the matching 429;
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

Cost on top of the store: a uuid4 and a dict insert per admission; renewals are batched per
``lease_ttl_s / 3`` tick (one store call per request in flight per tick).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from gateway.budgets.errors import (
    BudgetError,
    BudgetUnavailableError,
    StoreUnavailableError,
    describe_limit,
    too_large,
    unavailable,
)
from gateway.budgets.memory import MemoryBudgetStore
from gateway.budgets.models import (
    BudgetLimits,
    Clock,
    Reservation,
    ReserveRequest,
    SessionUsage,
    Throttle,
    ThrottleState,
    limits_for,
)
from gateway.budgets.session_id import sanitize_session_id
from gateway.budgets.store import SWEEP_LIMIT, BudgetStore
from gateway.config import BudgetSettings
from gateway.kvmath import format_bytes

log = logging.getLogger("gateway.budgets")

T = TypeVar("T")

MAX_REASON_LEN = 256
"""Longest throttle reason kept (an alert may send a whole description)."""

ANONYMOUS_STORE = "none"
"""``Reservation.store`` of an anonymous request's reservation (holds nothing)."""


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
    ) -> None:
        self._settings = settings
        self._clock = clock
        self._store: BudgetStore = store if store is not None else self._build_store(settings)
        self._fallback = MemoryBudgetStore(name="fallback")
        self._degraded = False
        self._probe_task: asyncio.Task[None] | None = None
        self._renew_task: asyncio.Task[None] | None = None
        self._held: dict[str, Reservation] = {}
        self._limits: dict[str | None, BudgetLimits] = {}
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
        try:
            await self._store.start()
            await self._store.ping()
        except StoreUnavailableError as exc:
            self._on_store_error(exc)
        if self._settings.auto_renew:
            self._renew_task = asyncio.create_task(self._renew_loop(), name="budget-renew")

    async def close(self) -> None:
        """Stop background tasks and close the store; held reservations are left to expire."""
        for task in (self._renew_task, self._probe_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
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

    # -- admission -------------------------------------------------------------------------

    def limits_for(self, key_name: str | None) -> BudgetLimits:
        """The limits of an API key (defaults when it has no override)."""
        limits = self._limits.get(key_name)
        if limits is None:
            limits = limits_for(self._settings, key_name)
            self._limits[key_name] = limits
        return limits

    def check_request(
        self,
        key_name: str | None,
        request_kv_bytes: int,
        tokens: int,
        session_id: str | None = None,
    ) -> None:
        """Raise 400 ``kv_request_too_large`` if the request could never be admitted."""
        if request_kv_bytes < 0 or tokens < 0:
            raise ValueError("request_kv_bytes and tokens must be >= 0")
        limits = self.limits_for(key_name)
        limit = limits.never_fits(request_kv_bytes, tokens)
        if limit is not None:
            raise too_large(limit, request_kv_bytes, tokens, session_id,
                            getattr(limits, limit, None))

    async def admit(
        self,
        session_id: str | None,
        key_name: str | None,
        request_kv_bytes: int,
        tokens: int,
    ) -> Reservation:
        """Reserve ``request_kv_bytes`` of KV and ``tokens`` for the session, or raise a
        ``BudgetError`` (400 / 429 / 503). ``tokens`` is prompt + max output tokens."""
        sid = sanitize_session_id(session_id)
        self.check_request(key_name, request_kv_bytes, tokens, sid)
        now = self._clock()
        rid = uuid.uuid4().hex
        if sid is None:
            return Reservation(
                id=rid,
                session_id=None,
                key_name=key_name,
                kv_bytes=request_kv_bytes,
                tokens=tokens,
                started_at=now,
                lease_expires_at=now + self._settings.lease_ttl_s,
                store=ANONYMOUS_STORE,
            )
        request = ReserveRequest(
            session_id=sid,
            reservation_id=rid,
            key_name=key_name,
            kv_bytes=request_kv_bytes,
            tokens=tokens,
            limits=self.limits_for(key_name),
            window_s=self._settings.window_s,
            lease_ttl_s=self._settings.lease_ttl_s,
            now=now,
        )
        try:
            reservation = await self._call(lambda store: store.reserve(request))
        except BudgetUnavailableError:
            if self._settings.outage_policy == "fail_closed":
                self._unavailable_rejections += 1
                raise
            self._fallback_admissions += 1
            reservation = await self._fallback.reserve(request)
        except BudgetError as err:
            # Tell the client the numbers: the limit it hit and what this request asked for.
            value = getattr(request.limits, err.limit or "", None)
            if isinstance(value, int) and err.limit in _BYTE_LIMITS:
                err.message = (
                    f"Session {sid!r} is at its {describe_limit(err.limit, value)}; this request"
                    f" needs {request_kv_bytes} KV bytes ({format_bytes(request_kv_bytes)})."
                    " Retry later."
                )
            raise
        self._held[reservation.id] = reservation
        return reservation

    async def release(self, reservation: Reservation, actual_tokens: int | None = None) -> None:
        """Give the reservation back; safe to call twice, never raises for store outages.

        ``actual_tokens`` (prompt + generated) refunds unused reserved tokens to tokens/minute.
        """
        if self._held.pop(reservation.id, None) is None or reservation.session_id is None:
            return
        store = self._store_named(reservation.store)
        if store is None:
            return
        try:
            await store.release(
                reservation.session_id, reservation.id, self._clock(), actual_tokens
            )
        except StoreUnavailableError as exc:
            # The lease will expire and be reaped; the charge then runs to the lease's end.
            self._on_store_error(exc)

    async def renew(self, reservation: Reservation) -> Reservation | None:
        """Extend the lease of a reservation this gateway holds; ``None`` if it was reaped
        (or is unknown here). Never raises for store outages (returns the old reservation)."""
        if reservation.session_id is None:
            return reservation
        if reservation.id not in self._held:
            return None
        store = self._store_named(reservation.store)
        if store is None:
            return None
        try:
            expires = await store.renew(
                reservation.session_id, reservation.id, self._clock(), self._settings.lease_ttl_s
            )
        except StoreUnavailableError as exc:
            self._on_store_error(exc)
            return reservation
        if expires is None:
            self._leases_lost += 1
            self._held.pop(reservation.id, None)
            log.warning(
                "lease of reservation %s of session %s was reaped while held",
                reservation.id,
                reservation.session_id,
            )
            return None
        renewed = Reservation(
            id=reservation.id,
            session_id=reservation.session_id,
            key_name=reservation.key_name,
            kv_bytes=reservation.kv_bytes,
            tokens=reservation.tokens,
            started_at=reservation.started_at,
            lease_expires_at=expires,
            store=reservation.store,
        )
        if reservation.id in self._held:
            self._held[reservation.id] = renewed
        return renewed

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

    @contextlib.asynccontextmanager
    async def hold(self, reservation: Reservation) -> AsyncIterator[Reservation]:
        """``async with budgets.hold(r):`` releases ``r`` on exit (after any explicit release
        with ``actual_tokens`` inside the block, this is a no-op)."""
        try:
            yield reservation
        finally:
            await self.release(reservation)

    # -- throttles -------------------------------------------------------------------------

    async def throttle(
        self,
        session_id: str,
        state: ThrottleState | str,
        *,
        ttl_s: float | None = None,
        expires_at: float | None = None,
        reason: str = "",
        max_inflight_requests: int | None = 1,
        budget_factor: float = 1.0,
    ) -> Throttle:
        """Throttle or block a session until ``expires_at`` (or for ``ttl_s``); replaces any
        throttle it had. ``throttled`` allows at most ``max_inflight_requests`` in flight
        (``None``: no extra cap) and scales every budget by ``budget_factor``."""
        sid = sanitize_session_id(session_id)
        if sid is None:
            raise ValueError("a throttle needs a session id")
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
        await self._call(lambda store: store.set_throttle(sid, throttle, now))
        log.info("session %s %s until %.0f: %s", sid, th_state.value, until, reason)
        return throttle

    async def unthrottle(self, session_id: str) -> bool:
        """Lift a session's throttle or block; ``False`` when it had none."""
        sid = sanitize_session_id(session_id)
        if sid is None:
            return False
        now = self._clock()
        return await self._call(lambda store: store.clear_throttle(sid, now))

    # -- reads -----------------------------------------------------------------------------

    async def session(self, session_id: str) -> SessionUsage | None:
        """One session's usage; ``None`` when it holds nothing and has no state."""
        sid = sanitize_session_id(session_id)
        if sid is None:
            return None
        now = self._clock()
        return await self._read(lambda store: store.usage(sid, now))

    async def sessions(self, top: int | None = None) -> list[SessionUsage]:
        """The ``top`` sessions (default ``top_k``) by KV bytes in flight, most first."""
        k = self._settings.top_k if top is None else top
        now = self._clock()
        return await self._read(lambda store: store.top(k, now))

    async def throttled(self, limit: int = SWEEP_LIMIT) -> list[SessionUsage]:
        """Sessions with an unexpired throttle or block, soonest expiry first."""
        now = self._clock()
        return await self._read(lambda store: store.throttled(now, limit))
