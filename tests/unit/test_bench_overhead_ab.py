"""The paired A/B of two checkouts (``gateway.bench.overhead.ab``): CPU per request of each side
of a pair and the summary line read from the pairs."""

from __future__ import annotations

import pytest

from gateway.bench.overhead.ab import Pair, table
from gateway.bench.overhead.model import Load, Round


def _round(target: str, cpu_s: float, requests: int) -> Round:
    return Round("short", target, 0, Load(requests, 0, requests / 8.0, 1.0, 2.0), 8.0, cpu_s,
                 0.0, 0.0, 0.0)


def test_cpu_per_request_is_the_gateway_tree_cpu_over_the_requests_of_its_round() -> None:
    pair = Pair(0, "base", _round("base", 1.2, 4000), _round("this", 0.9, 3000))
    assert pair.us_per_request("base") == pytest.approx(300.0)
    assert pair.us_per_request("this") == pytest.approx(300.0)


def test_summary_reads_the_median_paired_difference_and_counts_the_lower_pairs() -> None:
    # base 400/400/400 us, this 360/380/420 us: differences -40, -20, +20
    pairs = [Pair(i, "base" if i % 2 == 0 else "this", _round("base", 0.4, 1000),
                  _round("this", this_s, 1000))
             for i, this_s in enumerate((0.36, 0.38, 0.42))]
    lines = table(pairs, streaming=False)
    assert lines[-1] == ("median: base 400 us, this 380 us per request; median paired difference"
                         " -20 us (-5.0%); this lower in 2 of 3 pairs")
    assert len(lines) == 2 + len(pairs) + 1  # title, head, a line per pair, the summary


def _stream_round(target: str, ttft_p50_ms: float, ttft_p99_ms: float) -> Round:
    load = Load(1000, 0, 125.0, 700.0, 800.0, ttft_p50_ms, ttft_p99_ms, 10.0)
    return Round("stream", target, 0, load, 8.0, 2.0, 0.0, 0.0, 0.0)


def test_stream_summary_reads_ttft_p50_and_p99_medians_and_their_paired_differences() -> None:
    # p99 base 150/160/170 ms, this 140/165/150 ms: differences -10, +5, -20
    pairs = [Pair(i, "base", _stream_round("base", 40.0, base_p99),
                  _stream_round("this", 35.0, this_p99))
             for i, (base_p99, this_p99) in enumerate(((150.0, 140.0), (160.0, 165.0),
                                                       (170.0, 150.0)))]
    lines = table(pairs, streaming=True)
    assert lines[-2] == ("TTFT p50: base 40.0 ms, this 35.0 ms (medians); median paired"
                         " difference -5.0 ms; this lower in 3 of 3 pairs")
    assert lines[-1] == ("TTFT p99: base 160.0 ms, this 150.0 ms (medians); median paired"
                         " difference -10.0 ms; this lower in 2 of 3 pairs")
    assert "40.0 / 35.0" in lines[2] and "150.0 / 140.0" in lines[2]
