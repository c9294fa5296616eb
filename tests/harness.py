"""Run ASGI apps (the gateway, the no-op backend) on real loopback ports, in a thread each.

Tests then use real HTTP clients (httpx, the openai client) against real sockets, so the whole
stack (the server, disconnects, streaming) is exercised as in production. Ports and readiness come
from the process kit (``gateway.procs.net``); apps that must run as processes of their own are
started with ``gateway.procs`` too.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import httpx
import uvicorn
import zmq
from starlette.types import Receive, Scope, Send

from gateway.kvindex.hashing import BlockHash
from gateway.kvindex.index import BlockIndex
from gateway.procs.net import http_status, wait_until


@contextmanager
def serve_app(app: Any, port: int | None = None, ready_path: str = "/health",
              server: Literal["auto", "kvgate", "uvicorn"] = "auto") -> Iterator[str]:
    """Serve ``app`` until the block ends. ``auto``: the gateway (``KvgateApp``) on the server
    ``kvgate serve`` runs (``gateway.httpd``), any other app (fake workers, the no-op backend)
    on uvicorn, as vLLM is. The listening socket is bound here, on ``port`` or a free one, and
    handed to the server: no other process can take the port between its choice and the bind."""
    from gateway.app import KvgateApp

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers themselves do
        sock.bind(("127.0.0.1", port or 0))
        sock.listen(2048)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        if server == "kvgate" or (server == "auto" and isinstance(app, KvgateApp)):
            thread, stop = _serve_httpd(app, sock)
        else:
            thread, stop = _serve_uvicorn(app, sock)
        thread.start()
        try:
            def ready() -> bool:
                if not thread.is_alive():
                    raise RuntimeError(f"server at {url} failed to start")
                status = http_status(url + ready_path)
                return status is not None and status < 500

            wait_until(ready, 60, f"server at {url}")
            yield url
        finally:
            stop()
            thread.join(timeout=30)
        # A server whose shutdown hangs (a background loop that never ends) is a failure,
        # not a thread left behind: ``kvgate serve`` would hang on SIGTERM the same way.
        assert not thread.is_alive(), f"server at {url} did not stop within 30 s"
    finally:
        sock.close()


def _serve_uvicorn(app: Any, sock: socket.socket) -> tuple[threading.Thread, Callable[[], None]]:
    """A thread running ``app`` on uvicorn, listening on ``sock``, and what stops it."""
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")
    uv = uvicorn.Server(config)

    def stop() -> None:
        uv.should_exit = True

    return threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True), stop


def _serve_httpd(app: Any, sock: socket.socket) -> tuple[threading.Thread, Callable[[], None]]:
    """A thread running ``app`` on ``gateway.httpd`` with its own loop, listening on ``sock``, and
    what stops it gracefully (the requests in flight finish, as in ``kvgate serve``)."""
    from gateway.httpd import HttpServer
    from gateway.server import run

    server = HttpServer(app)
    loops: list[asyncio.AbstractEventLoop] = []

    async def main() -> None:
        loops.append(asyncio.get_running_loop())
        await server.serve(sock=sock, grace_s=30)

    def stop() -> None:
        if loops and not loops[0].is_closed():
            with contextlib.suppress(RuntimeError):  # the loop ended meanwhile
                loops[0].call_soon_threadsafe(server.request_stop)

    return threading.Thread(target=run, args=(main(),), daemon=True), stop


async def answer_probe(scope: Scope, send: Send) -> None:
    """A fake worker's answer to anything but completions: 200 on /health, 404 otherwise."""
    status = 200 if scope["path"] == "/health" else 404
    await send({"type": "http.response.start", "status": status, "headers": []})
    await send({"type": "http.response.body", "body": b""})


async def read_asgi_body(receive: Receive) -> bytes:
    """The whole request body of an ASGI http request."""
    raw = b""
    while True:
        msg = await receive()
        raw += bytes(msg.get("body", b""))
        if not msg.get("more_body"):
            return raw


class SocketWorker:
    """A worker at the socket level, for failures an ASGI app cannot produce. ``GET /health`` is
    answered 200 (other GETs 404) on a connection closed afterwards, so no pooled connection
    outlives ``close``. A completion request (any POST) is counted in ``completions``, then:

    * ``reset``: its connection is reset (RST) as soon as its head arrives, its body unread: what
      a worker killed under load does to the connections whose requests it had not read;
    * ``close``: its body is read whole, then the connection is closed without a byte of answer
      (a FIN): what a worker that dies while running the request, or crashes on it, does.
    """

    def __init__(self, on_post: Literal["reset", "close"]) -> None:
        self.on_post = on_post
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.completions = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            if not head.startswith(b"POST"):
                status = b"200 OK" if b" /health " in head.split(b"\r\n")[0] else b"404 Not Found"
                conn.sendall(b"HTTP/1.1 " + status
                             + b"\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                return
            with self._lock:
                self.completions += 1
            if self.on_post == "reset":
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                return  # closing with linger 0 sends RST
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            while len(body) < length:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                body += chunk
        # leaving the block closes the socket with nothing unread: a FIN, no answer

    def close(self) -> None:
        """Stop listening: connections are refused from now on."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() in the thread
        self.sock.close()


@contextmanager
def zmq_handshakes(sock: zmq.Socket[Any]) -> Iterator[Callable[[float], None]]:
    """Watch ``sock`` (plain or asyncio) for completed ZMQ handshakes; yields ``wait(timeout_s)``,
    which returns once the next one has happened. PUB/SUB's slow joiner: what a publisher sends
    before a subscriber's subscription reaches it is lost, and a fixed sleep for that flakes on a
    loaded machine. A SUB that has finished its handshake has sent its subscription (a bound SUB:
    once its own thread touches the socket, e.g. ``getsockopt(zmq.EVENTS)``); the publisher takes
    it in on its own time, so a test that needs a given batch also asks replay (``next_batch``)."""
    address = f"inproc://handshakes-{uuid.uuid4().hex}"
    sock.monitor(address, zmq.EVENT_HANDSHAKE_SUCCEEDED)
    # Read by a plain socket on the same context, so an asyncio socket is watched the same way.
    pair: zmq.Socket[bytes] = zmq.Context.shadow(sock.context.underlying).socket(zmq.PAIR)
    try:
        pair.connect(address)

        def wait(timeout_s: float = 60.0) -> None:
            if not pair.poll(int(timeout_s * 1000)):
                raise AssertionError(f"no ZMQ handshake within {timeout_s:g} s")
            pair.recv_multipart()

        yield wait
    finally:
        sock.disable_monitor()
        pair.close(linger=0)


def replayed_batches(replay_endpoint: str, start_seq: int = 0,
                     timeout_s: float = 60.0) -> list[list[bytes]]:
    """Every batch from ``start_seq`` on that a KV event publisher's replay socket still holds,
    each as ``[topic, seq, payload]`` (as on the PUB socket): a DEALER asks, then reads until
    the end mark."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    try:
        dealer.connect(replay_endpoint)
        dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
        batches: list[list[bytes]] = []
        while True:
            if not dealer.poll(int(timeout_s * 1000)):
                raise AssertionError(f"no replay answer from {replay_endpoint} in {timeout_s:g} s")
            _, topic, seq, payload = dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:  # the end mark
                return batches
            batches.append([topic, seq, payload])
    finally:
        dealer.close(linger=0)
        ctx.term()


def replayed_batch(replay_endpoint: str, seq: int) -> list[bytes]:
    """Batch ``seq`` as the publisher's replay socket answers it."""
    found = [b for b in replayed_batches(replay_endpoint, seq) if int.from_bytes(b[1], "big") == seq]
    assert found, f"batch {seq} is no longer in {replay_endpoint}'s buffer"
    return found[0]


def next_batch(sub: zmq.Socket[bytes], replay_endpoint: str, seq: int,
               wait_s: float = 10.0) -> list[bytes]:
    """KV event batch ``seq`` from ``sub``, or from replay where the subscription missed it: a
    publisher may send before it has taken in a subscription whose handshake is done (PUB/SUB's
    slow joiner on a loaded machine), which is what replay is for."""
    deadline = time.monotonic() + wait_s
    while (left := deadline - time.monotonic()) > 0 and sub.poll(int(left * 1000)):
        frames = sub.recv_multipart()
        got = int.from_bytes(frames[1], "big")
        if got == seq:
            return frames
        if got > seq:
            break
    return replayed_batch(replay_endpoint, seq)


async def eventually(cond: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Wait in the running event loop until ``cond()`` holds (polled every 10 ms); fail the test
    after ``timeout_s``. For what happens "soon" (a sweep, a check, an event): a fixed sleep
    instead flakes on a loaded machine."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        if loop.time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


def kv_event_batches(gateway: str) -> dict[str, float]:
    """KV event batches the gateway has applied so far, by worker (``kvgate_kv_events_total``):
    what a test waits on for events to have arrived, where a fixed sleep flakes."""
    from gateway import promtext

    text = httpx.get(gateway + "/metrics").text
    return {worker: v for (worker, what), v in
            promtext.sums_by(text, "kvgate_kv_events_total", ("worker", "what")).items()
            if what == "batches"}


def explained(gateway: str, request_id: str, admin_token: str) -> dict[str, Any]:
    """``GET /admin/routing/explain`` for one request once it has ended (its hit accounting
    completes as it finishes): polled for up to 10 s."""
    deadline = time.monotonic() + 10
    while True:
        r = httpx.get(gateway + "/admin/routing/explain", params={"request_id": request_id},
                      headers={"Authorization": f"Bearer {admin_token}"})
        assert r.status_code == 200, r.text
        data: dict[str, Any] = r.json()
        if data["state"] == "ended":
            return data
        assert time.monotonic() < deadline, data
        time.sleep(0.05)


class CountingIndex(BlockIndex):
    """A ``BlockIndex`` that counts the blocks each ``record_routed`` call is given (a subclass,
    not a patched method: the compiled index's methods cannot be replaced on an instance)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.recorded: list[int] = []

    def record_routed(self, worker_id: str, hashes: Sequence[BlockHash],
                      parent: BlockHash | None = None) -> None:
        self.recorded.append(len(hashes))
        super().record_routed(worker_id, hashes, parent)
