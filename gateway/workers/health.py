"""Active health checks and the periodic /metrics scrape of every worker.

Each worker is probed with ``GET /health`` every ``health.interval_s``; ``healthy_threshold``
consecutive successes mark it up, ``unhealthy_threshold`` consecutive failures (probes, or
connection errors on real requests reported through ``report_failure``) mark it down. When a worker
comes up, its ``/v1/models`` is read so requests for a model only go to workers serving it.
Separately, every ``scrape_interval_s`` its ``/metrics`` is scraped for load and cache facts.

With several gateway processes (a ``HealthBoard``), only the leader probes and scrapes, and
publishes what it saw after each round; followers poll the board and feed the same results into
their own workers (``gateway.workers.health_board`` says how, and why failures seen on requests
stay local).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace

import aiohttp

from gateway.config import HealthSettings
from gateway.metrics import Metrics
from gateway.tasks import cancel_and_wait
from gateway.workers.health_board import Board, HealthBoard, WorkerReport
from gateway.workers.registry import WorkerRegistry
from gateway.workers.vllm_metrics import parse_vllm_metrics
from gateway.workers.worker import VllmStats, Worker

log = logging.getLogger(__name__)

CIRCUIT_STATES = {"closed": 0, "half_open": 1, "open": 2}
# A follower starts serving once it has the leader's first board, as one process does once its
# first checks are done; a leader that takes longer than this (or never comes) is not waited for.
FIRST_BOARD_WAIT_S = 30.0


class HealthMonitor:
    def __init__(
        self,
        registry: WorkerRegistry,
        client: aiohttp.ClientSession,
        settings: HealthSettings,
        metrics: Metrics,
        on_stats: Callable[[Worker], None] | None = None,
        board: HealthBoard | None = None,
        upstream_headers: Mapping[str, Mapping[str, str]] | None = None,
        watch_adapters: bool = False,
    ) -> None:
        self._registry = registry
        # Re-read every worker's /v1/models at each scrape (models[].adapters configured);
        # otherwise only those that export LoRA metrics or list adapters.
        self._watch_adapters = watch_adapters
        self._client = client
        self._settings = settings
        self._timeout = aiohttp.ClientTimeout(total=settings.timeout_s)
        self._metrics = metrics
        self._on_stats = on_stats
        self._board = board
        # pool -> the credential its workers' /v1 routes need (PoolSettings.upstream_headers);
        # /health and /metrics are open in vLLM and get none.
        self._upstream_headers = upstream_headers or {}
        # The leader: what it publishes. A follower: what it has applied, from which leader.
        self._reports: dict[str, WorkerReport] = {}
        self._generation = ""
        self._board_workers: dict[str, WorkerReport] = {}  # a follower: the last board read
        self._tasks: list[asyncio.Task[None]] = []
        for w in registry:
            metrics.add_worker(w.pool, w.url)
            metrics.worker_up.labels(w.pool, w.url).set(0)
            metrics.worker_circuit_state.labels(w.pool, w.url).set(0)

    @property
    def follower(self) -> bool:
        return self._board is not None and not self._board.leader

    async def start(self) -> None:
        if self.follower:
            await self._first_board()
            s = self._settings
            poll_s = min(max(min(s.interval_s, s.scrape_interval_s) / 4, 0.05), 0.5)
            self._tasks = [asyncio.create_task(self._loop(self._follow_round, poll_s))]
            return
        await self.check_all()
        await self.scrape_all()
        self._tasks = [
            asyncio.create_task(self._loop(self.check_all, self._settings.interval_s)),
            asyncio.create_task(self._loop(self.scrape_all, self._settings.scrape_interval_s)),
        ]

    async def close(self) -> None:
        await cancel_and_wait(self._tasks)
        self._tasks = []

    async def _loop(self, fn: Callable[[], Awaitable[None]], period_s: float) -> None:
        while True:
            await asyncio.sleep(period_s)
            try:
                await fn()
            except Exception:  # a bug here must not stop health checking
                log.exception("health loop failed")

    async def adopt(self, worker: Worker) -> None:
        """A worker discovery just added: check and scrape it now rather than at the next tick."""
        self._metrics.add_worker(worker.pool, worker.url)
        self._metrics.worker_up.labels(worker.pool, worker.url).set(0)
        if self.follower:
            self.follow(worker)
            return
        await self._check(worker)
        if worker.healthy:
            await self._scrape(worker)
        self._publish()

    def forget(self, worker: Worker) -> None:
        """A worker discovery removed: drop every series labelled with it (``forget_worker``),
        so dashboards and alerts do not show it forever."""
        worker.healthy = False  # requests still holding it finish; no new ones go there
        self._reports.pop(worker.url, None)
        self._metrics.forget_worker(worker.pool, worker.url)

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(w) for w in self._registry))
        self._publish()

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self._scrape(w) for w in self._registry if w.healthy))
        self._publish()

    # -- several processes: the leader publishes, followers apply ------------------------------

    def _publish(self) -> None:
        if self._board is not None and self._board.leader:
            self._board.publish(self._reports)

    def _report(self, worker: Worker) -> WorkerReport:
        return self._reports.get(worker.url) or WorkerReport()

    async def _follow_round(self) -> None:
        self.follow()

    async def _first_board(self) -> None:
        """Apply the leader's board, waiting for its first round when it has not published yet
        (the processes start together): a follower that took connections before knowing which
        workers are up would answer them 503 ``no_healthy_worker``."""
        assert self._board is not None
        deadline = time.monotonic() + FIRST_BOARD_WAIT_S
        while True:
            board = self._board.read_if_changed()
            if board is not None or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.05)
        if board is None:
            log.warning("no health board from the leader after %.0f s; serving without it",
                        FIRST_BOARD_WAIT_S)
            return
        self._apply_board(board)

    def follow(self, only: Worker | None = None) -> None:
        """Apply the leader's board: to every worker when it changed, or now to ``only`` (a
        worker discovery just added here, which the leader may have checked already)."""
        assert self._board is not None
        board = self._board.read_if_changed()
        if board is not None:
            self._apply_board(board)
        elif only is not None:
            self._apply_known(only)

    def _apply_board(self, board: Board) -> None:
        if board.generation != self._generation:  # a new leader counts from 0 again
            self._generation = board.generation
            self._reports.clear()
        self._board_workers = board.workers
        for worker in self._registry:
            self._apply_known(worker)

    def _apply_known(self, worker: Worker) -> None:
        report = self._board_workers.get(worker.url)
        if report is not None:
            self._apply_report(worker, report)

    def _apply_report(self, worker: Worker, report: WorkerReport) -> None:
        seen = self._report(worker)
        s = self._settings
        cap = max(s.healthy_threshold, s.unhealthy_threshold) + 1
        for ok in report.results_since(seen.checks, cap):
            if ok:
                self.report_ok(worker)
            else:
                self.report_failure(worker)
        if not worker.adapters_changing:  # as _read_models: a list read meanwhile may predate it
            worker.models, worker.models_read = report.models, report.models_read
            worker.adapters = report.adapters
        if report.scrapes != seen.scrapes:
            self._apply_stats(worker, report.stats)
        self._reports[worker.url] = report

    async def _check(self, worker: Worker) -> None:
        try:
            async with self._client.get(f"{worker.url}/health", timeout=self._timeout) as r:
                ok = r.status == 200
        except (aiohttp.ClientError, TimeoutError):
            ok = False
        if ok:
            self.report_ok(worker)
            if not worker.models_read:
                await self._read_models(worker)
        else:
            self.report_failure(worker)
        if self._board is not None:
            self._reports[worker.url] = replace(self._report(worker).checked(ok),
                                                models=worker.models,
                                                models_read=worker.models_read,
                                                adapters=worker.adapters)

    def report_ok(self, worker: Worker) -> None:
        before = worker.circuit
        if worker.record_ok(self._settings.healthy_threshold, time.monotonic(),
                            self._settings.breaker_open_s):
            log.info("worker %s (pool %s) is up (circuit %s)", worker.url, worker.pool,
                     worker.circuit)
            self._metrics.worker_up.labels(worker.pool, worker.url).set(1)
        self._circuit_changed(worker, before)

    def report_request_ok(self, worker: Worker) -> None:
        before = worker.circuit
        worker.record_request_ok()
        self._circuit_changed(worker, before)

    def report_failure(self, worker: Worker) -> None:
        before = worker.circuit
        if worker.record_failure(self._settings.unhealthy_threshold, time.monotonic()):
            log.warning("worker %s (pool %s) is down (circuit open)", worker.url, worker.pool)
            self._metrics.worker_up.labels(worker.pool, worker.url).set(0)
            worker.models_read = False  # re-read when it returns: it may serve another model
        self._circuit_changed(worker, before)

    def _circuit_changed(self, worker: Worker, before: str) -> None:
        if worker.circuit == before:
            return
        labels = (worker.pool, worker.url)
        self._metrics.worker_circuit_state.labels(*labels).set(CIRCUIT_STATES[worker.circuit])
        self._metrics.worker_circuit_transitions.labels(*labels, worker.circuit).inc()

    async def _read_models(self, worker: Worker, *, keep_on_error: bool = False) -> None:
        """The models it serves, and its LoRA adapters: vLLM lists each loaded adapter as a
        card whose ``parent`` is its base model (``OpenAIServingModels.show_available_models``).
        ``keep_on_error``: a periodic re-read that fails keeps what was read before."""
        epoch = worker.adapters_epoch
        try:
            async with self._client.get(f"{worker.url}/v1/models", timeout=self._timeout,
                                        headers=self._upstream_headers.get(worker.pool)) as r:
                r.raise_for_status()
                data = (await r.json(content_type=None)).get("data", [])
            cards = [m for m in data if isinstance(m, dict)]
            models = frozenset(str(m["id"]) for m in cards)
            adapters = {str(m["id"]): str(m["parent"]) for m in cards if m.get("parent")}
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, AttributeError, TypeError):
            log.debug("could not read /v1/models of %s", worker.url)
            if keep_on_error and worker.models_read:
                return
            # Not every OpenAI-compatible backend lists its models: treat it as serving all.
            models, adapters = None, {}
        if worker.adapters_epoch != epoch or worker.adapters_changing:
            return  # the gateway loaded or unloaded one meanwhile: this list may predate it
        worker.models, worker.adapters, worker.models_read = models, adapters, True

    async def _scrape(self, worker: Worker) -> None:
        try:
            async with self._client.get(f"{worker.url}/metrics", timeout=self._timeout) as r:
                r.raise_for_status()
                text = await r.text()
        except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
            return  # health checks decide up/down; a failed scrape keeps the last numbers
        stats = parse_vllm_metrics(text)
        # Adapters come and go at run time (loaded by this gateway, another one, an operator):
        # where they may, each scrape re-reads the list.
        if self._watch_adapters or stats.lora_enabled or worker.adapters:
            await self._read_models(worker, keep_on_error=True)
        if self._board is not None:
            report = self._report(worker)
            self._reports[worker.url] = replace(report, scrapes=report.scrapes + 1, stats=stats,
                                                models=worker.models,
                                                models_read=worker.models_read,
                                                adapters=worker.adapters)
        self._apply_stats(worker, stats)

    def _apply_stats(self, worker: Worker, stats: VllmStats) -> None:
        previous, worker.stats = worker.stats, stats
        labels = (worker.pool, worker.url)
        self._metrics.worker_kv_usage.labels(*labels).set(worker.stats.kv_usage_ratio)
        # The hit ratio of the tokens queried since the last scrape (vLLM's counters are
        # cumulative, so their own ratio barely moves on an old worker); kept when idle.
        queried = worker.stats.prefix_cache_queries_tokens - previous.prefix_cache_queries_tokens
        hits = worker.stats.prefix_cache_hits_tokens - previous.prefix_cache_hits_tokens
        if queried > 0 and hits >= 0:
            self._metrics.worker_prefix_hit.labels(*labels).set(hits / queried)
        elif queried < 0:  # the worker restarted: its counters began again
            self._metrics.worker_prefix_hit.labels(*labels).set(worker.stats.prefix_hit_ratio)
        if self._on_stats is not None:
            self._on_stats(worker)
