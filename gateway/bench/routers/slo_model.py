"""The ``slo`` scenario in model time alone: where the objectives are missed, and why.

``python -m gateway.bench.routers.slo_model`` runs the scenario's workload (``scenario_slo``:
same classes, same arrival schedule, same fleet of 3 H100 + 3 A100) through the gateway's real
``Router`` (the real registry, ``kv_aware`` and the calibrated latency models of
``gateway.routing.slo``) and the simulator's own scheduler and cost model, event-driven, with no
clock and no host: a run takes seconds and is deterministic, so a policy can be chosen here and
proven with the real scenario (whose latencies carry the host's noise besides).

What the gateway sees is modelled as it sees it: its own in-flight requests and their prefill
still to do (exact, taken back at the first token), vLLM's ``running``/``waiting`` from a scrape
every ``scrape_interval_s`` (wall seconds, as the gateway's health settings; divided by the time
scale), and the TTFT of each stream from routing to its first token (its calibration).

Every miss is explained (``explain``): the worker type and reason, the TTFT predicted at routing
against the one observed; and the *oracle* TTFT on every candidate at routing time: the
candidate's queue as it stood (running and waiting requests, the step in progress), the request
appended, run forward through the same step rule with nothing arriving after it. So a miss is:

* ``late_arrivals``: the chosen worker's oracle met the objective, the observed did not:
  requests routed after it shared its prefill step (vLLM's scheduler puts a waiting request in
  the next step with everything else admitted behind it, chunked prefill: a 6K-token batch
  prompt routed 1 ms later makes the interactive one's step 7K tokens long);
* ``better_worker``: another candidate's oracle met it, the chosen one's did not;
* ``no_worker``: no candidate's oracle met it (the load, not the choice).

``--variant`` runs the policy variants being compared (``VARIANTS``); ``--processes`` routes
each request in one of that many gateway processes (a router each: its own calibration and
tight demand; the load they see and their pending requests are gateway-wide), as the
scenario's gateway does (one process per core). ``--seeds`` runs several arrival schedules.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import random
import statistics
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gateway.bench.routers.scenario_slo import CLASSES, SloClass, schedule
from gateway.config import PoolSettings, Priority
from gateway.routing.kv_aware import KvAware
from gateway.routing.router import Route, Router, SloHold, SloUnattainable
from gateway.routing.slo import SharedPromises, SloTarget
from gateway.routing.types import RoutingRequest
from gateway.sim.config import SimWorkerConfig, resolve
from gateway.sim.costmodel import CostModel, step_time_s
from gateway.sim.scheduler import SamplingSpec, Scheduler, SchedulerConfig, SimRequest, StepPlan
from gateway.workers.load_table import LoadTable
from gateway.workers.registry import WorkerRegistry
from gateway.workers.worker import VllmStats, Worker

MODEL = "sim-llama-3-8b"
KINDS = (("h100", "llama-3-8b@h100"), ("a100", "llama-3-8b@a100"))


@dataclass
class Outcome:
    """One request of the run, as the model saw it."""

    i: int
    cls: str
    arrival_s: float  # model seconds
    objective_s: float
    worker: str = ""
    reason: str = ""
    shed: bool = False
    predicted_s: float | None = None
    ttft_s: float | None = None
    oracle_s: dict[str, float] = field(default_factory=dict)  # misses only
    held_s: float = 0.0  # waited in the gateway (SloHold)
    late_tokens: int = 0  # prefill of requests routed after it, in its prefill steps
    why: str = ""

    @property
    def met(self) -> bool:
        return self.ttft_s is not None and self.ttft_s <= self.objective_s


@dataclass
class _Job:
    """One request on one worker (the oracle's light copy of a ``SimRequest``)."""

    prefill_left: int
    context: int
    outputs_left: int
    mine: bool = False


class ModelFleet:
    """The workers (scheduler + cost model + the gateway's ``Worker``) and the router: one per
    gateway process (``processes``), each with its own policy, calibration and tight demand,
    over one registry (the load every process sees is gateway-wide); their pending requests
    are shared through a real ``LoadTable`` (a row per process), as the gateway's are."""

    def __init__(self, per_kind: int, pool: PoolSettings, processes: int = 1) -> None:
        self.urls = [f"http://{kind}-{k}" for kind, _ in KINDS for k in range(per_kind)]
        self.registry = WorkerRegistry([pool])
        for w in self.registry:
            w.healthy = True
        self.now = 0.0  # model seconds: the routers' clock
        self.routed = 0  # requests routed so far (each gets a distinct prompt)
        shared: list[Callable[[str], SharedPromises | None] | None] = [None] * processes
        if processes > 1:
            with tempfile.TemporaryDirectory(prefix="kvgate-slo-model-") as tmp:
                for i in range(processes):  # mapped: the file may go once all are open
                    table = LoadTable(Path(tmp) / "load.table", rows=processes, own_row=i,
                                      slots=64)
                    table.open()
                    for url in self.urls:
                        table.claim(url)
                    shared[i] = table.shared
        self.routers = [
            Router([pool], self.registry, {pool.name: KvAware(pool.kv_aware)}, spill=False,
                   clock=lambda: self.now, shared_promises=share) for share in shared]
        self.router = self.routers[0]
        self.pool = pool
        self.scheds: dict[str, Scheduler] = {}
        self.costs: dict[str, CostModel] = {}
        self.config = SchedulerConfig(num_gpu_blocks=1)
        for kind, profile in KINDS:
            res = resolve(SimWorkerConfig(profile=profile))
            for k in range(per_kind):
                url = f"http://{kind}-{k}"
                cfg = SchedulerConfig(num_gpu_blocks=res.num_gpu_blocks,
                                      max_model_len=res.max_model_len)
                self.config = cfg
                self.scheds[url] = Scheduler(cfg)
                self.costs[url] = res.cost

    def worker(self, url: str) -> Worker:
        w = self.registry.get(url)
        assert w is not None
        return w


def pool_settings(**slo: Any) -> PoolSettings:
    return PoolSettings.model_validate({
        "name": "slo", "max_context_tokens": 32768, "policy": "kv_aware",
        "workers": [f"http://{kind}-{k}" for kind, _ in KINDS for k in range(3)],
        "slo": slo})


def oracle_ttft(sched: Scheduler, cost: CostModel, busy_until: float, now: float,
                prompt_tokens: int, max_tokens: int, budget: int) -> float:
    """The TTFT ``prompt_tokens`` would get on this worker if nothing arrived after it: its
    queue run forward (running first, then waiting in order, ``budget`` tokens a step, as
    ``Scheduler.schedule`` without the KV cache) from the end of the step in progress."""
    running = [_Job(r.num_tokens - r.num_computed_tokens if r.num_output_tokens == 0 else 0,
                    r.num_computed_tokens, r.sampling.max_tokens - r.num_output_tokens)
               for r in sched.running]
    waiting = [_Job(r.num_tokens - r.num_computed_tokens, 0,
                    r.sampling.max_tokens - r.num_output_tokens) for r in sched.waiting]
    waiting.append(_Job(prompt_tokens, 0, max_tokens, mine=True))
    t = max(busy_until, now)
    for _ in range(100_000):
        left = budget
        prefill = decode_kv = decodes = 0
        stepped: list[_Job] = []
        for j in running:
            if left <= 0:
                break
            if j.prefill_left:
                n = min(j.prefill_left, left)
                j.prefill_left -= n
                j.context += n
                prefill += n
                left -= n
            else:
                decodes += 1
                decode_kv += j.context + 1
                left -= 1
            stepped.append(j)
        while left > 0 and waiting:
            j = waiting.pop(0)
            n = min(j.prefill_left, left)
            j.prefill_left -= n
            j.context += n
            prefill += n
            left -= n
            running.append(j)
            stepped.append(j)
        plan = StepPlan(prefill_tokens=prefill, decode_kv_tokens=decode_kv,
                        num_decode_requests=decodes)
        t += step_time_s(cost, plan)
        for j in stepped:
            if j.prefill_left == 0:
                if j.mine:
                    return t - now
                j.outputs_left -= 1
                j.context += 1
        running = [j for j in running if j.outputs_left > 0]
    return math.inf


def simulate(fleet: ModelFleet, *, rate: float = 4.0, duration_s: float = 45.0, time_scale: float = 8.0,
             send_slo: bool = True, seed: int = 15, scrape_interval_s: float = 5.0,
             classes: Sequence[SloClass] = CLASSES, explain: bool = True) -> list[Outcome]:
    """One run on ``fleet`` (``rate``/``duration_s`` in wall seconds as the scenario's, turned
    into model time by ``time_scale``), from the fleet's clock on: an ``Outcome`` per request
    (``arrival_s`` from the run's start). The scenario runs ``kv_aware`` then ``kv_aware+slo``
    on one gateway, whose latency models learn from both: so does a fleet used twice."""
    plan = schedule(rate, duration_s, seed)
    # which gateway process takes each request (the kernel spreads connections among them)
    process_of = random.Random(seed * 7919 + 1)
    by_name = {c.name: c for c in classes}
    scrape_s = scrape_interval_s / time_scale
    ends: dict[str, float] = dict.fromkeys(fleet.urls, math.inf)
    plans: dict[str, StepPlan | None] = dict.fromkeys(fleet.urls)
    outcomes: list[Outcome] = []
    live: dict[str, tuple[Outcome, SimRequest, Route, float, Router]] = {}
    routed_order: dict[str, int] = {}
    seq = itertools.count()
    events: list[tuple[float, int, str, Any]] = []
    t0 = fleet.now
    for at, cls in plan:
        heapq.heappush(events, (t0 + at / time_scale, next(seq), "arrive",
                                (by_name[cls.name], process_of.randrange(len(fleet.routers)))))
    heapq.heappush(events, (t0, next(seq), "scrape", None))
    last_arrival = t0 + (plan[-1][0] / time_scale if plan else 0.0)

    def start_step(url: str, now: float) -> None:
        sched = fleet.scheds[url]
        if not sched.has_unfinished():
            plans[url], ends[url] = None, math.inf
            return
        p = plans[url] = sched.schedule()
        ends[url] = now + step_time_s(fleet.costs[url], p)
        # the prefill of requests routed after one that is in this step with it
        firsts = [ch for ch in p.chunks if not ch.is_decode]
        for ch in firsts:
            rid = ch.request.request_id
            mine = routed_order[rid]
            out = live[rid][0]
            out.late_tokens += sum(o.num_new_tokens for o in firsts
                                   if routed_order[o.request.request_id] > mine)
        heapq.heappush(events, (ends[url], next(seq), "step", url))

    n = 0
    while events:
        now, _, kind, what = heapq.heappop(events)
        fleet.now = now
        if kind == "scrape":
            for url in fleet.urls:
                s = fleet.scheds[url]
                fleet.worker(url).stats = VllmStats(running=s.num_running, waiting=s.num_waiting,
                                                    block_size_tokens=16)
            if now < last_arrival or live:
                heapq.heappush(events, (now + scrape_s, next(seq), "scrape", None))
            continue
        if kind in ("arrive", "retry"):
            if kind == "arrive":
                c, proc = what
                i = n
                n += 1
                out = Outcome(i, c.name, now - t0, c.ttft_ms_modelled / 1e3)
                outcomes.append(out)
            else:
                c, out, proc = what
                i = out.i
            router = fleet.routers[proc]
            rreq = RoutingRequest(model=MODEL, prompt_tokens=c.prompt_tokens,
                                  max_tokens=c.max_tokens, stream=True)
            target = SloTarget(out.objective_s if send_slo else None, None,
                               Priority(c.priority), now - t0 - out.arrival_s, out.held_s)
            if explain:
                budget = fleet.config.max_num_batched_tokens
                out.oracle_s = {u: oracle_ttft(fleet.scheds[u], fleet.costs[u],
                                               ends[u] if plans[u] is not None else now, now,
                                               c.prompt_tokens, c.max_tokens, budget)
                                for u in fleet.urls}
            try:
                route = router.route(rreq, slo=target)
            except SloUnattainable:
                out.shed = True
                continue
            except SloHold as hold:
                out.held_s += hold.wait_s
                heapq.heappush(events, (now + hold.wait_s, next(seq), "retry", (c, out, proc)))
                continue
            url = route.worker.url
            out.worker, out.reason = url, route.decision.reason
            if route.slo is not None:
                out.predicted_s = route.slo.prediction.ttft_s
            w = fleet.worker(url)
            w.inflight += 1
            w.inflight_prompt_tokens += c.prompt_tokens
            sched = fleet.scheds[url]
            rid = f"r{fleet.routed}"
            # every prompt distinct (the scenario salts each run's): no prefix cache hit
            req = sched.new_request(rid, [16 + (fleet.routed * 7919 + k) % 31000
                                          for k in range(c.prompt_tokens)],
                                    SamplingSpec(max_tokens=c.max_tokens, ignore_eos=True),
                                    arrival_time=now)
            sched.add_request(req)
            routed_order[rid] = fleet.routed
            fleet.routed += 1
            live[rid] = (out, req, route, now, router)
            if plans[url] is None:
                start_step(url, now)
            continue
        url = what
        done = plans[url]
        assert done is not None
        for o in fleet.scheds[url].update_from_output(done):
            rid = o.request.request_id
            out, req, route, routed, router = live[rid]
            w = fleet.worker(url)
            if o.first_token:  # the hold's prefill done; the TTFT calibrated (from routing)
                out.ttft_s = now - t0 - out.arrival_s
                w.inflight_prompt_tokens -= req.num_prompt_tokens
                if route.slo is not None:
                    router.slo_model(fleet.pool.name).observe(route.slo.prediction,
                                                              now - routed, None)
            if o.finish_reason is not None:
                w.inflight -= 1
                del live[rid]
        start_step(url, now)
    if explain:
        for out in outcomes:
            if out.shed or out.met or out.ttft_s is None:
                continue
            chosen = out.oracle_s.get(out.worker, math.inf)
            if chosen <= out.objective_s:
                out.why = "late_arrivals"
            elif min(out.oracle_s.values(), default=math.inf) <= out.objective_s:
                out.why = "better_worker"
            else:
                out.why = "no_worker"
    return outcomes


def summary(outcomes: Sequence[Outcome], warmup_s: float) -> dict[str, Any]:
    """Attainment per class (shed counted as missed), and the misses by cause, class and worker
    type, with the predicted and oracle TTFT against the observed."""
    counted = [o for o in outcomes if o.arrival_s >= warmup_s]
    out: dict[str, Any] = {"requests": len(counted)}
    met = sum(o.met for o in counted)
    out["attainment_shed_as_missed"] = met / len(counted) if counted else None
    out["shed"] = sum(o.shed for o in counted)
    for c in CLASSES:
        rs = [o for o in counted if o.cls == c.name]
        out[c.name] = {"requests": len(rs), "met": sum(o.met for o in rs),
                       "shed": sum(o.shed for o in rs),
                       "attainment": sum(o.met for o in rs) / len(rs) if rs else None}
    misses = [o for o in counted if not o.met and not o.shed]
    causes: dict[str, int] = {}
    for o in misses:
        key = f"{o.cls} on {_kind(o.worker)}: {o.why}"
        causes[key] = causes.get(key, 0) + 1
    out["misses"] = dict(sorted(causes.items(), key=lambda kv: -kv[1]))
    placed: dict[str, int] = {}
    for o in counted:
        if not o.shed:
            key = f"{o.cls} on {_kind(o.worker)}"
            placed[key] = placed.get(key, 0) + 1
    out["placed"] = placed
    errs = [o.predicted_s / o.oracle_s[o.worker] for o in counted
            if o.predicted_s and o.oracle_s.get(o.worker) and not o.shed]
    errs.sort()
    out["predicted_over_oracle_p10_p50_p90"] = (
        [errs[int(q * (len(errs) - 1))] for q in (0.1, 0.5, 0.9)] if errs else None)
    return out


def _kind(url: str) -> str:
    return url.split("//")[1].split("-")[0]


VARIANTS: dict[str, tuple[str, ...]] = {
    "all": (),
    "session7": ("pack", "harm", "clear_in_s", "room", "keep slack"),  # the policy before session 11
    "keep": ("pack", "harm", "clear_in_s", "room"),  # the policy's choice kept only with KEEP_SLACK
    "pack": ("harm", "clear_in_s", "room"),  # ... and batch packs onto the slowest fit
    "pack+harm": ("clear_in_s", "room"),  # ... and no placement that makes a pending one miss
    "no-room": ("room",),  # all but the room a batch request leaves for the tight ones
}
"""Policy variants: the ``select`` arguments each leaves out (the router's call, patched in
this process only), to weigh each step of the policy on its own; ``keep slack``: the policy's
choice is kept whenever it is predicted to meet the objectives, as before session 11."""


def use_variant(name: str) -> None:
    import gateway.routing.router as router_module
    from gateway.routing import slo as slo_module

    dropped = VARIANTS[name]

    def select(*args: Any, **kwargs: Any) -> Any:
        for k in dropped:
            kwargs.pop(k, None)
        return slo_module.select(*args, **kwargs)

    if "keep slack" in dropped:
        slo_module.KEEP_SLACK = 1.0

    setattr(router_module, "select", select)  # noqa: B010 (patched here only)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gateway.bench.routers.slo_model",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=4.0, help="wall requests/s (the scenario's)")
    p.add_argument("--duration-s", type=float, default=100.0, help="wall seconds")
    p.add_argument("--time-scale", type=float, default=8.0)
    p.add_argument("--seeds", type=int, nargs="+", default=[15])
    p.add_argument("--variant", choices=sorted(VARIANTS), default="all")
    p.add_argument("--processes", type=int, default=1,
                   help="gateway processes, each routing its share of the requests with its own"
                        " calibration and tight demand, sharing their pending requests (the"
                        " scenario's gateway: one per"
                        " core, 2 on a 2-core machine)")
    p.add_argument("--out", type=Path, default=None, help="write every outcome as JSON here")
    args = p.parse_args(argv)
    warmup = 10.0 / args.time_scale
    use_variant(args.variant)
    rows: dict[str, Any] = {}
    for seed in args.seeds:
        fleet = ModelFleet(3, pool_settings(), args.processes)
        for send in (False, True):
            name = "kv_aware+slo" if send else "kv_aware"
            outs = simulate(fleet, rate=args.rate, duration_s=args.duration_s,
                            time_scale=args.time_scale, send_slo=send, seed=seed)
            s = summary(outs, warmup)
            rows[f"{name} seed {seed}"] = s
            print(f"{name} seed {seed}: {json.dumps(s, default=str)}", flush=True)
            if args.out is not None:
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / f"{name}-{seed}.json").write_text(
                    json.dumps([asdict(o) for o in outs], default=str))
    for name in ("kv_aware", "kv_aware+slo"):
        runs = [rows[f"{name} seed {seed}"] for seed in args.seeds]
        att = sorted(r["attainment_shed_as_missed"] for r in runs)
        causes: dict[str, int] = {}
        for r in runs:
            for k, v in [*r["misses"].items(), ("shed", r["shed"])]:
                causes[k] = causes.get(k, 0) + v
        print(f"{name} over {len(runs)} seeds: median {statistics.median(att):.1%}, worst"
              f" {att[0]:.1%}; misses by cause: {json.dumps(causes)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
