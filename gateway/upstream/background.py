"""Background Responses: the holds of a response that goes on generating after its answer.

vLLM 0.32 (with its store on) answers ``POST /v1/responses`` with ``background: true`` at once:
status ``queued`` and no output (streamed: the events as they come), then generates in a task of
its own until the response is ``completed``, ``incomplete``, ``failed`` or ``cancelled``
(``entrypoints/openai/responses/serving.py``). A foreground request holds two things while it
runs, and so must a background one until its final status, or a session could run any number of
generations outside its budget:

* its budget reservation: the dispatcher simply does not release it when the answer ends. It
  stays in the ``BudgetService``'s held set, whose renewer extends its lease every
  ``lease_ttl_s / 3`` like any request's in flight;
* a ``WorkerHold`` on the owner, taken here when the answer's own hold is given back (in the same
  step of the event loop: routing never sees the worker without it), so policies count the
  generation as load. It carries no prefill tokens: vLLM does not say when a queued background
  response has been prefilled (its status stays ``queued`` until the end).

One watcher task per response asks the owner for it (``GET /v1/responses/{id}``, with the pool's
upstream credentials, as ``Dispatcher.stored_response`` does) every ``POLL_INTERVAL_S``, and ends
the holds:

==============================================  =============================================
the watcher sees                                the holds end, the reservation charged ...
==============================================  =============================================
a final status (polled, or relayed by the       on the final object's ``usage`` (as a
gateway to its client: ``settle``, so a          foreground request's release): cancelled or
cancel through the gateway ends it at once)     failed ones have none, and are charged whole
404 (the owner restarted and forgot it)         whole, logged
the owner left the fleet (discovery)            whole, logged
``MAX_ERRORS`` failed polls in a row            whole, logged
the deadline: the pool's ``timeouts.read_s``    whole, after asking the owner to cancel it
(the longest a non-streamed answer may take)    (so nothing runs on unaccounted), logged
gateway shutdown (``close``)                    the worker hold only; the reservation is left
                                                to expire with its lease (below)
==============================================  =============================================

Each gateway process watches the background responses it admitted. A retrieve or cancel that
another process (or replica) relays cannot ``settle`` them: that watcher's next poll sees the final
status instead, at most ``POLL_INTERVAL_S`` later.

Why the reservation is not released at shutdown: the generation goes on in the worker after this
gateway stops, and a release would let the session start as much again through another process or
replica at once. Left alone, the lease (no longer renewed) runs out after ``lease_ttl_s`` and the
store reaps it: a bounded over-charge instead of an unbounded under-charge.

Why polling and not a retrieve stream (``?stream=true``) per response: a stream is an open socket
and a task reading every event for the whole generation; a poll is one small request per
response per interval, and a response's final status is all the gateway needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import aiohttp
import orjson

from gateway.config import PoolSettings, TimeoutSettings
from gateway.metrics import Metrics
from gateway.tasks import cancel_and_wait
from gateway.upstream.headers import credential
from gateway.upstream.hold import WorkerHold
from gateway.workers.worker import Worker

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.5
"""How often a background response is asked for: the longest a finished response goes on
holding its session's budget (a cancel or a retrieve through the gateway ends it at once)."""
MAX_ERRORS = 10
"""Failed polls in a row (connection errors, 5xx) after which the owner is given up on."""
POLL_READ_S = 10.0
"""Longest wait for one poll's answer (vLLM answers a retrieve from memory)."""
TERMINAL_STATUSES = frozenset({"completed", "incomplete", "failed", "cancelled"})
"""vLLM's final statuses of a response (``ResponseStatus`` less ``queued``/``in_progress``)."""

OnEnd = Callable[[Mapping[str, Any] | None], Awaitable[None]]
"""Called once when a watched response ends: its final object, or None when it was given up."""


@dataclass(eq=False)
class _Watch:
    """One background response: where it lives, what holds it, and how its watcher is woken."""

    url: str  # the owner's ``/v1/responses/{id}``
    worker_url: str
    headers: Mapping[str, str]
    timeouts: TimeoutSettings
    deadline: float  # loop time
    hold: WorkerHold
    on_end: OnEnd
    final: Mapping[str, Any] | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # holds released, on_end done


class BackgroundWatchers:
    """The watchers of every background response this gateway process admitted."""

    def __init__(self, session: aiohttp.ClientSession, lookup: Callable[[str], Worker | None],
                 metrics: Metrics, *, poll_interval_s: float = POLL_INTERVAL_S,
                 max_errors: int = MAX_ERRORS) -> None:
        self._session = session
        self._lookup = lookup  # worker url -> the registry's Worker (None: left the fleet)
        self._metrics = metrics
        self._interval_s = poll_interval_s
        self._max_errors = max_errors
        self._watches: dict[tuple[str, str], _Watch] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    def __len__(self) -> int:
        """Watcher tasks running now (one per background response, until its holds end)."""
        return len(self._tasks)

    def watch(self, tenant: str, response_id: str, worker_url: str, pool: PoolSettings,
              timeouts: TimeoutSettings, on_end: OnEnd) -> None:
        """Hold ``worker_url`` for ``tenant``'s background response until it ends, then call
        ``on_end``. The worker hold is taken before this returns (no step of the event loop in
        which routing would not count it)."""
        worker = self._lookup(worker_url)
        if self._closed or worker is None:
            why = "the gateway is stopping" if self._closed else "its owner left the fleet"
            log.warning("background response %s of %s not watched: %s", response_id, tenant, why)
            if not self._closed:
                self._spawn(on_end(None))
            return  # stopping: the reservation is left to its lease (module doc)
        loop = asyncio.get_running_loop()
        w = _Watch(url=f"{worker_url}/v1/responses/{quote(response_id, safe='')}",
                   worker_url=worker_url, headers=credential(pool), timeouts=timeouts,
                   deadline=loop.time() + timeouts.read_s,
                   hold=WorkerHold(worker, worker.pool, 0, self._metrics), on_end=on_end)
        key = (tenant, response_id)
        self._watches[key] = w
        self._spawn(self._run(key, w))

    async def settle(self, tenant: str, response_id: str, body: bytes) -> None:
        """The owner's answer to a retrieve or cancel the gateway relays: when it shows a final
        status, the response's holds end now, before the client has the answer (a client that
        cancelled may start its next request at once), rather than at the next poll."""
        w = self._watches.get((tenant, response_id))
        if w is None:
            return
        final = _final(body)
        if final is not None:
            w.final = final
            w.wake.set()
            await w.ended.wait()

    async def close(self) -> None:
        """Stop every watcher (gateway shutdown): worker holds given back, reservations left
        to expire with their leases (module doc)."""
        self._closed = True
        await cancel_and_wait(self._tasks)
        # A task cancelled before its first step never ran its ``finally``: its hold is here.
        for w in self._watches.values():
            w.hold.release()
            w.ended.set()
        self._watches.clear()

    def _spawn(self, coro: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, key: tuple[str, str], w: _Watch) -> None:
        try:
            try:
                final, why = await self._until_final(w)
            finally:  # cancelled too (shutdown): the reservation is left to its lease
                self._watches.pop(key, None)
                w.hold.release()
            if final is None:
                log.warning("background response %s of %s on %s given up (%s): its reservation"
                            " is released whole", key[1], key[0], w.worker_url, why)
            try:
                await w.on_end(final)
            except Exception:  # the watcher set must outlive one failed release
                log.exception("ending background response %s failed", key[1])
        finally:
            w.ended.set()

    async def _until_final(self, w: _Watch) -> tuple[Mapping[str, Any] | None, str]:
        """The response's final object, or None and why it was given up."""
        loop = asyncio.get_running_loop()
        errors = 0
        while True:
            left = w.deadline - loop.time()
            if left <= 0:
                await self._cancel(w)
                return None, f"not finished within timeouts.read_s ({w.timeouts.read_s:g} s);" \
                             " asked the owner to cancel it"
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(self._interval_s, left)):
                    await w.wake.wait()
            if w.final is not None:
                return w.final, "settled"
            if self._lookup(w.worker_url) is None:
                return None, "its owner left the fleet"
            try:
                status, body = await self._get(w, "GET", w.url)
            except (aiohttp.ClientError, TimeoutError) as exc:
                status, body = 0, type(exc).__name__.encode()
            if status == 404:
                return None, "its owner no longer has it (restarted?)"
            final = _final(body) if status == 200 else None
            if final is not None:
                return final, "final"
            if status == 200:
                errors = 0  # still running
                continue
            errors += 1
            if errors >= self._max_errors:
                return None, f"{errors} failed polls in a row (last: {status or body.decode()})"

    async def _get(self, w: _Watch, method: str, url: str) -> tuple[int, bytes]:
        async with self._session.request(
            method, url, headers=w.headers,
            timeout=aiohttp.ClientTimeout(connect=w.timeouts.connect_s, sock_read=POLL_READ_S),
        ) as answer:
            return answer.status, await answer.read()

    async def _cancel(self, w: _Watch) -> None:
        """Best effort: a response past its deadline is cancelled on its owner."""
        try:
            await self._get(w, "POST", w.url + "/cancel")
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("cancelling background response at %s failed: %s", w.url, exc)


def _final(body: bytes) -> Mapping[str, Any] | None:
    """The response object in ``body`` when its status is final, else None."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if isinstance(obj, dict) and obj.get("status") in TERMINAL_STATUSES:
        return obj
    return None
