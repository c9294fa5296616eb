"""The simulator's CPU tier (vLLM's native offloading, ``--kv-offloading-size``): write-through
of cached blocks, an LRU that evicts with ``BlockRemoved`` (medium CPU), hits past the GPU
prefix loaded instead of computed, and their cost over the host link."""

from __future__ import annotations

import argparse
import zlib
from collections.abc import Sequence

import msgpack
import pytest

from gateway.sim.cli import build_configs, register
from gateway.sim.config import GIB, SimWorkerConfig, resolve
from gateway.sim.costmodel import LinearCostModel, step_time_s
from gateway.sim.kvcache import (
    MEDIUM_CPU,
    BlockRemoved,
    BlockStored,
    CpuOffloadCache,
    KVEvent,
    block_hashes_for,
    external_hash,
    none_hash,
)
from gateway.sim.kvevents import encode_batch
from gateway.sim.scheduler import SamplingSpec, Scheduler, SchedulerConfig

BS = 4


def make(gpu_blocks: int = 11, cpu_blocks: int = 16, *, self_describing: bool = False,
         reload_s_per_token: float = 0.0) -> Scheduler:
    return Scheduler(SchedulerConfig(
        num_gpu_blocks=gpu_blocks, block_size_tokens=BS, max_model_len=64, record_events=True,
        cpu_offload_blocks=cpu_blocks, cpu_offload_self_describing_events=self_describing,
        cpu_reload_s_per_token=reload_s_per_token))


def serve(s: Scheduler, rid: str, prompt: list[int], max_tokens: int = 1) -> list[int]:
    """Run one request to completion; the prefill tokens computed in each step."""
    spec = SamplingSpec(max_tokens=max_tokens, seed=zlib.crc32(rid.encode()))
    req = s.new_request(rid, prompt, spec)
    s.add_request(req)
    computed: list[int] = []
    while s.has_unfinished():
        assert len(computed) < 100, "the request never finished"
        plan = s.schedule()
        computed.append(plan.prefill_tokens)
        s.update_from_output(plan)
    return computed


def cpu_events(events: Sequence[KVEvent]) -> list[KVEvent]:
    return [e for e in events
            if isinstance(e, BlockStored | BlockRemoved) and e.medium == MEDIUM_CPU]


A = list(range(1000, 1021))  # 21 tokens: 5 full blocks
B = list(range(2000, 2037))  # 37 tokens: 9 full blocks, takes all 10 usable GPU blocks


def test_cached_blocks_are_written_through_to_the_cpu_after_the_gpu_events() -> None:
    s = make()
    serve(s, "a", A)
    events = s.take_events()
    assert [type(e).__name__ for e in events] == ["BlockStored"] * 6
    assert events[0].medium == "GPU"  # type: ignore[union-attr]
    hashes = [external_hash(h) for h in block_hashes_for(A, BS, none_hash("vllm-none-hash"))]
    # one placeholder per block: its hash, no parent, no tokens, block_size 0 (vLLM's default)
    assert events[1:] == [BlockStored((h,), None, (), 0, medium=MEDIUM_CPU) for h in hashes]
    assert s.kv.cpu is not None and len(s.kv.cpu) == 5


def test_a_request_evicted_from_the_gpu_reloads_its_prefix_from_the_cpu() -> None:
    s = make(reload_s_per_token=1e-3)
    serve(s, "a", A)
    serve(s, "b", B)  # evicts a's blocks from the GPU; the CPU (16 blocks) keeps both
    s.take_events()
    spec = SamplingSpec(max_tokens=1, seed=1)
    again = s.new_request("a2", A, spec)
    s.add_request(again)
    plan = s.schedule()
    # 20 of 21 tokens can hit (the last is recomputed): all 5 blocks from the CPU, 1 computed
    assert (plan.reload_tokens, plan.prefill_tokens, again.num_cached_tokens) == (20, 1, 20)
    assert s.prefix_stats.external_hits == 20
    cost = LinearCostModel(prefill_s_per_token=0.0, decode_base_s=0.0)
    assert step_time_s(cost, plan, 0.0, s.config.cpu_reload_s_per_token) == pytest.approx(0.02)
    s.update_from_output(plan)
    stored = [e for e in s.take_events() if isinstance(e, BlockStored)]
    assert stored and stored[0].medium == "GPU"  # loaded blocks are cached on the GPU again
    assert cpu_events(stored) == []  # ... and not offloaded twice


def test_without_a_cpu_tier_the_same_request_recomputes() -> None:
    s = make(cpu_blocks=0)
    serve(s, "a", A)
    serve(s, "b", B)
    assert s.kv.cpu is None
    assert serve(s, "a2", A)[0] == 21


def test_cpu_lru_evicts_the_oldest_blocks_with_one_cpu_block_removed() -> None:
    s = make(cpu_blocks=6)
    serve(s, "a", A)
    s.take_events()
    serve(s, "b", B)
    events = cpu_events(s.take_events())
    a_hashes = [external_hash(h) for h in block_hashes_for(A, BS, none_hash("vllm-none-hash"))]
    # b's 9 blocks cannot fit in 6 whatever is evicted: nothing of the call is stored (vLLM's
    # prepare_store returns None), nothing is evicted.
    assert events == []
    s2 = make(cpu_blocks=10)
    serve(s2, "a", A)
    s2.take_events()
    serve(s2, "b", B)
    events = cpu_events(s2.take_events())
    assert events[0] == BlockRemoved(tuple(a_hashes[:4]), medium=MEDIUM_CPU)  # LRU first
    assert sum(isinstance(e, BlockStored) for e in events) == 9
    assert s2.kv.cpu is not None and len(s2.kv.cpu) == 10


def test_self_describing_cpu_stores_carry_tokens_and_parents() -> None:
    s = make(self_describing=True)
    serve(s, "a", A[:8])
    events = cpu_events(s.take_events())
    h = [external_hash(x) for x in block_hashes_for(A[:8], BS, none_hash("vllm-none-hash"))]
    assert events == [BlockStored((h[0],), None, tuple(A[:4]), BS, medium=MEDIUM_CPU),
                      BlockStored((h[1],), h[0], tuple(A[4:8]), BS, medium=MEDIUM_CPU)]


def test_cpu_tier_wire_shapes_are_vllms() -> None:
    """The maps vLLM's msgspec writes for OffloadingEventsTracker's events (field order, omitted
    defaults); tests/integration/test_sim_cpu_tier.py checks the bytes against vLLM itself."""
    payload = encode_batch(1.0, [
        BlockStored((7,), None, (), 0, medium=MEDIUM_CPU),
        BlockStored((8,), 7, (1, 2, 3, 4), 4, medium=MEDIUM_CPU),
        BlockRemoved((7, 8), medium=MEDIUM_CPU),
    ])
    _, events, _ = msgpack.unpackb(payload)
    assert list(events[0]) == ["type", "block_hashes", "parent_block_hash", "token_ids",
                               "block_size", "lora_id", "medium", "lora_name", "group_idx"]
    assert list(events[1])[-1] == "kv_cache_spec_kind"
    assert events[2] == {"type": "BlockRemoved", "block_hashes": [7, 8], "medium": "CPU",
                         "group_idx": 0}


def test_cpu_cache_stores_nothing_when_it_cannot_make_room() -> None:
    cache = CpuOffloadCache(2, BS, record_events=True)
    hashes = [bytes([i]) * 32 for i in range(3)]
    cache.store(hashes, list(range(12)), 0, 3)
    assert len(cache) == 0 and cache.take_events() == []
    cache.store(hashes, list(range(12)), 0, 2)
    assert cache.lookup(hashes, 0, 3) == 2 and cache.lookup(hashes, 1, 1) == 0


def test_kv_offloading_size_becomes_blocks_of_the_profiles_kv_bytes() -> None:
    # llama-3-8b: 131,072 bytes per token, 16-token blocks: 2 MiB per block, 512 per GiB
    r = resolve(SimWorkerConfig(num_gpu_blocks=64, kv_offloading_size_gib=1.0))
    assert r.cpu_offload_blocks == GIB // (131_072 * 16) == 512
    assert r.cpu_reload_s_per_token == pytest.approx(131_072 / 25e9)
    assert resolve(SimWorkerConfig(num_gpu_blocks=64, cpu_offload_blocks=7)).cpu_offload_blocks \
        == 7
    assert resolve(SimWorkerConfig(num_gpu_blocks=64)).cpu_offload_blocks == 0
    with pytest.raises(ValueError):
        SimWorkerConfig(kv_offloading_size_gib=0.0)
    with pytest.raises(ValueError):
        SimWorkerConfig(cpu_offload_bytes_per_s=0.0)


def test_cli_takes_vllms_option_name_and_the_block_count() -> None:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["sim", "--kv-offloading-size", "2.5", "--cpu-offload-blocks",
                              "100", "--self-describing-kv-events"])
    (config,) = build_configs(args)
    assert (config.kv_offloading_size_gib, config.cpu_offload_blocks,
            config.self_describing_kv_events) == (2.5, 100, True)
