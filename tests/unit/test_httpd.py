"""gateway.httpd: the HTTP/1.1 server ``kvgate serve`` runs, on real loopback sockets.

Clients write raw bytes (``asyncio.open_connection``), as a hostile one would: pipelining,
chunked uploads, oversized and malformed heads, slowloris, disconnects mid-body. The app is a
small recording ASGI app; the server runs in the test's own event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
import orjson
import pytest

from gateway.config import Settings, build_settings
from gateway.errors import GatewayError
from gateway.httpd import (
    ON_DISCONNECT,
    STARTUP_FAILURE,
    HttpLimits,
    HttpServer,
    Message,
    Receive,
    Scope,
    Send,
    StartupFailed,
)
from gateway.httpd.protocol import Cycle, HttpConnection
from gateway.server import GatewayServer, http_limits

pytestmark = pytest.mark.timeout(30)

FAST = HttpLimits(keep_alive_s=0.3, head_timeout_s=0.3, sweep_interval_s=0.05)


@dataclass
class Recorder:
    """Answers ``<method> <path> <body length>`` (or what ``behaviour`` does instead) and
    records every scope and the messages ``receive`` gave."""

    scopes: list[Scope] = field(default_factory=list)
    received: list[Message] = field(default_factory=list)
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)
    behaviour: str = "echo"
    sent_bytes: int = 0
    done: asyncio.Event = field(default_factory=asyncio.Event)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (msg := await receive())["type"] != "lifespan.shutdown":
                scope["state"]["greeting"] = "hello"
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        self.scopes.append(scope)
        if self.behaviour == "slow_receive":
            await asyncio.sleep(0.3)
        if self.behaviour == "flood":  # more than the socket buffers hold, unread by the client
            await send({"type": "http.response.start", "status": 200, "headers": []})
            chunk = b"x" * 1024 * 1024
            for _ in range(64):
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                self.sent_bytes += len(chunk)
            await send({"type": "http.response.body", "body": b""})
            self.done.set()
            return
        if self.behaviour == "nowait_flood":  # the relay's token lane, to an unread client
            await send({"type": "http.response.start", "status": 200, "headers": []})
            nowait = scope["extensions"]["kvgate.send_body_nowait"]
            chunk = b"y" * 1024 * 1024
            while self.sent_bytes < 64 * len(chunk) and nowait(chunk):
                self.sent_bytes += len(chunk)
            self.done.set()
            await send({"type": "http.response.body", "body": b"end", "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return
        if self.behaviour == "refuse" and scope["method"] == "POST":  # as a 413, body unread
            await send({"type": "http.response.start", "status": 413,
                         "headers": [(b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return
        if self.behaviour == "held_stream":  # a stream whose first token takes its time
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            await self.done.wait()
            await send({"type": "http.response.body", "body": b"data: 1\n\n"})
            return
        if self.behaviour == "unread":  # answers when told, without reading the body
            await self.done.wait()
            await _answer(send, b"unread")
            return
        body = b""
        while True:
            msg = await receive()
            self.received.append(msg)
            if msg["type"] == "http.disconnect":
                self.disconnected.set()
                return
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        if self.behaviour == "fail_before":
            raise RuntimeError("boom before the answer")
        if self.behaviour == "fail_after":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"partial", "more_body": True})
            raise RuntimeError("boom in the middle of the answer")
        if self.behaviour == "fail_after_complete" and scope["path"] == "/fail":
            await _answer(send, b"whole")
            raise RuntimeError("boom in the bookkeeping after the answer")
        if self.behaviour == "watch":  # as the dispatcher: wait for the client to leave
            self.done.set()
            if (await receive())["type"] == "http.disconnect":
                self.disconnected.set()
            return
        if self.behaviour == "sleep":
            self.done.set()
            await asyncio.sleep(3600)
        if self.behaviour == "stream":  # no content-length: chunked
            await send({"type": "http.response.start", "status": 200, "headers": []})
            for part in (b"one ", b"two"):
                await send({"type": "http.response.body", "body": part, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return
        await _answer(send, b"%s %s %d" % (scope["method"].encode(), scope["path"].encode(),
                                           len(body)))


async def _answer(send: Send, body: bytes) -> None:
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


@contextlib.asynccontextmanager
async def serving(app: Any, limits: HttpLimits = FAST, grace_s: float = 5.0,
                  ) -> AsyncIterator[HttpServer]:
    server = HttpServer(app, limits)
    task = asyncio.create_task(server.serve(host="127.0.0.1", port=0, grace_s=grace_s))
    started = asyncio.create_task(server.started.wait())
    await asyncio.wait([task, started], return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        started.cancel()
        task.result()  # raises what startup raised
    try:
        yield server
    finally:
        server.request_stop()
        await asyncio.wait_for(task, 10)


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[bytes, bytes]
    body: bytes


async def read_answer(reader: asyncio.StreamReader, head_request: bool = False) -> Answer:
    status_line = await reader.readuntil(b"\r\n")
    headers: dict[bytes, bytes] = {}
    while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
        name, _, value = line.rstrip(b"\r\n").partition(b":")
        headers[name.lower()] = value.strip()
    status = int(status_line.split()[1])
    if head_request or status in (100, 204, 304):
        body = b""
    elif b"content-length" in headers:
        body = await reader.readexactly(int(headers[b"content-length"]))
    elif headers.get(b"transfer-encoding") == b"chunked":
        body = b""
        while (size := int((await reader.readuntil(b"\r\n")).strip(), 16)) > 0:
            body += await reader.readexactly(size)
            await reader.readexactly(2)
        await reader.readexactly(2)
    else:
        body = await reader.read()
    return Answer(status, headers, body)


async def connect(server: HttpServer) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", server.port)


async def closed_by_server(reader: asyncio.StreamReader, within_s: float = 5.0) -> bool:
    try:
        return await asyncio.wait_for(reader.read(), within_s) == b""
    except ConnectionResetError:
        return True


async def answered_and_closed(server: HttpServer, request: bytes) -> Answer:
    """``request``'s answer on a new connection, which the server then closes."""
    reader, writer = await connect(server)
    writer.write(request)
    answer = await read_answer(reader)
    assert await closed_by_server(reader)
    writer.close()
    return answer


def post(path: bytes, body: bytes, extra: bytes = b"") -> bytes:
    return (b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n%s\r\n%s"
            % (path, len(body), extra, body))


# -- requests and answers ----------------------------------------------------------------------


async def test_scope_carries_the_asgi3_http_fields_with_the_path_percent_decoded() -> None:
    app = Recorder()
    async with serving(app) as server:
        reader, writer = await connect(server)
        writer.write(b"GET /a%20b/c?x=1&y=%20 HTTP/1.1\r\nHost: x\r\nX-Thing: V\r\n\r\n")
        answer = await read_answer(reader)
        writer.close()
    assert answer.status == 200 and answer.body == b"GET /a b/c 0"
    scope = app.scopes[0]
    assert scope["type"] == "http" and scope["asgi"] == {"version": "3.0", "spec_version": "2.3"}
    assert (scope["http_version"], scope["method"], scope["scheme"]) == ("1.1", "GET", "http")
    assert scope["path"] == "/a b/c" and scope["raw_path"] == b"/a%20b/c"
    assert scope["query_string"] == b"x=1&y=%20" and scope["root_path"] == ""
    assert scope["headers"] == [(b"host", b"x"), (b"x-thing", b"V")]
    assert scope["client"][0] == "127.0.0.1"
    assert scope["server"] == ("127.0.0.1", server.port)
    assert scope["state"] == {"greeting": "hello"}  # the lifespan's state, copied per request


async def test_keep_alive_connection_serves_one_request_after_another() -> None:
    app = Recorder()
    async with serving(app) as server:
        reader, writer = await connect(server)
        for i in range(3):
            writer.write(post(b"/n%d" % i, b"x" * i))
            answer = await read_answer(reader)
            assert answer.body == b"POST /n%d %d" % (i, i)
            assert b"connection" not in answer.headers and b"date" in answer.headers
        writer.close()
    assert len({s["client"] for s in app.scopes}) == 1


async def test_answered_requests_leave_nothing_for_the_garbage_collector() -> None:
    """Regression (session 13): a ``Cycle`` held its scope, whose extensions are bound methods
    of the cycle, so every request left a reference cycle (the cycle, its scope, the header
    list and tuples: ~10 objects) that reference counting could not free. Under load they were
    nearly all the net allocations that set off the collector's young collections (one per
    ~1,000 requests, ~5-8 ms each). And a connection's parser held the connection's bound
    methods (~13 objects per connection, the garbage of clients that connect per request).
    With the collector off, every request's cycle and the connection must be gone once the
    connection is."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return
        while (await receive()).get("more_body"):
            pass
        await _answer(send, b"ok")

    gc.collect()
    gc.disable()
    try:
        async with serving(app) as server:
            reader, writer = await connect(server)
            for _ in range(3):
                writer.write(post(b"/x", b"abc"))
                assert (await read_answer(reader)).body == b"ok"
            writer.close()
            deadline = asyncio.get_running_loop().time() + 10
            while server.connections or server.tasks:
                assert asyncio.get_running_loop().time() < deadline, "the connection stayed"
                await asyncio.sleep(0.01)
            left = [type(o).__name__ for o in gc.get_objects()
                    if isinstance(o, (Cycle, HttpConnection))]
    finally:
        gc.enable()
    assert left == []


async def test_pipelined_requests_are_answered_in_order() -> None:
    app = Recorder()
    async with serving(app) as server:
        reader, writer = await connect(server)
        writer.write(post(b"/1", b"a") + b"GET /2 HTTP/1.1\r\nhost: x\r\n\r\n"
                     + post(b"/3", b"ccc"))
        bodies = [(await read_answer(reader)).body for _ in range(3)]
        writer.close()
    assert bodies == [b"POST /1 1", b"GET /2 0", b"POST /3 3"]


async def test_chunked_upload_reaches_the_app_whole() -> None:
    app = Recorder()
    async with serving(app) as server:
        reader, writer = await connect(server)
        writer.write(b"POST /up HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n")
        for part in (b"hello ", b"chunked ", b"world"):
            writer.write(b"%x\r\n%s\r\n" % (len(part), part))
            await writer.drain()
            await asyncio.sleep(0.02)
        writer.write(b"0\r\n\r\n")
        answer = await read_answer(reader)
        writer.close()
    assert answer.body == b"POST /up 19"


async def test_an_invalid_chunk_in_the_body_being_read_gets_400_and_frees_the_app() -> None:
    """Regression: a parse error inside the body of the request being served (an invalid chunk
    size) paused reading and left the app waiting in ``receive`` for ever: no answer, the
    connection never closed, and what the app held (the gateway's admission slot) never freed:
    four such requests took every slot. Now the answer is 400, the connection closes and the app
    sees the client gone."""
    app = Recorder()
    async with serving(app) as server:
        reader, writer = await connect(server)
        writer.write(b"POST /up HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
                     b"5\r\nhello\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"zz\r\nabc\r\n")
        await writer.drain()
        answer = await read_answer(reader)
        assert await closed_by_server(reader)
        await asyncio.wait_for(app.disconnected.wait(), 5)
        writer.close()
        # a pipelined request whose body breaks never reaches the app; the one before is answered
        reader, writer = await connect(server)
        writer.write(post(b"/first", b"{}") + b"POST /second HTTP/1.1\r\nhost: x\r\n"
                     b"transfer-encoding: chunked\r\n\r\n2\r\nhi\r\nzz\r\n")
        first = await read_answer(reader)
        second = await read_answer(reader)
        assert await closed_by_server(reader)
        writer.close()
    assert answer.status == 400
    assert app.received[0] == {"type": "http.request", "body": b"hello", "more_body": True}
    assert (first.status, first.body, second.status) == (200, b"POST /first 2", 400)
    assert [sc["path"] for sc in app.scopes] == ["/up", "/first"]


async def test_request_refused_before_its_body_keeps_its_connection_for_the_next() -> None:
    async with serving(Recorder(behaviour="refuse")) as server:
        reader, writer = await connect(server)
        writer.write(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 300000\r\n\r\n")
        refused = await read_answer(reader)
        writer.write(b"z" * 300000 + b"GET /next HTTP/1.1\r\nhost: x\r\n\r\n")
        after = await read_answer(reader)
        writer.close()
    assert refused.status == 413 and after.body == b"GET /next 0"


async def test_answer_without_content_length_is_chunked() -> None:
    async with serving(Recorder(behaviour="stream")) as server:
        reader, writer = await connect(server)
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        answer = await read_answer(reader)
        writer.close()
    assert answer.headers[b"transfer-encoding"] == b"chunked" and answer.body == b"one two"


async def test_stream_head_reaches_the_client_before_its_first_chunk() -> None:
    app = Recorder(behaviour="held_stream")
    async with serving(app) as server:
        reader, writer = await connect(server)
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2)
        assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"chunked" in head
        app.done.set()
        assert await reader.readuntil(b"0\r\n\r\n") == b"9\r\ndata: 1\n\n\r\n0\r\n\r\n"
        writer.close()


async def test_head_request_gets_the_headers_and_no_body() -> None:
    async with serving(Recorder()) as server:
        reader, writer = await connect(server)
        writer.write(b"HEAD /h HTTP/1.1\r\nhost: x\r\n\r\nGET /g HTTP/1.1\r\nhost: x\r\n\r\n")
        head = await read_answer(reader, head_request=True)
        after = await read_answer(reader)  # nothing of HEAD's body sits before the next answer
        writer.close()
    assert head.status == 200 and head.headers[b"content-length"] == b"9" and head.body == b""
    assert after.body == b"GET /g 0"


async def test_http_1_0_request_is_answered_without_chunks_and_closed() -> None:
    async with serving(Recorder(behaviour="stream")) as server:
        reader, writer = await connect(server)
        writer.write(b"GET / HTTP/1.0\r\n\r\n")
        answer = await read_answer(reader)  # no length, no chunks: the body ends at the close
        writer.close()
    assert answer.headers[b"connection"] == b"close" and answer.body == b"one two"
    assert b"transfer-encoding" not in answer.headers


async def test_connection_close_from_the_client_closes_after_the_answer() -> None:
    async with serving(Recorder()) as server:
        reader, writer = await connect(server)
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        answer = await read_answer(reader)
        assert answer.headers[b"connection"] == b"close" and answer.body == b"GET / 0"
        assert await closed_by_server(reader)
        writer.close()


async def test_expect_100_continue_is_answered_when_the_app_first_receives() -> None:
    app = Recorder(behaviour="slow_receive")  # receives 0.3 s after the request started
    async with serving(app) as server:
        reader, writer = await connect(server)
        writer.write(b"POST /e HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\n"
                     b"expect: 100-continue\r\n\r\n")
        with pytest.raises(TimeoutError):  # not before the app asks for the body
            await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 0.15)
        interim = await read_answer(reader)
        writer.write(b"body")
        answer = await read_answer(reader)
        writer.close()
    assert interim.status == 100 and answer.body == b"POST /e 4"


# -- what a hostile client meets ---------------------------------------------------------------


async def test_expect_100_continue_answered_before_its_body_was_asked_for_closes() -> None:
    """Regression: a request with ``Expect: 100-continue`` refused before its body was asked
    for (a 413 on its declared length) was answered without ``connection: close``; the server
    then read the client's next request as the body it had told it not to send."""
    async with serving(Recorder(behaviour="refuse")) as server:
        answer = await answered_and_closed(server, b"POST /big HTTP/1.1\r\nhost: x\r\n"
                                           b"expect: 100-continue\r\ncontent-length: 999999\r\n\r\n")
    assert answer.status == 413 and answer.headers[b"connection"] == b"close"


async def test_a_body_that_stops_coming_closes_and_frees_the_app() -> None:
    """Regression: once a head was complete no deadline applied, so a client that declared a
    body and never sent it (or stopped half way) held its connection and its app (the gateway's
    admission slot, for a body read after admission) for ever."""
    app = Recorder()
    async with serving(app) as server:
        reader, writer = await connect(server)
        writer.write(b"POST /slow HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\npart")
        await writer.drain()
        await asyncio.wait_for(app.disconnected.wait(), 5)
        assert await closed_by_server(reader)
        writer.close()
    assert app.received[0] == {"type": "http.request", "body": b"part", "more_body": True}


async def test_a_client_waiting_for_100_continue_is_not_timed_before_it_is_asked() -> None:
    """The body deadline starts when the 100 goes out: an app that first reads the body after
    the timeout (the gateway's large bodies wait for admission) still gets it."""
    async def late_reader(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        await asyncio.sleep(3 * FAST.head_timeout_s)
        body = b""
        while (msg := await receive())["type"] == "http.request":
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        await _answer(send, b"got %d" % len(body))

    async with serving(late_reader) as server:
        reader, writer = await connect(server)
        writer.write(b"POST /big HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\n"
                     b"content-length: 5\r\n\r\n")
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == (
            b"HTTP/1.1 100 Continue\r\n\r\n")
        writer.write(b"hello")
        answer = await read_answer(reader)
        writer.close()
    assert answer.body == b"got 5"


async def test_trailers_are_bounded_and_kept_out_of_the_headers() -> None:
    """Regression: a chunked body's trailer fields were neither counted against
    ``max_head_bytes`` nor kept apart: each went into the request's header list, so an endless
    trailer section grew the server's memory without limit."""
    app = Recorder()
    async with serving(app, HttpLimits(max_head_bytes=8 * 1024)) as server:
        reader, writer = await connect(server)
        writer.write(b"POST /t HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
                     b"2\r\nhi\r\n0\r\nx-trailer: 1\r\n\r\n")
        answer = await read_answer(reader)
        assert answer.body == b"POST /t 2"
        assert all(name != b"x-trailer" for name, _ in app.scopes[0]["headers"])
        writer.write(b"POST /t HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
                     b"2\r\nhi\r\n0\r\n")
        for i in range(200):
            writer.write(b"x-t-%d: %s\r\n" % (i, b"v" * 100))
        await writer.drain()
        answer = await read_answer(reader)
        assert await closed_by_server(reader)
        writer.close()
    assert answer.status == 431


@pytest.mark.parametrize(("target", "path", "query"), [
    (b"http://example.com/v1/models", "/v1/models", b""),
    (b"/v1/models?", "/v1/models", b""),
    (b"/v1/models#frag", "/v1/models", b""),
    (b"/v1/models?a=1", "/v1/models", b"a=1"),
])
async def test_targets_that_need_the_url_parser_are_served(
    target: bytes, path: str, query: bytes,
) -> None:
    """Regression (compiled build only): a target with no query that goes through the URL
    parser (absolute-form, a bare ``?``, a fragment) got 400: the parser's missing query is
    ``None``, which its stub calls bytes and compiled code checked."""
    app = Recorder()
    async with serving(app) as server:
        reader, writer = await connect(server)
        writer.write(b"GET %s HTTP/1.1\r\nhost: x\r\n\r\n" % target)
        answer = await read_answer(reader)
        writer.close()
    assert answer.status == 200
    assert (app.scopes[0]["path"], app.scopes[0]["query_string"]) == (path, query)


async def test_a_head_begun_while_the_last_request_was_answered_is_timed() -> None:
    """Regression: the first bytes of a head that came while a request was being answered
    (pipelined in the same packet) armed no deadline, so a head never finished held the
    connection for ever."""
    app = Recorder()
    async with serving(app) as server:
        reader, writer = await connect(server)
        writer.write(post(b"/one", b"{}") + b"GET /two HTTP/1.1\r\nhost")
        answer = await read_answer(reader)
        assert await closed_by_server(reader, within_s=3.0)
        writer.close()
    assert answer.body == b"POST /one 2" and len(app.scopes) == 1


async def test_pipelining_past_the_limit_is_answered_429_after_the_queued_requests() -> None:
    """Regression: every request of one read was parsed and queued, without a cap, so a few
    hundred KiB of tiny pipelined requests held tens of MiB while the client read nothing."""
    app = Recorder()
    async with serving(app, HttpLimits(max_pipelined=4)) as server:
        reader, writer = await connect(server)
        writer.write(b"".join(b"GET /%d HTTP/1.1\r\nhost: x\r\n\r\n" % i for i in range(20)))
        answers = [await read_answer(reader) for _ in range(6)]
        assert await closed_by_server(reader)
        writer.close()
    assert [a.status for a in answers] == [200] * 5 + [429]
    assert [a.body for a in answers[:5]] == [b"GET /%d 0" % i for i in range(5)]


async def test_malformed_request_line_gets_400_and_the_connection_closed() -> None:
    app = Recorder()
    async with serving(app) as server:
        reader, writer = await connect(server)
        writer.write(b"GET /\x01 nonsense\r\n\r\n")
        answer = await read_answer(reader)
        assert await closed_by_server(reader)
        writer.close()
    assert answer.status == 400 and answer.headers[b"connection"] == b"close"
    assert app.scopes == []


async def test_header_block_over_the_limit_gets_431_and_the_connection_closed() -> None:
    app = Recorder()
    async with serving(app, HttpLimits(max_head_bytes=8 * 1024)) as server:
        reader, writer = await connect(server)
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n")
        for i in range(20):  # 20 headers of 1 KiB, sent one by one
            writer.write(b"x-pad-%d: %s\r\n" % (i, b"p" * 1024))
            await writer.drain()
        answer = await read_answer(reader)
        assert await closed_by_server(reader)
        writer.close()
    assert answer.status == 431 and app.scopes == []


async def test_head_over_the_limit_arriving_in_one_piece_gets_431() -> None:
    """A head that arrives whole is measured at its end (the URL and every header, counted
    as each header is parsed), not by the raw-byte count of the pieces before."""
    app = Recorder()
    async with serving(app, HttpLimits(max_head_bytes=8 * 1024)) as server:
        reader, writer = await connect(server)
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n"
                     + b"".join(b"x-pad-%d: %s\r\n" % (i, b"p" * 1024) for i in range(9))
                     + b"\r\n")
        answer = await read_answer(reader)
        writer.close()
    assert answer.status == 431 and app.scopes == []


async def test_each_head_on_a_keep_alive_connection_is_measured_alone() -> None:
    """Two heads of 5 KiB under an 8 KiB limit: each is under it (the count starts afresh
    with each request), though together they are not."""
    app = Recorder()
    async with serving(app, HttpLimits(max_head_bytes=8 * 1024)) as server:
        reader, writer = await connect(server)
        for i in range(2):
            writer.write(b"GET /h%d HTTP/1.1\r\nhost: x\r\n" % i
                         + b"".join(b"x-pad-%d: %s\r\n" % (j, b"p" * 1024) for j in range(5))
                         + b"\r\n")
            answer = await read_answer(reader)
            assert answer.status == 200 and answer.body == b"GET /h%d 0" % i
        writer.close()
    assert len(app.scopes) == 2


async def test_one_endless_header_line_is_cut_off_at_the_limit() -> None:
    """httptools buffers a header until its line ends: the server must count raw bytes."""
    async with serving(Recorder(), HttpLimits(max_head_bytes=8 * 1024)) as server:
        reader, writer = await connect(server)
        writer.write(b"GET / HTTP/1.1\r\nx-endless: ")
        for _ in range(16):
            writer.write(b"e" * 1024)
            await writer.drain()
        answer = await read_answer(reader)
        writer.close()
    assert answer.status == 431


async def test_slowloris_that_never_finishes_its_head_is_closed() -> None:
    app = Recorder()
    async with serving(app) as server:  # head_timeout_s=0.3
        reader, writer = await connect(server)
        started = asyncio.get_running_loop().time()
        with contextlib.suppress(ConnectionError):
            for byte in b"GET / HTTP/1.1\r\nhost: x\r\nx-slow: 1":
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(0.05)  # a byte well within any idle timeout
                if reader.at_eof():
                    break
        assert await closed_by_server(reader, 2.0)
        writer.close()
    assert asyncio.get_running_loop().time() - started < 1.5 and app.scopes == []


async def test_idle_keep_alive_connection_is_closed_after_the_timeout() -> None:
    async with serving(Recorder()) as server:  # keep_alive_s=0.3
        reader, writer = await connect(server)
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        await read_answer(reader)
        assert await closed_by_server(reader, 2.0)
        writer.close()


AIOHTTP_KEEPALIVE_S = 15.0  # aiohttp's TCPConnector default keepalive_timeout
ALB_IDLE_S = 60.0  # AWS ALB's default idle timeout


def gateway_settings(**limits: Any) -> Settings:
    return build_settings({"models": [{"name": "m", "tokenizer": "simple"}],
                           "pools": [{"name": "p", "max_context_tokens": 4096,
                                      "workers": ["http://127.0.0.1:9"]}],
                           "limits": limits})


async def test_the_gateways_keep_alive_is_its_setting_and_outlasts_client_pools() -> None:
    """Regression: the gateway closed idle client connections after 5 s (uvicorn's default): the
    openai client's (httpx's) pool expiry exactly, and below aiohttp's 15 s, so a client sending
    on a connection the gateway was closing could get a reset (likely the one ``ClientOSError``
    in 1,568 requests of a 400-s SLO run, whose client is aiohttp). The limit is now
    ``limits.client_keep_alive_s``, by default above the common pools' and a load balancer's."""
    default = http_limits(gateway_settings()).keep_alive_s
    assert default > max(httpx.Limits().keepalive_expiry or 0.0, AIOHTTP_KEEPALIVE_S, ALB_IDLE_S)
    limits = replace(http_limits(gateway_settings(client_keep_alive_s=0.3)),
                     sweep_interval_s=FAST.sweep_interval_s)
    async with serving(Recorder(), limits) as server:
        reader, writer = await connect(server)
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        await read_answer(reader)
        assert await closed_by_server(reader, 2.0)  # the setting reached the server
        writer.close()


async def test_websocket_upgrade_is_refused() -> None:
    app = Recorder()
    async with serving(app) as server:
        reader, writer = await connect(server)
        writer.write(b"GET /ws HTTP/1.1\r\nhost: x\r\nconnection: Upgrade\r\nupgrade: websocket"
                     b"\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                     b"sec-websocket-version: 13\r\n\r\n")
        answer = await read_answer(reader)
        assert await closed_by_server(reader)
        writer.close()
    assert answer.status == 403 and app.scopes == []


async def test_h2c_upgrade_is_ignored_and_answered_in_http_1_1() -> None:
    async with serving(Recorder()) as server:
        answer = await answered_and_closed(
            server, b"GET /h2 HTTP/1.1\r\nhost: x\r\nconnection: Upgrade, HTTP2-Settings\r\n"
            b"upgrade: h2c\r\nhttp2-settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n\r\n")
    assert answer.status == 200 and answer.body == b"GET /h2 0"


H2C = b"connection: Upgrade, HTTP2-Settings\r\nupgrade: h2c\r\nhttp2-settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n"


@pytest.mark.parametrize("split", [False, True], ids=["one-piece", "body-later"])
@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_h2c_upgrade_with_a_body_is_served_with_its_body(framing: str, split: bool) -> None:
    """``curl --http2 -d ...``: httptools ends the message at an upgrade's head, which gave the
    app an empty body (a chat answered 400 ``invalid_json``). The body is the request's own."""
    body = b'{"model": "m", "messages": []}'
    if framing == "chunked":
        head = b"POST /h2 HTTP/1.1\r\nhost: x\r\n" + H2C + b"transfer-encoding: chunked\r\n\r\n"
        sent = b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (10, body[:10], len(body) - 10, body[10:])
    else:
        head = b"POST /h2 HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n%s\r\n" % (len(body), H2C)
        sent = body
    app = Recorder()
    async with serving(app) as server:
        reader, writer = await connect(server)
        if split:
            writer.write(head)
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(sent[:7])
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(sent[7:])
        else:
            writer.write(head + sent)
        answer = await read_answer(reader)
        assert await closed_by_server(reader)  # the next bytes may be another protocol's
        writer.close()
    assert answer.status == 200 and answer.body == b"POST /h2 %d" % len(body)
    assert b"".join(m.get("body", b"") for m in app.received) == body


async def test_h2c_upgrade_with_a_body_then_another_request_reads_no_further() -> None:
    body = b"hello"
    app = Recorder()
    async with serving(app) as server:
        answer = await answered_and_closed(
            server, b"POST /h2 HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n" + H2C + b"\r\n"
            + body + post(b"/next", b"{}"))
    assert answer.status == 200 and answer.body == b"POST /h2 5"
    assert [sc["path"] for sc in app.scopes] == ["/h2"]


@pytest.mark.parametrize(("request_bytes", "status", "code"), [
    (b"GET / HTTP/1.1\r\nho st: x\r\n\r\n", 400, "invalid_http_request"),
    (b"GET / HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 70_000 + b"\r\n\r\n", 431,
     "request_header_fields_too_large"),
    (b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: gzip\r\n\r\n", 400,
     "invalid_transfer_encoding"),
    (b"GET /ws HTTP/1.1\r\nhost: x\r\nconnection: Upgrade\r\nupgrade: websocket\r\n\r\n", 403,
     "upgrade_refused"),
], ids=["invalid", "head-too-large", "transfer-coding", "websocket"])
async def test_the_servers_own_answers_are_openai_shaped_errors(
        request_bytes: bytes, status: int, code: str) -> None:
    """What an OpenAI client parses: ``{"error": {"message", "type", "param", "code"}}``."""
    async with serving(Recorder()) as server:
        answer = await answered_and_closed(server, request_bytes)
    assert answer.status == status
    assert answer.headers[b"content-type"] == b"application/json"
    error = orjson.loads(answer.body)["error"]
    assert error["code"] == code and error["message"]
    # the shape and the type by status the app's errors have (gateway.errors)
    assert orjson.loads(answer.body) == GatewayError(status, error["message"], code=code).body()


async def test_client_leaving_mid_body_is_a_disconnect_for_the_app() -> None:
    app = Recorder()
    async with serving(app) as server:
        _, writer = await connect(server)
        writer.write(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\npartial")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()
        await asyncio.wait_for(app.disconnected.wait(), 5)
    assert app.received[-1] == {"type": "http.disconnect"}


async def test_client_leaving_after_its_body_is_seen_by_an_app_waiting_in_receive() -> None:
    """What the dispatcher relies on while a request waits for admission or a stream is
    relayed: with the body read, ``receive`` returns only when the client leaves."""
    app = Recorder(behaviour="watch")
    async with serving(app) as server:
        _, writer = await connect(server)
        writer.write(post(b"/w", b"{}"))
        await asyncio.wait_for(app.done.wait(), 5)
        await asyncio.sleep(0.1)
        assert not app.disconnected.is_set()  # nothing happened: receive() still waits
        writer.close()
        await asyncio.wait_for(app.disconnected.wait(), 5)


async def test_reading_pauses_while_an_unread_body_passes_the_high_water_mark() -> None:
    app = Recorder(behaviour="unread")
    async with serving(app, HttpLimits(body_high_water_bytes=64 * 1024)) as server:
        _, writer = await connect(server)
        size = 64 * 1024 * 1024  # more than the kernel's socket buffers hold
        writer.write(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % size)
        writer.write(b"b" * size)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(writer.drain(), 0.5)  # the server stopped reading
        connection = next(iter(server.connections))
        assert connection.read_paused
        assert connection.active is not None and len(connection.active.body) < 1024 * 1024
        app.done.set()
        writer.transport.abort()


async def test_send_waits_while_the_client_does_not_read() -> None:
    app = Recorder(behaviour="flood")  # 64 MiB
    async with serving(app) as server:
        reader, writer = await connect(server)
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        await asyncio.sleep(0.5)
        assert not app.done.is_set() and app.sent_bytes < 64 * 1024 * 1024
        answer = await read_answer(reader)  # reading lets the app go on
        writer.close()
    assert app.done.is_set() and len(answer.body) == 64 * 1024 * 1024


STALL = HttpLimits(send_timeout_s=0.5, sweep_interval_s=0.05)


async def test_client_that_stops_reading_is_dropped_after_the_send_timeout() -> None:
    app = Recorder(behaviour="flood")  # 64 MiB
    async with serving(app, STALL) as server:
        reader, writer = await connect(server)
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        await asyncio.sleep(0.2)
        assert not app.done.is_set()  # send waits: the client reads nothing
        # dropped: the unread bytes are discarded and the app's sends stop waiting
        await asyncio.wait_for(app.done.wait(), 5)
        received = 0
        with contextlib.suppress(ConnectionResetError):
            while data := await asyncio.wait_for(reader.read(1 << 20), 5):
                received += len(data)
        writer.close()
    assert received < 64 * 1024 * 1024


async def test_slow_client_that_keeps_reading_is_not_dropped() -> None:
    app = Recorder(behaviour="flood")  # 64 MiB
    # Kernel buffers hide a reading client's progress until whole windows move, so "slow" here
    # is a few MB/s against a timeout of 2 s (production: 60 s).
    limits = HttpLimits(send_timeout_s=2.0, sweep_interval_s=0.05)
    async with serving(app, limits) as server:
        reader, writer = await connect(server)
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        for _ in range(100):  # 5 s, over twice the send timeout, taking a little at a time
            await asyncio.sleep(0.05)
            await reader.read(128 * 1024)
        assert not app.done.is_set()
        rest = await read_answer_body_after_head(reader)
        writer.close()
    assert app.done.is_set() and rest > 0


async def read_answer_body_after_head(reader: asyncio.StreamReader) -> int:
    """Bytes left of an answer whose beginning was read already, up to the last chunk."""
    total = 0
    while not (data := await asyncio.wait_for(reader.read(1 << 20), 10)).endswith(b"0\r\n\r\n"):
        assert data, "the connection closed before the answer's end"
        total += len(data)
    return total + len(data)


async def test_send_body_nowait_writes_at_once_and_refuses_while_the_client_does_not_read(
) -> None:
    app = Recorder(behaviour="nowait_flood")
    async with serving(app) as server:
        reader, writer = await connect(server)
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        await asyncio.wait_for(app.done.wait(), 5)
        assert 0 < app.sent_bytes < 64 * 1024 * 1024  # refused once the write buffer filled
        answer = await read_answer(reader)
        writer.close()
    assert answer.body == b"y" * app.sent_bytes + b"end"


async def test_app_failing_before_its_answer_gets_a_500_in_the_openai_shape() -> None:
    async with serving(Recorder(behaviour="fail_before")) as server:
        reader, writer = await connect(server)
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        answer = await read_answer(reader)
        writer.close()
    assert answer.status == 500
    assert orjson.loads(answer.body) == GatewayError(500, "Internal Server Error",
                                                     code="internal_error").body()
    assert answer.headers[b"connection"] == b"close"


async def test_app_failing_during_its_answer_closes_the_connection() -> None:
    async with serving(Recorder(behaviour="fail_after")) as server:
        reader, writer = await connect(server)
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        with pytest.raises(asyncio.IncompleteReadError):
            await read_answer(reader)  # the chunked body never ends: the connection does
        writer.close()


async def test_app_failing_after_its_whole_answer_keeps_the_connection() -> None:
    async with serving(Recorder(behaviour="fail_after_complete")) as server:
        reader, writer = await connect(server)
        writer.write(b"GET /fail HTTP/1.1\r\nhost: x\r\n\r\nGET /next HTTP/1.1\r\nhost: x\r\n\r\n")
        first = await read_answer(reader)
        second = await read_answer(reader)
        writer.close()
    assert (first.body, second.body) == (b"whole", b"GET /next 0")


# -- lifespan and shutdown ---------------------------------------------------------------------


async def _failing_startup(scope: Scope, receive: Receive, send: Send) -> None:
    await receive()
    await send({"type": "lifespan.startup.failed", "message": "no tokenizer"})


async def test_failed_startup_raises_and_serves_nothing() -> None:
    with pytest.raises(StartupFailed):
        async with serving(_failing_startup):
            pass


def test_gateway_process_with_a_failed_startup_exits_with_uvicorns_status() -> None:
    server = GatewayServer(_failing_startup, port=0)
    with pytest.raises(SystemExit) as exited:
        asyncio.run(server.serve())
    assert exited.value.code == STARTUP_FAILURE == 3


async def test_stop_closes_idle_connections_and_lets_the_request_in_flight_finish() -> None:
    app = Recorder(behaviour="unread")
    async with serving(app) as server:
        idle_reader, idle_writer = await connect(server)
        busy_reader, busy_writer = await connect(server)
        busy_writer.write(b"GET /busy HTTP/1.1\r\nhost: x\r\n\r\n")
        await asyncio.sleep(0.1)
        server.request_stop()
        assert await closed_by_server(idle_reader, 1.0)
        app.done.set()  # the request in flight answers now
        answer = await read_answer(busy_reader)
        assert answer.body == b"unread" and answer.headers[b"connection"] == b"close"
        assert await closed_by_server(busy_reader, 1.0)
        idle_writer.close()
        busy_writer.close()


async def test_request_still_running_when_the_grace_ends_is_cancelled() -> None:
    app = Recorder(behaviour="sleep")
    async with serving(app, grace_s=0.3) as server:
        reader, writer = await connect(server)
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        await asyncio.wait_for(app.done.wait(), 5)
        started = asyncio.get_running_loop().time()
        server.request_stop()
        assert await closed_by_server(reader, 3.0)
        writer.close()
    assert asyncio.get_running_loop().time() - started < 2.0
    assert not server.tasks


async def test_force_stop_cancels_requests_without_waiting_for_the_grace() -> None:
    app = Recorder(behaviour="sleep")
    async with serving(app, grace_s=60) as server:
        reader, writer = await connect(server)
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        await asyncio.wait_for(app.done.wait(), 5)
        server.request_stop()
        await asyncio.sleep(0.2)
        server.force_stop()
        assert await closed_by_server(reader, 3.0)
        writer.close()
    assert not server.tasks


async def test_request_whose_last_transfer_coding_is_not_chunked_gets_400_and_is_closed() -> None:
    """Found by probing: ``transfer-encoding: gzip`` (no chunked) reached the app, whose body
    httptools then read until the close, holding the request open until the shutdown grace.
    RFC 9112 6.3 asks for 400 and a close: its length cannot be known."""
    for codings in (b"gzip", b"chunked, gzip"):
        app = Recorder()
        async with serving(app) as server:
            reader, writer = await connect(server)
            writer.write(b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: " + codings
                         + b"\r\n\r\nabc")
            answer = await read_answer(reader)
            assert await closed_by_server(reader)
            writer.close()
        assert answer.status == 400, codings
        assert app.scopes == []


async def test_on_disconnect_extension_calls_back_once_when_the_client_leaves_mid_answer() -> None:
    """``kvgate.on_disconnect``: the proxy cancels its upstream request from it, with no task
    waiting in ``receive()``. Called when the client leaves before the answer completed; not
    for an answer that completed, nor once unregistered."""
    calls: list[str] = []
    answered = asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return
        on_disconnect = scope["extensions"][ON_DISCONNECT]
        path = scope["path"]
        on_disconnect(lambda: calls.append(path))
        if path == "/unregistered":
            on_disconnect(None)
        elif path == "/complete":
            await _answer(send, b"done")
            answered.set()
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"partial", "more_body": True})
        answered.set()
        await asyncio.sleep(3)

    async with serving(app) as server:
        for path in (b"/complete", b"/unregistered", b"/mid-answer"):
            answered.clear()
            reader, writer = await connect(server)
            writer.write(b"GET " + path + b" HTTP/1.1\r\nhost: x\r\n\r\n")
            await asyncio.wait_for(answered.wait(), 5)
            await reader.read(1)
            writer.close()
            await asyncio.sleep(0.1)
    assert calls == ["/mid-answer"]


async def test_on_disconnect_registered_after_the_client_left_calls_back_at_once() -> None:
    """Regression: a client that closed right after its request, while the app was still
    working on it (the gateway's admission, routing, tokenizing in a thread), was never told to
    a callback registered later: the proxy forwarded the request and the worker generated the
    whole answer for nobody."""
    calls: list[str] = []
    gone = asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return
        assert (await receive())["type"] == "http.request"
        assert (await receive())["type"] == "http.disconnect"  # the client left
        scope["extensions"][ON_DISCONNECT](lambda: calls.append("told"))
        assert calls == ["told"]  # at once, not on some later event
        gone.set()

    async with serving(app) as server:
        _, writer = await connect(server)
        writer.write(post(b"/late", b"{}"))
        await writer.drain()
        writer.close()
        await asyncio.wait_for(gone.wait(), 5)
    assert calls == ["told"]
