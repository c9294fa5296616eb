"""Two proxies that only forward: the floors under kvgate's CPU per request.

The overhead benchmark (``gateway.bench.overhead``) puts them beside kvgate and the Rust routers
in front of the same backend, so one run splits kvgate's CPU per request into what any Python
proxy pays, what kvgate's own HTTP layers pay, and what its features (parsing, tokenization,
routing, budgets, metrics, accounting) pay:

- ``bare``: the least a Python proxy on this event loop can do per request. ``asyncio.Protocol``
  with httptools on both sides (uvloop), keep-alive connections to the upstream, no task, no
  ASGI, no header handling: the request line, ``content-type`` and the body go upstream, and the
  upstream's answer is relayed to the client byte for byte (head, chunked stream and all) while
  its parser only watches for the end of the answer to put the connection back in the pool.
  Two socket reads and two writes per request, as every router here makes.
- ``plumbing``: kvgate's own layers with nothing on top: its HTTP server (``gateway.httpd``,
  ASGI) and its upstream client (``gateway.upstream.client``, keep-alive pools), joined by a
  pass-through app that reads the body, posts it upstream and sends back the status,
  ``content-type`` and body: read whole, as kvgate relays an answer that is not a stream, or
  chunk by chunk for ``text/event-stream``. What kvgate's request path costs beyond
  this is its features.

Neither is a product: no error handling beyond closing the client's connection when the
upstream fails, no timeouts, one upstream. ``GET /health`` is forwarded by ``bare`` and
answered by ``plumbing`` itself (its client posts only), which is all their readiness needs.

Run: ``python -m gateway.bench.floor --kind bare|plumbing --port 9002 --upstream
http://127.0.0.1:9001``.
"""

from __future__ import annotations

import argparse
import asyncio
from collections import deque
from typing import Any, cast
from urllib.parse import urlsplit

import httptools
import uvloop

from gateway.httpd.server import HttpServer
from gateway.upstream.client import UpstreamClient

KINDS = ("bare", "plumbing")


class _Upstream(asyncio.Protocol):
    """One keep-alive connection to the upstream; relays each answer to the client it serves."""

    def __init__(self, pool: _Pool) -> None:
        self.pool = pool
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.client: _Client | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass of it

    def data_received(self, data: bytes) -> None:
        client = self.client
        if client is not None and client.transport is not None:
            client.transport.write(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:  # not HTTP: both connections go (connection_lost)
            if self.transport is not None:
                self.transport.close()

    def on_message_complete(self) -> None:
        client, self.client = self.client, None
        if self.parser.should_keep_alive():
            self.pool.idle.append(self)
        elif self.transport is not None:
            self.transport.close()
        if client is not None:
            client.answered()

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self.pool.idle:
            self.pool.idle.remove(self)
        client, self.client = self.client, None
        if client is not None and client.transport is not None:
            client.transport.close()


class _Pool:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.idle: deque[_Upstream] = deque()

    def send(self, client: _Client, data: bytes) -> None:
        if self.idle:
            up = self.idle.pop()
            up.client = client
            assert up.transport is not None
            up.transport.write(data)
        else:
            asyncio.get_running_loop().create_task(self._connect(client, data))

    async def _connect(self, client: _Client, data: bytes) -> None:
        loop = asyncio.get_running_loop()
        try:
            transport, up = await loop.create_connection(lambda: _Upstream(self), self.host,
                                                         self.port)
        except OSError:
            if client.transport is not None:
                client.transport.close()
            return
        up.client = client
        transport.write(data)


class _Client(asyncio.Protocol):
    """One client connection: requests in order, one upstream exchange at a time."""

    def __init__(self, pool: _Pool) -> None:
        self.pool = pool
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.content_type = b""
        self.body: list[bytes] = []
        self.pending: deque[bytes] = deque()
        self.busy = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass of it

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-type":
            self.content_type = value

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        body = b"".join(self.body)
        head = [self.parser.get_method(), b" ", self.url, b" HTTP/1.1\r\nhost: upstream\r\n"]
        if self.content_type:
            head += [b"content-type: ", self.content_type, b"\r\n"]
        head += [b"content-length: ", str(len(body)).encode(), b"\r\n\r\n", body]
        self.url, self.content_type, self.body = b"", b"", []
        self.pending.append(b"".join(head))
        if not self.busy:
            self._next()

    def _next(self) -> None:
        if self.pending and self.transport is not None and not self.transport.is_closing():
            self.busy = True
            self.pool.send(self, self.pending.popleft())

    def answered(self) -> None:
        self.busy = False
        self._next()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.pending.clear()


async def serve_bare(port: int, upstream: str) -> None:
    parts = urlsplit(upstream)
    pool = _Pool(parts.hostname or "127.0.0.1", parts.port or 80)
    loop = asyncio.get_running_loop()
    listener = await loop.create_server(lambda: _Client(pool), "127.0.0.1", port, backlog=2048)
    async with listener:
        await listener.serve_forever()


def plumbing_app(upstream: str) -> Any:
    """The pass-through ASGI app of ``plumbing``: a POST goes to ``upstream``, anything else is
    answered 200 (the readiness probe)."""
    client = UpstreamClient()
    origin = upstream.rstrip("/")

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    client.close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["method"] != "POST":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-length", b"2")]})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        parts: list[bytes] = []
        while True:
            message = await receive()
            parts.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        answer = await client.post(origin, scope["path"], b"".join(parts),
                                   {"content-type": "application/json"},
                                   connect_timeout_s=10.0, read_timeout_s=None)
        content_type = answer.headers.get("content-type", "")
        headers = [(b"content-type", content_type.encode())]
        try:
            if not content_type.startswith("text/event-stream"):
                body = await answer.read()
                headers.append((b"content-length", str(len(body)).encode()))
                await send({"type": "http.response.start", "status": answer.status,
                            "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
            await send({"type": "http.response.start", "status": answer.status,
                        "headers": headers})
            async for chunk in answer:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            answer.release()

    return app


async def serve_plumbing(port: int, upstream: str) -> None:
    await HttpServer(plumbing_app(upstream)).serve(host="127.0.0.1", port=port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway.bench.floor", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", choices=KINDS, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="the backend's URL")
    args = parser.parse_args(argv)
    serve = serve_bare if args.kind == "bare" else serve_plumbing
    uvloop.run(serve(args.port, args.upstream))  # as the gateway runs
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
