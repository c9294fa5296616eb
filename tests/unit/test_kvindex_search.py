"""BlockIndex's prefix search (issue 15): per worker, O(log n) lookups instead of a walk along the
chain, with exactly the linear walk's answer (blocks held before the first miss, and how many of
those are pending) in every index state: holes left by removed or evicted middle blocks, TTL
expiries, event segments with and without a held parent, both tentative sources.

The reference below is the walk ``match_prefix_pending`` did before the search (kept verbatim as
``index._walk``, the fallback): each block in order until the first one not held or expired."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.kvindex.events import BlockStored, EventApplier, adapter_root
from gateway.kvindex.hashing import BlockHash, block_hashes
from gateway.kvindex.index import (
    _CONFIRMED,
    CONFIRMED_CHILD,
    LEARNED,
    SPECULATIVE,
    BlockIndex,
    Source,
    _Positions,
    _search,
    _Stamp,
    _WorkerBlocks,
)
from tests.clock import ManualClock

SPEC_TTL_S, LEARNED_TTL_S = 5.0, 60.0
WORKERS = ("a", "b")


def walk(index: BlockIndex, hashes: Sequence[BlockHash], worker: str,
         clock: ManualClock) -> tuple[int, int]:
    """The reference: the linear walk, written out here on the index's entries."""
    w = index._workers.get(worker)
    if w is None:
        return 0, 0
    now = clock()
    recent_learned = now + LEARNED_TTL_S - SPEC_TTL_S
    matched = pending = 0
    for h in hashes:
        e = w.entries.get(h)
        if e is None or e.expires_at <= now:
            break
        matched += 1
        if e.source == SPECULATIVE or (e.source == LEARNED and e.expires_at > recent_learned):
            pending += 1
    return matched, pending


def check_structure(w: _WorkerBlocks) -> None:
    """The invariants the search relies on, recomputed from scratch."""
    if w.walk:
        return
    held = w.entries
    assert not (w.ghosts & held.keys())
    assert w.unanchored <= w.ghosts
    nodes = held.keys() | w.ghosts
    assert set(w.parent) <= nodes
    kids = Counter(w.parent[x] for x in nodes if x in w.parent)
    ckids = Counter(w.parent[x] for x in held if x in w.parent and held[x] is _CONFIRMED)
    assert w.kids == Counter({p: kids[p] + CONFIRMED_CHILD * ckids[p] for p in kids})
    assert all(kids[g] > 0 for g in w.ghosts)
    violations = sum(1 for p, s in held.items() if s is not _CONFIRMED and ckids[p] > 0)
    assert w.violations == violations
    for x in held:  # every block before a held one is held or a ghost, up to an unanchored one
        while x in w.parent and x not in w.unanchored:
            x = w.parent[x]
            assert x in nodes


# A small alphabet and one token per block: prompts share prefixes, so chains branch.
prompts = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=10), min_size=1, max_size=6)
op = st.tuples(
    st.sampled_from(["route"] * 6 + ["store"] * 6 + ["remove"] * 3 + ["expire"] * 3
                    + ["events"] * 2 + ["capacity", "clear"]),
    st.integers(0, 5),  # prompt
    st.integers(0, 10),  # segment start / blocks to remove
    st.integers(0, 10),  # segment length
    st.sampled_from(WORKERS),
    st.floats(0.0, 70.0),
)


random_index_states = given(prompts, st.lists(op, min_size=10, max_size=60), st.integers(4, 40))
"""Prompts, a run of operations on the index over them, and a capacity per worker."""


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          derandomize=True)
@random_index_states
def test_search_equals_the_linear_walk_in_random_index_states(
    tokens: list[list[int]], ops: list[tuple[str, int, int, int, str, float]], capacity: int
) -> None:
    clock = ManualClock(1000.0)
    index = BlockIndex(clock=clock, speculative_ttl_s=SPEC_TTL_S, learned_ttl_s=LEARNED_TTL_S)
    for worker in WORKERS:
        index.set_capacity(worker, capacity)
    chains = [block_hashes(t, 1) for t in tokens]
    for kind, p, a, b, worker, dt in ops:
        chain = chains[p % len(chains)]
        if kind == "route":
            index.record_routed(worker, chain)
        elif kind == "store":  # an event: a segment of the chain after its parent block
            start = min(a, len(chain) - 1)
            segment = chain[start : start + 1 + b]
            index.apply_stored(worker, segment, chain[start - 1] if start else None)
        elif kind == "remove":  # any blocks, middle ones included
            index.apply_removed(worker, chain[a % len(chain) :: 1 + b % 3])
        elif kind == "expire":
            clock.advance(dt)
        elif kind == "events":
            index.set_events(worker, not index._worker(worker).events)
        elif kind == "clear":
            index.clear_worker(worker)
        else:
            index.set_capacity(worker, max(2, capacity - a))
        for w in index._workers.values():
            check_structure(w)
        for query in chains:
            expected = {wk: walk(index, query, wk, clock) for wk in WORKERS}
            assert index.match_prefix_pending(query, WORKERS) == expected
            assert index.match_prefix(query, WORKERS) == {k: v[0] for k, v in expected.items()}


def searched(index: BlockIndex, worker: str, hashes: Sequence[BlockHash]
             ) -> tuple[int, int] | None:
    """The search alone (``None``: it would fall back to the walk)."""
    now = index._clock()
    return _search(index._workers[worker], hashes, now + LEARNED_TTL_S - SPEC_TTL_S,
                   _Positions(hashes))


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(1000.0)


@pytest.fixture
def index(clock: ManualClock) -> BlockIndex:
    return BlockIndex(clock=clock, speculative_ttl_s=SPEC_TTL_S, learned_ttl_s=LEARNED_TTL_S)


CHAIN = block_hashes(list(range(64)), 1)


def test_a_removed_middle_block_stops_the_match_there_without_a_walk(index: BlockIndex) -> None:
    index.apply_stored("a", CHAIN)
    index.apply_removed("a", [CHAIN[20]])
    assert index._workers["a"].ghosts == {CHAIN[20]}
    assert searched(index, "a", CHAIN) == (20, 0)
    assert index.match_prefix(CHAIN, ["a"]) == {"a": 20}
    index.apply_stored("a", [CHAIN[20]], CHAIN[19])  # stored again: the whole chain is back
    assert searched(index, "a", CHAIN) == (64, 0)
    assert not index._workers["a"].ghosts


def test_ghosts_go_when_their_last_descendant_goes(index: BlockIndex) -> None:
    """A hole is remembered only while a block after it is held: the memory stays bounded."""
    index.apply_stored("a", CHAIN)
    index.apply_removed("a", CHAIN[10:20])
    assert index._workers["a"].ghosts == set(CHAIN[10:20])
    index.apply_removed("a", CHAIN[20:])
    w = index._workers["a"]
    assert not w.ghosts and not (set(w.parent) - set(CHAIN[:10]))
    assert searched(index, "a", CHAIN) == (10, 0)


def test_an_evicted_chain_start_leaves_the_rest_unmatched_as_the_walk_does(
    index: BlockIndex,
) -> None:
    index.set_capacity("a", 40)
    index.set_events("a", True)
    index.record_routed("a", CHAIN[:32])
    # a later segment's event: CHAIN[8:32] more recently used than CHAIN[:8]
    index.apply_stored("a", CHAIN[8:32], CHAIN[7])
    other = block_hashes([99] * 16, 1)
    index.record_routed("a", other)  # evicts CHAIN[:8], the LRU front
    assert index._workers["a"].ghosts == set(CHAIN[:8])
    assert searched(index, "a", CHAIN) == (0, 0)
    index.apply_removed("a", other)
    index.record_routed("a", CHAIN[:8])  # routed again: CHAIN[8:32] counts once more
    assert searched(index, "a", CHAIN) == (32, 8)
    assert not index._workers["a"].ghosts


def test_pending_counts_tentative_blocks_after_the_confirmed_ones(
    index: BlockIndex, clock: ManualClock
) -> None:
    index.set_events("a", True)
    index.record_routed("a", CHAIN[:40])
    index.apply_stored("a", CHAIN[:16])
    assert searched(index, "a", CHAIN) == (40, 24)
    clock.advance(SPEC_TTL_S)  # the speculative blocks expire
    assert index.match_prefix_pending(CHAIN, ["a"]) == {"a": (16, 0)}


def test_learned_blocks_are_pending_only_when_routed_recently(
    index: BlockIndex, clock: ManualClock
) -> None:
    index.record_routed("a", CHAIN[:40])
    clock.advance(SPEC_TTL_S + 1)
    index.record_routed("a", CHAIN[:10])  # refreshes the first 10 only
    assert searched(index, "a", CHAIN) == (40, 10)


def test_a_segment_whose_parent_is_not_held_is_walked(index: BlockIndex) -> None:
    """Its blocks are held, but what lies before its parent is unknown: the search cannot vouch
    for the blocks before it, so that worker's answer comes from the walk."""
    index.apply_stored("a", CHAIN[:10])
    index.apply_stored("a", CHAIN[20:30], CHAIN[19])
    assert index._workers["a"].unanchored == {CHAIN[19]}
    assert searched(index, "a", CHAIN[:30]) is None
    assert index.match_prefix(CHAIN[:30], ["a"]) == {"a": 10}
    assert searched(index, "a", CHAIN[:10]) == (10, 0)  # not on the way: searched


def test_a_query_that_is_not_the_indexs_chain_is_walked(index: BlockIndex) -> None:
    """Keys are chained hashes, so a held block fixes every block before it; a list that puts a
    held block elsewhere is no chain the index knows, and gets the walk's answer."""
    index.apply_stored("a", [1, 2, 3, 5])
    assert searched(index, "a", [1, 2, 3, 4, 5]) is None
    assert index.match_prefix([1, 2, 3, 4, 5], ["a"]) == {"a": 3}
    assert searched(index, "a", [2, 3]) is None  # 2 is held after 1, not at a chain's start
    assert index.match_prefix([2, 3], ["a"]) == {"a": 2}


def test_thirty_two_k_tokens_held_by_every_worker_take_a_few_lookups_each(
    index: BlockIndex,
) -> None:
    """The issue's case: 2,048 blocks held by 16 workers. Counted lookups, not time: the walk
    made 2,048 per worker."""
    chain = block_hashes(list(range(32_768)), 16)
    workers = [f"w{i}" for i in range(16)]
    for w in workers:
        index.apply_stored(w, chain)
    lookups = 0

    class Counting(dict[BlockHash, object]):
        def get(self, key: BlockHash, default: object = None) -> object:
            nonlocal lookups
            lookups += 1
            return super().get(key, default)

    for w in workers:
        entries = index._workers[w].entries
        counting = Counting(entries)
        assert _search_with(index, w, chain, counting) == (2048, 0)
    assert lookups <= 16 * 4


def _search_with(index: BlockIndex, worker: str, hashes: Sequence[BlockHash],
                 entries: dict[BlockHash, object]) -> tuple[int, int] | None:
    w = index._workers[worker]
    saved = w.entries
    w.entries = entries  # type: ignore[assignment]
    try:
        return searched(index, worker, hashes)
    finally:
        w.entries = saved


def test_events_storing_a_chain_in_segments_keep_it_searchable(index: BlockIndex) -> None:
    """vLLM stores a prompt's blocks in several ``BlockStored`` events, each after its parent;
    the applier passes that parent on, so the chain stays one chain (searched, not walked), and
    an adapter's chain starts at its first block like any other."""
    applier = EventApplier("a", index, 4)
    tokens = list(range(48))
    applier.apply([
        BlockStored((901, 902), None, tuple(tokens[:8]), 4),
        BlockStored((903, 904, 905), 902, tuple(tokens[8:20]), 4),
    ])
    ours = block_hashes(tokens, 4)
    w = index._workers["a"]
    assert not w.ghosts and not w.unanchored
    assert searched(index, "a", ours) == (5, 0)
    applier.apply([BlockStored((911,), None, tuple(tokens[:4]), 4, lora_name="sql")])
    lora = block_hashes(tokens[:4], 4, adapter_root("sql"))
    assert not w.unanchored
    assert searched(index, "a", lora) == (1, 0)


class _Counted(BlockIndex):
    """``record_routed``'s refresh in place counted (``refresh=True``) or turned off."""

    def __init__(self, clock: ManualClock, refresh: bool) -> None:
        super().__init__(clock=clock, speculative_ttl_s=SPEC_TTL_S, learned_ttl_s=LEARNED_TTL_S)
        self.refresh = refresh
        self.calls = self.refreshed = 0

    def _refreshed(self, w: _WorkerBlocks, hashes: Sequence[BlockHash], source: Source,
                   stamp: _Stamp) -> bool:
        self.calls += 1
        done = self.refresh and super()._refreshed(w, hashes, source, stamp)
        self.refreshed += done
        return done


def _state(index: BlockIndex) -> dict[str, object]:
    """Everything ``record_routed`` changes, per worker: LRU order with each entry's source and
    expiry, every queue in order, and the chain structure."""
    return {name: ([(h, s.source, s.expires_at) for h, s in w.entries.items()],
                   {src: list(q) for src, q in w.queues.items()},
                   dict(w.parent), Counter(w.kids), set(w.ghosts), set(w.unanchored),
                   w.violations)
            for name, w in index._workers.items()}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          derandomize=True)
@random_index_states
def test_a_route_refreshed_in_place_leaves_the_state_the_general_path_leaves(
    tokens: list[list[int]], ops: list[tuple[str, int, int, int, str, float]], capacity: int
) -> None:
    """A prompt routed again to the worker that holds it tentatively from the same source (no
    events confirmed it) is refreshed in place (``BlockIndex._refreshed``): same LRU and queue
    order, same stamps, same chains as popping and reinserting every block, in random index
    states; and it is taken exactly when that holds."""
    clock = ManualClock(1000.0)
    fast, general = _Counted(clock, refresh=True), _Counted(clock, refresh=False)
    chains = [block_hashes(t, 1) for t in tokens]
    expected_refreshes = 0
    for index in (fast, general):
        for worker in WORKERS:
            index.set_capacity(worker, capacity)
    for kind, p, a, b, worker, dt in ops:
        chain = chains[p % len(chains)]
        if kind == "route":
            w = fast._worker(worker)
            source = SPECULATIVE if w.events else LEARNED
            stamps = [w.entries.get(h) for h in chain]
            expected_refreshes += bool(chain) and len(set(chain)) == len(chain) and all(
                s is not None and s is not _CONFIRMED and s.source == source for s in stamps)
        for index in (fast, general):
            if kind == "route":
                index.record_routed(worker, chain)
            elif kind == "store":
                start = min(a, len(chain) - 1)
                index.apply_stored(worker, chain[start : start + 1 + b],
                                   chain[start - 1] if start else None)
            elif kind == "remove":
                index.apply_removed(worker, chain[a % len(chain) :: 1 + b % 3])
            elif kind == "events":
                index.set_events(worker, not index._worker(worker).events)
            elif kind == "clear":
                index.clear_worker(worker)
            elif kind == "capacity":
                index.set_capacity(worker, max(2, capacity - a))
        if kind == "expire":
            clock.advance(dt)
        assert _state(fast) == _state(general)
    assert fast.refreshed == expected_refreshes
    assert general.refreshed == 0 and general.calls == fast.calls


def test_a_prompt_routed_again_without_events_is_refreshed_in_place(clock: ManualClock) -> None:
    """The case the refresh is for, spelled out: learned blocks routed again get the new expiry
    and move to the recently-used end, last block first, in the LRU and in their queue."""
    index = BlockIndex(clock=clock, speculative_ttl_s=SPEC_TTL_S, learned_ttl_s=LEARNED_TTL_S)
    index.record_routed("a", [1, 2])
    index.record_routed("a", [7])
    clock.advance(3.0)
    index.record_routed("a", [1, 2])
    w = index._workers["a"]
    assert list(w.entries) == [7, 2, 1]
    assert list(w.queues["learned"]) == [7, 2, 1]
    assert {h: s.expires_at for h, s in w.entries.items()} == {
        7: 1000.0 + LEARNED_TTL_S, 2: 1003.0 + LEARNED_TTL_S, 1: 1003.0 + LEARNED_TTL_S}
    clock.advance(LEARNED_TTL_S - 1.0)  # 7 is due, 1 and 2 are not
    index.record_routed("a", [9])
    assert list(w.entries) == [2, 1, 9]
