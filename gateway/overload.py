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

Two protections for a tenant whose short requests share a pool with another tenant's long
prompts (both off by default: ``limits.guaranteed_share``, ``limits.long_prompt_tokens``). Fair
order decides who gets the next slot, but it cannot stop a short request from waiting for a slot
a long one holds, nor from waiting on its worker behind a long prefill: the fair gate alone left
b/c's TTFT p99 54x their quiet value under a's flood (``gateway.bench.fairness``).

The guaranteed share (``guaranteed_share``, fair mode only): an interactive request whose tenant
holds less than its share, its weight over the weights of the tenants with requests in flight
or waiting (its own included), of the ``max_inflight`` slots *or* of the KV bytes held in flight,
enters at once even when every slot is taken. A chat holding 30 MiB is far below its share of the
bytes while a flood holds 2 GiB per request, so it never waits for the flood's slots. In flight
may exceed ``max_inflight`` then, never twice it; a slot freed while above the cap is retired,
not passed on, so the excess lasts only as long as the requests that made it.

The room kept for others (``long_prompt_tokens`` > 0). vLLM runs a prefill it has started to
the end (running requests are scheduled first, so a 16K-token prompt takes the token budget of
every step until it is done: ``v1/core/sched/scheduler.py``), and a short request scheduled on
a worker in the middle of one waits for it (~0.5 s for 16K tokens of an 8B model on an H100),
whatever order the gateway keeps; on a worker where long requests decode, a short prefill
shares its engine step with their decode (a step's batch is every running request). So the
gate keeps ``reserve_workers`` of each pool's healthy workers (at most all but one) free of long
requests, prefilling *and decoding*, for other tenants' short ones:

- *which*: the workers with the fewest long requests routed there and not ended (``Slot.routed``
  counts them per worker), then the least prefill queued, then by url, the last reserve's
  kept while it drains (below); long requests are not routed there while others are active,
  so once chosen they stay chosen, and a worker a long request left (its tenant alone)
  becomes reserved when it drains;
- *where requests go* (``avoid``, which the dispatcher passes to ``Router.route``, a preference
  kept while another worker can take the request): a long prompt, while another tenant is
  active (sent a prompt shorter than ``long_prompt_tokens`` within ``active_window_s``), avoids
  the reserved workers; a short one avoids every worker carrying a long request, unless all do;
- *when a long prompt starts* (``room``, called once its prompt is counted, before its budget
  is reserved), while another tenant is active: only while its pool has a worker outside the
  reserve that is *clean* (less than ``long_prompt_tokens`` of prefill queued: the gateway's
  count of uncached prompt tokens of requests that have not produced their first token,
  ``kv_aware``'s queued-prefill term), less the long requests this gate let through that
  routing has not placed yet (``Slot.hold`` marks them placed: it runs right before routing),
  and no such clean worker has a short prefill queued or it has waited ``SHORT_PREFILL_WAIT_S``
  (vLLM would schedule the two in one step, as long as the long prompt's chunk). So a long
  prefill waits in the gateway, not in vLLM's first-come-first-served queue, and at most one is
  queued per worker outside the reserve.

Otherwise it gives its slot back (the slot goes on in fair order) and waits, *parked*, in its
tenant's queue, holding no slot and no budget; it goes on, in fair order among those that may go,
once a slot is free and its pool has room, checked at every hand-off and every ``ROOM_POLL_S``
while any request is parked (a prefill ending frees no slot). Alone (no other tenant active: the
long prompt's own tenant's short requests do not count), a tenant's long prompts are never held
and go to any worker: work-conserving.

The size of the reserve (``reserve_workers``: an int, that many; "auto", the default, sized
per pool from what it carries). Under a flood every short request of the pool lands on the
reserve, and a chat prefilled in the same engine step as another chat's decode waits for that
step: with R workers and L short requests in flight on average, a chat meets a busy worker about
as often as a Poisson count of mean L reaches R (the simulator's scheduler, event-driven,
``gateway.bench.fairness --model-only``: 8 chats/s of 200 tokens, L = 1.3, mixed steps 3% over
four workers, 33% over two, 72% over one; TTFT p99 1.10x the four-worker value over two, 1.51x
over one; at 24 and 32 chats/s, against eight workers: <= 1.12x up to ~1 chat in flight per
worker, 1.18-1.40x at 1.3, 1.38-1.54x at 1.8-2.9; below ~12 chats/s eight workers never mix a
step, and the p99 of any fewer is a mixed step, 2-3x, whatever the reserve). So the auto reserve is the pool's short requests in flight
(every tenant's: all of them land there), averaged over ``active_window_s``, over
``SHORT_PER_WORKER`` (1), rounded up:

- *measured* by the gate itself: ``room`` counts a short request in its pool until its slot is
  released, and the count's exponentially weighted time average (time constant
  ``active_window_s``) is updated at each change, O(1); it restarts from what it sees after a
  window without short requests (normalised by the weight seen), so a reserve forms within a
  second of others arriving, not after a ramp from 0;
- *hysteresis*: it grows as soon as the average needs a worker more and shrinks only below
  ``SHRINK_BELOW`` (0.75) of what the smaller reserve carries, so a demand at a boundary does
  not move the reserve back and forth (each move sends long requests elsewhere);
- *bounds*: at least 1 while others are active (0, none, while nobody else is: unchanged), at
  most all workers but one, and at most the other active tenants' weighted share of the pool,
  floor(N x others' weight / (others' + the long prompt's tenant's)), a tenant whose short
  prompts were all batch counting ``batch_share`` of its weight. Measured without that bound:
  b's, c's and batch d's backlogged 4K-token chats (~20 in flight) took 3 of 4 workers, a's
  16K-token prompts kept one, a's share of the served KV byte-seconds fell to 0.15 (Jain 0.88
  against 0.97-1.00 with 2). The reserve serves latency; it does not outweigh the fair share.

It costs O(1) per short request (two updates of the average) and O(T) per long one (the share,
next to ``_others_active``'s O(T)). An int keeps the fixed size (no bound but all workers but
one).

What it costs, while others are active: the flood gets (N - reserve) / N of the pool (prefill and
decode), plus up to ``SHORT_PREFILL_WAIT_S`` + ``ROOM_POLL_S`` of wait per long prompt; short
requests are confined to the long-free workers, so a short load beyond their capacity queues
there while the others decode long requests (not work-conserving for them). The reserve forms
when others become active: until the long requests on it end (a prefill plus its decode), short
requests share workers with them, and go to the reserve being formed (``avoid``: when every
worker carries a long request, a short one leaves out the workers outside the last reserve
chosen, where new long prompts go); the reserve chosen stays put while it drains, a worker
joining it only once it carries no long request (``_reserved``), so it forms within a prefill
and a decode of the long requests it held, without preempting any. Not solved: (a) a non-streamed request counts as prefilling
until it ends (the gateway sees no first token), so unstreamed long prompts are held to
N - reserve in flight per pool while others are active; (b) a retried long request (another
worker after a failure) stays counted on its first worker; (c) with several gateway processes
each counts its own long requests per worker, so their reserves may differ (the reserve is
chosen by url among equals, so processes that each see no long request on two workers agree).

Cost: O(1) to admit into a free slot (no bookkeeping beyond a counter, a dict lookup and the
slot); O(T) per hand-off and per tenant joining the queue, T = the tenants (API keys: a few dozen
at most); one future per queued request and one small ``Slot`` per request. With the room on:
a short request, one time stamp, and O(W) to route (W: the pool's workers) while some long
request is in flight; a long one, O(T + W log W) when it asks and routes, and per hand-off or
poll while parked, O(T + W log W + the parked scanned), each pool's room computed once per
tenant; a full gate with the guaranteed share on, O(T) per request entering.

Compared to: FIFO (``limits.fair_queuing: false``; and vLLM's own waiting queue, where a gateway
that forwards everything leaves the order), in which a flooding tenant's backlog sits ahead of
everyone's. WFQ and DRR charge a cost known on arrival (a packet's length); a request's KV bytes
and holding time are not known then, and a long decode would be charged as a short one, so the
charge here is what was really held. A tenant is charged KV byte-seconds, not requests: one
16K-token prompt holds the KV of a hundred short chats.

Each gateway process has its own gate (``max_inflight`` is per process), so with several processes
the order is fair within each of them; the room is counted on the whole gateway's prefill queued
per worker, less this process's long requests not yet placed (another process's are seen once
placed), and "another tenant active" is what this process has seen.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from typing import Literal

from gateway.config import Priority

_RANK = {Priority.INTERACTIVE: 0, Priority.BATCH: 1}
"""Index of each class in the queues; a lower rank is served first."""

FULL_RETRY_AFTER_S = 1.0
ROOM_POLL_S = 0.005
"""While long requests are parked, how often the gate looks for room (a prefill ending frees no
slot, so nothing else would wake them): at most this much added to a long prompt's wait, against
~0.13 s of prefill for 4K tokens and ~0.5 s for 16K (8B model, H100)."""

SHORT_PER_WORKER = 1.0
"""``reserve_workers: auto``: the short requests in flight (averaged) one reserved worker carries.
Chosen with ``gateway.bench.fairness --model-only``: chats confined to R workers raise their TTFT
p99 over the same chats spread wide by <= ~1.1x at up to ~1 chat in flight per worker, and by
1.4-1.5x at ~1.3-2 (module docstring, "the size of the reserve")."""

SHRINK_BELOW = 0.75
"""``reserve_workers: auto``: the reserve grows as soon as the averaged demand needs a worker
more, and shrinks only once it would fit the smaller reserve at this fraction of
``SHORT_PER_WORKER``: a demand hovering at a boundary does not flap the reserve (each change
moves long requests, and a worker taken into the reserve carries long ones until they end)."""

SHORT_PREFILL_WAIT_S = 0.05
"""While others are active, a long request also waits (this long at most) until no clean worker
has a short prefill queued: routing would send it to the clean worker a short request just went
to as often as not (both go where the least is queued), and vLLM schedules the two in one engine
step, whose length (~0.27 s for a chunk of 8,192 tokens) becomes the short request's TTFT."""

PrefillQueues = Callable[[str], Mapping[str, int]]
"""Per healthy worker of the named pool (its url), the prompt tokens queued for prefill on it."""

NOWHERE: frozenset[str] = frozenset()
"""``AdmissionGate.avoid`` when routing may use every worker."""


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

    __slots__ = ("held_bytes", "held_moment", "interactive_seen", "name", "open", "served",
                 "short_seen", "waiting", "weight")

    def __init__(self, name: str, weight: float) -> None:
        self.name = name
        self.weight = weight
        self.short_seen = -math.inf
        """When it last sent a prompt shorter than ``long_prompt_tokens`` (gate time)."""
        self.interactive_seen = -math.inf
        """When it last sent such a prompt as ``interactive``."""
        self.open = 0
        """Its slots in flight (the parked excluded)."""
        self.served = 0.0
        """KV byte-seconds of its finished requests (raised to the floor when it turns active)."""
        self.held_bytes = 0
        """KV bytes of its requests in flight whose meter runs."""
        self.held_moment = 0.0
        """Sum of kv_bytes x meter start over those requests."""
        self.waiting: tuple[deque[_Waiter], deque[_Waiter]] = (deque(), deque())

    def vtime(self, now: float) -> float:
        return (self.served + self.held_bytes * now - self.held_moment) / self.weight


class _Demand:
    """A pool's short requests in flight (``reserve_workers: auto``): the count now, and its
    time average over about ``active_window_s``: an exponentially weighted average of the count,
    exact for a count that changes only at events (O(1) per change), normalised by the weight
    seen so far, so it restarts unbiased (no ramp from 0) when the pool had no short request for
    a window (the gateway started, or others came back after a pause)."""

    __slots__ = ("at", "count", "reserve", "total", "weight")

    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0
        """The weighted sum of the count over time (decayed)."""
        self.weight = 0.0
        """The weight of the time seen since the average restarted (decayed)."""
        self.at = -math.inf
        """When the average was last brought up to date (a change, or a read)."""
        self.reserve = 0
        """The auto reserve last chosen (``AdmissionGate._reserve_size``), before clamping to
        the pool's healthy workers."""

    def _advance(self, now: float, window_s: float) -> None:
        if now > self.at:
            keep = math.exp((self.at - now) / window_s)
            self.total = self.total * keep + self.count * (1.0 - keep)
            self.weight = self.weight * keep + (1.0 - keep)
            self.at = now

    def change(self, now: float, window_s: float, by: int) -> None:
        if self.count == 0 and now - self.at > window_s:  # none for a window: start afresh
            self.total = self.weight = 0.0
            self.at = now
        else:
            self._advance(now, window_s)
        self.count += by

    def level(self, now: float, window_s: float) -> float:
        """The short requests in flight, averaged over about the last ``window_s``."""
        self._advance(now, window_s)
        return self.total / self.weight if self.weight > 0 else float(self.count)


class _Waiter:
    __slots__ = ("future", "pool", "seq", "since", "slot")

    def __init__(self, seq: int, future: asyncio.Future[Slot], slot: Slot | None = None,
                 pool: str | None = None, since: float = 0.0) -> None:
        self.seq = seq
        self.since = since
        """When it was parked (gate time)."""
        self.future = future
        self.slot = slot
        """A parked long request's own slot (None: a request waiting for its first slot)."""
        self.pool = pool
        """A parked long request's pool: it may go only while that pool has room."""


class Slot:
    """One admitted request's place in the gate: ``hold`` starts its KV byte-second meter,
    ``release`` (safe to call twice) charges its tenant and passes the slot on."""

    __slots__ = ("_bytes", "_gate", "_landing", "_long", "_open", "_rank", "_short_in",
                 "_since", "_tenant", "_worker")

    def __init__(self, gate: AdmissionGate, tenant: _Tenant, rank: int = 0) -> None:
        self._gate = gate
        self._tenant = tenant
        self._rank = rank
        self._bytes = 0
        self._since = 0.0
        self._open = True
        self._landing: str | None = None
        """The pool of a long request let through and not yet placed (``AdmissionGate.room``)."""
        self._long: bool | None = None
        """Its prompt is long (``AdmissionGate.room`` with the room on; None: not told)."""
        self._worker: str | None = None
        """The worker a long request was routed to (``routed``), counted there until it ends."""
        self._short_in: _Demand | None = None
        """A short request's pool's demand, counting it until it ends (``AdmissionGate.room``)."""
        tenant.open += 1

    def hold(self, kv_bytes: int) -> None:
        """The request now holds ``kv_bytes`` of KV (once; later calls change nothing). Called
        right before it is routed: a long request let through is placed from now on."""
        self._gate.placed(self)
        if not self._open or self._bytes or kv_bytes <= 0:
            return
        now = self._gate.now()
        self._bytes, self._since = kv_bytes, now
        self._tenant.held_bytes += kv_bytes
        self._tenant.held_moment += kv_bytes * now

    def routed(self, worker: str) -> None:
        """The request was routed to ``worker`` (its url): a long one is counted there, in the
        gate's long requests per worker (prefilling or decoding), until it ends."""
        if self._long and self._open and self._worker is None:
            self._worker = worker
            self._gate._long_on[worker] = self._gate._long_on.get(worker, 0) + 1

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
        """Safe twice, and on a slot parked by ``AdmissionGate.room`` (its place is passed on
        already: nothing to do)."""
        if not self._open:
            return
        self._open = False
        self._tenant.open -= 1
        self._gate.placed(self)
        if self._worker is not None:
            self._gate.unrouted(self._worker)
        if self._short_in is not None:
            self._short_in.change(self._gate.now(), self._gate.active_window_s, -1)
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
        long_prompt_tokens: int = 0,
        reserve_workers: int | Literal["auto"] = "auto",
        active_window_s: float = 5.0,
        prefill_queues: PrefillQueues | None = None,
        guaranteed_share: bool = False,
    ) -> None:
        self.max_inflight = max_inflight
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.fair = fair
        self.batch_share = batch_share
        self.inflight = 0
        self.queued = 0
        """Requests waiting, the parked included."""
        self.parked = 0
        """Long requests waiting for room in their pool (``room``)."""
        # the room kept for others (module docstring); off without the workers' prefill queues
        self.long_prompt_tokens = long_prompt_tokens if prefill_queues is not None else 0
        self.reserve_workers = reserve_workers
        """An int: that many per pool; "auto": sized from each pool's ``_Demand``."""
        self.active_window_s = active_window_s
        self._demand: dict[str, _Demand] = {}
        """Per pool, its short requests in flight (counted only with the room on)."""
        self._prefill_queues = prefill_queues
        self.guaranteed_share = guaranteed_share and fair
        self._landing: dict[str, int] = {}
        """Per pool, long requests let through and not yet placed."""
        self._parked_in: dict[str, int] = {}
        self._reserve_of: dict[str, frozenset[str]] = {}
        """Per pool, the reserve last chosen (``_reserved``)."""
        self._long_on: dict[str, int] = {}
        """Per worker url, the long requests routed there and not ended (``Slot.routed``)."""
        self._poll: asyncio.TimerHandle | None = None
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

    def try_enter(self, tenant: str, priority: Priority = Priority.INTERACTIVE) -> Slot | None:
        """A slot at once when one is free and nobody waits for one (long requests parked for
        room in their pool do not count: no future, no task), or, with ``guaranteed_share``, for
        an interactive request of a tenant below its share; else None."""
        rank = _RANK[priority]
        if self.inflight >= self.max_inflight or self.queued > self.parked:
            if not (self.guaranteed_share and rank == 0):
                return None
            t = self._tenant(tenant)
            if not self._below_share(t):
                return None
            self.inflight += 1
            return Slot(self, t, rank)
        self.inflight += 1
        return Slot(self, self._tenant(tenant), rank)

    async def acquire(self, tenant: str, priority: Priority = Priority.INTERACTIVE) -> Slot:
        slot = self.try_enter(tenant, priority)
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
        """A slot freed: the next waiter in fair order gets it, or it goes back to the pool (as
        it does while a guaranteed share keeps more than ``max_inflight`` in flight)."""
        if self.inflight > self.max_inflight or not self._grant_next():
            self.inflight -= 1

    def room(self, slot: Slot, prompt_tokens: int, pool: str) -> Awaitable[None] | None:
        """The room kept for others (module docstring), for ``slot``'s request of
        ``prompt_tokens`` to ``pool``: None when it goes on at once (every short one: no
        coroutine, no task), else what to await until it may (``Overloaded`` after
        ``queue_timeout_s``, or when a full queue pushes it out; parked, it holds no slot)."""
        long = self.long_prompt_tokens
        if long <= 0:  # off: one comparison per request
            return None
        slot._long = prompt_tokens >= long
        if not slot._long:
            now = slot._tenant.short_seen = self.now()
            if slot._rank == 0:
                slot._tenant.interactive_seen = now
            if slot._short_in is None and slot._open:
                demand = self._demand.get(pool)
                if demand is None:
                    demand = self._demand[pool] = _Demand()
                demand.change(now, self.active_window_s, 1)
                slot._short_in = demand
            return None
        if not slot._open:
            return None
        if not self._parked_in.get(pool) and self._has_room(pool, slot._tenant, self.now()):
            self._land(slot, pool)
            return None
        return self._park(slot, pool)

    def avoid(self, slot: Slot, pool: str) -> frozenset[str]:
        """The workers of ``pool`` routing should leave out for ``slot``'s request (called after
        ``room``, right before routing): for a long prompt while another tenant is active, the
        reserved workers; for a short one, the workers carrying a long request, unless every
        healthy worker of the pool does. Empty with the room off."""
        if not slot._long:
            if slot._long is None or not self._long_on:  # off, or no long request anywhere
                return NOWHERE
            assert self._prefill_queues is not None
            workers = self._prefill_queues(pool)
            carrying = frozenset(u for u in workers if self._long_on.get(u))
            if len(carrying) < len(workers):
                return carrying
            # every worker carries a long request (a flood came first): the reserve being
            # formed, where no long prompt is sent any more, over those new ones are sent to;
            # chosen now if no long prompt has asked yet (the first of them may be seconds away)
            kept = self._reserve_of.get(pool) or self._reserved(pool, slot._tenant, workers,
                                                                self.now())
            others = frozenset(u for u in workers if u not in kept)
            return others if len(others) < len(workers) else NOWHERE
        now = self.now()
        if not self._others_active(slot._tenant, now):
            return NOWHERE
        assert self._prefill_queues is not None
        return self._reserved(pool, slot._tenant, self._prefill_queues(pool), now)

    def unrouted(self, worker: str) -> None:
        """A long request routed to ``worker`` ended."""
        left = self._long_on[worker] - 1
        if left:
            self._long_on[worker] = left
        else:
            del self._long_on[worker]

    def placed(self, slot: Slot) -> None:
        """``slot``'s request is placed on a worker (or ends): its pool's prefill queues count
        it from now on, the gate's landing count no longer."""
        pool = slot._landing
        if pool is not None:
            slot._landing = None
            self._landing[pool] -= 1

    def tenant_vtime(self, tenant: str) -> float:
        """The tenant's virtual time now (0 for one never seen): for tests and the benchmark."""
        t = self._tenants.get(tenant)
        return 0.0 if t is None else t.vtime(self.now())

    def _below_share(self, t: _Tenant) -> bool:
        """Does ``t`` hold less than its share, its weight over the weights of the tenants with
        a request in flight or waiting (itself included), of ``max_inflight`` slots or of the KV
        bytes held in flight? Never beyond twice ``max_inflight`` in flight."""
        if self.inflight >= 2 * self.max_inflight:
            return False
        active = t.weight
        held = 0
        for o in self._tenants.values():
            held += o.held_bytes
            if o is not t and (o.open or o.waiting[0] or o.waiting[1]):
                active += o.weight
        share = t.weight / active
        return t.open < self.max_inflight * share or t.held_bytes < held * share

    # -- the room kept for others ------------------------------------------------------------------

    def _has_room(self, pool: str, tenant: _Tenant, now: float, waited_s: float = 0.0) -> bool:
        """May a long request of ``tenant`` that has waited ``waited_s`` start in ``pool`` now?"""
        if not self._others_active(tenant, now):
            return True  # nobody to keep room for: work-conserving
        assert self._prefill_queues is not None
        queues = self._prefill_queues(pool)
        if not queues:
            return True  # no healthy worker: routing answers for it
        long = self.long_prompt_tokens
        reserved = self._reserved(pool, tenant, queues, now)
        clean = [q for u, q in queues.items() if u not in reserved and q < long]
        if len(clean) <= self._landing.get(pool, 0):
            return False
        # between short prefills: one sharing an engine step with a long prompt's chunk waits
        # for the whole step
        return waited_s >= SHORT_PREFILL_WAIT_S or not any(clean)

    def _others_active(self, tenant: _Tenant, now: float) -> bool:
        """Has another tenant sent a short prompt within ``active_window_s``?"""
        window = self.active_window_s
        return any(o is not tenant and now - o.short_seen <= window
                   for o in self._tenants.values())

    def _reserved(self, pool: str, tenant: _Tenant, queues: Mapping[str, int], now: float
                  ) -> frozenset[str]:
        """The pool's reserved workers against ``tenant``'s long prompts (of ``queues``, the
        pool's healthy workers), the reserve's size (``_reserve_size``, at most all but one) of
        them: first those carrying no long request (none routed there by this gate, no long
        prefill queued there by any; the last reserve's first), then the last
        reserve's, then the fewest long requests routed there, the least prefill queued, by url.
        Long requests are not routed to them, so a reserve once chosen stays chosen, and while
        it still carries long requests (others just became active) only a worker that has none
        takes a place in it: the first workers to drain are the reserve. (Re-sorted by the long
        requests alone, a forming reserve could move whenever the counts changed, to a worker
        just sent long prompts, and start draining over: after a flood that came first, chats
        still met long prefills 5-10 s in.)"""
        n = min(self._reserve_size(pool, tenant, len(queues), now), len(queues) - 1)
        if n <= 0:
            return NOWHERE
        on, kept, long = self._long_on, self._reserve_of.get(pool, NOWHERE), self.long_prompt_tokens
        reserved = frozenset(sorted(queues, key=lambda u: (
            u in on or queues[u] >= long, u not in kept, on.get(u, 0), queues[u], u))[:n])
        self._reserve_of[pool] = reserved
        return reserved

    def _reserve_size(self, pool: str, tenant: _Tenant, healthy: int, now: float) -> int:
        """``reserve_workers``; with "auto" (module docstring, "the size of the reserve") the
        pool's averaged short requests in flight over ``SHORT_PER_WORKER``, rounded up, changed
        only when the demand leaves the hysteresis band (it grows to the smallest size that
        carries the demand at ``SHORT_PER_WORKER``, shrinks to the smallest that carries it at
        ``SHRINK_BELOW`` of that), at most the other active tenants' weighted share of the
        ``healthy`` workers, at least 1 (called only while others are active). O(T)."""
        fixed = self.reserve_workers
        if fixed != "auto":
            return fixed
        demand = self._demand.get(pool)
        size = 1
        if demand is not None:
            level = demand.level(now, self.active_window_s)
            grow_to = max(1, math.ceil(level / SHORT_PER_WORKER - 1e-9))
            shrink_to = max(1, math.ceil(level / (SHORT_PER_WORKER * SHRINK_BELOW) - 1e-9))
            size = demand.reserve = min(max(demand.reserve, grow_to), shrink_to)
        window = self.active_window_s
        others = 0.0
        for o in self._tenants.values():
            if o is not tenant and now - o.short_seen <= window:
                # batch is owed batch_share of what it would be owed as interactive
                others += o.weight * (1.0 if now - o.interactive_seen <= window
                                      else self.batch_share)
        share = math.floor(healthy * others / (others + tenant.weight) + 1e-9)
        return max(1, min(size, share))

    def _land(self, slot: Slot, pool: str) -> None:
        slot._landing = pool
        self._landing[pool] = self._landing.get(pool, 0) + 1

    async def _park(self, slot: Slot, pool: str) -> None:
        t, rank = slot._tenant, slot._rank
        if self.queued >= self.max_queued and not (self.fair and self._push_out(t)):
            raise Overloaded(
                f"the gateway is at its limit of {self.max_queued} requests queued, and pool"
                f" {pool!r} keeps room for other tenants' short requests",
                retry_after_s=FULL_RETRY_AFTER_S)
        slot._open = False  # its place goes on now; it gets it back when granted
        t.open -= 1
        future: asyncio.Future[Slot] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(next(self._seq), future, slot, pool, self.now())
        if not (t.waiting[0] or t.waiting[1]):
            self._level(t)
        t.waiting[rank].append(waiter)
        self._classes[rank][t.name] = t
        self.queued += 1
        self.parked += 1
        self._parked_in[pool] = self._parked_in.get(pool, 0) + 1
        self.hand_off()  # the slot it held, to the next waiter that may go (not itself: no room)
        self._schedule_poll()
        try:
            async with asyncio.timeout(self.queue_timeout_s):
                await future  # granted: slot open again, in flight, landing in its pool
        except TimeoutError:
            if _granted(future):
                return
            raise Overloaded(
                f"pool {pool!r} keeps room for other tenants' short requests; this long prompt"
                f" waited {self.queue_timeout_s:g} s for it", retry_after_s=self.queue_timeout_s,
            ) from None
        except BaseException:
            if _granted(future):
                slot.release()  # woken and cancelled at once: pass the slot on
            raise
        finally:
            self._forget(t, rank, waiter)

    def _schedule_poll(self) -> None:
        if self._poll is None and self.parked:
            self._poll = asyncio.get_running_loop().call_later(ROOM_POLL_S, self._polled)

    def _polled(self) -> None:
        """A prefill may have ended, or the other tenants gone quiet: the free slots go to the
        parked that may go now (and none to anyone else: a free slot with a waiter that may go
        only exists while the parked lack room)."""
        self._poll = None
        while self.inflight < self.max_inflight and self._grant_next():
            self.inflight += 1
        self._schedule_poll()

    # -- the order ---------------------------------------------------------------------------------

    def _grant_next(self) -> bool:
        """Hand a slot (the caller's place in flight) to the next waiter in order that may go;
        False when none may."""
        while self.queued > 0:
            chosen = self._next()
            if chosen is None:
                return False
            t, rank, waiter = chosen
            t.waiting[rank].remove(waiter)
            self._dequeued(t, rank, waiter)
            if waiter.future.done():  # cancelled; its task has not run its cleanup yet
                continue
            slot = waiter.slot
            if slot is None:
                slot = Slot(self, t, rank)
            else:  # a parked long request: its own slot again, placed next
                slot._open = True
                t.open += 1
                assert waiter.pool is not None
                self._land(slot, waiter.pool)
            waiter.future.set_result(slot)  # the slot moves on: in flight unchanged
            return True
        return False

    def _next(self) -> tuple[_Tenant, int, _Waiter] | None:
        """The next waiter: of the class due, the tenant with the lowest virtual time, its
        oldest request that may go (a parked one only while its pool has room)."""
        now = self.now()
        rooms: dict[tuple[str, str, bool], bool] = {}

        def first(t: _Tenant, rank: int) -> _Waiter | None:
            for w in t.waiting[rank]:
                if w.pool is None:
                    return w
                waited = now - w.since >= SHORT_PREFILL_WAIT_S
                key = (w.pool, t.name, waited)
                may = rooms.get(key)
                if may is None:
                    may = rooms[key] = self._has_room(w.pool, t, now,
                                                      SHORT_PREFILL_WAIT_S if waited else 0.0)
                if may:
                    return w
            return None

        heads = [[(t, r, w) for t in cls.values() if (w := first(t, r)) is not None]
                 for r, cls in enumerate(self._classes)]
        if not self.fair:  # first come first served across classes and tenants
            return min(heads[0] + heads[1], key=lambda c: c[2].seq, default=None)
        interactive, batch = heads
        rank = 0 if interactive else 1
        if interactive and batch:
            self._batch_credit += self.batch_share
            if self._batch_credit >= 1.0 - 1e-9:  # ten 0.1s sum to 0.999...
                self._batch_credit -= 1.0
                rank = 1
        return min(heads[rank], key=lambda c: (c[0].vtime(now), c[2].seq), default=None)

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
        self._dequeued(longest, rank, waiter)
        if waiter.future.done():  # cancelled, its cleanup not run yet: its place is free anyway
            return True
        waiter.future.set_exception(Overloaded(
            f"the gateway queue is full and tenant {longest.name!r} holds the most of it",
            retry_after_s=FULL_RETRY_AFTER_S))
        return True

    def _dequeued(self, t: _Tenant, rank: int, waiter: _Waiter) -> None:
        self.queued -= 1
        if waiter.pool is not None:
            self.parked -= 1
            self._parked_in[waiter.pool] -= 1
        if not t.waiting[rank]:
            del self._classes[rank][t.name]

    def _forget(self, t: _Tenant, rank: int, waiter: _Waiter) -> None:
        """A waiter that leaves (timeout, cancelled) without being handed a slot or pushed out."""
        queue = t.waiting[rank]
        if waiter in queue:
            queue.remove(waiter)
            self._dequeued(t, rank, waiter)


def _granted(future: asyncio.Future[Slot]) -> bool:
    return future.done() and not future.cancelled() and future.exception() is None
