"""The replica exchange's pure parts (``gateway.kvindex.exchange``): the wire format and its
compaction, what a receiver does with routes, load and hostile bytes, the publish batch and its
byte cap, and the snapshot (``BlockIndex.export_chains`` -> ``apply_snapshot``) rebuilding an
index that answers every prefix as the exporter's did, with the search's structure intact.
Redis is not involved here (``tests/integration/test_replica_exchange_sim.py`` is)."""

from __future__ import annotations

import contextlib
import random
import struct

import pytest

from gateway.config import ReplicaSettings
from gateway.kvindex.exchange import (
    KIND_ROUTES,
    KIND_SNAPSHOT,
    MAX_PEERS,
    NO_PARENT,
    MalformedMessage,
    ReplicaExchange,
    SectionOut,
    compact,
    decode,
    encode,
)
from gateway.kvindex.hashing import BlockHash, block_hashes
from gateway.kvindex.index import BlockIndex
from gateway.kvindex.service import PrefixIndex
from gateway.workers.worker import Worker
from tests.clock import ManualClock
from tests.harness import CountingIndex
from tests.unit.test_kvindex_search import check_structure

W1, W2 = "http://w1:8000", "http://w2:8000"
BLOCK = 16


def chain(seed: int, blocks: int, prefix: list[int] | None = None) -> list[BlockHash]:
    tokens = (prefix or []) + [seed * 1000 + i for i in range(blocks * BLOCK)]
    return block_hashes(tokens, BLOCK)


def prefix_tokens(seed: int, blocks: int) -> list[int]:
    return [seed * 1000 + i for i in range(blocks * BLOCK)]


def replica(clock: ManualClock | None = None, events: bool = False, **settings: object
            ) -> ReplicaExchange:
    index = PrefixIndex(CountingIndex(clock=clock or ManualClock()))
    for w in (W1, W2):
        index.set_worker(w, BLOCK, None, None)
        index.index.set_events(w, events)
    return ReplicaExchange(ReplicaSettings(**settings), "redis://unused:1/0", index,  # type: ignore[arg-type]
                           clock=clock or ManualClock())


def bi(r: ReplicaExchange) -> BlockIndex:
    assert r.index is not None
    return r.index.index


def routes_message(sender: ReplicaExchange, routes: list[tuple[str, list[BlockHash]]]) -> bytes:
    for url, hashes in routes:
        sender.on_routed(url, BLOCK, hashes)
    data = sender.next_message()
    assert data is not None
    return data


# --- the wire format ---------------------------------------------------------------------------


def test_a_burst_of_one_prefix_costs_the_prefix_once_and_each_tail() -> None:
    shared = prefix_tokens(7, 64)
    burst = [block_hashes(shared + prefix_tokens(100 + i, 2), BLOCK) for i in range(10)]

    segments = compact(burst)
    data = encode(KIND_ROUTES, b"g" * 8, b"s" * 8, [SectionOut(W1, BLOCK, None, segments)])

    assert len(data) < 8 * (64 + 10 * 2) + 200  # not 10 x 66 blocks
    (section,) = decode(data).sections
    assert list(section.chains()) == burst


def test_identical_routes_repeat_as_empty_segments_and_decode_whole() -> None:
    route = chain(1, 8)

    segments = compact([route, route])
    msg = decode(encode(KIND_ROUTES, b"g" * 8, b"s" * 8, [SectionOut(W1, BLOCK, (3, 9), segments)]))

    assert segments[1] == (route[-1], [])
    assert list(msg.sections[0].chains()) == [route, route]
    assert msg.sections[0].load == (3, 9)


def test_decode_refuses_a_segment_that_continues_a_block_given_after_it() -> None:
    head = struct.pack("<2sBB8s8sH", b"KX", 1, KIND_ROUTES, b"g" * 8, b"s" * 8, 1)
    url = W1.encode()
    body = struct.pack("<HHB", len(url), BLOCK, 0) + url + struct.pack("<I", 1)
    body += struct.pack("<II", 0, 1) + struct.pack("<Q", 5)  # parent 0 is itself

    with pytest.raises(MalformedMessage):
        decode(head + body)


@pytest.mark.parametrize("cut", [0, 1, 5, 20, 27, 40, -9, -1])
def test_a_truncated_message_is_malformed_not_an_exception(cut: int) -> None:
    data = encode(KIND_ROUTES, b"g" * 8, b"s" * 8,
                  [SectionOut(W1, BLOCK, (1, 2), compact([chain(1, 4), chain(2, 3)]))])

    with pytest.raises(MalformedMessage):
        decode(data[:cut])


def test_random_bytes_and_flipped_bytes_only_ever_raise_malformed() -> None:
    rng = random.Random(15)
    good = encode(KIND_ROUTES, b"g" * 8, b"s" * 8,
                  [SectionOut(W1, BLOCK, (1, 2), compact([chain(1, 4), chain(2, 3)]))])
    for _ in range(3000):
        if rng.random() < 0.5:
            data = rng.randbytes(rng.randrange(0, 200))
        else:
            b = bytearray(good)
            for _ in range(rng.randrange(1, 4)):
                b[rng.randrange(len(b))] = rng.randrange(256)
            data = bytes(b)
        with contextlib.suppress(MalformedMessage):
            decode(data)


# --- receiving ---------------------------------------------------------------------------------


def test_a_peers_route_makes_the_receiver_match_the_prefix_at_the_same_worker() -> None:
    a, b = replica(), replica()
    route = chain(3, 32)

    b.receive(routes_message(a, [(W2, route)]))

    held = bi(b).match_prefix_pending(route, [W1, W2])
    assert held == {W1: (0, 0), W2: (32, 32)}
    assert b.counts == {"received": 1}


def test_with_events_the_peer_route_is_speculative_and_a_confirmed_route_is_not_sent() -> None:
    a, b = replica(events=True), replica(events=True)
    new, known = chain(4, 8), chain(5, 8)
    bi(a).apply_stored(W1, known)
    a.on_routed(W1, BLOCK, known)  # every block confirmed: the peers know it from the events

    data = routes_message(a, [(W1, new)])
    b.receive(data)

    (section,) = decode(data).sections
    assert list(section.chains()) == [new]
    assert bi(b).stats()[W1].speculative == 8


def test_own_messages_are_ignored() -> None:
    a = replica()

    a.receive(routes_message(a, [(W1, chain(6, 4))]))

    assert a.counts == {"own": 1}


def test_routes_for_unknown_workers_or_another_block_size_are_not_recorded() -> None:
    a, b = replica(), replica()
    data = encode(KIND_ROUTES, a.gateway_id, a.sender_id, [
        SectionOut("http://elsewhere:1", BLOCK, None, compact([chain(1, 4)])),
        SectionOut(W1, 32, None, compact([chain(2, 4)]))])

    b.receive(data)

    assert all(s.total == 0 for s in bi(b).stats().values())
    assert b.counts == {"received": 1}


def test_hostile_bytes_on_the_channel_are_counted_and_change_nothing() -> None:
    b = replica()
    rng = random.Random(3)

    for _ in range(200):
        b.receive(rng.randbytes(rng.randrange(1, 300)))
    b.receive(b"x" * (b.settings.max_message_bytes + 1))
    b.receive(encode(KIND_SNAPSHOT, b"p" * 8, b"q" * 8, []))  # a snapshot is not a route

    assert b.counts == {"malformed": 202}
    assert all(s.total == 0 for s in bi(b).stats().values())


def test_a_forged_message_naming_one_long_chain_many_times_is_cut_at_the_byte_cap() -> None:
    """A message of one 8K-block chain and 100,000 empty segments pointing at its end would
    have the receiver record 800M blocks (minutes of a stalled loop); it records at most what
    max_bytes_per_s lets an honest sender ask for."""
    b = replica(max_bytes_per_s=1 << 20)
    long = chain(9, 8192)
    url = W1.encode()
    parts = [struct.pack("<2sBB8s8sH", b"KX", 1, KIND_ROUTES, b"g" * 8, b"s" * 8, 1),
             struct.pack("<HHB", len(url), BLOCK, 0), url, struct.pack("<I", 100_001),
             struct.pack("<II", NO_PARENT, len(long)), struct.pack(f"<{len(long)}Q", *long)]
    parts += [struct.pack("<II", len(long) - 1, 0)] * 100_000
    counting = bi(b)
    assert isinstance(counting, CountingIndex)

    b.receive(b"".join(parts))

    assert 8192 <= sum(counting.recorded) <= (1 << 20) // 8


def test_peer_load_adds_to_the_workers_load_and_goes_when_the_peer_goes_quiet() -> None:
    clock = ManualClock()
    a, b = replica(clock), replica(clock, peer_timeout_s=2.0)
    wa, wb = Worker(url=W1, pool="p"), Worker(url=W1, pool="p")
    a.attach(wa)
    b.attach(wb)
    wa.inflight, wa.inflight_prompt_tokens = 3, 4000
    wb.inflight = 1

    b.receive(a.next_message() or b"")

    assert (wb.gateway_inflight, wb.gateway_inflight_prompt_tokens) == (4, 4000)
    assert wb.inflight == 1  # its own count is untouched, and is what it publishes
    assert b.peers == 1
    clock.advance(2.5)
    b.expire_peers()
    assert (wb.gateway_inflight, wb.gateway_inflight_prompt_tokens) == (1, 0)
    assert b.peers == 0


def test_load_is_published_when_it_changes_and_as_a_heartbeat_otherwise() -> None:
    clock = ManualClock()
    a = replica(clock, heartbeat_s=1.0)
    w = Worker(url=W1, pool="p")
    a.attach(w)

    first = a.next_message()
    unchanged = a.next_message()
    w.inflight = 2
    changed = a.next_message()
    clock.advance(1.1)
    heartbeat = a.next_message()

    assert first is not None and unchanged is None
    assert changed is not None and decode(changed).sections[0].load == (2, 0)
    assert heartbeat is not None


def test_a_follower_process_publishes_routes_but_not_load() -> None:
    index = PrefixIndex(BlockIndex())
    index.set_worker(W1, BLOCK, None, None)
    follower = ReplicaExchange(ReplicaSettings(), "redis://unused:1/0", index, leader=False)
    follower.attach(Worker(url=W1, pool="p"))

    assert follower.next_message() is None
    follower.on_routed(W1, BLOCK, chain(1, 2))
    msg = decode(follower.next_message() or b"")
    assert [s.load for s in msg.sections] == [None]


def test_peers_beyond_the_bound_are_not_kept() -> None:
    b = replica()
    b.attach(Worker(url=W1, pool="p"))

    for i in range(MAX_PEERS + 50):
        gid = i.to_bytes(8, "little")
        b.receive(encode(KIND_ROUTES, gid, gid, [SectionOut(W1, 1, (1, 1), ())]))

    assert b.peers == MAX_PEERS
    assert b.peer_load(W1) == (MAX_PEERS, MAX_PEERS)


def test_routes_over_the_byte_cap_are_dropped_and_counted() -> None:
    a = replica(max_bytes_per_s=20_000, interval_s=0.025)  # 500 bytes per interval
    for i in range(20):
        a.on_routed(W1, BLOCK, chain(i, 32))  # 256 bytes each

    data = a.next_message()

    assert data is not None and len(decode(data).sections[0].segments) <= 2
    assert a.counts["dropped"] >= 18


# --- snapshots ---------------------------------------------------------------------------------


def test_a_snapshot_rebuilds_an_index_that_matches_every_prefix_as_the_exporters_did() -> None:
    clock = ManualClock()
    a, fresh = replica(clock), replica(clock)
    shared = prefix_tokens(1, 40)
    routes = [block_hashes(shared + prefix_tokens(50 + i, 3), BLOCK) for i in range(12)]
    routes += [chain(200 + i, 5 + i) for i in range(6)]
    rng = random.Random(5)
    for r in rng.sample(routes, len(routes)):
        bi(a).record_routed(rng.choice([W1, W2]), r)
    bi(a).apply_removed(W1, [routes[0][10]])  # a ghost: below it nothing matches

    blocks = fresh.apply_snapshot(a.snapshot())

    assert blocks > 0
    for r in routes:
        assert (bi(fresh).match_prefix(r, [W1, W2])
                == bi(a).match_prefix(r, [W1, W2])), r[:2]
    for w in bi(fresh)._workers.values():
        check_structure(w)


def test_a_snapshot_keeps_the_most_recent_blocks_within_its_cap() -> None:
    a, fresh = replica(snapshot_max_blocks=20), replica()
    old, recent = chain(1, 30), chain(2, 20)
    bi(a).record_routed(W1, old)
    bi(a).record_routed(W1, recent)

    fresh.apply_snapshot(a.snapshot())

    assert bi(fresh).match_prefix(recent, [W1]) == {W1: 20}
    assert bi(fresh).match_prefix(old, [W1]) == {W1: 0}


def test_a_routes_message_is_not_a_snapshot() -> None:
    a, b = replica(), replica()

    with pytest.raises(MalformedMessage):
        b.apply_snapshot(routes_message(a, [(W1, chain(1, 3))]))


def test_a_routed_chain_is_exported_as_one_segment() -> None:
    """A call touches its blocks last to first (the index's LRU order), so the most recently
    used block of a route is its first: each later block continues the segment before it."""
    a = replica()
    long, other = chain(1, 3000), chain(2, 40)
    bi(a).record_routed(W1, other)
    bi(a).record_routed(W1, long)
    assert bi(a).export_chains(W1, 10_000) == [(None, long), (None, other)]
    assert bi(a).export_chains(W1, 100) == [(None, long[:100])]
