"""Scenario ``slo``: mixed latency-objective classes on a mixed fleet, ``kv_aware`` alone against
``kv_aware`` with the objectives sent (``gateway.routing.slo``).

The fleet: simulated llama-3-8b workers of two GPU generations in one pool, half H100 and half
A100 (a prefill ~3.2x slower). ``kv_aware``'s cost is in tokens, the same on both, so it balances
prefill tokens and an A100's queue drains 3.2x slower: that is where objectives are missed. The
workload (open loop, Poisson arrivals at ``--rate``, 4 req/s wall by default: ~60% of the
fleet's modelled prefill capacity at time scale 8; every prompt unique, so the prefix cache
plays no part):

* ``interactive``: 1K-token prompts, 32 output tokens, TTFT objective 120 ms (modelled);
* ``batch`` (``X-Priority: batch``): 6K-token prompts, 64 output tokens, TTFT objective 800 ms.

Two runs on the same gateway (one ``kvgate serve``, kv_aware, KV events), same arrival schedule,
same classes, prompts salted per run, every worker's prefix cache reset before each:
``kv_aware`` sends no objective headers (the gateway routes exactly as without the feature);
``kv_aware+slo`` sends ``x-slo-ttft-ms`` with each request. Attainment is measured at the client
(request sent -> first content token) against the same objectives in both runs, over the served
requests; requests shed (503 ``slo_unattainable``) are counted apart, and the attainment with
shed counted as missed is given too. The first ``warmup_s`` of each run are not counted (the
gateway calibrates its models from every stream, objective or not). The gateway's own counters
(``kvgate_slo_requests_total``) are read after each run.

Where the misses come from: each run prints its requests served and missed per class, GPU and
route reason (the gateway's ``x-kvgate-worker`` / ``x-kvgate-route-reason`` answer headers), and
``slo.json`` keeps every request with them. The same workload in model time, with the TTFT
predicted at routing against the observed and each miss's cause (a better worker available, a
later request sharing its prefill step, or none able to meet it), is
``python -m gateway.bench.routers.slo_model`` (seconds, deterministic: where the policy is chosen).

Targets (issue 15): with objectives, attainment >= 95% with shed requests counted; and the premise,
``kv_aware`` alone below 95% at this load. Writes ``slo.json`` and ``slo.png`` under the
scenario's directory (the ``routers.json`` the command writes carries only the targets).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from gateway import promtext
from gateway.bench.loadgen import reset
from gateway.bench.routers.contenders import Lineup, start_kvgate
from gateway.bench.routers.report import ScenarioResult
from gateway.bench.routers.targets import Verdict, at_least, at_most, fmt_pct
from gateway.bench.routers.workers import start_sim_workers
from gateway.procs.net import Ports
from gateway.procs.process import ProcessSet, StartError

WORDS = ("the", "cache", "token", "worker", "prefix", "route", "block", "gpu", "decode", "batch")
TOKENS_PER_WORD = 2  # the simulator's ``simple`` tokenizer: a word and its space


@dataclass(frozen=True)
class SloClass:
    name: str
    share: float
    prompt_tokens: int
    max_tokens: int
    ttft_ms_modelled: float
    priority: str


CLASSES = (
    SloClass("interactive", 0.75, 1024, 32, 120.0, "interactive"),
    SloClass("batch", 0.25, 6144, 64, 800.0, "batch"),
)


@dataclass
class Record:
    cls: str
    arrival_s: float
    status: int = 0
    code: str | None = None
    ttft_s: float | None = None
    worker: str = ""  # the gateway's x-kvgate-worker answer header
    reason: str = ""  # ... and x-kvgate-route-reason


@dataclass
class RunResult:
    name: str
    records: list[Record] = field(default_factory=list)
    gateway_counts: dict[str, float] = field(default_factory=dict)


def schedule(rate: float, duration_s: float, seed: int) -> list[tuple[float, SloClass]]:
    rng = random.Random(seed)
    t, out = 0.0, list[tuple[float, SloClass]]()
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            return out
        r, acc = rng.random(), 0.0
        for c in CLASSES:
            acc += c.share
            if r < acc:
                break
        out.append((t, c))


def prompt(c: SloClass, salt: str, i: int, rng: random.Random) -> str:
    words = c.prompt_tokens // TOKENS_PER_WORD - 1
    return f"{salt}-{i} " + " ".join(rng.choice(WORDS) for _ in range(words))


async def one(session: aiohttp.ClientSession, url: str, model: str, c: SloClass, text: str,
              slo_ms: float | None, rec: Record) -> None:
    headers = {"x-priority": c.priority}
    if slo_ms is not None:
        headers["x-slo-ttft-ms"] = f"{slo_ms:.0f}"
    body = {"model": model, "messages": [{"role": "user", "content": text}],
            "max_tokens": c.max_tokens, "stream": True}
    started = time.perf_counter()
    try:
        async with session.post(url + "/v1/chat/completions", json=body,
                                headers=headers) as resp:
            rec.status = resp.status
            rec.worker = resp.headers.get("x-kvgate-worker", "")
            rec.reason = resp.headers.get("x-kvgate-route-reason", "")
            if resp.status != 200:
                try:
                    rec.code = (await resp.json()).get("error", {}).get("code")
                except (aiohttp.ContentTypeError, ValueError):
                    rec.code = None
                return
            async for line in resp.content:
                if rec.ttft_s is None and line.startswith(b"data: ") and b'"content"' in line:
                    rec.ttft_s = time.perf_counter() - started
    except (aiohttp.ClientError, TimeoutError) as exc:
        rec.code = type(exc).__name__


async def run(name: str, url: str, model: str, plan: Sequence[tuple[float, SloClass]],
              time_scale: float, send_slo: bool, salt: str, reset_urls: Sequence[str]) -> RunResult:
    rng = random.Random(salt)
    texts = [prompt(c, salt, i, rng) for i, (_, c) in enumerate(plan)]
    result = RunResult(name)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        await reset(session, reset_urls)
        t0 = time.perf_counter()
        tasks = []
        for (at, c), text in zip(plan, texts, strict=True):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            rec = Record(c.name, at)
            result.records.append(rec)
            slo = c.ttft_ms_modelled * time_scale if send_slo else None
            tasks.append(asyncio.create_task(one(session, url, model, c, text, slo, rec)))
        await asyncio.gather(*tasks)
    return result


def gateway_counts(metrics_url: str) -> dict[str, float]:
    text = httpx.get(metrics_url, timeout=10).text
    by = promtext.sums_by(text, "kvgate_slo_requests_total", ("outcome",))
    return {o: by.get((o,), 0.0) for o in ("met", "missed", "shed")}


def prediction_ratios(metrics_url: str) -> list[dict[str, Any]]:
    """Every series of the calibration gauge (observed / predicted TTFT per worker and gateway
    process, as ``/metrics`` gives them): how far each worker's predictions are off."""
    text = httpx.get(metrics_url, timeout=10).text
    series = promtext.samples(text).get("kvgate_slo_prediction_ratio", {})
    return [dict(labels) | {"ratio": v} for labels, v in sorted(series.items())
            if dict(labels).get("slo") == "ttft"]


def summarize(r: RunResult, time_scale: float, warmup_s: float,
              kinds: dict[str, str] | None = None) -> dict[str, Any]:
    """Attainment per class; with ``kinds`` (worker url -> GPU), the requests served and missed
    per class, GPU and route reason too (where the misses come from)."""
    out: dict[str, Any] = {"classes": {}}
    if kinds is not None:
        where: dict[str, list[int]] = {}
        for x in r.records:
            if x.arrival_s < warmup_s or x.status != 200 or x.ttft_s is None:
                continue
            c = next(c for c in CLASSES if c.name == x.cls)
            key = f"{x.cls} on {kinds.get(x.worker, '?')} ({x.reason})"
            row = where.setdefault(key, [0, 0])
            row[0] += 1
            row[1] += x.ttft_s > c.ttft_ms_modelled * time_scale / 1e3
        out["served_missed_by_class_gpu_reason"] = dict(sorted(where.items()))
    tot_met = tot_served = tot_shed = 0
    for c in CLASSES:
        recs = [x for x in r.records if x.cls == c.name and x.arrival_s >= warmup_s]
        target_s = c.ttft_ms_modelled * time_scale / 1e3
        served = [x for x in recs if x.status == 200 and x.ttft_s is not None]
        met = sum(1 for x in served if x.ttft_s is not None and x.ttft_s <= target_s)
        shed = sum(1 for x in recs if x.code == "slo_unattainable")
        errors = len(recs) - len(served) - shed
        ttfts = sorted(x.ttft_s for x in served if x.ttft_s is not None)
        out["classes"][c.name] = {
            "requests": len(recs), "served": len(served), "met": met, "shed": shed,
            "errors": errors, "objective_ms": target_s * 1e3,
            "attainment": met / len(served) if served else None,
            "attainment_shed_as_missed": met / (len(served) + shed) if served or shed else None,
            "ttft_p50_ms": _q(ttfts, 0.5), "ttft_p99_ms": _q(ttfts, 0.99),
        }
        tot_met, tot_served, tot_shed = tot_met + met, tot_served + len(served), tot_shed + shed
    out["attainment"] = tot_met / tot_served if tot_served else None
    out["attainment_shed_as_missed"] = (tot_met / (tot_served + tot_shed)
                                        if tot_served + tot_shed else None)
    out["shed"] = tot_shed
    out["gateway_counts"] = r.gateway_counts
    return out


def _q(xs: Sequence[float], q: float) -> float | None:
    return None if not xs else xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3


def table(rows: dict[str, dict[str, Any]]) -> str:
    head = ["run", "class", "requests", "served", "shed", "errors", "objective ms",
            "TTFT p50 ms", "TTFT p99 ms", "attained", "shed as missed"]
    cells = []
    for name, s in rows.items():
        for cname, c in s["classes"].items():
            cells.append([name, cname, str(c["requests"]), str(c["served"]), str(c["shed"]),
                          str(c["errors"]), f"{c['objective_ms']:.0f}",
                          _f(c["ttft_p50_ms"]), _f(c["ttft_p99_ms"]), fmt_pct(c["attainment"]),
                          fmt_pct(c["attainment_shed_as_missed"])])
        cells.append([name, "all", "", "", str(s["shed"]), "", "", "", "",
                      fmt_pct(s["attainment"]), fmt_pct(s["attainment_shed_as_missed"])])
    widths = [max(len(head[i]), *(len(c[i]) for c in cells)) + 2 for i in range(len(head))]
    lines = ["".join(h.ljust(w) if i < 2 else h.rjust(w)
                     for i, (h, w) in enumerate(zip(head, widths, strict=True)))]
    lines += ["".join(x.ljust(w) if i < 2 else x.rjust(w)
                      for i, (x, w) in enumerate(zip(c, widths, strict=True))) for c in cells]
    return "\n".join(lines)


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def plot(rows: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 3.6))
    names = list(rows)
    classes = [c.name for c in CLASSES]
    w = 0.8 / len(names)
    for k, name in enumerate(names):
        xs = [i - 0.4 + w * (k + 0.5) for i in range(len(classes) + 1)]
        att = [(rows[name]["classes"][c]["attainment"] or 0) * 100 for c in classes]
        att.append((rows[name]["attainment"] or 0) * 100)
        left.bar(xs, att, w, label=name)
        p99 = [rows[name]["classes"][c]["ttft_p99_ms"] or 0 for c in classes]
        right.bar(xs[:-1], p99, w, label=name)
    left.axhline(95, color="k", ls="--", lw=1, label="target 95%")
    left.set_xticks(range(len(classes) + 1), [*classes, "all"])
    left.set_ylabel("TTFT objective attained (% of served)")
    left.set_ylim(0, 100)
    left.legend(fontsize=8, loc="lower right")
    for i, c in enumerate(CLASSES):
        obj = rows[names[0]]["classes"][c.name]["objective_ms"]
        right.hlines(obj, i - 0.4, i + 0.4, colors="k", linestyles="--", lw=1)
    right.set_xticks(range(len(classes)), classes)
    right.set_ylabel("TTFT p99 (ms, wall clock; dashed: objective)")
    right.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def scenario_slo(procs: ProcessSet, ports: Ports, args: argparse.Namespace) -> ScenarioResult:
    ts = args.time_scale if args.time_scale is not None else 8.0
    per_kind = 3
    fast = start_sim_workers(procs, ports, per_kind, profile="llama-3-8b@h100", time_scale=ts,
                             num_gpu_blocks=None, processes=1, name="sim-h100")
    slow = start_sim_workers(procs, ports, per_kind, profile="llama-3-8b@a100", time_scale=ts,
                             num_gpu_blocks=None, processes=1, name="sim-a100")
    workers = dataclasses.replace(
        fast, urls=fast.urls + slow.urls, events=fast.events + slow.events,
        process_names=fast.process_names + slow.process_names,
        commands=fast.commands + slow.commands,
        description=f"{per_kind} simulated H100 + {per_kind} A100 (llama-3-8b, time scale"
                    f" {ts:g}), one pool")
    lineup = Lineup()
    try:
        gw = start_kvgate(procs, ports, workers, "kvgate_kv", "kv_aware", True,
                          "kvgate kv_aware, KV events; the objectives sent or not")
        lineup.contenders.append(gw)
    except StartError as exc:
        lineup.skipped["kvgate_kv"] = str(exc).strip()
        return ScenarioResult("slo", workers, lineup, [], [], [f"kvgate did not start: {exc}"])
    rate = args.rate or 4.0
    duration_s = args.duration_s or (45.0 if args.quick else 100.0)
    warmup_s = 10.0
    plan = schedule(rate, duration_s, seed=15)
    resets = [u + "/reset_prefix_cache" for u in workers.urls]
    rows: dict[str, dict[str, Any]] = {}
    for name, send in (("kv_aware", False), ("kv_aware+slo", True)):
        print(f"routers: slo: {name}, {len(plan)} requests over {duration_s:g} s", flush=True)
        r = asyncio.run(run(name, gw.url, workers.model, plan, ts, send,
                            f"{name}-{random.randrange(10**9)}", resets))
        assert gw.metrics_url is not None
        before = dict(rows[next(iter(rows))]["gateway_counts_total"]) if rows else {}
        counts = gateway_counts(gw.metrics_url)
        r.gateway_counts = {k: v - before.get(k, 0.0) for k, v in counts.items()}
        kinds = {u: "h100" for u in fast.urls} | {u: "a100" for u in slow.urls}
        rows[name] = summarize(r, ts, warmup_s, kinds)
        rows[name]["records"] = [dataclasses.asdict(x) for x in r.records]
        for key, (served, missed) in rows[name]["served_missed_by_class_gpu_reason"].items():
            print(f"routers: slo: {name}: {key}: {served} served, {missed} missed", flush=True)
        rows[name]["gateway_counts_total"] = counts
        rows[name]["ttft_prediction_ratios"] = ratios = prediction_ratios(gw.metrics_url)
        print(f"routers: slo: {name}: observed/predicted TTFT: " + ", ".join(
            f"{kinds.get(r.get('worker', ''), '?')} {r['ratio']:.2f}" for r in ratios), flush=True)
    plain, slo = rows["kv_aware"], rows["kv_aware+slo"]
    verdicts: list[tuple[str, Verdict]] = [
        ("slo", at_least("kv_aware+slo: TTFT objectives attained >= 95% of served requests",
                         slo["attainment"], 0.95,
                         f"{fmt_pct(slo['attainment'])}; {slo['shed']} shed"
                         f" ({fmt_pct(slo['attainment_shed_as_missed'])} with shed as missed)")),
        ("slo", at_most("premise: kv_aware alone attains < 95% at this load",
                        plain["attainment"], 0.95, fmt_pct(plain["attainment"]))),
    ]
    print(f"\n--- slo: {rate:g} req/s for {duration_s:g} s (first {warmup_s:g} s not counted)")
    print(table(rows))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "slo.json").write_text(json.dumps({
        "scenario": "slo", "workers": workers.description, "urls": workers.urls,
        "rate_per_s": rate, "duration_s": duration_s, "warmup_s": warmup_s, "time_scale": ts,
        "classes": [dataclasses.asdict(c) for c in CLASSES], "runs": rows,
        "gateway": dataclasses.asdict(gw)}, indent=1, default=str))
    plot(rows, out / "slo.png", f"python -m gateway.bench.routers --scenario slo:"
         f" {workers.description}, {rate:g} req/s")
    print(f"wrote {out / 'slo.json'}, {out / 'slo.png'}")
    notes = [f"time scale {ts:g}: wall-clock latencies and objectives are {ts:g}x the modelled",
             f"kv_aware: {fmt_pct(plain['attainment'])} attained; kv_aware+slo:"
             f" {fmt_pct(slo['attainment'])} attained, {slo['shed']} shed"]
    return ScenarioResult("slo", workers, lineup, [], verdicts, notes)
