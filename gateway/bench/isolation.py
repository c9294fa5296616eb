"""The overhead benchmark's ``isolation`` case: do short chats through kvgate stay fast while
128K-token prompts flood it? (issue 11: short-chat added latency within 1.2x while 128K-token
prompts arrive at 2/s).

Setup: two no-op backends (``gateway.bench.noop``, 20 ms model time): the short pool's and the
long pool's. kvgate (kv_aware, the exact HF tokenizer and chat template; 1 and N processes, as
chosen) runs with two pools: ``fleet`` (8K tokens) on the first backend and ``long``
(``LONG_POOL_TOKENS``, which admits a 128K-token prompt plus its ``max_tokens``) on the second.
``direct`` is the short backend itself; its flood goes to the long backend itself.

Each round, for every target (order rotated), two phases of ``--duration-s`` each, their order
alternating round by round so drift hits both alike:

- quiet: short non-streaming chats from wrk at ``CASE.concurrency`` connections, nothing else;
- flood: the same wrk load while a small async sender in this process posts distinct chats of
  ~128K tokens to the same target at ``FLOOD_RATE_PER_S``, open loop (each on its own schedule,
  never waiting for an answer). Each prompt starts with its own marker (``Request 17.``) and is
  random common words from its own seed (``gateway.bench.workloads``), so no cache (the
  gateway's segment cache, a prefix index) spares the gateway any tokenizing. Prompts are made
  before the phase; the sender's CPU (``getrusage(RUSAGE_SELF)``: it is this process) is counted
  apart from wrk's and the router's.

Read against ``direct`` in the same phase, so the machine-wide cost of the flood (the sender,
the long backend reading 0.5 MB bodies) is not charged to the gateway: added latency = target's
p50/p99 - direct's, per phase (medians over rounds). The verdicts (p50 and p99 apart) are met
when added latency with the flood <= ``RATIO_GOAL`` x added latency without it and every flood
request was answered 200 (a gateway that drops the flood is not isolating it). The router's CPU
per short request is printed for both phases; in the flood phase it includes the flood's own
tokenizing, so the difference, spread over the long prompts answered, estimates what one long
prompt costs the gateway.

Output: two tables (quiet, flood) in the overhead benchmark's format, the flood's counts, the
ratios and verdicts; ``isolation.png`` next to ``overhead.json`` (which records every phase).
Run: ``python -m gateway.bench.overhead --case isolation [--duration-s 10] [--rounds 3]``
(about 4 minutes with the defaults and N = 2: 3 targets x 2 phases x 10 s x 3 rounds, plus
starting, calibrating and warming up; not in the default set of cases).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import resource
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from gateway.bench.overhead.cpu import (
    machine_cpu_s,
    read_proc_stats,
    rusage_cpu_s,
    tree_cpu_s,
)
from gateway.bench.overhead.model import (
    ISOLATION,
    LUA,
    MODEL,
    START_TIMEOUT_S,
    WARMUP_S,
    Case,
    Round,
    Summary,
    Target,
    Verdict,
)
from gateway.bench.overhead.report import table
from gateway.bench.overhead.run import Running, rotated, start_target
from gateway.bench.overhead.summary import summarize
from gateway.bench.overhead.wrk import parse_wrk, run_wrk, wrk_argv
from gateway.bench.stats import percentile
from gateway.bench.workloads import calibration_text, words
from gateway.procs.kvgate import noop_backend
from gateway.procs.net import Ports, free_port
from gateway.procs.process import ManagedProcess, ProcessSet, StartError
from gateway.prompt.tokenizer import load_tokenizer

CASE = Case(ISOLATION, 20.0, 16, "20 ms backend, wrk c=16 short chats, no flood")
FLOOD_CASE = Case(f"{ISOLATION}+flood", 20.0, 16,
                  "the same, while distinct ~128K-token prompts arrive at 2/s")
FLOOD_RATE_PER_S = 2.0
FLOOD_PROMPT_TOKENS = 128 * 1024
LONG_POOL_TOKENS = 160 * 1024
"""The long pool's context limit: a 128K-token prompt + max_tokens, with room for the
word-count estimate of the prompt's length to be off by a few percent."""
FLOOD_TIMEOUT_S = 60.0
FLOOD_GRACE_S = 10.0
"""After a phase, how long flood requests still in flight may take before they are cancelled
(and counted unfinished)."""
RATIO_GOAL = 1.2


# -- the flood --------------------------------------------------------------------------------


def flood_text(index: int, tokens: int, tokens_per_word: float) -> str:
    """Flood prompt ``index``: its marker, then about ``tokens`` tokens of random words."""
    return f"Request {index}. " + words(random.Random(f"isolation:{index}"), tokens,
                                        tokens_per_word)


def flood_body(text: str) -> bytes:
    return orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": text}],
                         "max_tokens": 16})


@dataclass(frozen=True)
class FloodLoad:
    """What the flood sender saw in one phase."""

    sent: int
    ok: int
    """Answered 200."""
    failed: int
    """Answered otherwise, or the connection failed, or the request timed out."""
    unfinished: int
    """Still in flight ``FLOOD_GRACE_S`` after the phase: cancelled."""
    p50_ms: float
    p99_ms: float


async def _send_flood(url: str, bodies: Sequence[bytes], rate_per_s: float,
                      duration_s: float, ended: asyncio.Event) -> FloodLoad:
    """Post ``bodies`` to ``url`` open loop, one every 1 / ``rate_per_s`` seconds for
    ``duration_s``; once ``ended`` is set wait up to ``FLOOD_GRACE_S`` for the last answers."""
    clock = time.perf_counter
    latencies: list[float] = []
    failed = 0
    async with aiohttp.ClientSession(
            headers={"Content-Type": "application/json"},
            timeout=aiohttp.ClientTimeout(total=FLOOD_TIMEOUT_S)) as session:

        async def one(body: bytes) -> None:
            nonlocal failed
            start = clock()
            try:
                async with session.post(url + "/v1/chat/completions", data=body) as resp:
                    await resp.read()
                    if resp.status == 200:
                        latencies.append((clock() - start) * 1000)
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            failed += 1

        started = clock()
        tasks: list[asyncio.Task[None]] = []
        for k, body in enumerate(bodies):
            due = started + k / rate_per_s
            if due >= started + duration_s:
                break
            await asyncio.sleep(max(0.0, due - clock()))
            tasks.append(asyncio.create_task(one(body)))
        await ended.wait()
        _, pending = await asyncio.wait(tasks, timeout=FLOOD_GRACE_S) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return FloodLoad(len(tasks), len(latencies), failed, len(pending),
                     percentile(latencies, 0.5), percentile(latencies, 0.99))


# -- one phase: wrk, and the flood beside it ----------------------------------------------------


@dataclass(frozen=True)
class Phase:
    """One target in one phase of one round: the short chats as an overhead ``Round``
    (``loadgen_cpu_s`` is wrk's), the flood's counts (None when quiet), the sender's CPU."""

    round: Round
    flood: FloodLoad | None
    sender_cpu_s: float


async def _phase(short_url: str, long_url: str, duration_s: int, script: Path,
                 bodies: Sequence[bytes]) -> tuple[str, float, float, FloodLoad | None]:
    """wrk's report, its wall time, the sender's CPU (both taken when wrk ends), the flood."""
    ended = asyncio.Event()
    sender = (asyncio.create_task(_send_flood(long_url, bodies, FLOOD_RATE_PER_S, duration_s,
                                              ended)) if bodies else None)
    self_before, t0 = rusage_cpu_s(resource.RUSAGE_SELF), time.perf_counter()
    wrk = await asyncio.create_subprocess_exec(
        *wrk_argv(short_url, duration_s, CASE.concurrency, script),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await wrk.communicate()
    wall_s = time.perf_counter() - t0
    sender_cpu_s = rusage_cpu_s(resource.RUSAGE_SELF) - self_before
    if wrk.returncode != 0:
        raise RuntimeError(f"wrk failed ({wrk.returncode}): {err.decode()}")
    ended.set()
    return out.decode(), wall_s, sender_cpu_s, (await sender if sender else None)


def measure_phase(running: Running, long_url: str, backends: Sequence[ManagedProcess],
                  index: int, duration_s: float, script: Path, bodies: Sequence[bytes]) -> Phase:
    """One phase against one target, with the CPU of router, backends, wrk and the sender.

    The CPU of the processes is read when wrk ends, before the flood's stragglers are awaited,
    so the phase's CPU and its short requests cover the same time."""
    before, machine_before = read_proc_stats(), machine_cpu_s()
    wrk_before = rusage_cpu_s(resource.RUSAGE_CHILDREN)
    out, wall_s, sender_cpu_s, flood = asyncio.run(
        _phase(running.url, long_url, max(1, round(duration_s)), script, bodies))
    after, machine_after = read_proc_stats(), machine_cpu_s()
    router = None
    if running.proc is not None:
        router = tree_cpu_s(after, running.proc.pid) - tree_cpu_s(before, running.proc.pid)
    backend = sum(tree_cpu_s(after, b.pid) - tree_cpu_s(before, b.pid) for b in backends)
    case = FLOOD_CASE if bodies else CASE
    rnd = Round(case.name, running.target.name, index, parse_wrk(out), wall_s, router, backend,
                rusage_cpu_s(resource.RUSAGE_CHILDREN) - wrk_before,
                machine_after - machine_before)
    return Phase(rnd, flood, sender_cpu_s)


# -- the case -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Isolation:
    """One kvgate target's short-chat added latency without and with the flood."""

    target: str
    quiet_added_p50_ms: float
    quiet_added_p99_ms: float
    flood_added_p50_ms: float
    flood_added_p99_ms: float
    flood_sent: int
    flood_ok: int
    quiet_router_cpu_us_per_request: float | None
    flood_router_cpu_us_per_request: float | None
    router_cpu_ms_per_long_prompt: float | None
    """Estimate: the flood phase's router CPU beyond the quiet phase's per short request,
    spread over the long prompts answered."""

    @property
    def ratio_p50(self) -> float | None:
        return _ratio(self.flood_added_p50_ms, self.quiet_added_p50_ms)

    @property
    def ratio_p99(self) -> float | None:
        return _ratio(self.flood_added_p99_ms, self.quiet_added_p99_ms)


def _ratio(flood: float, quiet: float) -> float | None:
    return flood / quiet if quiet > 0 else None


@dataclass(frozen=True)
class IsolationRun:
    phases: list[Phase]
    quiet: list[Summary]
    flood: list[Summary]
    isolations: list[Isolation]
    verdicts: list[Verdict]
    prompt_tokens: int
    """Tokens of flood prompt 0 as the target's tokenizer renders and encodes it."""
    started: dict[str, dict[str, str | None]]
    skipped: dict[str, str]

    def record(self) -> dict[str, Any]:
        """The case as ``overhead.json`` records it."""
        return {"case": asdict(CASE), "flood_case": asdict(FLOOD_CASE),
                "flood": {"rate_per_s": FLOOD_RATE_PER_S, "prompt_tokens": self.prompt_tokens,
                          "long_pool_tokens": LONG_POOL_TOKENS},
                "targets": self.started, "skipped": self.skipped,
                "summaries": {"quiet": [asdict(s) for s in self.quiet],
                              "flood": [asdict(s) for s in self.flood]},
                "isolation": [{**asdict(i), "ratio_p50": i.ratio_p50, "ratio_p99": i.ratio_p99}
                              for i in self.isolations],
                "phases": [asdict(p) for p in self.phases]}


def isolations(phases: Sequence[Phase], quiet: Sequence[Summary],
               flood: Sequence[Summary]) -> list[Isolation]:
    """Each target's phases side by side (targets without ``direct`` or a phase left out)."""
    q_at, f_at = {s.target: s for s in quiet}, {s.target: s for s in flood}
    out = []
    for name, q in q_at.items():
        f = f_at.get(name)
        if name == "direct" or f is None or q.added_p50_ms is None or q.added_p99_ms is None \
                or f.added_p50_ms is None or f.added_p99_ms is None:
            continue
        floods = [p.flood for p in phases if p.round.target == name and p.flood is not None]
        ok = sum(fl.ok for fl in floods)
        per_long = None
        if (ok and q.router_cpu_us_per_request is not None
                and f.router_cpu_us_per_request is not None):
            extra_us = (f.router_cpu_us_per_request - q.router_cpu_us_per_request) * f.requests
            per_long = extra_us / ok / 1000
        out.append(Isolation(name, q.added_p50_ms, q.added_p99_ms, f.added_p50_ms,
                             f.added_p99_ms, sum(fl.sent for fl in floods), ok,
                             q.router_cpu_us_per_request, f.router_cpu_us_per_request,
                             per_long))
    return out


def evaluate(found: Sequence[Isolation], wanted: Sequence[str]) -> list[Verdict]:
    """The issue's isolation target for every kvgate target wanted, p50 and p99 apart."""
    at = {i.target: i for i in found}
    verdicts = []
    for stat in ("p50", "p99"):
        goal = (f"isolation: added {stat} with 128K-token prompts at {FLOOD_RATE_PER_S:g}/s "
                f"<= {RATIO_GOAL:g}x without")
        for name in wanted:
            i = at.get(name)
            if i is None:
                verdicts.append(Verdict(goal, name, None, "not run (or direct did not run)"))
                continue
            quiet, flood = ((i.quiet_added_p50_ms, i.flood_added_p50_ms) if stat == "p50"
                            else (i.quiet_added_p99_ms, i.flood_added_p99_ms))
            ratio = _ratio(flood, quiet)
            served = i.flood_ok == i.flood_sent > 0
            verdicts.append(Verdict(
                goal, name, served and flood <= RATIO_GOAL * quiet,
                f"{quiet:+.1f} -> {flood:+.1f} ms "
                f"({'-' if ratio is None else f'{ratio:.2f}x'}); "
                f"flood answered {i.flood_ok}/{i.flood_sent}"))
    return verdicts


def _calibrate(hf_tokenizer: Path) -> tuple[float, int]:
    """Tokens per word of the flood's words, and the exact tokens of flood prompt 0."""
    tok = load_tokenizer(str(hf_tokenizer))
    sample = calibration_text()
    per_word = len(tok.encode_text(sample, False)) / len(sample.split())
    first = [{"role": "user", "content": flood_text(0, FLOOD_PROMPT_TOKENS, per_word)}]
    return per_word, len(tok.encode_chat(first, {}))


def run_isolation(chosen: Sequence[Target], args: argparse.Namespace,
                  log_dir: Path) -> IsolationRun:
    """The case for ``direct`` and the chosen kvgate targets with the HF tokenizer."""
    wanted = [t for t in chosen if t.kind == "direct" or (t.kind == "kvgate"
                                                           and t.tokenizer == "hf")]
    per_word, prompt_tokens = _calibrate(args.hf_tokenizer)
    count = itertools.count(1)  # prompt 0 is the calibration's

    def bodies(n: int) -> list[bytes]:
        return [flood_body(flood_text(next(count), FLOOD_PROMPT_TOKENS, per_word))
                for _ in range(n)]

    per_phase = max(1, round(args.duration_s * FLOOD_RATE_PER_S))
    skipped: dict[str, str] = {}
    phases: list[Phase] = []
    log_dir.mkdir(parents=True, exist_ok=True)
    with ProcessSet(log_dir) as procs:
        script = log_dir / "post.lua"
        script.write_text(LUA)
        ports = Ports(free_port())
        short, short_url = noop_backend(ports.take(), CASE.backend_delay_ms)
        long, long_url = noop_backend(ports.take(), CASE.backend_delay_ms)
        procs.start("noop", short, timeout_s=START_TIMEOUT_S)
        procs.start("noop_long", long, timeout_s=START_TIMEOUT_S)
        running: list[tuple[Running, str]] = []
        for target in wanted:
            try:
                r = start_target(procs, ports, target, short_url, args.hf_tokenizer, vars(args),
                                 long_pool=(long_url, LONG_POOL_TOKENS))
            except StartError as exc:
                skipped[target.name] = str(exc).strip()
                procs.stop(target.name)
                print(f"overhead: {ISOLATION}: {target.name} skipped: "
                      f"{str(exc).strip().splitlines()[0]}", flush=True)
                continue
            running.append((r, long_url if target.kind == "direct" else r.url))
        for r, flood_url in running:
            run_wrk(r.url, WARMUP_S, CASE.concurrency, script)
            asyncio.run(_warm_flood(flood_url, bodies(2)))
        for i in range(args.rounds):
            for r, flood_url in rotated(running, i):
                for flooded in ((False, True) if i % 2 == 0 else (True, False)):
                    phase = measure_phase(r, flood_url, (short, long), i, args.duration_s,
                                          script, bodies(per_phase) if flooded else [])
                    phases.append(phase)
                    fl = phase.flood
                    print(f"overhead: {ISOLATION} round {i + 1}/{args.rounds} "
                          f"{r.target.name:<20} {'flood' if flooded else 'quiet'} "
                          f"{phase.round.load.requests_per_s:7.0f} req/s "
                          f"p99 {phase.round.load.p99_ms:7.1f} ms  errors "
                          f"{phase.round.load.errors}"
                          + (f"  flood ok {fl.ok}/{fl.sent}" if fl else ""), flush=True)
    quiet = summarize([p.round for p in phases if p.flood is None])
    flood = summarize([p.round for p in phases if p.flood is not None])
    found = isolations(phases, quiet, flood)
    verdicts = evaluate(found, [t.name for t in wanted if t.kind == "kvgate"])
    return IsolationRun(phases, quiet, flood, found, verdicts, prompt_tokens,
                        {r.target.name: r.about() for r, _ in running}, skipped)


async def _warm_flood(url: str, bodies: Sequence[bytes]) -> None:
    """A few long prompts before measuring: the gateway's long path (threads, pools) is up."""
    ended = asyncio.Event()
    ended.set()
    await _send_flood(url, bodies, FLOOD_RATE_PER_S, len(bodies) / FLOOD_RATE_PER_S, ended)


# -- output -------------------------------------------------------------------------------------


def report(run: IsolationRun) -> list[str]:
    """The two phase tables, the flood's counts and the ratios."""
    lines = [f"flood: distinct prompts of {run.prompt_tokens} tokens (prompt 0, HF tokenizer + "
             f"chat template) at {FLOOD_RATE_PER_S:g}/s, open loop", table(CASE, run.quiet), "",
             table(FLOOD_CASE, run.flood)]
    for name, why in run.skipped.items():
        lines.append(f"  skipped {name}: {why.splitlines()[0]}")
    for name in dict.fromkeys(p.round.target for p in run.phases):
        floods = [p for p in run.phases if p.round.target == name and p.flood is not None]
        if not floods:
            continue
        fl = [p.flood for p in floods if p.flood is not None]
        latency = statistics.median([x.p50_ms for x in fl if x.ok] or [float("nan")])
        sent = sum(x.sent for x in fl)
        sender_ms = sum(p.sender_cpu_s for p in floods) * 1000 / sent if sent else float("nan")
        lines.append(f"  flood to {name:<20} sent {sent}, answered "
                     f"{sum(x.ok for x in fl)}, failed {sum(x.failed for x in fl)}, unfinished "
                     f"{sum(x.unfinished for x in fl)}; long p50 {latency:.0f} ms; "
                     f"sender CPU {sender_ms:.1f} ms per long prompt")
    lines += ["", f"{'short-chat added latency':<24}{'quiet p50':>10}{'flood p50':>10}"
              f"{'ratio':>7}{'quiet p99':>10}{'flood p99':>10}{'ratio':>7}"
              f"{'router us/req q/f':>19}{'ms/long':>9}"]
    for i in run.isolations:
        cpu = (f"{_num(i.quiet_router_cpu_us_per_request, '.0f')}/"
               f"{_num(i.flood_router_cpu_us_per_request, '.0f')}")
        lines.append(f"{i.target:<24}{i.quiet_added_p50_ms:>+10.1f}{i.flood_added_p50_ms:>+10.1f}"
                     f"{_num(i.ratio_p50, '.2f'):>7}{i.quiet_added_p99_ms:>+10.1f}"
                     f"{i.flood_added_p99_ms:>+10.1f}{_num(i.ratio_p99, '.2f'):>7}{cpu:>19}"
                     f"{_num(i.router_cpu_ms_per_long_prompt, '.0f'):>9}")
    return lines


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def plot(run: IsolationRun, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    names = [i.target for i in run.isolations]
    x = range(len(names))
    for k, (label, values) in enumerate((
            ("quiet p50", [i.quiet_added_p50_ms for i in run.isolations]),
            ("flood p50", [i.flood_added_p50_ms for i in run.isolations]),
            ("quiet p99", [i.quiet_added_p99_ms for i in run.isolations]),
            ("flood p99", [i.flood_added_p99_ms for i in run.isolations]))):
        left.bar([j + (k - 1.5) * 0.2 for j in x], values, 0.2, label=label,
                 color=f"C{k // 2}", alpha=1.0 if "flood" in label else 0.5)
    for j, i in enumerate(run.isolations):
        for k, quiet in ((0, i.quiet_added_p50_ms), (2, i.quiet_added_p99_ms)):
            left.hlines(RATIO_GOAL * quiet, j + (k - 0.5) * 0.2 - 0.1, j + (k - 0.5) * 0.2 + 0.1,
                        colors="red", linewidth=1.0)
    left.set_xticks(list(x), names, fontsize=7)
    left.set_ylabel("short-chat added ms vs direct")
    left.set_title(f"{CASE.description}; flood {run.prompt_tokens}-token prompts at "
                   f"{FLOOD_RATE_PER_S:g}/s (red: {RATIO_GOAL:g}x quiet)", fontsize=8)
    left.legend(fontsize=7)
    right.bar([j - 0.2 for j in x], [i.quiet_router_cpu_us_per_request or 0.0
                                     for i in run.isolations], 0.4, label="quiet", color="C3",
              alpha=0.5)
    right.bar([j + 0.2 for j in x], [i.flood_router_cpu_us_per_request or 0.0
                                     for i in run.isolations], 0.4, label="flood", color="C3")
    right.set_xticks(list(x), names, fontsize=7)
    right.set_ylabel("router CPU us per short request")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
