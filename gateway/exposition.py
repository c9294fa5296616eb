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

A worker that leaves (discovery removed it) takes every series labelled with it, counters and
histograms included: ``Metrics.forget_worker`` removes them from the registry, and both
expositions drop any series of a worker the registry no longer has (``Metrics.knows_worker``),
because two kinds of series outlive the removal:

* in multiprocess mode, the files: a value once written there cannot be deleted (prometheus-client
  keeps no tombstones, and a dead process's counters are kept on purpose), so every scrape hides
  them. Counters and histograms of a worker that comes back under the same URL continue from
  their old totals (monotonic: no reset for ``rate()``), while its gauges are set afresh by the
  health checks and the requests that follow;
* in either mode, series labelled again after the removal by a request still finishing on the
  worker, or a health check that was in flight: hidden, and in one process removed again after
  the scrape that saw them (in several, their values are in the files anyway).

Cost: per-request metric updates write the mmap'd value under a lock instead of a float under a
lock (measured: see the README's section on ``--processes``); a scrape reads N files, and looks
each series' worker up in a set.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from prometheus_client import Gauge, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.samples import Sample

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
    """One top-K session (or, with ``session_id`` ``None``, one tenant) as the gauges show it."""

    tenant: str
    session_id: str | None
    kv_bytes: int
    budget_ratio: float | None
    """KV in flight / the session's (tenant's) in-flight KV budget; ``None`` when it has none."""


Series = list[tuple[list[str], float]]


def _scrape_series(m: Metrics, top: list[SessionRow], tenants: list[SessionRow],
                   throttled: int) -> list[tuple[Gauge, list[str], Series]]:
    """The gauges computed at scrape time: each with its label names and its series."""
    def ratios(rows: list[SessionRow], labels: Callable[[SessionRow], list[str]]) -> Series:
        return [(labels(r), r.budget_ratio) for r in rows if r.budget_ratio is not None]

    def of_session(r: SessionRow) -> list[str]:
        return [r.tenant, r.session_id or ""]

    def of_tenant(r: SessionRow) -> list[str]:
        return [r.tenant]

    session, tenant = ["tenant", "session"], ["tenant"]
    return [
        (m.session_kv_bytes, session, [(of_session(r), r.kv_bytes) for r in top]),
        (m.session_kv_budget_ratio, session, ratios(top, of_session)),
        (m.tenant_kv_bytes, tenant, [(of_tenant(r), r.kv_bytes) for r in tenants]),
        (m.tenant_kv_budget_ratio, tenant, ratios(tenants, of_tenant)),
        (m.throttled_sessions, [], [([], throttled)]),
    ]


class Exposition(Protocol):
    def track_gate(self, gate: AdmissionGate) -> None:
        """Export the gate's requests in flight and queued."""
        ...

    def show_sessions(self, top: list[SessionRow], tenants: list[SessionRow],
                      throttled: int) -> None:
        """The top-K sessions, the tenants, and the number of throttled sessions and tenants,
        as of this scrape."""
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

    def show_sessions(self, top: list[SessionRow], tenants: list[SessionRow],
                      throttled: int) -> None:
        for gauge, names, series in _scrape_series(self._metrics, top, tenants, throttled):
            if names:
                gauge.clear()
            for labels, value in series:
                (gauge.labels(*labels) if labels else gauge).set(value)

    def render(self) -> bytes:
        m = self._metrics
        shown = _KnownWorkers(m.registry.collect, m)
        body = generate_latest(shown)
        for pool, url in shown.unknown:  # labelled again after it left: remove them again
            m.forget_worker(pool, url)
        return body


class MultiProcessExposition:
    """Every process of the gateway: the shared files, plus the scrape-time gauges."""

    def __init__(self, metrics: Metrics, multiprocess_dir: Path) -> None:
        self._metrics = metrics
        self._files = MultiProcessCollector(None, str(multiprocess_dir))  # type: ignore[no-untyped-call]
        self._gate: AdmissionGate | None = None
        self._scrape_time: list[Metric] = []
        self._scrape_time_names = frozenset(
            _family(g, []).name for g, _, _ in _scrape_series(metrics, [], [], 0))

    def track_gate(self, gate: AdmissionGate) -> None:
        self._gate = gate

    async def run(self) -> None:
        """Copy the gate's counts into this process's files until cancelled."""
        while True:
            if self._gate is not None:
                self._metrics.gateway_inflight.set(self._gate.inflight)
                self._metrics.gateway_queued.set(self._gate.queued)
            await asyncio.sleep(GATE_PUBLISH_S)

    def show_sessions(self, top: list[SessionRow], tenants: list[SessionRow],
                      throttled: int) -> None:
        families: list[Metric] = []
        for gauge, names, series in _scrape_series(self._metrics, top, tenants, throttled):
            family = _family(gauge, names)
            for labels, value in series:
                family.add_metric(labels, value)
            families.append(family)
        self._scrape_time = families

    def collect(self) -> Iterable[Metric]:
        files = _KnownWorkers(self._files.collect, self._metrics)
        for family in files.collect():
            if family.name not in self._scrape_time_names:
                yield family
        yield from self._scrape_time

    def render(self) -> bytes:
        return generate_latest(self)


@dataclass
class _KnownWorkers:
    """The families ``source`` collects, less the series of workers the registry no longer has
    (``unknown``, filled as they are met); series of no worker (``none``: refused before
    routing) stay."""

    source: Callable[[], Iterable[Metric]]
    metrics: Metrics
    unknown: set[tuple[str, str]] = field(default_factory=set)

    def collect(self) -> Iterator[Metric]:
        for family in self.source():
            kept = [s for s in family.samples if self._shown(s)]
            if len(kept) == len(family.samples):
                yield family
                continue
            trimmed = Metric(family.name, family.documentation, family.type, family.unit)
            trimmed.samples = kept
            yield trimmed

    def _shown(self, sample: Sample) -> bool:
        worker = sample.labels.get("worker")
        if worker is None or worker == "none":
            return True
        pool = sample.labels.get("pool", "")
        if self.metrics.knows_worker(pool, worker):
            return True
        self.unknown.add((pool, worker))
        return False


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
