"""The simulator's paged KV cache follows vLLM's prefix-caching rules."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.sim.kvcache import (
    AllBlocksCleared,
    Block,
    BlockPool,
    BlockRemoved,
    BlockStored,
    KVCacheManager,
    block_hashes_for,
    external_hash,
    none_hash,
)

BS = 4
ROOT = none_hash("vllm-none-hash")


@dataclass
class Seq:
    request_id: str
    token_ids: list[int]
    num_computed_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.block_hashes = block_hashes_for(self.token_ids, BS, ROOT)


def admit(kv: KVCacheManager, seq: Seq) -> int:
    """Look up, allocate the whole sequence, mark it computed; returns the hit in tokens."""
    blocks, hit = kv.get_computed_blocks(seq)
    assert kv.allocate_slots(seq, len(seq.token_ids) - hit, blocks, full_sequence_must_fit=True)
    seq.num_computed_tokens = len(seq.token_ids)
    return hit


def manager(num_blocks: int = 9, events: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, max_model_len=1000, record_events=events)


def test_block_zero_is_reserved_and_usage_counts_only_usable_blocks() -> None:
    kv = manager(num_blocks=5)
    assert kv.pool.num_free_blocks == 4
    admit(kv, Seq("a", list(range(8))))
    assert kv.pool.usage == 0.5
    assert 0 not in {b.block_id for b in kv.req_to_blocks["a"]}


def test_only_full_blocks_are_cached() -> None:
    kv = manager()
    admit(kv, Seq("a", list(range(10))))  # 2 full blocks + 2 tokens
    assert len(kv.pool.cached_hashes()) == 2
    (stored,) = kv.take_events()
    assert isinstance(stored, BlockStored)
    assert stored.token_ids == tuple(range(8))
    assert stored.parent_block_hash is None


def test_prompt_shorter_than_a_block_never_hits() -> None:
    kv = manager()
    admit(kv, Seq("a", [1, 2, 3]))
    kv.free("a")
    assert admit(kv, Seq("b", [1, 2, 3])) == 0


def test_hit_is_longest_cached_prefix_in_whole_blocks_counted_in_tokens() -> None:
    kv = manager()
    admit(kv, Seq("a", list(range(12))))
    kv.free("a")
    # Same first 9 tokens, then different: blocks 0 and 1 hit, 8 tokens.
    assert admit(kv, Seq("b", [*range(9), 99, 98, 97, 96])) == 8


def test_fully_cached_prompt_recomputes_its_last_block() -> None:
    """vLLM caps the hit at num_tokens - 1, so a prompt of whole blocks recomputes the last one."""
    kv = manager()
    admit(kv, Seq("a", list(range(8))))
    kv.free("a")
    kv.take_events()
    assert admit(kv, Seq("b", list(range(8)))) == 4
    # The recomputed block is cached again under the same hash, and announced again.
    (stored,) = kv.take_events()
    assert isinstance(stored, BlockStored)
    assert stored.token_ids == (4, 5, 6, 7)
    a_hashes = block_hashes_for(list(range(8)), BS, ROOT)
    assert stored.parent_block_hash == external_hash(a_hashes[0])
    assert stored.block_hashes == (external_hash(a_hashes[1]),)
    assert kv.pool.num_cached_blocks == 3  # the duplicate is not de-duplicated


def test_prompt_one_token_past_a_block_boundary_hits_all_full_blocks() -> None:
    kv = manager()
    admit(kv, Seq("a", list(range(9))))
    kv.free("a")
    assert admit(kv, Seq("b", list(range(9)))) == 8


def test_shared_prefix_blocks_are_ref_counted_and_not_freed_while_used() -> None:
    kv = manager()
    admit(kv, Seq("a", list(range(9))))
    admit(kv, Seq("b", [*range(8), 50, 51]))
    shared = kv.req_to_blocks["a"][:2]
    assert [b.ref_cnt for b in shared] == [2, 2]
    assert kv.req_to_blocks["b"][:2] == shared
    kv.free("a")
    assert [b.ref_cnt for b in shared] == [1, 1]
    assert all(b.block_id not in kv.pool.free_queue_ids() for b in shared)
    kv.free("b")
    assert all(b.block_id in kv.pool.free_queue_ids() for b in shared)


def test_freed_cached_blocks_go_to_the_lru_tail_tail_block_first() -> None:
    kv = manager(num_blocks=13)
    admit(kv, Seq("a", list(range(8))))
    a0, a1 = kv.req_to_blocks["a"]
    kv.free("a")
    queue = kv.pool.free_queue_ids()
    # Cached blocks sit behind the never-used ones; the sequence's tail is evicted before its head.
    assert queue[-2:] == [a1.block_id, a0.block_id]


def test_uncached_partial_blocks_are_reused_before_anything_else() -> None:
    kv = manager()
    admit(kv, Seq("a", list(range(6))))  # one full block, one partial
    full, partial = kv.req_to_blocks["a"]
    kv.free("a")
    queue = kv.pool.free_queue_ids()
    assert queue[0] == partial.block_id
    assert queue[-1] == full.block_id


def test_eviction_takes_least_recently_freed_cached_block_and_emits_block_removed() -> None:
    kv = manager(num_blocks=5)  # 4 usable blocks
    admit(kv, Seq("old", [1, 1, 1, 1, 9]))
    kv.free("old")
    admit(kv, Seq("new", [2, 2, 2, 2, 9]))
    kv.free("new")
    kv.take_events()
    old_hash = block_hashes_for([1, 1, 1, 1], BS, ROOT)[0]
    new_hash = block_hashes_for([2, 2, 2, 2], BS, ROOT)[0]
    # Needs all 4 blocks: the 2 uncached ones go first, then the cached ones, least recent first.
    admit(kv, Seq("c", [3] * 13))
    removed = [e for e in kv.take_events() if isinstance(e, BlockRemoved)]
    assert [e.block_hashes for e in removed] == [
        (external_hash(old_hash),),
        (external_hash(new_hash),),
    ]
    assert old_hash not in kv.pool.cached_hashes()


def test_touching_an_idle_cached_block_protects_it_from_eviction() -> None:
    kv = manager(num_blocks=4)  # 3 usable blocks
    admit(kv, Seq("a", [7, 7, 7, 7, 1]))
    kv.free("a")
    admit(kv, Seq("b", [7, 7, 7, 7, 2]))  # hits block 0 of "a", takes it off the free queue
    hash0 = block_hashes_for([7, 7, 7, 7], BS, ROOT)[0]
    assert kv.req_to_blocks["b"][0].block_hash == hash0
    assert kv.pool.num_free_blocks == 1


def test_allocation_fails_without_side_effects_when_blocks_run_out() -> None:
    kv = manager(num_blocks=3)  # 2 usable blocks
    admit(kv, Seq("a", list(range(8))))
    seq = Seq("b", list(range(100, 105)))
    blocks, hit = kv.get_computed_blocks(seq)
    assert not kv.allocate_slots(seq, 5 - hit, blocks, full_sequence_must_fit=True)
    assert "b" not in kv.req_to_blocks
    assert kv.pool.num_free_blocks == 0


def test_full_sequence_must_fit_refuses_even_when_the_first_chunk_fits() -> None:
    kv = manager(num_blocks=3)  # 2 usable blocks
    seq = Seq("a", list(range(12)))
    assert not kv.allocate_slots(seq, 4, full_sequence_must_fit=True)
    assert kv.allocate_slots(seq, 4, full_sequence_must_fit=False)


def test_decode_growth_caches_a_block_once_its_last_token_is_scheduled() -> None:
    kv = manager()
    seq = Seq("a", [1, 2, 3])
    admit(kv, seq)
    assert kv.pool.num_cached_blocks == 0
    # Generated token 4 is appended, then scheduled (computed) in the next step: block now full.
    seq.token_ids.append(4)
    seq.block_hashes = block_hashes_for(seq.token_ids, BS, ROOT)
    assert kv.allocate_slots(seq, 1)
    seq.num_computed_tokens += 1
    (stored,) = kv.take_events()
    assert isinstance(stored, BlockStored)
    assert stored.token_ids == (1, 2, 3, 4)


def test_reset_prefix_cache_forgets_hashes_only_when_nothing_runs() -> None:
    kv = manager()
    admit(kv, Seq("a", list(range(8))))
    assert not kv.pool.reset_prefix_cache()
    kv.free("a")
    kv.take_events()
    assert kv.pool.reset_prefix_cache()
    assert kv.take_events() == [AllBlocksCleared()]
    assert admit(kv, Seq("b", list(range(9)))) == 0


def test_events_are_not_recorded_unless_enabled() -> None:
    kv = manager(events=False)
    admit(kv, Seq("a", list(range(8))))
    assert kv.take_events() == []


def test_block_hashes_chain_so_equal_blocks_after_different_prefixes_differ() -> None:
    a = block_hashes_for([1, 2, 3, 4, 5, 6, 7, 8], BS, ROOT)
    b = block_hashes_for([9, 9, 9, 9, 5, 6, 7, 8], BS, ROOT)
    assert a[1] != b[1]
    assert block_hashes_for([1, 2, 3, 4, 5], BS, ROOT) == a[:1]


def _ids(blocks: Sequence[object]) -> list[int]:
    return [b.block_id for b in blocks]  # type: ignore[attr-defined]


def test_pool_get_new_blocks_pops_in_free_queue_order() -> None:
    pool = BlockPool(6, BS)
    assert _ids(pool.get_new_blocks(2)) == [1, 2]
    assert pool.free_queue_ids() == [3, 4, 5]


def test_free_queue_order_matches_vllm_list_semantics_under_random_operations() -> None:
    """The pool keeps never-used ids as a range; its order must still be vLLM's linked list."""
    rng = random.Random(42)
    pool = BlockPool(40, BS)
    reference = list(range(1, 40))  # vLLM's queue, front first
    held: list[list[Block]] = []
    for step in range(2000):
        op = rng.random()
        if op < 0.4 and len(reference) >= 3:
            n = rng.randint(1, 3)
            blocks = pool.get_new_blocks(n)
            assert [b.block_id for b in blocks] == reference[:n]
            del reference[:n]
            # Some of them become full and cached.
            hashes = [bytes([step % 256, i, rng.randrange(256)]) for i in range(n)]
            pool.cache_full_blocks(blocks, hashes, [0] * (n * BS), 0, rng.randint(0, n))
            held.append(blocks)
        elif op < 0.8 and held:
            blocks = held.pop(rng.randrange(len(held)))
            ordered = list(reversed(blocks))
            pool.free_blocks(ordered)
            first = [b.block_id for b in ordered if b.ref_cnt == 0 and b.block_hash is None]
            last = [b.block_id for b in ordered if b.ref_cnt == 0 and b.block_hash is not None]
            reference[:0] = first
            reference.extend(last)
        else:
            idle_cached = [pool.get_cached_block(h) for h in pool.cached_hashes()]
            candidates = [b for b in idle_cached if b is not None and b.ref_cnt == 0]
            if candidates:
                block = rng.choice(candidates)
                pool.touch([block])
                reference.remove(block.block_id)
                held.append([block])
        assert pool.free_queue_ids() == reference
        assert pool.num_free_blocks == len(reference)
