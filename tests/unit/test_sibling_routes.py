"""Routes shared among one gateway's processes (``gateway.kvindex.siblings``): two processes'
ends in this test's event loop, over real unix datagram sockets in a private directory."""

from __future__ import annotations

import socket
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from gateway.kvindex.exchange import KIND_ROUTES, SectionOut, decode, encode
from gateway.kvindex.hashing import block_hashes
from gateway.kvindex.service import PrefixIndex
from gateway.kvindex.siblings import (
    MAX_MESSAGE_BYTES,
    MAX_RECEIVED_BLOCKS,
    MAX_ROUTE_BLOCKS,
    MIN_ROUTE_TOKENS,
    SiblingRoutes,
)
from tests.harness import CountingIndex, eventually

W1, W2 = "http://w1:8000", "http://w2:8000"
BLOCK = 16


def tokens(seed: int, n: int) -> tuple[int, ...]:
    return tuple(seed * 100_000 + i for i in range(n))


def make_index(events: bool = False) -> PrefixIndex:
    index = PrefixIndex(CountingIndex())
    for w in (W1, W2):
        index.set_worker(w, BLOCK, None, None)
        index.index.set_events(w, events)
    return index


def held(index: PrefixIndex, ids: tuple[int, ...], worker: str = W1) -> int:
    return index.cached_tokens(ids, [(worker, BLOCK)])[worker]


@pytest.fixture
def runtime_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="kvg") as d:
        yield Path(d)


@pytest_asyncio.fixture(loop_scope="function")
async def pair(runtime_dir: Path) -> AsyncIterator[tuple[SiblingRoutes, SiblingRoutes]]:
    a = SiblingRoutes(make_index(), runtime_dir, 0, 2)
    b = SiblingRoutes(make_index(), runtime_dir, 1, 2)
    a.start()
    b.start()
    try:
        yield a, b
    finally:
        a.close()
        b.close()


@pytest.mark.asyncio(loop_scope="function")
async def test_a_route_made_in_one_process_is_known_to_the_other(
    pair: tuple[SiblingRoutes, SiblingRoutes],
) -> None:
    a, b = pair
    ids = tokens(1, 3 * 1024 + 100)
    assert held(b.index, ids) == 0

    a.index.record_routed(W1, ids, BLOCK)
    await eventually(lambda: held(b.index, ids) > 0, timeout_s=5)

    assert held(b.index, ids) == held(a.index, ids) == 3 * 1024 + 96
    assert held(b.index, ids, W2) == 0
    # and back: the other's routes reach the first
    other = tokens(2, 600)
    b.index.record_routed(W2, other, BLOCK)
    await eventually(lambda: held(a.index, other, W2) > 0, timeout_s=5)
    assert (a.counts["sent"], b.counts["received"]) == (1, 1)


@pytest.mark.asyncio(loop_scope="function")
async def test_one_turns_routes_go_as_one_message_and_a_burst_is_split_within_the_bound(
    pair: tuple[SiblingRoutes, SiblingRoutes],
) -> None:
    a, b = pair
    same_prefix = [tokens(3, 2048)[:2000] + tokens(100 + k, 64) for k in range(20)]
    for ids in same_prefix:
        a.index.record_routed(W1, ids, BLOCK)
    await eventually(lambda: b.counts.get("received", 0) >= 1, timeout_s=5)
    assert a.counts["sent"] == 1  # the turn's 20 routes, their shared prefix sent once
    assert all(held(b.index, ids) == held(a.index, ids) > 0 for ids in same_prefix)

    long = [tokens(200 + k, 2 * 1024 * 16) for k in range(12)]  # 2,048 distinct blocks each
    for ids in long:
        a.index.record_routed(W2, ids, BLOCK)
    queued = list(a._queue)
    sizes = [len(m) for m in a.messages()]
    assert len(sizes) > 1 and max(sizes) <= MAX_MESSAGE_BYTES
    for url, size, hashes in queued:  # the same routes, sent this time
        a.on_routed(url, size, hashes)
    await eventually(lambda: all(held(b.index, ids, W2) > 0 for ids in long), timeout_s=5)
    assert all(held(b.index, ids, W2) == held(a.index, ids, W2) for ids in long)


@pytest.mark.asyncio(loop_scope="function")
async def test_a_route_longer_than_the_bound_sends_its_first_blocks(
    pair: tuple[SiblingRoutes, SiblingRoutes],
) -> None:
    a, b = pair
    ids = tokens(4, (MAX_ROUTE_BLOCKS + 100) * BLOCK + 1)
    a.index.record_routed(W1, ids, BLOCK)
    await eventually(lambda: held(b.index, ids) > 0, timeout_s=5)
    assert held(b.index, ids) == MAX_ROUTE_BLOCKS * BLOCK
    assert held(a.index, ids) == (MAX_ROUTE_BLOCKS + 100) * BLOCK


@pytest.mark.asyncio(loop_scope="function")
async def test_a_short_route_is_not_sent(pair: tuple[SiblingRoutes, SiblingRoutes]) -> None:
    a, b = pair
    short = tokens(12, MIN_ROUTE_TOKENS - 1)  # one block short of it
    a.index.record_routed(W1, short, BLOCK)
    just = tokens(13, MIN_ROUTE_TOKENS + 1)
    a.index.record_routed(W1, just, BLOCK)
    await eventually(lambda: held(b.index, just) > 0, timeout_s=5)
    assert held(b.index, short) == 0 and held(a.index, short) == MIN_ROUTE_TOKENS - BLOCK
    assert a.counts["sent"] == 1


@pytest.mark.asyncio(loop_scope="function")
async def test_a_route_the_events_confirmed_already_is_not_sent(runtime_dir: Path) -> None:
    a = SiblingRoutes(make_index(events=True), runtime_dir, 0, 2)
    b = SiblingRoutes(make_index(events=True), runtime_dir, 1, 2)
    a.start()
    b.start()
    try:
        known = tokens(5, 64 * BLOCK)
        a.index.index.apply_stored(W1, block_hashes(known, BLOCK))
        a.index.record_routed(W1, known, BLOCK)
        fresh = tokens(6, 64 * BLOCK)
        a.index.record_routed(W1, fresh, BLOCK)
        await eventually(lambda: held(b.index, fresh) > 0, timeout_s=5)
        assert held(b.index, known) == 0  # its own events will tell it
        assert a.counts["sent"] == 1
    finally:
        a.close()
        b.close()


@pytest.mark.asyncio(loop_scope="function")
async def test_a_sibling_that_is_not_up_costs_a_dropped_message_and_nothing_else(
    runtime_dir: Path,
) -> None:
    a = SiblingRoutes(make_index(), runtime_dir, 0, 3)
    b = SiblingRoutes(make_index(), runtime_dir, 2, 3)  # process 1 is restarting
    a.start()
    b.start()
    try:
        ids = tokens(7, 700)
        a.index.record_routed(W1, ids, BLOCK)
        await eventually(lambda: held(b.index, ids) > 0, timeout_s=5)
        assert (a.counts["sent"], a.counts["dropped"]) == (1, 1)
        assert held(a.index, ids) == 688  # its own route stands
    finally:
        a.close()
        b.close()


@pytest.mark.asyncio(loop_scope="function")
async def test_garbage_on_the_socket_is_counted_and_changes_nothing(
    pair: tuple[SiblingRoutes, SiblingRoutes], runtime_dir: Path,
) -> None:
    a, b = pair
    good = encode(KIND_ROUTES, b"x" * 8, b"x" * 8,
                  [SectionOut(W1, BLOCK, None, [(None, block_hashes(tokens(8, 160), BLOCK))])])
    forged_block_size = encode(
        KIND_ROUTES, b"x" * 8, b"x" * 8,
        [SectionOut(W1, 32, None, [(None, block_hashes(tokens(9, 320), 32))])])
    decode(good)  # the format is right; only what is wrong below is wrong
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        target = str(b.path)
        for data in (b"", b"KX", good[:-3], good + b"\0", b"\xff" * 1000,
                     b"\0" * (MAX_MESSAGE_BYTES + 1), forged_block_size):
            sender.sendto(data, target)
        await eventually(lambda: b.counts.get("malformed", 0) >= 6, timeout_s=5)
        await eventually(lambda: b.counts.get("received", 0) >= 1, timeout_s=5)
    finally:
        sender.close()
    assert b.counts["malformed"] == 6
    # the one well-formed message with a block size the worker does not have records nothing
    assert held(b.index, tokens(9, 320)) == 0
    # and the socket still works
    ids = tokens(10, 700)
    a.index.record_routed(W1, ids, BLOCK)
    await eventually(lambda: held(b.index, ids) > 0, timeout_s=5)


def test_a_message_whose_segments_expand_far_is_recorded_only_up_to_the_bound(
    runtime_dir: Path,
) -> None:
    """Segments continue earlier blocks, so a message of a few thousand blocks can name
    chains of millions: what one message makes a sibling record is bounded, over all its
    sections."""
    b = SiblingRoutes(make_index(), runtime_dir, 1, 2)
    base = block_hashes(tokens(14, 100 * BLOCK), BLOCK)
    # per section: a 100-block chain, then 400 one-block chains continuing its last block
    segments: list[tuple[int | None, list[int]]] = [(None, base)]
    segments += [(base[-1], [10_000_000 + k]) for k in range(400)]
    data = encode(KIND_ROUTES, b"x" * 8, b"x" * 8,
                  [SectionOut(W1, BLOCK, None, segments) for _ in range(12)])
    assert len(data) <= MAX_MESSAGE_BYTES
    counting = b.index.index
    assert isinstance(counting, CountingIndex)
    b.receive(data)
    assert b.counts == {"received": 1}
    recorded = sum(counting.recorded)
    assert MAX_RECEIVED_BLOCKS - 101 <= recorded <= MAX_RECEIVED_BLOCKS  # 12 x 40,500 named


@pytest.mark.asyncio(loop_scope="function")
async def test_close_unbinds_and_stops_listening(runtime_dir: Path) -> None:
    a = SiblingRoutes(make_index(), runtime_dir, 0, 2)
    a.start()
    assert a.path.exists() and a.index.on_routed == a.on_routed
    a.close()
    a.close()  # idempotent
    assert not a.path.exists() and a.index.on_routed is None
    a.index.record_routed(W1, tokens(11, 700), BLOCK)  # nobody to tell: nothing queued
    assert not a._queue
    # a restarted process binds the same path again
    again = SiblingRoutes(make_index(), runtime_dir, 0, 2)
    again.start()
    again.close()
