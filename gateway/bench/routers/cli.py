"""``python -m gateway.bench.routers``: the command line of the benchmark (see the package
docstring, which is also its ``--help``)."""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import gateway.bench.routers as package
from gateway.bench.routers.report import plot, print_summary, write_results
from gateway.bench.routers.scenarios import SCENARIOS
from gateway.bench.routers.targets import CONTENDERS
from gateway.procs.net import Ports
from gateway.procs.process import ProcessSet, StartError


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gateway.bench.routers", description=package.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", required=True, choices=sorted(SCENARIOS))
    p.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=CONTENDERS,
                   help="vllm and sim16 only (default: all five)")
    p.add_argument("--out", default="results/routers", help="parent directory of the results")
    p.add_argument("--quick", action="store_true", help="a short smoke run (numbers not useful)")
    p.add_argument("--time-scale", type=float, default=None,
                   help="simulated workers' time scale (default: sim16 8, isolation 2)")
    p.add_argument("--rate", type=float, default=None,
                   help="open-loop rate (sim16 shared-prefix: 24/s; isolation: 8/s)")
    p.add_argument("--duration-s", type=float, default=None,
                   help="slo only: seconds of arrivals per run (default 100; --quick 45): a"
                        " longer run judges attainment over more requests and schedules")
    p.add_argument("--sim-processes", type=int, default=4,
                   help="kvgate sim processes the simulated workers are spread over (default 4:"
                        " one event loop per 4 workers keeps bursts from stalling the model"
                        " clock)")
    p.add_argument("--sglang-router", default=None, help="path of the sglang-router binary")
    p.add_argument("--vllm-router", default=None, help="path of the vllm-router binary")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--replot", action="store_true",
                   help="only redraw routers.png from the scenario's routers.json")
    args = p.parse_args(argv)
    args.out_dir = Path(args.out) / args.scenario
    if args.replot:
        data = json.loads((args.out_dir / "routers.json").read_text())
        plot(data, args.out_dir / "routers.png")
        print(f"wrote {args.out_dir / 'routers.png'}")
        return 0
    args.progress = args.progress if args.progress is not None else sys.stderr.isatty()
    command = "python -m gateway.bench.routers " + shlex.join(
        list(argv) if argv is not None else sys.argv[1:])
    signal.signal(signal.SIGTERM, _terminate)
    procs = ProcessSet(args.out_dir / "logs")
    ports = Ports(23000)
    t0 = time.monotonic()
    try:
        result = SCENARIOS[args.scenario](procs, ports, args)
    except StartError as exc:
        print(f"routers: could not start the workers: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("routers: interrupted; stopping everything", file=sys.stderr)
        return 130
    finally:
        procs.stop_all()
    elapsed = time.monotonic() - t0
    print_summary(result)
    write_results(result, args.out_dir, command, elapsed)
    print(f"\nwrote {args.out_dir / 'routers.json'}, {args.out_dir / 'routers.png'} "
          f"({elapsed:.0f} s)")
    return 0
