"""Benchmark: kvgate's routing against competing routers on the same workers, one command each.

``python -m gateway.bench.routers --scenario NAME`` starts the workers, starts every contender in
front of them, runs ``kvgate bench``'s load generator against each contender in turn (same
requests, same arrival schedule, every worker's prefix cache reset before each contender, a fresh
prompt salt per contender), computes the hit-rate ceiling, prints one table per workload, checks
the issue's targets, stops everything it started, and writes under ``results/routers/NAME/``:
``routers.json`` (every number, the exact commands, skipped contenders and why), ``routers.png``
(hit rate against the ceiling, TTFT p50/p99 per contender; ``--replot`` redraws it from the
JSON), per workload ``WORKLOAD/bench.json`` and ``WORKLOAD/latency_cdf.png`` (``kvgate bench``'s
own files), and every process's log and every gateway's config under ``logs/``.

Scenarios (each about 5-10 minutes on 2 cores; ``--quick`` for a smoke run):

* ``vllm``: two real vLLM CPU servers (``.venv-vllm``, the tiny model in ``.cache/tiny-llama``,
  32-token blocks, KV events, one core each, a KV cache held to 192 blocks (6K tokens) per
  server with ``--num-gpu-blocks-override`` so that one server cannot hold all eight 1K-token
  prefixes but the two together can); shared-prefix (320 requests, 32-token questions), closed
  loop, 4 users, ``max_tokens`` 8. About 2 minutes.
* ``sim16``: sixteen simulated H100s (``kvgate sim`` in 4 processes, llama-3-8b@h100, 1,024
  16-token blocks per worker, ``--time-scale 8``: the modelled GPU runs 8x slower than real
  time so the 2 cores keep up; wall-clock TTFTs are 8x the modelled ones, ratios are not
  affected); shared-prefix (32 prefixes of 2K tokens, open loop 24 req/s: one worker holds 8
  prefixes, the fleet all of them many times over) and multiturn (the bench's default sessions,
  48 of them x 8 turns, 48 users, 64-token answers). About 7.5 minutes.
* ``isolation``: eight simulated H100s (time scale 2); the mixed workload (10 req/s, a quarter
  of them 16K-token prompts, the rest 200-token chats) against (a) two pools, 4 short-chat + 4
  long-context workers, (b) one pool of the same 8 workers, kv_aware, and (c) that pool with
  round_robin; then the short chats alone at the same short-chat rate (7.5 req/s). The target
  is (a)'s short-chat TTFT p99 with the flood within 1.2x of its value without. About 5
  minutes.

Contenders (``--contenders`` picks some):

* ``kvgate_kv``: ``kvgate serve``, policy ``kv_aware``, KV events from every worker (precise);
* ``kvgate_approx``: ``kv_aware`` without event endpoints (the gateway's routing history only);
* ``kvgate_rr``: ``round_robin``, the baseline;
* ``sglang_cache_aware``: SGLang's model gateway (PyPI ``sglang-router``), ``--policy cache_aware``;
* ``vllm_router_cache_aware``: PyPI ``vllm-router``, ``--policy cache_aware``.

The two Rust routers live in their own virtual environments, never the gateway's::

    python3 -m venv /work/tmp/venv-sglang && /work/tmp/venv-sglang/bin/pip install sglang-router
    python3 -m venv /work/tmp/venv-vllm-router && \\
        /work/tmp/venv-vllm-router/bin/pip install vllm-router

and are found through ``--sglang-router`` / ``--vllm-router``, ``$KVGATE_SGLANG_ROUTER`` /
``$KVGATE_VLLM_ROUTER``, ``PATH``, or those two venvs. A contender that is not installed or does
not start is recorded with the reason (its log's tail) and the run goes on without it.

The ceiling: every request of a contender's run sent, in the order it was sent, to one cache that
never evicts, with vLLM's rules (full blocks only, chained hashes, a fully cached prompt still
recomputes its last token). ``ceiling()`` does that on the token ids the gateway's tokenizer
gives for the exact bodies sent (salt included), at the workers' block size. It ignores that two
requests in flight together cannot share blocks neither has computed yet, so it is an upper bound.

TTFT p99 over all requests is, with a few dozen prefixes or sessions, the TTFT of the requests
that are *cold by construction* (the first of each prefix, every session's first turn: even the
ceiling's cache hits less than half of them) and compares cold starts, not routing; the tables
also give the *warm* p99, over the other requests, and the targets are checked on both.

Hit rates are the workers' own counters (``vllm:prefix_cache_hits_total`` /
``..._queries_total``, in tokens) read before and after each contender. For the kvgate gateways
the run also records ``kvgate_routing_decisions_total`` by reason and requests per worker; for
every contender, the prompt tokens each worker was asked for (its load share).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import dataclasses
import importlib.metadata
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from gateway.bench.loadgen import (
    LoadSpec,
    Progress,
    Target,
    build_body,
    calibrate_tokens_per_word,
    run_target,
)
from gateway.bench.report import (
    TargetReport,
    build_report,
    compare_table,
    group_table,
    plot_cdfs,
    target_footer,
    target_header,
    to_json,
    write_json,
)
from gateway.bench.stats import Summary, distribution
from gateway.bench.workloads import Workload, WorkloadSpec, build_workload
from gateway.kvindex.hashing import BlockHash, block_hashes
from gateway.prompt.tokenizer import PromptTokenizer, load_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]
KVGATE_CONTENDERS = ("kvgate_kv", "kvgate_approx", "kvgate_rr")
PEER_CONTENDERS = ("sglang_cache_aware", "vllm_router_cache_aware")
CONTENDERS = KVGATE_CONTENDERS + PEER_CONTENDERS
COMPETITORS = PEER_CONTENDERS
"""The other routers: 'best competitor' in the targets means the best of these."""
SIM_MODEL = "sim-llama-3-8b"
VLLM_MODEL = "tiny"
STOP_GRACE_S = 15.0
LOG_TAIL_LINES = 25


# == pure parts =================================================================================


@dataclass(frozen=True)
class CacheCount:
    """Prefix-cache lookups in tokens, as vLLM counts them."""

    queries_tokens: int
    hits_tokens: int

    @property
    def hit_rate(self) -> float | None:
        return self.hits_tokens / self.queries_tokens if self.queries_tokens else None


def ceiling(prompts: Iterable[Sequence[int]], block_size_tokens: int) -> CacheCount:
    """Hits of ``prompts``, in order, on one prefix cache that never evicts.

    vLLM's rules: a prompt queries all its tokens; it hits its longest run of leading full blocks
    already cached, but at most ``(len - 1) // block_size`` blocks (the last token is always
    computed, so a fully cached prompt re-computes its last block's worth); afterwards all its
    full blocks are cached. Only prompt tokens count: generated tokens never match the next
    prompt's text unless it carries the real answer, which the workloads here do not.
    """
    queries = hits = 0
    for n_tokens, hit in ceiling_hits(prompts, block_size_tokens):
        queries += n_tokens
        hits += hit
    return CacheCount(queries, hits)


def ceiling_hits(prompts: Iterable[Sequence[int]], block_size_tokens: int
                 ) -> Iterator[tuple[int, int]]:
    """Per prompt, (prompt tokens, tokens hit) on the never-evicting cache of ``ceiling``."""
    cached: set[BlockHash] = set()
    for ids in prompts:
        hashes = block_hashes(ids, block_size_tokens)
        usable = max(0, (len(ids) - 1) // block_size_tokens)
        matched = 0
        for h in hashes[:usable]:
            if h not in cached:
                break
            matched += 1
        cached.update(hashes)
        yield len(ids), matched * block_size_tokens


def sent_prompts(workload: Workload, records: Iterable[Any], load: LoadSpec,
                 tokenizer: PromptTokenizer) -> Iterator[list[int]]:
    """Token ids of the requests a run sent (salt included), in the order they were sent.

    ``records`` are ``RequestRecord``s (or anything with ``index``, ``sent_s`` and ``status``);
    requests that got no HTTP response never reached a worker and are left out.
    """
    by_index = {r.index: r for r in workload.all_requests()}
    for rec in sent_in_order(records):
        request = by_index[rec.index]
        body = build_body(request, request.messages, load)
        if load.api == "chat":
            yield tokenizer.encode_chat(body["messages"], body)
        else:
            yield tokenizer.encode_text(body["prompt"])


def sent_in_order(records: Iterable[Any]) -> list[Any]:
    """The records of requests that reached a server (got an HTTP status), in send order."""
    return sorted((r for r in records if r.status != 0), key=lambda r: (r.sent_s, r.index))


WARM_MIN_CEILING_SHARE = 0.5


def warm_ttft_ms(records: Iterable[Any], per_prompt: Sequence[tuple[int, int]]
                 ) -> dict[str, float | None]:
    """TTFT p50/p99 (ms) of the successful requests that are not cold by construction.

    A request is *cold by construction* when even the never-evicting cache of ``ceiling`` hits
    less than half its prompt: the first request of a shared prefix, a session's first turn. No
    router can make those hits, and with a few dozen prefixes or sessions they alone make up the
    last percent of TTFT, so p99 over all requests compares cold starts, not routing. The warm
    p99 leaves them out. ``per_prompt`` is ``ceiling_hits`` in ``sent_in_order(records)`` order.
    """
    sent = sent_in_order(records)
    xs = [r.ttft_s for r, (n, hit) in zip(sent, per_prompt, strict=True)
          if n and hit >= WARM_MIN_CEILING_SHARE * n and r.error is None
          and r.ttft_s is not None]
    d = distribution(xs)
    return {"warm_requests": len(xs),
            "warm_ttft_p50_ms": None if d is None else d.p50 * 1000,
            "warm_ttft_p99_ms": None if d is None else d.p99 * 1000}


def parse_counter(text: str, name: str, labels: Sequence[str]) -> dict[tuple[str, ...], float]:
    """Samples of counter ``name`` (``_total`` suffix included) keyed by the given label values."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, ...], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                key = tuple(sample.labels.get(label, "") for label in labels)
                out[key] = out.get(key, 0.0) + sample.value
    return out


def counter_delta(before: Mapping[tuple[str, ...], float],
                  after: Mapping[tuple[str, ...], float]) -> dict[tuple[str, ...], float]:
    out: dict[tuple[str, ...], float] = {}
    for key, value in after.items():
        d = value - before.get(key, 0.0)
        if d > 0:
            out[key] = d
    return out


def load_spread(per_worker: Mapping[str, float]) -> float | None:
    """max / mean of per-worker load (1.0 = perfectly even)."""
    values = list(per_worker.values())
    if not values or sum(values) <= 0:
        return None
    return max(values) / (sum(values) / len(values))


@dataclass(frozen=True)
class Verdict:
    target: str
    value: float | None
    limit: float | None
    met: bool | None
    detail: str

    def line(self) -> str:
        state = {True: "met", False: "MISSED", None: "n/a"}[self.met]
        return f"  [{state:>6}] {self.target}: {self.detail}"


def at_most(target: str, value: float | None, limit: float | None, detail: str) -> Verdict:
    met = None if value is None or limit is None else value <= limit
    return Verdict(target, value, limit, met, detail)


def at_least(target: str, value: float | None, limit: float | None, detail: str) -> Verdict:
    met = None if value is None or limit is None else value >= limit
    return Verdict(target, value, limit, met, detail)


def hit_rate_verdicts(rows: Mapping[str, Mapping[str, Any]], ceiling_rate: float | None,
                      subject: str = "kvgate_kv") -> list[Verdict]:
    """Hit rate >= 95 % of the ceiling, and >= the best competitor's + 10 points."""
    mine = rows.get(subject, {}).get("hit_rate")
    out = [at_least(
        "hit rate >= 95% of the ceiling", mine,
        None if ceiling_rate is None else 0.95 * ceiling_rate,
        f"{subject} {_pct(mine)} vs ceiling {_pct(ceiling_rate)} = "
        f"{_ratio_text(mine, ceiling_rate, pct=True)} of it",
    )]
    rivals: dict[str, float] = {n: float(r["hit_rate"]) for n, r in rows.items()
                                if n in COMPETITORS and r.get("hit_rate") is not None}
    if rivals:
        best = max(rivals, key=lambda n: rivals[n])
        out.append(at_least(
            "hit rate >= best competitor + 10 points", mine, rivals[best] + 0.10,
            f"{subject} {_pct(mine)} vs {best} {_pct(rivals[best])}: "
            f"{_points(mine, rivals[best])}",
        ))
    else:
        out.append(Verdict("hit rate >= best competitor + 10 points", mine, None, None,
                           "no competitor ran"))
    return out


def ttft_verdicts(rows: Mapping[str, Mapping[str, Any]], subject: str = "kvgate_kv",
                  key: str = "ttft_p99_ms", label: str = "TTFT p99") -> list[Verdict]:
    """TTFT p99 <= 0.5x round robin's and <= 0.8x the best competitor's."""
    mine = rows.get(subject, {}).get(key)
    rr = rows.get("kvgate_rr", {}).get(key)
    out = [at_most(f"{label} <= 0.5x round robin", mine, None if rr is None else 0.5 * rr,
                   f"{subject} {_ms(mine)} vs kvgate_rr {_ms(rr)}: "
                   f"{_ratio_text(mine, rr)}")]
    rivals: dict[str, float] = {n: float(r[key]) for n, r in rows.items()
                                if n in COMPETITORS and r.get(key) is not None}
    if rivals:
        best = min(rivals, key=lambda n: rivals[n])
        out.append(at_most(f"{label} <= 0.8x best competitor", mine, 0.8 * rivals[best],
                           f"{subject} {_ms(mine)} vs {best} {_ms(rivals[best])}: "
                           f"{_ratio_text(mine, rivals[best])}"))
    else:
        out.append(Verdict(f"{label} <= 0.8x best competitor", mine, None, None,
                           "no competitor ran"))
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f} ms"


def _ratio_text(a: float | None, b: float | None, pct: bool = False) -> str:
    if a is None or b is None or b == 0:
        return "-"
    return f"{a / b:.1%}" if pct else f"{a / b:.2f}x"


def _points(a: float | None, b: float | None) -> str:
    if a is None or b is None:
        return "-"
    return f"{(a - b) * 100:+.1f} points"


def summary_row(report: TargetReport, ceiling_rate: float | None) -> dict[str, Any]:
    """The numbers of one contender on one workload that the table and the targets use."""
    s = report.summary
    rate = report.cache.hit_rate if report.cache else None
    return {
        "requests": s.requests, "ok": s.ok, "errors": dict(s.errors),
        "ttft_p50_ms": _q_ms(s, "p50"), "ttft_p99_ms": _q_ms(s, "p99"),
        "tpot_p50_ms": None if s.tpot_s is None else s.tpot_s.p50 * 1000,
        "e2e_p50_s": None if s.e2e_s is None else s.e2e_s.p50,
        "requests_per_s": s.requests_per_s, "output_tokens_per_s": s.output_tokens_per_s,
        "hit_rate": rate,
        "of_ceiling": None if rate is None or not ceiling_rate else rate / ceiling_rate,
        "duration_s": report.run.duration_s,
    }


def _q_ms(s: Summary, q: str) -> float | None:
    return None if s.ttft_s is None else float(getattr(s.ttft_s, q)) * 1000


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


# == processes ==================================================================================

_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the driver dies, so nothing outlives a run."""
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Processes:
    """Every process this driver starts, each in its own process group; ``stop_all`` ends them."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None
              ) -> subprocess.Popen[bytes]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path(name), "wb") as log:
            proc = subprocess.Popen(
                list(argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=dict(env) if env is not None else None, cwd=REPO_ROOT,
                start_new_session=True, preexec_fn=_die_with_parent,
            )
        self._procs.append((name, proc))
        return proc

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def tail(self, name: str, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path(name).read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, name: str) -> None:
        for n, proc in list(self._procs):
            if n == name:
                self._stop([proc])
                self._procs.remove((n, proc))

    def stop_all(self) -> None:
        procs = [p for _, p in reversed(self._procs)]
        self._procs.clear()
        self._stop(procs)

    @staticmethod
    def _stop(procs: Sequence[subprocess.Popen[bytes]]) -> None:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            while time.monotonic() < deadline and _group_alive(p.pid):
                time.sleep(0.1)  # vLLM's engine processes outlive the API server briefly
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class Ports:
    """Hands out loopback ports that are free now, in runs of consecutive ports when asked."""

    def __init__(self, start: int) -> None:
        self._next = start

    def take(self, count: int = 1) -> int:
        base = self._next
        while not all(_port_free(base + i) for i in range(count)):
            base += 1
            if base + count > 65000:
                raise RuntimeError("no free run of loopback ports")
        self._next = base + count
        return base


class StartError(RuntimeError):
    pass


def wait_until(check: Callable[[], bool], timeout_s: float, what: str,
               proc: subprocess.Popen[bytes] | None = None, interval_s: float = 0.5) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise StartError(f"{what}: exited with code {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError, OSError):
            if check():
                return
        if time.monotonic() > deadline:
            raise StartError(f"{what}: not ready after {timeout_s:.0f} s")
        time.sleep(interval_s)


def _status(url: str, timeout_s: float = 2.0) -> int:
    return httpx.get(url, timeout=timeout_s).status_code


def _healthy(url: str) -> Callable[[], bool]:
    return lambda: _status(url + "/health") == 200


# == workers ====================================================================================


@dataclass(frozen=True)
class Workers:
    kind: str
    """``sim`` or ``vllm``."""
    urls: list[str]
    events: list[tuple[str, str]]
    """Per worker: (KV event PUB endpoint, replay endpoint) for a subscriber to connect to."""
    model: str
    tokenizer: str
    """The gateway's tokenizer source for this model (the workers' own)."""
    architecture: str | None
    block_size_tokens: int
    max_model_len: int
    process_names: list[str]
    description: str
    commands: list[str] = field(default_factory=list)


def start_sim_workers(procs: Processes, ports: Ports, n: int, *, profile: str, time_scale: float,
                      num_gpu_blocks: int | None, processes: int, name: str = "sim",
                      max_num_batched_tokens: int | None = None) -> Workers:
    """``n`` simulated workers over ``processes`` ``kvgate sim`` processes (one event loop each)."""
    sizes = [n // processes + (1 if i < n % processes else 0) for i in range(processes)]
    sizes = [s for s in sizes if s > 0]
    urls: list[str] = []
    events: list[tuple[str, str]] = []
    names: list[str] = []
    commands: list[str] = []
    for i, size in enumerate(sizes):
        port = ports.take(size)
        ev = ports.take(2 * size)
        argv = [sys.executable, "-m", "gateway.cli", "sim", "--workers", str(size),
                "--port", str(port), "--profile", profile, "--model-name", SIM_MODEL,
                "--time-scale", f"{time_scale:g}", "--kv-events",
                "--kv-events-base-port", str(ev)]
        if num_gpu_blocks is not None:
            argv += ["--num-gpu-blocks", str(num_gpu_blocks)]
        if max_num_batched_tokens is not None:
            argv += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
        pname = f"{name}-{i}"
        procs.start(pname, argv)
        names.append(pname)
        commands.append(shlex.join(["kvgate", *argv[3:]]))
        for j in range(size):
            urls.append(f"http://127.0.0.1:{port + j}")
            events.append((f"tcp://127.0.0.1:{ev + 2 * j}", f"tcp://127.0.0.1:{ev + 2 * j + 1}"))
    for url in urls:
        wait_until(_healthy(url), 60, f"simulated worker {url}")
    block = 16
    blocks = num_gpu_blocks
    text = httpx.get(urls[0] + "/metrics", timeout=5).text
    from gateway.workers.vllm_metrics import parse_vllm_metrics

    stats = parse_vllm_metrics(text)
    block = stats.block_size_tokens or block
    blocks = stats.num_gpu_blocks or blocks
    desc = (f"{n} simulated workers ({profile}, {blocks} blocks x {block} tokens each, "
            f"time scale {time_scale:g}, {len(sizes)} processes)")
    return Workers("sim", urls, events, SIM_MODEL, "simple", profile.split("@")[0], block,
                   131072, names, desc, commands)


def _cpu_sets(n: int) -> list[str]:
    cpus = sorted(os.sched_getaffinity(0))
    per = max(1, len(cpus) // n)
    return [",".join(str(cpus[(i * per + k) % len(cpus)]) for k in range(per)) for i in range(n)]


def start_vllm_workers(procs: Processes, ports: Ports, n: int, *, block_size: int,
                       num_gpu_blocks: int | None, max_model_len: int) -> Workers:
    """``n`` real vLLM CPU servers serving the tiny model, as ``tests/integration/conftest.py``
    starts them (``--enforce-eager``, KV events over ZMQ, OpenMP threads pinned per server)."""
    python = REPO_ROOT / ".venv-vllm" / "bin" / "python"
    model_dir = REPO_ROOT / ".cache" / "tiny-llama"
    if not python.exists():
        raise StartError(f"{python} is missing: run scripts/setup.sh --test")
    if not (model_dir / "config.json").exists():
        build = REPO_ROOT / "tests" / "fixtures" / "build_tiny_model.py"
        subprocess.run([str(python), str(build), str(model_dir)], cwd=REPO_ROOT, check=True,
                       timeout=300)
    urls: list[str] = []
    events: list[tuple[str, str]] = []
    names: list[str] = []
    commands: list[str] = []
    popens = []
    for i, cpu_set in enumerate(_cpu_sets(n)):
        port, ev, replay = ports.take(), ports.take(), ports.take()
        kv_events = {"enable_kv_cache_events": True, "publisher": "zmq",
                     "endpoint": f"tcp://*:{ev}", "replay_endpoint": f"tcp://*:{replay}",
                     "topic": "kv-events"}
        argv = [str(python), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(model_dir), "--served-model-name", VLLM_MODEL,
                "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(max_model_len),
                "--enable-prefix-caching", "--dtype", "bfloat16", "--block-size", str(block_size),
                "--enforce-eager", "--kv-events-config", json.dumps(kv_events)]
        if num_gpu_blocks is not None:
            argv += ["--num-gpu-blocks-override", str(num_gpu_blocks)]
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        env.update({
            "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": cpu_set,
            "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "PYTHONHASHSEED": "0", "VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1",
        })
        name = f"vllm-{i}"
        popens.append((name, procs.start(name, argv, env)))
        names.append(name)
        env_text = " ".join(f"{k}={env[k]}" for k in (
            "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS",
            "PYTHONHASHSEED", "VLLM_SERVER_DEV_MODE"))
        commands.append(f"{env_text} {shlex.join(argv)}")
        urls.append(f"http://127.0.0.1:{port}")
        events.append((f"tcp://127.0.0.1:{ev}", f"tcp://127.0.0.1:{replay}"))
    for (name, popen), url in zip(popens, urls, strict=True):
        try:
            wait_until(_healthy(url), 300, f"vLLM {url}", popen)
        except StartError as exc:
            raise StartError(f"{exc}\n{procs.tail(name)}") from None
    from gateway.workers.vllm_metrics import parse_vllm_metrics

    stats = parse_vllm_metrics(httpx.get(urls[0] + "/metrics", timeout=5).text)
    block = stats.block_size_tokens or block_size
    desc = (f"{n} real vLLM CPU servers (tiny Llama, {stats.num_gpu_blocks} blocks x {block} "
            f"tokens each, one core each)")
    return Workers("vllm", urls, events, VLLM_MODEL, str(model_dir), None, block, max_model_len,
                   names, desc, commands)


def lag_warnings(procs: Processes, workers: Workers) -> int:
    """How many simulated engines logged that they fell behind their model clock (once each)."""
    if workers.kind != "sim":
        return 0
    n = 0
    for name in workers.process_names:
        with contextlib.suppress(OSError):
            n += procs.log_path(name).read_text(errors="replace").count("fell ")
    return n


# == contenders =================================================================================


@dataclass(frozen=True)
class PoolSpec:
    name: str
    max_context_tokens: int
    worker_indices: list[int]


@dataclass
class Contender:
    name: str
    url: str
    description: str
    command: str
    metrics_url: str | None = None
    """kvgate's own /metrics (routing decisions); None for the other routers."""
    version: str | None = None


@dataclass
class Lineup:
    contenders: list[Contender] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


def _find_binary(explicit: str | None, env: str, command: str, venvs: Sequence[str]
                 ) -> str | None:
    for candidate in (explicit, os.environ.get(env), shutil.which(command),
                      *(str(Path(v) / "bin" / command) for v in venvs)):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def _dist_version(binary: str, dist: str) -> str | None:
    python = Path(binary).parent / "python"
    if not python.exists():
        return None
    try:
        out = subprocess.run(
            [str(python), "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"],
            capture_output=True, text=True, timeout=30, check=True)
    except (subprocess.SubprocessError, OSError):
        return None
    return out.stdout.strip() or None


def kvgate_config(workers: Workers, port: int, policy: str, events: bool,
                  pools: Sequence[PoolSpec] | None = None) -> dict[str, Any]:
    model: dict[str, Any] = {"name": workers.model, "tokenizer": workers.tokenizer}
    if workers.architecture is not None:
        model["architecture"] = workers.architecture
    pools = pools or [PoolSpec("fleet", workers.max_model_len, list(range(len(workers.urls))))]
    pool_list = []
    for p in pools:
        ws: list[dict[str, str]] = []
        for i in p.worker_indices:
            w = {"url": workers.urls[i]}
            if events:
                w["kv_events_endpoint"], w["kv_replay_endpoint"] = workers.events[i]
            ws.append(w)
        pool_list.append({"name": p.name, "max_context_tokens": p.max_context_tokens,
                          "policy": policy, "workers": ws})
    return {"listen": {"host": "127.0.0.1", "port": port}, "models": [model],
            "pools": pool_list}


def start_kvgate(procs: Processes, ports: Ports, workers: Workers, name: str, policy: str,
                 events: bool, description: str, pools: Sequence[PoolSpec] | None = None
                 ) -> Contender:
    port = ports.take()
    config = kvgate_config(workers, port, policy, events, pools)
    path = procs.log_dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    argv = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path),
            "--log-level", "warning"]
    proc = procs.start(name, argv)
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: _status(url + "/ready") == 200, 60, name, proc)
    return Contender(name, url, description, shlex.join(["kvgate", *argv[3:]]),
                     metrics_url=url + "/metrics", version=importlib.metadata.version("kvgate"))


def _probe(url: str, model: str) -> bool:
    r = httpx.post(url + "/v1/chat/completions", timeout=30, json={
        "model": model, "max_tokens": 1,
        "messages": [{"role": "user", "content": "ping"}]})
    return r.status_code == 200


def start_lineup(procs: Processes, ports: Ports, workers: Workers, names: Sequence[str],
                 args: argparse.Namespace) -> Lineup:
    lineup = Lineup()
    kv = "kv_aware"
    for name in names:
        try:
            if name == "kvgate_kv":
                c = start_kvgate(procs, ports, workers, name, kv, True,
                                 "kvgate kv_aware, KV events from every worker")
            elif name == "kvgate_approx":
                c = start_kvgate(procs, ports, workers, name, kv, False,
                                 "kvgate kv_aware without KV events (routing history only)")
            elif name == "kvgate_rr":
                c = start_kvgate(procs, ports, workers, name, "round_robin", False,
                                 "kvgate round_robin")
            elif name == "sglang_cache_aware":
                c = _start_peer(procs, ports, workers, name, args.sglang_router,
                                "KVGATE_SGLANG_ROUTER", "sglang-router", "sglang-router",
                                ["/work/tmp/venv-sglang", str(REPO_ROOT / ".venv-sglang")],
                                lambda p, mp: ["launch", "--host", "127.0.0.1", "--port", str(p),
                                               "--worker-urls", *workers.urls,
                                               "--policy", "cache_aware",
                                               "--prometheus-host", "127.0.0.1",
                                               "--prometheus-port", str(mp),
                                               "--log-level", "warn"],
                                "SGLang model gateway, policy cache_aware (defaults: cache "
                                "threshold 0.3, balance abs 64 / rel 1.5)")
            elif name == "vllm_router_cache_aware":
                c = _start_peer(procs, ports, workers, name, args.vllm_router,
                                "KVGATE_VLLM_ROUTER", "vllm-router", "vllm-router",
                                ["/work/tmp/venv-vllm-router",
                                 str(REPO_ROOT / ".venv-vllm-router")],
                                lambda p, mp: ["--host", "127.0.0.1", "--port", str(p),
                                               "--worker-urls", *workers.urls,
                                               "--policy", "cache_aware",
                                               "--prometheus-host", "127.0.0.1",
                                               "--prometheus-port", str(mp),
                                               "--worker-startup-check-interval", "1",
                                               "--log-level", "warning"],
                                "vllm-router, policy cache_aware (tokenizes on the workers)")
            else:
                raise StartError(f"unknown contender {name!r}")
        except StartError as exc:
            lineup.skipped[name] = f"{exc}\n{procs.tail(name)}".strip()
            procs.stop(name)
            print(f"routers: {name} skipped: {str(exc).splitlines()[0]}", flush=True)
            continue
        lineup.contenders.append(c)
        print(f"routers: {name} ready at {c.url}", flush=True)
    return lineup


def _start_peer(procs: Processes, ports: Ports, workers: Workers, name: str,
                explicit: str | None, env: str, command: str, dist: str, venvs: Sequence[str],
                argv_of: Callable[[int, int], list[str]], description: str) -> Contender:
    binary = _find_binary(explicit, env, command, venvs)
    if binary is None:
        raise StartError(
            f"{command} not found (give --{command}, set ${env}, or install it into its own "
            f"venv: python3 -m venv {venvs[0]} && {venvs[0]}/bin/pip install {dist})")
    port, metrics_port = ports.take(), ports.take()
    argv = [binary, *argv_of(port, metrics_port)]
    proc = procs.start(name, argv)
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: _probe(url, workers.model), 90, name, proc)
    return Contender(name, url, description, shlex.join(argv),
                     version=_dist_version(binary, dist))


# == one workload against the lineup ============================================================


@dataclass(frozen=True)
class WorkloadPlan:
    key: str
    """Directory and table name."""
    spec: WorkloadSpec
    concurrency: int | None = None
    rate: float | None = None
    duration_s: float | None = None
    ignore_eos: bool = True
    note: str = ""
    cache_columns: bool = True
    """False: every prompt is unique by design, so hit rates say nothing (not shown)."""

    def bench_argv(self) -> list[str]:
        """The equivalent ``kvgate bench`` options (for reproducing one workload by hand)."""
        defaults = WorkloadSpec(self.spec.name)
        argv = ["--workload", self.spec.name]
        for f in dataclasses.fields(WorkloadSpec):
            if f.name in ("name", "tokens_per_word"):
                continue
            value = getattr(self.spec, f.name)
            if value != getattr(defaults, f.name) and value is not None:
                text = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
                argv += [f"--{f.name.replace('_', '-')}", text]
        if self.rate is not None:
            argv += ["--rate", f"{self.rate:g}"]
        else:
            argv += ["--concurrency", str(self.concurrency or 8)]
        if self.duration_s is not None:
            argv += ["--duration-s", f"{self.duration_s:g}"]
        if self.ignore_eos:
            argv.append("--ignore-eos")
        return argv


@dataclass
class WorkloadOutcome:
    plan: WorkloadPlan
    reports: list[TargetReport]
    rows: dict[str, dict[str, Any]]
    ceiling_rate: float | None
    ceilings: dict[str, float | None]
    tokens_per_word: float
    bench_command: str
    lag_warnings: int


async def run_workload(plan: WorkloadPlan, lineup: Lineup, workers: Workers, procs: Processes,
                       out_dir: Path, progress: bool
                       ) -> WorkloadOutcome:
    """Every contender in turn (reset before each), then the ceiling of each contender's run."""
    targets = [Target(c.name, c.url) for c in lineup.contenders]
    resets = [u + "/reset_prefix_cache" for u in workers.urls]
    measured = await calibrate_tokens_per_word(workers.urls, workers.model)
    tpw = measured[0] if measured else 1.0
    spec = dataclasses.replace(plan.spec, tokens_per_word=tpw)
    workload = build_workload(spec)
    load = LoadSpec(model=workers.model, concurrency=plan.concurrency or 8, rate=plan.rate,
                    duration_s=plan.duration_s, drain_s=60.0, timeout_s=300.0,
                    ignore_eos=plan.ignore_eos, seed=spec.seed)
    bench_cmd = shlex.join([
        "kvgate", "bench", *plan.bench_argv(), "--model", workers.model,
        "--tokens-per-word", f"{tpw:.3f}", "--compare", *(f"{t.name}={t.url}" for t in targets),
        "--worker-url", *workers.urls, "--reset-url", *resets,
        "--out", str(out_dir / plan.key)])
    mode = (f"open loop {plan.rate:g}/s" if plan.rate is not None
            else f"closed loop, {load.concurrency} users")
    print(f"\n=== {plan.key}: {workload.total} requests, {mode}, tokens/word {tpw:.2f}\n"
          f"    {bench_cmd}", flush=True)
    tokenizer = load_tokenizer(workers.tokenizer)
    reports: list[TargetReport] = []
    rows: dict[str, dict[str, Any]] = {}
    ceilings: dict[str, float | None] = {}
    lag_before = lag_warnings(procs, workers)
    bar = Progress(progress)
    for c in lineup.contenders:
        target = Target(c.name, c.url)
        metrics_before = _scrape_text(c.metrics_url)
        salted = dataclasses.replace(load, salt=secrets.token_hex(4))
        result = await run_target(target, workload, salted, worker_urls=workers.urls,
                                  reset_urls=resets, progress=bar)
        metrics_after = _scrape_text(c.metrics_url)
        report = build_report(result)
        reports.append(report)
        print()
        print(target_header(report))
        print(group_table(report))
        footer = target_footer(report)
        if footer:
            print(footer)
        per_prompt = list(ceiling_hits(sent_prompts(workload, result.records, salted, tokenizer),
                                        workers.block_size_tokens))
        count = CacheCount(sum(n for n, _ in per_prompt), sum(h for _, h in per_prompt))
        ceilings[c.name] = count.hit_rate
        row = summary_row(report, count.hit_rate)
        row.update(warm_ttft_ms(result.records, per_prompt))
        row["ceiling_hit_rate"] = count.hit_rate
        row["salt"] = salted.salt
        row["reset_ok"] = result.reset_ok
        row["groups"] = {g: _group_row(s) for g, s in report.groups.items()}
        per_worker = _per_worker_queries(report)
        row["worker_query_tokens"] = per_worker
        row["load_spread"] = load_spread(per_worker)
        if metrics_before is not None and metrics_after is not None:
            labels = ("pool", "policy", "reason")
            decisions = counter_delta(
                parse_counter(metrics_before, "kvgate_routing_decisions_total", labels),
                parse_counter(metrics_after, "kvgate_routing_decisions_total", labels))
            row["decisions"] = {"/".join(k): v for k, v in sorted(decisions.items())}
            per = counter_delta(
                parse_counter(metrics_before, "kvgate_requests_total", ("worker",)),
                parse_counter(metrics_after, "kvgate_requests_total", ("worker",)))
            row["gateway_requests_per_worker"] = {k[0]: v for k, v in sorted(per.items())}
            print("routing decisions: " + ", ".join(
                f"{k} {v:.0f}" for k, v in row["decisions"].items()))
        rows[c.name] = row
    lag = lag_warnings(procs, workers) - lag_before
    ceiling_rate = _mean([v for v in ceilings.values() if v is not None])
    for row in rows.values():
        rate = row.get("hit_rate")
        ceil = row.get("ceiling_hit_rate")
        row["of_ceiling"] = None if rate is None or not ceil else rate / ceil
    if len(reports) > 1:
        print(f"\n== comparison ({plan.key}; ratios to {reports[0].run.target.name})")
        print(compare_table(reports))
    wdir = out_dir / plan.key
    wdir.mkdir(parents=True, exist_ok=True)
    config = {
        "argv": plan.bench_argv(), "equivalent_command": bench_cmd, "model": workers.model,
        "workload": dataclasses.asdict(spec), "load": dataclasses.asdict(load),
        "tokens_per_word_source": measured[1] if measured else "assumed",
        "targets": [dataclasses.asdict(t) for t in targets], "worker_urls": workers.urls,
        "reset_urls": resets,
    }
    write_json(wdir / "bench.json", to_json(reports, config))
    if reports:
        plot_cdfs(reports, wdir / "latency_cdf.png", f"{plan.key}: {workers.description}")
    return WorkloadOutcome(plan, reports, rows, ceiling_rate, ceilings, tpw, bench_cmd, lag)


def _group_row(s: Summary) -> dict[str, Any]:
    return {"requests": s.requests, "ok": s.ok, "errors": dict(s.errors),
            "ttft_p50_ms": _q_ms(s, "p50"),
            "ttft_p99_ms": _q_ms(s, "p99"), "requests_per_s": s.requests_per_s,
            "output_tokens_per_s": s.output_tokens_per_s}


def _per_worker_queries(report: TargetReport) -> dict[str, float]:
    out: dict[str, float] = {}
    for url, before in report.run.workers_before.items():
        after = report.run.workers_after.get(url)
        if before is None or after is None:
            continue
        out[url] = max(0.0, after.prefix_cache_queries_tokens - before.prefix_cache_queries_tokens)
    return out


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _scrape_text(url: str | None) -> str | None:
    if url is None:
        return None
    try:
        r = httpx.get(url, timeout=10)
    except httpx.HTTPError:
        return None
    return r.text if r.status_code == 200 else None


# == scenarios ==================================================================================


@dataclass
class ScenarioResult:
    name: str
    workers: Workers
    lineup: Lineup
    outcomes: list[WorkloadOutcome]
    verdicts: list[tuple[str, Verdict]]
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


def scenario_vllm(procs: Processes, ports: Ports, args: argparse.Namespace) -> ScenarioResult:
    workers = start_vllm_workers(procs, ports, 2, block_size=32, num_gpu_blocks=192,
                                 max_model_len=4096)
    lineup = start_lineup(procs, ports, workers, args.contenders, args)
    n = 48 if args.quick else 320
    plan = WorkloadPlan("shared-prefix", WorkloadSpec(
        "shared-prefix", requests=n, prefixes=8, prefix_tokens=1024, question_tokens=32,
        max_tokens=8), concurrency=4,
        note="8 prefixes of ~1K tokens (~33 blocks each); 192 blocks per server hold 5 of them, "
             "the two servers together all 8")
    outcome = asyncio.run(run_workload(plan, lineup, workers, procs, args.out_dir,
                                       args.progress))
    verdicts = [("shared-prefix", v) for v in hit_rate_verdicts(outcome.rows,
                                                                  outcome.ceiling_rate)]
    return ScenarioResult("vllm", workers, lineup, [outcome], verdicts)


def scenario_sim16(procs: Processes, ports: Ports, args: argparse.Namespace) -> ScenarioResult:
    ts = args.time_scale if args.time_scale is not None else 8.0
    workers = start_sim_workers(procs, ports, 16, profile="llama-3-8b@h100", time_scale=ts,
                                num_gpu_blocks=1024, processes=args.sim_processes)
    lineup = start_lineup(procs, ports, workers, args.contenders, args)
    quick = args.quick
    plans = [
        WorkloadPlan("shared-prefix", WorkloadSpec(
            "shared-prefix", requests=240 if quick else 1440, prefixes=32, prefix_tokens=2048,
            question_tokens=64, max_tokens=16), rate=args.rate or 24.0,
            note="32 prefixes of 2K tokens; 1,024 blocks (16K tokens) per worker hold 8 of them, "
                 "the fleet all 32 many times over"),
        WorkloadPlan("multiturn", WorkloadSpec(
            "multiturn", sessions=16 if quick else 48, turns=8, max_tokens=64),
            concurrency=16 if quick else 48,
            note="bench defaults (system 200, first user 300, +100 per turn, 64-token answers)"),
    ]
    outcomes = []
    verdicts: list[tuple[str, Verdict]] = []
    for plan in plans:
        o = asyncio.run(run_workload(plan, lineup, workers, procs, args.out_dir, args.progress))
        outcomes.append(o)
        verdicts += [(plan.key, v) for v in hit_rate_verdicts(o.rows, o.ceiling_rate)]
        verdicts += [(plan.key, v) for v in ttft_verdicts(o.rows)]
        verdicts += [(plan.key, v) for v in ttft_verdicts(
            o.rows, key="warm_ttft_p99_ms", label="warm TTFT p99")]
    notes = [f"time scale {ts:g}: wall-clock latencies are {ts:g}x the modelled H100's"]
    return ScenarioResult("sim16", workers, lineup, outcomes, verdicts, notes)


def scenario_isolation(procs: Processes, ports: Ports, args: argparse.Namespace
                       ) -> ScenarioResult:
    ts = args.time_scale if args.time_scale is not None else 2.0
    workers = start_sim_workers(procs, ports, 8, profile="llama-3-8b@h100", time_scale=ts,
                                num_gpu_blocks=None, processes=args.sim_processes)
    two = [PoolSpec("short-chat", 8192, [0, 1, 2, 3]),
           PoolSpec("long-context", 131072, [4, 5, 6, 7])]
    one = [PoolSpec("mixed", 131072, list(range(8)))]
    lineup = Lineup()
    for name, pools, policy, desc in (
        ("two_pools", two, "kv_aware", "kvgate kv_aware, 4 short-chat + 4 long-context workers"),
        ("one_pool", one, "kv_aware", "kvgate kv_aware, one pool of the same 8 workers"),
        ("one_pool_rr", one, "round_robin", "kvgate round_robin, one pool of the same 8 workers"),
    ):
        try:
            lineup.contenders.append(start_kvgate(procs, ports, workers, name, policy,
                                                  policy == "kv_aware", desc, pools))
        except StartError as exc:
            lineup.skipped[name] = f"{exc}\n{procs.tail(name)}"
    quick = args.quick
    rate = args.rate or 10.0
    fraction = 0.25
    n = 120 if quick else 480
    flood = WorkloadPlan("flood", WorkloadSpec(
        "mixed", requests=n, long_tokens=16000, short_tokens=200, long_fraction=fraction,
        max_tokens=32), rate=rate, cache_columns=False,
        note=f"{rate:g} req/s, {fraction:.0%} of them 16K-token prompts")
    calm = WorkloadPlan("no-flood", WorkloadSpec(
        "mixed", requests=round(n * (1 - fraction)), long_tokens=16000, short_tokens=200,
        long_fraction=0.0, max_tokens=32), rate=rate * (1 - fraction), cache_columns=False,
        note=f"the short chats alone at the same short-chat rate, {rate * (1 - fraction):g} req/s")
    outcomes = [asyncio.run(run_workload(p, lineup, workers, procs, args.out_dir, args.progress))
                for p in (calm, flood)]
    verdicts: list[tuple[str, Verdict]] = []
    calm_rows, flood_rows = outcomes[0].rows, outcomes[1].rows
    extra: dict[str, Any] = {}
    for name in ("two_pools", "one_pool", "one_pool_rr"):
        base = calm_rows.get(name, {}).get("groups", {}).get("short", {}).get("ttft_p99_ms")
        hit = flood_rows.get(name, {}).get("groups", {}).get("short", {}).get("ttft_p99_ms")
        extra[name] = {"short_ttft_p99_ms_no_flood": base, "short_ttft_p99_ms_flood": hit,
                       "ratio": None if not base or hit is None else hit / base}
        verdicts.append(("isolation", at_most(
            f"{name}: short-chat TTFT p99 under the flood <= 1.2x without", hit,
            None if base is None else 1.2 * base,
            f"{_ms(hit)} vs {_ms(base)}: {_ratio_text(hit, base)}")))
    notes = [f"time scale {ts:g}: wall-clock latencies are {ts:g}x the modelled H100's"]
    return ScenarioResult("isolation", workers, lineup, outcomes, verdicts, notes, extra)


SCENARIOS: dict[str, Callable[[Processes, Ports, argparse.Namespace], ScenarioResult]] = {
    "vllm": scenario_vllm,
    "sim16": scenario_sim16,
    "isolation": scenario_isolation,
}


# == output =====================================================================================


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


# == main =======================================================================================


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gateway.bench.routers", description=__doc__,
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
    procs = Processes(args.out_dir / "logs")
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


if __name__ == "__main__":
    raise SystemExit(main())
