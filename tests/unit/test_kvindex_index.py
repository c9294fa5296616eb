"""BlockIndex: prefix matching, the LRU bound, and the three entry sources."""

from __future__ import annotations

import random
from collections import Counter, OrderedDict

import pytest

from gateway.kvindex.index import _SHORT, BlockIndex, _count, _tally
from tests.clock import ManualClock


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(1000.0)


def make(clock: ManualClock) -> BlockIndex:
    return BlockIndex(clock=clock, speculative_ttl_s=5.0, learned_ttl_s=60.0)


def test_match_prefix_counts_leading_blocks_and_stops_at_first_miss(clock: ManualClock) -> None:
    index = make(clock)
    index.apply_stored("a", [1, 2, 3, 5])  # holds 1,2,3 and 5 but not 4
    index.apply_stored("b", [1])
    assert index.match_prefix([1, 2, 3, 4, 5], ["a", "b"]) == {"a": 3, "b": 1}


def test_match_prefix_gives_zero_for_unknown_workers_and_empty_prompts(clock: ManualClock) -> None:
    index = make(clock)
    index.apply_stored("a", [1, 2])
    assert index.match_prefix([1, 2], ["nobody"]) == {"nobody": 0}
    assert index.match_prefix([], ["a"]) == {"a": 0}
    assert index.match_prefix([9, 1, 2], ["a"]) == {"a": 0}


def test_lru_bound_holds_when_inserting_far_more_than_capacity(clock: ManualClock) -> None:
    index = make(clock)
    index.set_capacity("ev", 100)
    index.set_events("ev", True)
    index.set_capacity("approx", 100)
    for i in range(0, 100_000, 50):
        index.apply_stored("ev", range(i, i + 50))
        index.record_routed("ev", range(10**6 + i, 10**6 + i + 50))
        index.record_routed("approx", range(i, i + 50))
        index.record_routed("approx", range(i, i + 50))  # refreshes restart TTLs too
    stats = index.stats()
    assert stats["ev"].total == 100
    assert stats["approx"].total == 100
    # sources are counted from the TTL queues: a queue that kept evicted blocks would show here
    assert stats["ev"].confirmed >= 0 and stats["ev"].speculative <= 100
    assert stats["approx"].learned == 100
    # the newest blocks survived
    assert index.match_prefix(range(99_950, 100_000), ["approx"]) == {"approx": 50}


def test_unknown_capacity_uses_the_default(clock: ManualClock) -> None:
    index = BlockIndex(clock=clock, default_capacity_blocks=10)
    index.apply_stored("a", range(1000))
    assert index.stats()["a"].total == 10
    assert index.stats()["a"].capacity_blocks == 10


def test_lru_evicts_the_least_recently_routed_block_first(clock: ManualClock) -> None:
    index = make(clock)
    index.set_capacity("a", 3)
    index.apply_stored("a", [1, 2, 3])  # LRU order 3, 2, 1: a call touches its tail first
    index.record_routed("a", [3])  # 3 is now the most recently used
    index.apply_stored("a", [4])
    assert index.holders(2) == set()
    assert index.holders(1) == {"a"}
    assert index.match_prefix([3, 4], ["a"]) == {"a": 2}


def test_capacity_evicts_a_chains_tail_first_and_its_prefix_still_matches(
    clock: ManualClock,
) -> None:
    """vLLM frees a request's blocks tail first, so its prefix outlives its tail; the index
    does the same: evicting part of an old route leaves a prefix the next request hits, and
    makes no ghost (the structure an evicted chain start would leave behind)."""
    index = make(clock)
    index.set_capacity("a", 10)
    index.record_routed("a", range(100, 108))
    index.record_routed("a", range(200, 206))  # 14 blocks: the first route loses 4
    assert index.match_prefix(range(100, 108), ["a"]) == {"a": 4}
    assert index.match_prefix(range(200, 206), ["a"]) == {"a": 6}
    assert not index._workers["a"].ghosts
    index.record_routed("a", [100])  # its prefix's head touched again: the rest goes first
    index.apply_stored("a", range(300, 305))
    assert index.match_prefix(range(100, 108), ["a"]) == {"a": 1}
    assert not index._workers["a"].ghosts


def test_match_prefix_does_not_refresh_lru_positions(clock: ManualClock) -> None:
    index = make(clock)
    index.set_capacity("a", 2)
    index.apply_stored("a", [1])
    index.apply_stored("a", [2])
    index.match_prefix([1], ["a"])
    index.apply_stored("a", [3])
    assert index.holders(1) == set()


def test_shrinking_capacity_evicts_at_once(clock: ManualClock) -> None:
    index = make(clock)
    index.apply_stored("a", range(10))
    index.set_capacity("a", 4)
    assert index.stats()["a"].total == 4
    assert index.match_prefix([0, 1, 2, 3], ["a"]) == {"a": 4}  # the tail went first


def test_speculative_entry_expires_after_ttl(clock: ManualClock) -> None:
    index = make(clock)
    index.set_events("a", True)
    index.record_routed("a", [1, 2])
    assert index.stats()["a"].speculative == 2
    clock.now += 4.9
    assert index.match_prefix([1, 2], ["a"]) == {"a": 2}
    clock.now += 0.2
    assert index.match_prefix([1, 2], ["a"]) == {"a": 0}
    assert index.stats()["a"].total == 0


def test_confirmed_entry_survives_ttl(clock: ManualClock) -> None:
    index = make(clock)
    index.set_events("a", True)
    index.record_routed("a", [1, 2, 3])
    index.apply_stored("a", [1, 2])  # events confirm the first two blocks
    clock.now += 3600
    assert index.match_prefix([1, 2, 3], ["a"]) == {"a": 2}
    assert index.stats()["a"].confirmed == 2
    assert index.stats()["a"].speculative == 0


def test_routing_to_a_confirmed_block_keeps_it_confirmed(clock: ManualClock) -> None:
    index = make(clock)
    index.set_events("a", True)
    index.apply_stored("a", [1])
    index.record_routed("a", [1])
    clock.now += 3600
    assert index.match_prefix([1], ["a"]) == {"a": 1}


def test_learned_entries_expire_unless_routed_again(clock: ManualClock) -> None:
    index = make(clock)
    index.record_routed("a", [1, 2])  # no events: learned
    assert index.stats()["a"].learned == 2
    clock.now += 50
    index.record_routed("a", [1])  # refreshes block 1 only
    clock.now += 20
    assert index.holders(1) == {"a"}
    assert index.holders(2) == set()
    clock.now += 60
    assert index.match_prefix([1], ["a"]) == {"a": 0}


def test_removed_blocks_leave_whatever_their_source(clock: ManualClock) -> None:
    index = make(clock)
    index.set_events("a", True)
    index.apply_stored("a", [1, 2])
    index.record_routed("a", [1, 2, 3])
    index.apply_removed("a", [2, 3, 42])
    assert index.match_prefix([1, 2, 3], ["a"]) == {"a": 1}
    assert index.stats()["a"].total == 1
    index.apply_removed("never-seen", [1])  # harmless


def test_clear_worker_drops_entries_but_keeps_capacity_and_mode(clock: ManualClock) -> None:
    index = make(clock)
    index.set_capacity("a", 7)
    index.set_events("a", True)
    index.apply_stored("a", [1, 2])
    index.apply_stored("b", [1, 2])
    index.clear_worker("a")
    stats = index.stats()
    assert stats["a"].total == 0 and stats["a"].capacity_blocks == 7 and stats["a"].events
    assert index.holders(1) == {"b"}


def test_stale_ttl_records_do_not_expire_refreshed_entries(clock: ManualClock) -> None:
    """Regression: a TTL record from before a refresh must not delete the refreshed entry."""
    index = make(clock)
    index.set_events("a", True)
    index.record_routed("a", [1])
    clock.now += 4
    index.record_routed("a", [1])
    clock.now += 2  # the first record is due, the entry is not
    index.record_routed("a", [99])  # triggers reclaim
    assert index.match_prefix([1], ["a"]) == {"a": 1}
    assert index.stats()["a"].speculative == 2


def test_remove_worker_forgets_it(clock: ManualClock) -> None:
    index = make(clock)
    index.apply_stored("a", [1])
    index.remove_worker("a")
    assert "a" not in index.stats()
    assert index.holders(1) == set()


def test_pending_counts_blocks_routed_but_not_yet_confirmed(clock: ManualClock) -> None:
    index = make(clock)
    index.set_events("a", True)
    index.apply_stored("a", [1, 2])  # computed and announced
    index.record_routed("a", [1, 2, 3, 4])  # 3 and 4: a request in flight is computing them
    assert index.match_prefix_pending([1, 2, 3, 4, 5], ["a"]) == {"a": (4, 2)}
    index.apply_stored("a", [3, 4])
    assert index.match_prefix_pending([1, 2, 3, 4], ["a"]) == {"a": (4, 0)}


def test_pending_counts_learned_blocks_only_while_recently_routed(clock: ManualClock) -> None:
    index = make(clock)  # no events: learned entries; recent = within speculative_ttl_s (5 s)
    index.record_routed("a", [1, 2])
    assert index.match_prefix_pending([1, 2], ["a"]) == {"a": (2, 2)}
    clock.now += 6
    assert index.match_prefix_pending([1, 2], ["a"]) == {"a": (2, 0)}


def test_hash_repeated_in_one_call_takes_its_last_position_and_stays_confirmed(
    clock: ManualClock,
) -> None:
    index = make(clock)
    index.set_capacity("a", 3)
    index.set_events("a", True)
    index.apply_stored("a", [1])
    index.record_routed("a", [1, 2, 1])  # LRU order now 2, 1; block 1 still confirmed
    clock.now += 3600
    assert index.match_prefix([1], ["a"]) == {"a": 1}
    assert index.stats()["a"].confirmed == 1
    index.record_routed("a", [3, 4])  # evicts the expired 2 first, then nothing confirmed
    assert index.holders(1) == {"a"}


def test_switching_mode_moves_tentative_entries_to_the_new_source(clock: ManualClock) -> None:
    index = make(clock)
    index.record_routed("a", [1, 2])  # learned (60 s)
    index.set_events("a", True)
    index.record_routed("a", [2])  # now speculative (5 s)
    assert (index.stats()["a"].learned, index.stats()["a"].speculative) == (1, 1)
    clock.now += 6
    assert index.match_prefix_pending([1, 2], ["a"]) == {"a": (1, 0)}
    assert (index.stats()["a"].learned, index.stats()["a"].speculative) == (1, 0)


class _Reference:
    """The index's semantics, one block at a time (the straightforward design it replaced)."""

    def __init__(self, clock: ManualClock, capacity: int) -> None:
        self.clock, self.capacity, self.events = clock, capacity, False
        self.entries: OrderedDict[int, tuple[str, float]] = OrderedDict()
        self.ttl = {"speculative": 5.0, "learned": 60.0}

    def record_routed(self, hashes: list[int]) -> None:
        source = "speculative" if self.events else "learned"
        expires = self.clock.now + self.ttl[source]
        for h in reversed(hashes):  # a call touches its blocks last to first
            old = self.entries.pop(h, None)
            confirmed = old is not None and old[0] == "confirmed"
            self.entries[h] = old if confirmed and old is not None else (source, expires)
        self._drop_expired()
        self._evict()

    def apply_stored(self, hashes: list[int]) -> None:
        for h in reversed(hashes):
            self.entries.pop(h, None)
            self.entries[h] = ("confirmed", float("inf"))
        self._evict()

    def apply_removed(self, hashes: list[int]) -> None:
        for h in hashes:
            self.entries.pop(h, None)

    def live(self) -> dict[int, tuple[str, float]]:
        return {h: e for h, e in self.entries.items() if e[1] > self.clock.now}

    def _drop_expired(self) -> None:
        for h in [h for h, e in self.entries.items() if e[1] <= self.clock.now]:
            del self.entries[h]

    def _evict(self) -> None:
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)


@pytest.mark.parametrize("seed", range(20))
def test_batched_updates_match_the_one_block_at_a_time_semantics(
    clock: ManualClock, seed: int
) -> None:
    """Random calls (repeats, overlaps, mode switches, expiries, evictions): the index holds the
    same blocks with the same sources and TTLs as the reference, in the same LRU order."""
    rng = random.Random(seed)
    capacity = rng.choice([5, 20, 60])
    index = make(clock)
    index.set_capacity("a", capacity)
    ref = _Reference(clock, capacity)
    for _ in range(300):
        hashes = [rng.randrange(80) for _ in range(rng.randrange(0, 12))]
        op = rng.random()
        if op < 0.45:
            index.record_routed("a", hashes)
            ref.record_routed(hashes)
        elif op < 0.75:
            index.apply_stored("a", hashes)
            ref.apply_stored(hashes)
        elif op < 0.85:
            index.apply_removed("a", hashes)
            ref.apply_removed(hashes)
        elif op < 0.92:
            ref.events = not ref.events
            index.set_events("a", ref.events)
        else:
            clock.now += rng.choice([1.0, 4.0, 30.0])
        live = ref.live()
        recent = clock.now + 60.0 - 5.0
        for h in range(80):
            want = live.get(h)
            pending = want is not None and (
                want[0] == "speculative" or (want[0] == "learned" and want[1] > recent))
            expected = (0, 0) if want is None else (1, int(pending))
            assert index.match_prefix_pending([h], ["a"])["a"] == expected, (h, want)
        stats = index.stats()["a"]
        ref._drop_expired()
        by_source = [e[0] for e in ref.entries.values()]
        assert (stats.confirmed, stats.speculative, stats.learned) == (
            by_source.count("confirmed"), by_source.count("speculative"),
            by_source.count("learned"),
        )
    # the same LRU order: filling the index with new confirmed blocks evicts in the same order
    for h in range(1000, 1000 + capacity):
        index.apply_stored("a", [h])
        ref.apply_stored([h])
        assert {x for x in range(80) if index.holders(x)} == set(ref.live()) & set(range(80))


def test_removed_since_tells_removals_by_events_after_the_mark_from_earlier_ones(
    clock: ManualClock,
) -> None:
    index = make(clock)
    index.apply_stored("a", [1, 2, 3, 4])
    index.apply_removed("a", [4])
    mark = index.removal_mark("a")
    assert not index.removed_since("a", 3, mark)  # nothing removed since
    index.apply_removed("a", [3])
    assert index.removed_since("a", 3, mark)
    assert not index.removed_since("a", 4, mark)  # removed before the mark
    assert not index.removed_since("a", 2, mark)  # still held
    index.apply_removed("a", [99])  # not held: nothing removed, no new number
    assert index.removal_mark("a") == mark + 1
    assert not index.removed_since("nobody", 3, 0)
    assert index.removal_mark("nobody") == 0


def test_expiry_and_the_indexs_own_lru_are_not_removals_by_the_worker(clock: ManualClock) -> None:
    index = make(clock)
    index.set_events("a", True)
    index.set_capacity("a", 4)
    index.record_routed("a", [1, 2])  # speculative
    mark = index.removal_mark("a")
    clock.advance(10.0)  # past speculative_ttl_s
    index.match_prefix([1, 2], ["a"])  # reclaims the expired entries
    index.apply_stored("a", [5, 6, 7, 8, 9])  # evicts the LRU front: the index's, not vLLM's
    assert not index.removed_since("a", 1, mark) and not index.removed_since("a", 5, mark)


def test_a_clear_after_the_mark_counts_every_block_as_removed(clock: ManualClock) -> None:
    index = make(clock)
    index.apply_stored("a", [1, 2])
    mark = index.removal_mark("a")
    index.clear_worker("a")
    index.apply_stored("a", [1])  # stored again since: vLLM served the request without it
    assert index.removed_since("a", 1, mark) and index.removed_since("a", 2, mark)
    assert not index.removed_since("a", 1, index.removal_mark("a"))


def test_the_removal_log_is_bounded_and_forgets_the_oldest_removals(clock: ManualClock) -> None:
    from gateway.kvindex.index import REMOVAL_LOG_BLOCKS

    index = make(clock)
    n = REMOVAL_LOG_BLOCKS + 100
    index.set_capacity("a", 2 * n)
    index.apply_stored("a", range(n))
    mark = index.removal_mark("a")
    for b in range(n):
        index.apply_removed("a", [b])
    assert not index.removed_since("a", 0, mark)  # beyond the log: not known, not removed
    assert index.removed_since("a", n - 1, mark)
    assert sum(index.removed_since("a", b, mark) for b in range(n)) == REMOVAL_LOG_BLOCKS


@pytest.mark.parametrize("n", [0, 1, 2, _SHORT, _SHORT + 1, 10 * _SHORT])
def test_the_chain_counters_count_as_counter_does_on_both_sides_of_the_short_cut(n: int) -> None:
    """``_tally`` and ``_count`` take a compiled loop up to ``_SHORT`` items and ``Counter``
    past it: both give what ``Counter`` gives, repeats and ``None`` (a chain's start) included."""
    items: list[int | None] = [None if i % 7 == 0 else i % 5 for i in range(n)]
    assert _tally(items) == Counter(items)
    kids: Counter[int] = Counter({1: 3, 99: 1})
    expected = Counter(kids)
    parents = [i % 5 for i in range(n)]
    expected.update(parents)
    _count(kids, parents)
    assert kids == expected and isinstance(kids, Counter)
