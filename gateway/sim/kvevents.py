"""KV cache events of the simulated worker, in vLLM 0.32's exact ZMQ wire format.

Wire format (what ``vllm.distributed.kv_events.ZmqEventPublisher`` sends):

* PUB multipart frames ``[topic, seq, payload]``: ``seq`` is an 8-byte big-endian counter of
  batches, from 0 per server start; ``topic`` defaults to ``""`` as in vLLM.
* ``payload`` is msgpack of ``KVEventBatch``, a msgspec struct with ``array_like=True``:
  ``[ts (float64), [events...], data_parallel_rank]``.
* Each event is a msgspec struct with ``tag=True`` (not array-like), so a msgpack *map* whose
  first key is ``"type"`` (the class name), then the fields in declaration order;
  ``omit_defaults=True`` drops fields that have a default and hold it, while fields without a
  default are always written, ``None`` included:
  ``BlockStored {type, block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name, extra_keys, group_idx, kv_cache_spec_kind}`` (``extra_keys`` is one ``None`` per
  block, ``group_idx`` 0, ``kv_cache_spec_kind`` ``"full_attention"``; the sliding window,
  locality, ownership and session id hold their defaults and are omitted),
  ``BlockRemoved {type, block_hashes, medium, group_idx}``, ``AllBlocksCleared {type}``.
  A CPU tier's events (``kvcache.CpuOffloadCache``, vLLM's offloading connector) carry medium
  ``"CPU"``; its ``BlockStored`` has no ``extra_keys``, and as a placeholder (vLLM's default)
  no tokens, parent, adapter or ``kv_cache_spec_kind`` either, ``block_size`` 0.
  Hashes are unsigned 64-bit ints. ``msgpack.packb`` with maps in that key order produces the
  same bytes as msgspec (both pick the shortest int/str/array forms and write floats as float64);
  a test checks byte equality against vLLM's encoder.
* One batch per engine step that produced events, published when the step completes
  (``ts = time.time()``), as vLLM's scheduler does in ``update_from_output``.
* Replay: a ROUTER socket answers a DEALER's ``[b"", start_seq (8 bytes)]`` with
  ``[b"", topic, seq, payload]`` for every buffered batch with ``seq >= start_seq`` (the last
  ``buffer_steps``), then ``[b"", b"", -1 (8 bytes, signed), b""]``.
* Endpoints follow vLLM's rule: a ``*``, ``::``, ``ipc://`` or ``inproc://`` endpoint is bound
  (subscribers connect), any other is connected to (the subscriber binds). The replay socket is
  always bound. ``tcp://127.0.0.1:*`` binds a free port; ``endpoint`` then reports it.
* ``AllBlocksCleared`` (``POST /reset_prefix_cache``) goes out with the next step's batch, as in
  vLLM, whose engine only publishes when it steps.

Unlike vLLM there is no publisher thread: a PUB send never blocks (messages past the high-water
mark are dropped, as in vLLM), so it runs inline in the event loop, and the replay socket is
served by an asyncio task that sleeps in the loop's selector until a request arrives.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from gateway.sim.kvcache import (
    FULL_ATTENTION,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def event_to_wire(event: KVEvent) -> dict[str, Any]:
    """One event as the msgpack map vLLM's msgspec struct encodes to (key order matters)."""
    if isinstance(event, BlockStored) and event.medium != MEDIUM_GPU:
        return _offloaded_to_wire(event)
    if isinstance(event, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": None if event.lora is None else event.lora.lora_id,
            "medium": MEDIUM_GPU,
            "lora_name": None if event.lora is None else event.lora.name,
            # vLLM publishes each block's keys untagged (to_event_extra_keys): the adapter's
            # name, then on a prompt's first block the cache salt
            "extra_keys": _extra_keys(event),
            "group_idx": 0,
            "kv_cache_spec_kind": FULL_ATTENTION,
        }
    if isinstance(event, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": list(event.block_hashes),
            "medium": event.medium,
            "group_idx": 0,
        }
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV event: {event!r}")


def _extra_keys(event: BlockStored) -> list[tuple[str, ...] | None]:
    own: tuple[str, ...] | None = None if event.lora is None else (event.lora.name,)
    keys = [own] * len(event.block_hashes)
    if event.cache_salt is not None and keys:
        keys[0] = (*(own or ()), event.cache_salt)
    return keys


def _offloaded_to_wire(event: BlockStored) -> dict[str, Any]:
    """A CPU-tier ``BlockStored`` as vLLM's offloading connector writes it
    (``OffloadingEventsTracker``): the placeholder (``block_size`` 0: no tokens, no parent, no
    adapter, no spec kind) or the self-describing payload (no ``extra_keys``: the tracker defers
    them, so they are ``None`` and omitted)."""
    wire: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": list(event.block_hashes),
        "parent_block_hash": event.parent_block_hash,
        "token_ids": list(event.token_ids),
        "block_size": event.block_size,
        "lora_id": None if event.lora is None else event.lora.lora_id,
        "medium": event.medium,
        "lora_name": None if event.lora is None else event.lora.name,
        "group_idx": 0,
    }
    if event.block_size:
        wire["kv_cache_spec_kind"] = FULL_ATTENTION
    return wire


def encode_batch(ts: float, events: Sequence[KVEvent], data_parallel_rank: int = 0) -> bytes:
    """msgpack payload of one ``KVEventBatch``."""
    packed: bytes = msgpack.packb(
        [float(ts), [event_to_wire(e) for e in events], data_parallel_rank], use_bin_type=True
    )
    return packed


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard and ipc/inproc endpoints, connect to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _reported(configured: str, bound: str) -> str:
    """What ``/kv_event_sources`` shows: the configured endpoint, as vLLM does, unless its port
    was left to the OS (``:*`` or ``:0``), then the bound one."""
    return bound if configured.endswith((":*", ":0")) else configured


class KVEventPublisher:
    """PUB socket plus optional replay ROUTER for one simulated worker."""

    def __init__(
        self,
        context: zmq.Context[zmq.Socket[bytes]],
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        data_parallel_rank: int = 0,
    ) -> None:
        self._ctx = context
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._topic = topic.encode()
        self._hwm = hwm
        self._rank = data_parallel_rank
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._pub: zmq.Socket[bytes] | None = None
        self._router: zmq.Socket[bytes] | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None

    @property
    def next_seq(self) -> int:
        return self._seq

    def start(self) -> None:
        pub = self._ctx.socket(zmq.PUB)
        pub.set_hwm(self._hwm)
        pub.setsockopt(zmq.LINGER, 0)
        if is_bind_endpoint(self.endpoint):
            pub.bind(self.endpoint)
            self.endpoint = _reported(self.endpoint, pub.getsockopt_string(zmq.LAST_ENDPOINT))
        else:
            pub.connect(self.endpoint)
        self._pub = pub
        if self.replay_endpoint is not None:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.bind(self.replay_endpoint)
            self.replay_endpoint = _reported(
                self.replay_endpoint, router.getsockopt_string(zmq.LAST_ENDPOINT)
            )
            self._router = router
            self._replay = zmq.asyncio.Socket.from_socket(router)
            self._replay_task = asyncio.get_running_loop().create_task(
                self._serve_replay(), name="sim-kv-replay"
            )

    def publish(self, events: Sequence[KVEvent], ts: float | None = None) -> int:
        """Send one batch now; returns its sequence number."""
        payload = encode_batch(time.time() if ts is None else ts, events, self._rank)
        seq = self._seq
        self._seq += 1
        if self._pub is not None:
            # A PUB send drops at the high-water mark rather than block; Again is not expected,
            # but a dropped batch is what vLLM does too, and replay can recover it.
            with contextlib.suppress(zmq.Again):
                self._pub.send_multipart(
                    (self._topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK
                )
        self._buffer.append((seq, payload))
        return seq

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        router = self._replay
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3:
                log.warning("invalid KV replay request: %d frames", len(frames))
                continue
            client_id, _, start_bytes = frames
            start_seq = int.from_bytes(start_bytes, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await router.send_multipart(
                        (client_id, b"", self._topic, seq.to_bytes(8, "big"), payload)
                    )
            await router.send_multipart((client_id, b"", b"", END_SEQ, b""))

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
            self._replay_task = None
        if self._replay is not None:
            self._replay.close(linger=0)
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._router = None
        self._replay = None
