"""One ``MemoryBudgetStore`` shared by the processes of one gateway (``kvgate serve --processes N``).

Budgets must hold over the whole gateway, not per process: a session limited to 2 requests in
flight gets 2 however the accept socket spreads its connections. With ``budgets.store: redis``
every process already talks to Redis; with the memory store the supervisor hosts the one store
(``SharedBudgetServer``) on a unix socket in the gateway's runtime directory, and each process
uses ``SharedBudgetStore``, a ``BudgetStore`` client of it. The accounting is
``MemoryBudgetStore``'s, unchanged: the server calls its synchronous operations
(``reserve_sync``...) inside the callback that read the calls, one at a time, so each stays atomic
across processes.

Steps of a call, per process, on one connection:

1. the client packs the call (``[op, call_id, *args]``, msgpack, the op a small int and the values
   flat: no per-call dataclass walk) into its connection's buffer; the first call of an
   event-loop iteration schedules one flush (``loop.call_soon``), so every call issued in that
   iteration goes out in one ``write``;
2. the server unpacks everything one ``data_received`` brought, runs each call in order, and
   answers them all with one ``write``: ``[call_id, OK, result]``, ``[call_id, REFUSED,
   rejection fields]`` (a ``BudgetError``, rebuilt as the same class on the client) or
   ``[call_id, FAILED, message]``;
3. the client resolves each call's future from the replies (a refusal or failure is set as the
   future's exception, so the caller's ``await`` raises it directly).

A **release** of a reservation this process made, whose lease (as this process last saw it) runs
for at least ``RELEASE_NOWAIT_MARGIN_S`` more, is sent without a reply (op ``RELEASE_NOWAIT``)
and returns ``True`` at once: the request finishes without waiting for the supervisor, and the
supervisor writes nothing back. It stays exact: the release travels on the same ordered stream as
every later call of this process (a later reserve of the same session is run after it), and only
a lease reaped first can make the server find nothing, which needs another call timed at or after
the lease's expiry to reach the server before this release, at least the margin later. Other
processes are not ordered after it, and need not be: a release only frees capacity, so a reserve
that overtakes it sees the budget as it was a moment earlier (the dispatcher releases after the
response was sent, so a client's next request could overtake a release with a reply too). Any
other release (not made here: released twice, reaped, or another process's) asks the server and
returns its answer. The one answer taken on trust: ``True`` for a reservation made here that
another process released first; ``BudgetService`` releases only what its own process holds.

Cost, measured on the 2-core development machine (``kvgate_kv_hf_p2``, short chats, wrk c=32,
CPU per request from /proc; noisy, the cores are shared): the supervisor spent 76-135 us per
request (median ~96) when every call was its own write and its own reply, read through an asyncio
stream, its values walked with ``dataclasses.fields``; now 32-75 us (median ~50). In a gateway
process the budget calls fell from ~14% of its py-spy samples (most of it one ``write`` syscall
per call) to ~5%. What remains in the supervisor is mostly the event loop's wake-up, read and
write per batch (about half its samples, in native code); batches grow with load, so the cost
per request falls as concurrency rises. Compiled, on a machine twice as fast (session 29): 11-13
us, of which ~10% was the ``StopIteration`` of each operation driven to its end by hand (the
store's operations are now called as plain functions); after it 9-10 us. The supervisor is one
process however many the gateway has, so this figure bounds the whole gateway's request rate
(``python -m gateway.bench.overhead`` prints the bound). The trade-off: a call waits for the end
of its event-loop iteration before it is written (the other ready callbacks run first:
microseconds).

A lost connection (the supervisor gone) fails every pending and later call with
``StoreUnavailableError`` until ``start`` reconnects: ``BudgetService`` applies its outage policy
and probes, as it does for Redis. A release sent without a reply that the connection lost is
reaped when its lease expires, as a release Redis missed is.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import msgpack

from gateway.budgets.errors import BudgetError, StoreUnavailableError
from gateway.budgets.memory import MemoryBudgetStore
from gateway.budgets.models import (
    BudgetLimits,
    Reservation,
    ReserveRequest,
    SessionUsage,
    Throttle,
    ThrottleState,
)

SHARED_STORE_NAME = "shared"
"""``Reservation.store`` of reservations in the shared store (the server's store carries it)."""

SOCKET_NAME = "budgets.sock"
"""The server's socket, in the gateway's runtime directory (``ProcessRole.runtime_dir``)."""

OK, REFUSED, FAILED = 0, 1, 2
"""The status of a reply."""

(RESERVE, RELEASE, RELEASE_NOWAIT, RENEW, SET_THROTTLE, CLEAR_THROTTLE, USAGE, TOP, THROTTLED,
 PING, SHRINK) = range(11)
"""Operations on the wire: every frame is ``[op, call_id, *args]``; ``RELEASE_NOWAIT`` gets no
reply."""

RELEASE_NOWAIT_MARGIN_S = 1.0
"""A release is sent without a reply only while the lease it releases has at least this long
left: the time the release has to reach the server before any other call could reap that lease."""

LIMITS_CACHE_SIZE = 1024
"""Most distinct ``BudgetLimits`` the server keeps built (they come from the configuration: a
few per tenant); past this the cache starts over."""


def socket_path(runtime_dir: Path) -> Path:
    return runtime_dir / SOCKET_NAME


# -- values on the wire -----------------------------------------------------------------------


def _limits_out(b: BudgetLimits) -> tuple[int | None, ...]:
    return (b.request_kv_bytes, b.inflight_kv_bytes, b.inflight_requests, b.kv_byte_seconds,
            b.requests_per_minute, b.tokens_per_minute)


def _throttle_out(t: Throttle | None) -> list[Any] | None:
    if t is None:
        return None
    return [t.state.value, t.expires_at, t.reason, t.max_inflight_requests, t.budget_factor,
            t.set_at]


def _throttle_in(raw: list[Any] | None) -> Throttle | None:
    if raw is None:
        return None
    state, *rest = raw
    return Throttle(ThrottleState(state), *rest)


def _usage_out(u: SessionUsage | None) -> list[Any] | None:
    if u is None:
        return None
    return [u.tenant, u.session_id, u.inflight_kv_bytes, u.inflight_requests,
            u.kv_byte_seconds_available, u.kv_byte_seconds_capacity, u.requests_available,
            u.requests_capacity, u.tokens_available, u.tokens_capacity, u.hold_ewma_s,
            _throttle_out(u.throttle)]


def _usage_in(raw: list[Any] | None) -> SessionUsage | None:
    if raw is None:
        return None
    raw[-1] = _throttle_in(raw[-1])
    return SessionUsage(*raw)


def _reservation_out(r: Reservation) -> list[Any]:
    return [r.id, r.tenant, r.session_id, r.kv_bytes, r.tokens, r.started_at, r.lease_expires_at,
            r.store]


_REJECTIONS: dict[str, type[BudgetError]] = {cls.code: cls for cls in BudgetError.__subclasses__()}


def _rejection_out(exc: BudgetError) -> list[Any]:
    return [exc.code, exc.message, exc.reason, exc.limit, exc.retry_after_s, exc.level]


def _rejection_in(raw: list[Any]) -> BudgetError:
    code, message, reason, limit, retry_after_s, level = raw
    return _REJECTIONS.get(code, BudgetError)(
        message, reason=reason, limit=limit, retry_after_s=retry_after_s, level=level)


# -- server (in the supervisor) -----------------------------------------------------------------


class SharedBudgetServer:
    """Serves ``store`` on a unix socket at ``path`` until closed."""

    def __init__(self, store: MemoryBudgetStore, path: Path) -> None:
        self._store = store
        self._path = path
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[_ServerConnection] = set()
        self._limits: dict[tuple[Any, ...], BudgetLimits] = {}
        self._packer = msgpack.Packer()  # one for every reply: ``packb`` builds one per call
        s = store
        self._ops: dict[int, Callable[..., Any]] = {
            RESERVE: self._reserve,
            RELEASE: s.release_sync,
            RELEASE_NOWAIT: s.release_sync,  # the same; nobody is told
            RENEW: s.renew_sync,
            SET_THROTTLE: lambda tenant, sid, throttle, now: s.set_throttle_sync(
                tenant, sid, cast(Throttle, _throttle_in(throttle)), now),
            CLEAR_THROTTLE: s.clear_throttle_sync,
            USAGE: lambda *a: _usage_out(s.usage_sync(*a)),
            TOP: lambda *a: [_usage_out(u) for u in s.top_sync(*a)],
            THROTTLED: lambda *a: [_usage_out(u) for u in s.throttled_sync(*a)],
            PING: lambda: None,
            SHRINK: s.shrink_sync,
        }

    async def start(self) -> None:
        await self._store.start()
        self._server = await asyncio.get_running_loop().create_unix_server(
            lambda: _ServerConnection(self), path=str(self._path))

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for conn in list(self._connections):
                conn.close()
            await self._server.wait_closed()
            self._server = None
        await self._store.close()
        self._path.unlink(missing_ok=True)

    def _budget_limits(self, raw: list[Any]) -> BudgetLimits:
        # Built once per distinct value: BudgetLimits validates its six fields on every build.
        key = tuple(raw)
        limits = self._limits.get(key)
        if limits is None:
            if len(self._limits) >= LIMITS_CACHE_SIZE:
                self._limits.clear()
            limits = self._limits[key] = BudgetLimits(*key)
        return limits

    def _reserve(self, tenant: str, session_id: str, reservation_id: str, kv_bytes: int,
                 tokens: int, limits: list[Any], tenant_limits: list[Any], window_s: float,
                 lease_ttl_s: float, now: float) -> list[Any]:
        request = ReserveRequest(tenant, session_id, reservation_id, kv_bytes, tokens,
                                 self._budget_limits(limits), self._budget_limits(tenant_limits),
                                 window_s, lease_ttl_s, now)
        return _reservation_out(self._store.reserve_sync(request))

    def run(self, frames: msgpack.Unpacker) -> bytes:
        """Run every call in ``frames`` in order; the replies, packed together."""
        replies: list[bytes] = []
        pack = self._packer.pack
        for frame in frames:
            op, call_id, *args = frame
            try:
                result = self._ops[op](*args)
            except BudgetError as exc:
                status, result = REFUSED, _rejection_out(exc)
            except Exception as exc:  # the caller's request fails, the server keeps serving
                status, result = FAILED, f"{type(exc).__name__}: {exc}"
            else:
                status = OK
            if op != RELEASE_NOWAIT:
                replies.append(pack([call_id, status, result]))
        return b"".join(replies)


class _ServerConnection(asyncio.Protocol):
    """One gateway process's connection: every batch read is answered with one write."""

    def __init__(self, server: SharedBudgetServer) -> None:
        self._server = server
        self._transport: asyncio.Transport | None = None
        self._unpacker = msgpack.Unpacker(use_list=True)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self._server._connections.add(self)

    def data_received(self, data: bytes) -> None:
        self._unpacker.feed(data)
        replies = self._server.run(self._unpacker)
        if replies and self._transport is not None:
            self._transport.write(replies)

    # A process that stops reading its replies stops being read: its calls wait in the kernel.
    def pause_writing(self) -> None:
        if self._transport is not None:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        if self._transport is not None:
            self._transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._server._connections.discard(self)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


# -- client (in each gateway process) -----------------------------------------------------------


class _Connection(asyncio.Protocol):
    """Buffers the calls of one event-loop iteration into one write; matches pipelined replies
    to their calls; a lost connection fails every pending call."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.pending: dict[int, asyncio.Future[Any]] = {}
        self._unpacker = msgpack.Unpacker(use_list=True)
        self._out: list[bytes] = []
        self._packer = msgpack.Packer()  # one for every call: ``packb`` builds one per call
        self._loop = asyncio.get_running_loop()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def send(self, frame: list[Any]) -> None:
        if not self._out:
            self._loop.call_soon(self.flush)
        self._out.append(self._packer.pack(frame))

    def flush(self) -> None:
        if self._out and self.transport is not None:
            self.transport.write(b"".join(self._out))
        self._out.clear()

    def data_received(self, data: bytes) -> None:
        self._unpacker.feed(data)
        pending = self.pending
        for call_id, status, result in self._unpacker:
            future = pending.pop(call_id, None)
            if future is None or future.done():  # its caller was cancelled
                continue
            if status == OK:
                future.set_result(result)
            elif status == REFUSED:
                future.set_exception(_rejection_in(result))
            else:
                future.set_exception(RuntimeError(f"shared budget store: {result}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._out.clear()
        for future in self.pending.values():
            if not future.done():
                future.set_exception(StoreUnavailableError("shared budget store: connection lost"))
        self.pending.clear()


class SharedBudgetStore:
    """The ``BudgetStore`` a gateway process uses when its supervisor hosts the memory store."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._conn: _Connection | None = None
        self._ids = itertools.count()
        self._made: dict[str, tuple[str, str, float]] = {}
        """Reservations made through this store and not released by it: id -> (tenant,
        session, lease expiry as last seen); what a release without a reply may release."""

    @property
    def name(self) -> str:
        return SHARED_STORE_NAME

    async def start(self) -> None:
        if self._conn is not None and self._conn.transport is not None:
            return
        # What the server still holds after a lost connection is not known here: ask it.
        self._made.clear()
        try:
            _, self._conn = await asyncio.get_running_loop().create_unix_connection(
                _Connection, str(self._path))
        except OSError as exc:
            raise StoreUnavailableError(f"shared budget store at {self._path}: {exc}") from exc

    async def close(self) -> None:
        conn = self._conn
        if conn is not None and conn.transport is not None:
            conn.flush()  # releases sent without a reply are still delivered
            conn.transport.close()
        self._conn = None

    def _connection(self) -> _Connection:
        conn = self._conn
        if conn is None or conn.transport is None:
            raise StoreUnavailableError("shared budget store: not connected")
        return conn

    async def _call(self, op: int, *args: Any) -> Any:
        conn = self._connection()
        call_id = next(self._ids)
        future: asyncio.Future[Any] = conn._loop.create_future()
        conn.pending[call_id] = future
        conn.send([op, call_id, *args])
        try:
            return await future
        finally:
            conn.pending.pop(call_id, None)

    async def ping(self) -> None:
        await self._call(PING)

    async def reserve(self, request: ReserveRequest) -> Reservation:
        r = request
        raw = await self._call(RESERVE, r.tenant, r.session_id, r.reservation_id, r.kv_bytes,
                               r.tokens, _limits_out(r.limits), _limits_out(r.tenant_limits),
                               r.window_s, r.lease_ttl_s, r.now)
        reservation = Reservation(*raw)
        self._made[reservation.id] = (reservation.tenant, reservation.session_id,
                                      reservation.lease_expires_at)
        return reservation

    async def release(
        self, tenant: str, session_id: str, reservation_id: str, now: float,
        actual_tokens: int | None,
    ) -> bool:
        made = self._made.pop(reservation_id, None)
        if (made is not None and made[0] == tenant and made[1] == session_id
                and made[2] - now >= RELEASE_NOWAIT_MARGIN_S):
            self._connection().send([RELEASE_NOWAIT, 0, tenant, session_id, reservation_id, now,
                                     actual_tokens])
            return True
        return bool(await self._call(RELEASE, tenant, session_id, reservation_id, now,
                                     actual_tokens))

    async def renew(
        self, tenant: str, session_id: str, reservation_id: str, now: float, lease_ttl_s: float
    ) -> float | None:
        expires: float | None = await self._call(RENEW, tenant, session_id, reservation_id,
                                                 now, lease_ttl_s)
        made = self._made.get(reservation_id)
        if made is not None:
            if expires is None:
                del self._made[reservation_id]
            else:
                self._made[reservation_id] = (made[0], made[1], expires)
        return expires

    async def shrink(
        self, tenant: str, session_id: str, reservation_id: str, now: float, kv_bytes: int
    ) -> int | None:
        held: int | None = await self._call(SHRINK, tenant, session_id, reservation_id, now,
                                            kv_bytes)
        return held

    async def set_throttle(
        self, tenant: str, session_id: str | None, throttle: Throttle, now: float
    ) -> None:
        await self._call(SET_THROTTLE, tenant, session_id, _throttle_out(throttle), now)

    async def clear_throttle(self, tenant: str, session_id: str | None, now: float) -> bool:
        return bool(await self._call(CLEAR_THROTTLE, tenant, session_id, now))

    async def usage(self, tenant: str, session_id: str | None, now: float) -> SessionUsage | None:
        return _usage_in(await self._call(USAGE, tenant, session_id, now))

    async def top(self, tenant: str, k: int, now: float) -> list[SessionUsage]:
        return self._usages(await self._call(TOP, tenant, k, now))

    async def throttled(self, tenant: str, now: float, limit: int) -> list[SessionUsage]:
        return self._usages(await self._call(THROTTLED, tenant, now, limit))

    @staticmethod
    def _usages(raw: list[list[Any]]) -> list[SessionUsage]:
        return [u for r in raw if (u := _usage_in(r)) is not None]
