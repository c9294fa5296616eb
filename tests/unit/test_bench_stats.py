"""gateway.bench.stats and the report tables: percentiles, TPOT, throughput, hit-rate deltas."""

from __future__ import annotations

import math
from typing import Any

import pytest

from gateway.bench.loadgen import Target, TargetRun
from gateway.bench.report import build_report, compare_table, group_table
from gateway.bench.stats import (
    RequestRecord,
    cache_delta,
    distribution,
    percentile,
    ratio_interval,
    summarize,
    summarize_groups,
    tpot,
)
from gateway.workers.worker import VllmStats


def rec(index: int = 0, **kw: Any) -> RequestRecord:
    base: dict[str, Any] = dict(
        index=index, group="all", status=200, error=None, scheduled_s=0.0, sent_s=0.0,
        ttft_s=0.1, tpot_s=0.01, e2e_s=1.0, prompt_tokens=100, completion_tokens=10,
        cached_tokens=None, approx_prompt_tokens=100, chunks=10,
    )
    base.update(kw)
    return RequestRecord(**base)


def test_percentile_interpolates_between_closest_ranks_like_numpy() -> None:
    xs = [1.0, 2.0, 3.0, 4.0]
    assert percentile(xs, 0.5) == 2.5
    assert percentile(xs, 0.0) == 1.0 and percentile(xs, 1.0) == 4.0
    assert percentile(list(range(1, 101)), 0.99) == pytest.approx(99.01)
    assert percentile([5.0], 0.9) == 5.0
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0  # unsorted input
    assert math.isnan(percentile([], 0.5))
    with pytest.raises(ValueError):
        percentile(xs, 1.5)


def test_distribution_ignores_missing_values_and_is_none_when_empty() -> None:
    d = distribution([0.3, None, 0.1, 0.2])
    assert d is not None
    assert (d.count, d.p50, d.max) == (3, 0.2, 0.3)
    assert d.mean == pytest.approx(0.2)
    assert distribution([None]) is None


def test_tpot_spreads_first_to_last_token_over_the_tokens_after_the_first() -> None:
    assert tpot(1.0, 2.0, 11) == pytest.approx(0.1)
    assert tpot(1.0, 1.0, 1) is None  # one token: no inter-token time
    assert tpot(None, 2.0, 5) is None
    assert tpot(1.0, 2.0, None) is None


def test_summary_counts_errors_by_kind_and_keeps_them_out_of_latencies() -> None:
    records = [
        rec(0, sent_s=0.0, e2e_s=1.0, ttft_s=0.1),
        rec(1, sent_s=0.5, e2e_s=1.5, ttft_s=0.3, completion_tokens=30),
        rec(2, status=503, error="503", ttft_s=None, tpot_s=None, e2e_s=0.01,
            completion_tokens=None),
        rec(3, status=0, error="timeout", ttft_s=None, tpot_s=None, e2e_s=0.5,
            completion_tokens=None),
        rec(4, status=503, error="503", ttft_s=None, tpot_s=None, e2e_s=0.01,
            completion_tokens=None),
    ]
    s = summarize(records)
    assert (s.requests, s.ok) == (5, 2)
    assert s.errors == {"503": 2, "timeout": 1}
    assert s.ttft_s is not None and s.ttft_s.count == 2 and s.ttft_s.p50 == pytest.approx(0.2)
    assert s.duration_s == pytest.approx(2.0)  # first sent at 0, last done at 0.5 + 1.5
    assert s.requests_per_s == pytest.approx(1.0)
    assert s.output_tokens_per_s == pytest.approx(20.0)


def test_summary_reports_cached_token_share_only_when_the_server_reports_it() -> None:
    assert summarize([rec()]).cached_tokens_ratio is None
    s = summarize([rec(0, cached_tokens=80), rec(1, cached_tokens=0)])
    assert s.cached_tokens_ratio == pytest.approx(0.4)


def test_open_loop_send_lag_is_sent_minus_scheduled() -> None:
    s = summarize([rec(0, scheduled_s=1.0, sent_s=1.0), rec(1, scheduled_s=1.0, sent_s=3.0)])
    assert s.send_lag_s is not None and s.send_lag_s.max == pytest.approx(2.0)


def test_groups_are_ordered_by_prompt_length() -> None:
    records = [rec(0, group="turn-10", prompt_tokens=900), rec(1, group="turn-2", prompt_tokens=200),
               rec(2, group="turn-1", prompt_tokens=100)]
    assert list(summarize_groups(records)) == ["turn-1", "turn-2", "turn-10"]


def stats(queries: float, hits: float) -> VllmStats:
    return VllmStats(prefix_cache_queries_tokens=queries, prefix_cache_hits_tokens=hits)


def test_fleet_hit_rate_is_hits_delta_over_queries_delta_summed_over_workers() -> None:
    before = {"a": stats(1000, 100), "b": stats(0, 0)}
    after = {"a": stats(3000, 1100), "b": stats(1000, 500)}
    d = cache_delta(before, after)
    assert d is not None
    assert (d.queries_tokens, d.hits_tokens) == (3000, 1500)
    assert d.hit_rate == pytest.approx(0.5)


def test_hit_rate_skips_unread_and_restarted_workers() -> None:
    before = {"a": stats(1000, 100), "b": None, "c": stats(5000, 4000)}
    after = {"a": stats(2000, 600), "b": stats(10, 10), "c": stats(100, 0)}  # c restarted
    d = cache_delta(before, after)
    assert d is not None and d.hit_rate == pytest.approx(0.5)
    assert cache_delta({"a": None}, {"a": stats(1, 1)}) is None
    assert cache_delta({}, {}) is None
    idle = cache_delta({"a": stats(5, 5)}, {"a": stats(5, 5)})
    assert idle is not None and idle.hit_rate is None


def run_of(name: str, ttft_s: float, workers: bool = False) -> TargetRun:
    records = tuple(rec(i, ttft_s=ttft_s, sent_s=float(i), group=f"g{i % 2}",
                        prompt_tokens=100 * (1 + i % 2)) for i in range(4))
    before: dict[str, VllmStats | None] = {"w": stats(0, 0)} if workers else {}
    after: dict[str, VllmStats | None] = {"w": stats(100, 25)} if workers else {}
    return TargetRun(Target(name, f"http://{name}"), records, 4.0, before, after, None)


def test_compare_table_shows_ratios_to_the_first_target() -> None:
    reports = [build_report(run_of("direct", 0.2, workers=True)),
               build_report(run_of("gateway", 0.1, workers=True))]
    table = compare_table(reports)
    lines = table.splitlines()
    assert lines[0].split()[0] == "target" and "hit rate" in lines[0]
    assert lines[1].startswith("direct") and "(" not in lines[1]
    assert lines[2].startswith("gateway")
    assert "100.0 (0.50x)" in lines[2]  # TTFT p50 halved
    assert "25.0% (1.00x)" in lines[2]


def test_group_table_has_a_row_per_group_and_one_for_the_run() -> None:
    table = group_table(build_report(run_of("t", 0.1)))
    names = [line.split()[0] for line in table.splitlines()[2:]]
    assert names == ["g0", "g1", "all"]


def test_ratio_interval_brackets_the_ratio_and_narrows_with_more_samples() -> None:
    small_quiet = [float(i) for i in range(1, 201)]
    small_flood = [1.2 * x for x in small_quiet]
    lo, hi = ratio_interval(small_flood, small_quiet, 0.99) or (0.0, 0.0)
    assert lo <= 1.2 <= hi
    assert hi - lo > 0.01  # a p99 of 200 is the 3rd worst: resampling moves it
    big_quiet = [float(i % 200 + 1) for i in range(4000)]
    big_flood = [1.2 * x for x in big_quiet]
    blo, bhi = ratio_interval(big_flood, big_quiet, 0.99) or (0.0, 0.0)
    assert blo <= 1.2 <= bhi
    assert bhi - blo < hi - lo
    assert ratio_interval(small_flood, small_quiet, 0.99) == (lo, hi)  # seeded
    assert ratio_interval([], small_quiet, 0.99) is None
    assert ratio_interval(small_flood, [0.0] * 10, 0.99) is None
