"""The protocol side of ``gateway.httpd``: one client connection (``HttpConnection``) and one
request on it (``Cycle``, the ``receive`` and ``send`` its app gets).

Steps per request: httptools calls back with the head's parts; at the head's end a scope and a
``Cycle`` are built and the app's task started (or queued behind the requests before it:
pipelining); the body is buffered, reading paused past ``HttpLimits.body_high_water_bytes``;
``send`` writes the head with the first body message sent in the same loop step (one syscall);
the answer's end starts the next queued request, or arms the keep-alive deadline. The cost,
measured: see the package docstring.

EXTENSION ``kvgate.send_body_nowait`` (in ``scope["extensions"]``): ``Cycle.send_body_nowait``,
a body message with more to come, written synchronously from any callback (the stream relay's
token chunks, straight from the upstream connection's ``on_body``: no task step per chunk). It
refuses (False, nothing written) while the client's write buffer is full, so the caller falls
back to ``send``, which waits for the drain: backpressure stays where it was.

EXTENSION ``kvgate.on_disconnect``: ``Cycle.on_disconnect(callback)`` registers a callable run
once if the connection is lost before the answer completed (None unregisters). The proxy cancels
its upstream request from it, instead of a task per request waiting in ``receive()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import http
import logging
import math
import re
import struct
import termios
import time
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from email.utils import formatdate
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import httptools
import orjson

if TYPE_CHECKING:
    from gateway.httpd.server import HttpServer

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

_NO_CALLBACKS = object()
"""What a closed connection's parser calls back: nothing (httptools skips missing callbacks)."""


@dataclass(frozen=True)
class HttpLimits:
    max_head_bytes: int = 64 * 1024
    """Request line plus headers; a larger head is answered 431 and its connection closed."""
    body_high_water_bytes: int = 64 * 1024
    """Reading pauses while this much of a request body waits unread by the app."""
    keep_alive_s: float = 5.0
    """An idle keep-alive connection is closed after this long (uvicorn's default)."""
    head_timeout_s: float = 10.0
    """A request head must be complete this long after its first byte (or after the connection
    opened): a slowloris client that never finishes one is closed. A request body, likewise,
    may not stop arriving for this long while the server reads it (a client that declared a
    body and sends none is closed, and its app sees it leave)."""
    max_pipelined: int = 32
    """Requests read ahead of the one being answered on one connection; one more is answered
    429 after them and the connection closed (each queued request holds its parsed head)."""
    send_timeout_s: float = 60.0
    """A client that takes none of an answer's bytes for this long (the connection's write
    buffer stays over its high-water mark and does not shrink: it stopped reading) is dropped,
    as by nginx's ``send_timeout`` (same default): the connection is aborted and the app sees
    the client leave (the proxy aborts the worker's request). A slow client that keeps reading
    is not: any shrink of the buffer restarts the clock."""
    sweep_interval_s: float = 1.0
    """How often the deadlines above are checked: each may be late by up to this much."""


def _status_line(status: int) -> bytes:
    try:
        phrase = http.HTTPStatus(status).phrase.encode()
    except ValueError:
        phrase = b""
    return b"HTTP/1.1 %d %s\r\n" % (status, phrase)


_STATUS_LINES = {status: _status_line(status) for status in range(100, 600)}
# What uvicorn forbids in header names and values: a CR/LF in either is response splitting.
_BAD_NAME = re.compile(b'[\x00-\x1f\x7f()<>@,;:\\[\\]={} \t\\\\"]')
_BAD_VALUE = re.compile(b"[\x00-\x08\x0a-\x1f\x7f]")
_DISCONNECT: Message = {"type": "http.disconnect"}
SEND_BODY_NOWAIT = "kvgate.send_body_nowait"
"""The scope extension: a ``Callable[[bytes], bool]`` (see the module docstring)."""
ON_DISCONNECT = "kvgate.on_disconnect"
"""The scope extension: a ``Callable[[Callable[[], None] | None], None]`` (the module docstring)."""


def _error_json(status: int, message: str, code: str) -> bytes:
    """The OpenAI error shape of ``gateway.errors.GatewayError.body`` (the tests hold the two
    equal; this layer imports nothing above it), for an answer written without an app."""
    kind = {403: "permission_error", 429: "rate_limit_error", 500: "internal_error"}.get(
        status, "invalid_request_error")
    return orjson.dumps({"error": {"message": message, "type": kind, "param": None,
                                   "code": code}})


def _answer(status: int, message: str, code: str) -> bytes:
    """A whole answer the server writes itself, in the OpenAI error shape (as every answer of
    the gateway's), on a connection it then closes."""
    body = _error_json(status, message, code)
    return (_STATUS_LINES[status] + b"content-type: application/json\r\n"
            + b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body) + body)


_INVALID = _answer(400, "Invalid HTTP request received.", "invalid_http_request")
_TOO_LARGE = _answer(431, "Request header fields too large.", "request_header_fields_too_large")
_TOO_MANY_PIPELINED = _answer(429, "Too many pipelined requests.", "too_many_pipelined_requests")
_UPGRADE_REFUSED = _answer(403, "WebSocket is not served.", "upgrade_refused")
_BAD_TRANSFER_ENCODING = _answer(400, "Invalid Transfer-Encoding: the last coding must be "
                                 "chunked.", "invalid_transfer_encoding")
_SERVER_ERROR_BODY = _error_json(500, "Internal Server Error", "internal_error")
_SERVER_ERROR_HEADERS = [(b"content-type", b"application/json"),
                         (b"content-length", b"%d" % len(_SERVER_ERROR_BODY)),
                         (b"connection", b"close")]


class DateHeader:
    """The ``date`` header line, formatted once a second rather than per answer."""

    __slots__ = ("_line", "_second")

    def __init__(self) -> None:
        self._second = -1
        self._line = b""

    def line(self) -> bytes:
        now = time.time()
        if int(now) != self._second:
            self._second = int(now)
            self._line = b"date: " + formatdate(now, usegmt=True).encode() + b"\r\n"
        return self._line


class Cycle:
    """One request and its answer: the ``receive`` and ``send`` the app gets.

    It holds its scope only until its app's task takes it (``run``), and keeps of it the two
    facts the answer needs (a HEAD request, HTTP/1.0). Why: the scope's extensions are bound
    methods of the cycle, so a cycle that held its scope formed a reference cycle with it
    (cycle, scope, extensions, two methods, the header list and tuples: ~10 objects per
    request) that reference counting could never free. Those were nearly all the net
    allocations that triggered the garbage collector's young collections (~1 per 1,000
    requests, each a pause of ~5-8 ms that walked the ~15K live objects of the bookkeeping
    queued meanwhile: 6-10 µs of GC per short request, session 13); now the scope dies with
    the task. (A pipelined request whose connection is lost before it ran still leaves its
    cycle to the collector: rare.)
    """

    __slots__ = ("_chunked", "_conn", "_head", "_head_method", "_http_1_0", "_on_disconnect",
                 "_remaining", "_scope", "_waiters", "body", "disconnected", "expect_continue",
                 "final_delivered", "keep_alive", "more_body", "response_complete",
                 "response_started")

    def __init__(self, conn: HttpConnection, scope: Scope, keep_alive: bool,
                 expect_continue: bool) -> None:
        self._conn = conn
        self._scope: Scope | None = scope  # until ``run`` hands it to the app
        self._head_method = scope["method"] == "HEAD"
        self._http_1_0 = scope["http_version"] == "1.0"
        self.keep_alive = keep_alive
        self.expect_continue = expect_continue
        self.body = bytearray()
        self.more_body = True
        self.final_delivered = False
        self.disconnected = False
        self.response_started = False
        self.response_complete = False
        self._chunked = False
        self._remaining = 0  # bytes of body still owed under content-length
        self._head: bytes | None = None  # a head held back to go out with the first body
        self._waiters: list[asyncio.Future[None]] = []
        self._on_disconnect: Callable[[], None] | None = None

    def on_disconnect(self, callback: Callable[[], None] | None) -> None:
        """``callback`` runs once if the client leaves before the answer completes (the
        ``kvgate.on_disconnect`` extension); None: no longer. A client already gone (it closed
        right after its request, while the app was still deciding where to send it) runs it
        now: registered late, it was never told, and the proxy forwarded the request and let
        the worker generate the whole answer for nobody."""
        if callback is not None and self.disconnected and not self.response_complete:
            self._on_disconnect = None
            callback()
            return
        self._on_disconnect = callback

    def lost(self) -> None:
        """The connection is gone before the answer completed."""
        self.disconnected = True
        self.wake()
        callback, self._on_disconnect = self._on_disconnect, None
        if callback is not None:
            try:
                callback()
            except Exception:  # a callback's failure must not stop the others being told
                log.exception("on_disconnect callback failed")

    def wake(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()

    async def run(self, app: App) -> None:
        scope, self._scope = self._scope, None
        assert scope is not None, "a cycle runs once"
        try:
            await app(scope, self.receive, self.send)
        except BaseException as exc:  # the server's last line: nothing escapes
            if isinstance(exc, asyncio.CancelledError):
                log.debug("request cancelled: %s %s", scope["method"], scope["path"])
            else:
                log.error("Exception in ASGI application", exc_info=exc)
            if not self.response_started and not self.disconnected:
                with contextlib.suppress(Exception):
                    await self._send_500()
            elif not self.response_complete:  # a whole answer went out: the connection is fine
                self._conn.close()
        else:
            if not self.response_started and not self.disconnected:
                log.error("ASGI callable returned without starting response.")
                await self._send_500()
            elif not self.response_complete and not self.disconnected:
                log.error("ASGI callable returned without completing response.")
                self._conn.close()

    async def _send_500(self) -> None:
        self.keep_alive = False
        await self.send({"type": "http.response.start", "status": 500,
                         "headers": _SERVER_ERROR_HEADERS})
        await self.send({"type": "http.response.body", "body": _SERVER_ERROR_BODY})

    async def receive(self) -> Message:
        conn = self._conn
        if self.expect_continue:
            self.expect_continue = False
            if not self.response_started and not conn.closing:
                conn.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                if conn.parsing is self and self.more_body and not conn.read_paused:
                    conn.body_deadline = conn.loop.time() + conn.limits.head_timeout_s
        while True:
            if self.disconnected or self.response_complete:
                return _DISCONNECT
            if self.body or not (self.more_body or self.final_delivered):
                body = bytes(self.body)
                self.body.clear()
                if not self.more_body:
                    self.final_delivered = True
                return {"type": "http.request", "body": body, "more_body": self.more_body}
            # Nothing buffered: read more of this request (reading may have been paused at the
            # high-water mark), or, its body all delivered, wait for the disconnect.
            if self.more_body and conn.parsing is self:
                conn.resume_reading()
            waiter = conn.loop.create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)

    async def send(self, message: Message) -> None:
        conn = self._conn
        if conn.write_paused and not self.disconnected:
            await conn.drain()
        if self.disconnected or conn.closing:
            return  # as uvicorn: the app learns of it from receive()
        kind = message["type"]
        if not self.response_started:
            if kind != "http.response.start":
                raise RuntimeError(f"Expected 'http.response.start', got {kind!r}")
            self._start(message)
        elif not self.response_complete:
            if kind != "http.response.body":
                raise RuntimeError(f"Expected 'http.response.body', got {kind!r}")
            self._body(message.get("body", b""), message.get("more_body", False))
        else:
            raise RuntimeError(f"Unexpected ASGI message {kind!r} after the response completed")

    def send_body_nowait(self, body: bytes) -> bool:
        """``send({"type": "http.response.body", "body": body, "more_body": True})`` done now,
        when it would not wait: False (nothing written) while the client's write buffer is
        full or no answer has started. A client gone takes it (dropped), as ``send`` does."""
        conn = self._conn
        if conn.write_paused and not self.disconnected:
            return False
        if self.disconnected or conn.closing:
            return True
        if not self.response_started or self.response_complete:
            return False
        self._body(body, True)
        return True

    def _start(self, message: Message) -> None:
        self.response_started = True
        if self.expect_continue and self.more_body:
            # Answered before its body was asked for: whether the client now sends that body
            # or its next request cannot be told apart, so the connection closes after this.
            self.keep_alive = False
        self.expect_continue = False  # the answer says it all: no 100 after it
        status: int = message["status"]
        headers = message.get("headers", ())
        line = _STATUS_LINES.get(status)
        parts = [line if line is not None else _status_line(status), self._conn.date.line()]
        length: int | None = None
        chunked = close_sent = False
        for name, value in headers:
            name = name.lower()
            if name == b"content-length":
                if length is None and not chunked:
                    length = int(value)
            elif name == b"transfer-encoding":
                if value.lower() == b"chunked" and length is None:
                    chunked = True
            elif name == b"connection" and b"close" in [
                    t.strip() for t in value.lower().split(b",")]:
                close_sent = True
                self.keep_alive = False
            parts += (name, b": ", value, b"\r\n")
        # Checked once over all of them rather than per header: a CR or LF in either would
        # let an app's header split the answer.
        if _BAD_NAME.search(b"".join(parts[2::4])) or _BAD_VALUE.search(b"".join(parts[4::4])):
            raise RuntimeError("Invalid HTTP header name or value.")
        if not self.keep_alive and not close_sent:
            parts.append(b"connection: close\r\n")
        no_body = self._head_method or status in (204, 304) or status < 200
        if length is None and not chunked and not no_body:
            if self._http_1_0:
                self.keep_alive = False  # HTTP/1.0 knows no chunks: the close ends the body
                length = -1
            else:
                chunked = True
                parts.append(b"transfer-encoding: chunked\r\n")
        parts.append(b"\r\n")
        self._chunked = chunked and not no_body
        self._remaining = 0 if no_body else (length if length is not None else 0)
        # The head waits for the body: an app sends its first body message in the same step
        # (Starlette's responses, the relay's whole answers), so both go in one write, one
        # syscall and one loopback segment fewer per request (~5 % of the gateway's CPU in the
        # profile). A stream's first chunk comes later: the head then goes at the end of this
        # loop iteration, before any I/O is polled, so no client sees it any later.
        self._head = b"".join(parts)
        self._conn.heads.add(self)

    def _body(self, body: bytes, more_body: bool) -> None:
        if self._chunked:
            out = [b"%x\r\n" % len(body), body, b"\r\n"] if body else []
            if not more_body:
                out.append(b"0\r\n\r\n")
        elif self._head_method:
            out = []
        elif self._remaining < 0:  # HTTP/1.0, length unknown: until the close
            out = [body]
        else:
            if len(body) > self._remaining:
                raise RuntimeError("Response content longer than Content-Length")
            if not more_body and len(body) != self._remaining:
                raise RuntimeError("Response content shorter than Content-Length")
            self._remaining -= len(body)
            out = [body]
        head, self._head = self._head, None
        if head is not None:
            out.insert(0, head)
        if out:
            self._conn.transport.write(b"".join(out) if len(out) > 1 else out[0])
        if not more_body:
            self.response_complete = True
            self.wake()  # a receive() waiting for the disconnect returns now
            self._conn.response_done(self)

    def flush_head(self) -> None:
        """Write the head if it still waits for a body (a stream, a failed app, a close)."""
        head, self._head = self._head, None
        if head is not None and not self._conn.closing:
            self._conn.transport.write(head)


class HeadFlusher:
    """The heads held back for a body (``Cycle._start``) written at the end of this loop
    iteration, all of them with one callback: one ``call_soon`` per iteration instead of one per
    answer (a whole answer's body comes in the same step, and its head goes with it, so for
    most answers there is nothing left to write by then). A head is flushed no later than a
    callback of its own would have flushed it."""

    def __init__(self) -> None:
        self._pending: list[Cycle] = []

    def add(self, cycle: Cycle) -> None:
        if not self._pending:
            cycle._conn.loop.call_soon(self.flush)
        self._pending.append(cycle)

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        for cycle in pending:
            try:
                cycle.flush_head()
            except Exception:  # one connection's failed write leaves the others' heads to go
                log.exception("writing a response head failed")


class HttpConnection(asyncio.Protocol):
    """One client connection; see the module docstring."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.loop = server.loop
        self.heads = server.heads
        self._app = server.app
        self._tasks = server.tasks
        self.date = server.date
        self.limits = server.limits
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.closing = False
        self.read_paused = False
        self.write_paused = False
        # while writing is paused: since when no byte went out, and the buffer then (send_timeout_s)
        self.write_stalled_since = math.inf
        self.write_stalled_bytes = 0
        self._drain_waiters: list[asyncio.Future[None]] = []
        self.active: Cycle | None = None  # the request being answered
        self.parsing: Cycle | None = None  # the request whose head or body is being read
        self._pipeline: deque[Cycle] = deque()
        self.deadline = math.inf  # loop time after which a connection without a request closes
        self.body_deadline = math.inf  # loop time after which a body that stopped coming closes
        self._in_body = False  # between a head's end and its message's end
        self._head_started = False  # a head's first bytes came, not its end
        self._head_bytes = 0  # bytes fed since the last head ended, bodies aside
        self._broken = False  # the parser failed: nothing more is read
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._header_bytes = 0  # the head's size as ``max_head_bytes`` counts it, URL aside
        self._expect_continue = False
        # an ignored upgrade's body (``_upgrade``): its framing header, then whether its head is
        # being replayed to a fresh parser (the head callbacks ignore it)
        self._upgrade_framing: bytes | None = None
        self._replaying = False
        self._last_message = False  # nothing is read after this message (an ignored upgrade's)
        self._refused_answer: bytes | None = None  # the answer to a refused head (431, 403)
        self._pending_error: bytes | None = None  # written once the answers before it are out
        self._client: tuple[str, int] | None = None
        self._server_addr: tuple[str, int] | None = None

    # -- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transport is no subclass of asyncio.Transport, though it is one.
        self.transport = transport  # type: ignore[assignment]
        self.server.connections.add(self)
        self._client = _address(transport.get_extra_info("peername"))
        self._server_addr = _address(transport.get_extra_info("sockname"))
        self.deadline = self.loop.time() + self.limits.head_timeout_s
        if self.server.stopping:
            self.close()

    def data_received(self, data: bytes) -> None:
        if self.closing or self._broken:
            return
        if not self._in_body:
            self._head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as upgrade:
            # the offset of the head's end in ``data`` (what follows it is its body, if any)
            at: Any = upgrade.args[0] if upgrade.args else len(data)
            self._upgrade(data[at:] if isinstance(at, int) else b"")
            return
        except httptools.HttpParserError:
            self._refuse(self._refused_answer or _INVALID)
            return
        # A head still incomplete may be mostly one header that httptools buffers whole.
        if not self._in_body and self._head_bytes > self.limits.max_head_bytes:
            self._refuse(_TOO_LARGE)

    def eof_received(self) -> bool | None:
        return None  # a half-closed client is closed: as uvicorn, the app sees a disconnect

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self.server.connections.discard(self)
        for cycle in (self.active, *self._pipeline):
            if cycle is not None and not cycle.response_complete:
                cycle.lost()
        self._pipeline.clear()
        self.active = self.parsing = None  # no reference cycle outlives the connection
        # nor this one: the parser holds its callbacks, bound methods of this connection, so
        # the two (and the transport, buffers, lists: ~13 objects per connection) would wait
        # for the garbage collector. Nothing parses after this (``data_received`` returns
        # while ``closing``). A parser with no callbacks takes its place (the attribute stays
        # set: a native class, as mypyc compiles this one, cannot delete one).
        self.parser = httptools.HttpRequestParser(_NO_CALLBACKS)
        self.write_paused = False
        self._wake_drain()

    def pause_writing(self) -> None:
        self.write_paused = True
        self.write_stalled_since = self.loop.time()
        self.write_stalled_bytes = (self.transport.get_write_buffer_size()
                                    + _kernel_unsent(self.transport))

    def resume_writing(self) -> None:
        self.write_paused = False
        self.write_stalled_since = math.inf
        self._wake_drain()

    def stalled_past(self, now: float) -> bool:
        """Whether the client has taken no byte for ``send_timeout_s`` while writing is paused
        (called by the server's sweep; a buffer that shrank since the last call restarts the
        clock)."""
        if not self.write_paused or self.closing:
            return False
        size = self.transport.get_write_buffer_size() + _kernel_unsent(self.transport)
        if size < self.write_stalled_bytes:
            self.write_stalled_since, self.write_stalled_bytes = now, size
            return False
        return now - self.write_stalled_since >= self.limits.send_timeout_s

    @property
    def client(self) -> tuple[str, int] | None:
        """The client's address, as the scope's ``client``."""
        return self._client

    def abort(self) -> None:
        """Drop the connection now, its unsent bytes too (a client that stopped reading)."""
        self.closing = True
        self.transport.abort()

    # -- httptools callbacks -------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._replaying:
            return
        self._url = b""
        self._headers = []
        self._header_bytes = 0
        self._expect_continue = False
        self._head_started = True
        if self.active is None:
            self.deadline = self.loop.time() + self.limits.head_timeout_s

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._replaying:
            return
        if self._in_body:  # a chunked body's trailer: not the request's headers, and bounded
            self._header_bytes += len(name) + len(value) + 4
            if len(self._url) + self._header_bytes > self.limits.max_head_bytes:
                self._refused_answer = _TOO_LARGE
                raise _Refused
            return
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self._expect_continue = True
        self._headers.append((name, value))
        # summed here, where each header passes anyway, not by a second pass at the head's end
        self._header_bytes += len(name) + len(value) + 4

    def on_headers_complete(self) -> None:
        if self._replaying:
            return
        parser = self.parser
        self._head_started = False
        self._head_bytes = 0
        if len(self._url) + self._header_bytes > self.limits.max_head_bytes:
            self._refused_answer = _TOO_LARGE
            raise _Refused  # httptools stops parsing; data_received answers
        if parser.should_upgrade() and _header(self._headers, b"upgrade") == b"websocket":
            self._refused_answer = _UPGRADE_REFUSED  # kvgate serves no WebSocket
            raise _Refused
        codings = b",".join(v for n, v in self._headers if n == b"transfer-encoding")
        if codings and codings.rsplit(b",", 1)[-1].strip().lower() != b"chunked":
            # RFC 9112 6.3: a request whose last transfer coding is not chunked has no
            # knowable length; httptools would read its body until the close, holding the
            # request open: 400 and close, as the RFC asks.
            self._refused_answer = _BAD_TRANSFER_ENCODING
            raise _Refused
        if parser.should_upgrade():
            # httptools ends the message at the head of any upgrade; one with a body (h2c's
            # ``curl --http2 -d``) has it read as HTTP/1.1 all the same (``_upgrade``)
            length = _header(self._headers, b"content-length")
            self._upgrade_framing = (b"transfer-encoding: chunked" if codings
                                     else b"content-length: " + length
                                     if length is not None and length.strip(b" \t0")
                                     else None)
        self._in_body = True
        url = self._url
        if url[:1] == b"/" and b"?" not in url and b"#" not in url:
            raw_path, query = url, b""
        else:
            # Any: parse_url's fields are None where absent (absolute-form, a bare ``?``, ``*``)
            # though its stub says bytes, which compiled code would check
            parsed: Any = httptools.parse_url(url)
            raw_path, query = parsed.path or b"/", parsed.query or b""
        path = raw_path.decode("ascii")
        if "%" in path:
            path = unquote(path)
        http_version = parser.get_http_version()
        scope: Scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": http_version,
            "method": parser.get_method().decode("ascii"),
            "scheme": "http",
            "path": path,
            "raw_path": raw_path,
            "query_string": query,
            "root_path": "",
            "headers": self._headers,
            "client": self._client,
            "server": self._server_addr,
            "state": self.server.state.copy(),
        }
        keep_alive = http_version != "1.0" and parser.should_keep_alive()
        if self.active is not None and len(self._pipeline) >= self.limits.max_pipelined:
            self._refused_answer = _TOO_MANY_PIPELINED
            raise _Refused
        cycle = Cycle(self, scope, keep_alive, self._expect_continue and http_version == "1.1")
        scope["extensions"] = {SEND_BODY_NOWAIT: cycle.send_body_nowait,
                               ON_DISCONNECT: cycle.on_disconnect}
        self.parsing = cycle
        self.deadline = math.inf
        # a client that asked for 100 Continue sends its body after it (``receive``)
        self.body_deadline = (math.inf if cycle.expect_continue
                              else self.loop.time() + self.limits.head_timeout_s)
        if self.active is None:
            self._start(cycle)
        else:  # pipelined: it waits for the answers before it, and so do further bytes
            self._pipeline.append(cycle)
            self.pause_reading()

    def on_body(self, body: bytes) -> None:
        cycle = self.parsing
        if cycle is None or cycle.response_complete or cycle.disconnected:
            return
        cycle.body += body
        self.body_deadline = self.loop.time() + self.limits.head_timeout_s
        if len(cycle.body) > self.limits.body_high_water_bytes:
            self.pause_reading()
        cycle.wake()

    def on_message_complete(self) -> None:
        if self._upgrade_framing is not None:
            return  # an upgrade's head, its body to come (``_upgrade``)
        self._in_body = False
        self.body_deadline = math.inf
        cycle = self.parsing
        if cycle is not None:
            cycle.more_body = False
            cycle.wake()
        if self._last_message:
            self._broken = True
        if self.active is None:  # answered before its body was all in (a refusal): now idle
            self.deadline = self.loop.time() + self.limits.keep_alive_s

    # -- the server's side ---------------------------------------------------------------------

    def _start(self, cycle: Cycle) -> None:
        self.active = cycle
        task = self.loop.create_task(cycle.run(self._app))
        tasks = self._tasks
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def response_done(self, cycle: Cycle) -> None:
        """``cycle`` answered in full: close, or start the next pipelined request, or wait."""
        if cycle is not self.active:
            return
        self.active = None
        if self.closing:
            return
        if not cycle.keep_alive or self.server.stopping:
            self.close()
            return
        if self._pipeline:
            self._start(self._pipeline.popleft())
            if not self._pipeline:
                self.resume_reading()
            return
        if self._pending_error is not None:
            self._refuse(self._pending_error)
            return
        self.resume_reading()
        if self._head_started:  # begun while the last request was answered: not timed yet
            self.deadline = self.loop.time() + self.limits.head_timeout_s
        elif not self._in_body:
            self.deadline = self.loop.time() + self.limits.keep_alive_s

    def _refuse(self, answer: bytes) -> None:
        """Answer a request the server will not take (400, 431, 403) once the answers before
        it are out, and close: the parser cannot go on after it. A request whose body the
        parser stopped inside (an invalid chunk) can never have the rest: when its app runs, the
        answer goes now and the connection closes, so the app sees the client gone and lets go
        of what it holds (an admission slot, a reservation); when it waits behind others, it
        never runs and the answer follows theirs."""
        self._broken = True
        cycle = self.parsing
        if cycle is not None and cycle.more_body and not cycle.response_complete:
            if cycle is self.active:
                if not cycle.response_started and not self.closing:
                    self.transport.write(answer)
                self.close()
                return
            with contextlib.suppress(ValueError):
                self._pipeline.remove(cycle)
            self.parsing = None
        if self.active is not None or self._pipeline:
            self._pending_error = answer
            self.pause_reading()
            return
        if not self.closing:
            self.transport.write(answer)
        self.close()

    def _upgrade(self, rest: bytes) -> None:
        """A request asking for another protocol that is not a WebSocket (h2c, as ``curl
        --http2`` asks): ignored, as RFC 9110 lets a server do, and uvicorn did. It is answered
        as plain HTTP/1.1 and the connection closed after it. Its body is its own (RFC 9113
        3.2: sent whole before any frame of the new protocol, which comes only after a 101):
        httptools ends the message at the head, so a fresh parser is given a head of the same
        framing (its callbacks ignore it) and then the bytes after the original head. ``rest``:
        those bytes, from the chunk that held the head's end."""
        cycle = self.parsing
        framing = self._upgrade_framing
        self._upgrade_framing = None
        if framing is not None and cycle is not None and not cycle.response_complete:
            cycle.keep_alive = False
            self.parser = parser = httptools.HttpRequestParser(self)
            self._replaying = True
            try:
                parser.feed_data(b"POST / HTTP/1.1\r\n" + framing + b"\r\n\r\n")
            finally:
                self._replaying = False
            self._last_message = True
            if rest:
                self.data_received(rest)
            return
        self._broken = True
        if cycle is None or cycle.response_complete:
            self.close()
            return
        cycle.keep_alive = False
        if cycle.more_body:
            cycle.more_body = False
            cycle.wake()
        self.pause_reading()

    def pause_reading(self) -> None:
        if not self.read_paused and not self.closing:
            self.read_paused = True
            self.transport.pause_reading()
            self.body_deadline = math.inf  # no byte can come: nothing to time

    def resume_reading(self) -> None:
        if self.read_paused and not self.closing and not self._broken:
            self.read_paused = False
            self.transport.resume_reading()
            if self._in_body:
                self.body_deadline = self.loop.time() + self.limits.head_timeout_s

    async def drain(self) -> None:
        waiter = self.loop.create_future()
        self._drain_waiters.append(waiter)
        await waiter

    def _wake_drain(self) -> None:
        for waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._drain_waiters.clear()

    def close(self) -> None:
        if self.active is not None:
            self.active.flush_head()
        if not self.closing:
            self.closing = True
            self.transport.close()

    def shutdown(self) -> None:
        """The server is stopping: close now when idle, else after the answer in flight."""
        if self.active is None:
            self.close()
        else:
            self.active.keep_alive = False
            self._pipeline.clear()


class _Refused(Exception):
    """Raised in a parser callback to stop parsing a head the server will not take."""


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes:
    return next((v.lower() for n, v in headers if n == name), b"")


def _kernel_unsent(transport: asyncio.BaseTransport) -> int:
    """Bytes in the socket's kernel send queue not yet taken by the peer (``SIOCOUTQ``; 0 where
    unavailable). A client that reads frees its receive buffer, so this queue shrinks while the
    transport's own buffer may not move for seconds: the kernel buffers of a loopback or LAN
    socket hold megabytes."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return 0
    try:
        unsent: int = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ,
                                                     b"\0\0\0\0"))[0]
    except OSError:
        return 0
    return unsent


def _address(addr: Any) -> tuple[str, int] | None:
    return (str(addr[0]), int(addr[1])) if isinstance(addr, tuple) and len(addr) >= 2 else None

