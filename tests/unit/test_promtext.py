"""gateway.promtext: the full parser's views (tests, benchmarks) and the scrape's fast path."""

from __future__ import annotations

from gateway import promtext

PAGE = """\
# HELP kvgate_requests_total Requests answered.
# TYPE kvgate_requests_total counter
kvgate_requests_total{pool="p",worker="http://a",code="200"} 7.0
kvgate_requests_total{pool="p",worker="http://b",code="200"} 3.0
kvgate_requests_total{pool="p",worker="http://b",code="502"} 1.0
# HELP kvgate_worker_up Worker health.
# TYPE kvgate_worker_up gauge
kvgate_worker_up{pool="p",worker="http://a"} 1.0
kvgate_worker_up{pool="p",worker="http://b"} 0.0
"""


def test_samples_key_series_by_sorted_label_pairs() -> None:
    up = promtext.samples(PAGE)["kvgate_worker_up"]
    assert up[(("pool", "p"), ("worker", "http://b"))] == 0.0


def test_values_match_every_series_whose_labels_include_the_given_ones() -> None:
    assert sorted(promtext.values(PAGE, "kvgate_requests_total", worker="http://b")) == [1.0, 3.0]
    assert promtext.values(PAGE, "kvgate_missing_total") == []


def test_value_sums_the_matching_series_or_is_none() -> None:
    assert promtext.value(PAGE, "kvgate_requests_total", code="200") == 10.0
    assert promtext.value(PAGE, "kvgate_requests_total", code="404") is None


def test_sums_by_groups_on_the_given_labels_and_reads_a_missing_one_as_empty() -> None:
    by_worker = promtext.sums_by(PAGE, "kvgate_requests_total", ("worker", "absent"))
    assert by_worker == {("http://a", ""): 7.0, ("http://b", ""): 4.0}


def test_scan_reads_only_the_wanted_families_and_skips_lines_that_do_not_parse() -> None:
    page = PAGE + "kvgate_worker_up{pool=\"p\",worker=\"http://c\"} not-a-number\n" + "garbage\n"
    found = list(promtext.scan(page, "kvgate_", {"kvgate_worker_up"}))
    assert [(promtext.scan_labels(labels)["worker"], v) for _, labels, v in found] == [
        ("http://a", 1.0), ("http://b", 0.0)]


def test_scan_takes_the_prefix_literally() -> None:
    page = "vllm:num_requests_running 2.0\nvllmXnum_requests_running 5.0\n"
    wanted = {"vllm:num_requests_running", "vllmXnum_requests_running"}
    assert [v for _, _, v in promtext.scan(page, "vllm:", wanted)] == [2.0]
