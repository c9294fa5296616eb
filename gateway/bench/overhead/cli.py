"""The overhead benchmark's command line: the flags (the package docstring is the --help text),
the targets chosen, every case run, the report printed and written."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import gateway.bench.overhead as package
from gateway.bench.overhead.model import CASES, ISOLATION, Case, Summary, Target, Verdict, targets
from gateway.bench.overhead.report import (
    client_check,
    finite,
    kernel_split,
    plot,
    prediction,
    process_shares,
    split_cpu,
    table,
)
from gateway.bench.overhead.run import run_case
from gateway.bench.overhead.summary import evaluate, summarize
from gateway.procs.peers import SGLANG_ROUTER, VLLM_ROUTER
from gateway.procs.vllm import tiny_model_path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gateway.bench.overhead",
                                     description=package.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    names = [t.name for t in targets(2)]
    parser.add_argument("--case", action="append",
                        choices=[*(c.name for c in CASES), ISOLATION],
                        help=f"a case to run (repeatable); default: all but "
                             f"{', '.join([c.name for c in CASES if not c.default] + [ISOLATION])}")
    parser.add_argument("--target", action="append", metavar="NAME",
                        help=f"a target to run (repeatable; direct always runs); default: all "
                             f"of {', '.join(names)} (p2 stands for --processes)")
    parser.add_argument("--duration-s", type=float, default=10.0, help="length of one round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--processes", type=int, default=len(os.sched_getaffinity(0)),
                        help="N of the kvgate --processes N targets (default: usable cores)")
    parser.add_argument("--hf-tokenizer", type=Path, default=tiny_model_path(),
                        help="tokenizer + chat template directory of the kv_aware targets")
    parser.add_argument(f"--{VLLM_ROUTER.command}", dest=VLLM_ROUTER.command, default=None,
                        help="the vllm-router binary (else found as gateway/procs/peers.py says)")
    parser.add_argument(f"--{SGLANG_ROUTER.command}", dest=SGLANG_ROUTER.command, default=None,
                        help="the sglang-router binary")
    parser.add_argument("--out", type=Path, default=Path("results/overhead"))
    parser.add_argument("--profile", type=Path, nargs="?", const=Path("docs/results"),
                        default=None, metavar="DIR",
                        help="after the measured rounds, one more per kvgate target under "
                             "py-spy: its flame graph as DIR/profile_<case>_<target>.svg "
                             "(default DIR: docs/results)")
    return parser


def choose(all_targets: Sequence[Target], wanted: Sequence[str] | None, processes: int,
           ) -> list[Target]:
    """``direct`` plus the targets named (``_p2`` in a name stands for ``_pN``)."""
    if not wanted:
        return list(all_targets)
    names = {w.replace("_p2", f"_p{processes}") for w in wanted} | {"direct"}
    unknown = names - {t.name for t in all_targets}
    if unknown:
        raise SystemExit(f"unknown target(s): {', '.join(sorted(unknown))}")
    return [t for t in all_targets if t.name in names]


def main(argv: list[str] | None = None, *, say: Callable[[str], None] = print) -> int:
    args = build_parser().parse_args(argv)
    if shutil.which("wrk") is None:
        print("wrk is not installed (apt-get install wrk)", file=sys.stderr)
        return 2
    cases = [c for c in CASES if c.name in args.case] if args.case else [
        c for c in CASES if c.default]
    chosen = choose(targets(args.processes), args.target, args.processes)
    args.out.mkdir(parents=True, exist_ok=True)
    runs: list[tuple[Case, list[Summary]]] = []
    record: list[dict[str, Any]] = []
    for case in cases:
        run = run_case(case, chosen, args, args.out / "logs" / case.name)
        sums = summarize(run.rounds)
        runs.append((case, sums))
        record.append({"case": asdict(case), "targets": run.started, "skipped": run.skipped,
                       "summaries": [asdict(s) for s in sums],
                       "rounds": [asdict(r) for r in run.rounds]})
    isolation_lines: list[str] = []
    isolation_verdicts: list[Verdict] = []
    if args.case and ISOLATION in args.case:
        # imported here: it loads transformers (the tokenizer of its flood), which the other
        # cases do not need
        from gateway.bench import isolation

        isolated = isolation.run_isolation(chosen, args, args.out / "logs" / ISOLATION)
        record.append(isolated.record())
        isolation_lines, isolation_verdicts = isolation.report(isolated), isolated.verdicts
        isolation.plot(isolated, args.out / "isolation.png")
    summaries = [s for _, sums in runs for s in sums]
    verdicts = evaluate(summaries, args.processes) + isolation_verdicts
    say("")
    for (case, sums), rec in zip(runs, record, strict=False):
        say(table(case, sums))
        for name, why in rec["skipped"].items():
            say(f"  skipped {name}: {why.splitlines()[0]}")
        if check := client_check(case, sums):
            say("  " + check)
        say("")
    if isolation_lines:
        for line in [*isolation_lines, ""]:
            say(line)
    say("what the CPU per short request predicts for a 16-core gateway node (upper bound):")
    for line in prediction(summaries) or ["  (neither the short nor the fresh case ran)"]:
        say(line)
    say("")
    if kernel := kernel_split(summaries):
        say("the routers' CPU per request in user space and in the kernel:")
        for line in kernel:
            say(line)
        say("")
    if shares := process_shares(summaries):
        say("how the processes of a gateway shared its CPU:")
        for line in shares:
            say(line)
        say("")
    if split := split_cpu(summaries):
        say("kvgate's CPU per request split at its layers (kvgate_plumbing) and its features:")
        for line in split:
            say(line)
        say("")
    say("targets:")
    for v in verdicts:
        mark = {True: "met", False: "MISSED", None: "NOT RUN"}[v.met]
        say(f"  {mark:<8}{v.target:<32} {v.goal}: {v.detail}")
    (args.out / "overhead.json").write_text(json.dumps(finite({
        "config": {"duration_s": args.duration_s, "rounds": args.rounds,
                   "processes": args.processes, "cores": len(os.sched_getaffinity(0)),
                   "hf_tokenizer": str(args.hf_tokenizer)},
        "cases": record, "verdicts": [asdict(v) for v in verdicts]}), indent=2))
    written = [args.out / "overhead.json"]
    if runs:
        plot(runs, args.out / "overhead.png")
        written.append(args.out / "overhead.png")
    if isolation_lines:
        written.append(args.out / "isolation.png")
    say(f"wrote {', '.join(str(p) for p in written)}")
    return 0
