"""Services: everything a route needs, built in the app's lifespan and closed on exit.

Constructors elsewhere do no I/O; ``Services.start`` is where the gateway opens its upstream
client, loads tokenizers and starts health checks, and ``close`` undoes it in reverse order.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import aiohttp
import anyio.to_thread
from prometheus_client import CollectorRegistry

from gateway.config import Settings
from gateway.dispatch import Dispatcher
from gateway.kvindex.events import KvEventsConfig
from gateway.kvindex.index import BlockIndex
from gateway.kvindex.service import PrefixIndex
from gateway.metrics import Metrics
from gateway.prompt.tokenizer import PromptTokenizer, load_tokenizer
from gateway.routing.kv_aware import KvAware
from gateway.routing.policies import make_policy
from gateway.routing.router import DEFAULT_BLOCK_SIZE_TOKENS, Router
from gateway.workers.health import HealthMonitor
from gateway.workers.registry import WorkerRegistry
from gateway.workers.worker import Worker

log = logging.getLogger(__name__)


def sync_worker(index: PrefixIndex, worker: Worker) -> None:
    """Tell the prefix index what the last scrape says about a worker (idempotent)."""
    events = None
    if worker.kv_events_endpoint is not None:
        events = KvEventsConfig(
            endpoint=worker.kv_events_endpoint,
            replay_endpoint=worker.kv_replay_endpoint,
            bind="*" in worker.kv_events_endpoint,
        )
    index.set_worker(
        worker.url,
        worker.stats.block_size_tokens or DEFAULT_BLOCK_SIZE_TOKENS,
        worker.stats.num_gpu_blocks,
        events,
    )


@dataclass
class Services:
    settings: Settings
    registry: CollectorRegistry
    metrics: Metrics
    workers: WorkerRegistry
    router: Router
    client: aiohttp.ClientSession
    health: HealthMonitor
    tokenizers: dict[str, PromptTokenizer]
    dispatcher: Dispatcher
    prefix_index: PrefixIndex | None

    @classmethod
    async def start(cls, settings: Settings) -> Services:
        registry = CollectorRegistry()
        metrics = Metrics(registry)
        workers = WorkerRegistry(settings.pools)
        policies = {p.name: make_policy(p.policy) for p in settings.pools}
        # The prefix index (and its KV-event subscribers) exists only when a pool routes by it.
        prefix_index = (
            PrefixIndex(BlockIndex())
            if any(p.policy == KvAware.name for p in settings.pools) else None
        )
        router = Router(settings.pools, workers, policies, spill=settings.routing.spill,
                        prefix_index=prefix_index)
        t = settings.timeouts
        client = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
            timeout=aiohttp.ClientTimeout(total=None, connect=t.connect_s, sock_read=t.read_s),
            trust_env=False,
            auto_decompress=True,
        )
        tokenizers: dict[str, PromptTokenizer] = {}
        for m in settings.models:
            log.info("loading tokenizer for %s from %s", m.name, m.tokenizer)
            tokenizers[m.name] = await anyio.to_thread.run_sync(load_tokenizer, m.tokenizer)
        on_stats = (
            (lambda w: sync_worker(prefix_index, w)) if prefix_index is not None else None
        )
        health = HealthMonitor(workers, client, settings.health, metrics, on_stats=on_stats)
        dispatcher = Dispatcher(
            settings, router, tokenizers, client, metrics, on_connect_failure=health.report_failure
        )
        services = cls(settings, registry, metrics, workers, router, client, health, tokenizers,
                       dispatcher, prefix_index)
        try:
            if prefix_index is not None:
                for w in workers:  # known before the first scrape: approximate mode at once
                    sync_worker(prefix_index, w)
            await health.start()  # the first scrape brings block sizes, before events open
            if prefix_index is not None:
                await prefix_index.start()
        except BaseException:
            await services.close()
            raise
        return services

    async def close(self) -> None:
        await self.health.close()
        if self.prefix_index is not None:
            await self.prefix_index.close()
        await self.client.close()

    def ready(self) -> tuple[bool, dict[str, int]]:
        """Every pool has at least one healthy worker."""
        counts = {p.name: len(self.workers.healthy(p.name)) for p in self.settings.pools}
        return all(counts.values()), counts
