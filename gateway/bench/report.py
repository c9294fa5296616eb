"""What ``kvgate bench`` prints and writes: tables on stdout, JSON and PNG under ``--out``.

* per target, a table with one row per group (multiturn turns, mixed long/short, sweep lengths)
  and one for the whole run: TTFT and TPOT p50/p90/p99, e2e p50/p99, throughput;
* with several targets, a side-by-side table with each number's ratio to the first target;
* ``bench.json``: the configuration, every per-request record and every summary;
* ``latency_cdf.png``: CDFs of TTFT, TPOT and e2e, one line per target;
* ``sweep.png`` (``curves.png`` for other workloads with several groups): TTFT and TPOT p50/p90
  against the mean prompt length of each group, one line per target.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.bench.loadgen import TargetRun
from gateway.bench.stats import (
    CacheDelta,
    Distribution,
    Summary,
    cache_delta,
    summarize,
    summarize_groups,
)


@dataclass(frozen=True)
class TargetReport:
    run: TargetRun
    summary: Summary
    groups: dict[str, Summary]
    cache: CacheDelta | None


def build_report(run: TargetRun) -> TargetReport:
    return TargetReport(
        run=run,
        summary=summarize(run.records),
        groups=summarize_groups(run.records),
        cache=cache_delta(run.workers_before, run.workers_after),
    )


# -- tables ----------------------------------------------------------------------------------------


def _ms(d: Distribution | None, q: str) -> str:
    return "-" if d is None else f"{getattr(d, q) * 1000:.1f}"


def _s(d: Distribution | None, q: str) -> str:
    return "-" if d is None else f"{getattr(d, q):.2f}"


def group_table(report: TargetReport) -> str:
    head = (f"{'group':<14}{'n':>6}{'ok':>6}{'prompt':>8}"
            f"{'TTFT p50':>10}{'p90':>9}{'p99':>9}{'TPOT p50':>10}{'p90':>8}{'p99':>8}"
            f"{'e2e p50':>9}{'p99':>8}{'req/s':>8}{'out tok/s':>11}")
    units = (f"{'':<14}{'':>6}{'':>6}{'tokens':>8}{'ms':>10}{'ms':>9}{'ms':>9}"
             f"{'ms':>10}{'ms':>8}{'ms':>8}{'s':>9}{'s':>8}")
    rows = [head, units]
    items = list(report.groups.items()) if len(report.groups) > 1 else []
    items.append(("all", report.summary))
    for name, s in items:
        prompt = "-" if s.prompt_tokens_mean is None else f"{s.prompt_tokens_mean:.0f}"
        rows.append(
            f"{name:<14}{s.requests:>6}{s.ok:>6}{prompt:>8}"
            f"{_ms(s.ttft_s, 'p50'):>10}{_ms(s.ttft_s, 'p90'):>9}{_ms(s.ttft_s, 'p99'):>9}"
            f"{_ms(s.tpot_s, 'p50'):>10}{_ms(s.tpot_s, 'p90'):>8}{_ms(s.tpot_s, 'p99'):>8}"
            f"{_s(s.e2e_s, 'p50'):>9}{_s(s.e2e_s, 'p99'):>8}"
            f"{s.requests_per_s:>8.2f}{s.output_tokens_per_s:>11.1f}"
        )
    return "\n".join(rows)


def target_header(report: TargetReport) -> str:
    run, s = report.run, report.summary
    line = (f"== {run.target.name}  {run.target.url}  {s.requests} requests in "
            f"{run.duration_s:.1f} s, {s.ok} ok")
    if s.errors:
        line += "  errors: " + ", ".join(f"{k}={v}" for k, v in s.errors.items())
    return line


def target_footer(report: TargetReport) -> str:
    lines = []
    if report.cache is not None:
        rate = report.cache.hit_rate
        lines.append(
            "fleet prefix-cache hit rate: "
            + ("- (no queries)" if rate is None else f"{rate:.1%}")
            + f"  (hits {report.cache.hits_tokens:.0f} / queries"
              f" {report.cache.queries_tokens:.0f} tokens)"
        )
    s = report.summary
    if s.cached_tokens_ratio is not None:
        lines.append(f"cached prompt tokens reported by the server: {s.cached_tokens_ratio:.1%}")
    if s.send_lag_s is not None and s.send_lag_s.p99 > 0.05:
        lines.append(f"client send lag p50 {s.send_lag_s.p50:.2f} s, p99 {s.send_lag_s.p99:.2f} s"
                     " (requests sent late: session turns waiting, or max-inflight reached)")
    if report.run.reset_ok is False:
        lines.append("warning: a cache reset failed before this target; it may have started warm")
    return "\n".join(lines)


def target_block(report: TargetReport) -> str:
    """What is printed after each target's run: its header, its per-group table, the footer."""
    return "\n".join(part for part in (target_header(report), group_table(report),
                                        target_footer(report)) if part)


def _ratio(value: float | None, base: float | None) -> str:
    if value is None or base is None or base == 0 or math.isnan(value) or math.isnan(base):
        return ""
    return f" ({value / base:.2f}x)"


def compare_table(reports: Sequence[TargetReport]) -> str:
    """Side by side, each value with its ratio to the first target."""
    columns: list[tuple[str, Callable[[TargetReport], float | None], Callable[[float], str]]] = [
        ("TTFT p50 ms", lambda r: _q(r.summary.ttft_s, "p50", 1000), "{:.1f}".format),
        ("TTFT p99 ms", lambda r: _q(r.summary.ttft_s, "p99", 1000), "{:.1f}".format),
        ("TPOT p50 ms", lambda r: _q(r.summary.tpot_s, "p50", 1000), "{:.2f}".format),
        ("e2e p50 s", lambda r: _q(r.summary.e2e_s, "p50", 1), "{:.2f}".format),
        ("req/s", lambda r: r.summary.requests_per_s, "{:.2f}".format),
        ("out tok/s", lambda r: r.summary.output_tokens_per_s, "{:.0f}".format),
    ]
    if any(r.cache is not None for r in reports):
        columns.append(("hit rate", lambda r: r.cache.hit_rate if r.cache else None,
                        "{:.1%}".format))
    cells: list[list[str]] = []
    for r in reports:
        row = [r.run.target.name]
        for _, get, fmt in columns:
            v, base = get(r), get(reports[0])
            row.append("-" if v is None else fmt(v) + (_ratio(v, base) if r is not reports[0]
                                                       else ""))
        errors = sum(r.summary.errors.values())
        row.append(str(errors))
        cells.append(row)
    header = ["target", *(c[0] for c in columns), "errors"]
    widths = [max(len(header[i]), *(len(row[i]) for row in cells)) + 2
              for i in range(len(header))]
    lines = ["".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in
                     enumerate(zip(header, widths, strict=True)))]
    for row in cells:
        lines.append("".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in
                             enumerate(zip(row, widths, strict=True))))
    return "\n".join(lines)


def _q(d: Distribution | None, q: str, scale: float) -> float | None:
    return None if d is None else float(getattr(d, q)) * scale


# -- files -----------------------------------------------------------------------------------------


def to_json(reports: Sequence[TargetReport], config: dict[str, Any]) -> dict[str, Any]:
    targets = []
    for r in reports:
        workers = {
            url: {"before": _asdict(r.run.workers_before.get(url)),
                  "after": _asdict(r.run.workers_after.get(url))}
            for url in r.run.workers_before
        }
        targets.append({
            "name": r.run.target.name,
            "url": r.run.target.url,
            "duration_s": r.run.duration_s,
            "reset_ok": r.run.reset_ok,
            "salt": r.run.salt,
            "summary": dataclasses.asdict(r.summary),
            "groups": {g: dataclasses.asdict(s) for g, s in r.groups.items()},
            "prefix_cache": None if r.cache is None else {
                "queries_tokens": r.cache.queries_tokens,
                "hits_tokens": r.cache.hits_tokens,
                "hit_rate": r.cache.hit_rate,
                "workers": workers,
            },
            "records": [dataclasses.asdict(rec) for rec in r.run.records],
        })
    return {"config": config, "targets": targets}


def _asdict(x: Any) -> Any:
    return None if x is None else dataclasses.asdict(x)


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=1, allow_nan=False, default=str))


def plot_cdfs(reports: Sequence[TargetReport], path: Path, title: str) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    panels = [("TTFT (ms)", "ttft_s", 1000.0), ("TPOT (ms)", "tpot_s", 1000.0),
              ("end-to-end (s)", "e2e_s", 1.0)]
    for ax, (label, attr, scale) in zip(axes, panels, strict=True):
        for i, r in enumerate(reports):
            xs = sorted(getattr(rec, attr) * scale for rec in r.run.records
                        if rec.ok and getattr(rec, attr) is not None)
            if not xs:
                continue
            ys = [(k + 1) / len(xs) for k in range(len(xs))]
            ax.step(xs, ys, where="post", color=f"C{i}", label=r.run.target.name)
        lows = [min(x) for x in _nonempty(reports, attr, scale)]
        highs = [max(x) for x in _nonempty(reports, attr, scale)]
        if lows and min(lows) > 0 and max(highs) / min(lows) > 100:
            ax.set_xscale("log")  # e.g. mixed: 200- and 16K-token prompts on one axis
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.set_ylim(0, 1.02)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _nonempty(reports: Sequence[TargetReport], attr: str, scale: float) -> list[list[float]]:
    out = []
    for r in reports:
        xs = [getattr(rec, attr) * scale for rec in r.run.records
              if rec.ok and getattr(rec, attr) is not None]
        if xs:
            out.append(xs)
    return out


def plot_curves(reports: Sequence[TargetReport], path: Path, title: str,
                x_from_zero: bool = True) -> None:
    """TTFT and TPOT (p50 solid, p90 dashed) against each group's mean prompt tokens."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    panels = [("TTFT (ms)", "ttft_s"), ("TPOT (ms)", "tpot_s")]
    for ax, (label, attr) in zip(axes, panels, strict=True):
        for i, r in enumerate(reports):
            points = [(s.prompt_tokens_mean, getattr(s, attr)) for s in r.groups.values()
                      if s.prompt_tokens_mean is not None and getattr(s, attr) is not None]
            if not points:
                continue
            xs = [p[0] for p in points]
            ax.plot(xs, [p[1].p50 * 1000 for p in points], "o-", color=f"C{i}",
                    label=f"{r.run.target.name} p50")
            ax.plot(xs, [p[1].p90 * 1000 for p in points], "x--", color=f"C{i}", alpha=0.6,
                    label=f"{r.run.target.name} p90")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
        if x_from_zero:
            ax.set_xlim(left=0)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
