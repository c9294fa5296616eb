"""gateway.workers.worker: the up/down state machine, saturation, and the stats a scrape reports."""

from __future__ import annotations

import pytest

from gateway.workers.worker import VllmStats, Worker


def worker(healthy: bool = False) -> Worker:
    return Worker(url="http://w:8000", pool="short", healthy=healthy)


# --- up/down -------------------------------------------------------------------------------------


def test_new_worker_is_down_until_a_check_succeeds() -> None:
    w = worker()

    assert w.healthy is False
    assert w.record_ok(healthy_threshold=1) is True
    assert w.healthy is True


@pytest.mark.parametrize("threshold", [1, 2, 3, 5])
def test_down_worker_comes_up_at_exactly_healthy_threshold_successes(threshold: int) -> None:
    w = worker()

    flips = [w.record_ok(threshold) for _ in range(threshold)]

    assert flips == [False] * (threshold - 1) + [True]
    assert w.healthy is True


@pytest.mark.parametrize("threshold", [1, 2, 3, 5])
def test_up_worker_goes_down_at_exactly_unhealthy_threshold_failures(threshold: int) -> None:
    w = worker(healthy=True)

    flips = [w.record_failure(threshold) for _ in range(threshold)]

    assert flips == [False] * (threshold - 1) + [True]
    assert w.healthy is False


def test_worker_one_failure_short_of_the_threshold_stays_up() -> None:
    w = worker(healthy=True)

    w.record_failure(3)
    w.record_failure(3)

    assert w.healthy is True


def test_success_resets_the_failure_streak() -> None:
    w = worker(healthy=True)

    w.record_failure(2)
    w.record_ok(1)
    flipped = w.record_failure(2)

    assert flipped is False
    assert w.healthy is True
    assert w.consecutive_failures == 1


def test_failure_resets_the_success_streak_of_a_down_worker() -> None:
    w = worker()

    w.record_ok(3)
    w.record_ok(3)
    w.record_failure(2)
    flips = [w.record_ok(3) for _ in range(3)]

    assert flips == [False, False, True]


def test_success_on_an_up_worker_reports_no_flip() -> None:
    w = worker(healthy=True)

    assert [w.record_ok(1) for _ in range(3)] == [False, False, False]
    assert w.healthy is True


def test_failure_on_a_down_worker_reports_no_flip() -> None:
    w = worker()

    assert [w.record_failure(1) for _ in range(3)] == [False, False, False]
    assert w.healthy is False
    assert w.consecutive_failures == 3


def test_worker_flaps_up_and_down_with_each_flip_reported_once() -> None:
    w = worker()
    history = [w.record_ok(2), w.record_ok(2), w.record_ok(2),
               w.record_failure(2), w.record_failure(2), w.record_failure(2),
               w.record_ok(2), w.record_ok(2)]

    assert history == [False, True, False, False, True, False, False, True]
    assert w.healthy is True


# --- saturation ----------------------------------------------------------------------------------


def test_worker_is_saturated_at_exactly_saturation_inflight() -> None:
    w = worker(healthy=True)
    w.inflight = 7

    assert w.saturated(8) is False
    w.inflight = 8
    assert w.saturated(8) is True
    w.inflight = 9
    assert w.saturated(8) is True


def test_worker_with_requests_waiting_in_vllm_is_saturated_however_few_are_in_flight() -> None:
    w = worker(healthy=True)
    w.stats = VllmStats(waiting=1)

    assert w.saturated(100) is True


def test_idle_worker_is_not_saturated() -> None:
    w = worker(healthy=True)
    w.stats = VllmStats(running=50, kv_usage_ratio=0.99)  # busy in vLLM, but nothing queued

    assert w.saturated(1) is False


# --- models and load -----------------------------------------------------------------------------


def test_worker_serves_any_model_until_its_models_are_known() -> None:
    w = worker()

    assert w.serves("anything")
    w.models = frozenset({"llama"})
    assert w.serves("llama")
    assert not w.serves("qwen")


def test_worker_with_empty_model_list_serves_nothing() -> None:
    w = worker()
    w.models = frozenset()

    assert not w.serves("llama")


def test_prefix_hit_ratio_is_hits_over_queries_and_zero_without_queries() -> None:
    assert VllmStats().prefix_hit_ratio == 0.0
    assert VllmStats(prefix_cache_queries_tokens=400, prefix_cache_hits_tokens=100
                     ).prefix_hit_ratio == 0.25


def test_workers_compare_by_identity_not_by_value() -> None:
    """Two Worker objects for the same URL are two states; `in`/`remove` must not mix them."""
    a, b = worker(), worker()

    assert a != b
    assert a == a


# --- circuit breaker ---------------------------------------------------------------------------


def _opened_worker() -> Worker:
    w = Worker(url="http://w:1", pool="p")
    w.record_ok(1, now=0.0)
    assert w.healthy and w.circuit == "closed"
    w.record_failure(2, now=10.0)
    assert w.record_failure(2, now=10.0) is True
    assert (w.healthy, w.circuit) == (False, "open")
    return w


def test_open_circuit_stays_out_for_open_s_even_when_checks_pass() -> None:
    w = _opened_worker()
    assert w.record_ok(1, now=12.0, open_s=5.0) is False
    assert (w.healthy, w.circuit) == (False, "open")


def test_after_open_s_passing_checks_let_one_trial_request_through() -> None:
    w = _opened_worker()
    assert w.record_ok(1, now=15.5, open_s=5.0) is True
    assert (w.healthy, w.circuit) == (True, "half_open")
    assert w.accepts_trial()
    w.inflight = 1
    assert not w.accepts_trial()  # one trial at a time


def test_successful_trial_closes_the_circuit() -> None:
    w = _opened_worker()
    w.record_ok(1, now=16.0, open_s=5.0)
    assert w.record_request_ok() is True
    assert w.circuit == "closed"
    w.inflight = 5
    assert w.accepts_trial()


def test_failed_trial_reopens_at_once_whatever_the_threshold() -> None:
    w = _opened_worker()
    w.record_ok(1, now=16.0, open_s=5.0)
    assert w.record_failure(5, now=17.0) is True
    assert (w.healthy, w.circuit, w.opened_at) == (False, "open", 17.0)


def test_half_open_closes_after_more_passing_checks_without_traffic() -> None:
    w = _opened_worker()
    w.record_ok(2, now=16.0, open_s=5.0)
    w.record_ok(2, now=16.0, open_s=5.0)
    assert w.circuit == "half_open"
    for _ in range(3):
        w.record_ok(2, now=17.0, open_s=5.0)
    assert w.circuit == "closed"


def test_a_worker_never_up_is_not_held_back_by_the_breaker() -> None:
    w = Worker(url="http://w:1", pool="p")
    w.record_failure(1, now=0.0)  # down from the start: no circuit to open
    assert w.circuit == "closed"
    assert w.record_ok(1, now=0.1, open_s=60.0) is True
