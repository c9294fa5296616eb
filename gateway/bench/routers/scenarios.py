"""The three scenarios: ``vllm`` (two real vLLM servers), ``sim16`` (sixteen simulated H100s)
and ``isolation`` (two pools against one under a flood of long prompts); see the package
docstring for what each runs and why."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable
from typing import Any

from gateway.bench.routers.contenders import Lineup, PoolSpec, start_kvgate, start_lineup
from gateway.bench.routers.driver import WorkloadPlan, run_workload
from gateway.bench.routers.report import ScenarioResult
from gateway.bench.routers.scenario_restart import scenario_restart
from gateway.bench.routers.scenario_slo import scenario_slo
from gateway.bench.routers.scenario_tiers import scenario_tiers
from gateway.bench.routers.scenario_zipf import scenario_zipf
from gateway.bench.routers.targets import (
    Verdict,
    at_most,
    fmt_ms,
    fmt_ratio,
    hit_rate_verdicts,
    ttft_verdicts,
)
from gateway.bench.routers.workers import start_sim_workers, start_vllm_workers
from gateway.bench.workloads import WorkloadSpec
from gateway.procs.net import Ports
from gateway.procs.process import ProcessSet, StartError


def scenario_vllm(procs: ProcessSet, ports: Ports, args: argparse.Namespace) -> ScenarioResult:
    workers = start_vllm_workers(procs, 2, block_size=32, num_gpu_blocks=192,
                                 max_model_len=4096)
    lineup = start_lineup(procs, ports, workers, args.contenders, args.sglang_router,
                          args.vllm_router)
    n = 48 if args.quick else 320
    plan = WorkloadPlan("shared-prefix", WorkloadSpec(
        "shared-prefix", requests=n, prefixes=8, prefix_tokens=1024, question_tokens=32,
        max_tokens=8), concurrency=4,
        note="8 prefixes of ~1K tokens (~33 blocks each); 192 blocks per server hold 5 of them, "
             "the two servers together all 8")
    outcome = asyncio.run(run_workload(plan, lineup, workers, procs, args.out_dir,
                                       args.progress))
    verdicts = [("shared-prefix", v) for v in hit_rate_verdicts(outcome.rows,
                                                                  outcome.ceiling_rate)]
    return ScenarioResult("vllm", workers, lineup, [outcome], verdicts)


def scenario_sim16(procs: ProcessSet, ports: Ports, args: argparse.Namespace) -> ScenarioResult:
    ts = args.time_scale if args.time_scale is not None else 8.0
    workers = start_sim_workers(procs, ports, 16, profile="llama-3-8b@h100", time_scale=ts,
                                num_gpu_blocks=1024, processes=args.sim_processes)
    lineup = start_lineup(procs, ports, workers, args.contenders, args.sglang_router,
                          args.vllm_router)
    quick = args.quick
    plans = [
        WorkloadPlan("shared-prefix", WorkloadSpec(
            "shared-prefix", requests=240 if quick else 1440, prefixes=32, prefix_tokens=2048,
            question_tokens=64, max_tokens=16), rate=args.rate or 24.0,
            note="32 prefixes of 2K tokens; 1,024 blocks (16K tokens) per worker hold 8 of them, "
                 "the fleet all 32 many times over"),
        WorkloadPlan("multiturn", WorkloadSpec(
            "multiturn", sessions=16 if quick else 48, turns=8, max_tokens=64),
            concurrency=16 if quick else 48,
            note="bench defaults (system 200, first user 300, +100 per turn, 64-token answers)"),
    ]
    outcomes = []
    verdicts: list[tuple[str, Verdict]] = []
    for plan in plans:
        o = asyncio.run(run_workload(plan, lineup, workers, procs, args.out_dir, args.progress))
        outcomes.append(o)
        verdicts += [(plan.key, v) for v in hit_rate_verdicts(o.rows, o.ceiling_rate)]
        verdicts += [(plan.key, v) for v in ttft_verdicts(o.rows)]
        verdicts += [(plan.key, v) for v in ttft_verdicts(
            o.rows, key="warm_ttft_p99_ms", label="warm TTFT p99")]
    notes = [f"time scale {ts:g}: wall-clock latencies are {ts:g}x the modelled H100's"]
    return ScenarioResult("sim16", workers, lineup, outcomes, verdicts, notes)


def scenario_isolation(procs: ProcessSet, ports: Ports, args: argparse.Namespace
                       ) -> ScenarioResult:
    ts = args.time_scale if args.time_scale is not None else 2.0
    workers = start_sim_workers(procs, ports, 8, profile="llama-3-8b@h100", time_scale=ts,
                                num_gpu_blocks=None, processes=args.sim_processes)
    two = [PoolSpec("short-chat", 8192, [0, 1, 2, 3]),
           PoolSpec("long-context", 131072, [4, 5, 6, 7])]
    one = [PoolSpec("mixed", 131072, list(range(8)))]
    lineup = Lineup()
    for name, pools, policy, desc in (
        ("two_pools", two, "kv_aware", "kvgate kv_aware, 4 short-chat + 4 long-context workers"),
        ("one_pool", one, "kv_aware", "kvgate kv_aware, one pool of the same 8 workers"),
        ("one_pool_rr", one, "round_robin", "kvgate round_robin, one pool of the same 8 workers"),
    ):
        try:
            lineup.contenders.append(start_kvgate(procs, ports, workers, name, policy,
                                                  policy == "kv_aware", desc, pools))
        except StartError as exc:
            lineup.skipped[name] = str(exc).strip()
    quick = args.quick
    rate = args.rate or 10.0
    fraction = 0.25
    n = 120 if quick else 480
    flood = WorkloadPlan("flood", WorkloadSpec(
        "mixed", requests=n, long_tokens=16000, short_tokens=200, long_fraction=fraction,
        max_tokens=32), rate=rate, cache_columns=False,
        note=f"{rate:g} req/s, {fraction:.0%} of them 16K-token prompts")
    calm = WorkloadPlan("no-flood", WorkloadSpec(
        "mixed", requests=round(n * (1 - fraction)), long_tokens=16000, short_tokens=200,
        long_fraction=0.0, max_tokens=32), rate=rate * (1 - fraction), cache_columns=False,
        note=f"the short chats alone at the same short-chat rate, {rate * (1 - fraction):g} req/s")
    outcomes = [asyncio.run(run_workload(p, lineup, workers, procs, args.out_dir, args.progress))
                for p in (calm, flood)]
    verdicts: list[tuple[str, Verdict]] = []
    calm_rows, flood_rows = outcomes[0].rows, outcomes[1].rows
    extra: dict[str, Any] = {}
    for name in ("two_pools", "one_pool", "one_pool_rr"):
        base = calm_rows.get(name, {}).get("groups", {}).get("short", {}).get("ttft_p99_ms")
        hit = flood_rows.get(name, {}).get("groups", {}).get("short", {}).get("ttft_p99_ms")
        extra[name] = {"short_ttft_p99_ms_no_flood": base, "short_ttft_p99_ms_flood": hit,
                       "ratio": None if not base or hit is None else hit / base}
        verdicts.append(("isolation", at_most(
            f"{name}: short-chat TTFT p99 under the flood <= 1.2x without", hit,
            None if base is None else 1.2 * base,
            f"{fmt_ms(hit)} vs {fmt_ms(base)}: {fmt_ratio(hit, base)}")))
    notes = [f"time scale {ts:g}: wall-clock latencies are {ts:g}x the modelled H100's"]
    return ScenarioResult("isolation", workers, lineup, outcomes, verdicts, notes, extra)


SCENARIOS: dict[str, Callable[[ProcessSet, Ports, argparse.Namespace], ScenarioResult]] = {
    "vllm": scenario_vllm,
    "sim16": scenario_sim16,
    "isolation": scenario_isolation,
    "slo": scenario_slo,
    "tiers": scenario_tiers,
    "restart": scenario_restart,
    "zipf_hot": scenario_zipf,
}
