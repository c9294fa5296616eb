"""A bounded pool for tokenizing long prompts off the event loop.

Rendering a chat template and encoding a 100K-token prompt take tens of milliseconds, so long
prompts are tokenized in worker threads. anyio's default limiter lets 40 of them run at once: a
flood of long prompts then fills the process with tokenizing threads that share its cores (and
its GIL) with the event loop, and short chats wait behind them. ``TokenizePool`` bounds them:
at most ``max_workers`` prompts are tokenized at a time and the rest wait, in arrival order,
without a thread, where a cancelled request (the client went away) leaves the queue at no cost.

The default is one worker per process: the gateway runs a process per core, and the encoder
(``tokenizers``' ``encode_batch``) releases the GIL, so one thread already overlaps tokenizing
with the event loop; more threads would only compete for the same cores. Short prompts are still
tokenized inline on the loop: a thread hop costs more than encoding them.

A job is never abandoned: a thread cannot be killed, and one left running past a timeout would
keep its core while a new thread took its slot. The work itself stops instead
(``gateway.prompt.limits``): a prompt certainly too long is refused before it is encoded, and
rendering + encoding check a deadline (``limits.tokenize_timeout_s``) as they go, so a slow
template ends its job with ``PromptTimeoutError`` and the slot passes to the next prompt.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar, TypeVarTuple

import anyio
import anyio.to_thread

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


class TokenizePool:
    """At most ``max_workers`` tokenizations at a time, in threads; the others wait their turn."""

    def __init__(self, max_workers: int = 1) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be at least 1, not {max_workers}")
        self._limiter = anyio.CapacityLimiter(max_workers)

    async def run(self, fn: Callable[[*Ts], T], *args: *Ts) -> T:
        """``fn(*args)`` in a worker thread once one of the pool's slots is free."""
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter)
