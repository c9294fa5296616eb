"""Admission control for the whole gateway: a cap on requests in flight and a bounded queue.

``acquire`` admits at once while fewer than ``max_inflight`` requests are in flight; otherwise the
request waits in a FIFO queue of at most ``max_queued`` entries for up to ``queue_timeout_s``.
A full queue refuses at once and a wait that times out refuses then: both raise ``Overloaded``
(503 with Retry-After), so memory and sockets stay bounded however hard clients push. ``release``
hands the slot straight to the oldest waiter, so a queued request cannot be overtaken.
Cost: O(1) per request; one future per queued request.
"""

from __future__ import annotations

import asyncio
from collections import deque


class Overloaded(Exception):
    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class AdmissionGate:
    def __init__(self, max_inflight: int, max_queued: int, queue_timeout_s: float) -> None:
        self.max_inflight = max_inflight
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.inflight = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        if self.inflight < self.max_inflight and not self._waiters:
            self.inflight += 1
            return
        if len(self._waiters) >= self.max_queued:
            raise Overloaded(
                f"the gateway is at its limit of {self.max_inflight} requests in flight and"
                f" {self.max_queued} queued", retry_after_s=1.0)
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(self.queue_timeout_s):
                await waiter  # release() counted us in flight before waking us
        except TimeoutError:
            raise Overloaded(
                f"the gateway is at its limit of {self.max_inflight} requests in flight; waited"
                f" {self.queue_timeout_s:g} s in the queue", retry_after_s=self.queue_timeout_s,
            ) from None
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.release()  # woken and cancelled at once: pass the slot on
            raise
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot moves to the waiter: inflight unchanged
                return
        self.inflight -= 1
