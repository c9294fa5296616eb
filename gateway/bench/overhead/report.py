"""The overhead benchmark's output: one table per case, the streaming client's check, the
prediction for a bigger node, the PNG, and the JSON made standard (NaN as null)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gateway.bench.overhead.model import BARE, LAYERS, Case, Summary

CLIENT_BUSY_CORES = 0.8
"""Above this the streaming client (one Python thread) may be what limits the streams."""


def _f(value: float | None, fmt: str, width: int) -> str:
    """``value`` right-aligned in ``width`` with ``fmt`` (``.1f``, ``+.1f`` ...); ``-`` for None."""
    if value is None:
        return f"{'-':>{width}}"
    sign, fmt = ("+", fmt[1:]) if fmt.startswith("+") else ("", fmt)
    return f"{value:>{sign}{width}{fmt}}"


def table(case: Case, summaries: Sequence[Summary]) -> str:
    head = (f"{'target':<22}{'req/s':>9}{'ratio':>7}{'p50 ms':>8}{'p99 ms':>8}{'+p50':>8}"
            f"{'+p99':>8}")
    if case.streaming:
        head += f"{'TTFT50':>8}{'TTFT99':>8}{'TPOT50':>8}"
    head += (f"{'router':>8}{'backend':>9}{'loadgen':>9}  {'cores r/b/l/o':<20}"
             f"{'req/s/core':>11}{'errors':>7}")
    pad = 70 + (24 if case.streaming else 0)
    lines = [f"case {case.name}: {case.description}", f"{'':<{pad}}{'CPU us/request':^26}", head]
    for s in summaries:
        row = (f"{s.target:<22}{s.requests_per_s:>9.0f}{_f(s.ratio, '.2f', 7)}"
               f"{s.p50_ms:>8.1f}{s.p99_ms:>8.1f}{_f(s.added_p50_ms, '+.1f', 8)}"
               f"{_f(s.added_p99_ms, '+.1f', 8)}")
        if case.streaming:
            row += (f"{_f(s.ttft_p50_ms, '.1f', 8)}{_f(s.ttft_p99_ms, '.1f', 8)}"
                    f"{_f(s.tpot_p50_ms, '.1f', 8)}")
        cores = (f"{'-' if s.router_cores is None else f'{s.router_cores:.2f}'}/"
                 f"{s.backend_cores:.2f}/{s.loadgen_cores:.2f}/{s.other_cores:.2f}")
        row += (f"{_f(s.router_cpu_us_per_request, '.0f', 8)}"
                f"{s.backend_cpu_us_per_request:>9.0f}{s.loadgen_cpu_us_per_request:>9.0f}  "
                f"{cores:<20}{_f(s.requests_per_s_per_core, '.0f', 11)}{s.errors:>7}")
        lines.append(row)
    return "\n".join(lines)


def client_check(case: Case, summaries: Sequence[Summary]) -> str | None:
    """For streams: whether the client could have been the bottleneck."""
    if not case.streaming or not summaries:
        return None
    busiest = max(summaries, key=lambda s: s.loadgen_cores)
    direct = next((s for s in summaries if s.target == "direct"), None)
    verdict = ("may be the bottleneck" if busiest.loadgen_cores > CLIENT_BUSY_CORES
               else "not the bottleneck")
    tpot = ("" if direct is None or direct.tpot_p50_ms is None
            else f"; direct TPOT p50 {direct.tpot_p50_ms:.1f} ms vs {case.chunk_interval_ms:g} ms "
                 "backend interval")
    return (f"streaming client: at most {busiest.loadgen_cores:.2f} cores "
            f"({busiest.target}){tpot}: {verdict}")


def prediction(summaries: Sequence[Summary], cores: int = 16) -> list[str]:
    """Per router, from the ``short`` and ``fresh`` cases: ``cores`` over its CPU per request,
    and for a router of several processes the lower bound its supervisor sets (one process
    however many children: ``1e6 / its CPU per request``) where that binds first."""
    lines = []
    for s in summaries:
        cpu = s.router_cpu_us_per_request
        if s.case not in ("short", "fresh") or not cpu:
            continue
        line = (f"  {s.case:<6} {s.target:<22} {cpu:6.0f} us/req -> {1e6 / cpu:8.0f} req/s per core, "
                f"~{cores * 1e6 / cpu:9.0f} req/s on {cores} cores")
        sup = s.supervisor_cpu_us_per_request
        if sup:
            cap = 1e6 / sup
            line += (f"; its supervisor {sup:.1f} us/req (one process): at most ~{cap:.0f} "
                     f"req/s{', which binds first' if cap < cores * 1e6 / cpu else ''}")
        lines.append(line)
    return lines


def kernel_split(summaries: Sequence[Summary]) -> list[str]:
    """Per router, from the ``short`` and ``fresh`` cases: its CPU per request as user space (its
    own code) plus kernel (system calls; on loopback the receiver's TCP path and wake-up too,
    which a VM's cross-core interrupts make dear and a slower router pays more of, its
    receivers idling between its writes)."""
    lines = []
    for s in summaries:
        cpu, kernel = s.router_cpu_us_per_request, s.router_kernel_cpu_us_per_request
        if s.case in ("short", "fresh") and cpu and kernel is not None:
            lines.append(f"  {s.case:<6} {s.target:<22} {cpu:6.0f} us/req = {cpu - kernel:4.0f} "
                         f"user + {kernel:3.0f} kernel")
    return lines


def process_shares(summaries: Sequence[Summary]) -> list[str]:
    """Per router of several processes and case: how evenly its processes shared the CPU (the
    kernel spreads connections over their sockets; a process that took most of them shows here)."""
    return [f"  {s.case:<8} {s.target:<22} busiest of {s.processes} processes: "
            f"{s.busiest_process_share:.0%} of their CPU (even: {1 / s.processes:.0%})"
            for s in summaries if s.busiest_process_share is not None]


def split_cpu(summaries: Sequence[Summary]) -> list[str]:
    """Per kvgate target, in each case where ``kvgate_plumbing`` ran: its CPU per request as
    kvgate's layers plus its features (what is left), against a bare Python proxy's."""
    lines = []
    for case in dict.fromkeys(s.case for s in summaries):
        at = {s.target: s.router_cpu_us_per_request for s in summaries if s.case == case}
        layers, bare = at.get(LAYERS), at.get(BARE)
        if not layers:
            continue
        for target, cpu in at.items():
            if target.startswith("kvgate_") and target != LAYERS and cpu:
                floor = "" if not bare else f" (a bare Python proxy: {bare:.0f})"
                lines.append(f"  {case:<8} {target:<22} {cpu:6.0f} us/req = {layers:.0f} "
                             f"layers + {cpu - layers:.0f} features{floor}")
    return lines


def plot(runs: Sequence[tuple[Case, list[Summary]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(runs), figsize=(5.5 * len(runs), 7), squeeze=False)
    for col, (case, sums) in enumerate(runs):
        names = [s.target for s in sums]
        y = list(range(len(sums)))
        top, bottom = axes[0][col], axes[1][col]
        top.barh(y, [s.ratio or 0.0 for s in sums], color="C0")
        for i, s in enumerate(sums):
            extra = (f"TTFT p99 {s.ttft_p99_ms:.0f} ms" if case.streaming and s.ttft_p99_ms
                     else f"+p99 {s.added_p99_ms or 0.0:.1f} ms")
            top.text(0.02, i, extra, va="center", fontsize=7, color="white")
        top.axvline(1.0, color="grey", lw=0.8)
        top.set_yticks(y, names, fontsize=7)
        top.invert_yaxis()
        top.set_xlabel("req/s ratio to direct")
        top.set_title(f"{case.name}: {case.description}", fontsize=8)
        left = [0.0] * len(sums)
        for label, values, color in (
                ("router", [s.router_cpu_us_per_request or 0.0 for s in sums], "C3"),
                ("backend", [s.backend_cpu_us_per_request for s in sums], "grey"),
                ("load generator", [s.loadgen_cpu_us_per_request for s in sums], "C2")):
            bottom.barh(y, values, left=left, color=color, label=label)
            left = [a + b for a, b in zip(left, values, strict=True)]
        bottom.set_yticks(y, names, fontsize=7)
        bottom.invert_yaxis()
        bottom.set_xlabel("CPU us per request")
        bottom.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)



def finite(value: Any) -> Any:
    """``value`` with NaN (a percentile of nothing) as None, so the JSON is standard."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value
