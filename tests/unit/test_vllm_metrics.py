"""gateway.workers.vllm_metrics: the few vLLM families routing needs, from a /metrics page."""

from __future__ import annotations

import pytest

from gateway.workers.vllm_metrics import parse_vllm_metrics
from gateway.workers.worker import VllmStats

# The shape of a vLLM 0.32 /metrics page for a server running two engines (data parallel 2),
# trimmed: process/GC families, HELP/TYPE lines, counters with their _created samples,
# histograms with `le` buckets, and the cache_config_info info-gauge.
VLLM_PAGE = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 12345.0
python_gc_objects_collected_total{generation="1"} 678.0
# HELP process_resident_memory_bytes Resident memory size in bytes.
# TYPE process_resident_memory_bytes gauge
process_resident_memory_bytes 4.123456512e+09
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 5.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.41015625
vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.73828125
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 10240.0
vllm:prefix_cache_queries_total{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 5760.0
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7326e+09
vllm:prefix_cache_queries_created{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7326e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 8192.0
vllm:prefix_cache_hits_total{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3808.0
# HELP vllm:prefix_cache_hits_created Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_created gauge
vllm:prefix_cache_hits_created{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7326e+09
vllm:prefix_cache_hits_created{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7326e+09
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:num_preemptions_total{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.0
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="meta-llama/Llama-3.1-8B-Instruct"} 120.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.005",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.04",model_name="meta-llama/Llama-3.1-8B-Instruct"} 90.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 127.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 127.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.917
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.3",model_name="meta-llama/Llama-3.1-8B-Instruct"} 4.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 127.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 512.25
vllm:e2e_request_latency_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 127.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",cache_dtype="auto",calculate_kv_scales="False",cpu_offload_gb="0",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",is_attention_free="False",num_cpu_blocks="None",num_gpu_blocks="512",num_gpu_blocks_override="None",prefix_caching_hash_algo="sha256",sliding_window="None",swap_space="4",swap_space_bytes="4294967296"} 1.0
"""


def test_running_and_waiting_are_summed_over_engines() -> None:
    stats = parse_vllm_metrics(VLLM_PAGE)

    assert (stats.running, stats.waiting) == (8, 2)


def test_kv_usage_is_that_of_the_fullest_engine() -> None:
    assert parse_vllm_metrics(VLLM_PAGE).kv_usage_ratio == 0.73828125


def test_prefix_cache_counters_are_summed_and_give_the_hit_ratio() -> None:
    stats = parse_vllm_metrics(VLLM_PAGE)

    assert stats.prefix_cache_queries_tokens == 16000.0
    assert stats.prefix_cache_hits_tokens == 12000.0
    assert stats.prefix_hit_ratio == 0.75


def test_created_timestamps_are_not_counted_as_queries_or_hits() -> None:
    only_created = "\n".join(
        line for line in VLLM_PAGE.splitlines() if "_created" in line or line.startswith("#")
    )

    stats = parse_vllm_metrics(only_created)

    assert (stats.prefix_cache_queries_tokens, stats.prefix_cache_hits_tokens) == (0.0, 0.0)


def test_block_size_and_gpu_blocks_come_from_cache_config_info() -> None:
    stats = parse_vllm_metrics(VLLM_PAGE)

    assert (stats.block_size_tokens, stats.num_gpu_blocks) == (32, 512)


def test_histogram_and_other_families_do_not_leak_into_the_stats() -> None:
    wanted_only = "\n".join(
        line for line in VLLM_PAGE.splitlines()
        if line.startswith((
            "vllm:num_requests_", "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
            "vllm:prefix_cache_hits_total", "vllm:cache_config_info",
        ))
    )

    assert parse_vllm_metrics(VLLM_PAGE) == parse_vllm_metrics(wanted_only)


def test_empty_page_gives_default_stats() -> None:
    assert parse_vllm_metrics("") == VllmStats()


def test_missing_families_keep_their_defaults() -> None:
    page = "vllm:num_requests_running{engine=\"0\"} 4\n"

    stats = parse_vllm_metrics(page)

    assert stats.running == 4
    assert (stats.waiting, stats.kv_usage_ratio) == (0, 0.0)
    assert (stats.block_size_tokens, stats.num_gpu_blocks) == (None, None)
    assert stats.prefix_hit_ratio == 0.0


def test_page_without_any_vllm_family_gives_default_stats() -> None:
    page = "# HELP up whatever\n# TYPE up gauge\nup 1\nprocess_cpu_seconds_total 12.5\n"

    assert parse_vllm_metrics(page) == VllmStats()


def test_metrics_of_before_vllm_0_10_give_kv_usage_from_gpu_cache_usage_perc() -> None:
    page = 'vllm:gpu_cache_usage_perc{model_name="m"} 0.5\nvllm:num_requests_running 1.0\n'

    stats = parse_vllm_metrics(page)

    assert (stats.kv_usage_ratio, stats.running) == (0.5, 1)


def test_unlabelled_samples_and_timestamps_are_read() -> None:
    page = "vllm:num_requests_waiting 6 1732600000000\nvllm:kv_cache_usage_perc 2.5e-1\n"

    stats = parse_vllm_metrics(page)

    assert (stats.waiting, stats.kv_usage_ratio) == (6, 0.25)


def test_garbage_lines_are_skipped_and_the_rest_is_read() -> None:
    page = (
        "this is not prometheus text\n"
        'vllm:num_requests_running{engine="0"} not-a-number\n'
        'vllm:num_requests_running{engine="1"} 2\n'
        "{} 5\n"
        "\x00\xff garbage\n"
        "vllm:NUM_REQUESTS_WAITING 7\n"
        'vllm:num_requests_waiting{engine="1"} 1\n'
    )

    stats = parse_vllm_metrics(page)

    assert (stats.running, stats.waiting, stats.kv_usage_ratio) == (2, 1, 0.0)


def test_line_cut_off_mid_labels_does_not_borrow_a_value_from_later_lines() -> None:
    """The label pattern `[^}]*` ran across newlines: a line cut off inside `{...` took its
    value from the next line that held a `}` (here waiting became 1 + 5)."""
    page = (
        'vllm:num_requests_waiting{engine="0"\n'
        "{} 5\n"
        'vllm:num_requests_waiting{engine="1"} 1\n'
    )

    assert parse_vllm_metrics(page).waiting == 1


def test_sample_without_a_value_does_not_swallow_the_next_line() -> None:
    """`\\s+` between name and value ran across the newline: a sample missing its value consumed
    the next line as its (unparsable) value, and that next sample was lost."""
    page = "vllm:kv_cache_usage_perc\nvllm:num_requests_running 4\n"

    assert parse_vllm_metrics(page).running == 4


def test_truncated_page_keeps_what_arrived_whole() -> None:
    cut = VLLM_PAGE.index("vllm:num_requests_waiting{engine=\"1\"")

    stats = parse_vllm_metrics(VLLM_PAGE[:cut])

    assert (stats.running, stats.waiting) == (8, 0)


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf"])
def test_non_finite_sample_values_do_not_break_the_scrape(value: str) -> None:
    """Prometheus text allows NaN and ±Inf; `int(float("NaN"))` raised ValueError (and
    `int(float("+Inf"))` OverflowError) out of the parser, so one odd gauge lost the whole
    scrape and the worker kept its stale load numbers."""
    page = (
        f'vllm:num_requests_running{{engine="0"}} {value}\n'
        f'vllm:num_requests_waiting{{engine="0"}} {value}\n'
        'vllm:num_requests_running{engine="1"} 3\n'
        'vllm:kv_cache_usage_perc{engine="0"} 0.5\n'
    )

    stats = parse_vllm_metrics(page)

    assert stats.kv_usage_ratio == 0.5
    assert stats.running >= 0
    assert stats.waiting >= 0


def test_cache_config_info_with_none_values_gives_none() -> None:
    page = 'vllm:cache_config_info{block_size="None",num_gpu_blocks="None"} 1.0\n'

    stats = parse_vllm_metrics(page)

    assert (stats.block_size_tokens, stats.num_gpu_blocks) == (None, None)


def test_cache_config_info_with_escaped_quotes_and_spaces_in_labels_is_read() -> None:
    page = (
        'vllm:cache_config_info{note="a \\"quoted\\" value, with = signs",block_size="16",'
        'num_gpu_blocks="27310"} 1.0\n'
    )

    stats = parse_vllm_metrics(page)

    assert (stats.block_size_tokens, stats.num_gpu_blocks) == (16, 27310)


def test_label_named_like_a_wanted_field_inside_another_label_is_not_read() -> None:
    page = 'vllm:cache_config_info{x_block_size="99",block_size="16",num_gpu_blocks="8"} 1\n'

    assert parse_vllm_metrics(page).block_size_tokens == 16


def test_families_with_a_wanted_prefix_but_another_name_are_ignored() -> None:
    page = (
        "vllm:num_requests_running_max 100\n"
        "vllm:num_requests_waiting_by_reason{reason=\"capacity\"} 50\n"
        "vllm:kv_cache_usage_perc_max 0.99\n"
        "vllm:num_requests_running 1\n"
    )

    stats = parse_vllm_metrics(page)

    assert (stats.running, stats.waiting, stats.kv_usage_ratio) == (1, 0, 0.0)


def test_metric_names_must_start_the_line() -> None:
    page = "# vllm:num_requests_running 9\nfoo vllm:num_requests_waiting 9\n"

    assert parse_vllm_metrics(page) == VllmStats()
