"""The replica exchange: what KV events cannot tell another gateway replica, through Redis.

Several kvgate replicas behind one load balancer share the workers' KV events (the truth about
what each worker holds), but each replica's own routes stay private until a worker's first
``BlockStored`` arrives: a burst of one new prefix spread over N replicas lands on up to N
workers. Without events (approximate mode) a replica knows only its own 1/N of the routes at
all. And each replica counts only its own requests in flight, so ``least_loaded``/``kv_aware``
see 1/N of a worker's queue. The exchange (``replicas.exchange``, off by default) closes these
gaps over the Redis the budgets already use:

1. **routes**: ``PrefixIndex.record_routed`` hands each route's block hashes to ``on_routed``
   (O(1): a deque append; with events, a route whose last block the worker already confirmed
   tells the peers nothing and is skipped). One task drains the queue every ``interval_s``
   (25 ms), encodes one message and PUBLISHes it on ``{key_prefix}:exchange``. A receiving
   replica ``record_routed``s each route into its ``BlockIndex``: ``speculative`` entries for a
   worker with events (until its events confirm them or ``speculative_ttl_s`` passes),
   ``learned`` ones without. Its own messages (same sender id) are ignored.
2. **load**: with the routes, per worker, the gateway's requests in flight and queued prefill
   tokens (all of its processes: the leader publishes the load table's sum), when they changed
   and at least every ``heartbeat_s``. A receiver adds every peer gateway's last numbers to the
   worker's load (``workers.worker.WithPeers``: one attribute read per routing look-up), stale by
   at most an interval; a peer silent for ``peer_timeout_s`` stops counting.
3. **snapshot**: the replica holding the writer lease (``SET NX`` with a TTL, renewed by its
   holder) writes its index every ``snapshot_interval_s`` (per worker the ``snapshot_max_blocks``
   most recently used blocks, ``BlockIndex.export_chains``) to ``{key_prefix}:snapshot`` with a
   TTL, and once more when it closes. A replica that starts loads it before it reports ready
   (at most ``snapshot_wait_s``): approximate mode has no replay socket, and without a snapshot
   a restarted replica routes blind until it has relearned the fleet.

Wire format (little-endian; one format for both messages): a header ``"KX"``, version, kind
(1 routes and load, 2 snapshot), the 8-byte gateway id (shared by the processes of one gateway:
load is counted per gateway), the 8-byte sender id (one per process: routes are per process),
the section count; per worker a section: URL, block size, optional load (u32 requests, u64
prefill tokens), then chain segments, each (parent position or none, n, n packed u64 hashes).
A segment continues the block at ``parent`` (a position among the section's earlier hashes), so
a burst of one prefix in one interval costs the prefix once plus each request's own tail, and a
snapshot's chains share their prefixes as the index does. A route is the chain a segment ends.

Cost: on the request path, a deque append per route (``on_routed``). On the same event loop, per
interval: encoding the batch (C-level ``array`` packing, a dict lookup per block); per message
received: decoding (one ``array`` unpack) and one ``record_routed`` per route (what routing the
request locally would have cost). Approximate mode with N replicas therefore records every
route of the fleet on every replica; with events only routes of blocks not yet confirmed travel.
Bytes: 8 per new block plus ~40 per route and ~30 per worker with load; ``max_bytes_per_s``
caps it (routes beyond are dropped and counted, load is always sent). Measured on the shared
2-core box (``python -m gateway.bench.replicas --cpu``, 2K-token prefixes + 64-token tails, 132
blocks a route): ``on_routed`` 0.3-0.5 µs; encoding 20-33 µs a route; receiving 100-130 µs a
route, of which ``record_routed`` is ≈ 75 (what the sender's own route cost it); a load read
through ``WithPeers`` 0.10 µs against 0.07-0.12. So in approximate mode each of N replicas
spends ≈ 20 + (N - 1) × 110 µs per request of its own. Snapshot: export + encode ≈ 0.8 µs a
block (12.6 ms for 16K blocks, yielding between workers), applying ≈ 130 ms for 16K blocks in
2,000 routes (before the replica reports ready).

Trade-offs: pub/sub is fire-and-forget: a replica that is disconnected misses routes (they are
hints that expire anyway; events and its own routing correct it). A Redis outage degrades to no
exchange (logged once, counted), never blocks routing. Anyone who can publish on the channel
can steer routing, as anyone who can write the budgets' keys can refuse requests: the Redis is
trusted; malformed messages are ignored and counted, every count is bounded by the message size
(``max_message_bytes``) and the state by the workers and peers known (``MAX_PEERS``).
On a Redis Cluster the snapshot keys go through the cluster client, pub/sub through one
connection to the node the URL names (a cluster forwards PUBLISH to every node).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import struct
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from gateway.config import ReplicaSettings
from gateway.kvindex.hashing import BlockHash
from gateway.kvindex.service import PrefixIndex
from gateway.metrics import Metrics
from gateway.tasks import cancel_and_wait
from gateway.workers.worker import PeerLoad, WithPeers, Worker

log = logging.getLogger(__name__)

MAGIC: Final = b"KX"
VERSION: Final = 1
KIND_ROUTES: Final = 1
KIND_SNAPSHOT: Final = 2
NO_PARENT: Final = 0xFFFF_FFFF
MAX_PEERS: Final = 256
"""Peer gateways whose load is kept; messages of more are ignored (bounded state)."""
MAX_QUEUED_ROUTES: Final = 4096
"""Routes waiting for the next publish; a route beyond is dropped (counted)."""
_CLUSTER_SCHEMES: Final = {"redis+cluster": "redis", "rediss+cluster": "rediss"}

_HEADER = struct.Struct("<2sBB8s8sH")
_SECTION = struct.Struct("<HHB")  # url length, block size, flags (bit 0: load follows)
_LOAD = struct.Struct("<IQ")
_COUNT = struct.Struct("<I")
_SEGMENT = struct.Struct("<II")  # parent position (NO_PARENT: a chain's start), new blocks
_U32: Final = 0xFFFF_FFFF
_U64: Final = 0xFFFF_FFFF_FFFF_FFFF


class MalformedMessage(ValueError):
    """An exchange message that does not decode (truncated, inconsistent, unknown version)."""


@dataclass(frozen=True, slots=True)
class Section:
    """One worker in a message: its load (None: not sent), and chain segments over ``hashes``:
    (parent position or ``NO_PARENT``, start, end) with ``parent < start``."""

    url: str
    block_size_tokens: int
    load: tuple[int, int] | None
    hashes: list[BlockHash]
    segments: tuple[tuple[int, int, int], ...]

    def chains(self, max_blocks: int | None = None) -> Iterator[list[BlockHash]]:
        """Each segment's whole chain, root first, in segment order; stops once the chains
        given reach ``max_blocks`` blocks in all (None: no bound)."""
        full: list[list[BlockHash]] = []
        seg_of: list[int] = []  # position -> its segment
        total = 0
        for k, (parent, start, end) in enumerate(self.segments):
            if parent == NO_PARENT:
                chain = self.hashes[start:end]
            else:
                p_seg = seg_of[parent]
                p_start = self.segments[p_seg][1]
                p_full = full[p_seg]
                before = len(p_full) - (self.segments[p_seg][2] - p_start)
                chain = p_full[: before + parent - p_start + 1]
                chain.extend(self.hashes[start:end])
            total += len(chain)
            if max_blocks is not None and total > max_blocks:
                return
            full.append(chain)
            seg_of.extend([k] * (end - start))
            yield chain


@dataclass(frozen=True, slots=True)
class Message:
    kind: int
    gateway_id: bytes
    sender_id: bytes
    sections: tuple[Section, ...]


@dataclass(frozen=True, slots=True)
class SectionOut:
    """What to encode for one worker: its load (None: none) and chain segments, each
    (parent hash given by an earlier segment of this section, or None; new hashes)."""

    url: str
    block_size_tokens: int
    load: tuple[int, int] | None
    segments: Sequence[tuple[BlockHash | None, Sequence[BlockHash]]]


def compact(routes: Iterable[Sequence[BlockHash]]) -> list[tuple[BlockHash | None,
                                                                   Sequence[BlockHash]]]:
    """Routes (whole chains) as segments that share what earlier ones gave: a chain's first k
    blocks given before (a binary search: chained hashes fix their prefix, so a given block
    means every block before it was given) become the new segment's parent."""
    given: set[BlockHash] = set()
    out: list[tuple[BlockHash | None, Sequence[BlockHash]]] = []
    for chain in routes:
        lo, hi = 0, len(chain)  # chain[:lo] given, chain[hi:] not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if chain[mid - 1] in given:
                lo = mid
            else:
                hi = mid - 1
        new = chain[lo:]
        given.update(new)
        out.append((chain[lo - 1] if lo else None, new))
    return out


def route_sections(routes: dict[tuple[str, int], list[list[BlockHash]]],
                   loads: dict[str, tuple[int, int]] | None = None) -> list[SectionOut]:
    """Queued routes (per (worker url, block size): each route's hashes) as sections, their
    chains sharing prefixes; ``loads`` (popped as used): a worker's load, in its routes'
    section or a section of its own."""
    loads = loads if loads is not None else {}
    sections = [SectionOut(url, size, loads.pop(url, None), compact(chains))
                for (url, size), chains in routes.items()]
    sections += [SectionOut(url, 1, load, ()) for url, load in loads.items()]
    return sections


def record_routes(index: PrefixIndex, sections: Iterable[Section], max_blocks: int) -> None:
    """Record a received message's routes in ``index`` (speculative for a worker with events,
    learned without): a section whose worker is unknown or has another block size is skipped,
    and at most ``max_blocks`` blocks are recorded over all its chains (a chain's shared prefix
    counted each time, so a forged message of segments that continue earlier blocks is cut)."""
    sizes = index.block_sizes()
    record = index.record_chain
    left = max_blocks
    for s in sections:
        if s.segments and sizes.get(s.url) == s.block_size_tokens:
            for chain in s.chains(max_blocks=left):
                record(s.url, chain)
                left -= len(chain)


def encode(kind: int, gateway_id: bytes, sender_id: bytes, sections: Sequence[SectionOut]
           ) -> bytes:
    parts = [_HEADER.pack(MAGIC, VERSION, kind, gateway_id, sender_id, len(sections))]
    for s in sections:
        url = s.url.encode()
        parts.append(_SECTION.pack(len(url), s.block_size_tokens, 1 if s.load else 0))
        parts.append(url)
        if s.load is not None:
            parts.append(_LOAD.pack(min(max(s.load[0], 0), _U32), min(max(s.load[1], 0), _U64)))
        parts.append(_COUNT.pack(len(s.segments)))
        where: dict[BlockHash, int] = {}
        n = 0
        for parent, new in s.segments:
            parts.append(_SEGMENT.pack(NO_PARENT if parent is None else where[parent], len(new)))
            if new:
                parts.append(array("Q", new).tobytes())
                where.update(zip(new, range(n, n + len(new)), strict=True))
                n += len(new)
    return b"".join(parts)


def decode(data: bytes, max_blocks: int | None = None) -> Message:
    """Parse one message; ``MalformedMessage`` for anything inconsistent (never another
    exception: a hostile message must not reach the caller any other way)."""
    try:
        return _decode(memoryview(data), max_blocks)
    except MalformedMessage:
        raise
    except (struct.error, ValueError, IndexError, UnicodeDecodeError) as exc:
        raise MalformedMessage(str(exc)) from None


def _decode(view: memoryview, max_blocks: int | None) -> Message:
    magic, version, kind, gateway_id, sender_id, n_sections = _HEADER.unpack_from(view, 0)
    if magic != MAGIC or version != VERSION or kind not in (KIND_ROUTES, KIND_SNAPSHOT):
        raise MalformedMessage("not a kvgate exchange message of this version")
    at = _HEADER.size
    sections = []
    blocks = 0
    for _ in range(n_sections):
        url_len, block_size, flags = _SECTION.unpack_from(view, at)
        at += _SECTION.size
        if block_size == 0 or url_len == 0 or at + url_len > len(view):
            raise MalformedMessage("section without a worker or a block size")
        url = bytes(view[at:at + url_len]).decode()
        at += url_len
        load = None
        if flags & 1:
            load = _LOAD.unpack_from(view, at)
            at += _LOAD.size
        (n_segments,) = _COUNT.unpack_from(view, at)
        at += _COUNT.size
        if n_segments * _SEGMENT.size > len(view) - at:
            raise MalformedMessage("more segments than bytes")
        hashes = array("Q")
        segments = []
        for _ in range(n_segments):
            parent, n = _SEGMENT.unpack_from(view, at)
            at += _SEGMENT.size
            start = len(hashes)
            if parent != NO_PARENT and parent >= start:
                raise MalformedMessage("a segment continues a block not given before it")
            if parent == NO_PARENT and n == 0:
                raise MalformedMessage("an empty chain")
            end = at + 8 * n
            if end > len(view):
                raise MalformedMessage("truncated hashes")
            hashes.frombytes(view[at:end])
            at = end
            segments.append((parent, start, start + n))
        blocks += len(hashes)
        if max_blocks is not None and blocks > max_blocks:
            raise MalformedMessage("more blocks than allowed")
        sections.append(Section(url, block_size, load, hashes.tolist(), tuple(segments)))
    if at != len(view):
        raise MalformedMessage("trailing bytes")
    return Message(kind, bytes(gateway_id), bytes(sender_id), tuple(sections))


@dataclass
class _Peer:
    seen_at: float
    load: dict[str, tuple[int, int]]  # worker URL -> (requests, prefill tokens)


class ReplicaExchange:
    """Routes, load and snapshots shared with other replicas; see the module docstring.

    The constructor does no I/O. ``start`` connects, loads the snapshot (bounded by
    ``snapshot_wait_s``) and starts the tasks; ``close`` writes a last snapshot (leader) and
    stops them. Synchronous methods run on the event loop's thread only.
    """

    def __init__(
        self,
        settings: ReplicaSettings,
        redis_url: str,
        index: PrefixIndex | None,
        *,
        metrics: Metrics | None = None,
        gateway_id: bytes | None = None,
        leader: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.redis_url = redis_url
        self.index = index
        self.metrics = metrics
        self.leader = leader  # publishes load, writes snapshots
        self.sender_id = os.urandom(8)
        self.gateway_id = gateway_id if gateway_id is not None else self.sender_id
        self._clock = clock
        prefix = settings.key_prefix
        self.channel = f"{prefix}:exchange"
        self.snapshot_key = f"{prefix}:snapshot"
        self.writer_key = f"{prefix}:snapshot:writer"
        self._queue: deque[tuple[str, int, list[BlockHash]]] = deque()
        self._loads: dict[str, WithPeers] = {}
        self._peer_loads: dict[str, PeerLoad] = {}
        self._peers: dict[bytes, _Peer] = {}
        self._published: dict[str, tuple[int, int]] = {}
        self._published_at = float("-inf")
        self._allowance = 0.0  # accrues per interval, up to one second's worth
        self._client: aioredis.Redis | RedisCluster | None = None
        self._pubsub_client: aioredis.Redis | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._down: set[str] = set()  # what is failing now (logged once per outage)
        self.subscribed = asyncio.Event()
        self.counts: dict[str, int] = {}

    # -- the request path ---------------------------------------------------------------------

    def on_routed(self, worker_id: str, block_size_tokens: int, hashes: list[BlockHash]) -> None:
        """``PrefixIndex.on_routed``: queue the route for the next publish (O(1))."""
        index = self.index
        if index is not None and index.index.is_confirmed(worker_id, hashes[-1]):
            return  # the worker's events told every replica already
        if len(self._queue) >= MAX_QUEUED_ROUTES:
            self._count("dropped")
            return
        self._queue.append((worker_id, block_size_tokens, hashes))

    # -- workers ------------------------------------------------------------------------------

    def attach(self, worker: Worker) -> None:
        """Count the peers' load on ``worker`` from now on (its ``load`` gains their term)."""
        if isinstance(worker.load, WithPeers):
            return
        peers = self._peer_loads.setdefault(worker.url, PeerLoad())
        load = WithPeers(worker.load, peers)
        worker.load = load
        self._loads[worker.url] = load
        self._sum(worker.url)

    def forget(self, url: str) -> None:
        """The worker left: its load is no longer published nor summed."""
        self._loads.pop(url, None)
        self._peer_loads.pop(url, None)
        self._published.pop(url, None)

    def peer_load(self, url: str) -> tuple[int, int]:
        """(requests, prefill tokens) the peer replicas hold on ``url`` now."""
        p = self._peer_loads.get(url)
        return (0, 0) if p is None else (p.requests, p.prefill_tokens)

    @property
    def peers(self) -> int:
        return len(self._peers)

    # -- receiving ----------------------------------------------------------------------------

    def receive(self, data: bytes) -> None:
        """Apply one message from the channel (own ones and malformed ones are counted and
        ignored; nothing a message holds can raise out of here)."""
        if len(data) > self.settings.max_message_bytes:
            self._count("malformed")
            return
        try:
            msg = decode(data)
        except MalformedMessage as exc:
            self._count("malformed")
            log.debug("replica exchange: malformed message ignored: %s", exc)
            return
        if msg.sender_id == self.sender_id or msg.kind != KIND_ROUTES:
            self._count("own" if msg.sender_id == self.sender_id else "malformed")
            return
        self._count("received")
        if self.metrics is not None:
            self.metrics.replica_exchange_bytes.labels("received").inc(len(data))
        if self.index is not None:
            # What a sender within max_bytes_per_s can ask for (it pays 8 bytes per block of
            # each whole route): a forged message naming one long chain many times is cut there.
            record_routes(self.index, msg.sections, int(self.settings.max_bytes_per_s) // 8)
        loads: dict[str, tuple[int, int]] = {}
        said_load = False
        for s in msg.sections:
            if s.load is not None:
                said_load = True
                if s.url in self._peer_loads:
                    loads[s.url] = s.load
        if said_load and msg.gateway_id != self.gateway_id:
            self._peer_said(msg.gateway_id, loads)

    def _peer_said(self, gateway_id: bytes, loads: dict[str, tuple[int, int]]) -> None:
        peer = self._peers.get(gateway_id)
        if peer is None:
            if len(self._peers) >= MAX_PEERS:
                return
            peer = self._peers[gateway_id] = _Peer(self._clock(), {})
            self._gauge()
        peer.seen_at = self._clock()
        changed = set(peer.load) | set(loads)
        peer.load = loads
        for url in changed:
            self._sum(url)

    def _sum(self, url: str) -> None:
        p = self._peer_loads.get(url)
        if p is None:
            return
        requests = tokens = 0
        for peer in self._peers.values():
            r_t = peer.load.get(url)
            if r_t is not None:
                requests += r_t[0]
                tokens += r_t[1]
        p.requests, p.prefill_tokens = requests, tokens

    def expire_peers(self) -> None:
        """Forget peers silent for ``peer_timeout_s`` (their load stops counting)."""
        cutoff = self._clock() - self.settings.peer_timeout_s
        quiet = [g for g, p in self._peers.items() if p.seen_at < cutoff]
        for g in quiet:
            peer = self._peers.pop(g)
            for url in peer.load:
                self._sum(url)
        if quiet:
            self._gauge()

    # -- publishing ---------------------------------------------------------------------------

    def next_message(self) -> bytes | None:
        """The batch to publish now (None: nothing to say): the queued routes, within the byte
        allowance (``max_bytes_per_s``, accrued per interval up to one second's worth), and the
        leader's load when it changed or a heartbeat is due."""
        s = self.settings
        now = self._clock()
        self._allowance = min(float(s.max_bytes_per_s),
                              self._allowance + float(s.max_bytes_per_s) * s.interval_s)
        loads: dict[str, tuple[int, int]] = {}
        if self.leader and self._loads:
            current = {url: (w.local.gateway_requests(), w.local.gateway_prefill_tokens())
                       for url, w in self._loads.items()}
            if current != self._published or now - self._published_at >= s.heartbeat_s:
                loads = current  # every worker's, so a message's load is the whole picture
                self._published, self._published_at = dict(current), now
        routes: dict[tuple[str, int], list[list[BlockHash]]] = {}
        budget = self._allowance - 64 - 48 * len(loads)
        queue = self._queue
        while queue:
            url, size, hashes = queue.popleft()
            cost = 8 * len(hashes) + 48  # an upper bound: shared prefixes cost less
            if cost > budget:
                self._count("dropped", 1 + len(queue))
                queue.clear()
                break
            budget -= cost
            routes.setdefault((url, size), []).append(hashes)
        if not routes and not loads:
            return None
        data = encode(KIND_ROUTES, self.gateway_id, self.sender_id, route_sections(routes, loads))
        self._allowance -= len(data)
        return data

    # -- snapshots ----------------------------------------------------------------------------

    def snapshot(self) -> bytes:
        """This replica's index, per worker the ``snapshot_max_blocks`` most recent blocks."""
        assert self.index is not None
        cap = self.settings.snapshot_max_blocks
        sections = [SectionOut(url, size, None, self.index.index.export_chains(url, cap))
                    for url, size in self.index.block_sizes().items()]
        return encode(KIND_SNAPSHOT, self.gateway_id, self.sender_id,
                      [s for s in sections if s.segments])

    async def snapshot_yielding(self) -> bytes:
        """``snapshot``, yielding to the event loop after each worker's export (≈ 0.8 µs per
        block: 16K blocks are ≈ 13 ms; requests wait one worker's share, not the whole)."""
        assert self.index is not None
        cap = self.settings.snapshot_max_blocks
        sections = []
        for url, size in self.index.block_sizes().items():
            segments = self.index.index.export_chains(url, cap)
            if segments:
                sections.append(SectionOut(url, size, None, segments))
            await asyncio.sleep(0)
        return encode(KIND_SNAPSHOT, self.gateway_id, self.sender_id, sections)

    def apply_snapshot(self, data: bytes) -> int:
        """Fill the index from a snapshot (least recently used first, so the most recent end
        up most recent here too); returns the blocks it names. ``MalformedMessage`` if it does
        not decode. Workers unknown here, or with another block size, are skipped."""
        assert self.index is not None
        cap = self.settings.snapshot_max_blocks
        msg = decode(data)
        if msg.kind != KIND_SNAPSHOT:
            raise MalformedMessage("not a snapshot")
        sizes = self.index.block_sizes()
        record = self.index.index.record_routed
        blocks = 0
        for s in msg.sections:
            if sizes.get(s.url) != s.block_size_tokens:
                continue
            # replaying every chain costs the sum of their lengths: bounded at 8x the blocks
            chains = list(s.chains(max_blocks=8 * cap))
            for chain in reversed(chains):
                record(s.url, chain)
            blocks += min(len(s.hashes), cap)
        return blocks

    async def load_snapshot(self) -> int:
        """Read and apply the snapshot (waits at most ``snapshot_wait_s``); blocks loaded."""
        if self.index is None or not self.settings.snapshot or self._client is None:
            return 0
        try:
            async with asyncio.timeout(self.settings.snapshot_wait_s):
                data = await self._client.get(self.snapshot_key)
        except (RedisError, OSError, TimeoutError) as exc:
            self._snapshot("failed")
            log.warning("replica exchange: no snapshot loaded (%s); starting cold", exc)
            return 0
        if not isinstance(data, bytes) or not data:
            self._snapshot("none")
            return 0
        try:
            blocks = self.apply_snapshot(data)
        except MalformedMessage as exc:
            self._snapshot("failed")
            log.warning("replica exchange: the snapshot is malformed (%s); starting cold", exc)
            return 0
        self._snapshot("loaded")
        log.info("replica exchange: %d blocks loaded from a peer's snapshot", blocks)
        return blocks

    async def write_snapshot(self, force: bool = False) -> bool:
        """Write the snapshot if this replica holds (or takes) the writer lease; ``force``:
        whatever the lease (the holder closing)."""
        client = self._client
        if client is None or self.index is None:
            return False
        s = self.settings
        lease_ms = max(1, int(3 * s.snapshot_interval_s * 1000))
        if not force:
            got = await client.set(self.writer_key, self.sender_id, nx=True, px=lease_ms)
            if not got:
                if await client.get(self.writer_key) != self.sender_id:
                    return False
                await client.pexpire(self.writer_key, lease_ms)
        data = await self.snapshot_yielding()
        await client.set(self.snapshot_key, data, px=max(1, int(s.snapshot_ttl_s * 1000)))
        self._snapshot("written")
        return True

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        self._client = self._connect()
        self._pubsub_client = self._connect_pubsub()
        if self.index is not None:
            self.index.on_routed = self.on_routed
        await self.load_snapshot()
        self._tasks = [asyncio.create_task(self._publish_loop(), name="exchange-publish"),
                       asyncio.create_task(self._subscribe_loop(), name="exchange-subscribe")]
        if self.leader and self.settings.snapshot and self.index is not None:
            self._tasks.append(asyncio.create_task(self._snapshot_loop(),
                                                   name="exchange-snapshot"))

    async def close(self) -> None:
        """Idempotent; the leader that holds the writer lease writes a last snapshot."""
        if self.index is not None and self.index.on_routed == self.on_routed:
            self.index.on_routed = None
        await cancel_and_wait(self._tasks)
        self._tasks = []
        if self._client is None:
            return  # never started, or closed already
        if self.leader and self.settings.snapshot and self.index is not None:
            with contextlib.suppress(RedisError, OSError, TimeoutError):
                async with asyncio.timeout(self.settings.timeout_s):
                    if await self._holds_lease():
                        await self.write_snapshot(force=True)
        for client in (self._client, self._pubsub_client):
            if client is not None:
                with contextlib.suppress(RedisError, OSError):
                    await client.aclose()
        self._client = self._pubsub_client = None

    async def _holds_lease(self) -> bool:
        assert self._client is not None
        held = await self._client.get(self.writer_key)
        return held is None or held == self.sender_id

    def _connect(self) -> aioredis.Redis | RedisCluster:
        common: dict[str, Any] = {"socket_timeout": self.settings.timeout_s,
                                  "socket_connect_timeout": self.settings.timeout_s}
        scheme, _, rest = self.redis_url.partition("://")
        if scheme in _CLUSTER_SCHEMES:
            return RedisCluster.from_url(f"{_CLUSTER_SCHEMES[scheme]}://{rest}", **common)
        return aioredis.Redis.from_url(self.redis_url, **common)

    def _connect_pubsub(self) -> aioredis.Redis:
        scheme, _, rest = self.redis_url.partition("://")
        url = f"{_CLUSTER_SCHEMES.get(scheme, scheme)}://{rest}"
        # No socket timeout: a quiet channel is not an outage (health checks find dead ones).
        return aioredis.Redis.from_url(url, socket_connect_timeout=self.settings.timeout_s,
                                       health_check_interval=10)

    async def _publish_loop(self) -> None:
        interval = self.settings.interval_s
        while True:
            await asyncio.sleep(interval)
            self.expire_peers()
            data = self.next_message()
            if data is None or self._pubsub_client is None:
                continue
            try:
                async with asyncio.timeout(self.settings.timeout_s):
                    await self._pubsub_client.publish(self.channel, data)
            except (RedisError, OSError, TimeoutError) as exc:
                self._count("failed")
                self._outage("publish", exc)
                await asyncio.sleep(min(1.0, 10 * interval))  # and drop what queued meanwhile
                self._queue.clear()
                continue
            self._recovered("publish")
            self._count("sent")
            if self.metrics is not None:
                self.metrics.replica_exchange_bytes.labels("sent").inc(len(data))

    async def _subscribe_loop(self) -> None:
        assert self._pubsub_client is not None
        while True:
            pubsub = self._pubsub_client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.channel)
                self._recovered("subscribe")
                self.subscribed.set()
                while True:
                    msg = await pubsub.get_message(timeout=1.0)
                    if msg is not None and isinstance(msg.get("data"), bytes):
                        self.receive(msg["data"])
            except (RedisError, OSError, TimeoutError) as exc:
                self.subscribed.clear()
                self._outage("subscribe", exc)
            finally:
                with contextlib.suppress(RedisError, OSError, RuntimeError):
                    await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]  # untyped before redis 8.2
            await asyncio.sleep(1.0)

    async def _snapshot_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.snapshot_interval_s)
            try:
                async with asyncio.timeout(self.settings.timeout_s):
                    await self.write_snapshot()
            except (RedisError, OSError, TimeoutError) as exc:
                self._snapshot("failed")
                self._outage("snapshot", exc)
            else:
                self._recovered("snapshot")

    # -- observing ----------------------------------------------------------------------------

    def _outage(self, what: str, exc: BaseException) -> None:
        if what not in self._down:
            self._down.add(what)
            log.warning("replica exchange: %s failed (%s: %s); no exchange until Redis is back",
                        what, type(exc).__name__, exc)

    def _recovered(self, what: str) -> None:
        if what in self._down:
            self._down.discard(what)
            log.warning("replica exchange: %s works again", what)

    def _count(self, direction: str, n: int = 1) -> None:
        self.counts[direction] = self.counts.get(direction, 0) + n
        if self.metrics is not None:
            self.metrics.replica_exchange_messages.labels(direction).inc(n)

    def _snapshot(self, outcome: str) -> None:
        self.counts["snapshot_" + outcome] = self.counts.get("snapshot_" + outcome, 0) + 1
        if self.metrics is not None:
            self.metrics.replica_snapshots.labels(outcome).inc()

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.replica_peers.set(len(self._peers))
