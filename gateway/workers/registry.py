"""The workers of every pool: the one place that knows who serves what.

A pool's workers are its static list from config plus, when it has ``discovery``, the ready
endpoints Kubernetes reports, replaced as a whole each time they change (``set_discovered``).
With several gateway processes, each worker's load lives in this process's row of the shared
``LoadTable``: a worker claims its slot when it joins and frees it when it leaves.

A disaggregated pool's prefill workers (``pools[].prefill_workers``) are workers like any other
for health checks, scrapes, KV events and load (iteration and ``get`` include them), but are kept
apart from the pool's list: ``healthy`` (what the router picks a client's worker from) never
returns one, ``healthy_prefill`` returns only them. Keeping them in their own list, rather than a
role tested in ``healthy``, leaves the hot path's candidate list exactly as it was.
"""

from __future__ import annotations

from collections.abc import Iterator

from gateway.config import KubernetesDiscoverySettings, PoolSettings
from gateway.workers.load_table import LoadTable
from gateway.workers.worker import Worker


class WorkerRegistry:
    def __init__(self, pools: list[PoolSettings], load_table: LoadTable | None = None) -> None:
        self._load_table = load_table  # opened: workers claim their slots here at once
        self._pools: dict[str, list[Worker]] = {}
        self._by_url: dict[str, Worker] = {}
        self._prefill: dict[str, list[Worker]] = {}
        self._discovered: dict[str, set[str]] = {}
        self._discovered_prefill: dict[str, set[str]] = {}
        for pool in pools:
            self._pools[pool.name] = []
            self._prefill[pool.name] = []
            self._discovered[pool.name] = set()
            self._discovered_prefill[pool.name] = set()
            for prefill, entries in ((False, pool.workers), (True, pool.prefill_workers)):
                for w in entries:
                    self._add(Worker(url=w.url, pool=pool.name,
                                     kv_events_endpoint=w.kv_events_endpoint,
                                     kv_replay_endpoint=w.kv_replay_endpoint, prefill=prefill))

    def _add(self, worker: Worker) -> None:
        if self._load_table is not None:
            worker.load = self._load_table.claim(worker.url)
        (self._prefill if worker.prefill else self._pools)[worker.pool].append(worker)
        self._by_url[worker.url] = worker

    def __iter__(self) -> Iterator[Worker]:
        return iter(list(self._by_url.values()))  # a copy: discovery may change the registry

    def pool(self, name: str) -> list[Worker]:
        return self._pools.get(name, [])

    def get(self, url: str) -> Worker | None:
        return self._by_url.get(url)

    def healthy(self, pool: str, model: str | None = None) -> list[Worker]:
        return [
            w for w in self._pools.get(pool, []) if w.healthy and (model is None or w.serves(model))
        ]

    def prefill_workers(self, name: str) -> list[Worker]:
        """The prefill workers of pool ``name`` (none: not disaggregated)."""
        return self._prefill.get(name, [])

    def healthy_prefill(self, pool: str, model: str | None = None) -> list[Worker]:
        return [
            w for w in self._prefill.get(pool, [])
            if w.healthy and (model is None or w.serves(model))
        ]

    def served_models(self) -> set[str]:
        out: set[str] = set()
        for w in self._by_url.values():
            if w.healthy and w.models is not None and not w.prefill:
                out |= w.models
        return out

    def set_discovered(
        self, pool: str, urls: frozenset[str], discovery: KubernetesDiscoverySettings, *,
        prefill: bool = False,
    ) -> tuple[list[Worker], list[Worker]]:
        """Make the pool's discovered workers (``prefill``: its discovered prefill workers)
        exactly ``urls``; returns (added, removed). A URL that is also a static worker (of any
        pool), or already discovered in the other role, is left to its first entry."""
        current = (self._discovered_prefill if prefill else self._discovered)[pool]
        added: list[Worker] = []
        for url in sorted(urls - current):
            if url in self._by_url:
                continue
            host = url.split("://", 1)[1].rsplit(":", 1)[0]
            worker = Worker(
                url=url, pool=pool,
                kv_events_endpoint=(f"tcp://{host}:{discovery.kv_events_port}"
                                    if discovery.kv_events_port else None),
                kv_replay_endpoint=(f"tcp://{host}:{discovery.kv_replay_port}"
                                    if discovery.kv_replay_port else None),
                prefill=prefill,
            )
            self._add(worker)
            current.add(url)
            added.append(worker)
        removed: list[Worker] = []
        for url in sorted(current - urls):
            current.discard(url)
            worker = self._by_url.pop(url)
            (self._prefill if prefill else self._pools)[pool].remove(worker)
            if self._load_table is not None:
                self._load_table.free(url)
            removed.append(worker)
        return added, removed
