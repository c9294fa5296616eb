"""A bounded pool for tokenizing long prompts off the event loop.

Rendering a chat template and encoding a 100K-token prompt take tens of milliseconds, so long
prompts are tokenized in worker threads. anyio's default limiter lets 40 of them run at once: a
flood of long prompts then fills the process with tokenizing threads that share its cores (and
its GIL) with the event loop, and short chats wait behind them. ``TokenizePool`` bounds them:
at most ``max_workers`` prompts are tokenized at a time and the rest wait without a thread, where
a cancelled request (the client went away) leaves the queue at no cost.

The waiting jobs are served tenant by tenant (round robin over the tenants with jobs waiting,
each tenant's in arrival order). One queue in arrival order let a tenant hold every other's long
prompts behind its own: two 15 MB ``/tokenize`` bodies of one key kept another key's 24 KB chat
waiting 31 s (``tests/security/test_surface.py``), and the admission gate's fair share does not
reach this queue (it orders requests only once the gateway is full). In turns, a job waits for at
most one job of each other tenant with jobs waiting, whatever they have queued. Cost: one dict
lookup and a deque append per job that waits, nothing for one that finds a free thread.

The default is one worker per process: the gateway runs a process per core, and the encoder
(``tokenizers``' ``encode_batch``) releases the GIL, so one thread already overlaps tokenizing
with the event loop; more threads would only compete for the same cores. Short prompts are still
tokenized inline on the loop: a thread hop costs more than encoding them.

``/tokenize`` reads a large body before it queues here (it has no admission gate: it holds no
KV, and a slot holding none would never advance its tenant's fair-share clock). So that one
tenant's connections cannot each hold a whole body in memory while they wait, a large body is
read only with one of its tenant's ``READERS_PER_TENANT`` permits (``reading``), kept until its
job is done; the others' bytes wait in their sockets. Memory for waiting bodies is then at most
that many bodies per tenant (the configured keys), and a slow upload holds only its own tenant's
permit.

A job is never abandoned: a thread cannot be killed, and one left running past a timeout would
keep its core while a new thread took its slot. The work itself stops instead
(``gateway.prompt.limits``): a prompt certainly too long is refused before it is encoded, and
rendering + encoding check a deadline (``limits.tokenize_timeout_s``) as they go, so a slow
template ends its job with ``PromptTimeoutError`` and the slot passes to the next prompt.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable
from typing import TypeVar, TypeVarTuple

import anyio
import anyio.to_thread

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


READERS_PER_TENANT = 2
"""Large bodies of one tenant read and waiting for (or in) the tokenizing thread at a time: one
tokenizing, one ready to go next."""


class _Readers:
    """One tenant's permits to read large bodies (``TokenizePool.reading``)."""

    __slots__ = ("held", "permits", "users")

    def __init__(self) -> None:
        self.permits = asyncio.Semaphore(READERS_PER_TENANT)
        self.users = 0  # holding a permit or waiting for one
        self.held = 0


class TokenizePool:
    """At most ``max_workers`` tokenizations at a time, in threads; the others wait their turn,
    tenant by tenant."""

    def __init__(self, max_workers: int = 1) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be at least 1, not {max_workers}")
        self._limiter = anyio.CapacityLimiter(max_workers)
        self._free = max_workers
        # tenant -> its waiting jobs' turns; the first tenant is served next
        self._waiting: OrderedDict[str, deque[asyncio.Future[None]]] = OrderedDict()
        self._readers: dict[str, _Readers] = {}  # tenants with a large body read or waiting

    def readers(self, tenant: str) -> int:
        """``tenant``'s large bodies holding a permit (``reading``); those waiting for one not."""
        readers = self._readers.get(tenant)
        return 0 if readers is None else readers.held

    @contextlib.asynccontextmanager
    async def reading(self, tenant: str) -> AsyncIterator[None]:
        """Hold one of ``tenant``'s ``READERS_PER_TENANT`` permits to read a large body and
        tokenize it; wait (the body unread) while they are all taken."""
        readers = self._readers.get(tenant)
        if readers is None:
            readers = self._readers[tenant] = _Readers()
        readers.users += 1
        try:
            async with readers.permits:
                readers.held += 1
                try:
                    yield
                finally:
                    readers.held -= 1
        finally:
            readers.users -= 1
            if not readers.users:
                del self._readers[tenant]

    @property
    def waiting(self) -> int:
        """Jobs waiting for a thread."""
        return sum(len(turns) for turns in self._waiting.values())

    async def run(self, fn: Callable[[*Ts], T], *args: *Ts, tenant: str = "") -> T:
        """``fn(*args)`` in a worker thread once ``tenant``'s turn comes and a slot is free."""
        await self._turn(tenant)
        try:
            # anyio waits for the thread even when cancelled: the slot is free only after it
            return await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter)
        finally:
            self._pass_on()

    async def _turn(self, tenant: str) -> None:
        if self._free > 0 and not self._waiting:
            self._free -= 1
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(tenant, deque()).append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self._pass_on()  # handed the slot as it was cancelled: the next one takes it
            else:
                turns = self._waiting.get(tenant)
                if turns is not None and turn in turns:
                    turns.remove(turn)
                    if not turns:
                        del self._waiting[tenant]
            raise

    def _pass_on(self) -> None:
        """A slot is free: to the first waiting tenant's oldest job (that tenant then goes
        behind the others), else back to the pool."""
        while self._waiting:
            tenant, turns = next(iter(self._waiting.items()))
            turn = turns.popleft()
            if turns:
                self._waiting.move_to_end(tenant)
            else:
                del self._waiting[tenant]
            if not turn.done():
                turn.set_result(None)
                return
        self._free += 1
