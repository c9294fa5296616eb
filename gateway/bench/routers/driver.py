"""One workload against the whole lineup: the same requests through every contender in turn.

Before each contender every worker's prefix cache is reset and a fresh prompt salt is drawn; the
load generator of ``kvgate bench`` sends the workload; the gateway's own ``/metrics`` (kvgate
contenders) is read before and after for its routing decisions; then the ceiling of exactly the
prompts that contender sent is computed. Writes ``kvgate bench``'s ``bench.json`` and latency
CDF for the workload.
"""

from __future__ import annotations

import dataclasses
import secrets
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from gateway import promtext
from gateway.bench.loadgen import LoadSpec, Progress, Target, calibrate_tokens_per_word, run_target
from gateway.bench.report import (
    TargetReport,
    build_report,
    compare_table,
    plot_cdfs,
    target_block,
    to_json,
    write_json,
)
from gateway.bench.routers.ceiling import (
    CacheCount,
    ceiling_hits,
    counter_delta,
    load_spread,
    sent_prompts,
    warm_ttft_ms,
)
from gateway.bench.routers.contenders import Lineup
from gateway.bench.routers.workers import Workers, lag_warnings
from gateway.bench.stats import Summary
from gateway.bench.workloads import WorkloadSpec, build_workload
from gateway.procs.process import ProcessSet
from gateway.prompt.tokenizer import load_tokenizer


@dataclass(frozen=True)
class WorkloadPlan:
    key: str
    """Directory and table name."""
    spec: WorkloadSpec
    concurrency: int | None = None
    rate: float | None = None
    duration_s: float | None = None
    ignore_eos: bool = True
    note: str = ""
    cache_columns: bool = True
    """False: every prompt is unique by design, so hit rates say nothing (not shown)."""

    def bench_argv(self) -> list[str]:
        """The equivalent ``kvgate bench`` options (for reproducing one workload by hand)."""
        defaults = WorkloadSpec(self.spec.name)
        argv = ["--workload", self.spec.name]
        for f in dataclasses.fields(WorkloadSpec):
            if f.name in ("name", "tokens_per_word"):
                continue
            value = getattr(self.spec, f.name)
            if value != getattr(defaults, f.name) and value is not None:
                text = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
                argv += [f"--{f.name.replace('_', '-')}", text]
        if self.rate is not None:
            argv += ["--rate", f"{self.rate:g}"]
        else:
            argv += ["--concurrency", str(self.concurrency or 8)]
        if self.duration_s is not None:
            argv += ["--duration-s", f"{self.duration_s:g}"]
        if self.ignore_eos:
            argv.append("--ignore-eos")
        return argv


@dataclass
class WorkloadOutcome:
    plan: WorkloadPlan
    reports: list[TargetReport]
    rows: dict[str, dict[str, Any]]
    ceiling_rate: float | None
    ceilings: dict[str, float | None]
    tokens_per_word: float
    bench_command: str
    lag_warnings: int


async def run_workload(plan: WorkloadPlan, lineup: Lineup, workers: Workers, procs: ProcessSet,
                       out_dir: Path, progress: bool
                       ) -> WorkloadOutcome:
    """Every contender in turn (reset before each), then the ceiling of each contender's run."""
    targets = [Target(c.name, c.url) for c in lineup.contenders]
    resets = [u + "/reset_prefix_cache" for u in workers.urls]
    measured = await calibrate_tokens_per_word(workers.urls, workers.model)
    tpw = measured[0] if measured else 1.0
    spec = dataclasses.replace(plan.spec, tokens_per_word=tpw)
    workload = build_workload(spec)
    load = LoadSpec(model=workers.model, concurrency=plan.concurrency or 8, rate=plan.rate,
                    duration_s=plan.duration_s, drain_s=60.0, timeout_s=300.0,
                    ignore_eos=plan.ignore_eos, seed=spec.seed)
    bench_cmd = shlex.join([
        "kvgate", "bench", *plan.bench_argv(), "--model", workers.model,
        "--tokens-per-word", f"{tpw:.3f}", "--compare", *(f"{t.name}={t.url}" for t in targets),
        "--worker-url", *workers.urls, "--reset-url", *resets,
        "--out", str(out_dir / plan.key)])
    mode = (f"open loop {plan.rate:g}/s" if plan.rate is not None
            else f"closed loop, {load.concurrency} users")
    print(f"\n=== {plan.key}: {workload.total} requests, {mode}, tokens/word {tpw:.2f}\n"
          f"    {bench_cmd}", flush=True)
    tokenizer = load_tokenizer(workers.tokenizer)
    reports: list[TargetReport] = []
    rows: dict[str, dict[str, Any]] = {}
    ceilings: dict[str, float | None] = {}
    lag_before = lag_warnings(procs, workers)
    bar = Progress(progress)
    for c in lineup.contenders:
        target = Target(c.name, c.url)
        metrics_before = _scrape_text(c.metrics_url)
        salted = dataclasses.replace(load, salt=secrets.token_hex(4))
        result = await run_target(target, workload, salted, worker_urls=workers.urls,
                                  reset_urls=resets, progress=bar)
        metrics_after = _scrape_text(c.metrics_url)
        report = build_report(result)
        reports.append(report)
        print()
        print(target_block(report))
        per_prompt = list(ceiling_hits(sent_prompts(workload, result.records, salted, tokenizer),
                                        workers.block_size_tokens))
        count = CacheCount(sum(n for n, _ in per_prompt), sum(h for _, h in per_prompt))
        ceilings[c.name] = count.hit_rate
        row = summary_row(report, count.hit_rate)
        row.update(warm_ttft_ms(result.records, per_prompt))
        row["ceiling_hit_rate"] = count.hit_rate
        row["salt"] = salted.salt
        row["reset_ok"] = result.reset_ok
        row["groups"] = {g: _group_row(s) for g, s in report.groups.items()}
        per_worker = _per_worker_queries(report)
        row["worker_query_tokens"] = per_worker
        row["load_spread"] = load_spread(per_worker)
        if metrics_before is not None and metrics_after is not None:
            labels = ("pool", "policy", "reason")
            decisions = counter_delta(
                promtext.sums_by(metrics_before, "kvgate_routing_decisions_total", labels),
                promtext.sums_by(metrics_after, "kvgate_routing_decisions_total", labels))
            row["decisions"] = {"/".join(k): v for k, v in sorted(decisions.items())}
            per = counter_delta(
                promtext.sums_by(metrics_before, "kvgate_requests_total", ("worker",)),
                promtext.sums_by(metrics_after, "kvgate_requests_total", ("worker",)))
            row["gateway_requests_per_worker"] = {k[0]: v for k, v in sorted(per.items())}
            print("routing decisions: " + ", ".join(
                f"{k} {v:.0f}" for k, v in row["decisions"].items()))
        rows[c.name] = row
    lag = lag_warnings(procs, workers) - lag_before
    ceiling_rate = _mean([v for v in ceilings.values() if v is not None])
    for row in rows.values():
        rate = row.get("hit_rate")
        ceil = row.get("ceiling_hit_rate")
        row["of_ceiling"] = None if rate is None or not ceil else rate / ceil
    if len(reports) > 1:
        print(f"\n== comparison ({plan.key}; ratios to {reports[0].run.target.name})")
        print(compare_table(reports))
    wdir = out_dir / plan.key
    wdir.mkdir(parents=True, exist_ok=True)
    config = {
        "argv": plan.bench_argv(), "equivalent_command": bench_cmd, "model": workers.model,
        "workload": dataclasses.asdict(spec), "load": dataclasses.asdict(load),
        "tokens_per_word_source": measured[1] if measured else "assumed",
        "targets": [dataclasses.asdict(t) for t in targets], "worker_urls": workers.urls,
        "reset_urls": resets,
    }
    write_json(wdir / "bench.json", to_json(reports, config))
    if reports:
        plot_cdfs(reports, wdir / "latency_cdf.png", f"{plan.key}: {workers.description}")
    return WorkloadOutcome(plan, reports, rows, ceiling_rate, ceilings, tpw, bench_cmd, lag)


def _group_row(s: Summary) -> dict[str, Any]:
    return {"requests": s.requests, "ok": s.ok, "errors": dict(s.errors),
            "ttft_p50_ms": _q_ms(s, "p50"),
            "ttft_p99_ms": _q_ms(s, "p99"), "requests_per_s": s.requests_per_s,
            "output_tokens_per_s": s.output_tokens_per_s}


def _per_worker_queries(report: TargetReport) -> dict[str, float]:
    out: dict[str, float] = {}
    for url, before in report.run.workers_before.items():
        after = report.run.workers_after.get(url)
        if before is None or after is None:
            continue
        out[url] = max(0.0, after.prefix_cache_queries_tokens - before.prefix_cache_queries_tokens)
    return out


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _scrape_text(url: str | None) -> str | None:
    if url is None:
        return None
    try:
        r = httpx.get(url, timeout=10)
    except httpx.HTTPError:
        return None
    return r.text if r.status_code == 200 else None



def summary_row(report: TargetReport, ceiling_rate: float | None) -> dict[str, Any]:
    """The numbers of one contender on one workload that the table and the targets use."""
    s = report.summary
    rate = report.cache.hit_rate if report.cache else None
    return {
        "requests": s.requests, "ok": s.ok, "errors": dict(s.errors),
        "ttft_p50_ms": _q_ms(s, "p50"), "ttft_p99_ms": _q_ms(s, "p99"),
        "tpot_p50_ms": None if s.tpot_s is None else s.tpot_s.p50 * 1000,
        "e2e_p50_s": None if s.e2e_s is None else s.e2e_s.p50,
        "requests_per_s": s.requests_per_s, "output_tokens_per_s": s.output_tokens_per_s,
        "hit_rate": rate,
        "of_ceiling": None if rate is None or not ceiling_rate else rate / ceiling_rate,
        "duration_s": report.run.duration_s,
    }


def _q_ms(s: Summary, q: str) -> float | None:
    return None if s.ttft_s is None else float(getattr(s.ttft_s, q)) * 1000
