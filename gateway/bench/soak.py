"""Soak benchmark: steady load for a long time, with faults injected on a schedule, watching for leaks.

Everything runs as real processes on loopback: ``--workers`` simulated vLLM workers, each in its own
``kvgate sim`` process (so one can be SIGKILLed or SIGSTOPped without touching the others), and
the gateway as ``kvgate serve`` in front of them. A small asyncio client keeps ``--concurrency``
requests in flight (chat, half of them streamed, each from one of ``--sessions`` session ids), and
on a schedule:

* every ``--kill-every-s``: SIGKILL one worker (in turn), restart it on the same port after
  ``--down-s``;
* every ``--hang-every-s``: SIGSTOP another worker for ``--hang-s`` (longer than the pool's
  ``read_s``), so requests on it hang until the gateway's timeouts end them, then SIGCONT;
* every ``--abandon-every-s``: a client opens a long stream, reads one chunk, stops reading for
  ``--abandon-hold-s`` and goes away.

Every ``--sample-every-s`` the gateway's RSS (``/proc/PID/status``) and its ``/metrics`` are
sampled. At the end the load stops, faults are healed, and the run checks:

1. no leaked in-flight counts: every ``kvgate_worker_inflight`` series is 0;
2. no leaked budget reservations: ``GET /admin/sessions`` shows no session holding requests or
   KV bytes;
3. errors only around injected faults: every failed request overlaps a fault's window (the fault,
   plus the gateway's timeouts and health-check detection time after it).

It prints a table, writes ``soak.json`` (config, samples, faults, every error, per-request
records up to a cap) and ``soak_rss.png`` (RSS and in-flight over time, faults marked) under
``--out``, and exits 1 when a check fails. It is a benchmark, not a test: the numbers (RSS growth
per minute, errors per fault) are for a person to read; the checks only catch leaks.

Run: ``python -m gateway.bench.soak --duration-s 600 --workers 4``.

The processes come from the kit in ``gateway/procs/`` and ``/metrics`` is read with
``gateway.promtext``, as the fault-injection tests (``tests/integration/test_reliability_*.py``)
do.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import random
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from gateway import promtext
from gateway.procs.kvgate import SIM_MODEL, GatewayProcess, SimProcess
from gateway.procs.process import start_all

ADMIN_TOKEN_ENV = "KVGATE_ADMIN__TOKEN"


# -- the soak run ------------------------------------------------------------------------------


@dataclass(frozen=True)
class SoakConfig:
    duration_s: float = 600.0
    workers: int = 4
    concurrency: int = 8
    stream_ratio: float = 0.5
    max_tokens: int = 48
    sessions: int = 16
    time_scale: float = 1.0
    kill_every_s: float = 30.0
    down_s: float = 5.0
    hang_every_s: float = 45.0
    hang_s: float = 5.0
    abandon_every_s: float = 10.0
    abandon_hold_s: float = 4.0
    sample_every_s: float = 2.0
    first_token_s: float = 3.0
    read_s: float = 2.0
    health_interval_s: float = 0.5
    unhealthy_threshold: int = 2
    seed: int = 0
    out: str = "results/soak"
    max_records: int = 20000

    @property
    def settle_s(self) -> float:
        """How long after a fault its errors may still land: a request's timeouts, the health
        checks that mark the worker down, and a margin."""
        detect = self.health_interval_s * (self.unhealthy_threshold + 1) + 0.5
        return max(self.first_token_s, self.read_s) + detect + 2.0


@dataclass
class RequestRecord:
    t_start: float
    t_end: float
    kind: str  # chat | stream | abandon
    status: int  # HTTP status; 0 when no response came
    outcome: str  # ok | abandoned | http_STATUS:CODE | stream_error:CODE | ...
    worker: str | None = None
    detail: str = ""  # the error's message, for failures

    @property
    def error(self) -> bool:
        return self.outcome not in ("ok", "abandoned")


@dataclass
class FaultRecord:
    kind: str  # kill | hang
    worker: str
    t_start: float
    t_end: float | None = None  # restarted and healthy / resumed


@dataclass
class Sample:
    t: float
    rss_bytes: int | None
    inflight: float | None  # sum of kvgate_worker_inflight
    workers_up: int | None
    requests_total: float | None


@dataclass
class SoakResult:
    config: SoakConfig
    records: list[RequestRecord] = field(default_factory=list)
    faults: list[FaultRecord] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    final_inflight: dict[str, float] = field(default_factory=dict)
    leaked_sessions: list[dict[str, Any]] = field(default_factory=list)
    sessions_seen: int = 0
    elapsed_s: float = 0.0
    checks: dict[str, bool] = field(default_factory=dict)

    def explained(self, r: RequestRecord) -> bool:
        settle = self.config.settle_s
        for f in self.faults:
            end = (f.t_end if f.t_end is not None else self.elapsed_s) + settle
            if r.t_start <= end and r.t_end >= f.t_start - 0.5:
                return True
        return False


class Clock:
    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self.t0


PROMPTS = (
    "You are a careful assistant. Summarise the following meeting notes in three bullet points.",
    "Translate the following paragraph into French, keeping the technical terms in English.",
    "Write a short poem about the sea, the wind and an old lighthouse keeper.",
    "Explain how paged attention stores the KV cache in fixed-size blocks.",
)


def _body(rng: random.Random, cfg: SoakConfig, stream: bool, max_tokens: int) -> dict[str, Any]:
    prefix = PROMPTS[rng.randrange(len(PROMPTS))]
    return {
        "model": SIM_MODEL,
        "messages": [{"role": "user", "content": f"{prefix} Request {rng.randrange(10**6)}."}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


def _error(body: bytes) -> tuple[str, str]:
    """The code and message of an OpenAI-shaped error body."""
    try:
        err = orjson.loads(body).get("error", {})
        return str(err.get("code") or err.get("type") or "?"), str(err.get("message", ""))[:200]
    except (orjson.JSONDecodeError, AttributeError):
        return "non_json", body[:200].decode(errors="replace")


async def _one_request(http: aiohttp.ClientSession, url: str, clock: Clock, rng: random.Random,
                       cfg: SoakConfig) -> RequestRecord:
    stream = rng.random() < cfg.stream_ratio
    kind = "stream" if stream else "chat"
    body = _body(rng, cfg, stream, rng.randint(4, cfg.max_tokens))
    headers = {"x-session-id": f"soak-{rng.randrange(cfg.sessions)}"}
    t0 = clock.now()
    rec = RequestRecord(t0, t0, kind, 0, "ok")
    timeout = aiohttp.ClientTimeout(total=cfg.first_token_s + cfg.read_s * 4 + 30)
    try:
        async with http.post(url + "/v1/chat/completions", json=body, headers=headers,
                             timeout=timeout) as r:
            rec.status = r.status
            rec.worker = r.headers.get("x-kvgate-worker")
            if r.status != 200:
                code, rec.detail = _error(await r.read())
                rec.outcome = f"http_{r.status}:{code}"
            elif not stream:
                data = await r.read()
                if b'"choices"' not in data:
                    rec.outcome = "bad_body"
            else:
                done, err = False, None
                async for line in r.content:
                    if not line.startswith(b"data: "):
                        continue
                    payload = line[6:].strip()
                    if payload == b"[DONE]":
                        done = True
                    elif payload.startswith(b'{"error"'):
                        err, rec.detail = _error(payload)
                if err is not None:
                    rec.outcome = f"stream_error:{err}"
                elif not done:
                    rec.outcome = "stream_truncated"
    except TimeoutError:
        rec.outcome = "client_timeout"
    except aiohttp.ClientError as exc:
        rec.outcome = f"exception:{type(exc).__name__}"
        rec.detail = str(exc)[:200]
    rec.t_end = clock.now()
    return rec


async def _abandon(http: aiohttp.ClientSession, url: str, clock: Clock, rng: random.Random,
                   cfg: SoakConfig) -> RequestRecord:
    """A client that reads one chunk of a long stream, stops reading, then goes away."""
    body = _body(rng, cfg, True, 2000)
    t0 = clock.now()
    rec = RequestRecord(t0, t0, "abandon", 0, "abandoned")
    try:
        async with http.post(url + "/v1/chat/completions", json=body,
                             headers={"x-session-id": f"soak-{rng.randrange(cfg.sessions)}"},
                             timeout=aiohttp.ClientTimeout(total=cfg.first_token_s + 30)) as r:
            rec.status = r.status
            rec.worker = r.headers.get("x-kvgate-worker")
            if r.status != 200:
                code, rec.detail = _error(await r.read())
                rec.outcome = f"http_{r.status}:{code}"
            else:
                await r.content.readline()
                await asyncio.sleep(cfg.abandon_hold_s)
                r.close()  # drop the connection mid-stream
    except TimeoutError:
        rec.outcome = "client_timeout"
    except aiohttp.ClientError as exc:
        rec.outcome = f"exception:{type(exc).__name__}"
    rec.t_end = clock.now()
    return rec


class _Run:
    def __init__(self, cfg: SoakConfig, gateway: GatewayProcess, sims: list[SimProcess],
                 admin_token: str) -> None:
        self.cfg = cfg
        self.gateway = gateway
        self.sims = sims
        self.admin_token = admin_token
        self.clock = Clock()
        self.result = SoakResult(cfg)
        self.stop = asyncio.Event()
        self.faulted: set[int] = set()  # indexes of workers under a fault now
        self.rng = random.Random(cfg.seed)

    async def _sleep(self, seconds: float) -> bool:
        """Sleep unless the run stops first; True when it stopped."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stop.wait(), seconds)
        return self.stop.is_set()

    def _next_worker(self, start: int) -> int | None:
        n = len(self.sims)
        for k in range(n):
            i = (start + k) % n
            if i not in self.faulted:
                return i
        return None

    async def load(self, http: aiohttp.ClientSession, index: int) -> None:
        rng = random.Random(self.cfg.seed * 1000 + index)
        while not self.stop.is_set():
            self._record(await _one_request(http, self.gateway.url, self.clock, rng, self.cfg))

    def _record(self, rec: RequestRecord) -> None:
        self.result.records.append(rec)

    async def kills(self) -> None:
        k = 0
        while not await self._sleep(self.cfg.kill_every_s):
            i = self._next_worker(k)
            k += 1
            if i is None:
                continue
            self.faulted.add(i)
            sim = self.sims[i]
            fault = FaultRecord("kill", sim.url, self.clock.now())
            self.result.faults.append(fault)
            try:
                sim.kill()
                await asyncio.sleep(self.cfg.down_s)
                sim.start(wait=False)  # from this thread: see _die_with_parent
                await asyncio.to_thread(sim.wait_ready)
            finally:
                fault.t_end = self.clock.now()
                self.faulted.discard(i)

    async def hangs(self) -> None:
        k = len(self.sims) // 2
        if await self._sleep(self.cfg.hang_every_s / 2):
            return
        while True:
            i = self._next_worker(k)
            k += 1
            if i is not None:
                self.faulted.add(i)
                sim = self.sims[i]
                fault = FaultRecord("hang", sim.url, self.clock.now())
                self.result.faults.append(fault)
                try:
                    sim.pause()
                    await asyncio.sleep(self.cfg.hang_s)
                finally:
                    sim.resume()
                    fault.t_end = self.clock.now()
                    self.faulted.discard(i)
            if await self._sleep(self.cfg.hang_every_s):
                return

    async def abandons(self, http: aiohttp.ClientSession) -> None:
        rng = random.Random(self.cfg.seed + 7)
        tasks: set[asyncio.Task[None]] = set()

        async def one() -> None:
            self._record(await _abandon(http, self.gateway.url, self.clock, rng, self.cfg))

        while not await self._sleep(self.cfg.abandon_every_s):
            t = asyncio.create_task(one())
            tasks.add(t)
            t.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)

    async def sampler(self, http: aiohttp.ClientSession) -> None:
        while True:
            await self.sample(http)
            if await self._sleep(self.cfg.sample_every_s):
                return

    async def sample(self, http: aiohttp.ClientSession) -> str | None:
        text: str | None = None
        try:
            async with http.get(self.gateway.url + "/metrics",
                                timeout=aiohttp.ClientTimeout(total=5)) as r:
                text = await r.text()
        except (aiohttp.ClientError, TimeoutError):
            pass
        inflight = up = total = None
        if text is not None:
            m = promtext.samples(text)
            inflight = sum(m.get("kvgate_worker_inflight", {}).values())
            up = sum(1 for v in m.get("kvgate_worker_up", {}).values() if v == 1)
            total = sum(m.get("kvgate_requests_total", {}).values())
        self.result.samples.append(
            Sample(self.clock.now(), self.gateway.rss_bytes(), inflight, up, total))
        return text

    async def run(self) -> SoakResult:
        cfg = self.cfg
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as http:
            sampler = asyncio.create_task(self.sampler(http))
            workers = [asyncio.create_task(self.load(http, i)) for i in range(cfg.concurrency)]
            faults = [asyncio.create_task(self.kills()), asyncio.create_task(self.hangs()),
                      asyncio.create_task(self.abandons(http))]
            last_report = 0.0
            while self.clock.now() < cfg.duration_s:
                await asyncio.sleep(min(1.0, cfg.duration_s - self.clock.now()))
                if self.clock.now() - last_report >= 30:
                    last_report = self.clock.now()
                    self._progress()
            self.stop.set()
            await asyncio.gather(*workers, *faults)
            await sampler
            self.result.elapsed_s = self.clock.now()
            await self._settle(http)
        return self.result

    def _progress(self) -> None:
        recs = self.result.records
        errors = sum(r.error for r in recs)
        rss = next((s.rss_bytes for s in reversed(self.result.samples) if s.rss_bytes), None)
        rss_txt = "-" if rss is None else f"{rss / 2**20:.1f} MB"
        print(f"[{self.clock.now():6.0f} s] requests {len(recs)}, errors {errors},"
              f" faults {len(self.result.faults)}, gateway RSS {rss_txt}", flush=True)

    async def _settle(self, http: aiohttp.ClientSession) -> None:
        """Every worker back, nothing in flight (bounded wait), then the final readings."""
        for sim in self.sims:
            sim.resume()
            if not sim.alive:
                sim.start(wait=False)
                await asyncio.to_thread(sim.wait_ready)
        deadline = time.monotonic() + self.cfg.settle_s + 10
        text = None
        while time.monotonic() < deadline:
            text = await self.sample(http)
            if text is not None:
                up = promtext.values(text, "kvgate_worker_up")
                busy = promtext.values(text, "kvgate_worker_inflight")
                if all(v == 1 for v in up) and not any(busy):
                    break
            await asyncio.sleep(0.5)
        if text is not None:
            self.result.final_inflight = {
                dict(ls).get("worker", "?"): v
                for ls, v in promtext.samples(text).get("kvgate_worker_inflight", {}).items()
            }
        async with http.get(self.gateway.url + "/admin/sessions", params={"top": "1000"},
                            headers={"authorization": f"Bearer {self.admin_token}"}) as r:
            r.raise_for_status()
            rows = (await r.json())["data"]
        self.result.sessions_seen = len(rows)
        self.result.leaked_sessions = [
            {k: row[k] for k in ("session_id", "inflight_requests", "inflight_kv_bytes")}
            for row in rows if row["inflight_requests"] or row["inflight_kv_bytes"]
        ]


def gateway_config(cfg: SoakConfig, worker_urls: Sequence[str]) -> dict[str, Any]:
    return {
        "models": [{"name": SIM_MODEL, "tokenizer": "simple", "architecture": "llama-3-8b"}],
        "pools": [{
            "name": "chat", "max_context_tokens": 16384, "policy": "least_loaded",
            "workers": list(worker_urls),
            "timeouts": {"connect_s": 1.0, "first_token_s": cfg.first_token_s,
                         "read_s": cfg.read_s},
        }],
        "health": {"interval_s": cfg.health_interval_s, "timeout_s": 0.5,
                   "unhealthy_threshold": cfg.unhealthy_threshold, "healthy_threshold": 1,
                   "scrape_interval_s": 2.0},
        # Budgets on, so every session request holds a reservation the end checks for leaks.
        "budgets": {"defaults": {"inflight_kv_bytes": "512GiB", "inflight_requests": 256}},
        "shutdown": {"drain_delay_s": 0.0, "grace_s": 5.0},
    }


def run_soak(cfg: SoakConfig) -> SoakResult:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvgate-soak-") as tmp:
        logs = Path(tmp)
        sims = [SimProcess(time_scale=cfg.time_scale, log_path=logs / f"sim-{i}.log")
                for i in range(cfg.workers)]
        token = f"soak-{random.Random(cfg.seed).getrandbits(64):016x}"
        gateway = GatewayProcess(gateway_config(cfg, [s.url for s in sims]),
                                 logs / "kvgate.yaml", log_path=out / "gateway.log",
                                 env={ADMIN_TOKEN_ENV: token})
        try:
            start_all(sims)
            gateway.start(timeout_s=60)
            print(f"soak: gateway {gateway.url} (pid {gateway.pid}) in front of"
                  f" {len(sims)} simulated workers; {cfg.duration_s:g} s", flush=True)
            result = asyncio.run(_Run(cfg, gateway, sims, token).run())
        finally:
            gateway.stop()
            for s in sims:
                s.stop()
    judge(result)
    return result


# -- report ------------------------------------------------------------------------------------


def _rss_growth_mb_per_min(samples: Sequence[Sample]) -> float | None:
    """Least-squares slope of RSS over the second half of the run (the first half warms up)."""
    pts = [(s.t, s.rss_bytes / 2**20) for s in samples if s.rss_bytes is not None]
    pts = pts[len(pts) // 2:]
    if len(pts) < 3:
        return None
    n = len(pts)
    mt = sum(t for t, _ in pts) / n
    mr = sum(r for _, r in pts) / n
    var = sum((t - mt) ** 2 for t, _ in pts)
    if var == 0:
        return None
    return sum((t - mt) * (r - mr) for t, r in pts) / var * 60


def judge(result: SoakResult) -> None:
    errors = [r for r in result.records if r.error]
    result.checks = {
        "no leaked in-flight counts": bool(result.final_inflight)
        and not any(result.final_inflight.values()),
        "no leaked budget reservations": not result.leaked_sessions,
        "errors only around faults": all(result.explained(r) for r in errors),
    }


def summary(result: SoakResult) -> dict[str, Any]:
    recs = result.records
    errors = [r for r in recs if r.error]
    by_outcome: dict[str, int] = {}
    for r in errors:
        by_outcome[r.outcome] = by_outcome.get(r.outcome, 0) + 1
    rss = [s.rss_bytes for s in result.samples if s.rss_bytes is not None]
    kinds: dict[str, dict[str, int]] = {}
    for kind in ("chat", "stream", "abandon"):
        rs = [r for r in recs if r.kind == kind]
        err = [r for r in rs if r.error]
        kinds[kind] = {"requests": len(rs), "errors": len(err),
                       "unexplained": sum(not result.explained(r) for r in err)}
    return {
        "elapsed_s": result.elapsed_s,
        "requests": len(recs),
        "requests_per_s": len(recs) / result.elapsed_s if result.elapsed_s else 0.0,
        "errors": len(errors),
        "unexplained_errors": sum(not result.explained(r) for r in errors),
        "errors_by_outcome": by_outcome,
        "by_kind": kinds,
        "faults": {k: sum(f.kind == k for f in result.faults) for k in ("kill", "hang")},
        "abandoned_clients": sum(r.kind == "abandon" for r in recs),
        "rss_mb": None if not rss else {
            "first": rss[0] / 2**20, "last": rss[-1] / 2**20, "max": max(rss) / 2**20,
            "growth_mb_per_min_second_half": _rss_growth_mb_per_min(result.samples),
        },
        "final_inflight": result.final_inflight,
        "sessions_seen": result.sessions_seen,
        "leaked_sessions": result.leaked_sessions,
        "checks": result.checks,
        "passed": all(result.checks.values()),
    }


def table(result: SoakResult) -> str:
    s = summary(result)
    cfg = result.config
    lines = [
        f"soak: {s['elapsed_s']:.0f} s, {cfg.workers} workers, concurrency {cfg.concurrency},"
        f" {s['requests']} requests ({s['requests_per_s']:.1f}/s)",
        "",
        f"{'kind':<10}{'requests':>10}{'errors':>9}{'unexplained':>13}",
    ]
    for kind, k in s["by_kind"].items():
        lines.append(f"{kind:<10}{k['requests']:>10}{k['errors']:>9}{k['unexplained']:>13}")
    lines += [
        "",
        f"faults: {s['faults']['kill']} kills (down {cfg.down_s:g} s), {s['faults']['hang']}"
        f" hangs ({cfg.hang_s:g} s), {s['abandoned_clients']} abandoned streams",
        "errors by outcome: " + (", ".join(f"{k} {v}" for k, v in
                                           sorted(s["errors_by_outcome"].items())) or "none"),
    ]
    rss = s["rss_mb"]
    if rss is not None:
        growth = rss["growth_mb_per_min_second_half"]
        lines.append(
            f"gateway RSS MB: first {rss['first']:.1f}, last {rss['last']:.1f}, max"
            f" {rss['max']:.1f}, second-half growth "
            + ("-" if growth is None else f"{growth:+.2f} MB/min"))
    lines += [
        f"in flight at the end: {s['final_inflight']}",
        f"sessions at the end: {s['sessions_seen']}, holding something:"
        f" {len(s['leaked_sessions'])}",
        "",
    ]
    for name, ok in s["checks"].items():
        lines.append(f"{'PASS' if ok else 'FAIL'}  {name}")
    return "\n".join(lines)


def to_json(result: SoakResult) -> dict[str, Any]:
    errors = [dataclasses.asdict(r) | {"explained": result.explained(r)}
              for r in result.records if r.error]
    records = result.records[: result.config.max_records]
    return {
        "config": dataclasses.asdict(result.config),
        "summary": summary(result),
        "faults": [dataclasses.asdict(f) for f in result.faults],
        "samples": [dataclasses.asdict(x) for x in result.samples],
        "errors": errors,
        "records": [dataclasses.asdict(r) for r in records],
        "records_truncated": len(result.records) > len(records),
    }


def plot(result: SoakResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    ts = [s.t for s in result.samples if s.rss_bytes is not None]
    rss = [s.rss_bytes / 2**20 for s in result.samples if s.rss_bytes is not None]
    ax1.plot(ts, rss, color="tab:blue", label="gateway RSS")
    ax1.set_ylabel("RSS (MB)")
    ax1.set_title(f"kvgate soak: {result.elapsed_s:.0f} s, {result.config.workers} workers")
    it = [(s.t, s.inflight) for s in result.samples if s.inflight is not None]
    ax2.plot([t for t, _ in it], [v for _, v in it], color="tab:green",
             label="kvgate_worker_inflight (sum)")
    errs = [r.t_end for r in result.records if r.error]
    if errs:
        ax2.scatter(errs, [0] * len(errs), marker="x", color="tab:red", label="failed request")
    ax2.set_ylabel("requests")
    ax2.set_xlabel("seconds")
    for ax in (ax1, ax2):
        for f in result.faults:
            end = f.t_end if f.t_end is not None else result.elapsed_s
            ax.axvspan(f.t_start, end, alpha=0.15,
                       color="tab:red" if f.kind == "kill" else "tab:orange")
        ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- CLI ---------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    d = SoakConfig()
    p = argparse.ArgumentParser(
        prog="python -m gateway.bench.soak",
        description="Steady load with injected faults against kvgate; checks for leaks.")
    for f in dataclasses.fields(SoakConfig):
        default = getattr(d, f.name)
        p.add_argument("--" + f.name.replace("_", "-"), type=type(default), default=default,
                       help=f"default {default}")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = SoakConfig(**vars(args))
    result = run_soak(cfg)
    out = Path(cfg.out)
    (out / "soak.json").write_text(json.dumps(to_json(result), indent=1))
    plot(result, out / "soak_rss.png")
    print(table(result))
    print(f"\nwrote {out / 'soak.json'} and {out / 'soak_rss.png'}")
    return 0 if all(result.checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
