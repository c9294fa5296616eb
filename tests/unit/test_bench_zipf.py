"""The ``zipf_hot`` routers scenario's parts: Zipf popularity of the shared-prefix workload and
the issue's targets on its rows."""

from __future__ import annotations

from collections import Counter

import pytest

from gateway.bench.routers.scenario_zipf import zipf_verdicts
from gateway.bench.workloads import WorkloadSpec, build_workload


def system_prompts(spec: WorkloadSpec) -> list[str]:
    return [r.messages[0].content for r in build_workload(spec).all_requests()]


def test_zipf_popularity_draws_prefix_k_with_weight_one_over_k_to_the_s() -> None:
    spec = WorkloadSpec("shared-prefix", requests=6000, prefixes=16, prefix_tokens=8,
                        question_tokens=2, prefix_zipf_s=1.1)
    counts = Counter(p.split(".")[0] for p in system_prompts(spec))
    weights = [1 / k ** 1.1 for k in range(1, 17)]
    total = sum(weights)
    for k in (1, 2, 4, 16):
        assert counts[f"You are assistant {k - 1}"] / 6000 == pytest.approx(
            weights[k - 1] / total, abs=0.015)


def test_prefix_popularity_stays_uniform_and_byte_identical_without_zipf() -> None:
    base = WorkloadSpec("shared-prefix", requests=200, prefixes=8, prefix_tokens=8)
    assert system_prompts(base) == system_prompts(
        WorkloadSpec("shared-prefix", requests=200, prefixes=8, prefix_tokens=8,
                     prefix_zipf_s=0.0))
    counts = Counter(system_prompts(base))
    assert len(counts) == 8 and max(counts.values()) < 2 * min(counts.values())


def test_a_negative_or_absurd_zipf_exponent_is_refused() -> None:
    for s in (-1.0, 11.0, float("nan")):
        with pytest.raises(ValueError):
            WorkloadSpec("shared-prefix", prefix_zipf_s=s)


def test_verdicts_compare_p90_and_p99_with_the_best_competitor_and_hits_with_the_ceiling() -> None:
    rows = {
        "kvgate_hot": {"ttft_p90_ms": 60.0, "ttft_p99_ms": 200.0, "hit_rate": 0.895,
                       "ceiling_hit_rate": 0.90},
        "sglang_cache_aware": {"ttft_p90_ms": 100.0, "ttft_p99_ms": 250.0},
        "vllm_router_cache_aware": {"ttft_p90_ms": 90.0, "ttft_p99_ms": 300.0},
    }
    p90, p99, hits = zipf_verdicts(rows, 0.5)
    assert p90.met is True and p90.limit == pytest.approx(63.0)
    assert p99.met is False and p99.limit == pytest.approx(175.0)
    assert hits.met is True and hits.limit == pytest.approx(0.89)
    assert [v.met for v in zipf_verdicts({"kvgate_hot": rows["kvgate_hot"]}, 0.9)] == [
        None, None, True]
