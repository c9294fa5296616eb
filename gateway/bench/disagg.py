"""Prefill/decode disaggregation against colocated serving on the same 16 simulated GPUs
(issue 14): TTFT and TPOT per request class, where each layout wins, and the planner's
prediction beside the measurement.

Setup: simulated llama-3-8b@h100 workers (``kvgate sim``, the planner's cost model: prefill
compute-bound at half the peak FLOP/s, decode memory-bound, chunked prefill of 8192 tokens per
step) and one kvgate gateway process in front, one layout after the other, each on fresh
processes (no cache or queue carries over):

- ``mixed``: 16 workers in one ``kv_aware`` pool; every worker prefills and decodes, so a decode
  step that shares the engine with a chunk of a long prompt waits for it;
- ``pd``: 4 prefill workers (``--kv-role kv_producer``) + 12 decode workers (``kv_consumer``) in
  one disaggregated pool (``prefill_workers``): the gateway runs vLLM's two steps, the decode
  worker pulls the prompt's KV (priced at ``kv_transfer_bytes_per_s``, 200 Gb/s) instead of
  computing it;
- ``pd-selective``: the same split with ``remote_prefill_min_tokens`` ``SELECTIVE_MIN_TOKENS``:
  a prompt with fewer tokens uncached on the chosen decode worker (every chat) is computed there
  in one step; only long prompts go through the prefill workers.

Workload (``PdMix``, fixed seed, the same requests and Poisson arrival times for both layouts,
open loop): short chats (~``CHAT_TOKENS`` prompt tokens, ``CHAT_OUTPUT`` output tokens drawn
uniformly) with long prompts mixed in (``LONG_TOKENS`` drawn uniformly, ``LONG_OUTPUT`` out) at
``--long-fraction``; every prompt unique, ``ignore_eos`` so outputs are exactly as drawn. The
requests sent in the first ``WARMUP_SHARE`` of the run are left out of the numbers.

Time: the fleet runs at ``--time-scale`` wall seconds per modelled second (2 by default, so two
cores keep up with the streamed tokens) and the arrival rate is divided by it; every latency is
reported in modelled seconds (wall / time scale), the unit of the planner, whose prediction
(``gateway.planner.estimate_pd`` for the P/D split, and its colocated TPOT for the same GPUs)
is printed next to the measured means. Client and gateway overheads shrink by the same factor.

Output: per layout the per-class table of ``kvgate bench``, a comparison of the two, a
per-class table of TTFT/TPOT p50/p99 with the layout that wins each, the prediction table;
``disagg.json`` (summaries, prediction, config; ``--records`` adds every request),
``disagg.png`` (per-class bars) and ``disagg_cdf.png`` (``kvgate bench``'s CDFs) in ``--out``
(default ``docs/results``).
Run: ``python -m gateway.bench.disagg`` (3 x 150 s of load plus start-up and drain: about 12
minutes); ``--quick`` (3 x 20 s) for a smoke run.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from gateway.bench.loadgen import LoadSpec, Target, calibrate_tokens_per_word, run_target
from gateway.bench.report import (
    TargetReport,
    build_report,
    compare_table,
    plot_cdfs,
    target_block,
    to_json,
    write_json,
)
from gateway.bench.stats import RequestRecord, Summary
from gateway.bench.workloads import BenchRequest, Message, Workload, WorkloadSpec, words
from gateway.planner import (
    PdEstimate,
    PdWorkload,
    RequestClass,
    estimate_pd,
    parse_profile,
    pd_estimate_to_json,
)
from gateway.procs.kvgate import SIM_MODEL, GatewayProcess, SimProcess
from gateway.procs.process import ProcessSet

ARCHITECTURE = "llama-3-8b"
PROFILE = f"{ARCHITECTURE}@h100"
"""The simulator's default cost model, and the planner's model and GPU."""
WORKERS = 16
PREFILL_WORKERS = 4
CHAT_TOKENS = 200
CHAT_OUTPUT = (100, 300)
LONG_TOKENS = (8 * 1024, 32 * 1024)
LONG_OUTPUT = (16, 32)
POOL_CONTEXT_TOKENS = 40 * 1024
WARMUP_SHARE = 0.1
SELECTIVE_MIN_TOKENS = 1024
LAYOUTS = ("mixed", "pd", "pd-selective")
CLASSES = ("chat", "long")
DEFAULT_OUT = Path("docs/results")


# -- the workload ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class MixSpec:
    """Short chats with long prompts among them; sizes in tokens, ranges drawn uniformly."""

    requests: int
    long_fraction: float = 0.15
    chat_tokens: int = CHAT_TOKENS
    chat_output: tuple[int, int] = CHAT_OUTPUT
    long_tokens: tuple[int, int] = LONG_TOKENS
    long_output: tuple[int, int] = LONG_OUTPUT
    seed: int = 0
    tokens_per_word: float = 1.0

    def __post_init__(self) -> None:
        if self.requests < 1:
            raise ValueError("requests must be >= 1")
        if not 0.0 <= self.long_fraction <= 1.0:
            raise ValueError("long_fraction must be in [0, 1]")
        for lo, hi in (self.chat_output, self.long_tokens, self.long_output):
            if not 1 <= lo <= hi:
                raise ValueError("ranges must be 1 <= low <= high")

    def classes(self) -> tuple[RequestClass, ...]:
        """The mix as the planner reads it: each class at its mean sizes."""
        sizes = (("chat", 1.0 - self.long_fraction, self.chat_tokens,
                  round(sum(self.chat_output) / 2)),
                 ("long", self.long_fraction, round(sum(self.long_tokens) / 2),
                  round(sum(self.long_output) / 2)))
        return tuple(RequestClass(*c) for c in sizes if c[1] > 0)


@dataclass(frozen=True)
class PdMix(Workload):
    """``kvgate bench``'s ``Workload`` whose requests come from a ``MixSpec``."""

    mix: MixSpec = MixSpec(1)

    def requests(self, phase: int = 0) -> Iterator[BenchRequest]:
        return mix_requests(self.mix)


def build_mix(mix: MixSpec) -> PdMix:
    spec = WorkloadSpec("mixed", seed=mix.seed, requests=mix.requests,
                        tokens_per_word=mix.tokens_per_word, long_fraction=mix.long_fraction)
    return PdMix(spec, (("pd-mix", mix.requests),), mix)


def mix_requests(mix: MixSpec) -> Iterator[BenchRequest]:
    """The same requests on every call: each from its own ``Random`` (seed, index)."""
    tpw = mix.tokens_per_word
    for i in range(mix.requests):
        rng = random.Random(f"{mix.seed}:pd-mix:{i}")
        long = rng.random() < mix.long_fraction
        size = rng.randint(*mix.long_tokens) if long else mix.chat_tokens
        out = rng.randint(*(mix.long_output if long else mix.chat_output))
        messages = (Message("user", f"Request {i}. " + words(rng, size, tpw)),)
        yield BenchRequest(i, "long" if long else "chat", messages,
                           round(len(messages[0].content.split()) * tpw), out)


# -- the layouts ----------------------------------------------------------------------------------


def gateway_config(decode: Sequence[str], prefill: Sequence[str] = (),
                   remote_prefill_min_tokens: int = 0) -> dict[str, Any]:
    """One kv_aware pool; with ``prefill`` workers it is disaggregated."""
    pool: dict[str, Any] = {"name": "fleet", "max_context_tokens": POOL_CONTEXT_TOKENS,
                            "policy": "kv_aware", "workers": list(decode)}
    if prefill:
        pool["prefill_workers"] = list(prefill)
        pool["remote_prefill_min_tokens"] = remote_prefill_min_tokens
    return {
        "listen": {"processes": 1},
        "models": [{"name": SIM_MODEL, "tokenizer": "simple", "architecture": ARCHITECTURE}],
        "pools": [pool],
        "health": {"interval_s": 0.5},
    }


@dataclass(frozen=True)
class LayoutRun:
    layout: str
    report: TargetReport
    """Over the measured window (the warm-up's requests left out)."""
    classes: dict[str, Summary]
    sim_lag_warnings: int = 0
    """Times a simulated engine logged that it fell behind its model clock (the host did not
    keep up with the time scale): latencies after one are inflated."""


def measured(records: Sequence[RequestRecord], duration_s: float) -> tuple[RequestRecord, ...]:
    """The requests scheduled after the warm-up share of the run."""
    return tuple(r for r in records if r.scheduled_s >= WARMUP_SHARE * duration_s)


def in_model_time(record: RequestRecord, time_scale: float) -> RequestRecord:
    """A record with its times in modelled seconds (wall / ``time_scale``)."""
    def scale(x: float | None) -> float | None:
        return None if x is None else x / time_scale

    return replace(record, scheduled_s=record.scheduled_s / time_scale,
                   sent_s=record.sent_s / time_scale, ttft_s=scale(record.ttft_s),
                   tpot_s=scale(record.tpot_s), e2e_s=scale(record.e2e_s))


def run_layout(layout: str, args: argparse.Namespace, mix: MixSpec, procs: ProcessSet,
               log_dir: Path) -> LayoutRun:
    """Start the layout's sims and gateway, offer the load, stop them."""
    names: list[str] = []
    scale = args.time_scale

    def sim(name: str, workers: int, *extra: str) -> list[str]:
        names.append(name)
        return procs.start(name, SimProcess(workers=workers, time_scale=scale,
                                            extra_args=extra, log_path=log_dir / f"{name}.log"),
                           timeout_s=120).urls

    if layout == "mixed":
        config = gateway_config(sim("sim-mixed", WORKERS))
    else:
        prefill = sim("sim-prefill", PREFILL_WORKERS, "--kv-role", "kv_producer")
        decode = sim("sim-decode", WORKERS - PREFILL_WORKERS, "--kv-role", "kv_consumer")
        config = gateway_config(decode, prefill, SELECTIVE_MIN_TOKENS
                                if layout == "pd-selective" else 0)
    names.append(f"gateway-{layout}")
    gateway = procs.start(names[-1], GatewayProcess(
        config, log_dir / f"{layout}.yaml", log_path=log_dir / f"gateway-{layout}.log"),
        timeout_s=120)
    try:
        load = LoadSpec(model=SIM_MODEL, rate=args.rate / scale, duration_s=args.duration_s,
                        drain_s=args.drain_s, timeout_s=600.0, max_inflight=4096,
                        ignore_eos=True, seed=args.seed, salt=None)
        run = asyncio.run(run_target(Target(layout, gateway.url), build_mix(mix), load))
    finally:
        for name in reversed(names):
            procs.stop(name)
    window = tuple(in_model_time(r, scale) for r in measured(run.records, args.duration_s))
    report = build_report(replace(run, records=window))
    lag = sum(lag_warnings(log_dir / f"{name}.log") for name in names if name.startswith("sim"))
    return LayoutRun(layout, report, {c: report.groups[c] for c in CLASSES
                                      if c in report.groups}, lag)


def lag_warnings(log: Path) -> int:
    """Lines where a simulated engine says it fell behind its model clock."""
    if not log.exists():
        return 0
    with log.open(errors="replace") as f:
        return sum("behind its model clock" in line for line in f)


# -- the comparison -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cell:
    """One class and statistic, every layout run, modelled milliseconds."""

    request_class: str
    stat: str
    """``ttft_p50``, ``ttft_p99``, ``tpot_p50``, ``tpot_p99``."""
    ms: dict[str, float | None]
    """By layout."""

    @property
    def winner(self) -> str | None:
        """The layout with the lowest value, when every layout has one."""
        if not self.ms or any(v is None for v in self.ms.values()):
            return None
        return min(self.ms, key=lambda x: self.ms[x] or 0.0)

    def ratio(self, layout: str) -> float | None:
        """``layout`` / mixed: below 1, ``layout`` is faster than colocated serving."""
        mine, mixed = self.ms.get(layout), self.ms.get("mixed")
        if mine is None or mixed is None or mixed == 0:
            return None
        return mine / mixed


STATS = (("ttft_p50", "ttft_s", "p50"), ("ttft_p99", "ttft_s", "p99"),
         ("tpot_p50", "tpot_s", "p50"), ("tpot_p99", "tpot_s", "p99"))


def cells(runs: dict[str, LayoutRun]) -> list[Cell]:
    def get(layout: str, cls: str, attr: str, q: str) -> float | None:
        run = runs.get(layout)
        summary = run.classes.get(cls) if run is not None else None
        d = getattr(summary, attr) if summary is not None else None
        return None if d is None else float(getattr(d, q)) * 1000

    return [Cell(cls, name, {x: get(x, cls, attr, q) for x in LAYOUTS if x in runs})
            for cls in CLASSES for name, attr, q in STATS]


@dataclass(frozen=True)
class Prediction:
    """The planner's means for the benchmark's workload: the P/D split, and the colocated
    TPOT for the same 16 GPUs."""

    estimate: PdEstimate
    workload: PdWorkload


def predict(mix: MixSpec, rate_per_s: float, transfer_bytes_per_s: float) -> Prediction:
    model, gpu = parse_profile(PROFILE)
    workload = PdWorkload(rate_per_s, mix.classes())
    return Prediction(estimate_pd(model, gpu, workload, PREFILL_WORKERS,
                                  WORKERS - PREFILL_WORKERS,
                                  link_bytes_per_s=transfer_bytes_per_s), workload)


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None or not math.isfinite(value) else format(value, fmt)


def _mean_ms(summary: Summary | None, attr: str) -> float | None:
    d = getattr(summary, attr) if summary is not None else None
    return None if d is None else d.mean * 1000


def class_table(found: Sequence[Cell]) -> list[str]:
    layouts = list(found[0].ms) if found else []
    others = [x for x in layouts if x != "mixed"]
    lines = [f"{'class':<7}{'statistic':<11}" + "".join(f"{x + ' ms':>16}" for x in layouts)
             + "".join(f"{x + '/mixed':>20}" for x in others) + "  winner"]
    for c in found:
        lines.append(f"{c.request_class:<7}{c.stat:<11}"
                     + "".join(f"{_num(c.ms[x], '.1f'):>16}" for x in layouts)
                     + "".join(f"{_num(c.ratio(x), '.2f'):>20}" for x in others)
                     + f"  {c.winner or '-'}")
    return lines


def prediction_table(pred: Prediction, runs: dict[str, LayoutRun]) -> list[str]:
    e = pred.estimate
    pd, mixed = runs.get("pd"), runs.get("mixed")
    lines = [f"planner (gateway.planner.estimate_pd, means, modelled ms): prefill utilisation"
             f" {e.prefill_utilisation:.0%} of {e.prefill_gpus} GPUs, mean prefill wait"
             f" {_num(e.prefill_wait_s * 1000, '.1f')} ms, decode batch {e.decode_batch:.1f}"
             " per GPU",
             f"{'class':<7}{'metric':<16}{'predicted':>10}{'measured':>10}"]
    for c in e.classes:
        got = pd.classes.get(c.name) if pd is not None else None
        lines.append(f"{c.name:<7}{'pd TTFT mean':<16}{c.ttft_s * 1000:>10.1f}"
                     f"{_num(_mean_ms(got, 'ttft_s'), '.1f'):>10}")
    chat_pd = pd.classes.get("chat") if pd is not None else None
    chat_mixed = mixed.classes.get("chat") if mixed is not None else None
    lines.append(f"{'chat':<7}{'pd TPOT mean':<16}{e.tpot_s * 1000:>10.2f}"
                 f"{_num(_mean_ms(chat_pd, 'tpot_s'), '.2f'):>10}")
    lines.append(f"{'chat':<7}{'mixed TPOT mean':<16}{_num(e.colocated_tpot_s * 1000, '.2f'):>10}"
                 f"{_num(_mean_ms(chat_mixed, 'tpot_s'), '.2f'):>10}")
    return lines


def wins(found: Sequence[Cell]) -> list[str]:
    """One line per layout: the statistics where it is the fastest."""
    layouts = list(found[0].ms) if found else []
    return [f"  {layout} wins: "
            + (", ".join(f"{c.request_class} {c.stat}" for c in found if c.winner == layout)
               or "nothing") for layout in layouts]


def plot(found: Sequence[Cell], pred: Prediction, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, metric in zip(axes, ("ttft", "tpot"), strict=True):
        chosen = [c for c in found if c.stat.startswith(metric)]
        labels = [f"{c.request_class}\n{c.stat.split('_')[1]}" for c in chosen]
        x = range(len(chosen))
        layouts = list(chosen[0].ms) if chosen else []
        width = 0.8 / max(len(layouts), 1)
        for k, layout in enumerate(layouts):
            ax.bar([i - 0.4 + width * (k + 0.5) for i in x],
                   [c.ms[layout] or 0.0 for c in chosen], width, color=f"C{k}",
                   label=layout + (f" ({WORKERS})" if layout == "mixed" else
                                   f" ({PREFILL_WORKERS}+{WORKERS - PREFILL_WORKERS})"))
        ax.set_xticks(list(x), labels, fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel(f"{metric.upper()} (modelled ms)")
        ax.grid(alpha=0.3, axis="y")
        if metric == "tpot":
            e = pred.estimate
            ax.axhline(e.tpot_s * 1000, color="C1", linestyle="--", linewidth=1,
                       label="planner: pd TPOT mean")
            if math.isfinite(e.colocated_tpot_s):
                ax.axhline(e.colocated_tpot_s * 1000, color="C0", linestyle="--", linewidth=1,
                           label="planner: mixed TPOT mean")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- main -----------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m gateway.bench.disagg", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=16.0,
                   help="requests per modelled second, Poisson (default 16)")
    p.add_argument("--long-fraction", type=float, default=0.15,
                   help="share of long prompts (default 0.15)")
    p.add_argument("--duration-s", type=float, default=150.0,
                   help="wall seconds of load per layout (default 150)")
    p.add_argument("--drain-s", type=float, default=60.0,
                   help="grace for requests in flight at the end (default 60)")
    p.add_argument("--time-scale", type=float, default=2.0,
                   help="wall seconds per modelled second of the simulator (default 2)")
    p.add_argument("--layouts", default=",".join(LAYOUTS),
                   help=f"comma-separated, of {','.join(LAYOUTS)} (default all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="20 s per layout: a smoke run")
    p.add_argument("--records", action="store_true", help="every request in the JSON")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if args.quick:
        args.duration_s, args.drain_s = 20.0, 30.0
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    if not layouts or any(x not in LAYOUTS for x in layouts):
        p.error(f"--layouts: a comma-separated subset of {','.join(LAYOUTS)}")
    args.layouts = layouts
    if args.rate <= 0 or args.time_scale <= 0 or args.duration_s <= 0:
        p.error("--rate, --time-scale and --duration-s must be > 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from gateway.sim.config import DEFAULT_KV_TRANSFER_BYTES_PER_S

    log_dir = Path(tempfile.mkdtemp(prefix="kvgate-disagg-"))
    # enough requests for the whole run at the rate (the run stops at --duration-s)
    count = math.ceil(args.rate / args.time_scale * args.duration_s * 1.5) + 10
    mix = MixSpec(count, long_fraction=args.long_fraction, seed=args.seed)
    runs: dict[str, LayoutRun] = {}
    with ProcessSet(log_dir) as procs:
        probe = procs.start("sim-probe", SimProcess(log_path=log_dir / "probe.log"), timeout_s=60)
        calibrated = asyncio.run(calibrate_tokens_per_word(probe.urls, SIM_MODEL))
        procs.stop("sim-probe")
        mix = replace(mix, tokens_per_word=calibrated[0] if calibrated else 2.0)
        for layout in args.layouts:
            runs[layout] = run_layout(layout, args, mix, procs, log_dir)
            print(target_block(runs[layout].report), flush=True)
            if runs[layout].sim_lag_warnings:
                print(f"warning: the simulated engines fell behind their model clock"
                      f" {runs[layout].sim_lag_warnings} times (host too slow for time scale"
                      f" {args.time_scale:g}): latencies are inflated", flush=True)
            print(flush=True)
    pred = predict(mix, args.rate, DEFAULT_KV_TRANSFER_BYTES_PER_S)
    found = cells(runs)
    reports = [runs[x].report for x in args.layouts]
    title = (f"{WORKERS} simulated {PROFILE} workers: mixed vs {PREFILL_WORKERS} prefill +"
             f" {WORKERS - PREFILL_WORKERS} decode (pd-selective: remote prefill from"
             f" {SELECTIVE_MIN_TOKENS} uncached tokens); {args.rate:g} req/s,"
             f" {args.long_fraction:.0%} long prompts")
    lines = [f"== {title} (latencies in modelled time)", compare_table(reports), "",
             *class_table(found), "", *wins(found), "", *prediction_table(pred, runs)]
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    data = to_json(reports, {**config, "argv": sys.argv[1:], "mix": asdict(mix),
                             "profile": PROFILE, "logs": str(log_dir)})
    if not args.records:
        for target in data["targets"]:
            target.pop("records", None)
    data["cells"] = [asdict(c) | {"winner": c.winner,
                                  "ratio_to_mixed": {x: c.ratio(x) for x in c.ms}}
                     for c in found]
    data["prediction"] = {"workload": asdict(pred.workload),
                          "estimate": pd_estimate_to_json(pred.estimate)}
    data["table"] = lines
    data["sim_lag_warnings"] = {x: r.sim_lag_warnings for x, r in runs.items()}
    write_json(args.out / "disagg.json", data)
    plot(found, pred, args.out / "disagg.png", title)
    plot_cdfs(reports, args.out / "disagg_cdf.png", title + " (modelled time)")
    print(f"disagg: wrote {args.out / 'disagg.json'}, {args.out / 'disagg.png'},"
          f" {args.out / 'disagg_cdf.png'}")
    failed = any(r.report.summary.ok == 0 for r in runs.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
