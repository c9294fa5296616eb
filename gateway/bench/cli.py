"""``kvgate bench``: KV-cache workloads against any OpenAI-compatible URL, side by side.

Targets can be a kvgate gateway, a vLLM server, a competing router or a simulated worker; with
``--compare a=URL b=URL`` every target gets the same requests (same seed, same arrival schedule),
one target after the other. Each target run puts its own random ``--salt`` in front of every
prompt, so prefixes are shared within a run but a target never finds an earlier one's prompts in a
KV cache they share; ``--salt none`` sends byte-identical prompts, and ``--reset-url`` (vLLM's and
the simulator's ``/reset_prefix_cache``) POSTed before each target empties the caches instead. ``--worker-url`` names the vLLM servers
behind the targets: their ``/metrics`` prefix-cache counters are read before and after each target,
giving the fleet's hit rate for that run.

Examples::

    kvgate bench --url http://127.0.0.1:8000 --workload shared-prefix --rate 4 --duration-s 60
    kvgate bench --workload sweep --lengths 2048,4096,8192,16384 --per-length 5 \\
        --url http://127.0.0.1:8100 --ignore-eos
    kvgate bench --workload multiturn --compare rr=http://127.0.0.1:8001 kv=http://127.0.0.1:8002 \\
        --worker-url http://127.0.0.1:8100 http://127.0.0.1:8101 \\
        --reset-url http://127.0.0.1:8100/reset_prefix_cache http://127.0.0.1:8101/reset_prefix_cache

Writes ``bench.json`` (every request and summary), ``latency_cdf.png`` and, for workloads with
several groups, ``sweep.png`` / ``curves.png`` under ``--out`` (default ``results/bench/WORKLOAD``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import secrets
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from gateway.bench.loadgen import (
    LoadSpec,
    Progress,
    Target,
    calibrate_tokens_per_word,
    discover_model,
    run_target,
)
from gateway.bench.report import (
    TargetReport,
    build_report,
    compare_table,
    plot_cdfs,
    plot_curves,
    target_block,
    to_json,
    write_json,
)
from gateway.bench.workloads import WORKLOADS, WorkloadSpec, build_workload

HELP = "load-test a gateway / vLLM / router with KV-cache workloads; compare targets"


def register(subparsers: Any) -> None:
    """Add the ``bench`` subcommand to ``kvgate``'s subparsers."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "bench", help=HELP, description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(func=run)


def _positive_int_list(text: str) -> tuple[int, ...]:
    """``2048,4096`` or ``2k,4k`` (k = 1024)."""
    values: list[int] = []
    for part in text.lower().split(","):
        part = part.strip()
        if not part:
            continue
        try:
            values.append(int(float(part[:-1]) * 1024) if part.endswith("k") else int(part))
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"not a list of positive integers: {text!r}")
    return tuple(values)


def _target(text: str) -> Target:
    name, sep, url = text.partition("=")
    if not sep or not name or not url.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"expected NAME=http://host:port, got {text!r}")
    return Target(name, url.rstrip("/"))


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"not JSON: {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}")
    return value


def _header(text: str) -> tuple[str, str]:
    name, sep, value = text.partition(":")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected 'Name: value', got {text!r}")
    return name.strip(), value.strip()


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = WorkloadSpec("multiturn")
    t = p.add_argument_group("targets")
    t.add_argument("--url", help="base URL of the target (http://host:port)")
    t.add_argument("--compare", nargs="+", action="extend", type=_target, metavar="NAME=URL",
                   help="run the same workload against each target in turn; ratios to the first")
    t.add_argument("--model", help="model name to send (default: the first of GET /v1/models)")
    t.add_argument("--worker-url", nargs="+", action="extend", default=[], metavar="URL",
                   help="vLLM worker(s) whose /metrics prefix-cache counters give the hit rate")
    t.add_argument("--reset-url", nargs="+", action="extend", default=[], metavar="URL",
                   help="URL(s) to POST before each target, e.g. WORKER/reset_prefix_cache")
    t.add_argument("--header", action="append", type=_header, default=[], metavar="'K: V'",
                   help="extra request header (repeatable)")
    t.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")

    w = p.add_argument_group("workload")
    w.add_argument("--workload", "-w", choices=WORKLOADS, default="multiturn")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--api", choices=("chat", "completions"), default="chat")
    w.add_argument("--max-tokens", type=int, default=d.max_tokens,
                   help="output tokens asked per request (default %(default)s)")
    w.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos: true so every answer has exactly max-tokens tokens")
    w.add_argument("--extra-body", type=_json_object, default={}, metavar="JSON",
                   help="fields merged into every request body, e.g. '{\"temperature\": 0}'")
    w.add_argument("--tokens-per-word", default="auto",
                   help="workload text's tokens per word: a number, or 'auto' to measure it on "
                        "the target's (or a worker's) /tokenize, else from the usage of two "
                        "probe requests, else 1.0 (default auto)")
    w.add_argument("--salt", default="auto",
                   help="text put in front of every prompt, one per target run, so no target "
                        "finds the previous run's prompts in a shared KV cache: 'auto' (a fresh "
                        "random one per target), 'none' (byte-identical prompts: then give "
                        "--reset-url for a fair comparison), or a fixed string")
    w.add_argument("--real-answers", action="store_true",
                   help="multiturn: append the answers the server gave, not synthetic ones "
                        "(then targets no longer get byte-identical requests)")
    k = p.add_argument_group("workload sizes (approximate tokens)")
    k.add_argument("--sessions", type=int, default=None,
                   help="multiturn sessions (default 16, or enough for --requests)")
    k.add_argument("--turns", type=int, default=d.turns)
    k.add_argument("--system-tokens", type=int, default=d.system_tokens)
    k.add_argument("--first-user-tokens", type=int, default=d.first_user_tokens)
    k.add_argument("--turn-user-tokens", type=int, default=d.turn_user_tokens)
    k.add_argument("--answer-tokens", type=int, default=None,
                   help="multiturn synthetic answer length (default: --max-tokens)")
    k.add_argument("--prefixes", type=int, default=d.prefixes, help="shared-prefix: prompts")
    k.add_argument("--prefix-tokens", type=int, default=d.prefix_tokens)
    k.add_argument("--question-tokens", type=int, default=d.question_tokens)
    k.add_argument("--prefix-zipf-s", type=float, default=d.prefix_zipf_s,
                   help="shared-prefix: 0 uniform popularity, s > 0 Zipf (weight 1/k^s)")
    k.add_argument("--docs", type=int, default=d.docs, help="doc-qa: documents")
    k.add_argument("--doc-tokens", type=int, default=d.doc_tokens)
    k.add_argument("--long-tokens", type=int, default=d.long_tokens)
    k.add_argument("--short-tokens", type=int, default=d.short_tokens)
    k.add_argument("--long-fraction", type=float, default=d.long_fraction,
                   help="mixed: share of long requests (default %(default)s)")
    k.add_argument("--lengths", type=_positive_int_list, default=d.lengths,
                   help="sweep: prompt lengths, e.g. 2048,4096,8192 or 2k,4k,8k")
    k.add_argument("--per-length", type=int, default=d.per_length,
                   help="sweep: requests per length (default %(default)s)")

    lo = p.add_argument_group("load")
    mode = lo.add_mutually_exclusive_group()
    mode.add_argument("--concurrency", "-c", type=int, default=None,
                      help="closed loop: this many users (default 8; sweep 1)")
    mode.add_argument("--rate", "-r", type=float, default=None,
                      help="open loop: Poisson arrivals, requests per second")
    lo.add_argument("--requests", "-n", type=int, default=None,
                    help="stop after this many requests (default: the workload's size)")
    lo.add_argument("--duration-s", type=float, default=None,
                    help="stop issuing after this long (whichever comes first)")
    lo.add_argument("--drain-s", type=float, default=30.0,
                    help="grace for requests in flight at --duration-s (default %(default)s)")
    lo.add_argument("--timeout-s", type=float, default=600.0, help="per request")
    lo.add_argument("--max-inflight", type=int, default=1024, help="open loop safety cap")

    o = p.add_argument_group("output")
    o.add_argument("--out", default=None, help="directory (default results/bench/WORKLOAD)")
    o.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress line on stderr (default: when stderr is a terminal)")
    o.add_argument("--no-plots", action="store_true", help="skip the PNG files")


def _workload_spec(args: argparse.Namespace) -> WorkloadSpec:
    return WorkloadSpec(
        name=args.workload, seed=args.seed, requests=args.requests, max_tokens=args.max_tokens,
        sessions=args.sessions, turns=args.turns, system_tokens=args.system_tokens,
        first_user_tokens=args.first_user_tokens, turn_user_tokens=args.turn_user_tokens,
        answer_tokens=args.answer_tokens, prefixes=args.prefixes, prefix_tokens=args.prefix_tokens,
        question_tokens=args.question_tokens, docs=args.docs, doc_tokens=args.doc_tokens,
        prefix_zipf_s=args.prefix_zipf_s,
        long_tokens=args.long_tokens, short_tokens=args.short_tokens,
        long_fraction=args.long_fraction, lengths=args.lengths, per_length=args.per_length,
    )


@dataclasses.dataclass(frozen=True)
class _Outcome:
    reports: list[TargetReport]
    config: dict[str, Any]
    workload: str
    title: str


def run(args: argparse.Namespace) -> int:
    try:
        outcome = asyncio.run(_run(args))
    except KeyboardInterrupt:
        print("kvgate bench: interrupted", file=sys.stderr)
        return 130
    if isinstance(outcome, int):
        return outcome
    reports = outcome.reports
    out = Path(args.out or f"results/bench/{outcome.workload}")
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "bench.json", to_json(reports, outcome.config))
    written = [out / "bench.json"]
    if not args.no_plots:
        plot_cdfs(reports, out / "latency_cdf.png", outcome.title)
        written.append(out / "latency_cdf.png")
        if any(len(r.groups) > 1 for r in reports):
            curves = out / ("sweep.png" if outcome.workload == "sweep" else "curves.png")
            plot_curves(reports, curves, outcome.title,
                        x_from_zero=outcome.workload == "sweep")
            written.append(curves)
    print(f"\nwrote {', '.join(str(p) for p in written)}")
    return 1 if any(r.summary.ok == 0 for r in reports) else 0


def _fail(message: str) -> int:
    print(f"kvgate bench: {message}", file=sys.stderr)
    return 2


async def _run(args: argparse.Namespace) -> _Outcome | int:
    targets: list[Target] = list(args.compare or [])
    if args.url:
        if targets:
            return _fail("give --url or --compare, not both (name the first target in --compare)")
        if not args.url.startswith(("http://", "https://")):
            return _fail(f"--url must start with http:// or https://, got {args.url!r}")
        targets = [Target("target", args.url.rstrip("/"))]
    if not targets:
        return _fail("give --url URL or --compare NAME=URL ...")
    if len({t.name for t in targets}) != len(targets):
        return _fail("--compare names must be distinct")
    headers = dict(args.header)
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"

    try:
        spec = _workload_spec(args)
    except ValueError as exc:
        return _fail(str(exc))

    model = args.model or await discover_model(targets[0].url, headers)
    if model is None:
        return _fail(f"no --model given and {targets[0].url}/v1/models did not list one")

    tokens_per_word, tpw_source = await _tokens_per_word(args, targets, model, headers)
    if tokens_per_word is None:
        return _fail(f"--tokens-per-word must be 'auto' or a positive number, "
                     f"got {args.tokens_per_word!r}")
    spec = dataclasses.replace(spec, tokens_per_word=tokens_per_word)
    workload = build_workload(spec)
    concurrency = args.concurrency or (1 if spec.name == "sweep" else 8)
    try:
        load = LoadSpec(
            model=model, concurrency=concurrency, rate=args.rate, duration_s=args.duration_s,
            drain_s=args.drain_s, timeout_s=args.timeout_s, max_inflight=args.max_inflight,
            api=args.api, ignore_eos=args.ignore_eos, real_answers=args.real_answers,
            extra_body=args.extra_body, headers=headers, seed=args.seed,
        )
    except ValueError as exc:
        return _fail(str(exc))

    mode = f"open loop {args.rate}/s" if args.rate else f"closed loop, {concurrency} user{'s' if concurrency > 1 else ''}"
    bound = f"{workload.total} requests" + (
        f" or {args.duration_s:g} s" if args.duration_s is not None else "")
    print(f"kvgate bench: {spec.name}, model {model}, {mode}, {bound}, max_tokens "
          f"{spec.max_tokens}, seed {spec.seed}; tokens/word {tokens_per_word:.2f} ({tpw_source})",
          flush=True)

    progress = Progress(args.progress if args.progress is not None else sys.stderr.isatty())
    reports: list[TargetReport] = []
    for target in targets:
        salt = {"auto": secrets.token_hex(4), "none": None}.get(args.salt, args.salt)
        result = await run_target(target, workload, dataclasses.replace(load, salt=salt),
                                  worker_urls=args.worker_url,
                                  reset_urls=args.reset_url, progress=progress)
        report = build_report(result)
        reports.append(report)
        print()
        print(target_block(report))
        _print_first_errors(report)
    if len(reports) > 1:
        print()
        print(f"== comparison ({spec.name}; ratios to {reports[0].run.target.name})")
        print(compare_table(reports))

    config = {
        "argv": sys.argv[1:],
        "model": model,
        "workload": dataclasses.asdict(spec),
        "load": {**dataclasses.asdict(load), "headers": sorted(headers)},  # no secrets
        "tokens_per_word_source": tpw_source,
        "targets": [dataclasses.asdict(t) for t in targets],
        "worker_urls": args.worker_url,
        "reset_urls": args.reset_url,
    }
    return _Outcome(reports, config, spec.name, f"kvgate bench {spec.name} ({mode})")


async def _tokens_per_word(args: argparse.Namespace, targets: Sequence[Target], model: str,
                           headers: dict[str, str]) -> tuple[float | None, str]:
    if args.tokens_per_word != "auto":
        try:
            value = float(args.tokens_per_word)
        except ValueError:
            return None, ""
        return (value, "given") if value > 0 else (None, "")
    urls = [t.url for t in targets] + [u.rstrip("/").removesuffix("/metrics")
                                       for u in args.worker_url]
    measured = await calibrate_tokens_per_word(urls, model, headers,
                                               probe_url=targets[0].url, api=args.api)
    if measured is None:
        return 1.0, "assumed; neither /tokenize nor usage answered"
    return measured


def _print_first_errors(report: TargetReport, limit: int = 3) -> None:
    shown = 0
    for rec in report.run.records:
        if rec.error is not None and shown < limit:
            print(f"  request {rec.index}: {rec.error} {rec.message or ''}".rstrip())
            shown += 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvgate bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
