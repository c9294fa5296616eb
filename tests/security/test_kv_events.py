"""The bind-mode KV-event socket against strangers and bad messages (issue 12, item 5).

In bind mode the gateway listens and the worker's PUB connects, so before this anyone reaching the
port could publish blocks into the prefix index (steering traffic by false cache hits), make the
worker's entries start fresh by merely connecting and leaving, or send a message of any size.
The worker here is a pyzmq PUB speaking vLLM's wire format from 127.0.0.1; a stranger on the same
host connects from another loopback address (127.0.0.2), which is all that tells them apart, as
an address is all that tells a worker from a stranger on a cluster network.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import msgpack
import pytest_asyncio
import zmq
import zmq.asyncio
from pydantic import ByteSize

from gateway.config import KvEventsSettings
from gateway.kvindex.events import KvEventsConfig, KvEventSubscriber
from gateway.kvindex.hashing import BlockHash, block_hashes
from gateway.kvindex.index import BlockIndex
from gateway.kvindex.service import PrefixIndex
from tests.harness import eventually

BLOCK = 4
TOPIC = b"kv"
WORKER_TOKENS = list(range(100, 100 + 4 * BLOCK))
STRANGER_TOKENS = list(range(900, 900 + 4 * BLOCK))


def batch(tokens: list[int], first_hash: int, *, padding: int = 0) -> bytes:
    """One batch storing ``tokens`` as a chain of blocks from the root (engine hashes from
    ``first_hash``); ``padding`` bytes of an extra field make it as large as wanted."""
    n = len(tokens) // BLOCK
    event: dict[str, object] = {
        "type": "BlockStored", "block_hashes": list(range(first_hash, first_hash + n)),
        "parent_block_hash": None, "token_ids": tokens, "block_size": BLOCK,
        "lora_id": None, "medium": "GPU", "lora_name": None,
    }
    if padding:
        event["pad"] = b"x" * padding
    payload: bytes = msgpack.packb([0.0, [event], 0])
    return payload


def empty_batch() -> bytes:
    payload: bytes = msgpack.packb([0.0, [], 0])
    return payload


@pytest_asyncio.fixture(loop_scope="function")
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


def held(index: BlockIndex, tokens: list[int]) -> int:
    ours: list[BlockHash] = block_hashes(tokens, BLOCK)
    return index.match_prefix(ours, ["w"])["w"]


class Publisher:
    """A PUB that connects to the gateway's bound port, from ``source`` (an address of this
    host), numbering its batches itself."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, source: str) -> None:
        host_port = endpoint.removeprefix("tcp://")
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.connect(f"tcp://{source}:0;{host_port}")
        self.seq = 0

    async def send(self, payload: bytes) -> None:
        await self.pub.send_multipart([TOPIC, self.seq.to_bytes(8, "big"), payload])
        self.seq += 1

    async def send_frames(self, *frames: bytes) -> None:
        await self.pub.send_multipart(list(frames))

    async def join(self, sub: KvEventSubscriber) -> None:
        """Empty batches until one is applied (a PUB drops what precedes the subscription)."""
        before = sub.stats().batches
        for _ in range(400):
            await self.send(empty_batch())
            await asyncio.sleep(0.005)
            if sub.stats().batches > before:
                await asyncio.sleep(0.02)
                return
        raise AssertionError("the worker was never heard")

    def close(self) -> None:
        self.pub.close(linger=0)


async def bound(settings: KvEventsSettings | None = None,
                peers: tuple[str, ...] = ("127.0.0.1",)) -> tuple[PrefixIndex, KvEventSubscriber]:
    """A started prefix index whose worker ``w`` (at 127.0.0.1) connects to it."""
    prefix = PrefixIndex(BlockIndex(), settings=settings)
    prefix.set_worker("w", BLOCK, 1000, KvEventsConfig(
        "tcp://127.0.0.1:0", topic=TOPIC.decode(), bind=True, peers=peers))
    await prefix.start()
    sub = prefix.subscriber("w")
    assert sub is not None and sub.bound_endpoint is not None
    return prefix, sub


async def test_a_strangers_socket_is_not_heard_and_does_not_reset_the_worker(
    ctx: zmq.asyncio.Context,
) -> None:
    """Regression: a stranger's blocks went into the index as the worker's, and its connection
    ending counted as the worker's disconnect (the worker's entries started fresh)."""
    prefix, sub = await bound()
    assert sub.bound_endpoint is not None
    worker = Publisher(ctx, sub.bound_endpoint, "127.0.0.1")
    stranger = Publisher(ctx, sub.bound_endpoint, "127.0.0.2")
    try:
        await worker.join(sub)
        await worker.send(batch(WORKER_TOKENS[:2 * BLOCK], 10))
        await eventually(lambda: held(prefix.index, WORKER_TOKENS) == 2)

        await eventually(lambda: sub.stats().refused_peers >= 1)
        for _ in range(50):  # whatever it sends, with a seq that would continue the worker's
            stranger.seq = worker.seq
            await stranger.send(batch(STRANGER_TOKENS, 500))
            await asyncio.sleep(0.002)
        stranger.close()
        await asyncio.sleep(0.1)  # its connection's end, had it been let in
        await worker.send(batch(WORKER_TOKENS, 10))

        await eventually(lambda: held(prefix.index, WORKER_TOKENS) == 4)
        assert held(prefix.index, STRANGER_TOKENS) == 0
        stats = sub.stats()
        assert (stats.disconnects, stats.resets, stats.reconnects) == (0, 0, 0)
    finally:
        worker.close()
        stranger.close()
        await prefix.close()


async def test_a_port_scan_does_not_make_the_worker_start_fresh(
    ctx: zmq.asyncio.Context,
) -> None:
    """Regression: any TCP connection that ended counted as the worker's disconnect, so the next
    batch threw away everything the index knew about the worker."""
    prefix, sub = await bound()
    assert sub.bound_endpoint is not None
    worker = Publisher(ctx, sub.bound_endpoint, "127.0.0.1")
    try:
        await worker.join(sub)
        await worker.send(batch(WORKER_TOKENS[:2 * BLOCK], 10))
        await eventually(lambda: held(prefix.index, WORKER_TOKENS) == 2)
        port = int(sub.bound_endpoint.rsplit(":", 1)[1])
        for junk in (b"", b"GET / HTTP/1.0\r\n\r\n", b"\xff" * 64):
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(junk)
                await asyncio.sleep(0.05)
        await eventually(lambda: sub.stats().failed_handshakes >= 1)
        await asyncio.sleep(0.2)  # every scan's connection has ended
        await worker.send(batch(WORKER_TOKENS, 10))

        await eventually(lambda: held(prefix.index, WORKER_TOKENS) == 4)
        assert (sub.stats().disconnects, sub.stats().resets) == (0, 0)
    finally:
        worker.close()
        await prefix.close()


async def test_an_oversized_message_is_dropped_and_the_worker_is_still_heard(
    ctx: zmq.asyncio.Context,
) -> None:
    """Regression: no size limit: a peer could make the gateway allocate any size."""
    prefix, sub = await bound(KvEventsSettings(max_message_bytes=ByteSize(4096)))
    assert sub.bound_endpoint is not None
    worker = Publisher(ctx, sub.bound_endpoint, "127.0.0.1")
    try:
        await worker.join(sub)
        await worker.send(batch(WORKER_TOKENS, 10, padding=64 << 10))
        await eventually(lambda: sub.stats().disconnects == 1)  # libzmq dropped it unread
        await asyncio.sleep(0.05)
        assert held(prefix.index, WORKER_TOKENS) == 0

        await worker.join(sub)  # its PUB reconnects by itself
        await worker.send(batch(WORKER_TOKENS, 10))
        await eventually(lambda: held(prefix.index, WORKER_TOKENS) == 4)
        assert sub.stats().reconnects == 1  # started fresh: a batch was lost
    finally:
        worker.close()
        await prefix.close()


async def test_malformed_messages_are_counted_and_dropped_and_the_subscriber_goes_on(
    ctx: zmq.asyncio.Context,
) -> None:
    prefix, sub = await bound()
    assert sub.bound_endpoint is not None
    worker = Publisher(ctx, sub.bound_endpoint, "127.0.0.1")
    try:
        await worker.join(sub)
        await worker.send_frames(TOPIC)
        await worker.send_frames(TOPIC, b"\x00\x01", b"")
        await worker.send_frames(TOPIC, (0).to_bytes(8, "big"), b"x", b"y")
        await worker.send(b"\xc1 not msgpack")
        await worker.send(msgpack.packb({"ts": "x", "events": 5}))
        await eventually(lambda: sub.stats().malformed == 3 and sub.stats().decode_errors == 2)
        await worker.send(batch(WORKER_TOKENS, 10))

        await eventually(lambda: held(prefix.index, WORKER_TOKENS) == 4)
        assert sub.running
    finally:
        worker.close()
        await prefix.close()


async def test_peers_may_be_named_and_configured_bind_peers_are_let_in_too(
    ctx: zmq.asyncio.Context,
) -> None:
    """The worker's host as a name (resolved when it connects), plus ``kv_events.bind_peers``."""
    prefix, sub = await bound(KvEventsSettings(bind_peers=["127.0.0.3/32"]), peers=("localhost",))
    assert sub.bound_endpoint is not None
    worker = Publisher(ctx, sub.bound_endpoint, "127.0.0.1")
    other = Publisher(ctx, sub.bound_endpoint, "127.0.0.3")
    stranger = Publisher(ctx, sub.bound_endpoint, "127.0.0.2")
    try:
        await worker.join(sub)
        other.seq = worker.seq + 1000  # far ahead: heard, it is a gap (the worker starts fresh)
        await other.join(sub)
        await eventually(lambda: sub.stats().refused_peers >= 1)
    finally:
        for p in (worker, other, stranger):
            p.close()
        await prefix.close()


async def test_a_bound_socket_without_peers_takes_loopback_only(
    ctx: zmq.asyncio.Context,
) -> None:
    prefix, sub = await bound(peers=())
    assert sub.bound_endpoint is not None
    local = Publisher(ctx, sub.bound_endpoint, "127.0.0.2")
    try:
        await local.join(sub)  # loopback: a worker on this host
    finally:
        local.close()
        await prefix.close()
