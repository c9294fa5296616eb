"""What ``/metrics`` answers: this process's metrics, or every process's (``--processes N``).

One process (``ProcessExposition``): the registry of ``gateway.metrics``, as it is.

Several processes (``MultiProcessExposition``): prometheus-client's multiprocess mode is on in
each (``PROMETHEUS_MULTIPROC_DIR``, set by the supervisor before Python starts), so every counter,
histogram and gauge writes its values to a per-process mmap'd file, and a scrape, whichever process
accepts it, merges the files of all (``MultiProcessCollector``): counters and histograms summed,
each gauge by its ``multiprocess_mode`` (``gateway.metrics``). A process that died keeps its
counters and histograms in the sum (the supervisor drops only its live gauges), so they never go
backwards when a process is restarted. Two kinds of gauge do not go through the files:

* the gauges computed at scrape time from the gateway-wide budget store (``SCRAPE_TIME``: top-K
  sessions, throttled sessions) are computed by the process answering the scrape and added as
  they are, since a file cannot delete a series (a session that left the top-K must leave);
* the admission gate's gauges, which one process reads with ``set_function``, are copied into
  the files by each process every ``GATE_PUBLISH_S`` (``run``), to be summed.

Cost: per-request metric updates write the mmap'd value under a lock instead of a float under a
lock (measured: see the README's section on ``--processes``); a scrape reads N files.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from prometheus_client import Gauge, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector

from gateway.metrics import Metrics
from gateway.overload import AdmissionGate

GATE_PUBLISH_S = 1.0
"""How often each process copies its admission gate's counts into the shared files."""

MULTIPROCESS_DIR = "prometheus"
"""The multiprocess directory, under the gateway's runtime directory (the supervisor makes it)."""
MULTIPROCESS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
"""prometheus-client's switch: set, every metric value lives in that directory's files."""


@dataclass(frozen=True)
class SessionRow:
    """One top-K session as the session gauges show it."""

    session_id: str
    kv_bytes: int
    budget_ratio: float | None
    """KV in flight / the session's in-flight KV budget; ``None`` when it has none."""


class Exposition(Protocol):
    def track_gate(self, gate: AdmissionGate) -> None:
        """Export the gate's requests in flight and queued."""
        ...

    def show_sessions(self, top: list[SessionRow], throttled: int) -> None:
        """The top-K sessions and the number of throttled ones, as of this scrape."""
        ...

    def render(self) -> bytes:
        """The exposition body (Prometheus text format)."""
        ...


class ProcessExposition:
    """One process: its registry as it is."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def track_gate(self, gate: AdmissionGate) -> None:
        self._metrics.gateway_inflight.set_function(lambda: gate.inflight)
        self._metrics.gateway_queued.set_function(lambda: gate.queued)

    def show_sessions(self, top: list[SessionRow], throttled: int) -> None:
        m = self._metrics
        m.session_kv_bytes.clear()
        m.session_kv_budget_ratio.clear()
        for row in top:
            m.session_kv_bytes.labels(row.session_id).set(row.kv_bytes)
            if row.budget_ratio is not None:
                m.session_kv_budget_ratio.labels(row.session_id).set(row.budget_ratio)
        m.throttled_sessions.set(throttled)

    def render(self) -> bytes:
        return generate_latest(self._metrics.registry)


class MultiProcessExposition:
    """Every process of the gateway: the shared files, plus the scrape-time gauges."""

    def __init__(self, metrics: Metrics, multiprocess_dir: Path) -> None:
        self._metrics = metrics
        self._files = MultiProcessCollector(None, str(multiprocess_dir))  # type: ignore[no-untyped-call]
        self._gate: AdmissionGate | None = None
        self._scrape_time: list[Metric] = []
        self._scrape_time_names = frozenset(
            _family(g, []).name
            for g in (metrics.session_kv_bytes, metrics.session_kv_budget_ratio,
                      metrics.throttled_sessions))

    def track_gate(self, gate: AdmissionGate) -> None:
        self._gate = gate

    async def run(self) -> None:
        """Copy the gate's counts into this process's files until cancelled."""
        while True:
            if self._gate is not None:
                self._metrics.gateway_inflight.set(self._gate.inflight)
                self._metrics.gateway_queued.set(self._gate.queued)
            await asyncio.sleep(GATE_PUBLISH_S)

    def show_sessions(self, top: list[SessionRow], throttled: int) -> None:
        m = self._metrics
        kv_bytes = _family(m.session_kv_bytes, ["session"])
        ratio = _family(m.session_kv_budget_ratio, ["session"])
        for row in top:
            kv_bytes.add_metric([row.session_id], row.kv_bytes)
            if row.budget_ratio is not None:
                ratio.add_metric([row.session_id], row.budget_ratio)
        count = _family(m.throttled_sessions, [])
        count.add_metric([], throttled)
        self._scrape_time = [kv_bytes, ratio, count]

    def collect(self) -> Iterable[Metric]:
        for family in self._files.collect():  # type: ignore[no-untyped-call]
            if family.name not in self._scrape_time_names:
                yield family
        yield from self._scrape_time

    def render(self) -> bytes:
        return generate_latest(self)


def _family(gauge: Gauge, labels: list[str]) -> GaugeMetricFamily:
    """An empty family with ``gauge``'s name and help (the one definition stays in metrics)."""
    described = next(iter(gauge.describe()))
    return GaugeMetricFamily(described.name, described.documentation, labels=labels)


def exposition_for(metrics: Metrics, env: Mapping[str, str]) -> Exposition:
    """Every process's metrics when prometheus-client runs in multiprocess mode, else this one's."""
    multiprocess_dir = env.get(MULTIPROCESS_DIR_ENV)
    if multiprocess_dir:
        return MultiProcessExposition(metrics, Path(multiprocess_dir))
    return ProcessExposition(metrics)
