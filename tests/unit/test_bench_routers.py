"""The pure parts of ``gateway.bench.routers``: the hit-rate ceiling, the targets, the tables."""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field

import pytest

from gateway import promtext
from gateway.bench import cli as bench_cli
from gateway.bench import routing_cost
from gateway.bench.loadgen import LoadSpec
from gateway.bench.routers.ceiling import (
    CacheCount,
    ceiling,
    ceiling_hits,
    counter_delta,
    load_spread,
    sent_prompts,
    warm_ttft_ms,
)
from gateway.bench.routers.contenders import PoolSpec, kvgate_config
from gateway.bench.routers.driver import WorkloadPlan
from gateway.bench.routers.report import format_table
from gateway.bench.routers.targets import hit_rate_verdicts, ttft_verdicts
from gateway.bench.routers.workers import Workers
from gateway.bench.workloads import WorkloadSpec, build_workload
from gateway.config import build_settings
from gateway.prompt.tokenizer import SimpleTokenizer
from gateway.sim.kvcache import KVCacheManager, block_hashes_for, none_hash

BS = 4


# -- the ceiling -------------------------------------------------------------------------------


def test_ceiling_of_nothing_is_no_queries_and_no_rate() -> None:
    assert ceiling([], BS) == CacheCount(0, 0)
    assert CacheCount(0, 0).hit_rate is None


def test_first_prompt_never_hits_and_a_repeat_hits_all_but_its_last_block() -> None:
    prompt = list(range(12))  # exactly 3 blocks: the last token is recomputed, so 2 blocks hit
    count = ceiling([prompt, prompt], BS)
    assert count == CacheCount(queries_tokens=24, hits_tokens=8)


def test_repeat_with_a_partial_tail_hits_every_full_block() -> None:
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    assert ceiling([prompt, prompt], BS).hits_tokens == 8


def test_shared_prefix_hits_only_whole_leading_blocks() -> None:
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    b = [1, 2, 3, 4, 5, 6, 0, 0, 0]  # shares 6 tokens: one whole block
    assert ceiling([a, b], BS).hits_tokens == 4


def test_a_different_first_token_breaks_the_chain_even_if_later_blocks_match() -> None:
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    b = [0, 2, 3, 4, 5, 6, 7, 8, 9]
    assert ceiling([a, b], BS).hits_tokens == 0


def test_prompts_shorter_than_a_block_never_hit() -> None:
    assert ceiling([[1, 2, 3], [1, 2, 3]], BS).hits_tokens == 0


def test_ceiling_never_evicts_so_an_old_prefix_still_hits() -> None:
    old = list(range(100, 108))
    others = [list(range(1000 * i, 1000 * i + 8)) for i in range(1, 50)]
    assert ceiling([old, *others, old], BS).hits_tokens == 4


@dataclass
class _Seq:
    request_id: str
    token_ids: list[int]
    num_computed_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)


def test_ceiling_equals_the_simulators_vllm_cache_when_nothing_is_evicted() -> None:
    """The simulator's cache follows vLLM rule for rule; with room for everything, one such
    cache serving the requests one after the other is exactly the ceiling."""
    rng = random.Random(7)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(3, 20))] for _ in range(5)]
    prompts = [rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(0, 9))]
               for _ in range(200)]
    kv = KVCacheManager(10_000, BS, max_model_len=1000)
    root = none_hash("vllm-none-hash")
    queries = hits = 0
    for i, ids in enumerate(prompts):
        seq = _Seq(str(i), ids, block_hashes=block_hashes_for(ids, BS, root))
        blocks, hit = kv.get_computed_blocks(seq)
        assert kv.allocate_slots(seq, len(ids) - hit, blocks, full_sequence_must_fit=True)
        seq.num_computed_tokens = len(ids)
        kv.free(seq.request_id)
        queries += len(ids)
        hits += hit
    assert ceiling(prompts, BS) == CacheCount(queries, hits)


# -- the requests a run sent -------------------------------------------------------------------


@dataclass(frozen=True)
class _Rec:
    index: int
    sent_s: float
    status: int = 200


def test_sent_prompts_follow_send_order_carry_the_salt_and_skip_unsent_requests() -> None:
    workload = build_workload(WorkloadSpec("shared-prefix", requests=4, prefixes=1,
                                           prefix_tokens=40, question_tokens=4))
    tok = SimpleTokenizer()
    load = LoadSpec(model="m", salt="abc123")
    records = [_Rec(0, 2.0), _Rec(1, 1.0), _Rec(2, 3.0, status=0), _Rec(3, 0.5)]
    got = list(sent_prompts(workload, records, load, tok))
    assert len(got) == 3
    requests = {r.index: r for r in workload.all_requests()}

    def ids(i: int) -> list[int]:
        first, *rest = requests[i].messages
        messages = [{"role": first.role, "content": f"[abc123] {first.content}"},
                    *({"role": m.role, "content": m.content} for m in rest)]
        return tok.encode_chat(messages, {})

    assert got == [ids(3), ids(1), ids(0)]


def test_ceiling_of_a_shared_prefix_run_approaches_the_prefix_share() -> None:
    spec = WorkloadSpec("shared-prefix", requests=200, prefixes=2, prefix_tokens=400,
                        question_tokens=8)
    workload = build_workload(spec)
    records = [_Rec(i, float(i)) for i in range(200)]
    count = ceiling(sent_prompts(workload, records, LoadSpec(model="m"), SimpleTokenizer()), 16)
    assert count.hit_rate is not None
    assert 0.85 < count.hit_rate < 0.99


# -- targets -----------------------------------------------------------------------------------


def test_hit_rate_targets_compare_with_the_ceiling_and_the_best_other_router() -> None:
    rows = {"kvgate_kv": {"hit_rate": 0.80}, "kvgate_rr": {"hit_rate": 0.95},
            "sglang_cache_aware": {"hit_rate": 0.60},
            "vllm_router_cache_aware": {"hit_rate": 0.65}}
    of_ceiling, vs_best = hit_rate_verdicts(rows, 0.82)
    assert of_ceiling.met is True  # 0.80 >= 0.95 * 0.82
    assert vs_best.met is True and vs_best.limit == pytest.approx(0.75)  # round robin ignored
    assert "vllm_router_cache_aware" in vs_best.detail
    of_ceiling, vs_best = hit_rate_verdicts(rows, 0.90)
    assert of_ceiling.met is False


def test_targets_without_competitors_or_numbers_are_not_applicable() -> None:
    of_ceiling, vs_best = hit_rate_verdicts({"kvgate_kv": {"hit_rate": None}}, None)
    assert of_ceiling.met is None and vs_best.met is None
    _, vs_best_ttft = ttft_verdicts({"kvgate_kv": {"ttft_p99_ms": 10.0}})
    assert vs_best_ttft.met is None


def test_ttft_targets_use_round_robin_and_the_fastest_competitor() -> None:
    rows = {"kvgate_kv": {"ttft_p99_ms": 100.0}, "kvgate_rr": {"ttft_p99_ms": 250.0},
            "sglang_cache_aware": {"ttft_p99_ms": 120.0},
            "vllm_router_cache_aware": {"ttft_p99_ms": 300.0}}
    vs_rr, vs_best = ttft_verdicts(rows)
    assert vs_rr.met is True and vs_rr.limit == 125.0
    assert vs_best.met is False and vs_best.limit == pytest.approx(96.0)
    assert "sglang_cache_aware" in vs_best.detail


# -- metrics, spread, tables -------------------------------------------------------------------


METRICS_BEFORE = """\
# TYPE kvgate_routing_decisions_total counter
kvgate_routing_decisions_total{pool="p",policy="kv_aware",reason="prefix_hit"} 3.0
kvgate_routing_decisions_total{pool="p",policy="kv_aware",reason="least_loaded"} 1.0
"""
METRICS_AFTER = """\
# TYPE kvgate_routing_decisions_total counter
kvgate_routing_decisions_total{pool="p",policy="kv_aware",reason="prefix_hit"} 10.0
kvgate_routing_decisions_total{pool="p",policy="kv_aware",reason="least_loaded"} 1.0
kvgate_routing_decisions_total{pool="p",policy="kv_aware",reason="load_balance"} 2.0
"""


def test_decision_counts_are_differenced_per_label_set() -> None:
    labels = ("pool", "policy", "reason")
    before = promtext.sums_by(METRICS_BEFORE, "kvgate_routing_decisions_total", labels)
    after = promtext.sums_by(METRICS_AFTER, "kvgate_routing_decisions_total", labels)
    assert counter_delta(before, after) == {("p", "kv_aware", "prefix_hit"): 7.0,
                                            ("p", "kv_aware", "load_balance"): 2.0}


def test_load_spread_is_max_over_mean() -> None:
    assert load_spread({"a": 1.0, "b": 1.0}) == 1.0
    assert load_spread({"a": 3.0, "b": 1.0}) == 1.5
    assert load_spread({}) is None and load_spread({"a": 0.0}) is None


def test_table_lists_every_contender_and_the_ceiling() -> None:
    rows = {"kvgate_kv": {"ttft_p50_ms": 12.0, "ttft_p99_ms": 40.0, "requests_per_s": 3.0,
                          "output_tokens_per_s": 90.0, "hit_rate": 0.5, "of_ceiling": 0.625,
                          "load_spread": 1.2, "errors": {"503": 2}}}
    text = format_table(rows, 0.8)
    assert "kvgate_kv" in text and "62.5%" in text and "80.0%" in text
    assert text.splitlines()[1].split()[-1] == "2"
    assert text.splitlines()[-1].startswith("ceiling")


# -- configuration and reproduction ------------------------------------------------------------


def _workers(n: int = 4) -> Workers:
    return Workers("sim", [f"http://127.0.0.1:{9000 + i}" for i in range(n)],
                   [(f"tcp://127.0.0.1:{7000 + 2 * i}", f"tcp://127.0.0.1:{7001 + 2 * i}")
                    for i in range(n)], "m", "simple", "llama-3-8b", 16, 131072, [], "test")


def test_kvgate_config_is_valid_with_and_without_event_endpoints() -> None:
    with_events = build_settings(kvgate_config(_workers(), 8000, "kv_aware", True))
    assert with_events.pools[0].workers[1].kv_events_endpoint == "tcp://127.0.0.1:7002"
    without = build_settings(kvgate_config(_workers(), 8000, "round_robin", False))
    assert all(w.kv_events_endpoint is None for w in without.pools[0].workers)


def test_kvgate_config_splits_workers_into_the_given_pools() -> None:
    pools = [PoolSpec("short", 8192, [0, 1]), PoolSpec("long", 131072, [2, 3])]
    settings = build_settings(kvgate_config(_workers(), 8000, "kv_aware", True, pools))
    assert [p.name for p in settings.pools] == ["short", "long"]
    assert [w.url for w in settings.pools[1].workers] == ["http://127.0.0.1:9002",
                                                          "http://127.0.0.1:9003"]


def test_bench_argv_reproduces_the_workload_with_kvgate_bench() -> None:
    spec = WorkloadSpec("shared-prefix", requests=40, prefixes=8, prefix_tokens=1024,
                        question_tokens=32, max_tokens=8)
    plan = WorkloadPlan("x", spec, rate=4.0)
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    args = parser.parse_args(plan.bench_argv())
    assert bench_cli._workload_spec(args) == spec
    assert args.rate == 4.0 and args.ignore_eos


@dataclass(frozen=True)
class _Timed:
    index: int
    sent_s: float
    ttft_s: float | None
    status: int = 200
    error: str | None = None


def test_warm_ttft_leaves_out_requests_the_ceiling_cannot_mostly_hit() -> None:
    records = [_Timed(0, 0.0, 9.0), _Timed(1, 1.0, 0.010), _Timed(2, 2.0, 0.020),
               _Timed(3, 3.0, 5.0, error="503"), _Timed(4, 4.0, None, status=0)]
    per_prompt = [(100, 0), (100, 96), (100, 80), (100, 90)]  # the unsent one has no entry
    warm = warm_ttft_ms(records, per_prompt)
    assert warm["warm_requests"] == 2
    assert warm["warm_ttft_p50_ms"] == pytest.approx(15.0)


def test_ceiling_hits_pair_each_prompt_with_its_hit() -> None:
    a = list(range(8))
    assert list(ceiling_hits([a, a, [9, 9, 9, 9, 1]], BS)) == [(8, 0), (8, 4), (5, 0)]


# -- routing cost (gateway.bench.routing_cost) -------------------------------------------------


def test_routing_cost_times_a_real_decision_that_sees_the_prefix_holder() -> None:
    row = routing_cost.measure(SimpleTokenizer(), "simple", 1024, 8, "one-holder", 16,
                               repeats=3, filler_blocks=100)
    # The cache discriminated (one candidate holds more); load then decided for or against it.
    assert row.chosen_reason in ("prefix_hit", "load_balance")
    assert 900 <= row.tokens <= 1300 and row.route.n == 3
    assert row.decide.median_ms >= row.route.median_ms > 0


def test_routing_cost_checks_only_32k_rows_against_the_target() -> None:
    t = routing_cost.Timing(0.5, 3.0, 10)  # median within the 1 ms target, p99 not
    rows = [routing_cost.Row("simple", n, 8, "all-hold", 16, t, t, t, t, t, "prefix_hit")
            for n in (1024, 33_000)]
    checks = routing_cost.verdicts(rows)
    assert {c["tokens"] for c in checks} == {33_000}
    assert [c["part"] for c in checks] == ["route", "ahead", "decide"]
    assert all(c["met"] and not c["met_p99"] for c in checks)


def test_restart_scenario_prompts_share_their_prefix_and_never_a_question() -> None:
    from gateway.bench.routers.scenario_restart import PREFIXES, Prompts

    prompts = Prompts("s")
    a, b = prompts.request(0), prompts.request(0)
    assert a != b and a.startswith(prompts.prefixes[0]) and b.startswith(prompts.prefixes[0])
    assert len(set(prompts.prefixes)) == PREFIXES
    assert Prompts("t").prefixes[0] != prompts.prefixes[0]  # a fresh salt: nothing cached


def test_restart_scenario_table_shows_the_ratio_to_steady() -> None:
    from gateway.bench.routers.scenario_restart import table

    rows = {"kvgate_kv": {"steady_hit_rate": 0.98, "after_restart_hit_rate": 0.49, "ratio": 0.5,
                          "requests_after_restart": 40, "restart_to_ready_s": 3.5}}
    text = table(rows)
    assert "98.0%" in text and "49.0%" in text and "0.50" in text
