"""Benchmark: what a router costs in front of a model server, kvgate side by side with the Rust
routers, in one run.

Steps, for each case: start the no-op backend (``gateway.bench.noop``) with the case's model
time, and every target in front of it on loopback: ``direct`` (no router), kvgate (round_robin
with the ``simple`` tokenizer, and kv_aware with the exact HF tokenizer and chat template of
``.cache/tiny-llama``; each as 1 process and as ``--processes N``), vllm-router (round_robin)
and sglang-router (round_robin and cache_aware). Warm each up, then run ``--rounds`` rounds of
the same load against every target, the order rotated each round so that drift (other load,
thermal, the page cache) hits every target alike. Targets that cannot start are skipped with
the reason (a missing binary, a ``kvgate serve`` without ``--processes``); the run goes on.

Cases (``--case``, all but ``isolation`` by default):

- ``short``: 0 ms backend, wrk at 32 connections, a small non-streaming chat: the router's CPU
  per request, undiluted;
- ``delay20``: 20 ms backend, wrk at 128 connections: a fleet's worth of short chats;
- ``stream``: 256 concurrent streams of 64 chunks 10 ms apart (decode steps shared by all
  streams, as in a vLLM engine step), from a lean aiohttp client in this process that splits
  the SSE stream and counts content events without parsing JSON: TTFT p50/p99 and TPOT p50
  (wrk cannot see the first token);
- ``isolation`` (only when named): short chats at a 20 ms backend, c=16, without and with a
  flood of distinct ~128K-token prompts at 2/s to a second pool: the added latency of each
  phase, their ratio (target <= 1.2x) and the CPU per short request (``gateway.bench.isolation``).

How to read the table (one per case; medians over rounds):

- ``ratio``: req/s through the target / req/s direct. ``+p50``/``+p99``: latency added to direct's
  (for ``stream``: end to end of a whole stream; TTFT and TPOT have their own columns).
- ``router/backend/loadgen us/req``: CPU microseconds per request (user + system, from
  ``/proc/PID/stat``, summed over the process tree: kvgate's supervisor and its children, each
  process's threads; children that exited count through their parent's ``cutime``/``cstime``),
  taken before and after each round and divided by the requests served in it. wrk's CPU comes
  from ``getrusage(RUSAGE_CHILDREN)`` around it; the streaming client's from
  ``getrusage(RUSAGE_SELF)``. ``cores r/b/l/o`` is the same CPU divided by the round's wall
  time, and ``o`` the rest of the machine's busy CPU (``/proc/stat``: other processes, this
  benchmark's own bookkeeping): where the cores went. When they add up to the core count, the
  machine, not the router, set the throughput: read the CPU per request then, not the ratio; a
  large ``o`` means the machine was not quiet.
- The streaming client is not the bottleneck when its ``cores`` stay well under one (it is one
  Python thread) and direct's TPOT p50 stays at the backend's interval (10 ms): both printed.

What it predicts for a bigger gateway node: CPU per request is the figure that transfers. A
gateway process that spends C microseconds of CPU per request serves at most 1e6 / C requests per
second per core (``req/s/core``), so a 16-core gateway node running ``--processes 16`` tops out
near 16e6 / C req/s (printed for every router from the ``short`` case; an upper bound: it assumes
the processes scale linearly and the backends and clients run elsewhere). The ratio on this
2-core machine does not transfer: the backend and the load generator share the cores.

Targets (printed met / missed / not run, every one, from the same run): kvgate kv_aware + HF at
``delay20`` keeps >= 0.9 of direct's throughput with added p99 <= 10 ms; its CPU per ``short``
request <= 2x vllm-router's; its ``stream`` TTFT p99 <= 1.2x the best Rust router's; kvgate with N
processes does not lose to 1 process (req/s, each case and configuration).

Output: the tables, ``overhead.json`` (every round, every summary, the verdicts) and
``overhead.png`` under ``--out``; the logs and configs of every process under ``--out``/logs.

Run (the full comparison takes about 17 minutes with the defaults):
``python -m gateway.bench.overhead [--case short|delay20|stream|isolation ...]
[--target NAME ...] [--duration-s 10] [--rounds 3] [--processes N] [--out results/overhead]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import aiohttp
import orjson

from gateway.bench.stats import percentile
from gateway.procs.kvgate import GatewayProcess, noop_backend, serve_accepts_processes
from gateway.procs.net import LOOPBACK, Ports, free_port
from gateway.procs.peers import SGLANG_ROUTER, VLLM_ROUTER, PeerRouter
from gateway.procs.process import ManagedProcess, ProcessSet, StartError
from gateway.procs.vllm import tiny_model_path
from gateway.upstream.sse import SSESplitter

MODEL = "noop"
PROMPT = "Say hello to the gateway benchmark, please."
CHAT_BODY = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16}
STREAM_BODY = {**CHAT_BODY, "stream": True, "stream_options": {"include_usage": True}}
LUA = f"""
wrk.method = "POST"
wrk.body = '{json.dumps(CHAT_BODY, separators=(",", ":"))}'
wrk.headers["Content-Type"] = "application/json"
"""
WARMUP_S = 2
START_TIMEOUT_S = 90.0
CLIENT_BUSY_CORES = 0.8
"""Above this the streaming client (one Python thread) may be what limits the streams."""
T = TypeVar("T")


# -- what is measured -------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    backend_delay_ms: float
    concurrency: int
    description: str
    stream_chunks: int = 0
    """0: non-streaming chats from wrk; else streams of this many content chunks."""
    chunk_interval_ms: float = 0.0

    @property
    def streaming(self) -> bool:
        return self.stream_chunks > 0


CASES = (
    Case("short", 0.0, 32, "0 ms backend, wrk c=32, small non-streaming chat"),
    Case("delay20", 20.0, 128, "20 ms backend, wrk c=128, small non-streaming chat"),
    Case("stream", 0.0, 256, "256 concurrent streams of 64 chunks 10 ms apart",
         stream_chunks=64, chunk_interval_ms=10.0),
)
ISOLATION = "isolation"
"""The case of ``gateway.bench.isolation`` (short chats while 128K-token prompts flood the
gateway): run only when asked for by name."""


@dataclass(frozen=True)
class Target:
    name: str
    description: str
    kind: Literal["direct", "kvgate", "peer"]
    policy: str = ""
    tokenizer: str = ""
    """kvgate: ``simple`` or ``hf`` (the tiny model's tokenizer and chat template)."""
    processes: int = 1
    peer: PeerRouter | None = None


def targets(processes: int) -> list[Target]:
    """Every target, in the order of the tables."""
    out = [Target("direct", "the no-op backend itself", "direct")]
    for policy, tok, label in (("round_robin", "simple", "rr_simple"), ("kv_aware", "hf", "kv_hf")):
        for n in sorted({1, processes}):
            out.append(Target(f"kvgate_{label}_p{n}",
                              f"kvgate {policy}, {tok} tokenizer, {n} process(es)",
                              "kvgate", policy, tok, n))
    out.append(Target("vllm_router_rr", "vllm-router round_robin", "peer", "round_robin",
                      peer=VLLM_ROUTER))
    for policy in ("round_robin", "cache_aware"):
        out.append(Target(f"sglang_{'rr' if policy == 'round_robin' else policy}",
                          f"sglang-router {policy}", "peer", policy, peer=SGLANG_ROUTER))
    return out


@dataclass(frozen=True)
class Load:
    """What the load generator saw in one round."""

    requests: int
    errors: int
    """Non-2xx answers, socket errors, streams without content or without ``[DONE]``."""
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    tpot_p50_ms: float | None = None


@dataclass(frozen=True)
class Round:
    case: str
    target: str
    index: int
    load: Load
    wall_s: float
    router_cpu_s: float | None
    """None for ``direct``."""
    backend_cpu_s: float
    loadgen_cpu_s: float
    machine_cpu_s: float
    """Busy CPU of the whole machine (all cores) during the round."""


@dataclass(frozen=True)
class Summary:
    """One target in one case: medians over rounds; CPU summed over rounds / requests."""

    case: str
    target: str
    rounds: int
    requests: int
    errors: int
    requests_per_s: float
    ratio: float | None
    p50_ms: float
    p99_ms: float
    added_p50_ms: float | None
    added_p99_ms: float | None
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    router_cpu_us_per_request: float | None
    backend_cpu_us_per_request: float
    loadgen_cpu_us_per_request: float
    router_cores: float | None
    backend_cores: float
    loadgen_cores: float
    other_cores: float

    @property
    def requests_per_s_per_core(self) -> float | None:
        c = self.router_cpu_us_per_request
        return 1e6 / c if c else None


@dataclass(frozen=True)
class Verdict:
    goal: str
    target: str
    met: bool | None
    """None: not evaluated (a target it needs did not run)."""
    detail: str


# -- CPU accounting from /proc ------------------------------------------------------------------

CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ProcStat:
    pid: int
    ppid: int
    cpu_ticks: int
    """utime + stime + cutime + cstime: the process, its threads, its reaped children."""


def parse_proc_stat(text: str) -> ProcStat:
    """One ``/proc/PID/stat`` line. The command name (field 2) may hold spaces and parentheses,
    so the fields are counted from its last ``)``."""
    pid = int(text[:text.index(" ")])
    rest = text[text.rindex(")") + 2:].split()
    # rest[0] is field 3 (state): ppid is field 4, utime..cstime are fields 14..17
    return ProcStat(pid, int(rest[1]), sum(int(x) for x in rest[11:15]))


def descendants(parents: Mapping[int, int], root: int) -> set[int]:
    """``root`` and every process below it, from a pid -> ppid map."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in tree:
            tree.add(pid)
            todo.extend(children.get(pid, ()))
    return tree


def read_proc_stats(proc: Path = Path("/proc")) -> dict[int, ProcStat]:
    """Every process's stat now; processes that end while being read are left out."""
    stats: dict[int, ProcStat] = {}
    for entry in proc.iterdir():
        if entry.name.isdigit():
            try:
                stats[int(entry.name)] = parse_proc_stat((entry / "stat").read_text())
            except (OSError, ValueError, IndexError):
                continue
    return stats


def tree_cpu_s(stats: Mapping[int, ProcStat], root: int) -> float:
    """CPU seconds of ``root``'s process tree so far."""
    tree = descendants({pid: s.ppid for pid, s in stats.items()}, root)
    return sum(stats[pid].cpu_ticks for pid in tree if pid in stats) / CLOCK_TICKS_PER_S


def parse_machine_busy_ticks(text: str) -> int:
    """Busy ticks of all cores from ``/proc/stat``: its ``cpu`` line less idle and iowait (guest
    time is already inside user)."""
    line = next(ln for ln in text.splitlines() if ln.startswith("cpu "))
    ticks = [int(x) for x in line.split()[1:9]]  # user nice system idle iowait irq softirq steal
    return sum(ticks) - ticks[3] - ticks[4]


def machine_cpu_s(stat: Path = Path("/proc/stat")) -> float:
    return parse_machine_busy_ticks(stat.read_text()) / CLOCK_TICKS_PER_S


def rusage_cpu_s(who: int) -> float:
    ru = resource.getrusage(who)
    return ru.ru_utime + ru.ru_stime


# -- load generators ----------------------------------------------------------------------------


def _ms(value: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m)", value)
    if not m:
        raise ValueError(f"not a wrk duration: {value!r}")
    scale = {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60_000.0}[m.group(2)]
    return float(m.group(1)) * scale


def _field(pattern: str, out: str) -> re.Match[str]:
    m = re.search(pattern, out, re.M)
    if m is None:
        raise ValueError(f"wrk output without {pattern!r}:\n{out}")
    return m


def parse_wrk(out: str) -> Load:
    """wrk's ``--latency`` report."""
    requests = int(_field(r"^\s*(\d+) requests in", out).group(1))
    rps = float(_field(r"^Requests/sec:\s+([\d.]+)", out).group(1))
    p50 = _ms(_field(r"^\s+50%\s+(\S+)", out).group(1))
    p99 = _ms(_field(r"^\s+99%\s+(\S+)", out).group(1))
    errors = 0
    if m := re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out):
        errors += int(m.group(1))
    if m := re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out):
        errors += sum(int(x) for x in m.groups())
    return Load(requests, errors, rps, p50, p99)


def wrk_argv(url: str, duration_s: int, connections: int, script: Path) -> list[str]:
    """wrk posting ``script``'s chat to ``url`` for ``duration_s`` with a latency report."""
    return ["wrk", "-t1", f"-c{connections}", f"-d{duration_s}s", "--latency", "-s", str(script),
            f"{url}/v1/chat/completions"]


def run_wrk(url: str, duration_s: int, connections: int, script: Path) -> Load:
    out = subprocess.run(wrk_argv(url, duration_s, connections, script),
                         check=True, capture_output=True, text=True).stdout
    return parse_wrk(out)


@dataclass(frozen=True)
class StreamTiming:
    """One stream as the client saw it; times in seconds from sending."""

    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float
    ok: bool


CONTENT = b'"content":"'
EMPTY_CONTENT = b'"content":""'


class StreamClock:
    """Times one SSE stream from its bytes: content events are counted with two substring
    searches per block of whole events (the role chunk and the end-of-sequence chunk carry empty
    content and do not count), no JSON is parsed."""

    def __init__(self, sent_s: float) -> None:
        self.sent_s = sent_s
        self._split = SSESplitter()
        self.first_s: float | None = None
        self.last_s: float | None = None
        self.contents = 0
        self.done = False

    def feed(self, data: bytes, now_s: float) -> None:
        block = self._split.feed_block(data)
        if not block:
            return
        n = block.count(CONTENT) - block.count(EMPTY_CONTENT)
        if n > 0:
            if self.first_s is None:
                self.first_s = now_s
            self.last_s = now_s
            self.contents += n
        if b"data: [DONE]" in block:
            self.done = True

    def timing(self, end_s: float) -> StreamTiming:
        ttft = None if self.first_s is None else self.first_s - self.sent_s
        tpot = None
        if self.contents >= 2 and self.first_s is not None and self.last_s is not None:
            tpot = (self.last_s - self.first_s) / (self.contents - 1)
        return StreamTiming(ttft, tpot, end_s - self.sent_s,
                            self.done and self.first_s is not None)


async def _streams(url: str, concurrency: int, duration_s: float) -> tuple[list[StreamTiming],
                                                                          float]:
    body = orjson.dumps(STREAM_BODY)
    timings: list[StreamTiming] = []
    clock = time.perf_counter
    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=concurrency)
    async with aiohttp.ClientSession(
            connector=connector, headers={"Content-Type": "application/json"},
            timeout=aiohttp.ClientTimeout(total=120, sock_connect=10)) as session:
        started = clock()
        deadline = started + duration_s

        async def one() -> None:
            s = StreamClock(clock())
            try:
                async with session.post(url + "/v1/chat/completions", data=body) as resp:
                    if resp.status == 200:
                        async for data in resp.content.iter_any():
                            s.feed(data, clock())
                    else:
                        await resp.read()
            except (aiohttp.ClientError, TimeoutError):
                s.done = False
            timings.append(s.timing(clock()))

        async def user() -> None:
            # at least one stream each: a loop that starts late (a starved machine) still
            # measures something
            await one()
            while clock() < deadline:
                await one()

        await asyncio.gather(*(user() for _ in range(concurrency)))
        return timings, clock() - started


def stream_load(timings: Sequence[StreamTiming], wall_s: float) -> Load:
    """The streams of one round, summed up: every stream started counts, failed ones as errors."""
    ok = [t for t in timings if t.ok]
    ttft = [t.ttft_s * 1000 for t in ok if t.ttft_s is not None]
    tpot = [t.tpot_s * 1000 for t in ok if t.tpot_s is not None]
    e2e = [t.e2e_s * 1000 for t in ok]
    return Load(len(timings), len(timings) - len(ok), len(ok) / wall_s if wall_s > 0 else 0.0,
                percentile(e2e, 0.5), percentile(e2e, 0.99),
                percentile(ttft, 0.5), percentile(ttft, 0.99), percentile(tpot, 0.5))


def run_streams(url: str, concurrency: int, duration_s: float) -> Load:
    import uvloop

    timings, wall_s = uvloop.run(_streams(url, concurrency, duration_s))
    return stream_load(timings, wall_s)


# -- one case: start, warm up, rounds -----------------------------------------------------------


@dataclass(frozen=True)
class Running:
    target: Target
    url: str
    proc: ManagedProcess | None
    """The router's root process (None for ``direct``)."""
    version: str | None = None

    def about(self) -> dict[str, str | None]:
        """What the JSON records of it: enough to run it again by hand."""
        return {"description": self.target.description, "url": self.url,
                "command": None if self.proc is None else self.proc.command,
                "version": self.version}


def kvgate_config(target: Target, backend_url: str, port: int, hf_tokenizer: Path,
                  long_pool: tuple[str, int] | None = None) -> dict[str, Any]:
    """One pool of ``backend_url`` (8K tokens); with ``long_pool`` (a backend URL and its context
    limit in tokens) a second pool ``long`` for prompts too long for the first."""
    tokenizer = str(hf_tokenizer) if target.tokenizer == "hf" else "simple"
    pools = [{"name": "fleet", "max_context_tokens": 8192, "policy": target.policy,
              "workers": [{"url": backend_url}]}]
    if long_pool is not None:
        url, max_context_tokens = long_pool
        pools.append({"name": "long", "max_context_tokens": max_context_tokens,
                      "policy": target.policy, "workers": [{"url": url}]})
    return {
        "listen": {"host": LOOPBACK, "port": port},
        "models": [{"name": MODEL, "tokenizer": tokenizer}],
        "pools": pools,
    }


def start_target(procs: ProcessSet, ports: Ports, target: Target, backend_url: str,
                 hf_tokenizer: Path, peer_binaries: Mapping[str, str | None],
                 long_pool: tuple[str, int] | None = None) -> Running:
    """``target`` started in front of ``backend_url``; kvgate with ``long_pool`` as
    ``kvgate_config`` says."""
    if target.kind == "direct":
        return Running(target, backend_url, None)
    if target.kind == "kvgate":
        accepts = serve_accepts_processes()
        if target.processes > 1 and not accepts:
            raise StartError("kvgate serve of this checkout does not accept --processes yet")
        port = ports.take()
        gw = GatewayProcess(kvgate_config(target, backend_url, port, hf_tokenizer, long_pool),
                            procs.log_dir / f"{target.name}.yaml", port=port,
                            processes=target.processes if accepts else None)
        procs.start(target.name, gw, timeout_s=START_TIMEOUT_S)
        return Running(target, gw.url, gw)
    assert target.peer is not None
    binary = target.peer.find(peer_binaries.get(target.peer.command))
    if binary is None:
        raise target.peer.missing()
    port = ports.take()
    proc = target.peer.process(binary, port, ports.take(), [backend_url], MODEL, target.policy)
    procs.start(target.name, proc, timeout_s=START_TIMEOUT_S)
    return Running(target, f"http://{LOOPBACK}:{port}", proc, target.peer.version(binary))


def offer_load(case: Case, url: str, duration_s: float, script: Path) -> Load:
    if case.streaming:
        return run_streams(url, case.concurrency, duration_s)
    return run_wrk(url, max(1, round(duration_s)), case.concurrency, script)


def measure(case: Case, running: Running, backend: ManagedProcess, index: int,
            duration_s: float, script: Path) -> Round:
    """One round against one target, with the CPU of router, backend and load generator."""
    who = resource.RUSAGE_SELF if case.streaming else resource.RUSAGE_CHILDREN
    before, machine_before = read_proc_stats(), machine_cpu_s()
    load_before, t0 = rusage_cpu_s(who), time.perf_counter()
    load = offer_load(case, running.url, duration_s, script)
    load_after, wall = rusage_cpu_s(who), time.perf_counter() - t0
    after, machine_after = read_proc_stats(), machine_cpu_s()
    router = None
    if running.proc is not None:
        router = tree_cpu_s(after, running.proc.pid) - tree_cpu_s(before, running.proc.pid)
    return Round(case.name, running.target.name, index, load, wall, router,
                 tree_cpu_s(after, backend.pid) - tree_cpu_s(before, backend.pid),
                 load_after - load_before, machine_after - machine_before)


def rotated(items: Sequence[T], index: int) -> list[T]:
    """Round ``index``'s order: each round starts one target later."""
    k = index % len(items) if items else 0
    return [*items[k:], *items[:k]]


@dataclass(frozen=True)
class CaseRun:
    case: Case
    rounds: list[Round]
    started: dict[str, dict[str, str | None]]
    skipped: dict[str, str]


def run_case(case: Case, chosen: Sequence[Target], args: argparse.Namespace,
             log_dir: Path) -> CaseRun:
    skipped: dict[str, str] = {}
    log_dir.mkdir(parents=True, exist_ok=True)
    with ProcessSet(log_dir) as procs:
        script = log_dir / "post.lua"
        script.write_text(LUA)
        ports = Ports(free_port())
        noop, backend_url = noop_backend(
            ports.take(), case.backend_delay_ms,
            stream_chunks=max(case.stream_chunks, 1), chunk_interval_ms=case.chunk_interval_ms)
        procs.start("noop", noop, timeout_s=START_TIMEOUT_S)
        running: list[Running] = []
        for target in chosen:
            try:
                running.append(start_target(procs, ports, target, backend_url,
                                            args.hf_tokenizer, vars(args)))
            except StartError as exc:
                skipped[target.name] = str(exc).strip()
                procs.stop(target.name)
                print(f"overhead: {case.name}: {target.name} skipped: "
                      f"{str(exc).strip().splitlines()[0]}", flush=True)
        for r in running:
            offer_load(case, r.url, WARMUP_S, script)
        rounds: list[Round] = []
        for i in range(args.rounds):
            for r in rotated(running, i):
                rnd = measure(case, r, noop, i, args.duration_s, script)
                rounds.append(rnd)
                print(f"overhead: {case.name} round {i + 1}/{args.rounds} {r.target.name:<20} "
                      f"{rnd.load.requests_per_s:9.0f} req/s  errors {rnd.load.errors}",
                      flush=True)
    return CaseRun(case, rounds, {r.target.name: r.about() for r in running}, skipped)


# -- summaries and verdicts ---------------------------------------------------------------------


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
        backend_cpu = sum(r.backend_cpu_s for r in rs)
        load_cpu = sum(r.loadgen_cpu_s for r in rs)
        other_cpu = sum(r.machine_cpu_s for r in rs) - (router_cpu or 0.0) - backend_cpu - load_cpu
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


# -- output -------------------------------------------------------------------------------------


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
    return [f"  {s.target:<22} {s.router_cpu_us_per_request:6.0f} us/req -> "
            f"{1e6 / s.router_cpu_us_per_request:8.0f} req/s per core, "
            f"~{cores * 1e6 / s.router_cpu_us_per_request:9.0f} req/s on {cores} cores"
            for s in summaries if s.case == "short" and s.router_cpu_us_per_request]


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


# -- command line -------------------------------------------------------------------------------


def finite(value: Any) -> Any:
    """``value`` with NaN (a percentile of nothing) as None, so the JSON is standard."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    names = [t.name for t in targets(2)]
    parser.add_argument("--case", action="append",
                        choices=[*(c.name for c in CASES), ISOLATION],
                        help=f"a case to run (repeatable); default: all but {ISOLATION}")
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
    cases = [c for c in CASES if not args.case or c.name in args.case]
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
        # imported here: the isolation case is built from this module's pieces
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
    for line in prediction(summaries) or ["  (the short case did not run)"]:
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


if __name__ == "__main__":
    raise SystemExit(main())
