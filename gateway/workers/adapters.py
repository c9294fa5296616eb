"""Models by name: aliases resolved, LoRA adapters found, and cold adapters loaded on a worker.

A request's ``model`` is a base model (``models[].name``), a LoRA adapter of one (configured in
``models[].adapters``, or listed by a worker's ``/v1/models`` with that model as ``parent``), or
unknown (404 ``model_not_found``, as vLLM answers). An adapter's request is tokenized, budgeted
and pooled as its base model's; only workers that list the adapter serve it (``Router``).

Loading (``AdapterLoader.ensure_loaded``), when no healthy worker has a configured adapter:

1. one load per adapter at a time, gateway process wide: concurrent requests for it await the
   load in flight (``_loads``), never a second one on another worker;
2. the worker: the one the pool's policy would choose (``Router.place``) among the workers with a
   free slot (fewer than ``max_loaded_per_worker`` of the model's adapters, loads in flight
   counted), else among those with an adapter to unload;
3. the unload policy: the least recently routed configured adapter of that model on the worker
   with no request of this process in flight there (an adapter the gateway cannot load again, one
   not in the config, is never unloaded); when every one is busy, 503 ``adapter_slots_busy``;
4. ``POST /v1/unload_lora_adapter``, then ``POST /v1/load_lora_adapter`` (vLLM needs
   ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``); vLLM's "already been loaded" (400) counts as
   loaded. The worker's adapter list is updated at once (the next scrape re-reads it; a read
   that overlaps a load or unload is dropped, as it may list the victim again). A load runs to
   its end in a task of its own, even when every client that asked for it has left.

Bounded: loads are only ever for configured adapters (an unknown name is 404 before any I/O), at
most one per adapter in flight, and the state kept is per (worker, configured adapter).
In-flight counts are this process's (with several processes another one's request may still run
on an unloaded adapter; vLLM then finishes it, as an unload does not abort running requests).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import aiohttp

from gateway.config import ModelSettings
from gateway.workers.registry import WorkerRegistry
from gateway.workers.worker import Worker

log = logging.getLogger(__name__)


@dataclass(frozen=True, init=False)
class Target:
    """What a request's ``model`` names: its base model, and the adapter (None: the base)."""

    base: str
    adapter: str | None = None

    def __init__(self, base: str, adapter: str | None = None) -> None:
        object.__setattr__(self, "base", base)
        object.__setattr__(self, "adapter", adapter)


class AdapterError(Exception):
    """An adapter request that cannot be served: ``status`` and ``code`` for the client."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class ModelCatalog:
    """Resolves a served name to its ``Target``; no I/O (the registry's last reads)."""

    def __init__(self, models: Sequence[ModelSettings], registry: WorkerRegistry) -> None:
        self._bases = frozenset(m.name for m in models)
        self._configured = {a.name: m.name for m in models for a in m.adapters}
        self._registry = registry

    def resolve(self, name: str) -> Target | None:
        if name in self._bases:
            return Target(name)
        base = self._configured.get(name)
        if base is not None:
            return Target(base, name)
        for worker in self._registry:  # an adapter some worker lists (loaded by an operator)
            parent = worker.adapters.get(name)
            if worker.healthy and parent in self._bases:
                return Target(parent, name)
        return None

    def loaded_adapters(self) -> dict[str, str]:
        """Every adapter a healthy worker lists, of a configured model -> that model."""
        out: dict[str, str] = {}
        for worker in self._registry:
            if worker.healthy:
                out.update((a, p) for a, p in worker.adapters.items() if p in self._bases)
        return out


Place = Callable[[Callable[[Worker], bool]], Worker | None]
"""``Router.place`` for the request: the worker to load on among those the predicate allows."""


class AdapterLoader:
    """Loads configured adapters on workers, bounded per worker; counts adapter requests."""

    def __init__(
        self,
        models: Sequence[ModelSettings],
        session: aiohttp.ClientSession,
        *,
        timeout_s: float,
        upstream_headers: Mapping[str, Mapping[str, str]] | None = None,
    ) -> None:
        self._paths = {a.name: a.path for m in models for a in m.adapters}
        self._max = {m.name: m.max_loaded_per_worker for m in models}
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._headers = upstream_headers or {}
        self._loads: dict[str, tuple[Worker, asyncio.Task[None]]] = {}  # adapter -> its load
        self._inflight: Counter[tuple[str, str]] = Counter()  # (worker url, adapter)
        self._last_routed: dict[tuple[str, str], int] = {}
        self._clock = itertools.count(1)

    def configured(self, adapter: str) -> bool:
        return adapter in self._paths

    # -- requests ----------------------------------------------------------------------------

    def routed(self, worker: str, adapter: str) -> None:
        key = (worker, adapter)
        self._inflight[key] += 1
        self._last_routed[key] = next(self._clock)

    def finished(self, worker: str, adapter: str) -> None:
        key = (worker, adapter)
        self._inflight[key] -= 1
        if self._inflight[key] <= 0:
            del self._inflight[key]

    def inflight(self, worker: str, adapter: str) -> int:
        return self._inflight[(worker, adapter)]

    # -- loading -----------------------------------------------------------------------------

    async def ensure_loaded(self, target: Target, place: Place) -> Worker:
        """Load ``target.adapter`` on one worker (or wait for its load in flight); the worker."""
        adapter = target.adapter
        if adapter is None or adapter not in self._paths:
            raise AdapterError(404, f"The model `{adapter}` does not exist.", "model_not_found")
        running = self._loads.get(adapter)
        if running is None:
            worker, victim = self._choose(target, place)
            # Marked before any await: a load chosen in the same loop step must not pick the
            # same victim, and a /v1/models read under way must not list it again.
            worker.adapters_changing += 1
            if victim is not None:
                _forget(worker, victim)  # no new request goes to it while it is unloaded
            # A task of its own: a client that leaves does not abandon the load half done (the
            # worker may have loaded it while the gateway no longer counted it).
            running = (worker, asyncio.create_task(self._load(worker, victim, adapter, target)))
            running[1].add_done_callback(_retrieve)
            self._loads[adapter] = running
        # Counted in flight while it waits: a load for another adapter must not unload this one
        # in the moment between its load's end and the request's routing.
        key = (running[0].url, adapter)
        self._inflight[key] += 1
        try:
            await asyncio.shield(running[1])
        finally:
            self.finished(*key)
        return running[0]

    def _choose(self, target: Target, place: Place) -> tuple[Worker, str | None]:
        """The worker to load ``target.adapter`` on, and the adapter to unload there first."""
        limit = self._max[target.base]
        worker = place(lambda w: self._loaded(w, target.base) < limit)
        if worker is not None:
            return worker, None
        worker = place(lambda w: self._victim(w, target.base) is not None)
        if worker is None and place(lambda w: True) is None:
            raise AdapterError(503, f"no healthy worker serves model `{target.base}` to"
                               f" load adapter `{target.adapter}` on", "no_healthy_worker")
        if worker is None:
            raise AdapterError(
                503, f"no worker can load adapter `{target.adapter}` now: every worker serving"
                f" `{target.base}` has {limit} of its adapters loaded"
                " (models[].max_loaded_per_worker), each with requests in flight; retry"
                " later", "adapter_slots_busy")
        return worker, self._victim(worker, target.base)

    async def _load(self, worker: Worker, victim: str | None, adapter: str,
                    target: Target) -> None:
        # While it runs (``adapters_changing``, counted by ``ensure_loaded``), reads of the
        # worker's /v1/models are dropped (health.py): one read between the unload sent and
        # done would list the victim again, and a second load could pick it too.
        try:
            if victim is not None:
                await self._post(worker, "/v1/unload_lora_adapter", {"lora_name": victim},
                                 ok_statuses=(200, 404))
                log.info("unloaded adapter %s from %s for %s", victim, worker.url, adapter)
            await self._post(worker, "/v1/load_lora_adapter",
                             {"lora_name": adapter, "lora_path": self._paths[adapter]},
                             ok_statuses=(200,), already=True)
            worker.adapters = {**worker.adapters, adapter: target.base}
            if worker.models is not None:
                worker.models = worker.models | {adapter}
            log.info("loaded adapter %s on %s", adapter, worker.url)
        finally:
            worker.adapters_changing -= 1
            worker.adapters_epoch += 1
            self._loads.pop(adapter, None)

    def _loaded(self, worker: Worker, base: str) -> int:
        """The model's adapters on ``worker``, with the loads in flight there."""
        listed = sum(1 for p in worker.adapters.values() if p == base)
        loading = sum(1 for a, (w, _) in self._loads.items()
                      if w is worker and a not in worker.adapters)
        return listed + loading

    def _victim(self, worker: Worker, base: str) -> str | None:
        """The adapter to unload for another: least recently routed, configured, idle."""
        idle = [a for a, p in worker.adapters.items()
                if p == base and a in self._paths and a not in self._loads
                and self._inflight[(worker.url, a)] == 0]
        return min(idle, key=lambda a: self._last_routed.get((worker.url, a), 0), default=None)

    async def _post(self, worker: Worker, path: str, body: dict[str, str], *,
                    ok_statuses: tuple[int, ...], already: bool = False) -> None:
        try:
            async with self._session.post(f"{worker.url}{path}", json=body,
                                          timeout=self._timeout,
                                          headers=self._headers.get(worker.pool)) as r:
                text = await r.text()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise AdapterError(502, f"worker {worker.url} failed {path}: {type(exc).__name__}",
                               "upstream_error") from None
        if r.status in ok_statuses or (already and r.status == 400
                                       and "already been loaded" in text):
            return
        raise AdapterError(502, f"worker {worker.url} answered {path} with {r.status}:"
                           f" {text[:300]}", "adapter_load_failed")


def _retrieve(task: asyncio.Task[None]) -> None:
    """A load's error reaches its waiters; retrieved here too, for a load none waits on."""
    if not task.cancelled():
        task.exception()


def _forget(worker: Worker, adapter: str) -> None:
    """Drop ``adapter`` from the worker's list, and any list read meanwhile (the epoch)."""
    worker.adapters = {a: p for a, p in worker.adapters.items() if a != adapter}
    worker.adapters_epoch += 1
