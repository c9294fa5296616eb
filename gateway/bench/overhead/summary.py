"""The overhead benchmark's rounds summed up per target (medians of throughput and latency, CPU
per request) and the issue's targets judged on them: met, missed or not run."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from gateway.bench.overhead.model import Round, Summary, Verdict


def _median(values: Sequence[float | None]) -> float | None:
    xs = [v for v in values if v is not None]
    return statistics.median(xs) if xs else None


def _per_request_us(cpu_s: float, requests: int) -> float:
    return cpu_s * 1e6 / requests if requests else float("nan")


def summarize(rounds: Sequence[Round]) -> list[Summary]:
    """Per target (in the order first seen): medians of throughput and latency over rounds, CPU
    per request over all rounds together; ratios and added latency against ``direct``."""
    by_target: dict[str, list[Round]] = {}
    for r in rounds:
        by_target.setdefault(r.target, []).append(r)
    base = {}
    if "direct" in by_target:
        d = by_target["direct"]
        base = {"rps": statistics.median(r.load.requests_per_s for r in d),
                "p50": statistics.median(r.load.p50_ms for r in d),
                "p99": statistics.median(r.load.p99_ms for r in d)}
    out = []
    for name, rs in by_target.items():
        requests = sum(r.load.requests for r in rs)
        wall = sum(r.wall_s for r in rs)
        rps = statistics.median(r.load.requests_per_s for r in rs)
        p50 = statistics.median(r.load.p50_ms for r in rs)
        p99 = statistics.median(r.load.p99_ms for r in rs)
        routed = [r.router_cpu_s for r in rs if r.router_cpu_s is not None]
        router_cpu = sum(routed) if routed else None
        in_kernel = [r.router_kernel_cpu_s for r in rs if r.router_kernel_cpu_s is not None]
        backend_cpu = sum(r.backend_cpu_s for r in rs)
        load_cpu = sum(r.loadgen_cpu_s for r in rs)
        other_cpu = sum(r.machine_cpu_s for r in rs) - (router_cpu or 0.0) - backend_cpu - load_cpu
        several = [r for r in rs if len(r.router_processes_cpu_s) > 1]  # a supervisor's
        split = [r.router_processes_cpu_s for r in several]
        shared = sum(sum(s) for s in split)
        # what the router spent outside its children (the supervisor), over the same rounds
        outside = sum(r.router_cpu_s - sum(r.router_processes_cpu_s) for r in several
                      if r.router_cpu_s is not None)
        out.append(Summary(
            case=rs[0].case, target=name, rounds=len(rs), requests=requests,
            errors=sum(r.load.errors for r in rs), requests_per_s=rps,
            ratio=rps / base["rps"] if base and base["rps"] else None,
            p50_ms=p50, p99_ms=p99,
            added_p50_ms=p50 - base["p50"] if base else None,
            added_p99_ms=p99 - base["p99"] if base else None,
            ttft_p50_ms=_median([r.load.ttft_p50_ms for r in rs]),
            ttft_p99_ms=_median([r.load.ttft_p99_ms for r in rs]),
            tpot_p50_ms=_median([r.load.tpot_p50_ms for r in rs]),
            router_cpu_us_per_request=(None if router_cpu is None
                                       else _per_request_us(router_cpu, requests)),
            backend_cpu_us_per_request=_per_request_us(backend_cpu, requests),
            loadgen_cpu_us_per_request=_per_request_us(load_cpu, requests),
            router_cores=None if router_cpu is None else router_cpu / wall,
            backend_cores=backend_cpu / wall, loadgen_cores=load_cpu / wall,
            other_cores=max(other_cpu, 0.0) / wall,
            busiest_process_share=sum(s[0] for s in split) / shared if shared > 0 else None,
            processes=max((len(s) for s in split), default=1),
            supervisor_cpu_us_per_request=(
                _per_request_us(max(outside, 0.0), sum(r.load.requests for r in several))
                if several else None),
            router_kernel_cpu_us_per_request=(_per_request_us(sum(in_kernel), requests)
                                              if in_kernel else None),
        ))
    return out


RUST_ROUTERS = ("vllm_router_rr", "sglang_rr", "sglang_cache_aware")


def evaluate(summaries: Sequence[Summary], processes: int) -> list[Verdict]:
    """The issue's targets, each met, missed or not run (never left out)."""
    at = {(s.case, s.target): s for s in summaries}
    verdicts: list[Verdict] = []
    kv = [f"kvgate_kv_hf_p{n}" for n in sorted({1, processes})]

    def missing(goal: str, target: str, *needed: tuple[str, str]) -> bool:
        gone = [f"{t} in {c}" for c, t in needed if (c, t) not in at]
        if gone:
            verdicts.append(Verdict(goal, target, None, "not run: " + ", ".join(gone)))
        return bool(gone)

    goal = "delay20: >= 0.9 of direct req/s, added p99 <= 10 ms"
    for t in kv:
        if not missing(goal, t, ("delay20", t), ("delay20", "direct")):
            s = at["delay20", t]
            assert s.ratio is not None and s.added_p99_ms is not None
            verdicts.append(Verdict(goal, t, s.ratio >= 0.9 and s.added_p99_ms <= 10.0,
                                    f"ratio {s.ratio:.2f}, added p99 {s.added_p99_ms:+.1f} ms"))
    goal = "short: CPU per request <= 2x vllm-router's"
    for t in kv:
        if not missing(goal, t, ("short", t), ("short", "vllm_router_rr")):
            mine = at["short", t].router_cpu_us_per_request
            theirs = at["short", "vllm_router_rr"].router_cpu_us_per_request
            assert mine is not None and theirs is not None
            verdicts.append(Verdict(goal, t, mine <= 2 * theirs,
                                    f"{mine:.0f} vs {theirs:.0f} us/req ({mine / theirs:.1f}x)"))
    goal = "stream: TTFT p99 <= 1.2x the best Rust router's"
    rust = [at["stream", r] for r in RUST_ROUTERS
            if ("stream", r) in at and at["stream", r].ttft_p99_ms is not None]
    for t in kv:
        if not missing(goal, t, ("stream", t)):
            mine_ttft = at["stream", t].ttft_p99_ms
            if not rust or mine_ttft is None:
                verdicts.append(Verdict(goal, t, None, "not run: no Rust router (or no TTFT) "
                                        "in stream"))
                continue
            best = min(rust, key=lambda s: s.ttft_p99_ms or float("inf"))
            assert best.ttft_p99_ms is not None
            verdicts.append(Verdict(goal, t, mine_ttft <= 1.2 * best.ttft_p99_ms,
                                    f"{mine_ttft:.0f} vs {best.ttft_p99_ms:.0f} ms "
                                    f"({best.target})"))
    if processes > 1:
        goal = f"{processes} processes do not lose to 1 (req/s)"
        for case in dict.fromkeys(s.case for s in summaries):
            for label in ("rr_simple", "kv_hf"):
                one, many = f"kvgate_{label}_p1", f"kvgate_{label}_p{processes}"
                if not missing(goal, f"{many} in {case}", (case, one), (case, many)):
                    a, b = at[case, one].requests_per_s, at[case, many].requests_per_s
                    verdicts.append(Verdict(goal, f"{many} in {case}", b >= a,
                                            f"{b:.0f} vs {a:.0f} req/s ({b / a:.2f}x)"))
    return verdicts

