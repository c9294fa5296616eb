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
clock time deletes expired sessions nobody touched again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.budgets.errors import rejection
from gateway.budgets.models import (
    RATE_PERIOD_S,
    Reservation,
    ReserveRequest,
    SessionUsage,
    Throttle,
    ThrottleState,
)
from gateway.budgets.store import HOLD_EWMA_WEIGHT, MIN_STATE_TTL_S

NEVER = -1.0
"""A Retry-After estimate meaning "waiting alone will not admit it"."""


@dataclass
class _Bucket:
    level: float
    capacity: float
    rate_per_s: float


@dataclass
class _Held:
    id: str
    kv_bytes: int
    tokens: int
    started_at: float
    lease_expires_at: float
    key_name: str | None


@dataclass
class _Session:
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

    def inflight_kv_bytes(self) -> int:
        return sum(h.kv_bytes for h in self.held.values())

    def accrued_byte_seconds(self, now: float) -> float:
        return sum(h.kv_bytes * max(0.0, now - h.started_at) for h in self.held.values())

    def charge(self, byte_seconds: float) -> None:
        b = self.byte_seconds
        if b is not None and byte_seconds > 0:
            b.level = max(-b.capacity, b.level - byte_seconds)

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
            until = max(h.lease_expires_at for h in self.held.values())
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
    if old is None or old.level >= old.capacity:
        return _Bucket(cap, cap, rate)
    return _Bucket(min(max(old.level, -cap), cap), cap, rate)


def _slot_wait(s: _Session, free_requests: int, free_bytes: int, now: float) -> float:
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


class MemoryBudgetStore:
    """The in-process ``BudgetStore``; see the module docstring."""

    def __init__(self, *, name: str = "memory") -> None:
        self._name = name
        self._sessions: dict[str, _Session] = {}
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

    def _open(self, session_id: str, now: float) -> _Session:
        s = self._sessions.get(session_id)
        if s is None or s.expires_at <= now:
            # expired state is fresh: every lease in it was charged and refilled by now
            s = _Session(ts=now)
            self._sessions[session_id] = s
        if s.throttle is not None and s.throttle.expires_at <= now:
            s.throttle = None
        if s.hold_ewma_s is not None and s.hold_ewma_at + MIN_STATE_TTL_S <= now:
            s.hold_ewma_s = None
        expired = [h for h in s.held.values() if h.lease_expires_at <= now]
        expired.sort(key=lambda h: (h.lease_expires_at, h.id))
        for h in expired:
            # charged as released when its lease ran out, with the refill before and after
            s.advance(h.lease_expires_at)
            del s.held[h.id]
            s.charge(h.kv_bytes * (h.lease_expires_at - h.started_at))
        s.advance(now)
        return s

    def _commit(self, session_id: str, s: _Session, now: float) -> bool:
        """Delete a session that is as good as fresh; ``True`` when it is kept."""
        until = s.keep_until(now)
        if until is None:
            self._sessions.pop(session_id, None)
            return False
        s.expires_at = until
        return True

    def _maybe_sweep(self, now: float) -> None:
        """Forget sessions past their expiry (what the Redis key TTL does), at most once per
        ``MIN_STATE_TTL_S``; it touches no live session, so answers never depend on it."""
        if now < self._next_sweep:
            return
        self._next_sweep = now + MIN_STATE_TTL_S
        for sid, s in list(self._sessions.items()):
            if s.expires_at <= now:
                del self._sessions[sid]

    def _sweep_expired(self, now: float) -> None:
        """Open every session with an expired lease or throttle (the Lua ``sweep``)."""
        for sid, s in list(self._sessions.items()):
            if (s.throttle is not None and s.throttle.expires_at <= now) or any(
                h.lease_expires_at <= now for h in s.held.values()
            ):
                self._commit(sid, self._open(sid, now), now)

    def _usage(self, session_id: str, s: _Session, now: float) -> SessionUsage:
        bs, rq, tk = s.byte_seconds, s.requests, s.tokens
        return SessionUsage(
            session_id=session_id,
            inflight_kv_bytes=s.inflight_kv_bytes(),
            inflight_requests=len(s.held),
            kv_byte_seconds_available=(
                None if bs is None else bs.level - s.accrued_byte_seconds(now)
            ),
            kv_byte_seconds_capacity=None if bs is None else bs.capacity,
            requests_available=None if rq is None else rq.level,
            requests_capacity=None if rq is None else rq.capacity,
            tokens_available=None if tk is None else tk.level,
            tokens_capacity=None if tk is None else tk.capacity,
            hold_ewma_s=s.hold_ewma_s,
            throttle=s.throttle,
        )

    # -- operations ------------------------------------------------------------------------

    async def reserve(self, request: ReserveRequest) -> Reservation:
        now = request.now
        self._maybe_sweep(now)
        sid = request.session_id
        s = self._open(sid, now)
        existing = s.held.get(request.reservation_id)
        if existing is not None:
            self._commit(sid, s, now)
            return self._reservation(sid, existing)

        limits = request.limits
        max_bytes = limits.inflight_kv_bytes
        max_requests = limits.inflight_requests
        caps: dict[str, float | None] = {
            "kv_byte_seconds": limits.kv_byte_seconds,
            "requests_per_minute": limits.requests_per_minute,
            "tokens_per_minute": limits.tokens_per_minute,
        }
        th = s.throttle
        throttle_left = 0.0
        if th is not None:
            throttle_left = th.expires_at - now
            if th.state is ThrottleState.BLOCKED:
                self._commit(sid, s, now)
                raise rejection("blocked", throttle_left, "blocked", sid)
            f = th.budget_factor
            if max_bytes is not None:
                max_bytes = int(max_bytes * f)
            if th.max_inflight_requests is not None and (
                max_requests is None or th.max_inflight_requests < max_requests
            ):
                max_requests = th.max_inflight_requests
            caps = {k: None if v is None else v * f for k, v in caps.items()}

        s.byte_seconds = _set_bucket(s.byte_seconds, caps["kv_byte_seconds"], request.window_s)
        s.requests = _set_bucket(s.requests, caps["requests_per_minute"], RATE_PERIOD_S)
        s.tokens = _set_bucket(s.tokens, caps["tokens_per_minute"], RATE_PERIOD_S)

        count = len(s.held)
        inflight = s.inflight_kv_bytes()
        limit: str | None = None
        wait = 0.0
        if max_requests is not None and count + 1 > max_requests:
            limit = "inflight_requests"
            wait = _slot_wait(s, count + 1 - max_requests, 0, now)
        elif max_bytes is not None and inflight + request.kv_bytes > max_bytes:
            limit = "inflight_kv_bytes"
            wait = _slot_wait(s, 0, inflight + request.kv_bytes - max_bytes, now)
        elif s.byte_seconds is not None and s.byte_seconds.level - s.accrued_byte_seconds(now) <= 0:
            limit = "kv_byte_seconds"
            wait = _bucket_wait(s.byte_seconds, s.accrued_byte_seconds(now))
        elif s.requests is not None and s.requests.level < 1:
            limit = "requests_per_minute"
            wait = _bucket_wait(s.requests, 1.0)
        elif s.tokens is not None and s.tokens.level < request.tokens:
            limit = "tokens_per_minute"
            wait = _bucket_wait(s.tokens, float(request.tokens))
        if limit is not None:
            if th is not None:
                wait = throttle_left if wait < 0 else min(wait, throttle_left)
            self._commit(sid, s, now)
            raise rejection(limit, wait, None if th is None else th.state.value, sid)

        held = _Held(
            id=request.reservation_id,
            kv_bytes=request.kv_bytes,
            tokens=request.tokens,
            started_at=now,
            lease_expires_at=now + request.lease_ttl_s,
            key_name=request.key_name,
        )
        s.held[held.id] = held
        if s.requests is not None:
            s.requests.level -= 1
        if s.tokens is not None:
            s.tokens.level -= request.tokens
        self._commit(sid, s, now)
        return self._reservation(sid, held)

    def _reservation(self, session_id: str, h: _Held) -> Reservation:
        return Reservation(
            id=h.id,
            session_id=session_id,
            key_name=h.key_name,
            kv_bytes=h.kv_bytes,
            tokens=h.tokens,
            started_at=h.started_at,
            lease_expires_at=h.lease_expires_at,
            store=self._name,
        )

    async def release(
        self, session_id: str, reservation_id: str, now: float, actual_tokens: int | None
    ) -> bool:
        if session_id not in self._sessions:
            return False
        s = self._open(session_id, now)
        h = s.held.pop(reservation_id, None)
        if h is not None:
            held_s = max(0.0, now - h.started_at)
            s.charge(h.kv_bytes * held_s)
            s.hold_ewma_s = (
                held_s
                if s.hold_ewma_s is None
                else (1 - HOLD_EWMA_WEIGHT) * s.hold_ewma_s + HOLD_EWMA_WEIGHT * held_s
            )
            s.hold_ewma_at = now
            tk = s.tokens
            if tk is not None and actual_tokens is not None and 0 <= actual_tokens < h.tokens:
                tk.level = min(tk.capacity, tk.level + (h.tokens - actual_tokens))
        self._commit(session_id, s, now)
        return h is not None

    async def renew(
        self, session_id: str, reservation_id: str, now: float, lease_ttl_s: float
    ) -> float | None:
        if session_id not in self._sessions:
            return None
        s = self._open(session_id, now)
        h = s.held.get(reservation_id)
        if h is not None:
            h.lease_expires_at = now + lease_ttl_s
        self._commit(session_id, s, now)
        return None if h is None else h.lease_expires_at

    async def set_throttle(self, session_id: str, throttle: Throttle, now: float) -> None:
        s = self._open(session_id, now)
        s.throttle = throttle if throttle.expires_at > now else None
        self._commit(session_id, s, now)

    async def clear_throttle(self, session_id: str, now: float) -> bool:
        if session_id not in self._sessions:
            return False
        s = self._open(session_id, now)
        had = s.throttle is not None
        s.throttle = None
        self._commit(session_id, s, now)
        return had

    async def usage(self, session_id: str, now: float) -> SessionUsage | None:
        if session_id not in self._sessions:
            return None
        s = self._open(session_id, now)
        if not self._commit(session_id, s, now):
            return None
        return self._usage(session_id, s, now)

    async def top(self, k: int, now: float) -> list[SessionUsage]:
        # Mirrors the Lua script step by step: sweep, pick the top k by stored in-flight bytes,
        # then open only those (answers must not depend on which sessions a read touched).
        self._maybe_sweep(now)
        self._sweep_expired(now)
        ranked = sorted(
            ((s.inflight_kv_bytes(), sid) for sid, s in self._sessions.items()),
            reverse=True,
        )
        out: list[SessionUsage] = []
        for ib, sid in ranked[: max(0, k)]:
            if ib <= 0:
                break
            s = self._open(sid, now)
            if self._commit(sid, s, now) and s.inflight_kv_bytes() > 0:
                out.append(self._usage(sid, s, now))
        return out

    async def throttled(self, now: float, limit: int) -> list[SessionUsage]:
        self._maybe_sweep(now)
        self._sweep_expired(now)
        ranked = sorted(
            (s.throttle.expires_at, sid)
            for sid, s in self._sessions.items()
            if s.throttle is not None
        )
        out: list[SessionUsage] = []
        for _, sid in ranked[: max(0, limit)]:
            s = self._open(sid, now)
            if self._commit(sid, s, now) and s.throttle is not None:
                out.append(self._usage(sid, s, now))
        return out
