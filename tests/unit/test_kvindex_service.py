"""PrefixIndex: cached tokens per worker from prompt token ids (no sockets)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from gateway.kvindex import service
from gateway.kvindex.events import KvEventsConfig
from gateway.kvindex.hashing import block_hashes
from gateway.kvindex.index import BlockIndex
from gateway.kvindex.service import MAX_HASHED_AHEAD, PrefixIndex
from tests.clock import ManualClock


def make() -> tuple[PrefixIndex, BlockIndex, ManualClock]:
    clock = ManualClock(0.0)
    index = BlockIndex(clock=clock, speculative_ttl_s=5.0, learned_ttl_s=60.0)
    return PrefixIndex(index), index, clock


def test_routed_prompt_is_predicted_cached_for_the_next_request_with_that_prefix() -> None:
    prefix, _, _ = make()
    prefix.set_worker("a", 16, 1000, None)
    prefix.set_worker("b", 16, 1000, None)
    system = tuple(range(64))
    prefix.record_routed("a", (*system, 500, 501), 16)
    cached = prefix.cached_tokens((*system, 900, 901, 902), [("a", 16), ("b", 16)])
    assert cached == {"a": 64, "b": 0}


def test_fully_cached_prompt_leaves_the_last_token_to_compute() -> None:
    """vLLM recomputes the last prompt token, so a prompt of exactly N full blocks can hit at
    most N - 1 of them."""
    prefix, _, _ = make()
    prefix.set_worker("a", 16, None, None)
    prompt = tuple(range(64))
    prefix.record_routed("a", prompt, 16)
    assert prefix.cached_tokens(prompt, [("a", 16)]) == {"a": 48}
    assert prefix.cached_tokens((*prompt, 7), [("a", 16)]) == {"a": 64}
    assert prefix.cached_tokens(prompt[:16], [("a", 16)]) == {"a": 0}
    assert prefix.cached_tokens((), [("a", 16)]) == {"a": 0}


def test_workers_with_different_block_sizes_are_matched_at_their_own_size() -> None:
    prefix, _, _ = make()
    prefix.set_worker("small", 16, None, None)
    prefix.set_worker("big", 32, None, None)
    prompt = tuple(range(100))
    prefix.record_routed("small", prompt, 16)
    prefix.record_routed("big", prompt, 32)
    assert prefix.cached_tokens(prompt, [("small", 16), ("big", 32)]) == {"small": 96, "big": 96}
    assert prefix.cached_tokens(prompt[:70], [("small", 16), ("big", 32)]) == {
        "small": 64,
        "big": 64,
    }


def test_worker_with_events_gets_speculative_entries_that_expire() -> None:
    prefix, index, clock = make()
    prefix.set_worker("a", 16, None, KvEventsConfig("tcp://127.0.0.1:5557"))
    prompt = tuple(range(40))
    prefix.record_routed("a", prompt, 16)
    assert index.stats()["a"].speculative == 2
    assert not prefix.has_events("a")  # configured, but no subscriber runs before start()
    clock.now += 6
    assert prefix.cached_tokens(prompt, [("a", 16)]) == {"a": 0}


def test_events_confirm_what_routing_predicted() -> None:
    prefix, index, clock = make()
    prefix.set_worker("a", 16, None, KvEventsConfig("tcp://127.0.0.1:5557"))
    prompt = tuple(range(40))
    prefix.record_routed("a", prompt, 16)
    index.apply_stored("a", block_hashes(prompt, 16))
    clock.now += 3600
    assert prefix.cached_tokens(prompt, [("a", 16)]) == {"a": 32}


def test_changing_block_size_forgets_the_worker() -> None:
    prefix, index, _ = make()
    prefix.set_worker("a", 16, None, None)
    prefix.record_routed("a", tuple(range(64)), 16)
    prefix.set_worker("a", 32, None, None)
    assert index.stats()["a"].total == 0


def test_capacity_follows_num_gpu_blocks() -> None:
    prefix, index, _ = make()
    prefix.set_worker("a", 16, 3, None)
    prefix.record_routed("a", tuple(range(160)), 16)
    assert index.stats()["a"].total == 3
    prefix.set_worker("a", 16, None, None)
    assert index.stats()["a"].capacity_blocks == index.default_capacity_blocks


def test_remove_worker_forgets_it() -> None:
    prefix, index, _ = make()
    prefix.set_worker("a", 16, None, None)
    prefix.record_routed("a", tuple(range(64)), 16)
    prefix.remove_worker("a")
    assert "a" not in index.stats()
    assert prefix.cached_tokens(tuple(range(80)), [("a", 16)]) == {"a": 0}


def test_list_token_ids_work_like_tuples() -> None:
    prefix, _, _ = make()
    prefix.set_worker("a", 16, None, None)
    prefix.record_routed("a", list(range(64)), 16)
    assert prefix.cached_tokens(list(range(70)), [("a", 16)]) == {"a": 64}


def test_prompt_hashed_ahead_in_another_thread_routes_as_if_hashed_at_routing() -> None:
    prefix, _, _ = make()
    prefix.set_worker("a", 16, None, None)
    prefix.set_worker("big", 32, None, None)
    system = tuple(range(256))
    prefix.record_routed("a", (*system, 1), 16)
    prefix.record_routed("big", (*system, 1), 32)
    prompt = (*system, 7, 8, 9)
    thread = threading.Thread(target=prefix.hash_ahead, args=(prompt,))
    thread.start()
    thread.join()
    assert prefix.cached_tokens(prompt, [("a", 16), ("big", 32)]) == {"a": 256, "big": 256}
    prefix.record_routed("a", prompt, 16)
    assert prefix.cached_tokens((*prompt, 10), [("a", 16)]) == {"a": 256}


def test_prompts_hashed_ahead_but_never_routed_stay_bounded() -> None:
    prefix, _, _ = make()
    prefix.set_worker("a", 16, None, None)
    prompts = [(i, *range(64)) for i in range(MAX_HASHED_AHEAD + 5)]
    for prompt in prompts:
        prefix.hash_ahead(prompt)  # all but the last, say, refused by budgets before routing
    assert len(prefix._ahead) == MAX_HASHED_AHEAD
    assert prefix.cached_tokens(prompts[-1], [("a", 16)]) == {"a": 0}
    assert len(prefix._ahead) == MAX_HASHED_AHEAD - 1  # routing took its entry


def test_a_salted_prompt_is_predicted_cached_for_its_own_salt_only() -> None:
    """Approximate mode (routing history): vLLM shares a salted prompt's blocks only with
    requests of the same ``cache_salt`` (and adapter), so the index does too."""
    prefix, _, _ = make()
    prefix.set_worker("a", 16, 1000, None)
    system = tuple(range(64))
    prefix.record_routed("a", (*system, 500), 16, salt="tenant-1")
    ask = (*system, 900, 901)
    workers = [("a", 16)]
    assert prefix.cached_and_pending(ask, workers, salt="tenant-1") == {"a": (64, 64)}
    assert prefix.cached_and_pending(ask, workers, salt="tenant-2")["a"][0] == 0
    assert prefix.cached_and_pending(ask, workers)["a"][0] == 0
    assert prefix.cached_and_pending(ask, workers, "lora", "tenant-1")["a"][0] == 0
    prefix.record_routed("a", ask, 16)  # now unsalted too: still nothing for another salt
    assert prefix.cached_and_pending(ask, workers)["a"][0] == 64
    assert prefix.cached_and_pending(ask, workers, salt="tenant-2")["a"][0] == 0


def test_a_salted_prompt_hashed_ahead_is_not_hashed_again_at_routing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prefix, _, _ = make()
    prefix.set_worker("a", 16, None, None)
    prefix.record_routed("a", tuple(range(64)), 16, salt="s")
    prompt = (*range(64), 7)
    prefix.hash_ahead(prompt, "s")  # in the tokenizing thread, in the gateway

    def no_hashing(*args: object) -> list[int]:
        raise AssertionError("hashed on the event loop")
    monkeypatch.setattr(service, "block_hashes", no_hashing)
    assert prefix.cached_and_pending(prompt, [("a", 16)], salt="s")["a"][0] == 64
    prefix.record_routed("a", prompt, 16, salt="s")


async def _turns(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_a_long_route_is_recorded_a_slice_per_loop_turn_and_ends_as_one_call() -> None:
    """Issue 11 (isolation): a 128K-token route is 8,192 blocks, 15-17 ms of index work; once
    started the index records it a slice per loop turn, and ends exactly as one call would
    (same entries, same LRU order, same chain structure)."""
    from tests.unit.test_kvindex_search import check_structure

    prefix, index, _ = make()
    prefix.set_worker("a", 16, 100_000, None)
    await prefix.start()
    try:
        n = 3 * service.ROUTE_SLICE_BLOCKS + 100
        tokens = tuple(range(16 * n + 1))
        prefix.record_routed("a", tokens, 16)
        first = service.ROUTE_SLICE_BLOCKS * 16
        # at once: the first slice (what a sibling request matches first), not the rest yet
        assert prefix.cached_tokens(tokens, [("a", 16)]) == {"a": first}
        assert index.stats()["a"].total == service.ROUTE_SLICE_BLOCKS
        await _turns(6)
        assert prefix.cached_tokens(tokens, [("a", 16)]) == {"a": 16 * n}
        one = BlockIndex(clock=ManualClock(0.0))
        one.record_routed("a", block_hashes(tokens, 16))
        w, ref = index._workers["a"], one._workers["a"]
        assert list(w.entries) == list(ref.entries)  # the tail least recently used
        assert (w.parent, +w.kids, w.ghosts, w.unanchored) == (
            ref.parent, +ref.kids, ref.ghosts, ref.unanchored)
        check_structure(w)
    finally:
        await prefix.close()


async def test_a_route_whose_worker_is_cleared_while_it_is_recorded_stops_there() -> None:
    prefix, index, _ = make()
    prefix.set_worker("a", 16, 100_000, None)
    await prefix.start()
    try:
        tokens = tuple(range(16 * 3 * service.ROUTE_SLICE_BLOCKS + 1))
        prefix.record_routed("a", tokens, 16)
        index.clear_worker("a")  # a restart, AllBlocksCleared
        await _turns(6)
        assert index.stats()["a"].total == 0
        prefix.record_routed("a", tokens, 16)
        prefix.remove_worker("a")
        await _turns(6)
        assert "a" not in index.stats()
    finally:
        await prefix.close()


def test_before_start_a_long_route_is_recorded_at_once() -> None:
    prefix, index, _ = make()
    prefix.set_worker("a", 16, 100_000, None)
    tokens = tuple(range(16 * 2 * service.ROUTE_SLICE_BLOCKS + 1))
    prefix.record_routed("a", tokens, 16)
    assert index.stats()["a"].total == 2 * service.ROUTE_SLICE_BLOCKS
