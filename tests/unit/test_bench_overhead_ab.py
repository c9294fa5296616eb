"""The paired A/B of two checkouts (``gateway.bench.overhead.ab``): CPU per request of each side
of a pair and the summary line read from the pairs; the GC probe (``--gc``) and its table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gateway.bench.overhead import gcprobe
from gateway.bench.overhead.ab import Pair, table
from gateway.bench.overhead.gcprobe import GcStats
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


def _gc(seconds: tuple[float, ...], collections: tuple[int, ...]) -> GcStats:
    return GcStats(1, collections, seconds, (0.008, 0.0, 0.0), (0, 0, 0))


def test_gc_table_reads_the_collectors_us_per_request_of_each_side_and_their_median() -> None:
    # base: 40 gen0 collections of 8 ms in 32,000 requests (10 us each), this: 1 of 8 ms (0.25)
    pairs = [Pair(i, "base", _round("base", 6.4, 32000), _round("this", 6.0, 32000),
                  _gc((0.32, 0.0, 0.0), (40, 0, 0)), _gc((0.008, 0.0, 0.0), (1, 0, 0)))
             for i in range(3)]
    assert pairs[0].gc_us_per_request("base") == pytest.approx(10.0)
    lines = table(pairs, streaming=False)
    assert lines[-1] == ("median GC: base 10.0 us, this 0.2 us per request; median paired"
                         " difference -9.8 us; this lower in 3 of 3 pairs")
    gc_rows = lines[lines.index(next(x for x in lines if x.startswith("garbage"))):]
    base_row = next(line for line in gc_rows if line.startswith("   1  base"))
    assert "12.5 x   8.0" in base_row  # gen0: collections per 10K requests x ms each


def test_gc_stats_since_subtracts_the_counts_and_keeps_the_later_longest() -> None:
    before = GcStats(1, (10, 1, 0), (0.1, 0.02, 0.0), (0.02, 0.02, 0.0), (100, 5, 0))
    after = GcStats(2, (12, 1, 1), (0.13, 0.02, 0.05), (0.016, 0.0, 0.05), (130, 5, 9))
    since = after.since(before)
    assert (since.seq, since.collections, since.max_s, since.collected) == (
        2, (2, 0, 1), (0.016, 0.0, 0.05), (30, 0, 9))
    assert since.seconds == pytest.approx((0.03, 0.0, 0.05))


_PROBED = """
import gc, runpy, sys, time
runpy.run_path(sys.argv[1])["install"](sys.argv[2])
class Node:
    pass
for _ in range(3):
    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle only the collector frees
    del a, b
    gc.collect()
print("ready", flush=True)
time.sleep(60)
"""


def test_probe_counts_the_collections_of_the_process_it_is_installed_in(tmp_path: Path) -> None:
    out = tmp_path / "gc.json"
    with subprocess.Popen([sys.executable, "-c", _PROBED, gcprobe.__file__, str(out)],
                          stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
            stats = gcprobe.snapshot(proc.pid, out)
        finally:
            proc.kill()
    assert stats.collections[2] >= 3 and stats.seconds[2] > 0
    assert stats.collected[2] >= 3 * 2  # two Nodes (and their dicts) per cycle


def test_probed_gateway_runs_the_gateway_cli_with_its_arguments(tmp_path: Path) -> None:
    """``boot_argv`` passes the arguments to ``gateway.cli`` as ``python -m`` would."""
    out = subprocess.run(gcprobe.boot_argv(tmp_path / "gc.json", "serve", "--help"),
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert "--processes" in out.stdout
