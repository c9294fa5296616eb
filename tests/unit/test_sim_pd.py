"""The simulator's pieces of prefill/decode disaggregation: transfer cost, held blocks, leases,
admission of pulled KV, the params vLLM's NIXL connector reads and writes, config and CLI."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import pytest

from gateway.sim.cli import build_configs, register
from gateway.sim.config import SimWorkerConfig, resolve
from gateway.sim.kvcache import BlockStored
from gateway.sim.kvtransfer import (
    BadTransferParams,
    KVTransfer,
    PullRefused,
    remote_prefill,
    transfer_bytes,
    transfer_time_s,
)
from gateway.sim.scheduler import SamplingSpec, Scheduler, SchedulerConfig, SimRequest

BLOCK = 4


def make(num_gpu_blocks: int = 64, *, record_events: bool = False) -> Scheduler:
    return Scheduler(SchedulerConfig(num_gpu_blocks=num_gpu_blocks, block_size_tokens=BLOCK,
                                     record_events=record_events, has_connector=True))


def add(s: Scheduler, rid: str, prompt: list[int], max_tokens: int = 1, *,
        kv_hold: bool = False, remote_kv: bool = False) -> SimRequest:
    req = s.new_request(rid, prompt, SamplingSpec(max_tokens=max_tokens))
    req.kv_hold, req.remote_kv = kv_hold, remote_kv
    s.add_request(req)
    return req


def run(s: Scheduler) -> int:
    """Step until idle; the prompt tokens computed in all steps."""
    computed = 0
    while s.has_unfinished():
        plan = s.schedule()
        computed += plan.prefill_tokens
        s.update_from_output(plan)
    return computed


def free_blocks(s: Scheduler) -> int:
    return s.kv.pool.num_free_blocks


# -- cost --------------------------------------------------------------------------------------


def test_transfer_moves_whole_blocks_of_kv_bytes_at_the_link_bandwidth() -> None:
    num_bytes = transfer_bytes(32, 16, 131072)  # 512 tokens of llama-3-8b
    assert num_bytes == 64 * 2**20
    assert transfer_time_s(num_bytes, 25e9) == pytest.approx(64 * 2**20 / 25e9)


def test_resolve_gives_the_profiles_kv_bytes_per_token_to_a_worker_with_a_connector() -> None:
    assert resolve(SimWorkerConfig(num_gpu_blocks=64, kv_role="kv_consumer")
                   ).kv_bytes_per_token == 131072  # llama-3-8b: 2 x 32 x 8 x 128 x 2 bytes
    assert resolve(SimWorkerConfig(num_gpu_blocks=64, kv_role="kv_consumer",
                                   kv_dtype="fp8")).kv_bytes_per_token == 65536
    assert resolve(SimWorkerConfig(num_gpu_blocks=64)).kv_bytes_per_token == 0


# -- producer: held blocks ---------------------------------------------------------------------


def test_finished_prefill_for_a_remote_decode_keeps_its_blocks_until_released() -> None:
    s = make()
    all_free = free_blocks(s)
    add(s, "p", list(range(100, 110)), kv_hold=True)  # 10 tokens: 3 blocks
    run(s)
    assert not s.has_unfinished()
    assert s.held_block_ids("p") == [1, 2, 3]
    assert free_blocks(s) == all_free - 3  # not free, so not evictable either
    assert s.release_held("p") is True
    assert free_blocks(s) == all_free
    assert s.release_held("p") is False
    assert s.held_block_ids("p") == []


def test_held_blocks_are_not_evicted_by_a_request_that_needs_the_room() -> None:
    s = make(num_gpu_blocks=5)  # 4 usable blocks
    add(s, "p", list(range(100, 112)), kv_hold=True)  # 3 blocks
    run(s)
    add(s, "other", list(range(200, 212)))  # needs 3: only 1 is free
    plan = s.schedule()
    assert plan.empty and s.num_waiting == 1
    s.release_held("p")
    assert not s.schedule().empty


def test_a_new_request_cannot_reuse_the_id_of_a_held_one() -> None:
    s = make()
    add(s, "p", list(range(100, 110)), kv_hold=True)
    run(s)
    with pytest.raises(ValueError, match="duplicate"):
        add(s, "p", [1, 2, 3])


def test_an_aborted_prefill_holds_nothing() -> None:
    s = make()
    all_free = free_blocks(s)
    add(s, "p", list(range(100, 110)), max_tokens=4, kv_hold=True)
    s.update_from_output(s.schedule())
    s.abort_request("p")
    assert free_blocks(s) == all_free and "p" not in s.held


# -- consumer: admission of pulled KV ----------------------------------------------------------


def test_pulled_prompt_is_admitted_computed_but_its_last_token() -> None:
    s = make(record_events=True)
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    req = add(s, "d", prompt, max_tokens=3, remote_kv=True)
    plan = s.schedule()
    assert plan.prefill_tokens == 1  # the last prompt token, recomputed for its logits
    assert req.num_computed_tokens == len(prompt)
    assert req.remote_kv is False  # one transfer per request
    [stored] = [e for e in s.take_events() if isinstance(e, BlockStored)]
    assert stored.token_ids == tuple(prompt[:8])  # the loaded full blocks are cached
    assert s.prefix_stats.external_queries == len(prompt)
    assert s.prefix_stats.external_hits == len(prompt)
    assert req.num_cached_tokens == len(prompt)
    s.update_from_output(plan)
    assert run(s) == 0  # then only decodes
    assert req.num_output_tokens == 3


def test_pulled_prompt_loads_only_what_the_local_prefix_cache_lacks() -> None:
    s = make()
    prefix = list(range(100, 108))  # 2 blocks
    add(s, "warm", [*prefix, 1, 2])
    run(s)
    add(s, "d", prefix + list(range(300, 306)), remote_kv=True)
    queries0, hits0 = s.prefix_stats.external_queries, s.prefix_stats.external_hits
    plan = s.schedule()
    assert plan.prefill_tokens == 1
    assert s.prefix_stats.hits >= 8
    assert s.prefix_stats.external_queries - queries0 == 14 - 8
    assert s.prefix_stats.external_hits - hits0 == 14 - 8


def test_a_request_with_no_remote_kv_on_a_connector_worker_counts_external_queries_only() -> None:
    s = make()
    add(s, "local", list(range(100, 110)))
    assert run(s) == 10
    assert (s.prefix_stats.external_queries, s.prefix_stats.external_hits) == (10, 0)


# -- params ------------------------------------------------------------------------------------

GOOD: dict[str, Any] = {
    "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[4, 5, 6]],
    "remote_engine_id": "e", "remote_request_id": "r", "remote_host": "10.0.0.1",
    "remote_port": 8100, "tp_size": 1, "remote_prefill_cached_tokens": 16,
}  # fmt: skip


def test_remote_prefill_reads_vllm_grouped_block_ids_and_older_flat_ones() -> None:
    grouped = remote_prefill(GOOD)
    flat = remote_prefill(GOOD | {"remote_block_ids": [4, 5, 6]})
    assert grouped == flat
    assert grouped.block_ids == (4, 5, 6) and grouped.cached_tokens == 16
    assert grouped.pull_url == "http://10.0.0.1:8100/sim/kv_transfer/pull"
    assert remote_prefill(GOOD | {"remote_host": "::1"}).pull_url.startswith("http://[::1]:")


@pytest.mark.parametrize("bad", [
    {"remote_engine_id": None}, {"remote_request_id": 7}, {"remote_host": ""},
    {"remote_port": True}, {"remote_port": 0}, {"remote_port": "8100"},
    {"remote_block_ids": None}, {"remote_block_ids": []}, {"remote_block_ids": [[1], [2]]},
    {"remote_block_ids": [1, -2]}, {"remote_block_ids": [[True]]},
])  # fmt: skip
def test_remote_prefill_params_with_a_missing_or_bad_field_are_refused(
    bad: dict[str, Any]
) -> None:
    with pytest.raises(BadTransferParams, match=next(iter(bad))):
        remote_prefill(GOOD | bad)


# -- leases ------------------------------------------------------------------------------------


def held_transfer(lease_s: float = 30.0) -> tuple[Scheduler, KVTransfer, SimRequest]:
    s = make()
    kvt = KVTransfer(s, block_size_tokens=BLOCK, kv_bytes_per_token=1024, bytes_per_s=1e9,
                     lease_s=lease_s, time_scale=1.0, recompute_on_failure=False,
                     engine_id="engine-p", host="127.0.0.1")
    kvt.port = 8100
    req = add(s, "p", list(range(100, 110)), kv_hold=True)
    run(s)
    kvt.hold(req)
    return s, kvt, req


async def test_held_request_answers_vllm_params_and_a_pull_frees_its_blocks() -> None:
    s, kvt, _ = held_transfer()
    params = kvt.params_for("p")
    assert params is not None
    assert params["remote_block_ids"] == [[1, 2, 3]]
    assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", 8100)
    assert params["remote_num_tokens"] == 10 and params["remote_prefill_cached_tokens"] == 0
    assert kvt.pull({"remote_engine_id": "engine-p", "remote_request_id": "p",
                     "remote_block_ids": [2, 3]})["num_tokens"] == 10
    assert s.held == {} and kvt.params_for("p") is None
    await kvt.close()


async def test_a_second_pull_of_the_same_blocks_is_404() -> None:
    _, kvt, _ = held_transfer()
    body = {"remote_engine_id": "engine-p", "remote_request_id": "p",
            "remote_block_ids": [[1, 2, 3]]}
    kvt.pull(body)
    with pytest.raises(PullRefused) as refused:
        kvt.pull(body)
    assert refused.value.status == 404
    await kvt.close()


@pytest.mark.parametrize(("body", "status"), [
    ({"remote_engine_id": "other", "remote_request_id": "p", "remote_block_ids": [1]}, 404),
    ({"remote_engine_id": "engine-p", "remote_request_id": "q", "remote_block_ids": [1]}, 404),
    ({"remote_engine_id": "engine-p", "remote_request_id": "p", "remote_block_ids": [9]}, 400),
    ({"remote_engine_id": "engine-p", "remote_request_id": "p"}, 400),
])  # fmt: skip
async def test_pull_of_blocks_not_held_is_refused(body: dict[str, Any], status: int) -> None:
    s, kvt, _ = held_transfer()
    with pytest.raises(PullRefused) as refused:
        kvt.pull(body)
    assert refused.value.status == status
    assert "p" in s.held  # a refused pull frees nothing
    await kvt.close()


async def test_unpulled_blocks_are_freed_when_the_lease_ends() -> None:
    s, kvt, _ = held_transfer(lease_s=0.05)
    assert "p" in s.held
    await asyncio.sleep(0.1)
    assert s.held == {} and kvt.num_expired == 1
    with pytest.raises(PullRefused):
        kvt.pull({"remote_engine_id": "engine-p", "remote_request_id": "p",
                  "remote_block_ids": [1]})
    await kvt.close()


async def test_close_frees_every_held_block() -> None:
    s, kvt, _ = held_transfer()
    await kvt.close()
    assert s.held == {} and kvt.num_expired == 0


# -- config and CLI ----------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [
    {"kv_role": "kv_prefill"}, {"kv_load_failure_policy": "retry"},
    {"kv_transfer_bytes_per_s": 0}, {"kv_lease_duration_s": -1},
])  # fmt: skip
def test_invalid_kv_transfer_configs_are_rejected(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        SimWorkerConfig(**bad)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["sim", *argv])


def test_cli_passes_the_kv_transfer_flags_to_every_worker() -> None:
    configs = build_configs(parse(
        "--workers", "2", "--kv-role", "kv_producer", "--kv-transfer-bytes-per-s", "1e10",
        "--kv-lease-duration", "5", "--kv-load-failure-policy", "recompute",
        "--kv-transfer-host", "pd.local"))  # fmt: skip
    assert {(c.kv_role, c.kv_transfer_bytes_per_s, c.kv_lease_duration_s,
             c.kv_load_failure_policy, c.kv_transfer_host) for c in configs} == {
        ("kv_producer", 1e10, 5.0, "recompute", "pd.local")}
    default = build_configs(parse())[0]
    assert default.kv_role is None and default.kv_load_failure_policy == "fail"
