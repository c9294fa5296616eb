"""The request path's bookkeeping that nothing urgent waits for, run a moment later, off the wave.

Why. Streams of a load whose clients start and end together arrive in waves: a few hundred new
requests become ready in one turn of the event loop, and each runs its whole request path in one
task step up to the upstream write, so a request's TTFT is about its place in the wave times the
CPU of each request before it; and the streams that ended together ran their end bookkeeping
just before the next wave's requests, in the same turns. Some of that work only later readers
need: counters and histograms (read by a scrape), the in-flight gauge, hit accounting's
settlement (read by ``/admin/routing/explain`` and the totals), the latency models' observations
(read by routing with an objective). ``defer`` queues it here instead.

When it runs: ``DELAY_S`` after it was deferred, each item on its own due time (a delay line:
one timer for the head of the queue, re-armed for the next item when it has run the due ones).
The delay moves the bookkeeping of a wave, and of the streams that ended just before it, past
the wave's first tokens, into the quiet part of the streams where only token chunks flow; and it
keeps the work as spread out in time as the requests were (a steady load's bookkeeping runs as
steadily as before, a little later: no batch that stalls the loop). Measured first with the
work run two loop turns later instead (behind what the next poll made ready): that landed it in
the middle of the next wave, and TTFT p50 came out ~4 ms higher in 5 of 6 paired rounds.
``DELAY_S``: a wave of 256 streams takes ~100-150 ms of one core to admit here (256 x ~0.45 ms
of CPU per request with the server's share), so 0.25 s is past it; a counter 0.25 s late is
nothing to a scrape every few seconds. The cost per item: one queue append and a clock read
(~0.2 µs) against the ~2-10 µs each piece of bookkeeping costs where it runs.

What it guarantees. Every item runs exactly once, in the order deferred, even when the request
that deferred it is cancelled (a client that left) or failed (the queue is the gateway's, not
the request's task's); one that raises is logged and the others still run. ``flush`` runs
everything queued at once: a reader that must see every request ended so far calls it first
(the ``/metrics`` scrape, the hit ledger's readers, routing with a latency objective), and so
does shutdown. With no running loop (a synchronous caller) ``defer`` runs the item at once.
What it must not hold: anything the routing of the next request reads (the route recorded in
the index, in-flight counts, budget reservations): those stay on the request path, exact and in
order. A reader that does not flush (another process's scrape with ``--processes N``) sees a
request's bookkeeping up to ``DELAY_S`` late.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any

log = logging.getLogger(__name__)

DELAY_S = 0.25


class Backlog:
    __slots__ = ("_delay_s", "_items", "_latest", "_loop", "_timer")

    def __init__(self, delay_s: float = DELAY_S) -> None:
        self._delay_s = delay_s
        self._items: deque[tuple[float, Callable[..., Any], tuple[Any, ...]]] = deque()
        self._latest: set[Hashable] = set()  # keys of ``defer_latest`` items queued
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the timer's

    def __len__(self) -> int:
        return len(self._items)

    def defer(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` ``delay_s`` from now (or at the next ``flush``)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop: nothing to be behind (what is queued goes first)
            self.flush()
            _run(fn, args)
            return
        due = loop.time() + self._delay_s
        self._items.append((due, fn, args))
        if self._timer is None or self._loop is not loop:  # (a loop of its own: a test's)
            self._loop = loop
            self._timer = loop.call_at(due, self._run_due, loop)

    def defer_latest(self, key: Hashable, fn: Callable[..., Any], *args: Any) -> None:
        """``defer`` for an item that shows state as of when it runs (a gauge set to a count):
        while one of ``key`` waits, another adds nothing, since the one queued will show the
        later state too. A worker's in-flight gauge changes twice per request; under load its
        requests queued one update each (two deferrals and two gauge sets per request), now one
        per ``DELAY_S`` while its count keeps changing. The key is released before ``fn`` runs,
        so a change made after that queues the next update."""
        latest = self._latest
        if key not in latest:
            latest.add(key)
            self.defer(_run_latest, latest, key, fn, args)

    def flush(self) -> None:
        """Run everything queued now, in order (items deferred meanwhile too)."""
        items = self._items
        while items:
            _, fn, args = items.popleft()
            _run(fn, args)

    def _run_due(self, loop: asyncio.AbstractEventLoop) -> None:
        if loop is not self._loop:
            return  # armed on a loop since replaced; the current one has its own timer
        self._timer = None
        items, now = self._items, loop.time()
        while items and items[0][0] <= now:
            _, fn, args = items.popleft()
            _run(fn, args)
        if items:
            self._timer = loop.call_at(items[0][0], self._run_due, loop)


def _run_latest(latest: set[Hashable], key: Hashable, fn: Callable[..., Any],
                args: tuple[Any, ...]) -> None:
    latest.discard(key)
    fn(*args)


def _run(fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    try:
        fn(*args)
    except Exception:
        log.exception("deferred bookkeeping failed: %r", fn)
