"""BlockIndex: prefix matching, the LRU bound, and the three entry sources."""

from __future__ import annotations

import pytest

from gateway.kvindex.index import BlockIndex
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
        index.record_routed("approx", range(i, i + 50))  # refreshes append TTL records too
    stats = index.stats()
    assert stats["ev"].total == 100
    assert stats["approx"].total == 100
    assert stats["ev"].expiry_records <= 2 * 100 + 64
    assert stats["approx"].expiry_records <= 2 * 100 + 64
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
    index.apply_stored("a", [1, 2, 3])
    index.record_routed("a", [1])  # 1 is now the most recently used
    index.apply_stored("a", [4])
    assert index.holders(2) == set()
    assert index.holders(1) == {"a"}
    assert index.match_prefix([3, 4], ["a"]) == {"a": 2}


def test_match_prefix_does_not_refresh_lru_positions(clock: ManualClock) -> None:
    index = make(clock)
    index.set_capacity("a", 2)
    index.apply_stored("a", [1, 2])
    index.match_prefix([1], ["a"])
    index.apply_stored("a", [3])
    assert index.holders(1) == set()


def test_shrinking_capacity_evicts_at_once(clock: ManualClock) -> None:
    index = make(clock)
    index.apply_stored("a", range(10))
    index.set_capacity("a", 4)
    assert index.stats()["a"].total == 4
    assert index.match_prefix([6, 7, 8, 9], ["a"]) == {"a": 4}


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
