"""Routes shared among the processes of one gateway (``kvgate serve --processes N``).

Every process keeps its own prefix index. KV events reach all of them, but a route is known only
to the process that made it until the worker's events confirm its blocks: one engine step at
the least, the whole queue wait on a busy worker. Meanwhile a sibling that takes the next
request of the same new prefix sees no holder and sends it elsewhere, a second copy of the
prefill; without events (approximate mode) each process would only ever know its own 1/N of the
routes. Measured in model time (``python -m gateway.bench.routers.zipf_model``: the ``zipf_hot``
scenario, 8 simulated H100s near saturation, 8 seeds of 320 requests), two processes that do
not share routes lost to one process: plain ``kv_aware`` TTFT p90 1,432 -> 1,914 ms, hit rate
64.0 -> 62.8%; with hot prefixes p99 1,853 -> 2,254 ms. The gateway's own
processes were giving hits away to each other.

So each process binds a unix datagram socket in the gateway's runtime directory
(``routes-{index}.sock``, the supervisor's private ``mkdtemp`` directory), and the routes it
makes in one turn of its event loop go to each sibling's socket as messages of the replica
exchange's wire format (``gateway.kvindex.exchange``: per worker, chain segments that share
their prefixes, so a burst of one prefix costs it once). A sibling records them as the
exchange's receiver does: ``speculative`` entries for a worker with events (until its events
confirm them or the TTL passes), ``learned`` ones without. A route whose last block the
worker's events already confirmed tells the siblings nothing and is not sent. With
``replicas.exchange`` on, the siblings already hear each other through Redis (every process
has a sender id of its own) and this stays off.

Delivery is best effort and never waits: a sibling that is not up yet, is restarting, or whose
socket buffer is full misses the message (counted, ``kvgate_sibling_routes_total{direction=
"dropped"}``); routes are hints that expire anyway, and events correct them. Bounds: a route
sends at most ``MAX_ROUTE_BLOCKS`` blocks (its first ones: a chain's prefix is a chain), a
message at most ``MAX_MESSAGE_BYTES`` (the rest of the turn's routes go in further messages),
at most ``MAX_QUEUED_ROUTES`` routes wait for a turn's end; a received message is decoded with
the same bounds, records at most ``MAX_RECEIVED_BLOCKS`` blocks over all its chains, and one
that does not decode is counted and ignored. A route of fewer than
``MIN_ROUTE_TOKENS`` tokens is not sent (a wrong guess about it costs little prefill).

Cost: on the request path a deque append (``on_routed``) and, once per loop turn with routes,
one ``call_soon``; at the turn's end one encode and one ``sendto`` per sibling; a receiver pays
a decode and one ``record_routed`` per route, what routing it itself would have cost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections import deque
from pathlib import Path
from typing import Final

from gateway.kvindex.exchange import (
    KIND_ROUTES,
    MalformedMessage,
    decode,
    encode,
    record_routes,
    route_sections,
)
from gateway.kvindex.hashing import BlockHash
from gateway.kvindex.service import PrefixIndex
from gateway.metrics import Metrics

log = logging.getLogger(__name__)

MIN_ROUTE_TOKENS: Final = 512
"""Shorter routes are not sent: a wrong guess costs a sibling at most this much prefill (hot
prefixes' ``min_prefix_tokens`` default), while telling costs every sibling about what
routing it costs the sender (the overhead benchmark's short chats, one block each, paid
+16 us per request with ``--processes 2`` when every route was sent)."""
MAX_ROUTE_BLOCKS: Final = 8192
"""Blocks of one route sent (128K tokens at 16 per block): the first ones, a longer chain's
prefix."""
MAX_MESSAGE_BYTES: Final = 96 * 1024
"""One datagram's payload; below the kernel's default socket buffer (208 KiB)."""
MAX_RECEIVED_BLOCKS: Final = 8 * MAX_ROUTE_BLOCKS
"""Blocks one received message may have recorded, over all its chains (a chain's shared prefix
counted each time): the segments of a 96 KiB message can expand far beyond its own 12K
blocks."""
MAX_QUEUED_ROUTES: Final = 4096
"""Routes waiting for the turn's end; one beyond is dropped (counted)."""
_ROUTE_BYTES: Final = 48
"""An upper bound of what a route costs a message besides 8 bytes per block."""


def routes_socket(runtime_dir: Path, index: int) -> Path:
    """Where process ``index`` of the gateway whose shared directory is ``runtime_dir``
    receives its siblings' routes."""
    return runtime_dir / f"routes-{index}.sock"


class SiblingRoutes:
    """One process's end of the route sharing; see the module docstring.

    ``start`` binds the socket and installs ``on_routed`` on the index; ``close`` undoes both.
    Everything runs on the event loop's thread.
    """

    def __init__(self, index: PrefixIndex, runtime_dir: Path, own: int, count: int,
                 metrics: Metrics | None = None) -> None:
        self.index = index
        self.path = routes_socket(runtime_dir, own)
        self.siblings = [str(routes_socket(runtime_dir, i)) for i in range(count) if i != own]
        self.metrics = metrics
        # the process's own id in the format's sender field (unused by the receiver: only
        # siblings send to this socket)
        self.sender_id = os.urandom(8)
        self._queue: deque[tuple[str, int, list[BlockHash]]] = deque()
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.counts: dict[str, int] = {}

    # -- the request path ---------------------------------------------------------------------

    def on_routed(self, worker_id: str, block_size_tokens: int, hashes: list[BlockHash]) -> None:
        """``PrefixIndex.on_routed``: queue the route for the turn's end (O(1))."""
        if len(hashes) * block_size_tokens < MIN_ROUTE_TOKENS:
            return  # cheap to recompute: not worth the siblings' time
        if self.index.index.is_confirmed(worker_id, hashes[-1]):
            return  # the worker's events told every process already
        queue = self._queue
        if len(queue) >= MAX_QUEUED_ROUTES:
            self._count("dropped")
            return
        if not queue and self._loop is not None:
            self._loop.call_soon(self.flush)
        queue.append((worker_id, block_size_tokens,
                      hashes if len(hashes) <= MAX_ROUTE_BLOCKS else hashes[:MAX_ROUTE_BLOCKS]))

    # -- sending ------------------------------------------------------------------------------

    def messages(self) -> list[bytes]:
        """The queued routes as messages of at most ``MAX_MESSAGE_BYTES`` each (emptying the
        queue)."""
        out: list[bytes] = []
        routes: dict[tuple[str, int], list[list[BlockHash]]] = {}
        size = 64
        queue = self._queue
        while queue:
            url, block_size, hashes = queue.popleft()
            cost = 8 * len(hashes) + _ROUTE_BYTES + len(url)
            if routes and size + cost > MAX_MESSAGE_BYTES:
                out.append(self._encode(routes))
                routes, size = {}, 64
            routes.setdefault((url, block_size), []).append(hashes)
            size += cost
        if routes:
            out.append(self._encode(routes))
        return out

    def _encode(self, routes: dict[tuple[str, int], list[list[BlockHash]]]) -> bytes:
        return encode(KIND_ROUTES, self.sender_id, self.sender_id, route_sections(routes))

    def flush(self) -> None:
        """Send what the turn queued to every sibling (best effort, never waits)."""
        sock = self._sock
        if sock is None:
            self._queue.clear()
            return
        for data in self.messages():
            for path in self.siblings:
                try:
                    sock.sendto(data, path)
                except OSError:  # not up (yet), restarting, or its buffer is full
                    self._count("dropped")
                else:
                    self._count("sent")

    # -- receiving ----------------------------------------------------------------------------

    def receive(self, data: bytes) -> None:
        """Record one sibling's routes (a message that does not decode is counted, ignored)."""
        try:
            msg = decode(data, max_blocks=MAX_MESSAGE_BYTES // 8)
        except MalformedMessage as exc:
            self._count("malformed")
            log.debug("sibling routes: malformed message ignored: %s", exc)
            return
        if msg.kind != KIND_ROUTES:
            self._count("malformed")
            return
        self._count("received")
        record_routes(self.index, msg.sections, MAX_RECEIVED_BLOCKS)

    def _readable(self) -> None:
        sock = self._sock
        if sock is None:
            return
        for _ in range(64):  # then let the loop run other work; the reader fires again
            try:
                data = sock.recv(MAX_MESSAGE_BYTES + 1)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("sibling routes: receive failed: %s", exc)
                return
            if len(data) > MAX_MESSAGE_BYTES:
                self._count("malformed")
                continue
            self.receive(data)

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()  # a predecessor's (this process restarted)
            sock.bind(str(self.path))
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._sock, self._loop = sock, loop
        loop.add_reader(sock.fileno(), self._readable)
        self.index.on_routed = self.on_routed

    def close(self) -> None:
        """Idempotent."""
        if self.index.on_routed == self.on_routed:
            self.index.on_routed = None
        sock, self._sock = self._sock, None
        self._queue.clear()
        if sock is None:
            return
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(sock.fileno())
        sock.close()
        with contextlib.suppress(OSError):
            self.path.unlink()

    def _count(self, direction: str, n: int = 1) -> None:
        self.counts[direction] = self.counts.get(direction, 0) + n
        if self.metrics is not None:
            self.metrics.sibling_routes.labels(direction).inc(n)
