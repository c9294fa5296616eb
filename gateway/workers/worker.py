"""A worker: one vLLM (or vLLM-compatible) server, its health and its load as the gateway sees it."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.routing.types import Candidate, LoadSnapshot


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

    @property
    def prefix_hit_ratio(self) -> float:
        q = self.prefix_cache_queries_tokens
        return self.prefix_cache_hits_tokens / q if q > 0 else 0.0


@dataclass(eq=False)
class Worker:
    """Mutable state of one worker; only the event loop touches it (no locks needed)."""

    url: str
    pool: str
    kv_events_endpoint: str | None = None
    kv_replay_endpoint: str | None = None
    healthy: bool = False
    consecutive_ok: int = 0
    consecutive_failures: int = 0
    inflight: int = 0
    inflight_prompt_tokens: int = 0
    stats: VllmStats = field(default_factory=VllmStats)
    models: frozenset[str] | None = None  # None: unknown (not read yet, or not listed): serves all
    models_read: bool = False

    def serves(self, model: str) -> bool:
        return self.models is None or model in self.models

    def snapshot(self) -> LoadSnapshot:
        return LoadSnapshot(
            inflight=self.inflight,
            inflight_prompt_tokens=self.inflight_prompt_tokens,
            running=self.stats.running,
            waiting=self.stats.waiting,
            kv_usage_ratio=self.stats.kv_usage_ratio,
        )

    def candidate(self, cached_tokens: int = 0) -> Candidate:
        return Candidate(
            worker_id=self.url,
            load=self.snapshot(),
            cached_tokens=cached_tokens,
            block_size_tokens=self.stats.block_size_tokens,
        )

    def saturated(self, saturation_inflight: int) -> bool:
        return self.inflight >= saturation_inflight or self.stats.waiting > 0

    def record_ok(self, healthy_threshold: int) -> bool:
        """Count a success; True when this flips the worker up."""
        self.consecutive_failures = 0
        self.consecutive_ok += 1
        if not self.healthy and self.consecutive_ok >= healthy_threshold:
            self.healthy = True
            return True
        return False

    def record_failure(self, unhealthy_threshold: int) -> bool:
        """Count a failure; True when this flips the worker down."""
        self.consecutive_ok = 0
        self.consecutive_failures += 1
        if self.healthy and self.consecutive_failures >= unhealthy_threshold:
            self.healthy = False
            return True
        return False
