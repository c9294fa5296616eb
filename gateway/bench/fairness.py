"""Fair share under contention (issue 12): does one tenant's flood raise other tenants' TTFT, and
does each backlogged tenant get its share of KV byte-seconds?

Setup: ``--workers`` simulated llama-3-8b@H100 workers (``kvgate sim``, one process each), one
pool, and three kvgate gateways in front of it, one process each, the same keys (tenants ``a``, ``b``,
``c`` interactive; ``d`` a key whose class is batch), differing only in the admission gate:

- ``forward``: today's defaults (2048 requests in flight): everything goes to vLLM at once and
  vLLM's own first-come-first-served queue decides who waits;
- ``fifo``: the gate holds ``--slots`` requests in flight (what the fleet runs without queueing)
  and queues the rest first come first served (``limits.fair_queuing: false``);
- ``fair``: the same gate in weighted fair order by KV byte-seconds (``gateway.overload``);
- ``room``: the fair gate of ``--slots`` with today's defaults for the rest: the room kept for
  others (``limits.long_prompt_tokens``, ``limits.reserve_workers`` = ``--reserve-workers``:
  while b or c are active, that many workers carry no long request, b's and c's chats go only
  there, and a's 16K-token prompts go to the others, starting only while one of them has no long
  prefill queued and waiting in the gateway otherwise) and the guaranteed share
  (``limits.guaranteed_share``: b's and c's chats, below their share of the slots, enter at
  once); ``forward``, ``fifo`` and ``fair`` run with both off, as they were;
- ``room_open`` (only when ``--gates`` names it): today's defaults, everything in flight at once
  (2048) with the room kept for others.

Phases, one after another (every prompt is unique, so no phase warms another's cache):

- ``quiet`` (the judged gateway, below; ``--duration-s``): tenants b and c send short chats
  (``CHAT_TOKENS`` prompt, ``CHAT_MAX_TOKENS`` out) open loop, Poisson at ``--chat-rate`` each:
  their TTFT without flood;
- ``flood/<gateway>`` (``--duration-s``): the same, while tenant a floods: ``--flood-users``
  clients sending ~16K-token prompts back to back (closed loop): b/c TTFT p99 per gateway against
  quiet's, over the chats sent after the first ``WARMUP_S`` (while the flood builds up); the
  judged gateway's first, right after quiet, so b and c are chatting there when a's flood comes
  (run cold, with a, b and c starting at once, a's first prompts land on every worker and the
  reserve forms only as they end: a transition, not the steady flood the target is about);
- ``backlog/<fifo|fair|room>`` (``BACKLOG_FACTOR`` x ``--duration-s``): every tenant backlogged
  (closed loop): a the 16K prompts from its ``--flood-users`` clients, b and c longer chats and d
  the same chats as batch from ``--backlog-users`` clients each, so that first come first served
  would hand a the larger share. Served KV byte-seconds per tenant over the phase, Jain's index over a, b,
  c = (sum x)^2 / (n sum x^2) (1: equal shares, 1/3: one tenant has all), and whether batch
  tenant d still progressed.

Served KV byte-seconds, from the client's records: (prompt + completion tokens) x KV bytes per
token x the part of [start of prefill, last token] inside the phase, the start of prefill being
the first token less the cost model's prefill time: about what vLLM holds, and what the fair gate
charges (it meters from admission to the end). The targets, for the ``room`` gateway (else
``fair``, when ``--gates`` leaves room out): flood b/c TTFT p99 <= ``RATIO_GOAL`` x quiet's,
Jain >= ``JAIN_GOAL`` while backlogged, d served > 0 there.

The reserve: the gateway's default, ``reserve_workers: auto`` (``gateway.overload``, "the size
of the reserve"): one worker per short request in flight, averaged over the active window, at
least 1, at most the other active tenants' weighted share of the pool. b's and c's 8 chats per
second, spread over 4 idle workers in the quiet phase, go only to the reserved workers under the
flood, and with one reserved (``--reserve-workers 1``) about 70% of the steps that prefill a
chat also decode another chat (3% over four workers, 33% over two), so the chats' TTFT p99
rises ~1.5x in model time alone, whatever the host: ``--model-only`` (the simulator's scheduler
and cost model, event-driven, no clock) reads p99 14.6 ms over four workers, 16.1 over two, 22.0
over one, with ~1.3 chats in flight, which auto turns into 2 reserved workers; session 10 read
1.58x (time scale 1) and 1.65x (time scale 4) with one reserved worker, 1.08-1.13x and
1.09-1.22x with two set by hand. Two cost the flood a third of its workers while b or c are
active (2 of 4, not 3). ``--reserve-workers 1`` or ``2`` measures a fixed reserve;
``--flood-first`` the transition where a's flood reaches a gateway that has forgotten b and c
(a's first prompts take every worker; the reserve forms as they end).

Time: the simulator runs at ``--time-scale`` wall seconds per modelled second, and the phases'
durations, the warm-up, the chat rate and every time reported (TTFT, served byte-seconds) are
model time: a larger scale runs the same modelled load (the same requests, the same modelled
utilisation), slower, so the host's own stalls (the load generator, the gateways and the
simulator share its cores; ``lag`` in the table is the load generator's event-loop lag, in wall
milliseconds) weigh less next to the modelled GPU times. The gateways' time limits are wall
time; the room's ``active_window_s`` is scaled with the rest. Where the chats went: per worker,
the short and long requests it finished in the phase (its ``vllm:request_prompt_tokens``);
what the host gave: the busy cores of the simulator, the gateways, the load generator and the
machine over each phase (``/proc``). Each simulated worker runs in its own ``kvgate sim``
process (``--sim-processes per-worker``, the default since session 21): in one process
(``--sim-processes one``, every run before) the workers share one event loop, so the work of
a's 16K-token prompts on their workers (reading, parsing, tokenizing, scheduling: a few ms each,
in one piece) delays the engine steps of the chats' workers too, which independent GPUs do not.
Same host, same gateway, back to back: one process 1.85x, one per worker 1.15x, 1.08x and
1.19x, with the machine 0.34-0.39 cores busy in the flood: the loop's pieces, not the host's
cores.

Output: a table, ``fairness.json`` (every phase's per-tenant summaries and served byte-seconds)
and ``fairness.png`` in ``--out`` (default ``docs/results``).
Run: ``python -m gateway.bench.fairness`` (3 phases x 15 s and 5 x 30 s, plus start-up and
drains: about 5 minutes); ``--duration-s 6`` for a smoke run, ``--gates fair,room`` for some
gateways only; ``--gates room --time-scale 4`` for the judged pair with the host's stalls a
quarter as heavy (about 9 minutes); ``--gates room --duration-s 60`` for the judged pair over
~950 chats per p99 instead of ~220 (about 8 minutes; the README's verdict, session 13);
``--model-only`` for the chats in model time alone (seconds); ``--replot`` to draw
``fairness.png`` again from ``--out``'s ``fairness.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import random
import resource
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

import aiohttp

from gateway import promtext
from gateway.bench.disagg import in_model_time, lag_warnings
from gateway.bench.loadgen import (
    LoadSpec,
    Target,
    TargetRun,
    calibrate_tokens_per_word,
    metrics_url,
    run_target,
)
from gateway.bench.overhead.cpu import machine_cpu_s, read_proc_stats, rusage_cpu_s, tree_cpu_s
from gateway.bench.stats import RequestRecord, distribution, percentile, ratio_interval
from gateway.bench.workloads import WorkloadSpec, build_workload
from gateway.planner import parse_profile, prefill_time_s
from gateway.procs.kvgate import SIM_MODEL, GatewayProcess, SimProcess
from gateway.procs.process import ManagedProcess, ProcessSet
from gateway.sim.costmodel import PlannerCostModel, step_time_s
from gateway.sim.scheduler import SamplingSpec, Scheduler, SchedulerConfig, StepPlan

ARCHITECTURE = "llama-3-8b"
PROFILE = f"{ARCHITECTURE}@h100"
"""The simulator's default cost model: its KV bytes per token and prefill times."""
MODEL, GPU = parse_profile(PROFILE)
KV_BYTES_PER_TOKEN = MODEL.kv_bytes_per_token("auto")
FLOOD_TOKENS = 16 * 1024
FLOOD_MAX_TOKENS = 128
CHAT_TOKENS = 200
CHAT_MAX_TOKENS = 32
RESERVE_WORKERS: int | Literal["auto"] = "auto"
"""The room gateways' ``limits.reserve_workers`` by default: the gateway's own default, the
reserve sized from the short requests in flight (module docstring)."""
LONG_PROMPT_TOKENS = 8192
"""``limits.long_prompt_tokens`` of the ``room`` gateways: a's 16K-token prompts are long; b's,
c's and d's chats are short, in the backlogged phases' too (``BACKLOG_CHAT_TOKENS``)."""
ACTIVE_WINDOW_S = 5.0
"""The room gateways' ``limits.active_window_s`` (its default) in model time."""
BACKLOG_CHAT_TOKENS = 4096
BACKLOG_CHAT_MAX_TOKENS = 1024
"""Backlogged chats are longer, so one chat holds about the KV byte-seconds of one flood request
and each tenant's share is not a matter of a few whole requests."""
BACKLOG_FACTOR = 2
"""Backlogged phases run this many times ``--duration-s``: whoever wins the first slots holds
them for a while, and the others catch up over the phase."""
WARMUP_S = 3.0
CHAT_PHASE_FACTOR = 2
"""The two phases the TTFT verdict compares (``quiet`` and the flood through the verdict's gate)
run this many times ``--duration-s``: ~200 chats per p99 at the defaults, not ~95, so the p99 is
the 3rd worst chat rather than the worst."""
LAG_TICK_S = 0.01
"""The load generator's event-loop lag is sampled every this often (``PhaseResult``): it shares
the host's cores with the simulator and the gateways, so its lag measures the host's stalls."""
DRAIN_S = 30.0
FLOOD_FIRST_PAUSE_S = ACTIVE_WINDOW_S + 2.0
"""``--flood-first``: the pause (model time) between quiet and the judged flood."""
RATIO_GOAL = 1.2
RATIO_LEVEL = 0.9
"""The bootstrap interval reported with the judged ratio (``stats.ratio_interval``): the 5th
to 95th percentile of the ratio over the chats of both phases resampled."""
JAIN_GOAL = 0.95
TENANTS = ("a", "b", "c", "d")
BATCH_TENANT = "d"
GATEWAYS = ("forward", "fifo", "fair", "room", "room_open")
DEFAULT_GATEWAYS = ("forward", "fifo", "fair", "room")
BACKLOG_GATEWAYS = ("fifo", "fair", "room")
"""Those with a gate that queues: with everything in flight, nobody is backlogged at the gate."""
DEFAULT_OUT = Path("docs/results")
MODEL_ONLY_S = 600.0
"""``--model-only``: model seconds of chats per row (~4,800 at the default rate)."""


def key_of(tenant: str) -> str:
    return f"fairness-key-{tenant}"


def gateway_config(workers: Sequence[str], gate: str, slots: int,
                   reserve_workers: int | Literal["auto"] = RESERVE_WORKERS,
                   time_scale: float = 1.0) -> dict[str, Any]:
    """The gateway ``gate`` in front of ``workers``; its time limits in wall time, the room's
    ``active_window_s`` (5 s of model time) included."""
    limits: dict[str, Any] = {"queue_timeout_s": 300.0 * time_scale,
                              "max_queued_requests": 4096}
    if gate in ("fifo", "fair", "room"):
        limits |= {"max_inflight_requests": slots, "fair_queuing": gate != "fifo"}
    if gate.startswith("room"):  # the room kept for others (and the guaranteed share)
        limits |= {"long_prompt_tokens": LONG_PROMPT_TOKENS, "guaranteed_share": True,
                   "reserve_workers": reserve_workers,
                   "active_window_s": ACTIVE_WINDOW_S * time_scale}
    return {
        "listen": {"processes": 1},
        "models": [{"name": SIM_MODEL, "tokenizer": "simple", "architecture": ARCHITECTURE}],
        "pools": [{"name": "fleet", "max_context_tokens": 32768, "policy": "kv_aware",
                   "workers": list(workers)}],
        "health": {"interval_s": 0.5},
        "limits": limits,
        "auth": {"api_keys": [
            {"name": t, "sha256": hashlib.sha256(key_of(t).encode()).hexdigest(),
             "priority": "batch" if t == BATCH_TENANT else "interactive"} for t in TENANTS]},
    }


# -- one phase ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Load:
    tenant: str
    prompt_tokens: int
    max_tokens: int
    users: int | None = None
    """Closed loop with this many clients; None: open loop at ``rate``."""
    rate: float | None = None


@dataclass(frozen=True)
class TenantResult:
    tenant: str
    sent: int
    ok: int
    errors: dict[str, int]
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    served_kv_byte_s: float


@dataclass(frozen=True)
class PhaseResult:
    name: str
    gateway: str
    tenants: dict[str, TenantResult]
    loop_lag_p99_ms: float | None = None
    """The load generator's event-loop lag over the phase (``LAG_TICK_S`` ticks): p99, max."""
    loop_lag_max_ms: float | None = None
    requests_per_worker: dict[str, tuple[int, int]] | None = None
    """Per simulated worker (its url), the requests it finished over the phase: (short, long),
    long being above ``SHORT_BUCKET`` prompt tokens (the workers' ``vllm:request_prompt_tokens``
    histogram, scraped around the phase): where the chats went."""
    chat_ttft_by_window_ms: list[tuple[float, int, float | None]] | None = None
    """b's and c's chats by when they were sent, in ``TTFT_WINDOW_S`` windows of the phase
    from its start (the warm-up's included): (window start s, chats, TTFT max ms), model time:
    when the slow chats came (a transition at the flood's start, or all along)."""
    host_cores: dict[str, float] | None = None
    """Busy cores over the phase (CPU seconds / wall seconds, from ``/proc``): the simulator's
    processes, the gateways', this load generator's and the whole machine's: how much of the
    host the phase took, and which part was short of it."""

    @property
    def jain(self) -> float | None:
        xs = [self.tenants[t].served_kv_byte_s for t in ("a", "b", "c") if t in self.tenants]
        return jain(xs) if len(xs) == 3 else None


def jain(xs: Sequence[float]) -> float | None:
    """Jain's fairness index: (sum x)^2 / (n sum x^2); 1 when all are equal, 1/n when one has all."""
    square = sum(x * x for x in xs)
    return sum(xs) ** 2 / (len(xs) * square) if square > 0 else None


def served_kv_byte_s(records: Sequence[RequestRecord], start_s: float, end_s: float) -> float:
    """KV byte-seconds held in [start_s, end_s] (model time): each answered request's whole
    footprint from the start of its prefill (first token - the cost model's prefill time) to its
    last token, clipped to the window."""
    total = 0.0
    for r in records:
        if r.ttft_s is None or r.e2e_s is None:
            continue
        prompt = r.prompt_tokens or r.approx_prompt_tokens
        tokens = prompt + (r.completion_tokens or 0)
        began = r.sent_s + max(0.0, r.ttft_s - prefill_time_s(MODEL, GPU, prompt))
        held = min(end_s, r.sent_s + r.e2e_s) - max(start_s, began)
        total += tokens * KV_BYTES_PER_TOKEN * max(0.0, held)
    return total


def records_in_model_time(records: Sequence[RequestRecord], time_scale: float
                          ) -> list[RequestRecord]:
    """The client's records with every time divided by ``time_scale`` (wall seconds per modelled
    second): what the modelled GPUs took, comparable across time scales."""
    return [in_model_time(r, time_scale) for r in records]


def measured(records: Sequence[RequestRecord], duration_s: float) -> list[RequestRecord]:
    """The requests sent inside the measured window (after the warm-up)."""
    return [r for r in records if WARMUP_S <= r.sent_s < duration_s]


def tenant_seed(phase_seed: int, tenant: str) -> int:
    """Each tenant's own seed in a phase: b's and c's Poisson arrivals are independent (with
    one seed for both, each chat had a twin sent at the same instant, and the two shared an
    engine step on the worker both went to)."""
    return phase_seed * len(TENANTS) + TENANTS.index(tenant)


async def loop_lag_s(stop: asyncio.Event, tick_s: float = LAG_TICK_S) -> list[float]:
    """How late each ``tick_s`` sleep of this event loop woke, until ``stop`` is set."""
    loop = asyncio.get_running_loop()
    lags: list[float] = []
    while not stop.is_set():
        due = loop.time() + tick_s
        await asyncio.sleep(tick_s)
        lags.append(max(0.0, loop.time() - due))
    return lags


def _ttfts_ms(records: Sequence[RequestRecord]) -> list[float]:
    return [r.ttft_s * 1000 for r in records if r.ok and r.ttft_s is not None]


TTFT_WINDOW_S = 5.0


def ttft_by_window(records: Sequence[RequestRecord], duration_s: float,
                   window_s: float = TTFT_WINDOW_S) -> list[tuple[float, int, float | None]]:
    """``records`` sent in each ``window_s`` of [0, ``duration_s``): (window start, answered,
    the slowest TTFT in ms, None when none answered)."""
    bins: list[list[float]] = [[] for _ in range(math.ceil(duration_s / window_s))]
    for r in records:
        if r.ok and r.ttft_s is not None and 0 <= r.sent_s < duration_s:
            bins[int(r.sent_s // window_s)].append(r.ttft_s * 1000)
    return [(k * window_s, len(b), max(b, default=None)) for k, b in enumerate(bins)]


SHORT_BUCKET = 5000
"""``vllm:request_prompt_tokens`` bucket (the 1-2-5 series) that holds every chat, short and
backlogged (``BACKLOG_CHAT_TOKENS``), and no 16K-token flood prompt."""


def finished_short_long(metrics_text: str) -> tuple[int, int]:
    """A worker's ``/metrics``: the requests it has finished, (short, long) by ``SHORT_BUCKET``
    prompt tokens."""
    short = sum(promtext.values(metrics_text, "vllm:request_prompt_tokens_bucket",
                                le=f"{float(SHORT_BUCKET)}"))
    total = sum(promtext.values(metrics_text, "vllm:request_prompt_tokens_count"))
    return int(short), int(total - short)


async def finished_per_worker(worker_urls: Sequence[str]) -> dict[str, tuple[int, int]]:
    """Per worker, the requests it has finished so far: (short, long) by ``SHORT_BUCKET``."""
    async def one(session: aiohttp.ClientSession, url: str) -> tuple[int, int]:
        async with session.get(metrics_url(url)) as resp:
            return finished_short_long(await resp.text())

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        counts = await asyncio.gather(*(one(session, u) for u in worker_urls))
    return dict(zip(worker_urls, counts, strict=True))


def load_spec(phase: str, load: Load, duration_s: float, seed: int,
              time_scale: float) -> LoadSpec:
    """The load generator's spec for ``load`` over ``duration_s`` model seconds: its wall-clock
    rate and times, ``time_scale`` wall seconds per model second."""
    seed_t = tenant_seed(seed, load.tenant)
    return LoadSpec(
        model=SIM_MODEL, concurrency=load.users or 1,
        rate=None if load.rate is None else load.rate / time_scale,
        duration_s=duration_s * time_scale, drain_s=DRAIN_S * time_scale,
        timeout_s=600.0 * time_scale,
        headers={"Authorization": f"Bearer {key_of(load.tenant)}"}, seed=seed_t,
        salt=f"{phase}/{load.tenant}/{seed}", ignore_eos=True)


async def run_phase(name: str, gateway: str, url: str, loads: Sequence[Load], duration_s: float,
                    tokens_per_word: float, seed: int, time_scale: float,
                    worker_urls: Sequence[str] = ()
                    ) -> tuple[PhaseResult, dict[str, list[RequestRecord]]]:
    """One phase; ``duration_s``, the loads' rates and every time returned are model time (wall
    = model x ``time_scale``), the loop lag excepted (the host's, in wall time)."""
    async def one(load: Load) -> TargetRun:
        seed_t = tenant_seed(seed, load.tenant)
        spec = WorkloadSpec("mixed", seed=seed_t, requests=100_000, max_tokens=load.max_tokens,
                            tokens_per_word=tokens_per_word, long_fraction=1.0,
                            long_tokens=load.prompt_tokens)
        return await run_target(Target(load.tenant, url), build_workload(spec),
                                 load_spec(name, load, duration_s, seed, time_scale))

    before = await finished_per_worker(worker_urls) if worker_urls else None
    stop = asyncio.Event()
    lagging = asyncio.create_task(loop_lag_s(stop))
    try:
        runs = await asyncio.gather(*(one(load) for load in loads))
    finally:
        stop.set()
    lags = await lagging
    per_worker = None
    if before is not None:
        after = await finished_per_worker(worker_urls)
        per_worker = {u: (after[u][0] - before[u][0], after[u][1] - before[u][1])
                      for u in worker_urls}
    records = {run.target.name: records_in_model_time(run.records, time_scale)
               for run in runs}
    tenants = {}
    for tenant, recs in records.items():
        window = measured(recs, duration_s)
        ttfts = distribution(r.ttft_s for r in window if r.ok)
        errors: dict[str, int] = {}
        for r in window:
            if r.error is not None:
                errors[r.error] = errors.get(r.error, 0) + 1
        tenants[tenant] = TenantResult(
            tenant, len(window), sum(r.ok for r in window), errors,
            None if ttfts is None else ttfts.p50 * 1000,
            None if ttfts is None else ttfts.p99 * 1000,
            served_kv_byte_s(recs, 0.0, duration_s))
    lag = distribution(lags)
    chats = [r for t in ("b", "c") for r in records.get(t, [])]
    return PhaseResult(name, gateway, tenants,
                       None if lag is None else lag.p99 * 1000,
                       None if not lags else max(lags) * 1000, per_worker,
                       ttft_by_window(chats, duration_s) if chats else None), records


# -- the run ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    goal: str
    met: bool | None
    detail: str


@dataclass(frozen=True)
class FairnessRun:
    args: dict[str, Any]
    phases: list[PhaseResult]
    chat_ttft_p99_ms: dict[str, float | None]
    """b and c together, per phase."""
    verdicts: list[Verdict]
    ratio_interval: tuple[float, float] | None = None
    """The judged flood's p99 over quiet's: its ``RATIO_LEVEL`` bootstrap interval."""


def plan(args: argparse.Namespace) -> list[tuple[str, str, list[Load], float]]:
    """Each phase: its name, gateway, loads and duration."""
    chats = [Load(t, CHAT_TOKENS, CHAT_MAX_TOKENS, rate=args.chat_rate) for t in ("b", "c")]
    flood = Load("a", FLOOD_TOKENS, FLOOD_MAX_TOKENS, users=args.flood_users)
    # a keeps its flood's many clients: first come first served would give it their share.
    backlog = [Load("a", FLOOD_TOKENS, FLOOD_MAX_TOKENS, users=args.flood_users)] + [
        Load(t, BACKLOG_CHAT_TOKENS, BACKLOG_CHAT_MAX_TOKENS, users=args.backlog_users)
        for t in ("b", "c", BATCH_TENANT)]
    d = args.duration_s
    gates = args.gates
    judged = verdict_gate(gates)
    # quiet, then the judged gateway's flood, through the one gateway: b and c are chatting
    # there when a's flood comes (the room is kept from a's first prompt on, as it is for a
    # flood that joins), and the two differ only in the flood
    quiet = judged if judged in gates else gates[0]
    floods = sorted(gates, key=lambda g: g != quiet)  # stable: the others in --gates order
    phases = [("quiet", quiet, chats, CHAT_PHASE_FACTOR * d)]
    phases += [(f"flood/{g}", g, [flood, *chats], (CHAT_PHASE_FACTOR if g == judged else 1) * d)
               for g in floods]
    phases += [(f"backlog/{g}", g, backlog, BACKLOG_FACTOR * d) for g in gates
               if g in BACKLOG_GATEWAYS]
    return phases


def verdict_gate(gates: Sequence[str]) -> str:
    """The gateway the targets are judged on: ``room`` when run, else ``fair``."""
    return "room" if "room" in gates else "fair"


def judged_interval(phases: Sequence[str], ttfts: dict[str, list[float]]
                    ) -> tuple[float, float] | None:
    """The bootstrap interval (``RATIO_LEVEL``) of the judged flood's chat TTFT p99 over
    quiet's, from the chats of both phases."""
    gate = verdict_gate([p.removeprefix("flood/") for p in phases if p.startswith("flood/")])
    return ratio_interval(ttfts.get(f"flood/{gate}", []), ttfts.get("quiet", []), 0.99,
                          level=RATIO_LEVEL)


def evaluate(phases: Sequence[PhaseResult], p99: dict[str, float | None],
             interval: tuple[float, float] | None = None) -> list[Verdict]:
    at = {p.name: p for p in phases}
    gate = verdict_gate([p.gateway for p in phases if p.name.startswith("flood/")])
    quiet, fair = p99.get("quiet"), p99.get(f"flood/{gate}")
    spread = ("" if interval is None else
              f"; {RATIO_LEVEL:.0%} bootstrap interval {interval[0]:.2f}-{interval[1]:.2f}x")
    verdicts = [Verdict(
        f"b/c TTFT p99 with a's flood <= {RATIO_GOAL:g}x without ({gate} gate)",
        None if quiet is None or fair is None else fair <= RATIO_GOAL * quiet,
        "-" if quiet is None or fair is None
        else f"{quiet:.0f} -> {fair:.0f} ms ({fair / quiet:.2f}x{spread})")]
    backlog = at.get(f"backlog/{gate}")
    j = backlog.jain if backlog is not None else None
    verdicts.append(Verdict(
        f"Jain's index over a, b, c served KV byte-seconds while backlogged >= {JAIN_GOAL:g}",
        None if j is None else j >= JAIN_GOAL, "-" if j is None else f"{j:.3f}"))
    d = backlog.tenants.get(BATCH_TENANT) if backlog is not None else None
    total = sum(t.served_kv_byte_s for t in backlog.tenants.values()) if backlog else 0.0
    verdicts.append(Verdict(
        "batch tenant d progresses under interactive backlog",
        None if d is None else d.served_kv_byte_s > 0,
        "-" if d is None or not total else
        f"{_gib_s(d.served_kv_byte_s)} served, {d.served_kv_byte_s / total:.0%} of all"))
    return verdicts


@dataclass(frozen=True)
class HostCpu:
    """CPU seconds so far of the simulator's and the gateways' process trees, this process and
    the machine, at a wall time."""

    wall_s: float
    cpu_s: dict[str, float]

    @classmethod
    def read(cls, sims: Sequence[ManagedProcess], gateways: Sequence[ManagedProcess]) -> HostCpu:
        stats = read_proc_stats()
        return cls(time.monotonic(), {
            "sim": sum(tree_cpu_s(stats, p.pid) for p in sims),
            "gateway": sum(tree_cpu_s(stats, p.pid) for p in gateways),
            "loadgen": rusage_cpu_s(resource.RUSAGE_SELF),
            "machine": machine_cpu_s()})

    def cores_since(self, before: HostCpu) -> dict[str, float]:
        wall = max(self.wall_s - before.wall_s, 1e-9)
        return {k: round((v - before.cpu_s[k]) / wall, 3) for k, v in self.cpu_s.items()}


def run(args: argparse.Namespace) -> FairnessRun:
    log_dir = Path(tempfile.mkdtemp(prefix="kvgate-fairness-"))
    with ProcessSet(log_dir) as procs:
        extra = (("--long-prefill-token-threshold", str(args.long_prefill_token_threshold))
                 if args.long_prefill_token_threshold else ())
        fleets = ([("sim", args.workers)] if args.sim_processes == "one" else
                  [(f"sim-{i}", 1) for i in range(args.workers)])
        sims = [procs.start(name, SimProcess(workers=n, time_scale=args.time_scale,
                                             extra_args=extra, log_path=log_dir / f"{name}.log"),
                            timeout_s=60) for name, n in fleets]
        sim_urls = [u for sim in sims for u in sim.urls]
        gateways = [procs.start(f"gateway-{g}", GatewayProcess(
            gateway_config(sim_urls, g, args.slots, args.reserve_workers, args.time_scale),
            log_dir / f"{g}.yaml",
            log_path=log_dir / f"gateway-{g}.log"), timeout_s=60) for g in args.gates]
        urls = {g: gw.url for g, gw in zip(args.gates, gateways, strict=True)}
        calibrated = asyncio.run(calibrate_tokens_per_word(sim_urls, SIM_MODEL))
        tokens_per_word = calibrated[0] if calibrated else 2.0
        phases: list[PhaseResult] = []
        ttfts: dict[str, list[float]] = {}
        p99: dict[str, float | None] = {}
        for k, (name, gateway, loads, duration_s) in enumerate(plan(args)):
            if args.flood_first and name == f"flood/{verdict_gate(args.gates)}":
                # b and c fall silent for longer than the active window: the gateway has
                # forgotten them when a's flood and their chats start together
                time.sleep(FLOOD_FIRST_PAUSE_S * args.time_scale)
            before = HostCpu.read(sims, gateways)
            result, records = asyncio.run(run_phase(name, gateway, urls[gateway], loads,
                                                    duration_s, tokens_per_word, k,
                                                    args.time_scale, sim_urls))
            result = replace(result, host_cores=HostCpu.read(sims, gateways).cores_since(before))
            phases.append(result)
            chats = [r for t in ("b", "c") for r in measured(records.get(t, []), duration_s)]
            ttfts[name] = _ttfts_ms(chats)
            p99[name] = percentile(ttfts[name], 0.99) if ttfts[name] else None
            print(f"fairness: {name:<16} " + "  ".join(
                f"{t.tenant}: {t.ok}/{t.sent} ok, {_gib_s(t.served_kv_byte_s)}"
                for t in result.tenants.values()), flush=True)
    behind = sum(lag_warnings(log_dir / f"{name}.log") for name, _ in fleets)
    if behind:
        print(f"fairness: warning: {behind} simulated engine(s) fell behind their model clock"
              f" (host too slow for time scale {args.time_scale:g}): latencies are inflated",
              flush=True)
    interval = judged_interval([p.name for p in phases], ttfts)
    return FairnessRun(vars(args) | {"out": str(args.out), "kv_bytes_per_token":
                                     KV_BYTES_PER_TOKEN, "tokens_per_word": tokens_per_word,
                                     "sim_engines_behind": behind},
                       phases, p99, evaluate(phases, p99, interval), interval)


# -- the chats in model time alone -------------------------------------------------------------------


@dataclass(frozen=True)
class ModelChats:
    """The chats' TTFT over ``workers`` workers with no host at all (``model_chats``)."""

    workers: int
    chats: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    mixed_share: float
    """Of the engine steps that prefill a chat, the share that also decode another."""
    inflight: float
    """Chats in flight on the workers together, averaged over the run (the sum of their
    durations, arrival to last token, over the run's length): the short demand
    ``limits.reserve_workers: auto`` measures."""


def model_chats(workers: int, rate: float, seconds: float, seed: int = 1) -> ModelChats:
    """b's and c's chats (``CHAT_TOKENS`` in, ``CHAT_MAX_TOKENS`` out, Poisson at ``rate`` per
    model second in all) on ``workers`` simulated workers with nothing else, event-driven through
    the simulator's own scheduler and cost model, no clock: what the modelled GPUs alone give the
    chats' TTFT when they spread over that many workers (each chat to the worker with the fewest
    requests, as ``kv_aware`` does with nothing cached). Under the flood, the room confines them
    to the reserved workers; in the quiet phase they spread over the pool."""
    rng = random.Random(seed)
    cost = PlannerCostModel(MODEL, GPU)
    scheds = [Scheduler(SchedulerConfig(num_gpu_blocks=1 << 20)) for _ in range(workers)]
    plans: list[StepPlan | None] = [None] * workers
    ends = [math.inf] * workers  # each worker's step in progress ends then (inf: idle)
    arrivals: dict[str, float] = {}
    ttfts: list[float] = []
    busy_s = 0.0  # the chats' durations, summed
    steps = [0, 0]  # steps prefilling a chat: alone, with a decode

    def step(w: int, now: float) -> None:
        if not scheds[w].has_unfinished():
            plans[w], ends[w] = None, math.inf
            return
        plan_ = plans[w] = scheds[w].schedule()
        if plan_.prefill_tokens:
            steps[plan_.num_decode_requests > 0] += 1
        ends[w] = now + step_time_s(cost, plan_)

    due = rng.expovariate(rate)
    while True:
        w = min(range(workers), key=ends.__getitem__)
        if due <= ends[w] and due < seconds:  # a chat arrives
            now, due = due, due + rng.expovariate(rate)
            w = min(range(workers), key=lambda i: (scheds[i].num_running
                                                   + scheds[i].num_waiting, rng.random()))
            request = scheds[w].new_request(
                f"chat-{len(arrivals)}", [rng.randrange(16, 32000) for _ in range(CHAT_TOKENS)],
                SamplingSpec(max_tokens=CHAT_MAX_TOKENS, ignore_eos=True), arrival_time=now)
            scheds[w].add_request(request)
            arrivals[request.request_id] = now
            if plans[w] is None:
                step(w, now)
        elif ends[w] < math.inf:  # a step ends
            now = ends[w]
            done = plans[w]
            assert done is not None
            for out in scheds[w].update_from_output(done):
                if out.first_token:
                    ttfts.append(now - arrivals[out.request.request_id])
                if out.finish_reason is not None:
                    busy_s += now - arrivals[out.request.request_id]
            step(w, now)
        else:
            break
    return ModelChats(workers, len(ttfts), percentile(ttfts, 0.5) * 1000,
                      percentile(ttfts, 0.99) * 1000, steps[1] / max(1, sum(steps)),
                      busy_s / seconds)


def model_report(workers: int, rate: float, seconds: float) -> list[str]:
    """``model_chats`` over 1 to ``workers`` workers, as the table ``--model-only`` prints."""
    lines = [f"b/c chats at {rate:g}/s (model time, no host), {seconds:g} s:",
             f"{'workers':>8}{'chats':>7}{'TTFT p50':>10}{'p99':>8}{'x all':>7}"
             f"{'mixed steps':>13}{'in flight/worker':>18}"]
    runs = [model_chats(n, rate, seconds) for n in range(workers, 0, -1)]
    for r in runs:
        lines.append(f"{r.workers:>8}{r.chats:>7}{r.ttft_p50_ms:>10.1f}{r.ttft_p99_ms:>8.1f}"
                     f"{r.ttft_p99_ms / runs[0].ttft_p99_ms:>7.2f}{r.mixed_share:>13.0%}"
                     f"{r.inflight / r.workers:>18.2f}")
    return lines


# -- output ----------------------------------------------------------------------------------------


def _gib_s(byte_s: float) -> str:
    return f"{byte_s / (1 << 30):.0f} GiB*s"


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _per_worker(p: PhaseResult) -> str:
    if p.requests_per_worker is None:
        return "-"
    return " ".join(f"{short}/{long}" for short, long in p.requests_per_worker.values())


def report(result: FairnessRun) -> list[str]:
    quiet = result.chat_ttft_p99_ms.get("quiet")
    lines = [f"{'phase':<16}{'gate':<9}{'chats':>6}{'b/c TTFT p50':>13}{'p99':>8}{'x quiet':>8}"
             f"{'a ok':>6}{'share a/b/c/d (served KV byte-s)':>36}{'Jain a,b,c':>11}"
             f"{'lag p99/max ms':>15}  short/long finished per worker"]
    for p in result.phases:
        chats = [p.tenants[t] for t in ("b", "c") if t in p.tenants]
        p50 = max((t.ttft_p50_ms for t in chats if t.ttft_p50_ms is not None), default=None)
        p99 = result.chat_ttft_p99_ms.get(p.name)
        ratio = p99 / quiet if p99 is not None and quiet else None
        total = sum(t.served_kv_byte_s for t in p.tenants.values()) or 1.0
        shares = "/".join(f"{p.tenants[t].served_kv_byte_s / total:.2f}" if t in p.tenants
                          else "-" for t in TENANTS)
        a = p.tenants.get("a")
        lag = f"{_num(p.loop_lag_p99_ms, '.0f')}/{_num(p.loop_lag_max_ms, '.0f')}"
        lines.append(f"{p.name:<16}{p.gateway:<9}{sum(t.ok for t in chats):>6}"
                     f"{_num(p50, '.0f'):>13}{_num(p99, '.0f'):>8}"
                     f"{_num(ratio, '.2f'):>8}{'-' if a is None else a.ok:>6}{shares:>36}"
                     f"{_num(p.jain, '.3f'):>11}{lag:>15}  {_per_worker(p)}")
    lines.append("")
    judged = f"flood/{verdict_gate([p.gateway for p in result.phases])}"
    for p in result.phases:
        if p.name in ("quiet", judged) and p.chat_ttft_by_window_ms:
            lines.append(f"  b/c slowest TTFT ms per {TTFT_WINDOW_S:g} s sent, {p.name}: " + " ".join(
                _num(worst, ".0f") for _, _, worst in p.chat_ttft_by_window_ms))
    for p in result.phases:
        if p.host_cores:
            lines.append(f"  busy cores, {p.name}: " + ", ".join(
                f"{k} {v:.2f}" for k, v in p.host_cores.items()))
    for v in result.verdicts:
        mark = "n/a" if v.met is None else ("MET" if v.met else "NOT MET")
        lines.append(f"  [{mark}] {v.goal}: {v.detail}")
    return lines


def plot(result: FairnessRun, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    floods = [p for p in result.phases if not p.name.startswith("backlog")]
    values = [result.chat_ttft_p99_ms.get(p.name) or 0.0 for p in floods]
    left.bar(range(len(floods)), values, color=["C2"] + ["C3"] * (len(floods) - 1))
    quiet = result.chat_ttft_p99_ms.get("quiet")
    if quiet:
        left.axhline(RATIO_GOAL * quiet, color="red", linewidth=1.0,
                     label=f"{RATIO_GOAL:g}x quiet")
        judged = f"flood/{verdict_gate([p.gateway for p in floods if p.name != 'quiet'])}"
        names = [p.name for p in floods]
        if result.ratio_interval is not None and judged in names:
            # the interval is of the ratio: drawn at quiet's p99 times its ends
            k, (lo, hi) = names.index(judged), result.ratio_interval
            left.errorbar([k], [values[k]], yerr=[[max(values[k] - lo * quiet, 0.0)],
                                                  [max(hi * quiet - values[k], 0.0)]],
                          fmt="none", ecolor="black", capsize=6,
                          label=f"{RATIO_LEVEL:.0%} bootstrap interval")
        left.legend(fontsize=7)
    left.set_xticks(range(len(floods)), [p.name for p in floods], fontsize=7)
    shown = [v for v in values if v > 0]
    if shown and max(shown) > 10 * min(shown):  # FIFO's seconds next to room's milliseconds
        left.set_yscale("log")
    left.set_ylabel("b/c TTFT p99 (ms)")
    left.set_title("short chats while tenant a floods 16K-token prompts", fontsize=8)
    backlogs = [p for p in result.phases if p.name.startswith("backlog")]
    bottom = [0.0] * len(backlogs)
    for k, tenant in enumerate(TENANTS):
        shares = []
        for p in backlogs:
            total = sum(t.served_kv_byte_s for t in p.tenants.values()) or 1.0
            shares.append(p.tenants[tenant].served_kv_byte_s / total if tenant in p.tenants
                          else 0.0)
        right.bar(range(len(backlogs)), shares, bottom=bottom, color=f"C{k}",
                  label=f"{tenant}{' (batch)' if tenant == BATCH_TENANT else ''}")
        bottom = [b + s for b, s in zip(bottom, shares, strict=True)]
    right.set_xticks(range(len(backlogs)),
                     [f"{p.name}\nJain {_num(p.jain, '.3f')}" for p in backlogs], fontsize=7)
    right.set_ylabel("share of served KV byte-seconds")
    right.set_title("every tenant backlogged", fontsize=8)
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_run(result: FairnessRun, out: Path) -> None:
    """``fairness.json`` and ``fairness.png`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "fairness.json").write_text(json.dumps(
        {"args": result.args, "chat_ttft_p99_ms": result.chat_ttft_p99_ms,
         "ratio_interval": result.ratio_interval,
         "phases": [asdict(p) | {"jain": p.jain} for p in result.phases],
         "verdicts": [asdict(v) for v in result.verdicts]}, indent=2))
    plot(result, out / "fairness.png")


def load_run(path: Path) -> FairnessRun:
    """A run back from its ``fairness.json`` (``--replot``)."""
    data = json.loads(path.read_text())
    phases = []
    for ph in data["phases"]:
        ph = {k: v for k, v in ph.items() if k != "jain"}  # a property, written for readers
        tenants = {t: TenantResult(**r) for t, r in ph.pop("tenants").items()}
        per_worker = ph.pop("requests_per_worker", None)
        windows = ph.pop("chat_ttft_by_window_ms", None)
        phases.append(PhaseResult(
            tenants=tenants, **ph,
            requests_per_worker=None if per_worker is None else
            {url: (short, long) for url, (short, long) in per_worker.items()},
            chat_ttft_by_window_ms=None if windows is None else
            [(start, n, slowest) for start, n, slowest in windows]))
    interval = data.get("ratio_interval")
    return FairnessRun(data["args"], phases, data["chat_ttft_p99_ms"],
                       [Verdict(**v) for v in data["verdicts"]],
                       None if interval is None else (interval[0], interval[1]))


def _reserve(value: str) -> int | Literal["auto"]:
    if value == "auto":
        return "auto"
    if value.isdigit():
        return int(value)
    raise argparse.ArgumentTypeError(f"an integer >= 0 or auto, not {value!r}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m gateway.bench.fairness", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration-s", type=float, default=15.0,
                   help=f"each phase, in model seconds; backlogged ones {BACKLOG_FACTOR}x"
                        " (default 15)")
    p.add_argument("--workers", type=int, default=4, help="simulated workers (default 4)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="wall seconds per modelled second of the simulator; phases, warm-up,"
                        " rates and the times reported are model time, so a larger scale runs"
                        " the same modelled load, slower, and the host's stalls weigh less next"
                        " to the modelled GPU times (default 1)")
    p.add_argument("--sim-processes", choices=("one", "per-worker"), default="per-worker",
                   help="one `kvgate sim` process per simulated worker, as GPUs are independent"
                        " (default), or all of them in one process (one event loop: the work"
                        " of a's 16K-token prompts on their workers delays the chats' workers'"
                        " steps too; the runs before session 21)")
    p.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="the workers' vLLM --long-prefill-token-threshold (default 0: off)")
    p.add_argument("--slots", type=int, default=8,
                   help="the fifo and fair gates' requests in flight (default 8)")
    p.add_argument("--reserve-workers", type=_reserve, default=RESERVE_WORKERS,
                   help="the room gateways' limits.reserve_workers, an integer or auto (default"
                        f" {RESERVE_WORKERS}, the gateway's: one worker per chat in flight;"
                        " with 1, b's and c's chats all share one worker's engine steps under"
                        " the flood, ~1.5x their quiet TTFT p99 in model time alone)")
    p.add_argument("--flood-first", action="store_true",
                   help="pause after quiet until the judged gateway has forgotten b and c"
                        f" ({FLOOD_FIRST_PAUSE_S:g} model s), then start a's flood and their"
                        " chats together: a's first prompts take every worker (alone, nothing"
                        " is held) and the reserve forms as they end")
    p.add_argument("--chat-rate", type=float, default=4.0,
                   help="short chats per model second from each of b and c (default 4)")
    p.add_argument("--flood-users", type=int, default=32,
                   help="tenant a's clients sending 16K-token prompts back to back (default 32)")
    p.add_argument("--backlog-users", type=int, default=8,
                   help="b's, c's and d's clients each in the backlogged phases (default 8)")
    p.add_argument("--gates", default=",".join(DEFAULT_GATEWAYS),
                   help=f"the gateways to compare, in order (the judged one's flood first,"
                        f" right after quiet), of {', '.join(GATEWAYS)} (default"
                        f" {','.join(DEFAULT_GATEWAYS)})")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--model-only", action="store_true",
                   help="print the chats' TTFT over 1 to --workers workers in model time alone"
                        " (the simulator's scheduler and cost model, event-driven, no host, 600"
                        " model seconds), and nothing else: what the reserve's size does to them")
    p.add_argument("--replot", action="store_true",
                   help="only draw fairness.png again from the fairness.json in --out")
    args = p.parse_args(argv)
    if args.duration_s <= WARMUP_S:
        p.error(f"--duration-s must be above the {WARMUP_S:g} s warm-up")
    gates = [g.strip() for g in args.gates.split(",") if g.strip()]
    unknown = [g for g in gates if g not in GATEWAYS]
    if unknown or not gates or len(set(gates)) < len(gates):
        p.error(f"--gates takes distinct names of {', '.join(GATEWAYS)}; got {args.gates!r}")
    args.gates = tuple(gates)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.model_only:
        print("\n".join(model_report(args.workers, 2 * args.chat_rate, MODEL_ONLY_S)))
        return 0
    if args.replot:
        plot(load_run(args.out / "fairness.json"), args.out / "fairness.png")
        print(f"fairness: wrote {args.out / 'fairness.png'}")
        return 0
    result = run(args)
    print("\n".join(report(result)))
    write_run(result, args.out)
    print(f"fairness: wrote {args.out / 'fairness.json'} and {args.out / 'fairness.png'}")
    return 0 if all(v.met for v in result.verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
