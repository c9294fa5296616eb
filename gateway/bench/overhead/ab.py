"""Paired A/B of two checkouts of kvgate: CPU per request of the same target, both up at once.

Why paired. On a shared 2-core machine a router's CPU per request moves between runs an hour
apart by more than most changes of the request path (README, "The gateway's own overhead"), so
two sequential runs of the overhead benchmark cannot tell a 20 µs change from drift. Here both
gateways run side by side in front of one no-op backend and take the same load in alternating
rounds (A then B, then B then A, ...): drift of the machine hits both sides of a pair alike, and
the per-pair difference is what is read.

Steps: start the no-op backend of the case (``gateway.bench.noop``); start kvgate from ``--base``
(``python -m gateway.cli serve`` run in that directory with it first on ``PYTHONPATH``, so its
own code is imported) and from this checkout, each with the overhead benchmark's config of the
target (``kv_aware`` + the tiny model's HF tokenizer, or ``round_robin`` + ``simple``; one
process); warm both up; then ``--pairs`` pairs of ``--duration-s`` rounds, the order alternated.
Each round's CPU is the gateway's process tree from ``/proc`` (``gateway.bench.overhead.cpu``),
divided by the requests (streams) it served.

Output: a table per pair (µs per request of base and this checkout, the difference, req/s; for
streams TTFT p50 and p99 of each side), the medians, the median paired difference and how many
pairs were lower (of the CPU, and for streams of TTFT p50 and p99: a stream wave's length shows
in the TTFT, not in the CPU); and ``ab.json`` + ``ab.png`` under ``--out`` (for streams a second
panel with each pair's TTFT p99). With ``--gc`` both gateways run with
``gateway.bench.overhead.gcprobe`` installed, and a second table gives each side's garbage
collector per pair: µs of collections per request, collections per 10,000 requests and ms per
collection by generation, the longest; with the medians and the median paired difference.

Run: ``python -m gateway.bench.overhead.ab --base DIR [--case short|stream] [--pairs 5]
[--duration-s 8] [--target kvgate_kv_hf_p1|kvgate_rr_simple_p1] [--gc] [--out results/overhead_ab]``.
Make ``DIR`` with e.g. ``git archive HEAD | tar -x -C DIR`` before changing the code.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gateway.bench.overhead import gcprobe
from gateway.bench.overhead.gcprobe import GcStats
from gateway.bench.overhead.model import (
    CASES,
    START_TIMEOUT_S,
    WARMUP_S,
    Round,
    Target,
    targets,
)
from gateway.bench.overhead.run import Running, kvgate_config, measure, offer_load
from gateway.procs.kvgate import GatewayProcess, noop_backend
from gateway.procs.process import ProcessSet
from gateway.procs.vllm import tiny_model_path

SIDES = ("base", "this")


@dataclass(frozen=True)
class Pair:
    index: int
    first: str
    """The side that ran first in this pair."""
    base: Round
    this: Round
    base_gc: GcStats | None = None
    """With ``--gc``: the base gateway's collections during its round."""
    this_gc: GcStats | None = None

    def us_per_request(self, side: str) -> float:
        r = self.base if side == "base" else self.this
        assert r.router_cpu_s is not None
        return r.router_cpu_s / max(r.load.requests, 1) * 1e6

    def gc_us_per_request(self, side: str) -> float:
        r, stats = (self.base, self.base_gc) if side == "base" else (self.this, self.this_gc)
        assert stats is not None
        return stats.total_s / max(r.load.requests, 1) * 1e6


class ProbedGateway(GatewayProcess):
    """A gateway started with the GC probe installed (``gcprobe.boot_argv``), writing its
    snapshots to ``gc_path``."""

    def __init__(self, gc_path: Path, *args: Any, **kwargs: Any) -> None:
        self.gc_path = gc_path
        super().__init__(*args, **kwargs)

    def _argv(self, port: int) -> list[str]:
        argv = super()._argv(port)
        serve = argv.index("serve")  # ``python -m gateway.cli serve ...``
        return gcprobe.boot_argv(self.gc_path, *argv[serve:])


def _gateway(procs: ProcessSet, name: str, target: Target, backend_url: str,
             hf_tokenizer: Path, root: Path | None, probe_gc: bool = False) -> Running:
    config = kvgate_config(target, backend_url, None, hf_tokenizer)
    config_path = procs.log_dir / f"{name}.yaml"
    env = None if root is None else {"PYTHONPATH": str(root)}
    gw = (ProbedGateway(procs.log_dir / f"{name}.gc.json", config, config_path,
                        processes=target.processes, env=env) if probe_gc else
          GatewayProcess(config, config_path, processes=target.processes, env=env))
    if root is not None:
        # ``python -m`` puts the working directory first on the path: the other checkout's
        # package is the one imported
        gw.cwd = root
    procs.start(name, gw, timeout_s=START_TIMEOUT_S)
    return Running(target, gw.url, gw)


def run_pairs(args: argparse.Namespace) -> list[Pair]:
    case = next(c for c in CASES if c.name == args.case)
    target = next(t for t in targets(2) if t.name == args.target)
    log_dir: Path = args.out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    pairs: list[Pair] = []
    with ProcessSet(log_dir) as procs:
        script = log_dir / "post.lua"
        script.write_text(case.lua)
        noop, backend_url = noop_backend(
            None, case.backend_delay_ms, stream_chunks=max(case.stream_chunks, 1),
            chunk_interval_ms=case.chunk_interval_ms)
        procs.start("noop", noop, timeout_s=START_TIMEOUT_S)
        hf = args.hf_tokenizer.resolve()
        sides = {"base": _gateway(procs, "base", target, backend_url, hf,
                                  args.base.resolve(), args.gc),
                 "this": _gateway(procs, "this", target, backend_url, hf, None,
                                  args.gc)}
        for running in sides.values():
            offer_load(case, running.url, WARMUP_S, script)
        for i in range(args.pairs):
            order = SIDES if i % 2 == 0 else SIDES[::-1]
            rounds: dict[str, Round] = {}
            collections: dict[str, GcStats | None] = {"base": None, "this": None}
            for side in order:
                proc = sides[side].proc
                # the snapshots bracket the round, outside the CPU it measures
                before = _gc_snapshot(proc) if args.gc else None
                rounds[side] = measure(case, sides[side], noop, i, args.duration_s, script)
                if before is not None:
                    after = _gc_snapshot(proc)
                    assert after is not None
                    collections[side] = after.since(before)
            pair = Pair(i, order[0], rounds["base"], rounds["this"],
                        collections["base"], collections["this"])
            pairs.append(pair)
            gc_note = (f" (GC {pair.gc_us_per_request('base'):.1f} / "
                       f"{pair.gc_us_per_request('this'):.1f} us)" if args.gc else "")
            print(f"ab: pair {i + 1}/{args.pairs}: base {pair.us_per_request('base'):7.0f} us, "
                  f"this {pair.us_per_request('this'):7.0f} us per "
                  f"{'stream' if case.streaming else 'request'}{gc_note}", flush=True)
    return pairs


def _gc_snapshot(proc: object) -> GcStats | None:
    if not isinstance(proc, ProbedGateway):
        return None
    return gcprobe.snapshot(proc.pid, proc.gc_path)


def table(pairs: list[Pair], streaming: bool) -> list[str]:
    unit = "stream" if streaming else "request"
    head = f"{'pair':>4} {'first':>5} {'base us':>9} {'this us':>9} {'diff':>8} " \
           f"{'base req/s':>10} {'this req/s':>10}"
    if streaming:
        head += " TTFT p50 base/this ms  TTFT p99 base/this ms"
    lines = [f"CPU per {unit} (gateway process tree), base checkout vs this one", head]
    for p in pairs:
        b, t = p.us_per_request("base"), p.us_per_request("this")
        line = (f"{p.index + 1:>4} {p.first:>5} {b:9.0f} {t:9.0f} {t - b:+8.0f} "
                f"{p.base.load.requests_per_s:10.0f} {p.this.load.requests_per_s:10.0f}")
        if streaming:
            line += (f" {_ms(p.base.load.ttft_p50_ms):>9} / {_ms(p.this.load.ttft_p50_ms):<9}"
                     f" {_ms(p.base.load.ttft_p99_ms):>9} / {_ms(p.this.load.ttft_p99_ms):<9}")
        lines.append(line)
    diffs = [p.us_per_request("this") - p.us_per_request("base") for p in pairs]
    base_med = statistics.median(p.us_per_request("base") for p in pairs)
    this_med = statistics.median(p.us_per_request("this") for p in pairs)
    lower = sum(1 for d in diffs if d < 0)
    lines.append(f"median: base {base_med:.0f} us, this {this_med:.0f} us per {unit}; median "
                 f"paired difference {statistics.median(diffs):+.0f} us "
                 f"({statistics.median(diffs) / base_med:+.1%}); this lower in {lower} of "
                 f"{len(pairs)} pairs")
    if streaming:
        lines.extend(ttft_lines(pairs))
    if all(p.base_gc is not None and p.this_gc is not None for p in pairs):
        lines.extend(gc_lines(pairs, unit))
    return lines


def gc_lines(pairs: list[Pair], unit: str) -> list[str]:
    """The garbage collector's share per side and pair (``--gc``): µs of collections per
    request, and per generation the collections per 10,000 requests and ms per collection."""
    lines = ["", f"garbage collection per {unit} (gcprobe in each gateway; gen: collections "
                 f"per 10K {unit}s x ms each)",
             f"{'pair':>4} {'side':>5} {'GC us':>7}  {'gen0':>14}  {'gen1':>14}  {'gen2':>14}"
             f"  {'longest ms':>10}"]
    for p in pairs:
        for side in SIDES:
            r, stats = (p.base, p.base_gc) if side == "base" else (p.this, p.this_gc)
            assert stats is not None
            n = max(r.load.requests, 1)
            gens = "  ".join(
                f"{c * 1e4 / n:6.1f} x {s / c * 1e3 if c else 0:5.1f}"
                for c, s in zip(stats.collections, stats.seconds, strict=True))
            lines.append(f"{p.index + 1:>4} {side:>5} {p.gc_us_per_request(side):7.1f}  {gens}"
                         f"  {max(stats.max_s) * 1e3:10.1f}")
    diffs = [p.gc_us_per_request("this") - p.gc_us_per_request("base") for p in pairs]
    lines.append(
        f"median GC: base {statistics.median(p.gc_us_per_request('base') for p in pairs):.1f} "
        f"us, this {statistics.median(p.gc_us_per_request('this') for p in pairs):.1f} us per "
        f"{unit}; median paired difference {statistics.median(diffs):+.1f} us; this lower in "
        f"{sum(1 for d in diffs if d < 0)} of {len(pairs)} pairs")
    return lines


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def ttft_lines(pairs: list[Pair]) -> list[str]:
    """TTFT p50 and p99 of the streams (what a stream wave's length shows up in): each side's
    median over the pairs, the median paired difference and how many pairs were lower."""
    lines = []
    for name in ("ttft_p50_ms", "ttft_p99_ms"):
        both = [(getattr(p.base.load, name), getattr(p.this.load, name)) for p in pairs]
        known = [(b, t) for b, t in both if b is not None and t is not None]
        if not known:
            continue
        diffs = [t - b for b, t in known]
        lines.append(
            f"TTFT {name[5:8]}: base {statistics.median(b for b, _ in known):.1f} ms, this "
            f"{statistics.median(t for _, t in known):.1f} ms (medians); median paired "
            f"difference {statistics.median(diffs):+.1f} ms; this lower in "
            f"{sum(1 for d in diffs if d < 0)} of {len(known)} pairs")
    return lines


def plot(pairs: list[Pair], path: Path, streaming: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 if streaming else 1, figsize=(12 if streaming else 7, 4),
                             squeeze=False)
    ax = axes[0][0]
    xs = [p.index + 1 for p in pairs]
    for side in SIDES:
        ax.plot(xs, [p.us_per_request(side) for p in pairs], marker="o", label=side)
    ax.set_xlabel("pair")
    ax.set_ylabel(f"gateway CPU us per {'stream' if streaming else 'request'}")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.set_title("paired A/B: base checkout vs this one")
    if streaming:
        ax = axes[0][1]
        for side in SIDES:
            loads = [(p.base if side == "base" else p.this).load for p in pairs]
            ax.plot(xs, [ld.ttft_p99_ms or 0 for ld in loads], marker="o", label=f"{side} p99")
            ax.plot(xs, [ld.ttft_p50_ms or 0 for ld in loads], marker="x", linestyle=":",
                    label=f"{side} p50")
        ax.set_xlabel("pair")
        ax.set_ylabel("TTFT ms (client side)")
        ax.set_ylim(bottom=0)
        ax.legend()
        ax.set_title("stream TTFT per pair")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway.bench.overhead.ab",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, required=True,
                        help="the other checkout's root (the one with gateway/ in it)")
    parser.add_argument("--case", choices=[c.name for c in CASES], default="short")
    parser.add_argument("--target", default="kvgate_kv_hf_p1",
                        choices=[t.name for t in targets(2) if t.kind == "kvgate"])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--duration-s", type=float, default=8.0)
    parser.add_argument("--gc", action="store_true",
                        help="run both gateways with the GC probe and report the collector's "
                             "share per request (gateway.bench.overhead.gcprobe)")
    parser.add_argument("--hf-tokenizer", type=Path, default=tiny_model_path())
    parser.add_argument("--out", type=Path, default=Path("results/overhead_ab"))
    args = parser.parse_args(argv)
    if not (args.base / "gateway" / "cli.py").exists():
        parser.error(f"--base {args.base}: no gateway/cli.py there")
    pairs = run_pairs(args)
    streaming = next(c for c in CASES if c.name == args.case).streaming
    print()
    for line in table(pairs, streaming):
        print(line)
    record: dict[str, Any] = {
        "config": {"base": str(args.base.resolve()), "case": args.case, "target": args.target,
                   "pairs": args.pairs, "duration_s": args.duration_s, "gc": args.gc,
                   "cores": len(os.sched_getaffinity(0))},
        "pairs": [{**asdict(p), "base_us": p.us_per_request("base"),
                   "this_us": p.us_per_request("this"),
                   **({"base_gc_us": p.gc_us_per_request("base"),
                       "this_gc_us": p.gc_us_per_request("this")} if args.gc else {})}
                  for p in pairs]}
    (args.out / "ab.json").write_text(json.dumps(record, indent=2))
    plot(pairs, args.out / "ab.png", streaming)
    print(f"wrote {args.out / 'ab.json'}, {args.out / 'ab.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
