"""Every Prometheus metric kvgate exports, defined once, against a registry passed in.

Labels come from small fixed sets (pool and worker names from config, policy and reason names from
code, HTTP status codes); a raw session id never becomes a label except in the bounded top-K
``kvgate_session_kv_bytes`` gauge, whose ids are sanitised first. The request path takes its
labelled series through ``Metrics.child`` (each looked up once); ``forget_worker`` is the one
place a worker's series go. What the request path records only for later readers it defers to
``Metrics.backlog`` (``gateway.backlog``: run ``DELAY_S`` later, off a stream wave), so a
reader that must see every request ended so far (the ``/metrics`` scrape) flushes it first.
"""

from __future__ import annotations

import asyncio
import bisect
import math
import warnings
from collections.abc import Callable
from typing import Any, TypeVar, cast

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.metrics import MetricWrapperBase

from gateway.backlog import Backlog

M = TypeVar("M", bound=MetricWrapperBase)

# The *_created series double the exposition for no use on dashboards.
disable_created_metrics()  # type: ignore[no-untyped-call]

# TTFT: from 5 ms (a cached short prompt) to a minute (a 128K-token prefill queued behind others).
TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)
# TPOT: decode steps are memory-bound, 5-100 ms typical; up to 1 s under heavy batching.
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0)
DURATION_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        # the request path's deferred bookkeeping (metrics, hit accounting, latency models)
        self.backlog = Backlog()
        pw = ("pool", "worker")
        self.requests = Counter(
            "kvgate_requests",
            "Requests answered, by pool, worker and HTTP status (pool/worker 'none' when refused"
            " before routing).",
            ("pool", "worker", "code"),
            registry=registry,
        )
        self.ttft = Histogram(
            "kvgate_ttft_seconds",
            "Time to first token measured at the gateway: request received to first content byte.",
            pw,
            buckets=TTFT_BUCKETS_S,
            registry=registry,
        )
        self.tpot = Histogram(
            "kvgate_tpot_seconds",
            "Time per output token after the first, per streamed request.",
            pw,
            buckets=TPOT_BUCKETS_S,
            registry=registry,
        )
        self.duration = Histogram(
            "kvgate_request_duration_seconds",
            "Request duration at the gateway, first byte in to last byte out.",
            pw,
            buckets=DURATION_BUCKETS_S,
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "kvgate_prompt_tokens", "Prompt tokens routed, counted by the gateway.", ("pool",),
            registry=registry,
        )
        self.predicted_cached_tokens = Counter(
            "kvgate_predicted_cached_tokens",
            "Prompt tokens the router predicted the chosen worker already held in KV cache.",
            ("pool",),
            registry=registry,
        )
        self.routing_decisions = Counter(
            "kvgate_routing_decisions",
            "Routing decisions by pool, policy and reason.",
            ("pool", "policy", "reason"),
            registry=registry,
        )
        self.worker_up = Gauge(
            "kvgate_worker_up", "1 when the worker passes health checks.", pw,
            multiprocess_mode="livemax", registry=registry,
        )
        self.worker_circuit_state = Gauge(
            "kvgate_worker_circuit_state",
            "Circuit breaker of the worker: 0 closed, 1 half-open (one trial request at a time),"
            " 2 open (no requests).",
            pw,
            multiprocess_mode="livemax", registry=registry,
        )
        self.worker_circuit_transitions = Counter(
            "kvgate_worker_circuit_transitions",
            "Circuit breaker transitions, by the state entered.",
            ("pool", "worker", "to"),
            registry=registry,
        )
        self.worker_inflight = Gauge(
            "kvgate_worker_inflight", "Requests this gateway has open on the worker.", pw,
            multiprocess_mode="livesum", registry=registry,
        )
        self.worker_kv_usage = Gauge(
            "kvgate_worker_kv_usage_ratio",
            "KV cache usage of the worker, 0..1 (vllm:kv_cache_usage_perc, last scrape).",
            pw,
            multiprocess_mode="livemostrecent", registry=registry,
        )
        self.worker_prefix_hit = Gauge(
            "kvgate_worker_prefix_cache_hit_ratio",
            "Prefix cache hit ratio of the worker, in tokens, between the last two scrapes of its"
            " vLLM counters (unchanged while it is idle).",
            pw,
            multiprocess_mode="livemostrecent", registry=registry,
        )
        self.session_kv_bytes = Gauge(
            "kvgate_session_kv_bytes",
            "KV bytes held in flight by the top-K sessions (bounded; others are not exported),"
            " by tenant (API key) and session.",
            ("tenant", "session"),
            registry=registry,
        )
        self.session_kv_budget_ratio = Gauge(
            "kvgate_session_kv_budget_ratio",
            "KV bytes held in flight / the session's in-flight KV budget, for the top-K sessions"
            " (what the runaway-session alert watches).",
            ("tenant", "session"),
            registry=registry,
        )
        self.tenant_kv_bytes = Gauge(
            "kvgate_tenant_kv_bytes",
            "KV bytes held in flight by each tenant (API key), summed over its sessions; tenants"
            " holding none are not exported.",
            ("tenant",),
            registry=registry,
        )
        self.tenant_kv_budget_ratio = Gauge(
            "kvgate_tenant_kv_budget_ratio",
            "KV bytes held in flight / the tenant's in-flight KV budget (what the runaway-tenant"
            " alert watches: a tenant spreading its load over many session ids).",
            ("tenant",),
            registry=registry,
        )
        self.budget_rejections = Counter(
            "kvgate_budget_rejections",
            "Requests refused by budgets, throttles or rate limits, by reason (the error code).",
            ("reason",),
            registry=registry,
        )
        self.throttled_sessions = Gauge(
            "kvgate_throttled_sessions",
            "Sessions and whole tenants currently throttled or blocked.",
            registry=registry,
        )
        self.gateway_inflight = Gauge(
            "kvgate_gateway_inflight_requests",
            "Completions this gateway is serving (limits.max_inflight_requests caps it).",
            multiprocess_mode="livesum", registry=registry,
        )
        self.gateway_queued = Gauge(
            "kvgate_gateway_queued_requests",
            "Completions waiting in the admission queue (limits.max_queued_requests caps it).",
            multiprocess_mode="livesum", registry=registry,
        )
        self.resumed_streams = Counter(
            "kvgate_resumed_streams",
            "Chat streams continued on another worker after theirs died (routing.resume_streams).",
            ("pool",),
            registry=registry,
        )
        self.upstream_retries = Counter(
            "kvgate_upstream_retries",
            "Requests retried on another worker after a connection failure before any byte.",
            ("pool",),
            registry=registry,
        )
        # Disaggregated pools (``gateway.upstream.disagg``): the TTFT of a two-step request split
        # into its prefill step (on the prefill worker) and its decode step's first token (on
        # the decode worker: the KV transfer included).
        self.prefill_seconds = Histogram(
            "kvgate_prefill_seconds",
            "Prefill step of a disaggregated request: sent to the prefill worker to its answer"
            " (kv_transfer_params) read.",
            pw,
            buckets=TTFT_BUCKETS_S,
            registry=registry,
        )
        self.decode_first_token = Histogram(
            "kvgate_decode_first_token_seconds",
            "Decode step of a disaggregated stream: sent to the decode worker to its first token"
            " (the KV transfer from the prefill worker included).",
            pw,
            buckets=TTFT_BUCKETS_S,
            registry=registry,
        )
        self.prefill_requests = Counter(
            "kvgate_prefill_requests",
            "Prefill steps of disaggregated requests by pool, prefill worker and code: the"
            " worker's HTTP status, else what the client got (502 unreachable or no usable"
            " kv_transfer_params, 504 timeout, 499 cancelled: the client left, or a stream's"
            " first_token_s ran out).",
            ("pool", "worker", "code"),
            registry=registry,
        )
        self.prefill_decisions = Counter(
            "kvgate_prefill_decisions",
            "Prefill workers chosen for disaggregated requests, by pool and kv_aware reason.",
            ("pool", "reason"),
            registry=registry,
        )
        # Hit accounting (``gateway.routing.accounting``): every prompt token of a routed chat or
        # completions request, by outcome; the outcomes sum to the prompt tokens accounted.
        self.prefix_tokens = Counter(
            "kvgate_prefix_tokens",
            "Prompt tokens of routed requests by outcome: delivered (vLLM's cached_tokens),"
            " never_seen (no worker held them), load / kv_pressure (a holder passed over),"
            " stale_index / evicted / mismatch (predicted at the chosen worker, not delivered),"
            " unknown (no cached_tokens in the answer).",
            ("pool", "outcome"),
            registry=registry,
        )
        self.prefix_mismatch = Gauge(
            "kvgate_prefix_cache_mismatch",
            "1 while vLLM delivers far below the predicted cached tokens for the whole model (a"
            " tokenizer or chat template that differs from the server's), else 0.",
            ("model",),
            multiprocess_mode="livemax", registry=registry,
        )
        # Latency objectives (``gateway.routing.slo``).
        self.slo_requests = Counter(
            "kvgate_slo_requests",
            "Requests with a latency objective (x-slo-ttft-ms / x-slo-tpot-ms, a key's or a"
            " pool's default), by pool, objective (ttft, tpot) and outcome: met / missed"
            " (measured on streamed answers; an answer that failed at the worker is missed),"
            " shed (refused: no worker predicted to meet it, pools[].slo.shed).",
            ("pool", "slo", "outcome"),
            registry=registry,
        )
        self.slo_prediction_ratio = Gauge(
            "kvgate_slo_prediction_ratio",
            "Observed / predicted TTFT (from routing) or TPOT of the worker's streamed answers,"
            " exponentially weighted over pools[].slo.half_life_requests (1: calibrated).",
            ("pool", "worker", "slo"),
            multiprocess_mode="livemostrecent", registry=registry,
        )
        self.kv_events = Counter(
            "kvgate_kv_events",
            "What each worker's KV event subscriber saw, by what: batches (applied), warm_starts"
            " and warm_batches (history replayed when it started the worker fresh), gaps,"
            " replays (gaps closed by replay), resets (the worker's entries dropped: publisher"
            " restart, unrecoverable gap), restarts, reconnects, disconnects, duplicates,"
            " decode_errors, malformed, refused_peers, failed_handshakes. Summed over the"
            " gateway's processes (each subscribes).",
            ("pool", "worker", "what"),
            registry=registry,
        )
        self.replica_exchange_messages = Counter(
            "kvgate_replica_exchange_messages",
            "Replica exchange messages (replicas.exchange), by direction: sent, received"
            " (applied), own (this gateway's, ignored), malformed (ignored), failed (Redis"
            " unavailable: not sent), dropped (routes over max_bytes_per_s or the queue bound;"
            " counts routes, not messages).",
            ("direction",),
            registry=registry,
        )
        self.sibling_routes = Counter(
            "kvgate_sibling_routes",
            "Routes shared among the gateway's own processes (--processes N, gateway.kvindex."
            "siblings), by direction: sent and received (messages), dropped (messages a sibling"
            " could not take: not up, restarting, its buffer full; routes over the queue bound),"
            " malformed (ignored).",
            ("direction",),
            registry=registry,
        )
        self.replica_exchange_bytes = Counter(
            "kvgate_replica_exchange_bytes",
            "Bytes of replica exchange messages, by direction: sent, received.",
            ("direction",),
            registry=registry,
        )
        self.replica_peers = Gauge(
            "kvgate_replica_peers",
            "Other gateway replicas heard within replicas.peer_timeout_s (their load counts).",
            multiprocess_mode="livemax", registry=registry,
        )
        self.replica_snapshots = Counter(
            "kvgate_replica_snapshots",
            "Index snapshots (replicas.snapshot), by outcome: written, loaded (at start), none"
            " (none to load), failed (Redis unavailable or a malformed snapshot).",
            ("outcome",),
            registry=registry,
        )
        self._children: dict[tuple[MetricWrapperBase, tuple[str, ...]], Any] = {}
        self._adders: dict[tuple[MetricWrapperBase, tuple[str, ...]], Callable[[float], None]] = {}
        self._pending_adds: dict[tuple[MetricWrapperBase, tuple[str, ...]], float] = {}
        self._pending_observations: dict[tuple[Histogram, tuple[str, ...]], list[float]] = {}
        # Every metric labelled (pool, worker, ...): what a worker that leaves takes with it.
        self._per_worker: tuple[MetricWrapperBase, ...] = (
            self.requests, self.ttft, self.tpot, self.duration, self.worker_up,
            self.worker_circuit_state, self.worker_circuit_transitions, self.worker_inflight,
            self.worker_kv_usage, self.worker_prefix_hit, self.prefill_seconds,
            self.decode_first_token, self.prefill_requests, self.slo_prediction_ratio,
            self.kv_events)
        self._workers: set[tuple[str, str]] = set()  # (pool, url) of the workers in the registry

    def child(self, metric: M, *labels: str) -> M:
        """``metric.labels(*labels)``, looked up once: the request path labels about ten series per
        request, and ``labels()`` costs ~0.9 us a call (argument checks, ``str()`` of each value,
        a lock) where a dict lookup costs ~0.05 us."""
        key = (metric, labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return cast(M, found)

    def add(self, metric: Counter, labels: tuple[str, ...], amount: float = 1) -> None:
        """``child(metric, *labels).inc(amount)`` for the request path's counters (5 or more
        a request), summed per series until the end of this event-loop iteration and then
        added to each series once (``flush_adds``, scheduled by the first add of an iteration;
        at once with no running loop). Each ``inc`` of a prometheus-client value takes a lock,
        and in multiprocess mode writes the value file (``MmapedValue``: ~2 us an add, ~4% of a
        short request's CPU with ``--processes 2``); under load an iteration holds several
        requests' adds, most of them to the same few series. Still exact and still prompt: the
        adds land before the loop polls for I/O again, so before any scrape is read, and a
        process that dies loses none it made in an earlier iteration. The child's value is
        incremented directly, skipping ``Counter.inc`` and its checks: ``amount`` must be >= 0;
        prometheus-client's private ``_value`` is pinned by ``tests/unit/test_metrics.py``."""
        key = (metric, labels)
        pending = self._pending_adds
        if key in pending:
            pending[key] += amount
            return
        if not pending and not self._pending_observations:
            try:
                asyncio.get_running_loop().call_soon(self.flush_adds)
            except RuntimeError:  # no loop: nothing to batch with
                self._inc(key, amount)
                return
        pending[key] = amount

    def observe(self, metric: Histogram, labels: tuple[str, ...], value: float) -> None:
        """``child(metric, *labels).observe(value)`` for the request path's latencies, batched
        as ``add`` batches counts: the iteration's observations of a series are added to its
        sum and buckets once each (``flush_adds``), where ``Histogram.observe`` took the lock
        (and in multiprocess mode wrote the file) twice per observation. Same buckets, same
        sum; prometheus-client's private ``_sum``, ``_buckets`` and ``_upper_bounds`` are pinned
        by ``tests/unit/test_metrics.py``."""
        key = (metric, labels)
        pending = self._pending_observations
        values = pending.get(key)
        if values is not None:
            values.append(value)
            return
        if not pending and not self._pending_adds:
            try:
                asyncio.get_running_loop().call_soon(self.flush_adds)
            except RuntimeError:  # no loop: nothing to batch with
                self._observe_all(key, [value])
                return
        pending[key] = [value]

    def flush_adds(self) -> None:
        """Add what ``add`` summed and ``observe`` gathered since the last flush to the series."""
        adds, observations = self._pending_adds, self._pending_observations
        if adds:
            self._pending_adds = {}
            for key, amount in adds.items():
                self._inc(key, amount)
        if observations:
            self._pending_observations = {}
            for hkey, values in observations.items():
                self._observe_all(hkey, values)

    def _inc(self, key: tuple[MetricWrapperBase, tuple[str, ...]], amount: float) -> None:
        inc = self._adders.get(key)
        if inc is None:
            counter = self.child(cast(Counter, key[0]), *key[1])
            inc = self._adders[key] = counter._value.inc
        inc(amount)

    def _observe_all(self, key: tuple[Histogram, tuple[str, ...]], values: list[float]) -> None:
        child = self.child(key[0], *key[1])
        bounds: list[float] = child._upper_bounds
        counts = [0] * len(bounds)
        for value in values:
            if value == value:  # a NaN falls in no bucket, as in Histogram.observe
                counts[bisect.bisect_left(bounds, value)] += 1  # the first bound >= value
        child._sum.inc(math.fsum(values))
        buckets = child._buckets
        for i, n in enumerate(counts):
            if n:
                buckets[i].inc(n)

    def add_worker(self, pool: str, url: str) -> None:
        """A worker joined (configured, or discovered): its series are exported from now on."""
        self._workers.add((pool, url))

    def knows_worker(self, pool: str, url: str) -> bool:
        """Whether series labelled with this worker are exported (``gateway.exposition``)."""
        return (pool, url) in self._workers

    def forget_worker(self, pool: str, url: str) -> None:
        """A worker left (discovery removed it): every series labelled with it goes, counters
        and histograms too, with the children held for it; if it comes back under the same URL
        (``add_worker``) its series start afresh. Series that a request still finishing there,
        or a health check in flight, labels again are not exported (``knows_worker``)."""
        self._workers.discard((pool, url))
        self.flush_adds()  # what it counted goes with its series
        with warnings.catch_warnings():
            # In multiprocess mode prometheus-client warns that removal cannot reach the value
            # files; it cannot, and gateway.exposition hides those values by knows_worker.
            warnings.simplefilter("ignore", UserWarning)
            for metric in self._per_worker:
                metric.remove_by_labels({"pool": pool, "worker": url})
        for key in [k for k in self._children
                    if k[1][:2] == (pool, url) and k[0] in self._per_worker]:
            del self._children[key]
            self._adders.pop(key, None)
