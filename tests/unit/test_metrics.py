"""gateway.metrics: labelled series looked up once (``child``), and a worker's series forgotten."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics import MetricWrapperBase

from gateway.exposition import ProcessExposition
from gateway.metrics import Metrics


def test_child_is_the_series_labels_gives_and_is_looked_up_once() -> None:
    m = Metrics(CollectorRegistry())

    first = m.child(m.requests, "short", "http://w1", "200")

    assert first is m.requests.labels("short", "http://w1", "200")
    assert m.child(m.requests, "short", "http://w1", "200") is first
    assert m.child(m.requests, "short", "http://w1", "500") is not first


def test_forgotten_worker_loses_every_series_counters_and_histograms_too() -> None:
    """Regression: only its gauges went; requests, TTFT/TPOT/duration histograms and circuit
    transitions of every worker discovery ever removed stayed in /metrics forever."""
    registry = CollectorRegistry()
    m = Metrics(registry)
    for url in ("http://w1", "http://w2"):
        m.add_worker("short", url)
        record_everything(m, "short", url)

    m.forget_worker("short", "http://w1")

    text = generate_latest(registry).decode()
    assert 'worker="http://w1"' not in text
    assert 'kvgate_requests_total{code="200",pool="short",worker="http://w2"} 1.0' in text
    assert 'kvgate_ttft_seconds_count{pool="short",worker="http://w2"} 1.0' in text


def test_every_metric_labelled_by_worker_is_forgotten_with_it() -> None:
    """A metric added later with a worker label must not be left out of forget_worker."""
    registry = CollectorRegistry()
    m = Metrics(registry)
    m.add_worker("short", "http://w1")
    # every attribute (dir, not vars: a compiled Metrics keeps them in slots, not a __dict__)
    attributes = [getattr(m, a) for a in dir(m) if not a.startswith("__")]
    labelled = [v for v in attributes
                if isinstance(v, MetricWrapperBase) and "worker" in v._labelnames]
    assert labelled
    for metric in labelled:
        metric.labels(**{n: {"pool": "short", "worker": "http://w1"}.get(n, "x")
                         for n in metric._labelnames})

    m.forget_worker("short", "http://w1")

    assert 'worker="http://w1"' not in generate_latest(registry).decode()


def test_series_labelled_after_the_worker_left_are_not_exported_and_then_dropped() -> None:
    """A request still finishing on a removed worker labels its series again: they must not
    bring the worker back to /metrics."""
    registry = CollectorRegistry()
    m = Metrics(registry)
    m.add_worker("short", "http://w1")
    record_everything(m, "short", "http://w1")
    m.forget_worker("short", "http://w1")

    m.child(m.requests, "short", "http://w1", "200").inc()  # the straggler's outcome
    m.worker_up.labels("short", "http://w1").set(1)  # a health check that was in flight

    assert 'worker="http://w1"' not in ProcessExposition(m).render().decode()
    assert 'worker="http://w1"' not in generate_latest(registry).decode()  # removed again


def test_worker_that_comes_back_under_the_same_url_gets_its_series_again() -> None:
    m = Metrics(CollectorRegistry())
    m.add_worker("short", "http://w1")
    record_everything(m, "short", "http://w1")
    m.forget_worker("short", "http://w1")

    m.add_worker("short", "http://w1")
    m.child(m.worker_inflight, "short", "http://w1").set(2)

    text = ProcessExposition(m).render().decode()
    assert 'kvgate_worker_inflight{pool="short",worker="http://w1"} 2.0' in text
    assert 'kvgate_requests_total{code="200",pool="short",worker="http://w1"}' not in text


def test_add_counts_into_the_series_child_gives() -> None:
    m = Metrics(CollectorRegistry())

    m.add(m.prefix_tokens, ("short", "delivered"), 48)
    m.add(m.prefix_tokens, ("short", "delivered"), 16)
    m.child(m.prefix_tokens, "short", "delivered").inc(1)
    m.add(m.routing_decisions, ("short", "kv_aware", "prefix_hit"))

    text = ProcessExposition(m).render().decode()
    assert 'kvgate_prefix_tokens_total{outcome="delivered",pool="short"} 65.0' in text
    assert ('kvgate_routing_decisions_total{policy="kv_aware",pool="short",reason="prefix_hit"}'
            ' 1.0') in text


async def test_adds_of_one_loop_iteration_land_once_before_the_loop_polls_again() -> None:
    m = Metrics(CollectorRegistry())
    requests = ("short", "http://w1", "200")
    writes: list[float] = []
    value = m.child(m.requests, *requests)._value
    inc = value.inc

    def counting_inc(amount: float) -> None:
        writes.append(amount)
        inc(amount)

    value.inc = counting_inc
    for _ in range(3):
        m.add(m.requests, requests)
    m.add(m.prompt_tokens, ("short",), 40)
    assert m.registry.get_sample_value("kvgate_requests_total", dict(
        pool="short", worker="http://w1", code="200")) == 0  # summed, not yet added

    await asyncio.sleep(0)  # the rest of this iteration's callbacks: the flush among them

    assert writes == [3]  # one write of the sum, not one a request
    assert m.registry.get_sample_value("kvgate_requests_total", dict(
        pool="short", worker="http://w1", code="200")) == 3
    assert m.registry.get_sample_value("kvgate_prompt_tokens_total", dict(pool="short")) == 40
    m.add(m.requests, requests)  # a later iteration schedules its own flush
    await asyncio.sleep(0)
    assert writes == [3, 1]


async def test_batched_observations_give_the_buckets_and_sum_histogram_observe_gives() -> None:
    """``Metrics.observe`` adds an iteration's observations to the histogram's private sum and
    buckets: the series must read exactly as ``Histogram.observe`` of each value leaves them."""
    values = [0.0, 0.004, 0.005, 0.0051, 0.01, 0.3, 2.5, 59.0, 61.0, 1e9, -1.0]
    batched, plain = Metrics(CollectorRegistry()), Metrics(CollectorRegistry())
    for value in values:
        batched.observe(batched.ttft, ("short", "http://w1"), value)
        plain.child(plain.ttft, "short", "http://w1").observe(value)
    assert batched.registry.get_sample_value("kvgate_ttft_seconds_count", dict(
        pool="short", worker="http://w1")) is None  # gathered, not yet added
    await asyncio.sleep(0)

    def samples(m: Metrics) -> list[tuple[str, dict[str, str], float]]:
        return [(s.name, s.labels, s.value) for family in m.registry.collect()
                if family.name == "kvgate_ttft_seconds" for s in family.samples]

    got, want = samples(batched), samples(plain)
    assert [s[:2] for s in got] == [s[:2] for s in want]
    for (name, _, g), (_, _, w) in zip(got, want, strict=True):
        assert g == pytest.approx(w), name
    assert plain.registry.get_sample_value("kvgate_ttft_seconds_count", dict(
        pool="short", worker="http://w1")) == len(values)


async def test_a_scrape_and_a_departing_worker_see_the_adds_of_the_current_iteration() -> None:
    m = Metrics(CollectorRegistry())
    m.add_worker("short", "http://w1")
    m.add(m.prompt_tokens, ("short",), 40)
    m.flush_adds()  # what the /metrics endpoint does before it renders
    assert m.registry.get_sample_value("kvgate_prompt_tokens_total", dict(pool="short")) == 40

    m.add(m.requests, ("short", "http://w1", "200"))
    m.forget_worker("short", "http://w1")  # counted into the series it removes, not kept
    await asyncio.sleep(0)
    m.add_worker("short", "http://w1")
    m.add(m.requests, ("short", "http://w1", "200"))
    await asyncio.sleep(0)
    assert ('kvgate_requests_total{code="200",pool="short",worker="http://w1"} 1.0'
            in ProcessExposition(m).render().decode())


def test_add_after_the_worker_came_back_counts_into_its_new_series() -> None:
    """``add`` keeps the series' increment at hand: it must be dropped with the series when the
    worker is forgotten, or counts of the returning worker would go to the removed series."""
    m = Metrics(CollectorRegistry())
    m.add_worker("short", "http://w1")
    m.add(m.requests, ("short", "http://w1", "200"))
    m.forget_worker("short", "http://w1")

    m.add_worker("short", "http://w1")
    m.add(m.requests, ("short", "http://w1", "200"))

    assert ('kvgate_requests_total{code="200",pool="short",worker="http://w1"} 1.0'
            in ProcessExposition(m).render().decode())


def test_requests_refused_before_routing_are_exported_without_a_worker() -> None:
    m = Metrics(CollectorRegistry())
    m.child(m.requests, "none", "none", "429").inc()

    assert ('kvgate_requests_total{code="429",pool="none",worker="none"} 1.0'
            in ProcessExposition(m).render().decode())


def record_everything(m: Metrics, pool: str, url: str) -> None:
    """One value in every series a worker has, through the paths the gateway uses."""
    m.add(m.requests, (pool, url, "200"))
    m.child(m.ttft, pool, url).observe(0.1)
    m.child(m.tpot, pool, url).observe(0.01)
    m.child(m.duration, pool, url).observe(1.0)
    m.child(m.worker_inflight, pool, url).set(1)
    m.worker_up.labels(pool, url).set(1)
    m.worker_circuit_state.labels(pool, url).set(2)
    m.worker_circuit_transitions.labels(pool, url, "open").inc()
    m.worker_kv_usage.labels(pool, url).set(0.5)
    m.worker_prefix_hit.labels(pool, url).set(0.25)
