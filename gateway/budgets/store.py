"""The ``BudgetStore`` protocol and the accounting algorithm every store implements.

Three stores implement it with the same semantics, proven by one contract test suite:
``MemoryBudgetStore`` (one process; the embedded default, and the fallback while Redis is down),
``SharedBudgetStore`` (the memory store of a supervisor, for the processes of one gateway) and
``RedisBudgetStore`` (shared by every gateway; each operation is one atomic Lua script).

Identity is (tenant, session) (``gateway.budgets.session_id``): a session id is scoped inside its
tenant, and every operation names both. A store keeps two kinds of account with the same
algorithm: one per session, and one per tenant that holds every reservation of all the tenant's
sessions (so rotating session ids still fills the tenant's budgets). A reservation is recorded in
its session's account and its tenant's, in the same atomic step; release, renew, shrink and
lease reaping apply to both. Everything one operation touches belongs to one tenant (in Redis:
one hash tag, one Cluster slot).

Per account (session or tenant) a store keeps:

* the reservations in flight: ``id -> (kv_bytes, tokens, started_at, lease_expires_at)``;
* three token buckets, each ``(level, capacity, refill rate)`` with the effective limits of the
  session's last admission: KV byte-seconds (capacity ``kv_byte_seconds``, refilled at
  ``kv_byte_seconds / window_s`` per second), requests (``requests_per_minute`` / 60 s) and tokens
  (``tokens_per_minute`` / 60 s), and ``ts``, when they were last refilled;
* ``hold_ewma_s``: an exponentially weighted mean of how long its requests were held (weight 0.2),
  for Retry-After estimates;
* its throttle, if any.

Every operation on a session starts with the same **open** step and ends with **commit**:

1. open: drop the throttle if it has expired; reap every reservation whose lease has expired (a
   holder that died), in expiry order: refill up to its expiry, remove it and charge its
   byte-seconds ``kv_bytes x (lease_expires_at - started_at)``, exactly as if it had been released
   when its lease ran out; then refill every bucket by ``rate x (now - ts)`` up to its capacity
   (lazy, continuous refill: no timers).
2. the operation (reserve, release, renew, shrink, throttle, read).
3. commit: in-flight bytes and count are *derived* from the reservations left, never kept as
   separate counters that could drift; the top-sessions index gets the session's in-flight bytes
   (or loses it at zero); a session whose state equals a fresh one (nothing in flight, no throttle,
   every bucket full, no hold history) is deleted, so idle sessions cost nothing; any other gets an
   expiry: the time at which it will equal a fresh one, a pure function of the state so that
   reads never extend it (the refill after the charge of every live lease, should its holder die;
   the throttle's expiry; each bucket's full refill; the hold EWMA ``MIN_STATE_TTL_S`` after its
   last update). A session opened after its expiry starts fresh; in Redis the keys also get a
   TTL of at least ``MIN_STATE_TTL_S`` past it, to collect what no script touches again.

A session account derives its totals from its few reservations at every call. A tenant account
may hold thousands, so it keeps running sums instead (in-flight bytes, ``sum kv_bytes x
started_at`` for the byte-seconds accrued, and an upper bound of its lease expiries, all reset
when it holds nothing) and finds expired leases in an index ordered by expiry: O(log n) per
operation. They change only in the same atomic step as the reservations they sum.

**reserve**: a blocked tenant, then a blocked session, is refused first. Then, for the session's
limits and then the tenant's (each the caller's, scaled by ``budget_factor`` and capped at
``max_inflight_requests`` while that account is throttled), checked in order:
requests in flight + 1 <= ``inflight_requests``; KV in flight + ``kv_bytes`` <=
``inflight_kv_bytes``; byte-seconds level minus what the reservations in flight have accrued so far
(``sum kv_bytes x (now - started_at)``) > 0; requests level >= 1; tokens level >= ``tokens``. The
first failing check is the rejection's ``limit`` (and its ``level``, session or tenant); nothing is
consumed. On success the reservation is added to both accounts with a lease of ``lease_ttl_s`` and
both accounts' request and token buckets are debited. A reserve is idempotent on its reservation
id (a retried call after a lost reply does not reserve twice).

**release** removes the reservation, charges ``kv_bytes x seconds held`` to the byte-seconds bucket
(the level may go negative down to ``-capacity``: a runaway session pays off at most one window of
debt), updates ``hold_ewma_s``, and refunds ``tokens - actual_tokens`` when the request used fewer
tokens than it reserved. Releasing an unknown (already released or reaped) reservation is a no-op,
which makes release safe to call twice.

**renew** moves a live lease to ``now + lease_ttl_s``; a lease that already expired is reaped by
the open step and cannot be renewed.

**shrink** lowers a live reservation's KV bytes to ``kv_bytes`` (never raises them: a
``kv_bytes`` at or above what it holds changes nothing), on the session's account and the
tenant's in one atomic step: the bytes shed are charged to the byte-seconds bucket for the time
they were held (``shed x (now - started_at)``, as a release of that part would be), and from then
on the reservation holds, accrues and is reaped with the smaller size; its tokens, lease and
start are unchanged (tokens/minute was charged for the request, not for where its KV lives). It
is a partial release: a prefill/decode request (``gateway.upstream.disagg``) holds its prompt's KV
twice until the decode worker has pulled it, then once. Shrinking to the size already held is a
no-op, so a retried shrink after a lost reply cannot shed twice; shrinking a released or reaped
reservation is a no-op too.

**Retry-After estimates**: in-flight limits (requests and bytes): walk the reservations oldest
first until enough would be freed; the estimate is that one's ``started_at + hold_ewma_s - now``
(at least 0; the HTTP layer rounds up to 1 s). Buckets: ``(needed - level) / rate``. While
throttled, never later than the throttle's expiry; a blocked session: the throttle's expiry.

Cost per operation: O(reservations in flight of that session) (they are read to derive the totals
and reap), plus O(log sessions) for the top-K index. Reading the top K additionally sweeps expired
leases and throttles of any session (bounded per call).
"""

from __future__ import annotations

from typing import Protocol

from gateway.budgets.models import Reservation, ReserveRequest, SessionUsage, Throttle

HOLD_EWMA_WEIGHT = 0.2
"""Weight of the newest hold time in ``hold_ewma_s``."""

MIN_STATE_TTL_S = 60.0
"""Shortest time a non-fresh session's state is kept; covers clock skew between gateways."""

SWEEP_LIMIT = 1000
"""Most expired leases (and throttles) one top-K or throttled-list read reaps."""


class BudgetStore(Protocol):
    """Where accounting lives. Every method is atomic, and touches one tenant only.

    ``session_id`` ``None`` (throttles and usage) names the tenant's own account, the sum over its
    sessions. ``reserve`` raises a ``BudgetError`` (from ``errors.rejection``) when a limit
    refuses the request; every method raises ``StoreUnavailableError`` when the backend cannot
    be reached.
    """

    @property
    def name(self) -> str:
        """``memory``, ``redis``, ``shared`` or ``fallback``: stored in each ``Reservation.store``."""
        ...

    async def start(self) -> None:
        """Open connections (the only I/O outside operations); may raise StoreUnavailableError."""
        ...

    async def close(self) -> None:
        """Close connections; the store can be started again."""
        ...

    async def ping(self) -> None:
        """Raise ``StoreUnavailableError`` unless the backend answers."""
        ...

    async def reserve(self, request: ReserveRequest) -> Reservation:
        """Admit and record ``request`` or raise the rejection of the first limit it fails."""
        ...

    async def release(
        self, tenant: str, session_id: str, reservation_id: str, now: float,
        actual_tokens: int | None,
    ) -> bool:
        """Release a reservation; ``False`` when it was not held (released before, or reaped)."""
        ...

    async def renew(
        self, tenant: str, session_id: str, reservation_id: str, now: float, lease_ttl_s: float
    ) -> float | None:
        """Extend a live lease to ``now + lease_ttl_s``; its new expiry, or ``None`` if lost."""
        ...

    async def shrink(
        self, tenant: str, session_id: str, reservation_id: str, now: float, kv_bytes: int
    ) -> int | None:
        """Lower a live reservation's KV bytes to ``kv_bytes`` (never raise them); the bytes it
        holds after the call, or ``None`` if it is not held (released before, or reaped)."""
        ...

    async def set_throttle(
        self, tenant: str, session_id: str | None, throttle: Throttle, now: float
    ) -> None:
        """Set (replace) the session's (or the whole tenant's) throttle."""
        ...

    async def clear_throttle(self, tenant: str, session_id: str | None, now: float) -> bool:
        """Remove the session's (or tenant's) throttle; ``False`` when it had none."""
        ...

    async def usage(self, tenant: str, session_id: str | None, now: float) -> SessionUsage | None:
        """The session's (or tenant's) usage, or ``None`` when its state is a fresh one's."""
        ...

    async def top(self, tenant: str, k: int, now: float) -> list[SessionUsage]:
        """Up to ``k`` sessions of ``tenant`` with KV in flight, most bytes first (ties: greater
        id first)."""
        ...

    async def throttled(self, tenant: str, now: float, limit: int) -> list[SessionUsage]:
        """Up to ``limit`` sessions of ``tenant`` with an unexpired throttle, soonest expiry
        first (the tenant's own throttle is read with ``usage``)."""
        ...
