"""gateway.metrics: labelled series looked up once (``child``), and a worker's series forgotten."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from gateway.metrics import Metrics


def test_child_is_the_series_labels_gives_and_is_looked_up_once() -> None:
    m = Metrics(CollectorRegistry())

    first = m.child(m.requests, "short", "http://w1", "200")

    assert first is m.requests.labels("short", "http://w1", "200")
    assert m.child(m.requests, "short", "http://w1", "200") is first
    assert m.child(m.requests, "short", "http://w1", "500") is not first


def test_forgotten_worker_loses_its_gauges_and_gets_them_back_when_used_again() -> None:
    registry = CollectorRegistry()
    m = Metrics(registry)
    m.child(m.worker_inflight, "short", "http://w1").set(3)
    m.child(m.worker_inflight, "short", "http://w2").set(1)
    m.worker_up.labels("short", "http://w1").set(1)

    m.forget_worker("short", "http://w1")

    text = generate_latest(registry).decode()
    assert 'worker="http://w1"' not in text
    assert 'kvgate_worker_inflight{pool="short",worker="http://w2"} 1.0' in text
    m.child(m.worker_inflight, "short", "http://w1").set(2)
    assert ('kvgate_worker_inflight{pool="short",worker="http://w1"} 2.0'
            in generate_latest(registry).decode())
