"""The ``tiers`` scenario (issue 15, item 4): a working set larger than the fleet's GPU KV cache
but within GPU + CPU, on simulated H100s with a CPU tier (vLLM's ``--kv-offloading-size``).

Workers: four simulated H100s (llama-3-8b, ``kvgate sim`` in one process per two workers),
1,024 GPU blocks of 16 tokens each (16K tokens: 8 prefixes of 2K) and a CPU tier of 4,096
blocks (``--cpu-offload-blocks``: 64K tokens, 32 prefixes), loads priced at 25 GB/s (a 2K-token
prefix: 268 MB, ≈ 11 ms modelled, against ≈ 66 ms to prefill it). Workload: shared-prefix, 48
prefixes of 2K tokens (6,144 blocks: 1.5x the fleet's GPU cache, a third of GPU + CPU), 64-token
questions, 16-token answers, open loop.

Contenders, on the same workers (their CPU tiers work alike for all; the routers differ in
what they know of them):

* ``kvgate_tiers``: ``kv_aware`` with KV events, lower tiers kept (``kv_events.lower_tiers``,
  the default): a prefix its holder evicted from the GPU but kept on the CPU goes back there at
  its reload cost (``pools[].kv_aware.cpu_reload_tokens_per_token``);
* ``kvgate_gpu_only``: the same with ``lower_tiers: false`` (what kvgate did before: CPU events
  dropped): an evicted prefix looks cold everywhere, so it goes where load says and is
  recomputed there (unless that happens to be its CPU holder);
* the Rust routers (``sglang_cache_aware``, ``vllm_router_cache_aware``) when ``--contenders``
  names them and they are installed: approximate trees of what they routed, blind to evictions.

Target: ``kvgate_tiers``' warm TTFT p99 <= 0.5x ``kvgate_gpu_only``'s. Hit rates are the
workers' GPU prefix-cache counters (``vllm:prefix_cache_hits_total``), which do not count a CPU
reload as a hit (vLLM counts those as external hits): the table's hit rate is the GPU's.
"""

from __future__ import annotations

import argparse
import asyncio

from gateway.bench.routers.contenders import (
    Contender,
    Lineup,
    kvgate_config,
    launch_kvgate,
    start_lineup,
)
from gateway.bench.routers.driver import WorkloadPlan, run_workload
from gateway.bench.routers.report import ScenarioResult
from gateway.bench.routers.targets import Verdict, at_most, fmt_ms, fmt_ratio
from gateway.bench.routers.workers import Workers, start_sim_workers
from gateway.bench.workloads import WorkloadSpec
from gateway.procs.net import Ports
from gateway.procs.process import ProcessSet, StartError

PROFILE = "llama-3-8b@h100"
WORKERS = 4
GPU_BLOCKS = 1024
CPU_BLOCKS = 4096
PEERS = ("sglang_cache_aware", "vllm_router_cache_aware")


def start_kvgate_tiers(procs: ProcessSet, ports: Ports, workers: Workers, name: str,
                       lower_tiers: bool, description: str) -> Contender:
    port = ports.take()
    config = kvgate_config(workers, port, "kv_aware", True)
    config["kv_events"] = {"lower_tiers": lower_tiers}
    return launch_kvgate(procs, port, name, config, description)


def scenario_tiers(procs: ProcessSet, ports: Ports, args: argparse.Namespace) -> ScenarioResult:
    ts = args.time_scale if args.time_scale is not None else 4.0
    workers = start_sim_workers(procs, ports, WORKERS, profile=PROFILE, time_scale=ts,
                                num_gpu_blocks=GPU_BLOCKS, cpu_offload_blocks=CPU_BLOCKS,
                                processes=max(1, min(args.sim_processes, WORKERS // 2)))
    lineup = Lineup()
    for name, lower_tiers, desc in (
        ("kvgate_tiers", True, "kvgate kv_aware, KV events, GPU + CPU tiers indexed"),
        ("kvgate_gpu_only", False, "kvgate kv_aware, KV events, GPU tier only"),
    ):
        try:
            lineup.contenders.append(start_kvgate_tiers(procs, ports, workers, name,
                                                        lower_tiers, desc))
        except StartError as exc:
            lineup.skipped[name] = str(exc).strip()
    peers = start_lineup(procs, ports, workers, [n for n in args.contenders if n in PEERS],
                         args.sglang_router, args.vllm_router)
    lineup.contenders += peers.contenders
    lineup.skipped.update(peers.skipped)
    quick = args.quick
    rate = args.rate or 6.0
    plan = WorkloadPlan("shared-prefix", WorkloadSpec(
        "shared-prefix", requests=240 if quick else 960, prefixes=48, prefix_tokens=2048,
        question_tokens=64, max_tokens=16), rate=rate,
        note=f"48 prefixes of 2K tokens (6,144 blocks) on {WORKERS} workers of {GPU_BLOCKS} GPU"
             f" + {CPU_BLOCKS} CPU blocks: 1.5x the fleet's GPU KV, a third of GPU + CPU;"
             f" {rate:g} req/s")
    outcome = asyncio.run(run_workload(plan, lineup, workers, procs, args.out_dir,
                                       args.progress))
    rows = outcome.rows
    tiers_p99 = rows.get("kvgate_tiers", {}).get("warm_ttft_p99_ms")
    gpu_p99 = rows.get("kvgate_gpu_only", {}).get("warm_ttft_p99_ms")
    verdicts: list[tuple[str, Verdict]] = [("shared-prefix", at_most(
        "kvgate_tiers warm TTFT p99 <= 0.5x kvgate_gpu_only's", tiers_p99,
        None if gpu_p99 is None else 0.5 * gpu_p99,
        f"{fmt_ms(tiers_p99)} vs {fmt_ms(gpu_p99)}: {fmt_ratio(tiers_p99, gpu_p99)}"))]
    notes = [f"time scale {ts:g}: wall-clock latencies are {ts:g}x the modelled H100's",
             "hit rates are GPU prefix-cache hits: a CPU reload is vLLM's external hit, not"
             " counted there"]
    extra = {"warm_ttft_p99_ratio": None if not gpu_p99 or tiers_p99 is None
             else tiers_p99 / gpu_p99}
    return ScenarioResult("tiers", workers, lineup, [outcome], verdicts, notes, extra)
