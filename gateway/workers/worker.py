"""A worker: one vLLM (or vLLM-compatible) server, its health and its load as the gateway sees it.

Workers know nothing of routing: the router reads a worker's load and turns it into the
``Candidate`` its policies choose from (``gateway.routing.router.candidate``).

A worker's load has two readings: ``inflight``/``inflight_prompt_tokens``, this process's own
requests (what ``WorkerHold`` adds and takes back), and ``gateway_inflight``/
``gateway_inflight_prompt_tokens``, the whole gateway's, which routing reads. With one process
they are the same numbers (``LocalLoad``); with ``--processes N`` the worker's ``load`` is its slot
in the shared table (``gateway.workers.load_table.SharedLoad``), which adds the other processes'.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class VllmStats:
    """What one scrape of a worker's /metrics says (sums over models/engines on that server)."""

    running: int = 0
    waiting: int = 0
    kv_usage_ratio: float = 0.0
    prefix_cache_queries_tokens: float = 0.0
    prefix_cache_hits_tokens: float = 0.0
    block_size_tokens: int | None = None
    num_gpu_blocks: int | None = None
    lora_enabled: bool = False  # it exports vllm:lora_requests_info (vLLM's --enable-lora)

    @property
    def prefix_hit_ratio(self) -> float:
        q = self.prefix_cache_queries_tokens
        return self.prefix_cache_hits_tokens / q if q > 0 else 0.0


class WorkerLoad(Protocol):
    """Where a worker's in-flight counts live: this process's, and the gateway-wide sums."""

    requests: int
    prefill_tokens: int

    def gateway_requests(self) -> int: ...

    def gateway_prefill_tokens(self) -> int: ...


class LocalLoad:
    """One gateway process: its own counts are the gateway's."""

    __slots__ = ("prefill_tokens", "requests")

    def __init__(self) -> None:
        self.requests = 0
        self.prefill_tokens = 0

    def gateway_requests(self) -> int:
        return self.requests

    def gateway_prefill_tokens(self) -> int:
        return self.prefill_tokens


class PeerLoad:
    """Other gateway replicas' load on one worker, as their last messages said (written by the
    replica exchange, ``gateway.kvindex.exchange``; stale by at most its publish interval, 0
    once every peer went quiet)."""

    __slots__ = ("prefill_tokens", "requests")

    def __init__(self) -> None:
        self.requests = 0
        self.prefill_tokens = 0


class WithPeers:
    """A ``WorkerLoad`` plus the peer replicas' (``replicas.exchange``): this process's counts
    and the gateway's as ``local`` has them, the fleet's for routing. ``local`` is what this
    gateway publishes to its peers (never the sum: that would echo)."""

    __slots__ = ("local", "peers")

    def __init__(self, local: WorkerLoad, peers: PeerLoad) -> None:
        self.local = local
        self.peers = peers

    @property
    def requests(self) -> int:
        return self.local.requests

    @requests.setter
    def requests(self, n: int) -> None:
        self.local.requests = n

    @property
    def prefill_tokens(self) -> int:
        return self.local.prefill_tokens

    @prefill_tokens.setter
    def prefill_tokens(self, n: int) -> None:
        self.local.prefill_tokens = n

    def gateway_requests(self) -> int:
        return self.local.gateway_requests() + self.peers.requests

    def gateway_prefill_tokens(self) -> int:
        return self.local.gateway_prefill_tokens() + self.peers.prefill_tokens


@dataclass(eq=False)
class Worker:
    """Mutable state of one worker; only the event loop touches it (no locks needed)."""

    url: str
    pool: str
    kv_events_endpoint: str | None = None
    kv_replay_endpoint: str | None = None
    # A disaggregated pool's prefill worker: it computes prompts' KV for the pool's other
    # workers to pull, and never answers a client (``gateway.upstream.disagg``).
    prefill: bool = False
    healthy: bool = False
    circuit: str = "closed"  # closed | open | half_open (see record_ok)
    opened_at: float = 0.0
    consecutive_ok: int = 0
    consecutive_failures: int = 0
    stats: VllmStats = field(default_factory=VllmStats)
    models: frozenset[str] | None = None  # None: unknown (not read yet, or not listed): serves all
    models_read: bool = False
    # The LoRA adapters it lists in /v1/models (those are in ``models`` too) -> their base model
    adapters: Mapping[str, str] = field(default_factory=dict)
    # Bumped by each change the gateway makes to the worker's adapters (a load or unload sent,
    # or done), and the changes under way: a /v1/models read that overlapped one is stale and
    # dropped (``AdapterLoader``; ``HealthMonitor._read_models``).
    adapters_epoch: int = 0
    adapters_changing: int = 0
    load: WorkerLoad = field(default_factory=LocalLoad)

    @property
    def inflight(self) -> int:
        """This process's requests in flight on the worker."""
        return self.load.requests

    @inflight.setter
    def inflight(self, n: int) -> None:
        self.load.requests = n

    @property
    def inflight_prompt_tokens(self) -> int:
        """Prompt tokens this process's requests still have to prefill there."""
        return self.load.prefill_tokens

    @inflight_prompt_tokens.setter
    def inflight_prompt_tokens(self, n: int) -> None:
        self.load.prefill_tokens = n

    @property
    def gateway_inflight(self) -> int:
        """Requests in flight on the worker over every process of the gateway."""
        return self.load.gateway_requests()

    @property
    def gateway_inflight_prompt_tokens(self) -> int:
        return self.load.gateway_prefill_tokens()

    def serves(self, model: str) -> bool:
        return self.models is None or model in self.models

    def saturated(self, saturation_inflight: int) -> bool:
        return self.gateway_inflight >= saturation_inflight or self.stats.waiting > 0

    # -- health and circuit breaker ----------------------------------------------------------
    #
    # closed: routable. open: a worker that was up failed `unhealthy_threshold` times in a row
    # (health checks, connection errors, broken streams); nothing is routed to it for at least
    # `open_s`. half_open: after that, enough passing health checks let ONE trial request
    # through at a time (the router enforces it); its success closes the circuit, any failure
    # opens it again at once. A worker never seen up yet is simply down until its checks pass.

    def record_ok(self, healthy_threshold: int, now: float = 0.0, open_s: float = 0.0) -> bool:
        """Count a passing health check; True when this makes the worker routable."""
        self.consecutive_failures = 0
        self.consecutive_ok += 1
        if self.healthy:
            if self.circuit == "half_open" and self.consecutive_ok > healthy_threshold:
                self.circuit = "closed"  # passing checks alone close it too, if no trial comes
            return False
        if self.consecutive_ok < healthy_threshold:
            return False
        if self.circuit == "open":
            if now - self.opened_at < open_s:
                return False
            self.circuit = "half_open"
            self.consecutive_ok = 0
        self.healthy = True
        return True

    def record_request_ok(self) -> bool:
        """A request through this worker succeeded; True when that closes a half-open circuit."""
        if self.circuit == "half_open":
            self.circuit = "closed"
            return True
        return False

    def record_failure(self, unhealthy_threshold: int, now: float = 0.0) -> bool:
        """Count a failure; True when this flips the worker down (opens its circuit)."""
        self.consecutive_ok = 0
        self.consecutive_failures += 1
        if self.healthy and (self.circuit == "half_open"
                             or self.consecutive_failures >= unhealthy_threshold):
            self.healthy = False
            self.circuit = "open"
            self.opened_at = now
            return True
        return False

    def accepts_trial(self) -> bool:
        """Half-open: one request at a time. Closed: no limit here."""
        return self.circuit != "half_open" or self.gateway_inflight == 0
