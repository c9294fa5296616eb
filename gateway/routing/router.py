"""Steps 3 and 5 of the request path: pick the pool, then ask the pool's policy for a worker.

Pool selection: pools are ordered by context limit; a request goes to the smallest pool whose
limit fits prompt + max output tokens. None fits -> ``ContextLengthExceeded`` before any worker is
touched.

Spill (``routing.spill``): when every healthy worker of that pool serving the model is saturated
(see ``Worker.saturated``), or the pool has no healthy worker at all, the request moves to the next
larger pool that has an unsaturated healthy worker; the decision's reason becomes ``spill``. A
request never moves to a smaller pool: a long prompt on a short-chat worker is exactly the
starvation pools exist to prevent. If no larger pool can take it, it queues in its own pool.

A request for a LoRA adapter (``RoutingRequest.adapter``) has as candidates only the workers that
list it in /v1/models with the request's model as its parent; its prefix lookups are keyed by the
adapter, as vLLM's block hashes are. When none has it, ``place`` names the worker to load it on
(``gateway.workers.adapters``).

Routing reads workers (the registry, each worker's load); workers never read routing: the router
turns a worker into the ``Candidate`` a policy sees (``candidate``).

A disaggregated pool (``pools[].prefill_workers``) is routed in two choices. ``route`` picks the
decode worker exactly as any pool's worker (the pool's policy over its decode workers only: the
registry never lists a prefill worker as a candidate), so a pool without prefill workers pays
nothing for the feature. ``route_prefill`` then picks the prefill worker by the ``kv_aware`` cost
(with the pool's ``kv_aware`` weights, whatever the pool's own policy): the prompt's prefix held
there (KV index, routing history) against the prefill queued there. Prefill is where a prompt's
blocks are computed and cached, so that choice is what is recorded in the routing history; the
decode worker's is recorded too, since it keeps the blocks it pulled (vLLM caches them as its own).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace

from gateway.config import PoolSettings, Priority
from gateway.routing.index_like import (
    EvictionProbingIndex,
    PrefixIndexLike,
    TieredPrefixIndexLike,
)
from gateway.routing.kv_aware import KvAware
from gateway.routing.slo import (
    MAX_HOLD_S,
    SLO_BEST_EFFORT_REASON,
    SLO_HELD_REASON,
    SLO_REASON,
    Promises,
    SharedPromises,
    SloModel,
    SloPlacement,
    SloTarget,
    Tight,
    TightDemand,
    room,
    select,
)
from gateway.routing.types import (
    Candidate,
    Decision,
    LoadSnapshot,
    Policy,
    RoutingRequest,
)
from gateway.workers.registry import WorkerRegistry
from gateway.workers.worker import Worker


class RoutingError(Exception):
    pass


class ContextLengthExceeded(RoutingError):
    def __init__(self, needed_tokens: int, largest_tokens: int) -> None:
        super().__init__(
            f"this request needs {needed_tokens} tokens (prompt + max output tokens), more than the"
            f" largest pool accepts ({largest_tokens} tokens); shorten the prompt or max_tokens"
        )
        self.needed_tokens = needed_tokens
        self.largest_tokens = largest_tokens


class NoHealthyWorker(RoutingError):
    pass


class PoolSaturated(RoutingError):
    """Every healthy worker of the pool is at ``max_inflight_per_worker``."""


class OwnerUnavailable(RoutingError):
    """The worker holding the conversation a request continues cannot take it: down (``gone``
    false: it may come back), or no longer part of the fleet (``gone``: its conversations are
    lost with it)."""

    def __init__(self, message: str, *, gone: bool) -> None:
        super().__init__(message)
        self.gone = gone


class SloUnattainable(RoutingError):
    """No worker of the pool is predicted to meet the request's latency objective, and its
    priority class is shed (``pools[].slo.shed``; ``gateway.routing.slo``)."""

    def __init__(self, message: str, *, pool: str, objective: str, objectives: tuple[str, ...],
                 retry_after_s: float) -> None:
        super().__init__(message)
        self.pool = pool
        self.objective = objective  # the one no worker met: ttft or tpot
        self.objectives = objectives  # every objective the request had (what is counted shed)
        self.retry_after_s = retry_after_s


class SloHold(RoutingError):
    """Not routed yet: the request's class waits in the gateway (``wait_s``, then routes
    again) rather than make requests pending on every worker that fits it miss their latency
    objectives (``gateway.routing.slo``, step 5)."""

    def __init__(self, wait_s: float) -> None:
        super().__init__(f"held {wait_s * 1e3:.0f} ms for requests with objectives ahead")
        self.wait_s = wait_s


@dataclass(frozen=True, init=False)
class Route:
    pool: PoolSettings
    worker: Worker
    decision: Decision
    policy: str
    # What the policy chose among (hit accounting, ``gateway.routing.accounting``): the
    # candidates as it saw them, the longest cached prefix any healthy worker of the pool holds
    # (those below, and those held back at ``max_inflight_per_worker``), and the held-back ones.
    candidates: tuple[Candidate, ...] = ()
    fleet_best_tokens: int = 0
    held_back: tuple[tuple[str, int], ...] = ()  # (worker, cached tokens)
    # The chosen worker's predicted latencies and the objectives in force (``routing.slo``);
    # None for a route no policy chose (an owner placement).
    slo: SloPlacement | None = None

    def __init__(
        self, pool: PoolSettings, worker: Worker, decision: Decision, policy: str,
        candidates: tuple[Candidate, ...] = (), fleet_best_tokens: int = 0,
        held_back: tuple[tuple[str, int], ...] = (), slo: SloPlacement | None = None,
    ) -> None:
        object.__setattr__(self, "pool", pool)
        object.__setattr__(self, "worker", worker)
        object.__setattr__(self, "decision", decision)
        object.__setattr__(self, "policy", policy)
        object.__setattr__(self, "candidates", candidates)
        object.__setattr__(self, "fleet_best_tokens", fleet_best_tokens)
        object.__setattr__(self, "held_back", held_back)
        object.__setattr__(self, "slo", slo)


@dataclass(frozen=True)
class PrefillRoute:
    """The prefill worker of a disaggregated pool chosen for one request."""

    worker: Worker
    decision: Decision


DEFAULT_BLOCK_SIZE_TOKENS = 16  # vLLM's GPU default, until a scrape says otherwise


class Router:
    def __init__(
        self,
        pools: Sequence[PoolSettings],
        registry: WorkerRegistry,
        policies: dict[str, Policy],
        *,
        spill: bool,
        prefix_index: PrefixIndexLike | None = None,
        clock: Callable[[], float] = time.perf_counter,
        shared_promises: Callable[[str], SharedPromises | None] | None = None,
    ) -> None:
        self._pools = sorted(pools, key=lambda p: p.max_context_tokens)
        self._registry = registry
        self._policies = policies
        self._spill = spill
        self._index = prefix_index
        # as an object first: narrowed from PrefixIndexLike, mypy infers an intersection that
        # compiled code (gateway.native) checks as None
        index: object = prefix_index
        self._tiered = index if isinstance(index, TieredPrefixIndexLike) else None
        self._probing = index if isinstance(index, EvictionProbingIndex) else None
        # Only disaggregated pools have one: the prefill worker's cost (``route_prefill``).
        self._prefill_policies = {p.name: KvAware(p.kv_aware) for p in pools if p.disaggregated}
        # Latency objectives: each pool's kv_aware cost (whatever its policy) and its calibrated
        # per-worker models (``gateway.routing.slo``).
        self._slo_costs = {p.name: KvAware(p.kv_aware) for p in pools}
        self._slo_models = {p.name: SloModel(p.slo) for p in pools}
        # ``shared_promises``: the slots of the table the gateway's processes share (one clock
        # for all: perf_counter is CLOCK_MONOTONIC on Linux, one per machine)
        self._promises = {p.name: Promises(shared_promises) for p in pools}
        self._tight = {p.name: TightDemand() for p in pools}
        self._clock = clock

    @property
    def registry(self) -> WorkerRegistry:
        return self._registry

    def slo_model(self, pool: str) -> SloModel:
        """The pool's calibrated latency models (the request path feeds them what it observed)."""
        return self._slo_models[pool]

    def pools_that_fit(self, request: RoutingRequest) -> list[PoolSettings]:
        fit = [p for p in self._pools if p.max_context_tokens >= request.total_tokens]
        if not fit:
            raise ContextLengthExceeded(request.total_tokens, self._pools[-1].max_context_tokens)
        return fit

    def route(self, request: RoutingRequest, exclude: Collection[str] = (),
              slo: SloTarget | None = None, avoid: Collection[str] = ()) -> Route:
        """Choose pool and worker. ``exclude``: workers that already failed this request;
        ``slo``: its latency objectives and class (None: only the pool's defaults apply);
        ``avoid``: workers of the home pool to leave out while another has room (the admission
        gate's room for other tenants, ``gateway.overload``; a preference, not a retry's
        exclusion: with nothing else left they are used)."""
        if request.owner is not None:
            return self._owner_route(request, request.owner, exclude)
        fit = self.pools_that_fit(request)
        if exclude:  # a retry stays in the pool of the worker that failed (spilled or not)
            failed = self._registry.get(next(iter(exclude)))
            home = next((p for p in fit if failed is not None and p.name == failed.pool), fit[0])
            workers = [w for w in self._candidates(home, request, exclude) if _has_room(home, w)]
            if not workers:
                raise NoHealthyWorker(f"no other healthy worker in pool {home.name!r}")
            return self._choose(home, workers, request, spilled=False, slo=slo)
        home = fit[0]
        home_workers = self._candidates(home, request, exclude)
        if self._spill and all(w.saturated(home.saturation_inflight) for w in home_workers):
            for bigger in fit[1:]:
                workers = [
                    w for w in self._candidates(bigger, request, exclude)
                    if not w.saturated(bigger.saturation_inflight) and _has_room(bigger, w)
                ]
                if workers:
                    return self._choose(bigger, workers, request, spilled=True, slo=slo)
        if not home_workers:
            raise NoHealthyWorker(
                f"no healthy worker serves model {request.model!r} in pool {home.name!r}"
            )
        with_room = [w for w in home_workers if _has_room(home, w)]
        if not with_room:
            raise PoolSaturated(
                f"every worker of pool {home.name!r} has {home.max_inflight_per_worker} requests"
                " in flight (max_inflight_per_worker)"
            )
        if avoid:
            with_room = [w for w in with_room if w.url not in avoid] or with_room
        held_back = ([w for w in home_workers if w not in with_room]
                     if len(with_room) < len(home_workers) else [])
        return self._choose(home, with_room, request, spilled=False, held_back=held_back,
                            slo=slo)

    def eviction_probe(self, route: Route,
                       request: RoutingRequest) -> Callable[[int, int], int] | None:
        """For hit accounting: (predicted, delivered) -> the tokens lost because the chosen
        worker's events removed what the prediction counted on after this call; None when the
        index cannot tell (no events for the worker, no token ids, no index)."""
        if self._probing is None or not request.token_ids:
            return None
        return self._probing.eviction_probe(route.worker.url, request.token_ids,
                                            _block_size(route.worker), request.adapter,
                                            request.cache_salt)

    def route_prefill(self, request: RoutingRequest, pool: PoolSettings,
                      exclude: Collection[str] = ()) -> PrefillRoute:
        """The prefill worker of disaggregated ``pool`` for ``request`` (``exclude``: workers
        that failed it), by the ``kv_aware`` cost; ``NoHealthyWorker`` when none can take it."""
        adapter = request.adapter
        workers = [w for w in self._registry.healthy_prefill(pool.name, request.model)
                   if w.url not in exclude and _has_room(pool, w)
                   and (adapter is None or w.adapters.get(adapter) == request.model)]
        if not workers:
            raise NoHealthyWorker(f"no healthy prefill worker serves model {request.model!r}"
                                  f" in pool {pool.name!r}")
        cached: dict[str, tuple[int, int, int]] = {}
        if self._index is not None and request.token_ids:
            cached = self._lookup(request, [(w.url, _block_size(w)) for w in workers])
        decision = self._prefill_policies[pool.name].choose(
            request, [candidate(w, *cached.get(w.url, NOTHING_CACHED)) for w in workers])
        worker = next(w for w in workers if w.url == decision.worker_id)
        if self._index is not None and request.token_ids:
            self._index.record_routed(worker.url, request.token_ids, _block_size(worker), adapter,
                                      request.cache_salt)
        return PrefillRoute(worker, decision)

    def place(self, request: RoutingRequest, eligible: Callable[[Worker], bool]) -> Worker | None:
        """Where to load ``request.adapter``: the worker the pool's policy would choose among the
        ``eligible`` healthy workers serving the base model, in the smallest fitting pool that
        has one (nothing recorded: the load is not the request's routing). None: no such one."""
        for pool in self.pools_that_fit(request):
            workers = [w for w in self._registry.healthy(pool.name, request.model)
                       if eligible(w) and _has_room(pool, w)]
            if workers:
                return self._choose(pool, workers, request, spilled=False, record=False).worker
        return None

    def _owner_route(self, request: RoutingRequest, owner: str,
                     exclude: Collection[str]) -> Route:
        """The owner placement: the worker that holds the conversation, or an error (any other
        worker would answer 404: vLLM keeps a stored conversation in that server's memory). No
        policy chooses, no spill; the reason is ``owner``."""
        worker = self._registry.get(owner)
        if worker is None:
            raise OwnerUnavailable(f"the worker {owner} that stored this response has left the"
                                   " fleet, and its stored responses with it", gone=True)
        if owner in exclude or not worker.healthy:
            raise OwnerUnavailable(f"the worker {owner} that stored this response is down",
                                   gone=False)
        pool = next(p for p in self._pools if p.name == worker.pool)
        if pool.max_context_tokens < request.total_tokens:
            raise ContextLengthExceeded(request.total_tokens, pool.max_context_tokens)
        if not _has_room(pool, worker):
            raise PoolSaturated(f"the worker {owner} that stored this response has"
                                f" {pool.max_inflight_per_worker} requests in flight"
                                " (max_inflight_per_worker)")
        return Route(pool, worker, Decision(owner, "owner"), self._policies[pool.name].name)

    def _candidates(
        self, pool: PoolSettings, request: RoutingRequest, exclude: Collection[str]
    ) -> list[Worker]:
        adapter = request.adapter
        return [w for w in self._registry.healthy(pool.name, request.model)
                if w.url not in exclude
                and (adapter is None or w.adapters.get(adapter) == request.model)]

    def _choose(
        self, pool: PoolSettings, workers: list[Worker], request: RoutingRequest, *,
        spilled: bool, record: bool = True, held_back: Sequence[Worker] = (),
        slo: SloTarget | None = None,
    ) -> Route:
        """``held_back``: healthy workers of the pool left out at their in-flight cap, looked
        up only for the fleet's best (hit accounting)."""
        cached: dict[str, tuple[int, int, int]] = {}
        if self._index is not None and request.token_ids:
            cached = self._lookup(
                request, [(w.url, _block_size(w)) for w in (*workers, *held_back)])
        policy = self._policies[pool.name]
        # Only session affinity reads it (it keeps no session on a saturated worker): no cost
        # for the other pools.
        saturation = pool.saturation_inflight if pool.affinity.by == "session" else None
        candidates = [candidate(w, *cached.get(w.url, NOTHING_CACHED),
                                saturation_inflight=saturation) for w in workers]
        decision = policy.choose(request, candidates)
        decision, placement = self._slo_choose(pool, request, candidates, decision, slo,
                                               record)
        if spilled:
            decision = replace(decision, reason="spill")
        worker = next(w for w in workers if w.url == decision.worker_id)
        if record and self._index is not None and request.token_ids:
            self._index.record_routed(worker.url, request.token_ids, _block_size(worker),
                                      request.adapter, request.cache_salt)
        held = tuple((w.url, cached[w.url][0]) for w in held_back if w.url in cached)
        # vLLM counts a prefix reloaded from a lower tier as cached, so the fleet's best does too
        best = max((t + low for t, _, low in cached.values()), default=0)
        return Route(pool, worker, decision, policy.name, tuple(candidates), best, held,
                     slo=placement)

    def _lookup(
        self, request: RoutingRequest, workers: Sequence[tuple[str, int]]
    ) -> dict[str, tuple[int, int, int]]:
        """Per worker, (GPU cached tokens, pending among them, the tokens past them it holds
        only in a lower KV tier: 0 unless the index keeps tiers): one index query; none for a
        request vLLM serves from no cache (``RoutingRequest.reads_prefix_cache``)."""
        assert self._index is not None
        if not request.reads_prefix_cache:
            return {}
        if self._tiered is not None:
            return self._tiered.cached_pending_lower(request.token_ids, workers,
                                                     request.adapter, request.cache_salt)
        return {w: (c, p, 0) for w, (c, p) in self._index.cached_and_pending(
            request.token_ids, workers, request.adapter, request.cache_salt).items()}

    def _slo_choose(
        self, pool: PoolSettings, request: RoutingRequest, candidates: list[Candidate],
        decision: Decision, slo: SloTarget | None, record: bool = True,
    ) -> tuple[Decision, SloPlacement | None]:
        """The policy's ``decision`` kept, moved to meet the objectives, or refused
        (``SloUnattainable``), by ``gateway.routing.slo.select``; with the chosen worker's
        prediction. Without an objective only the chosen worker of a stream is scored (the
        latency models learn from streams only), and nothing at all for other requests."""
        ttft_s = slo.ttft_s if slo is not None and slo.ttft_s is not None else (
            None if pool.slo.ttft_ms is None else pool.slo.ttft_ms / 1e3)
        tpot_s = slo.tpot_s if slo is not None and slo.tpot_s is not None else (
            None if pool.slo.tpot_ms is None else pool.slo.tpot_ms / 1e3)
        if ttft_s is None and tpot_s is None and not request.stream:
            return decision, None
        costs, model = self._slo_costs[pool.name], self._slo_models[pool.name]
        chosen = next(i for i, c in enumerate(candidates) if c.worker_id == decision.worker_id)
        if ttft_s is None and tpot_s is None:
            c = candidates[chosen]
            return decision, SloPlacement(
                model.predict(c.worker_id, costs.score(request, c).cost, _batch(c)))
        scores = [costs.score(request, c, i) for i, c in enumerate(candidates)]
        predictions = [model.predict(c.worker_id, s.cost, _batch(c))
                       for c, s in zip(candidates, scores, strict=True)]
        target = slo or SloTarget()
        now = self._clock()
        promises = self._promises[pool.name]
        prompt = max(request.prompt_tokens, len(request.token_ids))
        delays = [model.ttft_slope(c.worker_id) * max(prompt - s.cached, 0)
                  for c, s in zip(candidates, scores, strict=True)]
        pack = target.priority is Priority.BATCH
        tight = self._tight[pool.name]
        recent = tight.recent(now) if pack and ttft_s is not None else None
        assessed = [promises.assess(c.worker_id, d, now)
                    for c, d in zip(candidates, delays, strict=True)]
        picked = select(predictions, chosen, [not s.over_hard_limit for s in scores],
                        [c.load.inflight for c in candidates], ttft_s=ttft_s, tpot_s=tpot_s,
                        elapsed_s=target.elapsed_s, shed=target.priority in pool.slo.shed,
                        pack=pack, cached=[s.cached for s in scores],
                        harm=[harmed for harmed, _ in assessed],
                        clear_in_s=[clear_in for _, clear_in in assessed],
                        room=() if recent is None else self._room(
                            pool, request, candidates, [prompt - s.cached for s in scores],
                            recent))
        if picked.hold_s > 0:
            if target.held_s < MAX_HOLD_S:
                raise SloHold(min(picked.hold_s, MAX_HOLD_S - target.held_s))
            picked = replace(picked, hold_s=0.0)  # held long enough: the policy's choice
        if record and not picked.shed:
            p = predictions[picked.index]
            promises.add(p.worker_id, now + p.ttft_s,
                         None if ttft_s is None else now - target.elapsed_s + ttft_s,
                         delays[picked.index], now)
            if not pack and ttft_s is not None and picked.attainable:
                # an objective no worker can meet is no demand to keep room for: a client's
                # ``x-slo-ttft-ms: 1`` would make none clear, and the room the others need gone
                tight.observe(now, prompt - scores[picked.index].cached, ttft_s)
        if picked.shed:
            objectives = tuple(name for name, v in (("ttft", ttft_s), ("tpot", tpot_s))
                               if v is not None)
            header = "x-slo-ttft-ms" if picked.unmet == "ttft" else "x-slo-tpot-ms"
            raise SloUnattainable(
                f"every worker of pool {pool.name!r} that could meet this request's TTFT"
                f" objective ({header}) would make a request already waiting there miss its own;"
                f" {target.priority.value} requests give way (pools[].slo.shed)"
                if picked.gives_way else
                f"no worker of pool {pool.name!r} is predicted to meet this request's"
                f" {picked.unmet.upper()} objective ({header}); {target.priority.value} requests"
                " are refused rather than served late (pools[].slo.shed)",
                pool=pool.name, objective=picked.unmet, objectives=objectives,
                retry_after_s=picked.retry_after_s)
        if picked.moved or not picked.attainable or target.held_s > 0:
            moved = scores[picked.index]
            decision = Decision(moved.candidate.worker_id,
                                SLO_HELD_REASON if target.held_s > 0
                                else SLO_REASON if picked.attainable else SLO_BEST_EFFORT_REASON,
                                moved.cached)
        return decision, SloPlacement(predictions[picked.index], ttft_s, tpot_s)

    def _room(self, pool: PoolSettings, request: RoutingRequest, candidates: list[Candidate],
              uncached: list[int], tight: Tight) -> list[bool]:
        """``gateway.routing.slo.room`` for a batch request: a tight request's predicted TTFT on
        each candidate (its ``kv_aware`` cost there), as it stands and with the batch request's
        ``uncached`` prefill queued ahead of it."""
        costs, model = self._slo_costs[pool.name], self._slo_models[pool.name]
        w = costs.weights
        ref = RoutingRequest(request.model, round(tight.prompt_tokens), 0)
        now_s, after_s = [], []
        for c, u in zip(candidates, uncached, strict=True):
            cost = costs.score(ref, Candidate(c.worker_id, c.load)).cost  # its prefix: uncached
            now_s.append(model.predict(c.worker_id, cost, 1).ttft_s)
            added = w.queued_prefill_weight * max(u, 0) + w.active_request_tokens
            after_s.append(model.predict(c.worker_id, cost + added, 1).ttft_s)
        idle = w.uncached_weight * tight.prompt_tokens
        return room(now_s, after_s,
                    min(model.predict(c.worker_id, idle, 1).ttft_s for c in candidates), tight)


def candidate(worker: Worker, cached_tokens: int = 0, pending_cached_tokens: int = 0,
              lower_tier_cached_tokens: int = 0, *,
              saturation_inflight: int | None = None) -> Candidate:
    """What a policy sees of a worker: its identity, a copy of its gateway-wide load (summed
    over processes), its cached prefix (and the tokens past it held only in a lower KV tier),
    and whether it is saturated at the pool's ``saturation_inflight`` (None: never)."""
    stats = worker.stats
    return Candidate(
        worker_id=worker.url,
        load=LoadSnapshot(
            inflight=worker.gateway_inflight,
            inflight_prompt_tokens=worker.gateway_inflight_prompt_tokens,
            running=stats.running,
            waiting=stats.waiting,
            kv_usage_ratio=stats.kv_usage_ratio,
        ),
        cached_tokens=cached_tokens,
        pending_cached_tokens=pending_cached_tokens,
        lower_tier_cached_tokens=lower_tier_cached_tokens,
        block_size_tokens=stats.block_size_tokens,
        saturated=saturation_inflight is not None and worker.saturated(saturation_inflight),
    )


NOTHING_CACHED = (0, 0, 0)
"""(cached, pending, lower-tier) tokens of a worker the index knows nothing of."""


def _batch(c: Candidate) -> int:
    """The requests a decode step of ``c`` would carry with this one."""
    return max(c.load.inflight, c.load.running + c.load.waiting) + 1


def _has_room(pool: PoolSettings, worker: Worker) -> bool:
    """Below the pool's in-flight cap, and not a half-open circuit's trial already in flight."""
    cap = pool.max_inflight_per_worker
    return (cap is None or worker.gateway_inflight < cap) and worker.accepts_trial()


def _block_size(worker: Worker) -> int:
    return worker.stats.block_size_tokens or DEFAULT_BLOCK_SIZE_TOKENS
