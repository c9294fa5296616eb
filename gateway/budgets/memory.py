"""``MemoryBudgetStore``: the accounting of ``gateway.budgets.store`` in one process's memory.

It is the reference implementation of the algorithm (the Redis Lua scripts mirror it line by
line) and serves two roles: the embedded default for a single gateway, and the local fallback
while Redis is unreachable under ``fail_open``.

Atomicity: no method awaits between reading and writing a session, so on one event loop every
operation is atomic without locks. Cost: O(reservations in flight of the session) per operation;
``top`` and ``throttled`` scan every session (O(sessions), fine for the sizes one process sees)
but, like the Lua scripts, open only the sessions they report or that have something expired, so
both stores give the same answers whatever was read before (a randomized parity test checks it).

A session whose state equals a fresh one is deleted at once; any other carries an expiry (the
Redis store's key TTL) after which it counts as fresh, and a sweep every ``MIN_STATE_TTL_S`` of
clock time deletes expired sessions nobody touched again. Tenants are kept the same way; a
tenant's accounting keeps running sums (see ``gateway.budgets.store``) and a heap of lease
expiries, so a tenant with thousands of requests in flight costs O(log n) per operation.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import TypeVar

from mypy_extensions import mypyc_attr

from gateway.budgets.errors import rejection
from gateway.budgets.models import (
    RATE_PERIOD_S,
    BudgetLimits,
    Reservation,
    ReserveRequest,
    SessionUsage,
    Throttle,
    ThrottleState,
)
from gateway.budgets.store import HOLD_EWMA_WEIGHT, MIN_STATE_TTL_S

NEVER = -1.0
"""A Retry-After estimate meaning "waiting alone will not admit it"."""


@dataclass(slots=True)
class _Bucket:
    level: float
    capacity: float
    rate_per_s: float


@dataclass(slots=True, init=False)
class _Held:
    id: str
    kv_bytes: int
    tokens: int
    started_at: float
    lease_expires_at: float

    def __init__(
        self, id: str, kv_bytes: int, tokens: int, started_at: float, lease_expires_at: float,
    ) -> None:
        self.id = id
        self.kv_bytes = kv_bytes
        self.tokens = tokens
        self.started_at = started_at
        self.lease_expires_at = lease_expires_at


@dataclass(slots=True)
class _Account:
    """What a session and a tenant both keep: buckets, throttle, hold EWMA, reservations."""

    ts: float
    expires_at: float = 0.0
    hold_ewma_s: float | None = None
    hold_ewma_at: float = 0.0
    byte_seconds: _Bucket | None = None
    requests: _Bucket | None = None
    tokens: _Bucket | None = None
    throttle: Throttle | None = None
    held: dict[str, _Held] = field(default_factory=dict)

    def advance(self, t: float) -> None:
        """Refill every bucket up to time ``t`` (never backwards: clocks may disagree)."""
        dt = t - self.ts
        if dt > 0:
            for b in (self.byte_seconds, self.requests, self.tokens):
                if b is not None:
                    b.level = min(b.capacity, b.level + b.rate_per_s * dt)
            self.ts = t

    def charge(self, byte_seconds: float) -> None:
        b = self.byte_seconds
        if b is not None and byte_seconds > 0:
            b.level = max(-b.capacity, b.level - byte_seconds)

    def inflight_kv_bytes(self) -> int:
        raise NotImplementedError

    def accrued_byte_seconds(self, now: float) -> float:
        raise NotImplementedError

    def held_until(self) -> float:
        """The latest lease expiry of the reservations held (there is at least one)."""
        raise NotImplementedError

    def add(self, h: _Held) -> None:
        self.held[h.id] = h

    def remove(self, rid: str) -> _Held | None:
        return self.held.pop(rid, None)

    def renew(self, rid: str, expires_at: float) -> bool:
        h = self.held.get(rid)
        if h is None:
            return False
        h.lease_expires_at = expires_at
        return True

    def shed(self, h: _Held, kv_bytes: int) -> None:
        """Take ``kv_bytes`` off the held reservation ``h`` (and off the account's sums)."""
        h.kv_bytes -= kv_bytes

    def expired(self, now: float) -> list[_Held]:
        """The reservations whose lease ran out by ``now``, in expiry order."""
        raise NotImplementedError

    def keep_until(self, now: float) -> float | None:
        """When this state will equal a fresh one (``None``: it already does).

        A pure function of the state, so reading a session never extends it: the refill after
        the byte-seconds charge of every live lease (should its holder die), the throttle's
        expiry, each bucket's full refill, and the hold EWMA for ``MIN_STATE_TTL_S`` after it
        was last updated. The Lua ``commit`` computes the same expression in the same order.
        """
        until = now
        differs = False
        if self.held:
            differs = True
            until = self.held_until()
            bs = self.byte_seconds
            if bs is not None and bs.rate_per_s > 0:
                until = until + 2 * bs.capacity / bs.rate_per_s
        if self.throttle is not None:
            differs = True
            until = max(until, self.throttle.expires_at)
        for b in (self.byte_seconds, self.requests, self.tokens):
            if b is not None and b.level < b.capacity:
                differs = True
                if b.rate_per_s > 0:
                    until = max(until, now + (b.capacity - b.level) / b.rate_per_s)
        if self.hold_ewma_s is not None:
            differs = True
            until = max(until, self.hold_ewma_at + MIN_STATE_TTL_S)
        return until if differs else None


def _push_lease(leases: list[tuple[float, str]], held: dict[str, _Held], e: float,
                rid: str) -> None:
    """Add ``(e, rid)`` to a heap of lease expiries whose stale entries (leases released or
    renewed since) are skipped when popped; rebuilt from the live ones once the stale outnumber
    them, so a busy account's heap stays O(in flight) rather than O(request rate x lease TTL)."""
    heapq.heappush(leases, (e, rid))
    if len(leases) > 2 * len(held) + 64:
        leases[:] = [(h.lease_expires_at, h.id) for h in held.values()]
        heapq.heapify(leases)


def _pop_expired(leases: list[tuple[float, str]], held: dict[str, _Held],
                 now: float) -> list[_Held]:
    """The held reservations whose lease ran out by ``now``, in (expiry, id) order, their heap
    entries popped."""
    out: list[_Held] = []
    while leases and leases[0][0] <= now:
        e, rid = heapq.heappop(leases)
        h = held.get(rid)
        if h is not None and h.lease_expires_at == e:
            out.append(h)
    return out


@dataclass(slots=True)
class _Session(_Account):
    """A session: its totals are exact, as the Lua computes them from every reservation, but
    kept as they change instead of summed at each call. A client's requests without a session
    id all go to its tenant's default session, which then holds every request of the tenant in
    flight: summing them per operation cost O(in flight) per request (``sum``/``max``/``min``
    over the reservations were the busiest lines of the budget profile at 32 in flight). The
    byte count is an integer sum, the latest lease expiry is cached (recomputed only when the
    reservation that set it goes), and expiries are found with a heap, as the tenant's."""

    kv_bytes: int = 0
    latest_lease: float | None = None
    """The exact latest lease expiry of the reservations held; None: not known."""
    leases: list[tuple[float, str]] = field(default_factory=list)
    """Heap of ``(lease expiry, id)``, as the tenant's."""

    def inflight_kv_bytes(self) -> int:
        return self.kv_bytes

    def accrued_byte_seconds(self, now: float) -> float:
        # summed per reservation, in the Lua's order of operations (the limit compares it)
        return sum(h.kv_bytes * max(0.0, now - h.started_at) for h in self.held.values())

    def held_until(self) -> float:
        if self.latest_lease is None:
            self.latest_lease = max(h.lease_expires_at for h in self.held.values())
        return self.latest_lease

    def add(self, h: _Held) -> None:
        self.held[h.id] = h
        self.kv_bytes += h.kv_bytes
        self._leased(h.id, h.lease_expires_at)

    def remove(self, rid: str) -> _Held | None:
        h = self.held.pop(rid, None)
        if h is not None:
            self.kv_bytes -= h.kv_bytes
            if h.lease_expires_at == self.latest_lease:
                self.latest_lease = None
            if not self.held:
                self.leases.clear()
        return h

    def renew(self, rid: str, expires_at: float) -> bool:
        h = self.held.get(rid)
        if h is None:
            return False
        if h.lease_expires_at == self.latest_lease:
            self.latest_lease = None
        h.lease_expires_at = expires_at
        self._leased(rid, expires_at)
        return True

    def shed(self, h: _Held, kv_bytes: int) -> None:
        h.kv_bytes -= kv_bytes
        self.kv_bytes -= kv_bytes

    def _leased(self, rid: str, e: float) -> None:
        if len(self.held) == 1 or (self.latest_lease is not None and e > self.latest_lease):
            self.latest_lease = e
        _push_lease(self.leases, self.held, e, rid)

    def expired(self, now: float) -> list[_Held]:
        return _pop_expired(self.leases, self.held, now)


@dataclass(slots=True)
class _Tenant(_Account):
    """A tenant: every reservation of all its sessions, so it keeps running sums and a heap of
    lease expiries (the Lua keeps the same sums and a sorted set), never a scan of them all."""

    kv_bytes: int = 0
    started_bytes: float = 0.0
    """Sum of ``kv_bytes x started_at``: accrued byte-seconds are ``kv_bytes x now`` minus it."""
    max_lease: float = 0.0
    """Latest lease expiry given while anything was held: an upper bound, as in the Lua."""
    leases: list[tuple[float, str]] = field(default_factory=list)
    """Heap of ``(lease expiry, id)``; entries for released or renewed leases are skipped."""

    def inflight_kv_bytes(self) -> int:
        return self.kv_bytes

    def accrued_byte_seconds(self, now: float) -> float:
        return max(0.0, self.kv_bytes * now - self.started_bytes)

    def held_until(self) -> float:
        return self.max_lease

    def add(self, h: _Held) -> None:
        self.held[h.id] = h
        self.kv_bytes += h.kv_bytes
        self.started_bytes += h.kv_bytes * h.started_at
        self.max_lease = max(self.max_lease, h.lease_expires_at)
        _push_lease(self.leases, self.held, h.lease_expires_at, h.id)

    def remove(self, rid: str) -> _Held | None:
        h = self.held.pop(rid, None)
        if h is not None:
            self.kv_bytes -= h.kv_bytes
            self.started_bytes -= h.kv_bytes * h.started_at
            if not self.held:  # rounding never outlives a busy period
                self.kv_bytes, self.started_bytes, self.max_lease = 0, 0.0, 0.0
                self.leases.clear()
        return h

    def shed(self, h: _Held, kv_bytes: int) -> None:
        h.kv_bytes -= kv_bytes
        self.kv_bytes -= kv_bytes
        self.started_bytes -= kv_bytes * h.started_at

    def renew(self, rid: str, expires_at: float) -> bool:
        if not _Account.renew(self, rid, expires_at):  # (slots: no zero-argument super)
            return False
        self.max_lease = max(self.max_lease, expires_at)
        _push_lease(self.leases, self.held, expires_at, rid)
        return True

    def expired(self, now: float) -> list[_Held]:
        return _pop_expired(self.leases, self.held, now)


def _set_bucket(
    old: _Bucket | None, capacity: int | float | None, period_s: float
) -> _Bucket | None:
    """The bucket under a new effective capacity: a new limit starts full; a lower one clamps.

    A full bucket stays full under a new capacity: "full" and "no bucket" must be the same
    state, or deleting a fresh session (and a Redis key expiring) would change later answers.
    """
    if capacity is None:
        return None
    cap = float(capacity)
    rate = cap / period_s
    if old is not None and old.capacity == cap and old.rate_per_s == rate:
        return old  # the usual case: limits unchanged since the last admission
    if old is None or old.level >= old.capacity:
        return _Bucket(cap, cap, rate)
    return _Bucket(min(max(old.level, -cap), cap), cap, rate)


def _slot_wait(s: _Account, free_requests: int, free_bytes: int, now: float) -> float:
    """Seconds until enough of the oldest reservations are expected to be released."""
    freed_b = 0
    ewma = s.hold_ewma_s or 0.0
    oldest_first = sorted(s.held.values(), key=lambda h: (h.started_at, h.id))
    for freed_n, h in enumerate(oldest_first, start=1):
        freed_b += h.kv_bytes
        if freed_n >= free_requests and freed_b >= free_bytes:
            return max(0.0, h.started_at + ewma - now)
    return NEVER


def _bucket_wait(b: _Bucket, needed: float) -> float:
    if b.rate_per_s <= 0:
        return NEVER
    return max(0.0, (needed - b.level) / b.rate_per_s)


_Check = tuple[int | None, int | None]
"""One account's effective in-flight limits (bytes, requests), its throttle applied."""


def _prepare(a: _Account, limits: BudgetLimits, window_s: float) -> _Check:
    """Apply ``a``'s throttle to ``limits`` and set its buckets to the effective capacities."""
    if a.throttle is None:  # the usual account: the limits as they are, no dict of them built
        a.byte_seconds = _set_bucket(a.byte_seconds, limits.kv_byte_seconds, window_s)
        a.requests = _set_bucket(a.requests, limits.requests_per_minute, RATE_PERIOD_S)
        a.tokens = _set_bucket(a.tokens, limits.tokens_per_minute, RATE_PERIOD_S)
        return limits.inflight_kv_bytes, limits.inflight_requests
    max_bytes = limits.inflight_kv_bytes
    max_requests = limits.inflight_requests
    caps: dict[str, float | None] = {
        "kv_byte_seconds": limits.kv_byte_seconds,
        "requests_per_minute": limits.requests_per_minute,
        "tokens_per_minute": limits.tokens_per_minute,
    }
    th = a.throttle
    if th is not None:
        f = th.budget_factor
        if max_bytes is not None:
            max_bytes = int(max_bytes * f)
        if th.max_inflight_requests is not None and (
            max_requests is None or th.max_inflight_requests < max_requests
        ):
            max_requests = th.max_inflight_requests
        caps = {k: None if v is None else v * f for k, v in caps.items()}
    a.byte_seconds = _set_bucket(a.byte_seconds, caps["kv_byte_seconds"], window_s)
    a.requests = _set_bucket(a.requests, caps["requests_per_minute"], RATE_PERIOD_S)
    a.tokens = _set_bucket(a.tokens, caps["tokens_per_minute"], RATE_PERIOD_S)
    return max_bytes, max_requests


def _refusal(a: _Account, c: _Check, kv_bytes: int, tokens: int,
             now: float) -> tuple[str, float] | None:
    """The first limit of ``a`` this reservation fails, and the wait estimate, or ``None``."""
    max_bytes, max_requests = c
    count = len(a.held)
    inflight = a.inflight_kv_bytes()
    limit: str | None = None
    wait = 0.0
    if max_requests is not None and count + 1 > max_requests:
        limit = "inflight_requests"
        wait = _slot_wait(a, count + 1 - max_requests, 0, now)
    elif max_bytes is not None and inflight + kv_bytes > max_bytes:
        limit = "inflight_kv_bytes"
        wait = _slot_wait(a, 0, inflight + kv_bytes - max_bytes, now)
    elif a.byte_seconds is not None and a.byte_seconds.level - a.accrued_byte_seconds(now) <= 0:
        limit = "kv_byte_seconds"
        wait = _bucket_wait(a.byte_seconds, a.accrued_byte_seconds(now))
    elif a.requests is not None and a.requests.level < 1:
        limit = "requests_per_minute"
        wait = _bucket_wait(a.requests, 1.0)
    elif a.tokens is not None and a.tokens.level < tokens:
        limit = "tokens_per_minute"
        wait = _bucket_wait(a.tokens, float(tokens))
    if limit is None:
        return None
    th = a.throttle
    if th is not None:
        left = th.expires_at - now
        wait = left if wait < 0 else min(wait, left)
    return limit, wait


def _debit(a: _Account, tokens: int) -> None:
    if a.requests is not None:
        a.requests.level -= 1
    if a.tokens is not None:
        a.tokens.level -= tokens


def _settle(a: _Account, rid: str, now: float, actual_tokens: int | None) -> _Held | None:
    """Release ``rid`` from ``a``: charge its byte-seconds, learn its hold, refund tokens."""
    h = a.remove(rid)
    if h is not None:
        held_s = max(0.0, now - h.started_at)
        a.charge(h.kv_bytes * held_s)
        a.hold_ewma_s = (
            held_s
            if a.hold_ewma_s is None
            else (1 - HOLD_EWMA_WEIGHT) * a.hold_ewma_s + HOLD_EWMA_WEIGHT * held_s
        )
        a.hold_ewma_at = now
        tk = a.tokens
        if tk is not None and actual_tokens is not None and 0 <= actual_tokens < h.tokens:
            tk.level = min(tk.capacity, tk.level + (h.tokens - actual_tokens))
    return h


def _shrink(a: _Account, rid: str, kv_bytes: int, now: float) -> int | None:
    """Lower ``rid``'s KV bytes in ``a`` to ``kv_bytes`` (never raise them), charging the bytes
    shed for the time they were held; what it holds after, or ``None`` when ``a`` holds no
    ``rid``."""
    h = a.held.get(rid)
    if h is None:
        return None
    shed = h.kv_bytes - kv_bytes
    if shed > 0:
        a.charge(shed * max(0.0, now - h.started_at))
        a.shed(h, shed)
    return h.kv_bytes


_A = TypeVar("_A", bound=_Account)


def _opened(a: _A | None, fresh: type[_A], now: float) -> _A:
    """The open step of ``gateway.budgets.store`` on account ``a`` (a new ``fresh`` one if it
    has none: built only then, since most opens find the account)."""
    if a is None or a.expires_at <= now:
        # expired state is fresh: every lease in it was charged and refilled by now
        a = fresh(ts=now)
    if a.throttle is not None and a.throttle.expires_at <= now:
        a.throttle = None
    if a.hold_ewma_s is not None and a.hold_ewma_at + MIN_STATE_TTL_S <= now:
        a.hold_ewma_s = None
    for h in a.expired(now):
        # charged as released when its lease ran out, with the refill before and after
        a.advance(h.lease_expires_at)
        a.remove(h.id)
        a.charge(h.kv_bytes * (h.lease_expires_at - h.started_at))
    a.advance(now)
    return a


def _usage(tenant: str, session_id: str | None, a: _Account, now: float) -> SessionUsage:
    bs, rq, tk = a.byte_seconds, a.requests, a.tokens
    return SessionUsage(
        tenant=tenant,
        session_id=session_id,
        inflight_kv_bytes=a.inflight_kv_bytes(),
        inflight_requests=len(a.held),
        kv_byte_seconds_available=(
            None if bs is None else bs.level - a.accrued_byte_seconds(now)
        ),
        kv_byte_seconds_capacity=None if bs is None else bs.capacity,
        requests_available=None if rq is None else rq.level,
        requests_capacity=None if rq is None else rq.capacity,
        tokens_available=None if tk is None else tk.level,
        tokens_capacity=None if tk is None else tk.capacity,
        hold_ewma_s=a.hold_ewma_s,
        throttle=a.throttle,
    )


@mypyc_attr(allow_interpreted_subclasses=True)  # a store that wraps it (tests: a failing one)
class MemoryBudgetStore:
    """The in-process ``BudgetStore``; see the module docstring."""

    def __init__(self, *, name: str = "memory") -> None:
        self._name = name
        self._tenants: dict[str, _Tenant] = {}
        self._sessions: dict[str, dict[str, _Session]] = {}
        """Per tenant, its sessions with state."""
        self._next_sweep = 0.0

    @property
    def name(self) -> str:
        return self._name

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def ping(self) -> None:
        return None

    # -- open / commit ---------------------------------------------------------------------

    def _open_tenant(self, tenant: str, now: float) -> _Tenant:
        t = _opened(self._tenants.get(tenant), _Tenant, now)
        self._tenants[tenant] = t
        return t

    def _commit_tenant(self, tenant: str, t: _Tenant, now: float) -> bool:
        until = t.keep_until(now)
        if until is None:
            self._tenants.pop(tenant, None)
            return False
        t.expires_at = until
        return True

    def _open(self, tenant: str, sid: str, now: float) -> _Session:
        sessions = self._sessions.setdefault(tenant, {})
        s = _opened(sessions.get(sid), _Session, now)
        sessions[sid] = s
        return s

    def _commit(self, tenant: str, sid: str, s: _Session, now: float) -> bool:
        """Delete a session that is as good as fresh; ``True`` when it is kept."""
        until = s.keep_until(now)
        if until is None:
            sessions = self._sessions.get(tenant)
            if sessions is not None:
                sessions.pop(sid, None)
                if not sessions:
                    del self._sessions[tenant]
            return False
        s.expires_at = until
        return True

    def _has(self, tenant: str, sid: str | None) -> bool:
        if sid is None:
            return tenant in self._tenants
        return sid in self._sessions.get(tenant, {})

    def _maybe_sweep(self, now: float) -> None:
        """Forget state past its expiry (what the Redis key TTL does), at most once per
        ``MIN_STATE_TTL_S``; it touches nothing live, so answers never depend on it."""
        if now < self._next_sweep:
            return
        self._next_sweep = now + MIN_STATE_TTL_S
        for tenant, t in list(self._tenants.items()):
            if t.expires_at <= now:
                del self._tenants[tenant]
        for tenant, sessions in list(self._sessions.items()):
            for sid, s in list(sessions.items()):
                if s.expires_at <= now:
                    del sessions[sid]
            if not sessions:
                del self._sessions[tenant]

    def _sweep_expired(self, tenant: str, now: float) -> None:
        """Open every session of ``tenant`` with an expired lease or throttle (the Lua sweep)."""
        for sid, s in list(self._sessions.get(tenant, {}).items()):
            if (s.throttle is not None and s.throttle.expires_at <= now) or any(
                h.lease_expires_at <= now for h in s.held.values()
            ):
                self._commit(tenant, sid, self._open(tenant, sid, now), now)

    # -- operations (synchronous: the coroutines of the protocol are at the end) ------------

    def reserve_sync(self, request: ReserveRequest) -> Reservation:
        now = request.now
        self._maybe_sweep(now)
        tenant, sid = request.tenant, request.session_id
        t = self._open_tenant(tenant, now)
        s = self._open(tenant, sid, now)
        refusal: tuple[str, float, str | None, str] | None = None
        existing = s.held.get(request.reservation_id)
        if existing is None:
            for level, a in (("tenant", t), ("session", s)):
                if a.throttle is not None and a.throttle.state is ThrottleState.BLOCKED:
                    refusal = ("blocked", a.throttle.expires_at - now, "blocked", level)
                    break
        if existing is None and refusal is None:
            sc = _prepare(s, request.limits, request.window_s)
            tc = _prepare(t, request.tenant_limits, request.window_s)
            for level, a, c in (("session", s, sc), ("tenant", t, tc)):
                failed = _refusal(a, c, request.kv_bytes, request.tokens, now)
                if failed is not None:
                    th = a.throttle
                    refusal = (*failed, None if th is None else th.state.value, level)
                    break
        if existing is None and refusal is None:
            existing = _Held(
                id=request.reservation_id,
                kv_bytes=request.kv_bytes,
                tokens=request.tokens,
                started_at=now,
                lease_expires_at=now + request.lease_ttl_s,
            )
            s.add(existing)
            t.add(_Held(existing.id, existing.kv_bytes, existing.tokens, existing.started_at,
                        existing.lease_expires_at))  # its own: renewals change each copy
            _debit(s, request.tokens)
            _debit(t, request.tokens)
        self._commit(tenant, sid, s, now)
        self._commit_tenant(tenant, t, now)
        if refusal is not None:
            limit, wait, throttle, level = refusal
            raise rejection(limit, wait, throttle, level, tenant, sid)
        assert existing is not None
        return self._reservation(tenant, sid, existing)

    def _reservation(self, tenant: str, sid: str, h: _Held) -> Reservation:
        return Reservation(
            id=h.id,
            tenant=tenant,
            session_id=sid,
            kv_bytes=h.kv_bytes,
            tokens=h.tokens,
            started_at=h.started_at,
            lease_expires_at=h.lease_expires_at,
            store=self._name,
        )

    def release_sync(
        self, tenant: str, session_id: str, reservation_id: str, now: float,
        actual_tokens: int | None,
    ) -> bool:
        found = False
        if self._has(tenant, session_id):
            s = self._open(tenant, session_id, now)
            found = _settle(s, reservation_id, now, actual_tokens) is not None
            self._commit(tenant, session_id, s, now)
        if self._has(tenant, None):
            t = self._open_tenant(tenant, now)
            _settle(t, reservation_id, now, actual_tokens)
            self._commit_tenant(tenant, t, now)
        return found

    def renew_sync(
        self, tenant: str, session_id: str, reservation_id: str, now: float, lease_ttl_s: float
    ) -> float | None:
        if not self._has(tenant, session_id):
            return None
        expires = now + lease_ttl_s
        s = self._open(tenant, session_id, now)
        found = s.renew(reservation_id, expires)
        self._commit(tenant, session_id, s, now)
        if found:
            t = self._open_tenant(tenant, now)
            t.renew(reservation_id, expires)
            self._commit_tenant(tenant, t, now)
        return expires if found else None

    def shrink_sync(
        self, tenant: str, session_id: str, reservation_id: str, now: float, kv_bytes: int
    ) -> int | None:
        if not self._has(tenant, session_id):
            return None
        s = self._open(tenant, session_id, now)
        held = _shrink(s, reservation_id, kv_bytes, now)
        self._commit(tenant, session_id, s, now)
        if held is not None:
            t = self._open_tenant(tenant, now)
            _shrink(t, reservation_id, kv_bytes, now)
            self._commit_tenant(tenant, t, now)
        return held

    def _account(self, tenant: str, session_id: str | None, now: float) -> _Account:
        if session_id is None:
            return self._open_tenant(tenant, now)
        return self._open(tenant, session_id, now)

    def _keep(self, tenant: str, session_id: str | None, a: _Account, now: float) -> bool:
        if session_id is None:
            assert isinstance(a, _Tenant)
            return self._commit_tenant(tenant, a, now)
        assert isinstance(a, _Session)
        return self._commit(tenant, session_id, a, now)

    def set_throttle_sync(
        self, tenant: str, session_id: str | None, throttle: Throttle, now: float
    ) -> None:
        a = self._account(tenant, session_id, now)
        a.throttle = throttle if throttle.expires_at > now else None
        self._keep(tenant, session_id, a, now)

    def clear_throttle_sync(self, tenant: str, session_id: str | None, now: float) -> bool:
        if not self._has(tenant, session_id):
            return False
        a = self._account(tenant, session_id, now)
        had = a.throttle is not None
        a.throttle = None
        self._keep(tenant, session_id, a, now)
        return had

    def usage_sync(self, tenant: str, session_id: str | None, now: float) -> SessionUsage | None:
        if not self._has(tenant, session_id):
            return None
        a = self._account(tenant, session_id, now)
        if not self._keep(tenant, session_id, a, now):
            return None
        return _usage(tenant, session_id, a, now)

    def top_sync(self, tenant: str, k: int, now: float) -> list[SessionUsage]:
        # Mirrors the Redis store step by step: sweep, pick the top k by stored in-flight bytes,
        # then open only those (answers must not depend on which sessions a read touched).
        self._maybe_sweep(now)
        self._sweep_expired(tenant, now)
        ranked = sorted(
            ((s.inflight_kv_bytes(), sid) for sid, s in self._sessions.get(tenant, {}).items()),
            reverse=True,
        )
        out: list[SessionUsage] = []
        for ib, sid in ranked[: max(0, k)]:
            if ib <= 0:
                break
            s = self._open(tenant, sid, now)
            if self._commit(tenant, sid, s, now) and s.inflight_kv_bytes() > 0:
                out.append(_usage(tenant, sid, s, now))
        return out

    def throttled_sync(self, tenant: str, now: float, limit: int) -> list[SessionUsage]:
        self._maybe_sweep(now)
        self._sweep_expired(tenant, now)
        ranked = sorted(
            (s.throttle.expires_at, sid)
            for sid, s in self._sessions.get(tenant, {}).items()
            if s.throttle is not None
        )
        out: list[SessionUsage] = []
        for _, sid in ranked[: max(0, limit)]:
            s = self._open(tenant, sid, now)
            if self._commit(tenant, sid, s, now) and s.throttle is not None:
                out.append(_usage(tenant, sid, s, now))
        return out

    # -- the ``BudgetStore`` protocol: the operations above, as coroutines ------------------
    # Coroutines only to fit the protocol (they never await). The shared store's server
    # (``gateway.budgets.shared``) calls the synchronous ones directly: driving a coroutine to
    # its end by hand raised a ``StopIteration`` per call, and with the traceback entries
    # compiled code adds to it that was ~10% of the supervisor's CPU.

    async def reserve(self, request: ReserveRequest) -> Reservation:
        return self.reserve_sync(request)

    async def release(
        self, tenant: str, session_id: str, reservation_id: str, now: float,
        actual_tokens: int | None,
    ) -> bool:
        return self.release_sync(tenant, session_id, reservation_id, now, actual_tokens)

    async def renew(
        self, tenant: str, session_id: str, reservation_id: str, now: float, lease_ttl_s: float
    ) -> float | None:
        return self.renew_sync(tenant, session_id, reservation_id, now, lease_ttl_s)

    async def shrink(
        self, tenant: str, session_id: str, reservation_id: str, now: float, kv_bytes: int
    ) -> int | None:
        return self.shrink_sync(tenant, session_id, reservation_id, now, kv_bytes)

    async def set_throttle(
        self, tenant: str, session_id: str | None, throttle: Throttle, now: float
    ) -> None:
        self.set_throttle_sync(tenant, session_id, throttle, now)

    async def clear_throttle(self, tenant: str, session_id: str | None, now: float) -> bool:
        return self.clear_throttle_sync(tenant, session_id, now)

    async def usage(self, tenant: str, session_id: str | None, now: float) -> SessionUsage | None:
        return self.usage_sync(tenant, session_id, now)

    async def top(self, tenant: str, k: int, now: float) -> list[SessionUsage]:
        return self.top_sync(tenant, k, now)

    async def throttled(self, tenant: str, now: float, limit: int) -> list[SessionUsage]:
        return self.throttled_sync(tenant, now, limit)
