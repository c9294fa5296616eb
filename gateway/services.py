"""Services: everything a route needs, built in the app's lifespan and closed on exit.

Constructors elsewhere do no I/O; ``Services.start`` is where the gateway opens its upstream
client, loads tokenizers and starts health checks, and ``close`` undoes it in reverse order.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import anyio.to_thread
from prometheus_client import CollectorRegistry

from gateway.auth import ApiKeys
from gateway.budgets.errors import REJECTION_REASONS, BudgetError
from gateway.budgets.models import SessionUsage
from gateway.budgets.owners import FileOwners, MemoryOwners, ResponseOwners
from gateway.budgets.service import BudgetService
from gateway.budgets.shared import SharedBudgetStore, socket_path
from gateway.config import KubernetesDiscoverySettings, ModelSettings, Runner, Settings
from gateway.dispatch import Dispatcher
from gateway.exposition import Exposition, MultiProcessExposition, SessionRow, exposition_for
from gateway.kvindex.events import KvEventsConfig
from gateway.kvindex.exchange import ReplicaExchange
from gateway.kvindex.index import BlockIndex
from gateway.kvindex.relay import EventRelay
from gateway.kvindex.service import PrefixIndex
from gateway.kvindex.siblings import SiblingRoutes
from gateway.kvmath import load_model_arch
from gateway.metrics import Metrics
from gateway.processes import SINGLE_PROCESS, ProcessRole
from gateway.prompt.pooling import score_encoding_for
from gateway.prompt.tokenizer import PromptTokenizer, load_tokenizer
from gateway.routing.kv_aware import KvAware
from gateway.routing.policies import make_policy
from gateway.routing.router import DEFAULT_BLOCK_SIZE_TOKENS, Router
from gateway.tasks import cancel_and_wait
from gateway.upstream.background import BackgroundWatchers
from gateway.upstream.client import UpstreamClient
from gateway.workers.adapters import AdapterLoader, ModelCatalog
from gateway.workers.discovery import KubernetesDiscovery
from gateway.workers.health import HealthMonitor
from gateway.workers.health_board import HealthBoard
from gateway.workers.load_table import LoadTable
from gateway.workers.registry import WorkerRegistry
from gateway.workers.worker import Worker

log = logging.getLogger(__name__)

KV_EVENT_METRICS_S = 5.0
# The counts of ``SubscriberStats`` exported as ``kvgate_kv_events{what}``.
KV_EVENT_COUNTS = ("batches", "warm_starts", "warm_batches", "gaps", "replays", "resets",
                   "restarts", "reconnects", "disconnects", "duplicates", "decode_errors",
                   "malformed", "refused_peers", "failed_handshakes")



def kv_bytes_per_token(model: ModelSettings) -> int:
    """KV bytes one token of this model holds (kvmath), for budgets; 0 when unknown."""
    source = model.architecture
    if source is None and (Path(model.tokenizer) / "config.json").is_file():
        source = model.tokenizer
    if source is None:
        log.warning("model %s: no architecture configured; KV byte budgets are not enforced"
                    " for it (set models[].architecture)", model.name)
        return 0
    return load_model_arch(source).kv_bytes_per_token(model.kv_dtype)


def response_owners(settings: Settings, role: ProcessRole) -> ResponseOwners:
    """The response-owner map: in Redis with the Redis budget store (shared by every gateway),
    else in a file of the runtime directory shared by the processes of this gateway, or, for
    one process, in its memory."""
    b = settings.budgets
    if b.store == "redis":
        from gateway.budgets.redis_owners import RedisOwners

        assert b.redis_url is not None  # the settings validator guarantees it
        return RedisOwners(b.redis_url, ttl_s=settings.routing.response_owner_ttl_s,
                           key_prefix=b.redis_key_prefix, timeout_s=b.redis_timeout_s,
                           max_connections=b.redis_max_connections,
                           pool_timeout_s=b.redis_pool_timeout_s)
    shared = shared_dir(role)
    if shared is not None:
        return FileOwners(shared / "response-owners.sqlite3", settings.routing.response_owners_max)
    return MemoryOwners(settings.routing.response_owners_max)


def shared_dir(role: ProcessRole) -> Path | None:
    """Where this gateway's processes share worker load, health and KV events; None for one."""
    if role.count == 1:
        return None
    if role.runtime_dir is None:
        raise ValueError(f"{role.count} gateway processes need a runtime_dir to share state in")
    return role.runtime_dir


def replica_exchange(settings: Settings, role: ProcessRole, index: PrefixIndex | None,
                     metrics: Metrics) -> ReplicaExchange | None:
    """The exchange with other gateway replicas (``replicas.exchange``), or None. The processes
    of one gateway share its id (their load is one row of the table already: the leader
    publishes the sum); each sends its own routes."""
    r = settings.replicas
    url = r.redis_url or settings.budgets.redis_url
    if not r.exchange or url is None:
        return None
    gateway_id = None
    if role.count > 1:
        import hashlib
        import socket

        seed = f"{socket.gethostname()}:{role.runtime_dir}".encode()
        gateway_id = hashlib.blake2b(seed, digest_size=8).digest()
    return ReplicaExchange(r, url, index, metrics=metrics, gateway_id=gateway_id,
                           leader=role.leader)


def sync_worker(index: PrefixIndex, worker: Worker) -> None:
    """Tell the prefix index what the last scrape says about a worker (idempotent)."""
    events = None
    if worker.kv_events_endpoint is not None:
        events = KvEventsConfig(
            endpoint=worker.kv_events_endpoint,
            replay_endpoint=worker.kv_replay_endpoint,
            bind="*" in worker.kv_events_endpoint,
            peers=(host,) if (host := urlsplit(worker.url).hostname) else (),
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
    upstream_client: UpstreamClient  # forwards requests (gateway.upstream.client); `client` the rest
    health: HealthMonitor
    tokenizers: dict[str, PromptTokenizer]
    dispatcher: Dispatcher
    prefix_index: PrefixIndex | None
    budgets: BudgetService
    api_keys: ApiKeys
    exposition: Exposition
    role: ProcessRole
    load_table: LoadTable | None = None  # per-worker load shared by the processes (count > 1)
    discoveries: list[KubernetesDiscovery] = field(default_factory=list)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    owners: ResponseOwners | None = None  # which worker stores each Responses answer
    background: BackgroundWatchers | None = None  # background Responses held to their end
    exchange: ReplicaExchange | None = None  # routes, load and snapshots with other replicas
    siblings: SiblingRoutes | None = None  # routes shared with this gateway's other processes
    _kv_events_seen: dict[tuple[str, str], int] = field(default_factory=dict)

    @classmethod
    async def start(cls, settings: Settings, role: ProcessRole = SINGLE_PROCESS) -> Services:
        registry = CollectorRegistry()
        metrics = Metrics(registry)
        shared = shared_dir(role)
        load_table = None
        if shared is not None:
            load_table = LoadTable(shared / "load.table", rows=role.count, own_row=role.index)
            load_table.open()
        workers = WorkerRegistry(settings.pools, load_table)
        policies = {p.name: make_policy(p) for p in settings.pools}
        # The prefix index (and its KV-event subscribers) exists only when a pool routes by it:
        # kv_aware pools, and disaggregated ones (their prefill workers are chosen by kv_aware's
        # cost whatever the pool's own policy).
        prefix_index = (
            PrefixIndex(BlockIndex(), settings=settings.kv_events,
                        relay=EventRelay(shared, role.leader) if shared is not None else None)
            if any(p.policy == KvAware.name or p.disaggregated for p in settings.pools)
            else None
        )
        router = Router(settings.pools, workers, policies, spill=settings.routing.spill,
                        prefix_index=prefix_index,
                        shared_promises=None if load_table is None else load_table.shared)
        exchange = replica_exchange(settings, role, prefix_index, metrics)
        # The exchange carries every process's routes already; without it the siblings share
        # theirs directly (gateway.kvindex.siblings).
        siblings = (SiblingRoutes(prefix_index, shared, role.index, role.count, metrics)
                    if shared is not None and prefix_index is not None and exchange is None
                    else None)
        if exchange is not None:
            for w in workers:  # the peers' load counts from the first request on
                exchange.attach(w)
        t = settings.timeouts
        client = aiohttp.ClientSession(
            # Idle connections are dropped before vLLM's (uvicorn's 5 s keep-alive) would be: a
            # request sent on a connection the worker is closing fails after sending, which is
            # not retried (the worker may have started it: gateway.upstream.placement).
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4),
            timeout=aiohttp.ClientTimeout(total=None, connect=t.connect_s, sock_read=t.read_s),
            trust_env=False,
            auto_decompress=True,
        )
        upstream_client = UpstreamClient()  # every forwarded request: keep-alive pools (4 s idle)
        tokenizers: dict[str, PromptTokenizer] = {}
        for m in settings.models:
            log.info("loading tokenizer for %s from %s", m.name, m.tokenizer)
            tokenizers[m.name] = await anyio.to_thread.run_sync(load_tokenizer, m.tokenizer)
        on_stats = (
            (lambda w: sync_worker(prefix_index, w)) if prefix_index is not None else None
        )
        health = HealthMonitor(
            workers, client, settings.health, metrics, on_stats=on_stats,
            board=HealthBoard(shared / "health.json", role.leader) if shared is not None else None,
            upstream_headers={p.name: p.upstream_headers for p in settings.pools},
            watch_adapters=any(m.adapters for m in settings.models),
        )
        api_keys = ApiKeys(settings.auth, settings.model_aliases)
        if api_keys.required and settings.admin.metrics_token is None and role.leader:
            log.warning("auth.api_keys is set and admin.metrics_token is not: /metrics is open to"
                        " anyone reaching the port, and its top-K series name tenants and"
                        " session ids")
        budgets = BudgetService(
            settings.budgets,  # the memory store of several processes is the supervisor's
            store=(SharedBudgetStore(socket_path(shared))
                   if shared is not None and settings.budgets.store == "memory" else None),
            tenants=api_keys.tenants,
        )
        owners = response_owners(settings, role)
        background = BackgroundWatchers(client, workers.get, metrics)
        dispatcher = Dispatcher(
            settings, router, tokenizers, client, upstream_client, metrics,
            health=health, budgets=budgets, api_keys=api_keys,
            kv_bytes_per_token={m.name: kv_bytes_per_token(m) for m in settings.models},
            score_encodings={m.name: score_encoding_for(m) for m in settings.models
                             if m.runner is Runner.POOLING},
            owners=owners, background=background,
            hash_ahead=prefix_index.hash_ahead if prefix_index is not None else None,
            catalog=ModelCatalog(settings.models, workers),
            adapters=AdapterLoader(settings.models, client, timeout_s=t.read_s,
                                   upstream_headers={p.name: p.upstream_headers
                                                     for p in settings.pools}),
        )
        exposition = exposition_for(metrics, os.environ)
        exposition.track_gate(dispatcher.gate)
        for reason in REJECTION_REASONS:  # the series exist (at 0) before the first rejection
            metrics.budget_rejections.labels(reason)
        services = cls(settings, registry, metrics, workers, router, client, upstream_client, health,
                       tokenizers, dispatcher, prefix_index, budgets, api_keys, exposition,
                       role, load_table, owners=owners, background=background,
                       exchange=exchange, siblings=siblings)
        try:
            await budgets.start()
            await owners.start()
            if prefix_index is not None:
                for w in workers:  # known before the first scrape: approximate mode at once
                    sync_worker(prefix_index, w)
            await health.start()  # the first scrape brings block sizes, before events open
            if siblings is not None:
                siblings.start()
            if prefix_index is not None:
                await prefix_index.start()
                services._spawn(services._sync_kv_event_metrics())
            if exchange is not None:  # the snapshot loads before the gateway reports ready
                await exchange.start()
            services.start_discovery()
            if isinstance(exposition, MultiProcessExposition):
                services._spawn(exposition.run())
        except BaseException:
            await services.close()
            raise
        return services

    def start_discovery(self) -> None:
        """One EndpointSlice watch per pool's ``discovery`` (and ``prefill_discovery``, its
        prefill workers); see ``workers.discovery``."""
        for pool in self.settings.pools:
            for d, prefill in ((pool.discovery, False), (pool.prefill_discovery, True)):
                if d is not None:
                    self._watch(pool.name, d, prefill)

    def _watch(self, pool_name: str, d: KubernetesDiscoverySettings, prefill: bool) -> None:
        watcher = KubernetesDiscovery(d.namespace, d.label_selector, d.port_name,
                                      base_url=d.api_url, scheme=d.scheme)
        self.discoveries.append(watcher)
        role = "prefill worker" if prefill else "worker"

        def on_change(urls: frozenset[str]) -> None:
            added, removed = self.workers.set_discovered(pool_name, urls, d, prefill=prefill)
            for w in removed:
                log.info("discovery: %s %s left pool %s", role, w.url, pool_name)
                self.health.forget(w)
                if self.prefix_index is not None:
                    self.prefix_index.remove_worker(w.url)
                if self.exchange is not None:
                    self.exchange.forget(w.url)
                    for key in [k for k in self._kv_events_seen if k[0] == w.url]:
                        del self._kv_events_seen[key]  # back later: a fresh subscriber
            for w in added:
                log.info("discovery: %s %s joined pool %s", role, w.url, pool_name)
                if self.prefix_index is not None:
                    sync_worker(self.prefix_index, w)
                if self.exchange is not None:
                    self.exchange.attach(w)
                self._spawn(self.health.adopt(w))

        self._spawn(watcher.run(on_change))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def close(self) -> None:
        self.metrics.backlog.flush()  # the request path's deferred bookkeeping (gateway.backlog)
        for watcher in self.discoveries:
            await watcher.close()
        if self.background is not None:  # before the budgets: reservations left to their leases
            await self.background.close()
        await cancel_and_wait(self.tasks)
        await self.health.close()
        await self.budgets.close()
        if self.owners is not None:
            await self.owners.close()
        if self.exchange is not None:  # its last snapshot, while the index is still whole
            await self.exchange.close()
        if self.siblings is not None:
            self.siblings.close()
        if self.prefix_index is not None:
            await self.prefix_index.close()
        await self.client.close()
        self.upstream_client.close()
        if self.load_table is not None:
            self.load_table.close()
        self.metrics.backlog.flush()  # what the background watchers' ends deferred
        self.metrics.flush_adds()

    def sync_kv_event_metrics(self) -> None:
        """Bring ``kvgate_kv_events`` up to each subscriber's counts (called on each /metrics
        scrape and every ``KV_EVENT_METRICS_S``, so every process's counts reach the shared files
        with ``--processes N``). Adds what grew since the last call; a subscriber opened afresh
        (a worker that left and came back) counts from 0 again: its last counts are forgotten
        when it leaves."""
        if self.prefix_index is None:
            return
        for url, stats in self.prefix_index.subscriber_stats().items():
            worker = self.workers.get(url)
            if worker is None:
                continue
            for what in KV_EVENT_COUNTS:
                now = getattr(stats, what)
                key = (url, what)
                before = self._kv_events_seen.get(key, 0)
                if now != before:
                    self._kv_events_seen[key] = now
                    self.metrics.add(self.metrics.kv_events, (worker.pool, url, what),
                                     now - before if now > before else now)

    async def _sync_kv_event_metrics(self) -> None:
        while True:
            await asyncio.sleep(KV_EVENT_METRICS_S)
            self.sync_kv_event_metrics()

    async def refresh_session_metrics(self) -> None:
        """Rebuild the bounded top-K session gauges and the per-tenant ones (called on each
        /metrics scrape): a session that left the top-K loses its series, so 10,000 sessions
        still export at most K; tenants are the configured keys, a bounded set."""
        try:
            top = await self.budgets.sessions()
            tenants = await self.budgets.tenants_usage()
            throttled = await self.budgets.throttled()
        except BudgetError:
            return  # store unavailable under fail_closed: keep the last values
        self.exposition.show_sessions(
            [self._session_row(u) for u in top if u.inflight_kv_bytes > 0],
            [self._session_row(u) for u in tenants if u.inflight_kv_bytes > 0],
            len(throttled))

    def _session_row(self, u: SessionUsage) -> SessionRow:
        limits = self.budgets.limits_for(u.tenant)
        budget = (limits.tenant if u.session_id is None else limits.session).inflight_kv_bytes
        return SessionRow(u.tenant, u.session_id, u.inflight_kv_bytes,
                          u.inflight_kv_bytes / budget if budget else None)

    def ready(self) -> tuple[bool, dict[str, int]]:
        """Every pool has at least one healthy worker."""
        counts = {p.name: len(self.workers.healthy(p.name)) for p in self.settings.pools}
        return all(counts.values()), counts
