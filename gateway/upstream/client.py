"""The hot path's upstream client: HTTP/1.1 POSTs over kept-alive connections, on
``asyncio.Protocol`` + ``httptools`` (the parser uvicorn uses).

One ``post``, step by step:

1. take the origin's most recently used idle connection that is still open (see RACE below),
   else connect (bounded by ``connect_timeout_s``; TLS for an ``https`` worker);
2. write the request: head and body in one ``transport.write`` up to ``ONE_WRITE_BODY_BYTES``; a
   larger body in ``WRITE_PIECE_BYTES`` pieces, each written only while the transport has not
   asked to pause (``pause_writing``/``resume_writing``), so megabytes never sit in its buffer;
3. wait for the response head; with ``read_timeout_s`` set (non-streamed answers) every wait for
   bytes, the head's included, is bounded by it (one timer per connection, armed by the first
   exchange that needs it and re-armed for what is left when it fires early: no task, no timer
   per request or chunk);
4. hand the body out as it arrives (``async for chunk in response``: whatever has arrived, joined;
   chunked transfer-encoding already de-chunked by the parser) or whole (``read``). Unread bytes
   past ``READ_HIGH_WATER_BYTES`` pause the socket's reading; it resumes once the reader takes
   them, so a slow client of a fast stream holds at most that much here. A reader may set a
   ``sink``: while it waits for bytes with none buffered, each piece that arrives goes to the
   sink first, in the protocol's callback; a piece the sink takes never wakes the reader (no
   future, no task step per chunk: see ``gateway.upstream.relay``, the stream's token phase);
5. ``release``: the connection goes back to its origin's pool when the answer was read whole and
   is keep-alive, else it is closed. ``close``: the connection is dropped, mid-stream too; that
   is how vLLM learns the client left, and aborts the request.

Idle connections live at most ``KEEPALIVE_S`` (4 s): vLLM's uvicorn closes them at 5 s, and one
closed under a request in flight fails that request (RACE). At most ``MAX_IDLE_PER_ORIGIN`` stay
idle per worker (the oldest closed first); connections in use are not limited (``limit=0`` in
the aiohttp connector this replaces). A connection the worker closes while idle leaves the pool at
once (``connection_lost``).

ERRORS, and what each proves (``gateway.upstream.placement.never_reached`` retries on them):

* ``ConnectError`` (refused, unreachable, name not resolved, TLS refused), ``ConnectTimeout``:
  no connection, so nothing was sent: never reached.
* ``ResetError``: a TCP reset (ECONNRESET, or EPIPE while writing) before any byte of the
  answer. A socket is reset when closed with received bytes unread, or when bytes reach a socket
  already closed: the worker did not read the whole request, and vLLM starts nothing before it
  has it: never reached.
* ``ServerDisconnected`` (a FIN before the answer was whole), ``ConnectionLost`` (any other
  socket error, or a reset after part of the answer): the worker may have run the request.
* ``ReadTimeout`` (also a ``TimeoutError``): no byte for ``read_timeout_s``.
* ``ProtocolError``: the answer was not HTTP/1.1.

RACE. A kept-alive connection that the worker closes just as a request is written on it is the
race every HTTP/1.1 client has (aiohttp too: it retries a reused connection only for idempotent
methods, never a POST). What is done about it, safest first:

* never reuse what is known closed: an idle connection leaves the pool on the worker's FIN or RST
  (the loop handles them before this request runs), and ``take`` skips a closing transport;
* prefer the most recently used connection (LIFO): the fewer seconds idle, the further from the
  worker's keep-alive limit; none older than ``KEEPALIVE_S`` is used;
* a reused connection reset before any byte of the answer (the worker closed it and our bytes
  met the closed socket: ``ResetError``) is retried once here on a fresh connection to the same
  worker: it proves the worker never read the request, and the worker is healthy, so neither a
  second worker nor a failure report is called for;
* a reused connection that gets a FIN and no answer is NOT retried (``ServerDisconnected``): a
  worker that read the request and then died closes the same way. With the 1 s margin under
  uvicorn's keep-alive this needs the FIN to cross our request on the wire (microseconds).

COST. The client alone, 32 concurrent short non-streamed chats to ``gateway.bench.noop`` on
uvloop, CPU of the client process per request (post, read, release): 28-30 µs, against 84-120 µs
through the aiohttp session it replaces (three alternating runs); about half of what is left is
the ``send`` system call of step 2. The trade-off: HTTP/1.1 POST only, identity bodies (no
``accept-encoding`` is sent, so none comes back compressed), no proxies, no cookies: what
forwarding to vLLM needs and nothing else; the aiohttp session stays for the other calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
import ssl
from collections import deque
from collections.abc import Callable, Mapping
from typing import cast
from urllib.parse import urlsplit

import httptools

from gateway.upstream.errors import (
    ConnectError,
    ConnectionLost,
    ConnectTimeout,
    ProtocolError,
    ReadTimeout,
    ResetError,
    ServerDisconnected,
    UpstreamError,
)

KEEPALIVE_S = 4.0
"""An idle connection is used, and kept, for at most this long (uvicorn closes them at 5 s)."""
MAX_IDLE_PER_ORIGIN = 256
ONE_WRITE_BODY_BYTES = 1024 * 1024  # aiohttp's own threshold for one write of raw bytes
WRITE_PIECE_BYTES = 64 * 1024
READ_HIGH_WATER_BYTES = 256 * 1024
"""Unread body bytes past this pause the socket's reading; taking them resumes it (the reader
takes all that is buffered at once, so the low-water mark is an empty buffer)."""
RESET_ERRNOS = frozenset({errno.ECONNRESET, errno.EPIPE})


class Response:
    """One answer. ``status`` and ``headers`` (lower-case names) are known on return from
    ``post``; the body is ``read`` whole or iterated (``async for chunk in response``)."""

    __slots__ = ("_buffered_bytes", "_chunks", "_conn", "_exc", "_released", "_waiter",
                 "complete", "headers", "sink", "status")

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self.status = 0
        self.headers: dict[str, str] = {}
        self._chunks: list[bytes] = []
        self._buffered_bytes = 0
        self.complete = False  # the whole body has arrived
        self._exc: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._released = False
        self.sink: Callable[[bytes], bool] | None = None
        """Offered each arriving piece of the body while the reader waits on ``__anext__`` with
        nothing buffered (so the sink's output cannot overtake the reader's); True: taken, the
        reader never sees it; False: buffered for the reader as without a sink."""

    @property
    def at_eof(self) -> bool:
        """The whole body has arrived and been read."""
        return self.complete and not self._chunks

    async def read(self) -> bytes:
        """The whole body (what was not iterated already)."""
        parts: list[bytes] = []
        while not self.complete or self._chunks:
            if self._chunks:
                parts.append(self._take())
            elif self._exc is not None:
                raise self._exc
            else:
                await self._wait()
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def __aiter__(self) -> Response:
        return self

    async def __anext__(self) -> bytes:
        """What has arrived since the last chunk taken (waiting for some when none has)."""
        while True:
            if self._chunks:
                return self._take()
            if self.complete:
                raise StopAsyncIteration
            if self._exc is not None:
                raise self._exc
            await self._wait()

    def release(self) -> None:
        """Give the connection back: to the pool when the answer was read whole and the
        connection may be kept alive, else closed."""
        if self._released:
            return
        conn = self._conn
        if self.at_eof and conn.keep_alive and not conn.lost:
            self._released = True
            conn.response = None
            conn.pool.put(conn)
        else:
            self.close()

    def close(self) -> None:
        """Drop the connection (mid-answer too: the worker sees the client leave)."""
        if self._released:
            return
        self._released = True
        conn = self._conn
        conn.response = None
        conn.cancel_timer()
        conn.drop()

    def _take(self) -> bytes:
        chunks = self._chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered_bytes = 0
        if self._conn.reading_paused:
            self._conn.resume_reading()
        return data

    async def _wait(self) -> None:
        waiter = self._waiter = self._conn.loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            # cleared at once: a set waiter means a reader parked with nothing buffered (sink)
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def _fail(self, exc: UpstreamError) -> None:
        if self._exc is None and not self.complete:
            self._exc = exc
            self._wake()


class _Connection(asyncio.Protocol):
    """One connection to a worker: the protocol the transport calls, and the parser's callback
    object (httptools calls only the callbacks defined here)."""

    def __init__(self, pool: _Pool, loop: asyncio.AbstractEventLoop) -> None:
        self.pool = pool
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None  # the exchange in progress; None while idle
        self.head_done = False
        self.answered = False  # a byte of the current answer has arrived
        self.keep_alive = False
        self.lost = False
        self.idle_since_s = 0.0
        self.reading_paused = False
        self.writing_paused = False
        self.drained: asyncio.Future[None] | None = None
        # read timeout: one timer per connection, re-armed lazily; data only stamps the time of
        # its arrival
        self.read_timeout_s: float | None = None
        self.last_data_s = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.timer_due_s = 0.0

    # -- the exchange --------------------------------------------------------------------------

    async def exchange(self, head: bytes, body: bytes, read_timeout_s: float | None) -> Response:
        transport = self.transport
        assert transport is not None
        if self.lost:  # closed by the worker before a byte was sent: nothing reached it
            raise ConnectError("the worker closed the connection before the request was sent")
        r = self.response = Response(self)
        self.head_done = self.answered = self.keep_alive = False
        try:
            if len(body) <= ONE_WRITE_BODY_BYTES:
                transport.write(head + body)
            else:
                transport.write(head)
                await self._write_pieces(memoryview(body))
            if read_timeout_s is not None:
                self.read_timeout_s = read_timeout_s
                self.last_data_s = now_s = self.loop.time()
                due_s = now_s + read_timeout_s
                # One timer per connection, armed lazily: one still armed for a due time no
                # later than this one's re-arms itself for what is left when it fires
                # (``_check_read_timeout``), so a connection that answers request after request
                # arms about one per read_timeout_s instead of one per request.
                if self.timer is None or self.timer_due_s > due_s:
                    if self.timer is not None:
                        self.timer.cancel()
                    self.timer = self.loop.call_at(due_s, self._check_read_timeout)
                    self.timer_due_s = due_s
            while not self.head_done:
                if r._exc is not None:
                    raise r._exc
                await r._wait()
        except BaseException:
            # no answer (or cancelled before it): the connection goes, so the worker sees the
            # request abandoned
            r.close()
            raise
        return r

    async def _write_pieces(self, body: memoryview) -> None:
        transport = self.transport
        assert transport is not None
        for start in range(0, len(body), WRITE_PIECE_BYTES):
            if self.lost:
                return  # the failure reaches the waiter for the head
            transport.write(body[start:start + WRITE_PIECE_BYTES])
            if self.writing_paused:
                self.drained = self.loop.create_future()
                try:
                    await self.drained
                finally:
                    self.drained = None

    def _check_read_timeout(self) -> None:
        self.timer = None
        r, timeout_s = self.response, self.read_timeout_s
        if r is None or r.complete or timeout_s is None:
            return  # idle, or an answer without a read timeout: the next exchange arms one
        due_s = self.last_data_s + timeout_s
        if due_s > self.loop.time():
            self.timer = self.loop.call_at(due_s, self._check_read_timeout)
            self.timer_due_s = due_s
            return
        r._fail(ReadTimeout(f"no byte from the worker in {timeout_s} s"))
        self.drop()

    def cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.read_timeout_s = None

    def drop(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.close()

    # -- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            # asyncio sets it already; uvloop may not. Small writes must not wait on ACKs.
            with contextlib.suppress(OSError, AttributeError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        r = self.response
        if r is None or r.complete:  # nothing was asked: not a worker we can talk to
            self.drop()
            return
        self.answered = True
        if self.read_timeout_s is not None:
            self.last_data_s = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            r._fail(ProtocolError(f"malformed answer from the worker: {exc}"))
            self.drop()

    def eof_received(self) -> bool | None:
        return None  # the transport closes; connection_lost says what it means

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.cancel_timer()
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)
        r = self.response
        if r is None:
            self.pool.forget(self)  # idle: it leaves the pool
            return
        if r.complete:
            return
        if exc is None and self.head_done and not (
                "content-length" in r.headers or "transfer-encoding" in r.headers):
            r.complete = True  # a body that ends with the connection (httptools has no EOF)
            r._wake()
        elif exc is None:
            r._fail(ServerDisconnected("the worker closed the connection"))
        elif (isinstance(exc, OSError) and exc.errno in RESET_ERRNOS and not self.answered):
            r._fail(ResetError(exc.errno))
        else:
            r._fail(ConnectionLost(getattr(exc, "errno", None), str(exc) or type(exc).__name__))

    def pause_writing(self) -> None:
        self.writing_paused = True

    def resume_writing(self) -> None:
        self.writing_paused = False
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)

    def resume_reading(self) -> None:
        self.reading_paused = False
        if self.transport is not None and not self.lost:
            self.transport.resume_reading()

    # -- httptools callbacks ---------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        r = self.response
        if r is not None:
            r.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        r = self.response
        if r is None:
            return
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # an interim answer (100 Continue): the real one follows
            r.headers.clear()
            return
        r.status = status
        self.keep_alive = self.parser.should_keep_alive()
        self.head_done = True
        r._wake()

    def on_body(self, body: bytes) -> None:
        r = self.response
        if r is None:
            return
        sink, waiter = r.sink, r._waiter
        # (a waiter done already is a reader cancelled, by a timeout say: the sink is not asked)
        if sink is not None and waiter is not None and not waiter.done() and sink(body):
            return  # the reader waits with nothing buffered: the sink passed it on already
        r._chunks.append(body)
        r._buffered_bytes += len(body)
        if r._buffered_bytes > READ_HIGH_WATER_BYTES and not self.reading_paused:
            assert self.transport is not None
            self.reading_paused = True
            self.transport.pause_reading()
        r._wake()

    def on_message_complete(self) -> None:
        r = self.response
        if r is None or not self.head_done:
            return  # the end of an interim answer
        r.complete = True
        self.read_timeout_s = None  # the timer stays armed for the next exchange (``exchange``)
        r._wake()


class _Pool:
    """One origin's idle connections, most recently used last."""

    __slots__ = ("client", "host", "host_header", "idle", "port", "prefix", "server_hostname",
                 "sweeper", "tls")

    def __init__(self, client: UpstreamClient, origin: str) -> None:
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) origin: {origin!r}")
        self.client = client
        self.tls = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.tls else 80)
        self.server_hostname = self.host if self.tls else None
        self.host_header = parts.netloc.rpartition("@")[2]
        self.prefix = parts.path  # a worker behind a path: its url + the endpoint's path
        self.idle: deque[_Connection] = deque()
        self.sweeper: asyncio.TimerHandle | None = None

    def take(self, now_s: float) -> _Connection | None:
        idle = self.idle
        while idle:
            conn = idle.pop()
            transport = conn.transport
            if (conn.lost or transport is None or transport.is_closing()
                    or now_s - conn.idle_since_s >= KEEPALIVE_S):
                conn.drop()
                continue
            return conn
        return None

    def put(self, conn: _Connection) -> None:
        idle = self.idle
        conn.idle_since_s = conn.loop.time()
        if len(idle) >= MAX_IDLE_PER_ORIGIN:
            idle.popleft().drop()
        idle.append(conn)
        if self.sweeper is None:
            self.sweeper = conn.loop.call_later(KEEPALIVE_S, self._sweep, conn.loop)

    def forget(self, conn: _Connection) -> None:
        with contextlib.suppress(ValueError):  # taken already, or closed by the sweeper
            self.idle.remove(conn)

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        """Close the connections idle for KEEPALIVE_S (``take`` never uses them either)."""
        self.sweeper = None
        now_s, idle = loop.time(), self.idle
        while idle and now_s - idle[0].idle_since_s >= KEEPALIVE_S:
            idle.popleft().drop()
        if idle:
            self.sweeper = loop.call_later(idle[0].idle_since_s + KEEPALIVE_S - now_s,
                                           self._sweep, loop)

    async def connect(self, timeout_s: float | None) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self, loop), self.host, self.port,
                    ssl=self.client.tls_context() if self.tls else None,
                    server_hostname=self.server_hostname)
        except TimeoutError:  # also the OS's ETIMEDOUT
            raise ConnectTimeout(f"no connection to {self.host_header} in {timeout_s} s") from None
        except OSError as exc:  # refused, unreachable, DNS (gaierror), TLS (SSLError)
            raise ConnectError(f"cannot connect to {self.host_header}: {exc}") from exc
        return conn

    def head(self, path: str, headers: Mapping[str, str], length: int) -> bytes:
        lines = [f"POST {self.prefix}{path} HTTP/1.1\r\nhost: {self.host_header}\r\n"]
        lines.extend(f"{name}: {value}\r\n" for name, value in headers.items())
        lines.append(f"content-length: {length}\r\n\r\n")
        return "".join(lines).encode("latin-1")

    def close(self) -> None:
        if self.sweeper is not None:
            self.sweeper.cancel()
            self.sweeper = None
        while self.idle:
            self.idle.pop().drop()


class UpstreamClient:
    """Keep-alive pools, one per worker origin (``http://host:port``, or ``https://``: TLS with
    ``tls_context``, by default the system's CAs). Built without I/O; the connections are made
    on the loop of the first request."""

    def __init__(self, tls_context: ssl.SSLContext | None = None) -> None:
        self._pools: dict[str, _Pool] = {}
        self._tls = tls_context

    async def post(self, origin: str, path: str, body: bytes, headers: Mapping[str, str], *,
                   connect_timeout_s: float | None, read_timeout_s: float | None) -> Response:
        """POST ``body`` to ``origin + path``: the answer once its head has arrived.

        ``headers`` go as given, after ``host`` and before ``content-length``. Raises an
        ``UpstreamError`` (see the module docstring for what each proves).
        """
        pool = self._pools.get(origin)
        if pool is None:
            pool = self._pools[origin] = _Pool(self, origin)
        head = pool.head(path, headers, len(body))
        conn = pool.take(asyncio.get_running_loop().time())
        if conn is None:
            conn = await pool.connect(connect_timeout_s)
            return await conn.exchange(head, body, read_timeout_s)
        try:
            return await conn.exchange(head, body, read_timeout_s)
        except ResetError:
            # The worker had closed this kept-alive connection (RACE in the module docstring)
            # and never read the request: once more, on a new connection to the same worker.
            conn = await pool.connect(connect_timeout_s)
            return await conn.exchange(head, body, read_timeout_s)

    def tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls

    def idle_connections(self, origin: str) -> int:
        pool = self._pools.get(origin)
        return len(pool.idle) if pool is not None else 0

    def close(self) -> None:
        """Close every idle connection (those in use close with their responses)."""
        for pool in self._pools.values():
            pool.close()
