"""What a scenario prints and writes: one table per workload, the targets, ``routers.json`` and
``routers.png`` (redrawn from the JSON alone by ``--replot``)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.bench.routers.contenders import Lineup
from gateway.bench.routers.driver import WorkloadOutcome
from gateway.bench.routers.targets import Verdict
from gateway.bench.routers.workers import Workers


@dataclass
class ScenarioResult:
    name: str
    workers: Workers
    lineup: Lineup
    outcomes: list[WorkloadOutcome]
    verdicts: list[tuple[str, Verdict]]
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


def format_table(rows: Mapping[str, Mapping[str, Any]], ceiling_rate: float | None,
                 group: str | None = None, cache_columns: bool = True) -> str:
    """One line per contender: TTFT, throughput, hit rate and share of the ceiling."""
    head = ["contender", "TTFT p50 ms", "TTFT p99 ms", "warm p99 ms", "req/s", "out tok/s",
            "hit rate", "of ceiling", "load max/mean", "errors"]
    cells = []
    for name, r in rows.items():
        g = r if group is None else r.get("groups", {}).get(group, {})
        cells.append([
            name, _f(g.get("ttft_p50_ms"), "{:.1f}"), _f(g.get("ttft_p99_ms"), "{:.1f}"),
            _f(g.get("warm_ttft_p99_ms"), "{:.1f}"), _f(g.get("requests_per_s"), "{:.2f}"),
            _f(g.get("output_tokens_per_s"), "{:.0f}"),
            _f(r.get("hit_rate") if cache_columns else None, "{:.1%}"),
            _f(r.get("of_ceiling") if cache_columns else None, "{:.1%}"),
            _f(r.get("load_spread"), "{:.2f}"), str(sum((g.get("errors") or {}).values())),
        ])
    if cache_columns:
        cells.append(["ceiling (one cache)", "", "", "", "", "", _f(ceiling_rate, "{:.1%}"),
                      "100%", "", ""])
    widths = [max(len(head[i]), *(len(c[i]) for c in cells)) + 2 for i in range(len(head))]
    lines = ["".join(h.ljust(w) if i == 0 else h.rjust(w)
                     for i, (h, w) in enumerate(zip(head, widths, strict=True)))]
    for c in cells:
        lines.append("".join(x.ljust(w) if i == 0 else x.rjust(w)
                             for i, (x, w) in enumerate(zip(c, widths, strict=True))))
    return "\n".join(lines)


def _f(x: Any, fmt: str) -> str:
    return "-" if x is None else fmt.format(x)


def write_results(result: ScenarioResult, out_dir: Path, command: str, elapsed_s: float) -> None:
    data = {
        "scenario": result.name,
        "command": command,
        "elapsed_s": elapsed_s,
        "workers": {"description": result.workers.description, "urls": result.workers.urls,
                    "block_size_tokens": result.workers.block_size_tokens,
                    "commands": result.workers.commands},
        "contenders": [dataclasses.asdict(c) for c in result.lineup.contenders],
        "skipped": result.lineup.skipped,
        "workloads": {
            o.plan.key: {
                "note": o.plan.note, "bench_command": o.bench_command,
                "cache_columns": o.plan.cache_columns,
                "tokens_per_word": o.tokens_per_word, "ceiling_hit_rate": o.ceiling_rate,
                "ceiling_per_run": o.ceilings, "sim_lag_warnings": o.lag_warnings,
                "contenders": o.rows,
            } for o in result.outcomes
        },
        "targets": [{"workload": w, **dataclasses.asdict(v)} for w, v in result.verdicts],
        "notes": result.notes,
        **({"isolation": result.extra} if result.extra else {}),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "routers.json").write_text(json.dumps(data, indent=1, default=str))
    plot(data, out_dir / "routers.png")


def plot(data: Mapping[str, Any], path: Path) -> None:
    """``routers.png`` from ``routers.json``'s data: per workload, hit rates against the ceiling
    (or, where every prompt is unique, the short chats' TTFT) and TTFT p50/p99 per contender."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = [(k, w) for k, w in data["workloads"].items() if w["contenders"]]
    if not workloads:
        return
    fig, axes = plt.subplots(len(workloads), 2, figsize=(12, 3.4 * len(workloads)),
                             squeeze=False)
    for (left, right), (key, w) in zip(axes, workloads, strict=True):
        rows: dict[str, dict[str, Any]] = w["contenders"]
        names = list(rows)
        xs = list(range(len(names)))
        if w.get("cache_columns", True):
            hits = [(rows[n].get("hit_rate") or 0.0) * 100 for n in names]
            left.bar(xs, hits, color=[f"C{i}" for i in xs])
            if w.get("ceiling_hit_rate") is not None:
                left.axhline(w["ceiling_hit_rate"] * 100, color="k", ls="--", lw=1,
                             label="ceiling")
                left.legend(fontsize=8, loc="lower right")
            left.set_ylabel("prefix-cache hit rate (%)")
            left.set_ylim(0, 100)
            left.set_title(f"{key}: hit rate", fontsize=9)
        else:
            short = [rows[n].get("groups", {}).get("short", {}) for n in names]
            _bars(left, xs, [g.get("ttft_p50_ms") for g in short],
                  [g.get("ttft_p99_ms") for g in short])
            left.set_ylabel("TTFT (ms, wall clock)")
            left.set_title(f"{key}: short chats' TTFT", fontsize=9)
        left.set_xticks(xs, names, rotation=20, fontsize=8)
        _bars(right, xs, [rows[n].get("ttft_p50_ms") for n in names],
              [rows[n].get("ttft_p99_ms") for n in names],
              [rows[n].get("warm_ttft_p99_ms") for n in names])
        right.set_xticks(xs, names, rotation=20, fontsize=8)
        right.set_ylabel("TTFT (ms, wall clock)")
        right.set_title(f"{key}: TTFT, all requests", fontsize=9)
    fig.suptitle(f"python -m gateway.bench.routers --scenario {data['scenario']}: "
                 f"{data['workers']['description']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _bars(ax: Any, xs: Sequence[int], *series: Sequence[float | None]) -> None:
    labels = ("p50", "p99", "warm p99")
    w = 0.8 / len(series)
    for k, ys in enumerate(series):
        if all(y is None for y in ys):
            continue
        ax.bar([x - 0.4 + w * (k + 0.5) for x in xs], [y or 0.0 for y in ys], w,
               label=labels[k])
    ax.legend(fontsize=8)


def print_summary(result: ScenarioResult) -> None:
    print(f"\n##### scenario {result.name}: {result.workers.description}")
    for note in result.notes:
        print(f"note: {note}")
    for o in result.outcomes:
        print(f"\n--- {o.plan.key}: {o.plan.note}")
        groups = ["short"] if result.name == "isolation" else []
        print(format_table(o.rows, o.ceiling_rate, cache_columns=o.plan.cache_columns))
        for g in groups:
            print(f"\n    group {g!r} only:")
            print(format_table(o.rows, None, group=g, cache_columns=False))
        if o.lag_warnings:
            print(f"WARNING: {o.lag_warnings} simulated engine(s) fell behind their model clock "
                  "during this workload: latencies are inflated; lower --rate or raise "
                  "--time-scale")
    if result.lineup.skipped:
        print("\nskipped contenders:")
        for name, why in result.lineup.skipped.items():
            print(f"  {name}: {why.splitlines()[0]}")
    print("\ntargets:")
    for workload, v in result.verdicts:
        print(f"  {workload:<14}" + v.line().lstrip())
