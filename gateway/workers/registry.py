"""The workers of every pool, built from config; the one place that knows who serves what."""

from __future__ import annotations

from collections.abc import Iterator

from gateway.config import PoolSettings
from gateway.workers.worker import Worker


class WorkerRegistry:
    def __init__(self, pools: list[PoolSettings]) -> None:
        self._pools: dict[str, list[Worker]] = {}
        self._by_url: dict[str, Worker] = {}
        for pool in pools:
            workers = [
                Worker(
                    url=w.url,
                    pool=pool.name,
                    kv_events_endpoint=w.kv_events_endpoint,
                    kv_replay_endpoint=w.kv_replay_endpoint,
                )
                for w in pool.workers
            ]
            self._pools[pool.name] = workers
            for w in workers:
                self._by_url[w.url] = w

    def __iter__(self) -> Iterator[Worker]:
        return iter(self._by_url.values())

    def pool(self, name: str) -> list[Worker]:
        return self._pools.get(name, [])

    def get(self, url: str) -> Worker | None:
        return self._by_url.get(url)

    def healthy(self, pool: str, model: str | None = None) -> list[Worker]:
        return [
            w for w in self._pools.get(pool, []) if w.healthy and (model is None or w.serves(model))
        ]

    def served_models(self) -> set[str]:
        out: set[str] = set()
        for w in self._by_url.values():
            if w.healthy and w.models is not None:
                out |= w.models
        return out
