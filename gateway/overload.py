"""Admission control for the whole gateway: a cap on requests in flight, and a bounded queue
served in weighted fair order across tenants by the KV byte-seconds they hold.

Admission: ``try_enter`` admits at once while fewer than ``max_inflight`` requests are in flight
and nobody waits; otherwise ``acquire`` queues the request, at most ``max_queued`` in all, for
up to ``queue_timeout_s``. A full queue refuses at once and a wait that times out refuses then:
both raise ``Overloaded`` (503 with Retry-After), so memory and sockets stay bounded however hard
clients push. A released ``Slot`` passes straight to the next waiter, so no newcomer takes a freed
slot ahead of the queue.

Who goes next when a slot frees, in three steps:

1. the class: ``interactive`` before ``batch``; while both wait, every hand-off adds
   ``batch_share`` to a credit and one of them in every ``1 / batch_share`` goes to batch, so
   batch keeps a bounded share of the slots under any interactive load and never starves;
2. the tenant, by virtual time (start-time fair queuing with the charge taken as it accrues, like
   Linux CFS's vruntime): a tenant's virtual time is the KV byte-seconds its requests have held
   (those finished, plus those in flight so far) divided by its weight; the waiting tenant with
   the lowest virtual time goes next (ties: the oldest request). A tenant joining the queue
   starts no lower than the queue's virtual time (the lowest among the tenants waiting, each
   levelled so when it joined), so usage it did not have while others were served is not
   banked as credit to flood with later (start-time fair queuing's system virtual time); a debt
   (a higher one) is kept while the queue lasts. A queue that empties ends a busy period: the
   next one starts level (its first tenant joins at the highest virtual time of all), so
   neither credit nor debt outlives the contention it came from;
3. inside a tenant, first come first served.

The charge: a request's KV bytes (its budget reservation: prompt + output limit, x n) are known
only once its prompt is tokenized and its holding time only when it ends, so the slot starts its
meter at ``Slot.hold(kv_bytes)`` and a tenant's in-flight byte-seconds are
``held_bytes x now - sum(kv_bytes x start)``: two running sums, O(1) to read at any instant,
exact for every request in flight.

A full queue does not simply shut newcomers out (fair mode): when the tenant with the longest
weighted backlog is not the newcomer's, its newest waiter is pushed out (``Overloaded``) to make
room, so one tenant's flood cannot fill the queue and turn every other tenant away.

Cost: O(1) to admit into a free slot (no bookkeeping beyond a counter, a dict lookup and the
slot); O(T) per hand-off and per tenant joining the queue, T = the tenants (API keys: a few dozen
at most); one future per queued request and one small ``Slot`` per request.

Compared to: FIFO (``limits.fair_queuing: false``; and vLLM's own waiting queue, where a gateway
that forwards everything leaves the order), in which a flooding tenant's backlog sits ahead of
everyone's. WFQ and DRR charge a cost known on arrival (a packet's length); a request's KV bytes
and holding time are not known then, and a long decode would be charged as a short one, so the
charge here is what was really held. A tenant is charged KV byte-seconds, not requests: one
16K-token prompt holds the KV of a hundred short chats.

Each gateway process has its own gate (``max_inflight`` is per process), so with several processes
the order is fair within each of them.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable, Mapping

from gateway.config import Priority

_RANK = {Priority.INTERACTIVE: 0, Priority.BATCH: 1}
"""Index of each class in the queues; a lower rank is served first."""

FULL_RETRY_AFTER_S = 1.0


class Overloaded(Exception):
    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def priority_for(asked: str | None, ceiling: Priority) -> Priority:
    """The class of a request whose ``X-Priority`` header is ``asked`` (None: absent) from a key
    whose class is ``ceiling``: the header may lower it to batch, never raise it (a batch key
    saying ``interactive`` would jump every batch tenant). ``ValueError`` for an unknown class."""
    if asked is None:
        return ceiling
    try:
        wanted = Priority(asked.strip().lower())
    except ValueError:
        raise ValueError(
            f"X-Priority must be one of {', '.join(p.value for p in Priority)}, not {asked!r}"
        ) from None
    return wanted if _RANK[wanted] > _RANK[ceiling] else ceiling


class _Tenant:
    """One tenant's share: KV byte-seconds served and held, its requests waiting."""

    __slots__ = ("held_bytes", "held_moment", "name", "served", "waiting", "weight")

    def __init__(self, name: str, weight: float) -> None:
        self.name = name
        self.weight = weight
        self.served = 0.0
        """KV byte-seconds of its finished requests (raised to the floor when it turns active)."""
        self.held_bytes = 0
        """KV bytes of its requests in flight whose meter runs."""
        self.held_moment = 0.0
        """Sum of kv_bytes x meter start over those requests."""
        self.waiting: tuple[deque[_Waiter], deque[_Waiter]] = (deque(), deque())

    def vtime(self, now: float) -> float:
        return (self.served + self.held_bytes * now - self.held_moment) / self.weight


class _Waiter:
    __slots__ = ("future", "seq")

    def __init__(self, seq: int, future: asyncio.Future[Slot]) -> None:
        self.seq = seq
        self.future = future


class Slot:
    """One admitted request's place in the gate: ``hold`` starts its KV byte-second meter,
    ``release`` (safe to call twice) charges its tenant and passes the slot on."""

    __slots__ = ("_bytes", "_gate", "_open", "_since", "_tenant")

    def __init__(self, gate: AdmissionGate, tenant: _Tenant) -> None:
        self._gate = gate
        self._tenant = tenant
        self._bytes = 0
        self._since = 0.0
        self._open = True

    def hold(self, kv_bytes: int) -> None:
        """The request now holds ``kv_bytes`` of KV (once; later calls change nothing)."""
        if not self._open or self._bytes or kv_bytes <= 0:
            return
        now = self._gate.now()
        self._bytes, self._since = kv_bytes, now
        self._tenant.held_bytes += kv_bytes
        self._tenant.held_moment += kv_bytes * now

    def shrink(self, kv_bytes: int) -> None:
        """The request now holds only ``kv_bytes`` (never more than before): the bytes shed are
        charged for the time they were held (a prefill/decode request's prompt, once the decode
        worker has pulled it and the prefill worker freed it)."""
        shed = self._bytes - max(kv_bytes, 0)
        if not self._open or shed <= 0:
            return
        t = self._tenant
        t.served += shed * (self._gate.now() - self._since)
        t.held_bytes -= shed
        t.held_moment -= shed * self._since
        self._bytes -= shed

    def release(self) -> None:
        if not self._open:
            return
        self._open = False
        t = self._tenant
        if self._bytes:
            t.served += self._bytes * (self._gate.now() - self._since)
            t.held_bytes -= self._bytes
            t.held_moment -= self._bytes * self._since
        self._gate.hand_off()


class AdmissionGate:
    def __init__(
        self,
        max_inflight: int,
        max_queued: int,
        queue_timeout_s: float,
        *,
        fair: bool = True,
        weights: Mapping[str, float] | None = None,
        batch_share: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_inflight = max_inflight
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.fair = fair
        self.batch_share = batch_share
        self.inflight = 0
        self.queued = 0
        self._weights = dict(weights or {})
        self._clock = clock
        self._epoch = clock()  # times relative to it keep held_bytes x now exact in a float
        self._tenants: dict[str, _Tenant] = {}
        self._classes: tuple[dict[str, _Tenant], dict[str, _Tenant]] = ({}, {})
        """Per class, the tenants with a request waiting in it."""
        self._batch_credit = 0.0
        self._seq = itertools.count()

    def now(self) -> float:
        return self._clock() - self._epoch

    def try_enter(self, tenant: str) -> Slot | None:
        """A slot at once when one is free and nobody waits (no future, no task); else None."""
        if self.inflight >= self.max_inflight or self.queued:
            return None
        self.inflight += 1
        return Slot(self, self._tenant(tenant))

    async def acquire(self, tenant: str, priority: Priority = Priority.INTERACTIVE) -> Slot:
        slot = self.try_enter(tenant)
        if slot is not None:
            return slot
        t = self._tenant(tenant)
        if self.queued >= self.max_queued and not (self.fair and self._push_out(t)):
            raise Overloaded(
                f"the gateway is at its limit of {self.max_inflight} requests in flight and"
                f" {self.max_queued} queued", retry_after_s=FULL_RETRY_AFTER_S)
        future: asyncio.Future[Slot] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(next(self._seq), future)
        rank = _RANK[priority]
        if not (t.waiting[0] or t.waiting[1]):
            self._level(t)
        t.waiting[rank].append(waiter)
        self._classes[rank][t.name] = t
        self.queued += 1
        try:
            async with asyncio.timeout(self.queue_timeout_s):
                return await future  # hand_off counted us in flight before waking us
        except TimeoutError:
            if _granted(future):  # granted as the timer fired: the slot is ours
                return future.result()
            raise Overloaded(
                f"the gateway is at its limit of {self.max_inflight} requests in flight; waited"
                f" {self.queue_timeout_s:g} s in the queue", retry_after_s=self.queue_timeout_s,
            ) from None
        except BaseException:
            if _granted(future):
                future.result().release()  # woken and cancelled at once: pass the slot on
            raise
        finally:
            self._forget(t, rank, waiter)

    def hand_off(self) -> None:
        """A slot freed: the next waiter in fair order gets it, or it goes back to the pool."""
        while self.queued:
            t, rank = self._next()
            waiter = t.waiting[rank].popleft()
            self._dequeued(t, rank)
            if waiter.future.done():  # cancelled; its task has not run its cleanup yet
                continue
            waiter.future.set_result(Slot(self, t))  # the slot moves on: in flight unchanged
            return
        self.inflight -= 1

    def tenant_vtime(self, tenant: str) -> float:
        """The tenant's virtual time now (0 for one never seen): for tests and the benchmark."""
        t = self._tenants.get(tenant)
        return 0.0 if t is None else t.vtime(self.now())

    # -- the order ---------------------------------------------------------------------------------

    def _next(self) -> tuple[_Tenant, int]:
        interactive, batch = self._classes
        if not self.fair:  # first come first served across classes and tenants
            return min(((t, r) for r, cls in enumerate(self._classes) for t in cls.values()),
                       key=lambda tr: tr[0].waiting[tr[1]][0].seq)
        rank = 0 if interactive else 1
        if interactive and batch:
            self._batch_credit += self.batch_share
            if self._batch_credit >= 1.0 - 1e-9:  # ten 0.1s sum to 0.999...
                self._batch_credit -= 1.0
                rank = 1
        now = self.now()
        t = min(self._classes[rank].values(),
                key=lambda t: (t.vtime(now), t.waiting[rank][0].seq))
        return t, rank

    def _tenant(self, name: str) -> _Tenant:
        t = self._tenants.get(name)
        if t is None:
            t = self._tenants[name] = _Tenant(name, self._weights.get(name, 1.0))
        return t

    def _level(self, t: _Tenant) -> None:
        """``t`` joins the queue: raise its virtual time to the queue's (the lowest of the tenants
        waiting, each levelled when it joined); joining an empty queue, which starts a new busy
        period, to the highest of any tenant, so each busy period starts level."""
        now = self.now()
        waiting = [o.vtime(now) for cls in self._classes for o in cls.values()]
        floor = min(waiting) if waiting else max(o.vtime(now) for o in self._tenants.values())
        held = t.vtime(now) - t.served / t.weight  # what its requests in flight hold so far
        t.served = max(t.served, (floor - held) * t.weight)

    def _push_out(self, newcomer: _Tenant) -> bool:
        """Room for ``newcomer`` by refusing the newest waiter of the tenant with the longest
        weighted backlog, if that is another tenant's and longer than the newcomer's would be."""
        def backlog(t: _Tenant, extra: int = 0) -> float:
            return (len(t.waiting[0]) + len(t.waiting[1]) + extra) / t.weight

        longest = max((t for cls in self._classes for t in cls.values()), key=backlog,
                      default=None)
        if longest is None or longest is newcomer or backlog(longest) <= backlog(newcomer, 1):
            return False
        rank = 1 if longest.waiting[1] else 0  # batch waits longest anyway: push it out first
        waiter = longest.waiting[rank].pop()
        self._dequeued(longest, rank)
        if waiter.future.done():  # cancelled, its cleanup not run yet: its place is free anyway
            return True
        waiter.future.set_exception(Overloaded(
            f"the gateway queue is full and tenant {longest.name!r} holds the most of it",
            retry_after_s=FULL_RETRY_AFTER_S))
        return True

    def _dequeued(self, t: _Tenant, rank: int) -> None:
        self.queued -= 1
        if not t.waiting[rank]:
            del self._classes[rank][t.name]

    def _forget(self, t: _Tenant, rank: int, waiter: _Waiter) -> None:
        """A waiter that leaves (timeout, cancelled) without being handed a slot or pushed out."""
        queue = t.waiting[rank]
        if waiter in queue:
            queue.remove(waiter)
            self._dequeued(t, rank)


def _granted(future: asyncio.Future[Slot]) -> bool:
    return future.done() and not future.cancelled() and future.exception() is None
