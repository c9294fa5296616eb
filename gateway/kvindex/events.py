"""vLLM KV-cache events -> the BlockIndex: decoding, applying, and one asyncio subscriber per worker.

The wire (vLLM 0.32, ``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``):

- PUB frames ``[topic, seq, payload]``; ``seq`` is 8 bytes big-endian and counts batches from 0 per
  publisher start. A ROUTER replay socket answers a DEALER's ``[b"", start_seq]`` with one
  ``[b"", topic, seq, payload]`` per buffered batch with ``seq >= start_seq`` (the last
  ``buffer_steps`` = 10,000 batches), then ``[b"", b"", -1 (8 bytes, signed), b""]``.
- ``payload`` is msgspec msgpack of ``KVEventBatch`` (``array_like=True``): ``[ts, events,
  data_parallel_rank]``. Events are tagged structs *without* ``array_like``, so each is a map whose
  first key is ``"type"`` (``"BlockStored"`` / ``"BlockRemoved"`` / ``"AllBlocksCleared"``), with
  ``omit_defaults``: fields with defaults (``extra_keys``, ``group_idx`` ...) are absent when they
  hold their default, fields without one (``lora_id``, ``medium``, ``lora_name``) are always there.
  Older vLLM encoded events as tagged arrays, tag first then the fields in declaration order
  (``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, ...]``);
  both shapes are accepted, and a batch as a map too.
- Engine block hashes are unsigned 64-bit ints by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``:
  the last 8 bytes of the digest) or the raw digest ``bytes``; both are used only as opaque keys.

Applying (``EventApplier``, pure): a ``BlockStored`` is re-keyed by the gateway's own hash of its
``token_ids`` (``block_hashes`` chained from the gateway hash that the engine's
``parent_block_hash`` maps to), so nothing depends on the engine's hash algorithm or seed. The
engine -> gateway map is per worker and bounded: ``BlockRemoved`` drops entries, ``AllBlocksCleared``
clears it, and past ``max_mapped_blocks`` the oldest mappings go. Skipped, and counted: stores whose
parent is unknown (published before we subscribed, or lost), blocks carrying extra hash keys
(multimodal, cache salt: a plain-token request can never hit them), another KV-cache group than 0
(hybrid models), or a block size other than the worker's.

Lower tiers (``keep_lower_tiers``; the ``PrefixIndex`` sets it, an applier alone keeps the
device tier only and skips the rest as ``skipped_medium``): a store or removal whose ``medium``
is not the device's (``"CPU"`` from vLLM's native offloading, ``--kv-offloading-size``;
``"STORAGE"``; a connector's own) goes to that tier of the index (``BlockIndex.
apply_stored_lower``), never to the GPU entries. vLLM 0.32's offloading connector
(``distributed/kv_transfer/kv_connector/v1/offloading/events.py``) publishes two shapes, both
taken: with ``kv_connector_extra_config.self_describing_kv_events`` a full ``BlockStored`` (the
chunk's block hashes, tokens, parent, ``block_size`` of the GPU block), re-keyed as a device
store is; by default a placeholder (one hash per chunk, the chunk's last block's engine hash, no
tokens, ``block_size`` 0, no parent), mapped through the engine -> gateway map that the
worker's own device store of that block filled (the connector stores what the GPU computed,
after it computed it); a placeholder for a hash the map does not know is counted
(``skipped_unmapped``) and dropped. The map therefore keeps an engine hash while any tier holds
its block: a device removal of a block that a lower tier still holds leaves its mapping (its
offloaded copy is named by later events), and a lower-tier removal drops it only when neither
the GPU entries nor another tier hold the block. A removal takes one reference in the tier
(self-describing chunks may name a shared hash twice). ``AllBlocksCleared`` clears every tier
of the worker: conservative (vLLM may keep the offloaded copies), never a phantom hit. A worker
has at most ``MAX_LOWER_TIERS`` media (a publisher naming more is counted, ``skipped_tiers``),
and a ``medium`` that is no string is skipped as ``skipped_medium``. A LoRA adapter's blocks (``lora_name`` set; each block's extra
keys then start with that name, as ``to_event_extra_keys`` publishes them) are kept under that
adapter: their chain starts at ``adapter_root(lora_name)`` instead of the plain root, as vLLM's
hashes include the adapter, so they are hits for that adapter's requests only. A LoRA block
known only by its deprecated ``lora_id`` is skipped (no name to key it by). A salted chain (a
request's ``cache_salt``: vLLM publishes it last in its first block's extra keys) starts at
``chain_root(lora_name, salt)``: hits for requests of that salt only.

Ordering (``KvEventSubscriber``): the first batch seen starts the worker fresh (the gateway has no
state). ``seq == last + 1`` is applied. A jump is a gap: with a replay endpoint the missing batches
are fetched and applied in order (their live copies, arriving later, are skipped as duplicates);
without one, or when replay fails or no longer has them, that worker's entries are dropped and it
starts fresh. ``seq <= last`` is a publisher restart (the engine restarted, so its cache is empty):
the worker's entries are dropped. A socket monitor marks the peer as lost when the connection its
batches come by ends (told by the file descriptor each message carries, ``SRCFD``, so that a
connection that never published, a stranger's or a port scan's, does not count), as does a batch
coming by another connection; the first batch after that starts the worker fresh too: a restarted
engine whose first batches were published before we reconnected can show any seq, even
``last + 1``, and replaying a different engine's history into the old state would mix two caches.

What a subscriber accepts (``max_message_bytes``, ``peers``): a message part larger than
``max_message_bytes`` makes libzmq drop the connection before reading it (no allocation; it is
a disconnect, and the worker starts fresh on its next batch, as after any lost batch); frames that
are not ``[topic, seq, payload]`` are counted (``malformed``) and dropped, undecodable payloads
counted (``decode_errors``) and the worker started fresh; nothing a peer sends stops the
subscriber. In bind mode over TCP only ``config.peers`` may connect (``gateway.kvindex.peers``:
a ZAP handler checks each connection's address before reading from it); refused connections and
failed handshakes are counted (``refused_peers``, ``failed_handshakes``), and as they never
published, their end is no disconnect of the worker.

Warm start (a replica or process that starts or restarts, a worker whose first batches were
missed): vLLM's replay socket (``--kv-events-config`` ``replay_endpoint``) keeps the last
``buffer_steps`` batches (10,000 by default) from seq 0 on, so the engine's history replayed in
order rebuilds what it holds. Each time the subscriber starts a worker fresh, it asks the replay
socket for ``[0, seq)`` before applying ``seq``: when it opens (before the first live batch, so
a gateway started in front of busy or idle workers is warm in the time a replay takes rather
than after the prompts come again), on the first batch it sees, after a publisher restart and
after a reconnect. What the buffer no longer holds (an engine that has published more than
``buffer_steps`` batches) is missed, never invented: a block stored before the buffer's oldest
batch is not known until it is stored again, and a removal of an unknown block is ignored. A
replay that fails leaves the worker cold (as before), never half-applied: a gap after a partial
history is recovered like any other gap. Cost: one replay per fresh start, applied batch by batch
between receives (10,000 batches of a busy worker take well under a second).

Re-publishing (``republish``, bind mode with several gateway processes: ``gateway.kvindex.relay``):
the subscriber that bound the worker's endpoint also forwards every frame it receives, unchanged,
on a PUB socket bound to ``republish``, and a lost peer as ``[topic, PEER_LOST_SEQ, b""]``, which
a subscriber on the other side treats as its own disconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections import Counter, OrderedDict
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from gateway.kvindex.hashing import BlockHash, block_hashes
from gateway.kvindex.index import BlockIndex
from gateway.kvindex.peers import AllowList, PeerGate

log = logging.getLogger(__name__)

EngineHash = int | bytes
DEVICE_MEDIA: frozenset[str | None] = frozenset(
    {None, "GPU"}
)  # vLLM's device tier, CPU backend too
END_SEQ = -1
PEER_LOST_SEQ = -2  # a re-publisher's notice: the worker's connection to it was lost
_RCVHWM = 100_000  # batches; the publisher's own default HWM
DEFAULT_MAX_MESSAGE_BYTES = 16 << 20
"""The largest message part taken from a publisher. vLLM publishes one batch per engine step:
a step that prefills 128K tokens at once stores about 0.7 MB (token ids and block hashes)."""
_HANDSHAKE_FAILED = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL


@dataclass(frozen=True)
class KvEventsConfig:
    """Where one worker's KV events come from (mirrors vLLM's ``--kv-events-config``).

    ``bind=False``: the worker's PUB binds (``tcp://*:5557`` there) and the gateway connects to
    ``endpoint`` (``tcp://worker-host:5557``). ``bind=True``: the gateway binds ``endpoint`` (port
    0 picks a free port) and the worker connects to it, from an address among ``peers``
    (addresses, CIDR networks, host names; empty: loopback only; bind mode over TCP only).
    ``replay_endpoint`` (the worker's ROUTER, always bound by the worker) is always connected to.
    """

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    bind: bool = False
    peers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for ep in (self.endpoint, self.replay_endpoint):
            if ep is not None and not ep.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"not a ZMQ endpoint: {ep!r}")
        if not self.bind and "*" in self.endpoint:
            raise ValueError(
                f"cannot connect to wildcard endpoint {self.endpoint!r}: give the worker's host, "
                "or set bind=True if the worker connects to the gateway"
            )
        if self.replay_endpoint is not None and "*" in self.replay_endpoint:
            raise ValueError(
                f"replay_endpoint must name the worker's host: {self.replay_endpoint!r}"
            )
        AllowList.of(self.peers)  # fails here, on a bad entry, rather than when binding


# -- decoding --------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[EngineHash, ...]
    parent_block_hash: EngineHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None
    group_idx: int | None = None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[EngineHash, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class EventBatch:
    ts: float
    events: tuple[KvEvent, ...]
    data_parallel_rank: int | None = None
    unknown_events: int = 0  # events of a type this gateway does not know (skipped)


class DecodeError(ValueError):
    pass


_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


def _fields(raw: Any, names: Sequence[str]) -> dict[str, Any]:
    if isinstance(raw, dict):
        return {k: raw.get(k) for k in names}
    values = list(raw[1:])  # tagged array: tag first, then fields in declaration order
    return {k: (values[i] if i < len(values) else None) for i, k in enumerate(names)}


def _decode_event(raw: Any) -> KvEvent | None:
    if isinstance(raw, dict):
        tag = raw.get("type")
    elif isinstance(raw, list) and raw:
        tag = raw[0]
    else:
        raise DecodeError(f"event is neither a map nor a tagged array: {type(raw).__name__}")
    if tag == "BlockStored":
        f = _fields(raw, _STORED_FIELDS)
        if f["block_hashes"] is None or f["token_ids"] is None or f["block_size"] is None:
            raise DecodeError("BlockStored without block_hashes/token_ids/block_size")
        extra = f["extra_keys"]
        return BlockStored(
            block_hashes=tuple(f["block_hashes"]),
            parent_block_hash=f["parent_block_hash"],
            token_ids=tuple(f["token_ids"]),
            block_size=int(f["block_size"]),
            lora_id=f["lora_id"],
            medium=f["medium"],
            lora_name=f["lora_name"],
            extra_keys=tuple(extra) if extra is not None else None,
            group_idx=f["group_idx"],
        )
    if tag == "BlockRemoved":
        f = _fields(raw, _REMOVED_FIELDS)
        if f["block_hashes"] is None:
            raise DecodeError("BlockRemoved without block_hashes")
        return BlockRemoved(tuple(f["block_hashes"]), f["medium"], f["group_idx"])
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one PUB payload (vLLM's ``KVEventBatch``); raises ``DecodeError`` if malformed."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise DecodeError(f"not msgpack: {exc}") from exc
    ts: Any
    events: Any
    rank: Any
    try:
        if isinstance(raw, dict):
            ts, events, rank = raw["ts"], raw["events"], raw.get("data_parallel_rank")
        else:
            ts, events = raw[0], raw[1]
            rank = raw[2] if len(raw) > 2 else None
        decoded: list[KvEvent] = []
        unknown = 0
        for ev in events:
            d = _decode_event(ev)
            if d is None:
                unknown += 1
            else:
                decoded.append(d)
        return EventBatch(float(ts), tuple(decoded), rank, unknown)
    except DecodeError:
        raise
    except (TypeError, ValueError, IndexError, KeyError) as exc:
        raise DecodeError(f"malformed KV event batch: {exc}") from exc


# -- applying --------------------------------------------------------------------------------


class EventApplier:
    """Applies one worker's decoded events to the ``BlockIndex`` as ``confirmed`` entries.

    Pure and synchronous; owns the worker's engine-hash -> gateway-hash map. With
    ``keep_lower_tiers`` a lower tier's events go to ``BlockIndex.apply_stored_lower`` /
    ``apply_removed_lower`` (the module docstring, "Lower tiers").
    """

    def __init__(
        self,
        worker_id: str,
        index: BlockIndex,
        block_size_tokens: int,
        *,
        max_mapped_blocks: int = 2 * 65_536,
        keep_lower_tiers: bool = False,
    ) -> None:
        self.worker_id = worker_id
        self.index = index
        self.block_size_tokens = block_size_tokens
        self.max_mapped_blocks = max_mapped_blocks
        self.keep_lower_tiers = keep_lower_tiers
        # OrderedDict, not dict: evicting from the front of a dict leaves holes that every later
        # ``next(iter())`` walks over; ``popitem(last=False)`` is O(1).
        self._engine_to_gateway: OrderedDict[EngineHash, BlockHash] = OrderedDict()
        self.counts: Counter[str] = Counter()

    @property
    def mapped_blocks(self) -> int:
        return len(self._engine_to_gateway)

    def reset(self) -> None:
        """Forget the worker's blocks and the hash map (restart, lost events, cache reset)."""
        self._engine_to_gateway.clear()
        self.index.clear_worker(self.worker_id)

    def apply(self, events: Sequence[KvEvent]) -> None:
        for ev in events:
            if isinstance(ev, BlockStored):
                self._stored(ev)
            elif isinstance(ev, BlockRemoved):
                self._removed(ev)
            else:
                self.counts["cleared"] += 1
                self.reset()

    def _skip(self, reason: str) -> None:
        self.counts[f"skipped_{reason}"] += 1

    def _stored(self, ev: BlockStored) -> None:
        if not isinstance(ev.medium, str | None):  # a publisher's garbage, never a tier
            return self._skip("medium")
        lower = ev.medium not in DEVICE_MEDIA
        if lower and not self.keep_lower_tiers:
            return self._skip("medium")
        if ev.group_idx not in (None, 0):
            return self._skip("group")
        if lower and ev.block_size == 0 and not ev.token_ids and ev.parent_block_hash is None:
            return self._stored_placeholder(ev)
        if ev.lora_name is None and ev.lora_id is not None:
            return self._skip("lora")
        if ev.block_size != self.block_size_tokens:
            return self._skip("block_size")
        n = len(ev.block_hashes)
        if n == 0 or len(ev.token_ids) != n * ev.block_size:
            return self._skip("shape")  # e.g. null (sliding-window) blocks left out of the hashes
        salt = None
        if ev.extra_keys is not None:
            own = () if ev.lora_name is None else (ev.lora_name,)
            keys = ev.extra_keys
            if ev.parent_block_hash is None and keys and isinstance(keys[0], list | tuple):
                # A salted chain's first block: its keys are the adapter's, then the salt.
                head = tuple(keys[0])
                if (len(head) == len(own) + 1 and head[:-1] == own
                        and isinstance(head[-1], str) and head[-1]):
                    salt = head[-1]
            # Blocks from the first one with other extra keys on (multimodal inputs, prompt
            # embeds) are unreachable for the prompts the gateway routes.
            plain = next((i for i, k in enumerate(keys) if k is not None and tuple(k) != own
                          and not (i == 0 and salt is not None)), n)
            if plain < n:
                self._skip("extra_keys")
            n = plain
            if n == 0:
                return None
        parent = chain_root(ev.lora_name, salt)
        if ev.parent_block_hash is not None:
            parent = self._engine_to_gateway.get(ev.parent_block_hash)
            if parent is None:
                return self._skip("orphan")
        try:
            ours = block_hashes(ev.token_ids[: n * ev.block_size], ev.block_size, parent)
        except ValueError:
            return self._skip("token_ids")
        mapping = self._engine_to_gateway
        for engine_hash, gateway_hash in zip(ev.block_hashes[:n], ours, strict=True):
            mapping[engine_hash] = gateway_hash
            mapping.move_to_end(engine_hash)
        while len(mapping) > self.max_mapped_blocks:
            mapping.popitem(last=False)
        if lower:
            assert ev.medium is not None
            if not self.index.apply_stored_lower(self.worker_id, ev.medium, ours):
                return self._skip("tiers")
            self.counts["stored_lower_blocks"] += n
            return None
        # A chain's first block (no parent block) starts a chain in the index too, whatever
        # root (plain, an adapter's, a salt's) its hash was chained from: the search relies on it.
        first = parent if ev.parent_block_hash is not None else None
        self.index.apply_stored(self.worker_id, ours, first)
        self.counts["stored_blocks"] += n
        return None

    def _stored_placeholder(self, ev: BlockStored) -> None:
        """vLLM's offloading connector without ``self_describing_kv_events`` (its default):
        one block hash per offloaded chunk, no tokens. Known through the worker's own earlier
        device-tier store of that block (the connector stores what the GPU computed)."""
        assert ev.medium is not None
        mapping = self._engine_to_gateway
        ours = [g for h in ev.block_hashes if (g := mapping.get(h)) is not None]
        if len(ours) < len(ev.block_hashes):
            self.counts["skipped_unmapped"] += len(ev.block_hashes) - len(ours)
        for h in ev.block_hashes:
            if h in mapping:
                mapping.move_to_end(h)
        if ours:
            if not self.index.apply_stored_lower(self.worker_id, ev.medium, ours):
                return self._skip("tiers")
            self.counts["stored_lower_blocks"] += len(ours)
        return None

    def _removed(self, ev: BlockRemoved) -> None:
        if not isinstance(ev.medium, str | None):
            return self._skip("medium")
        lower = ev.medium not in DEVICE_MEDIA
        if lower and not self.keep_lower_tiers:
            return self._skip("medium")
        if ev.group_idx not in (None, 0):
            return self._skip("group")
        mapping, index, worker_id = self._engine_to_gateway, self.index, self.worker_id
        if lower:
            assert ev.medium is not None
            gone = [g for h in ev.block_hashes if (g := mapping.get(h)) is not None]
            if gone:
                index.apply_removed_lower(worker_id, ev.medium, gone)
            for h in ev.block_hashes:  # no tier holds it any more: no event will name it again
                g = mapping.get(h)
                if g is not None and not index.in_gpu(worker_id, g) \
                        and not index.in_lower_tier(worker_id, g):
                    del mapping[h]
            self.counts["removed_lower_blocks"] += len(gone)
            return None
        if self.keep_lower_tiers:
            gone = []
            for h in ev.block_hashes:
                g = mapping.get(h)
                if g is None:
                    continue
                gone.append(g)
                if not index.in_lower_tier(worker_id, g):  # else its offloaded copy is named later
                    del mapping[h]
        else:
            gone = [g for h in ev.block_hashes if (g := mapping.pop(h, None)) is not None]
        if gone:
            index.apply_removed(worker_id, gone)
        self.counts["removed_blocks"] += len(gone)
        return None


def adapter_root(adapter: str) -> BlockHash:
    """The parent hash of the first block of a LoRA adapter's chain: the adapter's blocks never
    share a key with the base model's or another adapter's (vLLM keys them by the adapter too)."""
    # Its own BLAKE2b domain (a personalisation no block hash uses): no prompt can forge it.
    digest = hashlib.blake2b(adapter.encode(), digest_size=8, person=b"kvgate-lora").digest()
    return int.from_bytes(digest, "little")


def chain_root(adapter: str | None, salt: str | None) -> BlockHash | None:
    """The parent hash of a chain's first block for a prompt of ``adapter`` (None: the base
    model) salted with ``salt`` (vLLM's ``cache_salt``; None: unsalted); None for the plain
    root. vLLM adds the salt to the extra keys of a prompt's first block only, but every later
    block chains from it, so a salted prompt shares no block with any other salt's, nor with an
    unsalted one: a root of its own keys it the same way."""
    if salt is None:
        return None if adapter is None else adapter_root(adapter)
    # Length-prefixed, so no (adapter, salt) pair encodes as another; a domain of its own.
    name = b"" if adapter is None else adapter.encode()
    data = len(name).to_bytes(4, "little") + name + salt.encode()
    digest = hashlib.blake2b(data, digest_size=8, person=b"kvgate-salt").digest()
    return int.from_bytes(digest, "little")


# -- subscribing -----------------------------------------------------------------------------


@dataclass
class SubscriberStats:
    batches: int = 0  # applied batches
    last_seq: int | None = None
    gaps: int = 0
    replays: int = 0  # gaps closed by replay
    warm_starts: int = 0  # fresh starts that read the worker's history from its replay socket
    warm_batches: int = 0  # batches applied from those histories
    restarts: int = 0
    resets: int = 0  # times the worker's entries were dropped (restart, unrecoverable gap ...)
    duplicates: int = 0
    decode_errors: int = 0
    malformed: int = 0  # messages that are not [topic, seq, payload]: dropped
    refused_peers: int = 0  # connections refused: not from an allowed peer (bind mode)
    failed_handshakes: int = 0  # connections that were no ZMQ publisher (a port scan ...)
    disconnects: int = 0
    reconnects: int = 0  # batches after a disconnect (each started the worker fresh)
    events: dict[str, int] = field(default_factory=dict)


class KvEventSubscriber:
    """One worker's SUB socket, applying its batches in sequence order. See the module docstring.

    The constructor does no I/O; ``start()`` (or ``open()`` inside a running loop) creates the
    sockets and the receive task; ``close()`` is idempotent and leaves no socket or task behind.
    Binding over TCP needs the ``PeerGate`` of the context: given with a ``context``, made here
    with the subscriber's own.
    """

    def __init__(
        self,
        worker_id: str,
        config: KvEventsConfig,
        index: BlockIndex,
        block_size_tokens: int,
        *,
        context: zmq.asyncio.Context | None = None,
        max_mapped_blocks: int = 2 * 65_536,
        replay_timeout_s: float = 2.0,
        republish: str | None = None,
        gate: PeerGate | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        keep_lower_tiers: bool = False,
    ) -> None:
        if gate is not None and context is None:
            raise ValueError("a PeerGate belongs to the context it was made with: give both")
        self.worker_id = worker_id
        self.config = config
        self.republish = republish
        self.max_message_bytes = max_message_bytes
        self._given_gate = gate
        self._gate: PeerGate | None = None  # owned (made with our own context): closed with it
        self._domain: str | None = None  # our ZAP domain in the gate that checks our peers
        self._publisher_fd: int | None = None  # the connection the last batch came by
        self.applier = EventApplier(
            worker_id, index, block_size_tokens, max_mapped_blocks=max_mapped_blocks,
            keep_lower_tiers=keep_lower_tiers,
        )
        self.replay_timeout_s = replay_timeout_s
        self._given_context = context
        self._context: zmq.asyncio.Context | None = None  # owned (none given): destroyed on close
        self._ctx_in_use: zmq.asyncio.Context | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._pub: zmq.asyncio.Socket | None = None  # the re-publishing socket, if any
        self._tasks: list[asyncio.Task[None]] = []
        self._state = "new"  # new -> open -> closed
        self._bound_endpoint: str | None = None
        self._stats = SubscriberStats()
        self._last_seq: int | None = None
        self._dup_floor: int | None = None  # live seqs in (floor, last] were already replayed
        self._peer_lost = False

    # -- lifecycle --

    @property
    def bound_endpoint(self) -> str | None:
        """The endpoint actually bound (``bind=True``), with the real port when 0 was asked."""
        return self._bound_endpoint

    @property
    def running(self) -> bool:
        return self._state == "open"

    async def start(self) -> None:
        self.open()

    def open(self) -> None:
        """Create the sockets and the receive task (needs a running loop)."""
        if self._state != "new":
            raise RuntimeError(f"subscriber for {self.worker_id} is {self._state}")
        loop = asyncio.get_running_loop()
        ctx = self._given_context
        if ctx is None:
            ctx = self._context = zmq.asyncio.Context()
        self._ctx_in_use = ctx
        sub = ctx.socket(zmq.SUB)
        monitor: zmq.asyncio.Socket | None = None
        pub: zmq.asyncio.Socket | None = None
        try:
            if self.republish is not None:
                pub = ctx.socket(zmq.PUB)
                pub.setsockopt(zmq.LINGER, 0)
                pub.setsockopt(zmq.SNDHWM, _RCVHWM)
                pub.bind(self.republish)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, _RCVHWM)
            sub.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
            sub.setsockopt(zmq.SUBSCRIBE, self.config.topic.encode())
            monitor = sub.get_monitor_socket(
                zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH | _HANDSHAKE_FAILED)
            if self.config.bind:
                if self.config.endpoint.startswith("tcp://"):
                    gate = self._given_gate
                    if gate is None:
                        if self._context is None:
                            raise ValueError("binding on a shared context needs its PeerGate")
                        gate = self._gate = PeerGate(ctx)
                        gate.open()
                    self._domain = gate.allow(self.config.peers)
                    sub.setsockopt_string(zmq.ZAP_DOMAIN, self._domain)
                sub.bind(self.config.endpoint)
                self._bound_endpoint = sub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                sub.connect(self.config.endpoint)
        except BaseException:
            if monitor is not None:
                with contextlib.suppress(zmq.ZMQError):
                    sub.disable_monitor()
                monitor.close(linger=0)
            if pub is not None:
                pub.close(linger=0)
            sub.close(linger=0)
            self._close_gate()
            if self._context is not None:
                self._context.destroy(linger=0)
                self._context = None
            self._state = "closed"
            raise
        self._sub, self._monitor, self._pub = sub, monitor, pub
        self._state = "open"
        self._tasks = [
            loop.create_task(self._receive_loop(), name=f"kv-events:{self.worker_id}"),
            loop.create_task(self._monitor_loop(), name=f"kv-events-monitor:{self.worker_id}"),
        ]

    def close_nowait(self) -> list[asyncio.Task[None]]:
        """Stop applying at once, cancel the tasks, close the sockets; returns the tasks to await."""
        if self._state == "closed":
            return []
        self._state = "closed"
        tasks, self._tasks = self._tasks, []
        for t in tasks:
            t.cancel()
        if self._sub is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sub.disable_monitor()
            if self._monitor is not None:
                self._monitor.close(linger=0)
            self._sub.close(linger=0)
            self._sub = self._monitor = None
        if self._pub is not None:
            self._pub.close(linger=0)
            self._pub = None
        tasks += self._close_gate()
        self._ctx_in_use = None
        if self._context is not None:
            self._context.destroy(linger=0)
            self._context = None
        return tasks

    def _close_gate(self) -> list[asyncio.Task[None]]:
        """Leave the gate that checks our peers; close it if it is our own."""
        gate = self._gate or self._given_gate
        if self._domain is not None and gate is not None:
            gate.forget(self._domain)
        self._domain = None
        owned, self._gate = self._gate, None
        return owned.close_nowait() if owned is not None else []

    async def close(self) -> None:
        tasks = self.close_nowait()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    def stats(self) -> SubscriberStats:
        s = self._stats
        s.last_seq = self._last_seq
        s.events = dict(self.applier.counts)
        return SubscriberStats(**vars(s))

    # -- receiving --

    async def _monitor_loop(self) -> None:
        assert self._monitor is not None
        mon = self._monitor
        while True:
            try:
                frames = await mon.recv_multipart()
            except zmq.ZMQError:  # closed
                return
            message = parse_monitor_message(frames)
            event = message["event"]
            if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self._stats.refused_peers += 1
            elif event & _HANDSHAKE_FAILED:
                self._stats.failed_handshakes += 1
            elif event == zmq.EVENT_DISCONNECTED and message["value"] == self._publisher_fd:
                self._stats.disconnects += 1
                await self._peer_gone()

    async def _peer_gone(self) -> None:
        """The publisher's connection ended: the next batch starts the worker fresh, here and
        at every subscriber we re-publish to."""
        self._peer_lost = True
        if self._pub is not None:
            notice = PEER_LOST_SEQ.to_bytes(8, "big", signed=True)
            await self._pub.send_multipart([self.config.topic.encode(), notice, b""])

    async def _receive_loop(self) -> None:
        assert self._sub is not None
        sub = self._sub
        # What the worker holds already (see "Warm start"); live batches meanwhile wait in the
        # socket and those the history brought are skipped as duplicates.
        await self._replay_history(None)
        if self._last_seq is not None:
            self._dup_floor = -1
        while True:
            try:
                frames = await sub.recv_multipart(copy=False)
            except zmq.ZMQError:  # closed
                return
            if len(frames) != 3 or len(frames[1]) != 8:
                self._stats.malformed += 1
                log.debug(
                    "kv events from %s: unexpected frames (%d)", self.worker_id, len(frames)
                )
                continue
            fd = frames[0].get(zmq.SRCFD)
            if fd != self._publisher_fd:  # another connection: perhaps another engine
                if self._publisher_fd is not None:
                    await self._peer_gone()
                self._publisher_fd = fd
            if self._pub is not None:  # PUB never blocks: a slow follower loses, not us
                await self._pub.send_multipart(frames)
            seq = int.from_bytes(frames[1].bytes, "big", signed=True)
            if seq == PEER_LOST_SEQ:  # from a re-publisher: its worker went away
                self._stats.disconnects += 1
                self._peer_lost = True
                continue
            try:
                await self._on_batch(seq, frames[2].bytes)
            except asyncio.CancelledError:
                raise
            except Exception:  # one bad batch must not stop the subscriber
                log.exception("kv events from %s: failed to apply a batch", self.worker_id)

    async def _on_batch(self, seq: int, payload: bytes) -> None:
        if self._state != "open":
            return
        last = self._last_seq
        if self._peer_lost and last is not None:
            # The publisher went away and a publisher is back: the same engine after a network
            # blip, or a restarted one whose first batches we missed (its seq may even continue
            # ours by chance). Nothing tells them apart, so start the worker fresh.
            log.info(
                "kv events from %s: first batch after a disconnect, starting fresh", self.worker_id
            )
            self._stats.reconnects += 1
            self._reset()
            await self._start_fresh(seq, payload)
            return
        if last is None:
            await self._start_fresh(seq, payload)
            return
        if seq == last + 1:
            self._dup_floor = None
            self._apply(seq, payload)
            return
        if seq <= last:
            if self._dup_floor is not None and seq > self._dup_floor:
                self._stats.duplicates += 1
                return
            log.info(
                "kv events from %s: seq %d after %d, publisher restarted", self.worker_id, seq, last
            )
            self._stats.restarts += 1
            self._reset()
            await self._start_fresh(seq, payload)
            return
        self._stats.gaps += 1
        if self.config.replay_endpoint is None:
            log.info(
                "kv events from %s: gap %d..%d, dropping its entries",
                self.worker_id,
                last + 1,
                seq - 1,
            )
            self._reset()
            self._apply(seq, payload)
            return
        await self._recover(last, seq, payload)

    async def _recover(self, last: int, seq: int, payload: bytes) -> None:
        resets_before = self._stats.resets
        try:
            async for r_seq, r_payload in self._replay(last + 1):
                if self._state != "open":
                    return
                assert self._last_seq is not None
                if r_seq <= self._last_seq:
                    continue
                if r_seq != self._last_seq + 1:  # the replay buffer no longer has what we missed
                    self._reset()
                self._apply(r_seq, r_payload)
        except (TimeoutError, zmq.ZMQError) as exc:
            log.warning(
                "kv events from %s: replay failed (%s), dropping its entries", self.worker_id, exc
            )
            self._reset()
            self._apply(seq, payload)
            return
        assert self._last_seq is not None
        if seq > self._last_seq:  # the replay stopped short of the batch that showed the gap
            if seq != self._last_seq + 1:
                self._reset()
            self._apply(seq, payload)
        if self._stats.resets == resets_before:
            self._stats.replays += 1
        # Live batches after the gap may already have come through the replay: skip them.
        self._dup_floor = last

    async def _start_fresh(self, seq: int, payload: bytes) -> None:
        """Start the worker (whose entries are gone) at ``seq``: its history first, if it has one."""
        if seq > 0:
            await self._replay_history(seq)
            if self._last_seq is not None and seq != self._last_seq + 1:
                self._reset()  # the history stopped short of seq: what we have is not all
        self._apply(seq, payload)

    async def _replay_history(self, before: int | None) -> None:
        """Apply the worker's buffered history, from its first batch up to ``before`` (all when
        None), while nothing is known of the worker yet. A failed or short replay leaves it as
        a prefix of the history (gaps after it are recovered as usual) or, when it did not start
        at the buffer's oldest batch contiguously, dropped."""
        if self.config.replay_endpoint is None or self._last_seq is not None:
            return
        applied = 0
        try:
            async with contextlib.aclosing(self._replay(0)) as history:
                async for r_seq, r_payload in history:
                    if self._state != "open" or (before is not None and r_seq >= before):
                        break
                    if self._last_seq is not None and r_seq != self._last_seq + 1:
                        self._reset()  # not one contiguous history: keep only from here
                    self._apply(r_seq, r_payload)
                    applied += 1
        except (TimeoutError, zmq.ZMQError) as exc:
            # A worker not up yet, or one without a replay socket: it starts cold, as it would.
            log.info("kv events from %s: no history replayed (%s)", self.worker_id, exc)
        if applied:
            self._stats.warm_starts += 1
            self._stats.warm_batches += applied
            log.info(
                "kv events from %s: warm start, %d batches replayed up to seq %s",
                self.worker_id, applied, self._last_seq,
            )

    async def _replay(self, start_seq: int) -> AsyncGenerator[tuple[int, bytes], None]:
        """Yield ``(seq, payload)`` from the worker's replay socket, from ``start_seq`` on."""
        assert self.config.replay_endpoint is not None and self._ctx_in_use is not None
        dealer = self._ctx_in_use.socket(zmq.DEALER)
        try:
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
            dealer.connect(self.config.replay_endpoint)
            await dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
            while True:
                if not await dealer.poll(self.replay_timeout_s * 1000):
                    raise TimeoutError(f"no replay answer within {self.replay_timeout_s} s")
                frames = await dealer.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8:
                    raise zmq.ZMQError(msg=f"unexpected replay frames ({len(frames)})")
                r_seq = int.from_bytes(frames[2], "big", signed=True)
                if r_seq == END_SEQ:
                    return
                yield r_seq, frames[3]
        finally:
            dealer.close(linger=0)

    def _reset(self) -> None:
        self._stats.resets += 1
        self.applier.reset()
        self._last_seq = None
        self._dup_floor = None
        self._peer_lost = False

    def _apply(self, seq: int, payload: bytes) -> None:
        self._last_seq = seq
        try:
            batch = decode_batch(payload)
        except DecodeError as exc:
            # A batch we cannot read is a batch lost, and replay would return the same bytes.
            log.warning("kv events from %s: seq %d undecodable (%s)", self.worker_id, seq, exc)
            self._stats.decode_errors += 1
            self._reset()
            self._last_seq = seq
            return
        self.applier.apply(batch.events)
        self._stats.batches += 1
