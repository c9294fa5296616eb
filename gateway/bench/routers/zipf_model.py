"""The ``zipf_hot`` scenario in model time: kvgate's routing and the peers' ``cache_aware``
policy on the simulator's scheduler, no clock and no host.

``python -m gateway.bench.routers.zipf_model`` runs the scenario's workload (``scenario_zipf``:
8 H100s, 64 system prompts of 3K tokens with Zipf popularity s = 1.1, 512-token questions,
16-token answers, open loop 18 req/s at time scale 8) through

* kvgate: the gateway's real ``Router`` with ``kv_aware`` (hot prefixes on or off) over the real
  ``PrefixIndex``, fed the simulator's own KV events through the wire format and the gateway's
  ``EventApplier``, published when each step ends as the simulator publishes them; the load the
  gateway sees as it sees it: its in-flight requests and their uncached prefill (taken back at
  the first token), vLLM's running/waiting/KV usage from a scrape every ``scrape_interval_s``;
* ``cache_aware``: the policy sglang-router 0.3.2 and vllm-router 0.1.17 document and run
  (``PeerCacheAware``): the shortest queue when the load is imbalanced (a gap of 64 requests
  and 1.5x), else the worker whose approximate tree matches most of the prompt when over half
  of it matches, else the worker with the smallest tree;

each worker being the simulator's scheduler (vLLM's: chunked prefill, prefix caching, the LRU)
and cost model, event-driven. A run takes seconds and is deterministic for a seed, so policies
can be compared over many arrival schedules here (the real scenario's 320 requests put its p99 on
~3 samples and its latencies carry the host's noise) and then proven with the real scenario.
``--shape sim16`` runs the ``sim16`` scenario's shared-prefix workload on its fleet instead.

TTFT is from arrival to the first token, printed in wall milliseconds (model seconds x time
scale) so the figures read as the real scenario's.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.bench.routers.scenario_zipf import (
    PREFIX_TOKENS,
    PREFIXES,
    PROFILE,
    QUESTION_TOKENS,
    WORKERS,
    ZIPF_S,
)
from gateway.config import PoolSettings
from gateway.kvindex.events import EventApplier, KvEventsConfig, decode_batch
from gateway.kvindex.index import BlockIndex
from gateway.kvindex.service import PrefixIndex
from gateway.kvindex.siblings import SiblingRoutes
from gateway.routing.kv_aware import KvAware
from gateway.routing.router import Router
from gateway.routing.types import RoutingRequest
from gateway.sim.config import SimWorkerConfig, resolve
from gateway.sim.costmodel import CostModel, step_time_s
from gateway.sim.kvevents import encode_batch
from gateway.sim.scheduler import SamplingSpec, Scheduler, SchedulerConfig, SimRequest, StepPlan
from gateway.workers.registry import WorkerRegistry
from gateway.workers.worker import VllmStats

MODEL = "sim-llama-3-8b"
BLOCK = 16
MAX_TOKENS = 16


@dataclass
class Outcome:
    """One request of a run: where it went, what its worker's cache gave, its TTFT."""

    i: int
    prefix: int
    arrival_s: float  # model seconds
    prompt_tokens: int
    worker: str = ""
    reason: str = ""
    cached_tokens: int = 0
    predicted_tokens: int = 0  # kvgate: cached at the chosen worker, as the index said
    best_tokens: int = 0  # kvgate: the longest prefix any worker held, as the index said
    ttft_s: float | None = None  # model seconds


@dataclass(frozen=True)
class Arrival:
    """One request of the workload: when, which system prompt, its token ids."""

    at_s: float  # model seconds
    prefix: int
    token_ids: tuple[int, ...]
    prefix_tokens: int = PREFIX_TOKENS


def workload(seed: int, requests: int, rate: float, time_scale: float,
             prefixes: int = PREFIXES, prefix_tokens: int = PREFIX_TOKENS,
             question_tokens: int = QUESTION_TOKENS, zipf_s: float = ZIPF_S) -> list[Arrival]:
    """Poisson arrivals of ``rate`` wall requests/s (``rate x time_scale`` modelled), each a
    Zipf-drawn prefix and a question of its own (distinct token ids per request)."""
    rng = random.Random(f"zipf-model:{seed}")
    heads = [tuple(random.Random(f"prefix:{p}").choices(range(100, 30_000), k=prefix_tokens))
             for p in range(prefixes)]
    weights = [1.0 / k ** zipf_s for k in range(1, prefixes + 1)]
    out: list[Arrival] = []
    t = 0.0
    for _ in range(requests):
        t += rng.expovariate(rate * time_scale)
        p = rng.choices(range(prefixes), weights)[0]
        question = tuple(rng.choices(range(100, 30_000), k=question_tokens))
        out.append(Arrival(t, p, heads[p] + question, prefix_tokens))
    return out


def ceiling(arrivals: Sequence[Arrival]) -> float:
    """The hit rate of one cache that never evicts: every prefix's full blocks after its first
    request (vLLM recomputes at least the last token; the questions are distinct)."""
    seen: set[int] = set()
    hit = total = 0
    for a in arrivals:
        total += len(a.token_ids)
        if a.prefix in seen:
            hit += a.prefix_tokens // BLOCK * BLOCK
        seen.add(a.prefix)
    return hit / total if total else 0.0


def alone_ttft_s(arrivals: Sequence[Arrival], cost: CostModel) -> list[float]:
    """Each request's TTFT on a worker of its own that holds every prefix seen before it (the
    ceiling's cache): its uncached prefill alone, one step (the prompts fit the step budget).
    No router can do better for any percentile."""
    seen: set[int] = set()
    out = []
    for a in arrivals:
        cached = a.prefix_tokens // BLOCK * BLOCK if a.prefix in seen else 0
        seen.add(a.prefix)
        out.append(step_time_s(cost, StepPlan(prefill_tokens=len(a.token_ids) - cached)))
    return out


class PeerCacheAware:
    """sglang-router's ``cache_aware`` (and vllm-router's port of it), as documented and
    defaulted: ``balance_abs_threshold`` 64, ``balance_rel_threshold`` 1.5, ``cache_threshold``
    0.5; the load is the router's own count of open requests per worker. The approximate tree is
    modelled by what it answers here: a prompt matches a worker's tree over its system prompt
    once that prompt was routed there (the questions are distinct), and a tree's size is the
    tokens routed to it that it did not hold yet."""

    def __init__(self, urls: Sequence[str], abs_threshold: int = 64, rel_threshold: float = 1.5,
                 cache_threshold: float = 0.5) -> None:
        self.urls = list(urls)
        self.load = dict.fromkeys(self.urls, 0)
        self.holds: dict[str, set[int]] = {u: set() for u in self.urls}
        self.size = dict.fromkeys(self.urls, 0)
        self.abs_threshold = abs_threshold
        self.rel_threshold = rel_threshold
        self.cache_threshold = cache_threshold

    def route(self, prefix: int, prompt_tokens: int, prefix_tokens: int = PREFIX_TOKENS
              ) -> tuple[str, str]:
        loads = self.load
        hi, lo = max(loads.values()), min(loads.values())
        if hi - lo > self.abs_threshold and hi > lo * self.rel_threshold:
            url = min(self.urls, key=lambda u: loads[u])
            reason = "load_balance"
        else:
            holders = [u for u in self.urls if prefix in self.holds[u]]
            rate = prefix_tokens / prompt_tokens if holders else 0.0
            if rate > self.cache_threshold:
                url, reason = holders[0], "prefix_hit"
            else:
                url, reason = min(self.urls, key=lambda u: self.size[u]), "smallest_tree"
        if prefix not in self.holds[url]:
            self.holds[url].add(prefix)
            self.size[url] += prefix_tokens
        self.size[url] += prompt_tokens - prefix_tokens
        loads[url] += 1
        return url, reason

    def done(self, url: str) -> None:
        self.load[url] -= 1


class Fleet:
    """The simulated workers, and what the gateway knows of them."""

    def __init__(self, workers: int, time_scale: float, num_gpu_blocks: int | None = None
                 ) -> None:
        res = resolve(SimWorkerConfig(profile=PROFILE, num_gpu_blocks=num_gpu_blocks))
        self.urls = [f"http://h100-{k}" for k in range(workers)]
        self.config = SchedulerConfig(num_gpu_blocks=res.num_gpu_blocks,
                                      max_model_len=res.max_model_len,
                                      block_size_tokens=BLOCK, record_events=True)
        self.scheds = {u: Scheduler(self.config) for u in self.urls}
        self.cost: CostModel = res.cost
        self.time_scale = time_scale
        self.now = 0.0  # model seconds


def pool_settings(fleet: Fleet, hot: dict[str, Any] | None) -> PoolSettings:
    """``hot``: the pool's ``kv_aware.hot_prefix`` settings (None: off)."""
    return PoolSettings.model_validate({
        "name": "fleet", "max_context_tokens": fleet.config.max_model_len, "policy": "kv_aware",
        "workers": fleet.urls,
        "kv_aware": {"hot_prefix": {"enabled": True, **hot} if hot is not None
                                    else {"enabled": False}}})


def kvgate_router(fleet: Fleet, pool: PoolSettings, registry: WorkerRegistry
                  ) -> tuple[Router, PrefixIndex, dict[str, EventApplier]]:
    """One gateway process's router over ``fleet``: its own index, fed every worker's events,
    over ``registry`` (the load every process sees is gateway-wide); its clocks in wall seconds,
    as the real gateway's in front of a simulator slowed ``time_scale`` times."""

    def wall() -> float:
        return fleet.now * fleet.time_scale

    blocks = BlockIndex(clock=wall)
    index = PrefixIndex(blocks)
    appliers = {}
    for u in fleet.urls:
        index.set_worker(u, BLOCK, fleet.config.num_gpu_blocks,
                         KvEventsConfig(endpoint=f"tcp://{u[7:]}:5557"))
        appliers[u] = EventApplier(u, blocks, BLOCK)
    router = Router([pool], registry, {pool.name: KvAware(pool.kv_aware)}, spill=False,
                    prefix_index=index, clock=wall)
    return router, index, appliers


def simulate(arrivals: Sequence[Arrival], policy: str, *, workers: int = WORKERS,
             time_scale: float = 8.0, scrape_interval_s: float = 5.0,
             hot: dict[str, Any] | None = None, processes: int = 1,
             seed: int = 1, share_routes_ms: float | None = 0.0,
             num_gpu_blocks: int | None = None) -> list[Outcome]:
    """One run of ``arrivals`` routed by ``policy`` (``kvgate``: ``kv_aware``, with ``hot`` its
    hot-prefix settings or None for off, in ``processes`` gateway processes, each request taken
    by one of them at random as the kernel spreads connections, each receiving its siblings'
    routes (``gateway.kvindex.siblings``: what it sends, delivered here) ``share_routes_ms``
    wall ms after they were made (the gateway: at the end of the routing process's loop turn),
    or never with None, as the gateway did before it; ``cache_aware``: the peers')."""
    fleet = Fleet(workers, time_scale, num_gpu_blocks)
    peer = PeerCacheAware(fleet.urls) if policy == "cache_aware" else None
    routers: list[Router] = []
    siblings: list[SiblingRoutes] = []
    appliers: list[dict[str, EventApplier]] = []
    registry: WorkerRegistry | None = None
    if peer is None:
        pool = pool_settings(fleet, hot)
        registry = WorkerRegistry([pool])
        for worker in registry:
            worker.healthy = True
            worker.stats = VllmStats(block_size_tokens=BLOCK,
                                     num_gpu_blocks=fleet.config.num_gpu_blocks)
        for k in range(processes):
            r, x, a = kvgate_router(fleet, pool, registry)
            routers.append(r)
            appliers.append(a)
            # the gateway's own sharing, its sockets left out: what it queues is delivered here
            sib = SiblingRoutes(x, Path("/nonexistent"), k, processes)
            if share_routes_ms is not None:
                x.on_routed = sib.on_routed
            siblings.append(sib)
    process_of = random.Random(f"zipf-model-processes:{seed}")
    ends: dict[str, float] = dict.fromkeys(fleet.urls, math.inf)
    plans: dict[str, tuple[StepPlan, list[Any]] | None] = dict.fromkeys(fleet.urls)
    live: dict[str, tuple[Outcome, SimRequest, int]] = {}
    seq = itertools.count()
    events: list[tuple[float, int, str, Any]] = []
    for i, arrival in enumerate(arrivals):
        heapq.heappush(events, (arrival.at_s, next(seq), "arrive", i))
    heapq.heappush(events, (0.0, next(seq), "scrape", None))
    last = arrivals[-1].at_s if arrivals else 0.0
    outcomes: list[Outcome] = []

    def start_step(url: str, now: float) -> None:
        sched = fleet.scheds[url]
        if not sched.has_unfinished():
            plans[url], ends[url] = None, math.inf
            return
        plan = sched.schedule()
        plans[url] = (plan, sched.take_events())
        ends[url] = now + step_time_s(fleet.cost, plan)
        heapq.heappush(events, (ends[url], next(seq), "step", url))

    while events:
        now, _, kind, what = heapq.heappop(events)
        fleet.now = now
        if kind == "scrape":
            if registry is not None:
                for url in fleet.urls:
                    s = fleet.scheds[url]
                    seen = registry.get(url)
                    assert seen is not None
                    seen.stats = VllmStats(running=s.num_running, waiting=s.num_waiting,
                                           kv_usage_ratio=s.kv.pool.usage,
                                           block_size_tokens=BLOCK,
                                           num_gpu_blocks=fleet.config.num_gpu_blocks)
            if now < last or live:
                heapq.heappush(events, (now + scrape_interval_s / time_scale, next(seq),
                                        "scrape", None))
            continue
        if kind == "share":
            k, data = what
            siblings[k].receive(data)
            continue
        if kind == "arrive":
            a = arrivals[what]
            out = Outcome(what, a.prefix, now, len(a.token_ids))
            outcomes.append(out)
            uncached = len(a.token_ids)
            if peer is not None:
                url, out.reason = peer.route(a.prefix, len(a.token_ids), a.prefix_tokens)
            else:
                k = process_of.randrange(len(routers))
                route = routers[k].route(RoutingRequest(
                    model=MODEL, prompt_tokens=len(a.token_ids), max_tokens=MAX_TOKENS,
                    token_ids=a.token_ids, stream=True))
                url, out.reason = route.worker.url, route.decision.reason
                out.predicted_tokens = route.decision.predicted_cached_tokens
                out.best_tokens = route.fleet_best_tokens
                if share_routes_ms is not None:
                    for data in siblings[k].messages():
                        for other in range(len(routers)):
                            if other != k:
                                heapq.heappush(events, (now + share_routes_ms / 1e3 / time_scale,
                                                        next(seq), "share", (other, data)))
                uncached = max(len(a.token_ids) - route.decision.predicted_cached_tokens, 0)
                route.worker.inflight += 1
                route.worker.inflight_prompt_tokens += uncached
            out.worker = url
            sched = fleet.scheds[url]
            rid = f"r{what}"
            req = sched.new_request(rid, a.token_ids,
                                    SamplingSpec(max_tokens=MAX_TOKENS, ignore_eos=True),
                                    arrival_time=now)
            sched.add_request(req)
            live[rid] = (out, req, uncached)
            if plans[url] is None:
                start_step(url, now)
            continue
        url = what
        done = plans[url]
        assert done is not None
        plan, kv_events = done
        for o in fleet.scheds[url].update_from_output(plan):
            rid = o.request.request_id
            out, req, uncached = live[rid]
            w = None if registry is None else registry.get(url)
            if o.first_token:
                out.ttft_s = now - out.arrival_s
                out.cached_tokens = req.num_cached_tokens
                if w is not None:
                    w.inflight_prompt_tokens -= uncached
            if o.finish_reason is not None:
                if w is not None:
                    w.inflight -= 1
                if peer is not None:
                    peer.done(url)
                del live[rid]
        if kv_events and appliers:
            batch = decode_batch(encode_batch(now, kv_events)).events
            for mine in appliers:
                mine[url].apply(batch)
        start_step(url, now)
    return outcomes


@dataclass(frozen=True)
class Shape:
    """A fleet and a shared-prefix workload (the model's defaults: ``zipf_hot``'s)."""

    workers: int = WORKERS
    num_gpu_blocks: int | None = None  # None: the profile's own KV cache
    prefixes: int = PREFIXES
    prefix_tokens: int = PREFIX_TOKENS
    question_tokens: int = QUESTION_TOKENS
    zipf_s: float = ZIPF_S
    rate: float = 18.0
    requests: int = 320


SHAPES = {"zipf_hot": Shape(),
          "sim16": Shape(workers=16, num_gpu_blocks=1024, prefixes=32, prefix_tokens=2048,
                         question_tokens=64, zipf_s=0.0, rate=24.0, requests=240)}


def _pct(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def summary(outcomes: Sequence[Outcome], time_scale: float) -> dict[str, Any]:
    tokens: dict[str, int] = {}
    for o in outcomes:
        tokens[o.worker] = tokens.get(o.worker, 0) + o.prompt_tokens
    ttft = [o.ttft_s * time_scale * 1e3 for o in outcomes if o.ttft_s is not None]
    prompt = sum(o.prompt_tokens for o in outcomes)
    per_worker: dict[str, int] = {}
    for o in outcomes:
        per_worker[o.worker] = per_worker.get(o.worker, 0) + o.prompt_tokens - o.cached_tokens
    loads = list(per_worker.values())
    reasons: dict[str, int] = {}
    for o in outcomes:
        reasons[o.reason] = reasons.get(o.reason, 0) + 1
    lost_load = sum(o.best_tokens - o.predicted_tokens for o in outcomes)
    lost_stale = sum(max(o.predicted_tokens - o.cached_tokens, 0) for o in outcomes)
    return {"lost_to_load": lost_load / prompt if prompt else 0.0,
            "lost_predicted_not_delivered": lost_stale / prompt if prompt else 0.0,
            "p50": _pct(ttft, 0.5), "p90": _pct(ttft, 0.9), "p99": _pct(ttft, 0.99),
            "hit_rate": sum(o.cached_tokens for o in outcomes) / prompt if prompt else 0.0,
            "load_max_mean": max(loads) / statistics.mean(loads) if loads else 0.0,
            "prompt_max_mean": (max(tokens.values()) / statistics.mean(tokens.values())
                                if tokens else 0.0),
            "reasons": reasons}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gateway.bench.routers.zipf_model",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="zipf_hot",
                   help="the workload and fleet: zipf_hot (the default), or sim16 (the sim16"
                        " scenario's shared-prefix part: 16 workers of 1,024 blocks, 32 prefixes"
                        " of 2K tokens, uniform, 24 req/s, 240 requests)")
    p.add_argument("--rate", type=float, default=None, help="wall requests/s (the shape's)")
    p.add_argument("--requests", type=int, default=None, help="(the shape's: 320 for zipf_hot)")
    p.add_argument("--time-scale", type=float, default=8.0)
    p.add_argument("--seeds", type=int, nargs="+", default=[1])
    p.add_argument("--policy", action="append", default=None,
                   help="cache_aware, kvgate, kvgate_hot, or kvgate_hot:key=value,... (hot-prefix"
                        " settings); repeatable (default: cache_aware kvgate kvgate_hot)")
    p.add_argument("--processes", type=int, default=2,
                   help="kvgate's gateway processes (the scenario's gateway: one per core)")
    p.add_argument("--share-routes-ms", type=float, default=0.0,
                   help="each gateway process records its siblings' routes this many wall ms"
                        " after they were made (default 0: at once, as the gateway does)")
    p.add_argument("--no-share-routes", action="store_true",
                   help="the processes do not share their routes (the gateway before"
                        " gateway.kvindex.siblings)")
    args = p.parse_args(argv)
    shape = SHAPES[args.shape]
    rate = args.rate if args.rate is not None else shape.rate
    requests = args.requests if args.requests is not None else shape.requests
    policies = args.policy or ["cache_aware", "kvgate", "kvgate_hot"]
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in policies}
    ceilings = []
    bounds: list[dict[str, float]] = []
    for seed in args.seeds:
        arrivals = workload(seed, requests, rate, args.time_scale, shape.prefixes,
                            shape.prefix_tokens, shape.question_tokens, shape.zipf_s)
        ceilings.append(ceiling(arrivals))
        alone = alone_ttft_s(arrivals, Fleet(1, args.time_scale).cost)
        bound = {q: _pct([t * args.time_scale * 1e3 for t in alone], v)
                 for q, v in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))}
        bounds.append(bound)
        print(f"seed {seed} {'bound (each alone)':<28} p50 {bound['p50']:7.0f} p90"
              f" {bound['p90']:7.0f} p99 {bound['p99']:7.0f} ms", flush=True)
        for name in policies:
            base, _, opts = name.partition(":")
            hot: dict[str, Any] | None = None
            if base == "kvgate_hot":
                hot = {k: float(v) if "." in v else int(v)
                       for k, v in (kv.split("=") for kv in opts.split(",") if kv)}
            outs = simulate(arrivals, "cache_aware" if base == "cache_aware" else "kvgate",
                            time_scale=args.time_scale, hot=hot, processes=args.processes,
                            workers=shape.workers, num_gpu_blocks=shape.num_gpu_blocks,
                            seed=seed,
                            share_routes_ms=None if args.no_share_routes else args.share_routes_ms)
            s = summary(outs, args.time_scale)
            rows[name].append(s)
            print(f"seed {seed} {name:<28} p50 {s['p50']:7.0f} p90 {s['p90']:7.0f}"
                  f" p99 {s['p99']:7.0f} ms  hit {s['hit_rate']:.1%}"
                  f" (ceiling {ceilings[-1]:.1%})  load {s['load_max_mean']:.2f}"
                  f" / {s['prompt_max_mean']:.2f}"
                  f"  {json.dumps(s['reasons'])} lost: load {s['lost_to_load']:.1%},"
                  f" predicted not delivered {s['lost_predicted_not_delivered']:.1%}",
                  flush=True)
    print(f"\nmedians over {len(args.seeds)} seeds (wall ms at time scale {args.time_scale:g};"
          f" ceiling {statistics.median(ceilings):.1%}):")
    print(f"  {'bound (each alone)':<28} " + " ".join(
        f"{q} {statistics.median(b[q] for b in bounds):7.0f}" for q in ("p50", "p90", "p99")))
    for name, runs in rows.items():
        med = {k: statistics.median(r[k] for r in runs)
               for k in ("p50", "p90", "p99", "hit_rate", "load_max_mean", "prompt_max_mean")}
        print(f"  {name:<28} p50 {med['p50']:7.0f} p90 {med['p90']:7.0f} p99 {med['p99']:7.0f}"
              f"  hit {med['hit_rate']:.1%}  load {med['load_max_mean']:.2f}"
              f" / {med['prompt_max_mean']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
