"""Lower KV tiers in the index (issue 15, item 4): blocks a worker's KV connector offloaded to
its CPU (vLLM's ``--kv-offloading-size``) are kept per tier, reported by events with medium
``"CPU"`` in vLLM's two shapes (placeholder, self-describing), and reachable past the GPU prefix."""

from __future__ import annotations

import msgpack
import pytest

from gateway.config import KvEventsSettings
from gateway.kvindex.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventApplier,
    decode_batch,
)
from gateway.kvindex.hashing import block_hashes
from gateway.kvindex.index import MAX_LOWER_TIERS, BlockIndex
from gateway.kvindex.service import PrefixIndex

BS = 4
TOKENS = list(range(100, 132))  # 8 blocks of 4
HASHES = block_hashes(TOKENS, BS)
ENGINE = [9000 + i for i in range(8)]  # the engine's hashes of those 8 blocks


def gpu_stored(first: int, last: int) -> BlockStored:
    """The worker's GPU stored blocks ``first..last - 1`` of TOKENS (engine hashes ENGINE)."""
    return BlockStored(tuple(ENGINE[first:last]), ENGINE[first - 1] if first else None,
                       tuple(TOKENS[first * BS:last * BS]), BS, medium="GPU", group_idx=0)


def cpu_placeholder(i: int) -> BlockStored:
    """vLLM's offloading connector by default: one block hash, no tokens, no parent, size 0."""
    return BlockStored((ENGINE[i],), None, (), 0, medium="CPU", group_idx=0)


def cpu_full(i: int) -> BlockStored:
    """... with ``self_describing_kv_events``: the block's tokens and parent."""
    return BlockStored((ENGINE[i],), ENGINE[i - 1] if i else None,
                       tuple(TOKENS[i * BS:(i + 1) * BS]), BS, medium="CPU", group_idx=0)


@pytest.fixture
def index() -> BlockIndex:
    return BlockIndex()


def tiered(index: BlockIndex) -> EventApplier:
    return EventApplier("w", index, BS, keep_lower_tiers=True)


def test_index_keeps_a_lower_tier_apart_from_the_gpu_entries(index: BlockIndex) -> None:
    index.apply_stored("w", HASHES[:3])
    index.apply_stored_lower("w", "CPU", HASHES[:6])
    assert index.match_prefix_tiers(HASHES, ["w", "cold"]) == {"w": (3, 0, 6), "cold": (0, 0, 0)}
    assert index.match_prefix(HASHES, ["w"]) == {"w": 3}  # the GPU answer is unchanged
    stats = index.stats()["w"]
    assert (stats.confirmed, stats.lower_tiers) == (3, (("CPU", 6),))


def test_lower_tier_run_starts_at_the_first_gpu_miss_and_stops_at_a_hole(
        index: BlockIndex) -> None:
    """vLLM's connector looks up from num_computed_tokens, chunk by chunk, to the first miss."""
    index.apply_stored("w", HASHES[:2])
    index.apply_stored_lower("w", "CPU", [*HASHES[2:4], *HASHES[5:8]])  # block 4 missing
    assert index.match_prefix_tiers(HASHES, ["w"]) == {"w": (2, 0, 4)}
    index.apply_stored_lower("w", "STORAGE", [HASHES[4]])  # another tier fills the hole
    assert index.match_prefix_tiers(HASHES, ["w"]) == {"w": (2, 0, 8)}


def test_lower_tier_is_bounded_per_worker_and_tier_by_its_own_lru(index: BlockIndex) -> None:
    index.set_tier_capacity("w", "CPU", 4)
    index.apply_stored_lower("w", "CPU", HASHES[:4])
    index.apply_stored_lower("w", "CPU", HASHES[:1])  # touched: most recently used
    index.apply_stored_lower("w", "CPU", HASHES[4:6])  # evicts blocks 1 and 2
    assert index.in_lower_tier("w", HASHES[0]) and index.in_lower_tier("w", HASHES[5])
    assert not index.in_lower_tier("w", HASHES[1]) and not index.in_lower_tier("w", HASHES[2])
    assert index.stats()["w"].lower_tiers == (("CPU", 4),)
    index.set_tier_capacity("w", "CPU", 1)
    assert index.stats()["w"].lower_tiers == (("CPU", 1),)


def test_a_hash_stored_twice_needs_two_removals(index: BlockIndex) -> None:
    """vLLM's self-describing chunks re-announce a shared hash once per chunk; consumers
    reference-count them (offloading/events.py)."""
    index.apply_stored_lower("w", "CPU", HASHES[:1])
    index.apply_stored_lower("w", "CPU", HASHES[:1])
    index.apply_removed_lower("w", "CPU", HASHES[:1])
    assert index.in_lower_tier("w", HASHES[0])
    index.apply_removed_lower("w", "CPU", HASHES[:1])
    assert not index.in_lower_tier("w", HASHES[0])


def test_gpu_removal_leaves_the_block_a_cpu_hit(index: BlockIndex) -> None:
    applier = tiered(index)
    applier.apply([gpu_stored(0, 8), *(cpu_placeholder(i) for i in range(8))])
    assert index.match_prefix_tiers(HASHES, ["w"]) == {"w": (8, 0, 8)}
    applier.apply([BlockRemoved(tuple(ENGINE[5:8]), "GPU", 0)])  # GPU evicts the tail
    assert index.match_prefix_tiers(HASHES, ["w"]) == {"w": (5, 0, 8)}
    # The evicted block's engine hash stays mapped while the CPU holds it: a later device
    # store that continues from it (the block reloaded, then extended) is no orphan.
    applier.apply([gpu_stored(6, 7)])
    assert applier.counts["skipped_orphan"] == 0
    assert index.in_gpu("w", HASHES[6])


def test_cpu_eviction_removes_the_lower_tier_hit_and_the_mapping(index: BlockIndex) -> None:
    applier = tiered(index)
    applier.apply([gpu_stored(0, 4), *(cpu_placeholder(i) for i in range(4))])
    applier.apply([BlockRemoved(tuple(ENGINE[2:4]), "GPU", 0)])
    assert applier.mapped_blocks == 4
    applier.apply([BlockRemoved((ENGINE[3],), "CPU", 0)])
    assert index.match_prefix_tiers(HASHES, ["w"]) == {"w": (2, 0, 3)}
    assert applier.mapped_blocks == 3  # block 3 is in no tier: nothing will name it again
    applier.apply([BlockRemoved((ENGINE[0],), "CPU", 0)])  # still on the GPU: stays mapped
    assert applier.mapped_blocks == 3
    assert index.match_prefix_tiers(HASHES, ["w"]) == {"w": (2, 0, 3)}
    assert applier.counts["removed_lower_blocks"] == 2


def test_self_describing_cpu_stores_are_rekeyed_like_device_stores(index: BlockIndex) -> None:
    """A gateway that subscribed after the GPU evicted the blocks still learns the CPU copies
    from the self-describing payload (tokens + parent)."""
    applier = tiered(index)
    applier.apply([cpu_full(i) for i in range(6)])
    assert index.match_prefix_tiers(HASHES, ["w"]) == {"w": (0, 0, 6)}
    assert applier.counts["stored_lower_blocks"] == 6


def test_placeholder_for_a_block_never_seen_on_the_gpu_is_counted_and_dropped(
        index: BlockIndex) -> None:
    applier = tiered(index)
    applier.apply([cpu_placeholder(0)])
    assert applier.counts["skipped_unmapped"] == 1
    assert index.match_prefix_tiers(HASHES, ["w"]) == {"w": (0, 0, 0)}


def test_all_blocks_cleared_clears_the_lower_tiers_too(index: BlockIndex) -> None:
    applier = tiered(index)
    applier.apply([gpu_stored(0, 4), *(cpu_placeholder(i) for i in range(4))])
    applier.apply([AllBlocksCleared()])
    assert index.match_prefix_tiers(HASHES, ["w"]) == {"w": (0, 0, 0)}
    assert applier.mapped_blocks == 0


def test_an_applier_without_lower_tiers_skips_other_media(index: BlockIndex) -> None:
    applier = EventApplier("w", index, BS)
    applier.apply([gpu_stored(0, 4), cpu_placeholder(0), cpu_full(1)])
    applier.apply([BlockRemoved((ENGINE[3],), "GPU", 0)])
    assert applier.counts["skipped_medium"] == 2
    assert index.match_prefix_tiers(HASHES, ["w"]) == {"w": (3, 0, 3)}
    assert applier.mapped_blocks == 3


def test_cpu_events_of_another_group_are_skipped(index: BlockIndex) -> None:
    applier = tiered(index)
    applier.apply([gpu_stored(0, 2), BlockStored((ENGINE[0],), None, (), 0, medium="CPU",
                                                 group_idx=1)])
    assert applier.counts["skipped_group"] == 1
    assert index.match_prefix_tiers(HASHES, ["w"]) == {"w": (2, 0, 2)}


def test_vllm_placeholder_payload_decodes_and_applies(index: BlockIndex) -> None:
    """The bytes vLLM 0.32's msgspec encoder writes for OffloadingEventsTracker's placeholder
    store and a CPU removal (tests/integration/test_sim_cpu_tier.py checks the sim's against
    vLLM's own tracker)."""
    payload = msgpack.packb([2.5, [
        {"type": "BlockStored", "block_hashes": [ENGINE[0]], "parent_block_hash": None,
         "token_ids": [], "block_size": 0, "lora_id": None, "medium": "CPU", "lora_name": None,
         "group_idx": 0},
        {"type": "BlockRemoved", "block_hashes": [ENGINE[0]], "medium": "CPU", "group_idx": 0},
    ], 0])
    batch = decode_batch(payload)
    applier = tiered(index)
    applier.apply([gpu_stored(0, 1), batch.events[0]])
    assert index.in_lower_tier("w", HASHES[0])
    applier.apply([batch.events[1]])
    assert not index.in_lower_tier("w", HASHES[0])


def test_prefix_index_reports_lower_tier_tokens_within_the_usable_blocks() -> None:
    index = BlockIndex()
    prefix = PrefixIndex(index)
    index.apply_stored("w", HASHES[:2])
    index.apply_stored_lower("w", "CPU", HASHES)
    # 32 tokens: the last is recomputed, so 7 blocks can hit: 2 on the GPU, 5 more from the CPU.
    assert prefix.cached_pending_lower(TOKENS, [("w", BS), ("x", BS)]) == {
        "w": (8, 0, 20), "x": (0, 0, 0)}
    assert prefix.cached_and_pending(TOKENS, [("w", BS)]) == {"w": (8, 0)}
    assert prefix.cached_pending_lower(TOKENS[:4], [("w", BS)]) == {"w": (0, 0, 0)}


def test_prefix_index_lower_tiers_follow_the_kv_events_setting() -> None:
    assert PrefixIndex(BlockIndex()).lower_tiers
    off = PrefixIndex(BlockIndex(), settings=KvEventsSettings(lower_tiers=False))
    assert not off.lower_tiers
    assert PrefixIndex(BlockIndex(), settings=KvEventsSettings(lower_tiers=False),
                       lower_tiers=True).lower_tiers


def test_lower_tier_capacity_must_be_positive(index: BlockIndex) -> None:
    with pytest.raises(ValueError):
        index.set_tier_capacity("w", "CPU", 0)
    with pytest.raises(ValueError):
        BlockIndex(default_lower_tier_capacity_blocks=0)


def test_a_publisher_naming_many_media_cannot_grow_the_index_without_bound(
        index: BlockIndex) -> None:
    """A worker has at most MAX_LOWER_TIERS media; a stream of made-up ones is dropped."""
    applier = tiered(index)
    applier.apply([gpu_stored(0, 1)])
    for k in range(MAX_LOWER_TIERS + 3):
        applier.apply([BlockStored((ENGINE[0],), None, (), 0, medium=f"TIER{k}", group_idx=0)])
    assert len(index.stats()["w"].lower_tiers) == MAX_LOWER_TIERS
    assert applier.counts["skipped_tiers"] == 3
    with pytest.raises(ValueError):
        index.set_tier_capacity("w", "ANOTHER", 8)


@pytest.mark.parametrize("medium", [7, ["CPU"], {"CPU": 1}])
def test_a_medium_that_is_no_string_is_skipped(index: BlockIndex, medium: object) -> None:
    applier = tiered(index)
    applier.apply([gpu_stored(0, 1),
                   BlockStored((ENGINE[0],), None, (), 0, medium=medium,  # type: ignore[arg-type]
                               group_idx=0),
                   BlockRemoved((ENGINE[0],), medium)])  # type: ignore[arg-type]
    assert applier.counts["skipped_medium"] == 2
    assert index.match_prefix_tiers(HASHES, ["w"]) == {"w": (1, 0, 1)}
