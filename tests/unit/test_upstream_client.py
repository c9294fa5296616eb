"""The hot path's HTTP/1.1 client (``gateway.upstream.client``) against real loopback sockets: a
tiny asyncio server per test, scripted per connection, and ``tests.harness.SocketWorker`` for
resets and FINs. What each failure is called decides whether the request is retried
(``never_reached``), so each is provoked for real."""

from __future__ import annotations

import asyncio
import socket
import ssl
import struct
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from gateway.upstream import client as client_module
from gateway.upstream.client import READ_HIGH_WATER_BYTES, UpstreamClient
from gateway.upstream.errors import ConnectError, ReadTimeout, ResetError, ServerDisconnected
from gateway.upstream.placement import never_reached
from tests.harness import SocketWorker

pytestmark = pytest.mark.timeout(30)

PATH = "/v1/chat/completions"
HEADERS = {"content-type": "application/json"}
OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"

Handler = Callable[["Exchange"], Awaitable[None]]


class Exchange:
    """One request as the server read it, and its connection to answer on."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 connection: int, head: bytes, body: bytes) -> None:
        self.reader, self.writer = reader, writer
        self.connection = connection  # which connection (0, 1, ...) it came on
        self.head, self.body = head, body

    def reset(self) -> None:
        sock = self.writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.writer.transport.abort()


class Server:
    """Reads requests (head + content-length body) on each connection and hands them to
    ``handler``; ``read`` False: connections are accepted and never read."""

    def __init__(self, handler: Handler, read: bool = True) -> None:
        self.handler, self.read = handler, read
        self.connections = 0
        self.requests: list[Exchange] = []
        self.closed = asyncio.Event()  # a connection ended from the client's side
        self.origin = ""
        self._open: list[tuple[asyncio.Task[None], asyncio.StreamWriter]] = []

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = self.connections
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self._open.append((task, writer))
        if not self.read:
            await reader.read()  # EOF: the client closed
            self.closed.set()
            return
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                body = await reader.readexactly(length)
                exchange = Exchange(reader, writer, connection, head, body)
                self.requests.append(exchange)
                await self.handler(exchange)
                if writer.is_closing():
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed.set()

    async def close(self) -> None:
        for task, writer in self._open:
            task.cancel()
            writer.close()
        await asyncio.gather(*(t for t, _ in self._open), return_exceptions=True)


@asynccontextmanager
async def serving(handler: Handler, read: bool = True,
                  tls: ssl.SSLContext | None = None) -> AsyncIterator[Server]:
    server = Server(handler, read)
    listener = await asyncio.start_server(server.serve, "127.0.0.1", 0, ssl=tls)
    port = listener.sockets[0].getsockname()[1]
    server.origin = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    try:
        yield server
    finally:
        listener.close()
        await server.close()


async def fetch(client: UpstreamClient, origin: str) -> bytes:
    """A whole answer's body, its connection given back."""
    r = await post(client, origin)
    body = await r.read()
    r.release()
    return body


async def answer_ok(exchange: Exchange) -> None:
    exchange.writer.write(OK)
    await exchange.writer.drain()


async def post(client: UpstreamClient, origin: str, body: bytes = b"{}",
               read_timeout_s: float | None = 5.0) -> client_module.Response:
    return await client.post(origin, PATH, body, HEADERS, connect_timeout_s=2.0,
                             read_timeout_s=read_timeout_s)


async def test_connection_is_reused_when_the_answer_was_read_whole() -> None:
    client = UpstreamClient()
    async with serving(answer_ok) as server:
        for _ in range(3):
            r = await post(client, server.origin)
            assert (r.status, r.headers["content-type"], await r.read()) == (
                200, "application/json", b"{}")
            r.release()
        assert server.connections == 1
        assert client.idle_connections(server.origin) == 1
        head = server.requests[0].head.decode()
        assert head.startswith(f"POST {PATH} HTTP/1.1\r\nhost: {server.origin[7:]}\r\n")
        assert "content-type: application/json\r\ncontent-length: 2\r\n" in head
    client.close()


async def test_connection_is_not_reused_when_the_answer_was_not_read() -> None:
    client = UpstreamClient()
    async with serving(answer_ok) as server:
        r = await post(client, server.origin)
        r.release()  # body arrived but was never read: not at EOF
        assert await fetch(client, server.origin) == b"{}"
        assert server.connections == 2
    client.close()


async def test_chunked_stream_is_handed_out_dechunked_as_it_arrives() -> None:
    go_on = asyncio.Event()

    async def stream(exchange: Exchange) -> None:
        w = exchange.writer
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\n\r\n")
        w.write(b"6\r\ndata: \r\n")
        await w.drain()
        await go_on.wait()  # the second chunk waits until the client has the first
        w.write(b"5\r\nhello\r\n0\r\n\r\n")
        await w.drain()

    client = UpstreamClient()
    async with serving(stream) as server:
        r = await post(client, server.origin, read_timeout_s=None)
        assert await anext(r) == b"data: "
        go_on.set()
        assert [c async for c in r] == [b"hello"]
        assert r.at_eof
        r.release()
        assert client.idle_connections(server.origin) == 1
    client.close()


async def test_sink_takes_pieces_only_while_the_reader_waits_and_refused_ones_reach_it() -> None:
    go_on = asyncio.Event()

    async def stream(exchange: Exchange) -> None:
        w = exchange.writer
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\ntake0\r\n")
        await w.drain()
        await go_on.wait()
        for piece in (b"take1", b"take2", b"other", b"take3"):
            w.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await w.drain()
            await asyncio.sleep(0.01)
        w.write(b"0\r\n\r\n")
        await w.drain()

    taken: list[bytes] = []

    def sink(piece: bytes) -> bool:
        if piece.startswith(b"take"):
            taken.append(piece)
            return True
        return False

    client = UpstreamClient()
    async with serving(stream) as server:
        r = await post(client, server.origin, read_timeout_s=None)
        r.sink = sink
        await asyncio.sleep(0.1)  # take0 arrives while nobody waits: it is the reader's
        assert await anext(r) == b"take0"
        go_on.set()
        rest = [c async for c in r]
        # take3 may come before the reader took "other" (then it is buffered behind it)
        assert taken[:2] == [b"take1", b"take2"]
        assert b"".join(taken[2:] + rest) in (b"othertake3", b"take3other")
        assert b"".join(rest).startswith(b"other") and r.at_eof
    client.close()


async def test_close_mid_stream_closes_the_workers_connection() -> None:
    async def endless(exchange: Exchange) -> None:
        w = exchange.writer
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        while not w.is_closing():
            w.write(b"6\r\ntoken \r\n")
            await w.drain()
            await asyncio.sleep(0.01)

    client = UpstreamClient()
    async with serving(endless) as server:
        r = await post(client, server.origin, read_timeout_s=None)
        await anext(r)
        r.close()
        await asyncio.wait_for(server.closed.wait(), 5)  # vLLM would abort the request here
        assert client.idle_connections(server.origin) == 0
    client.close()


async def test_refused_connection_is_a_never_reached_connect_error() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    origin = f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()  # nothing listens there
    with pytest.raises(ConnectError) as caught:
        await post(UpstreamClient(), origin)
    assert never_reached(caught.value)


async def test_reset_before_any_answer_is_a_never_reached_reset_error() -> None:
    worker = SocketWorker("reset")
    try:
        with pytest.raises(ResetError) as caught:
            await post(UpstreamClient(), worker.url)
    finally:
        worker.close()
    assert worker.completions == 1
    assert never_reached(caught.value)


async def test_fin_after_the_request_was_read_is_a_disconnect_that_is_not_retried() -> None:
    worker = SocketWorker("close")
    try:
        with pytest.raises(ServerDisconnected) as caught:
            await post(UpstreamClient(), worker.url)
    finally:
        worker.close()
    assert not never_reached(caught.value)


async def test_silent_worker_is_a_read_timeout_when_read_timeout_is_set() -> None:
    async def silent(exchange: Exchange) -> None:
        await asyncio.sleep(10)

    client = UpstreamClient()
    async with serving(silent) as server:
        loop = asyncio.get_running_loop()
        started_s = loop.time()
        with pytest.raises(ReadTimeout) as caught:
            await post(client, server.origin, read_timeout_s=0.2)
        assert 0.2 <= loop.time() - started_s < 2
        assert isinstance(caught.value, TimeoutError)  # the 504, as aiohttp's sock_read was
        assert not never_reached(caught.value)
    client.close()


async def test_read_timeout_is_between_bytes_not_for_the_whole_answer() -> None:
    async def slow_but_steady(exchange: Exchange) -> None:
        w = exchange.writer
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(6):  # 0.6 s in all, never 0.3 s without a byte
            await asyncio.sleep(0.1)
            w.write(b"1\r\nx\r\n")
            await w.drain()
        w.write(b"0\r\n\r\n")

    client = UpstreamClient()
    async with serving(slow_but_steady) as server:
        r = await post(client, server.origin, read_timeout_s=0.3)
        assert await r.read() == b"x" * 6
        r.release()
    client.close()


async def test_a_kept_connection_times_out_its_next_exchange_on_that_exchange_s_limit() -> None:
    """The connection's read timer is armed once and kept: a timer left from an exchange with a
    longer limit must not let a later exchange with a shorter one wait that long."""
    async def ok_then_silent(exchange: Exchange) -> None:
        if len(server.requests) == 1:
            await answer_ok(exchange)
        else:
            await asyncio.sleep(10)

    client = UpstreamClient()
    async with serving(ok_then_silent) as server:
        r = await post(client, server.origin, read_timeout_s=30.0)
        await r.read()
        r.release()
        loop = asyncio.get_running_loop()
        started_s = loop.time()
        with pytest.raises(ReadTimeout):
            await post(client, server.origin, read_timeout_s=0.2)
        assert 0.2 <= loop.time() - started_s < 2
        assert server.connections == 1  # the same connection, reused
    client.close()


async def test_a_timer_armed_by_an_earlier_exchange_does_not_cut_a_later_one_short() -> None:
    """The timer of the first exchange fires while the second is waiting, well within the
    second's own limit: it re-arms for what is left of it, and the answer that comes in time
    is read; one that does not come still times out at its own limit."""
    answers = iter([0.0, 0.2, 10.0])

    async def answer_after(exchange: Exchange) -> None:
        await asyncio.sleep(next(answers))
        await answer_ok(exchange)

    client = UpstreamClient()
    async with serving(answer_after) as server:
        loop = asyncio.get_running_loop()
        r = await post(client, server.origin, read_timeout_s=0.3)
        await r.read()
        r.release()
        await asyncio.sleep(0.15)  # the first exchange's timer is due 0.15 s into the next
        r = await post(client, server.origin, read_timeout_s=0.3)  # answered after 0.2 s
        assert await r.read() == b"{}"
        r.release()
        started_s = loop.time()
        with pytest.raises(ReadTimeout):
            await post(client, server.origin, read_timeout_s=0.3)
        assert 0.3 <= loop.time() - started_s < 2
        assert server.connections == 1
    client.close()


async def test_exchanges_on_one_connection_share_one_read_timer() -> None:
    loop = asyncio.get_running_loop()
    armed: list[float] = []
    call_at = loop.call_at

    def counting_call_at(when: float, callback: Any, *args: Any,
                         **kwargs: Any) -> asyncio.TimerHandle:
        if getattr(callback, "__name__", "") == "_check_read_timeout":  # not the pool's sweeper
            armed.append(when)
        return call_at(when, callback, *args, **kwargs)

    client = UpstreamClient()
    async with serving(answer_ok) as server:
        loop.call_at = counting_call_at  # type: ignore[method-assign,assignment]
        try:
            for _ in range(20):
                await fetch(client, server.origin)
        finally:
            del loop.call_at
        assert server.connections == 1
    client.close()
    assert len(armed) == 1


async def test_idle_connection_the_worker_closed_leaves_the_pool() -> None:
    async def answer_then_close(exchange: Exchange) -> None:
        await answer_ok(exchange)
        await asyncio.sleep(0.05)
        exchange.writer.close()  # the worker's keep-alive timeout

    client = UpstreamClient()
    async with serving(answer_then_close) as server:
        r = await post(client, server.origin)
        await r.read()
        r.release()
        await asyncio.sleep(0.3)
        assert client.idle_connections(server.origin) == 0
        assert await fetch(client, server.origin) == b"{}"
        assert server.connections == 2
    client.close()


async def test_idle_connection_older_than_keepalive_is_not_reused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(client_module, "KEEPALIVE_S", 0.1)
    client = UpstreamClient()
    async with serving(answer_ok) as server:
        r = await post(client, server.origin)
        await r.read()
        r.release()
        await asyncio.sleep(0.3)  # the sweeper has closed it by now
        assert client.idle_connections(server.origin) == 0
        await fetch(client, server.origin)
        assert server.connections == 2
    client.close()


async def test_reused_connection_reset_before_answering_is_sent_again_on_a_new_one() -> None:
    """Regression guard for the keep-alive race: a worker that closed a kept-alive connection as
    the gateway wrote on it resets it (the request unread); that must not fail a request to a
    healthy worker."""
    async def reset_second_request(exchange: Exchange) -> None:
        if exchange.connection == 0 and len(server.requests) == 2:
            exchange.reset()
        else:
            await answer_ok(exchange)

    client = UpstreamClient()
    async with serving(reset_second_request) as server:
        assert await fetch(client, server.origin) == b"{}"
        assert await fetch(client, server.origin) == b"{}"
        assert [e.connection for e in server.requests] == [0, 0, 1]
    client.close()


async def test_fresh_connection_reset_is_not_sent_again() -> None:
    async def reset(exchange: Exchange) -> None:
        exchange.reset()

    client = UpstreamClient()
    async with serving(reset) as server:
        with pytest.raises(ResetError):
            await post(client, server.origin)
        assert len(server.requests) == 1  # the retry elsewhere is the placement's call
    client.close()


async def test_reading_pauses_when_the_reader_falls_behind_a_fast_stream() -> None:
    total_bytes = 8 * 1024 * 1024

    async def fast(exchange: Exchange) -> None:
        w = exchange.writer
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % total_bytes)
        for _ in range(total_bytes // 65536):
            w.write(b"x" * 65536)
            await w.drain()

    client = UpstreamClient()
    async with serving(fast) as server:
        r = await post(client, server.origin, read_timeout_s=None)
        await asyncio.sleep(0.3)  # the reader takes nothing for a while
        buffered = r._buffered_bytes
        assert READ_HIGH_WATER_BYTES < buffered < READ_HIGH_WATER_BYTES + 2 * 1024 * 1024
        assert len(await r.read()) == total_bytes  # resumed once read
        r.release()
    client.close()


async def test_large_body_is_written_as_the_socket_drains(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    transports: list[asyncio.Transport] = []
    made = client_module._Connection.connection_made

    def record(self: client_module._Connection, transport: asyncio.BaseTransport) -> None:
        made(self, transport)
        assert self.transport is not None
        transports.append(self.transport)

    monkeypatch.setattr(client_module._Connection, "connection_made", record)
    body = b"x" * (32 * 1024 * 1024)
    release = asyncio.Event()

    async def slow_reader(exchange: Exchange) -> None:
        await answer_ok(exchange)

    async def gated(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await release.wait()  # nothing is read until then: the client's writes must wait
        await server.serve(reader, writer)

    server = Server(slow_reader)
    listener = await asyncio.start_server(gated, "127.0.0.1", 0)
    origin = f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}"
    client = UpstreamClient()
    try:
        posting = asyncio.create_task(post(client, origin, body))
        await asyncio.sleep(0.3)
        assert not posting.done()
        # not 32 MiB in the transport: what the kernel holds + about one piece beyond the mark
        assert transports[0].get_write_buffer_size() < 1024 * 1024
        release.set()
        r = await posting
        assert await r.read() == b"{}"
        r.release()
        assert server.requests[0].body == body
    finally:
        listener.close()
        await server.close()
        client.close()


@pytest.fixture
def self_signed(tmp_path: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, made by the openssl command (installed by
    ``scripts/setup.sh``)."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key


async def test_https_worker_is_reached_over_tls_and_its_connection_kept_alive(
    self_signed: tuple[Path, Path],
) -> None:
    cert, key = self_signed
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert, key)
    client = UpstreamClient(ssl.create_default_context(cafile=str(cert)))
    async with serving(answer_ok, tls=server_tls) as server:
        assert await fetch(client, server.origin) == b"{}"
        assert await fetch(client, server.origin) == b"{}"
        assert server.connections == 1
        with pytest.raises(ConnectError):  # the system's CAs do not trust this certificate
            await post(UpstreamClient(), server.origin)
    client.close()
