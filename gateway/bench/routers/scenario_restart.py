"""The ``restart`` scenario (issue 15, item 3): a router restarted in front of workers that hold
prompts. How much of its steady prefix-cache hit rate does it get in the first 2 s after it is
ready again?

Workers: four simulated H100s (llama-3-8b, KV events with vLLM's replay socket). Workload: 24
prefixes of ~1K tokens, each request one of them plus a fresh ~32-token question, 4-token
answers, 8 clients in a closed loop. Per contender, from caches reset: two passes over the
prefixes (the fleet learns them; each prefix lands on one worker), a third pass measured (the
steady hit rate), the router's process stopped and started again, and then, from the moment it
answers again, 2 s of the same closed loop over the prefixes in a new order (the hit rate after
restart). Hit rates are the workers' own prefix-cache counters (``vllm:prefix_cache_hits`` /
``_queries``, in tokens), read before and after each phase.

Contenders (same workers):

* ``kvgate_kv``: ``kv_aware`` with KV events and the workers' replay sockets: on start each
  subscriber reads its worker's history (``gateway.kvindex.events``, "Warm start");
* ``kvgate_kv_no_replay``: the same without replay endpoints (what kvgate did before: a
  restarted gateway knows a worker's blocks only from the events published after it started);
* ``kvgate_approx``: ``kv_aware`` without events (its routing history dies with the process);
* ``kvgate_approx_snapshot``: two replicas of ``kvgate_approx`` with the replica exchange and its
  snapshot (``replicas.exchange``, over a redis-server the scenario starts): the passes go
  through the first, the second learns them from its routes; the second is the one restarted,
  and it loads the snapshot (written every 2 s by the replica holding the writer lease, and by
  a closing holder) before it reports ready; the 2 s after go to it;
* the Rust routers (``sglang_cache_aware``, ``vllm_router_cache_aware``) when ``--contenders``
  names them and they are installed: their approximate trees die with their process too.

Target: ``kvgate_kv`` at >= 95% of its steady hit rate in the 2 s after restart.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import secrets
import time
from pathlib import Path
from typing import Any

import httpx

from gateway import promtext
from gateway.bench.routers.contenders import (
    Contender,
    Lineup,
    kvgate_config,
    launch_kvgate,
    start_contender,
)
from gateway.bench.routers.report import ScenarioResult
from gateway.bench.routers.targets import Verdict, at_least, fmt_ratio
from gateway.bench.routers.workers import Workers, start_sim_workers
from gateway.procs.net import Ports
from gateway.procs.process import ProcessSet, StartError
from gateway.procs.redis import RedisProcess

PROFILE = "llama-3-8b@h100"
WORKERS = 4
PREFIXES = 24
PREFIX_WORDS = 512  # ~1K tokens with the simulator's simple tokenizer (two per word)
QUESTION_WORDS = 16
CLIENTS = 8
WINDOW_S = 2.0
PEERS = ("sglang_cache_aware", "vllm_router_cache_aware")
SNAPSHOT = "kvgate_approx_snapshot"


def start(procs: ProcessSet, ports: Ports, workers: Workers, name: str,
          args: argparse.Namespace) -> Contender:
    if name.startswith(SNAPSHOT):  # the replica, or its peer
        return start_snapshot_replica(procs, ports, workers, name)
    if name not in ("kvgate_kv", "kvgate_kv_no_replay"):
        return start_contender(procs, ports, workers, name, args.sglang_router, args.vllm_router)
    replay = name == "kvgate_kv"
    port = ports.take()
    config = kvgate_config(workers, port, "kv_aware", True)
    if not replay:
        for pool in config["pools"]:
            for w in pool["workers"]:
                w.pop("kv_replay_endpoint", None)
    what = "KV events + the workers' replay sockets" if replay else "KV events, no replay"
    return launch_kvgate(procs, port, name, config, f"kvgate kv_aware, {what}")


def start_snapshot_replica(procs: ProcessSet, ports: Ports, workers: Workers, name: str
                           ) -> Contender:
    """One ``kvgate_approx_snapshot`` replica (``name``, or its peer ``name + "_peer"``) on the
    scenario's redis-server (started on first use), all with one key prefix per scenario."""
    try:
        redis = procs.get("redis")
    except KeyError:
        redis = procs.start("redis", RedisProcess(procs.log_dir / "redis"), timeout_s=15)
    assert isinstance(redis, RedisProcess)
    port = ports.take()
    config = kvgate_config(workers, port, "kv_aware", False)
    config["replicas"] = {"exchange": True, "redis_url": redis.url,
                          "key_prefix": f"bench:restart:{redis.port}"}
    return launch_kvgate(procs, port, name, config, "kvgate kv_aware without KV events, two"
                         " replicas with the replica exchange; the restarted one loads the"
                         " snapshot")


def counts(urls: list[str]) -> tuple[float, float]:
    """(prefix-cache hit tokens, query tokens) summed over the workers."""
    hits = queries = 0.0
    for url in urls:
        text = httpx.get(url + "/metrics", timeout=10).text
        hits += sum(promtext.values(text, "vllm:prefix_cache_hits_total"))
        queries += sum(promtext.values(text, "vllm:prefix_cache_queries_total"))
    return hits, queries


class Prompts:
    def __init__(self, salt: str) -> None:
        self.prefixes = [" ".join(f"{salt}p{p}w{i}" for i in range(PREFIX_WORDS))
                         for p in range(PREFIXES)]
        self._questions = itertools.count()

    def request(self, p: int) -> str:
        q = next(self._questions)
        return self.prefixes[p] + " " + " ".join(f"q{q}x{i}" for i in range(QUESTION_WORDS))


async def send(client: httpx.AsyncClient, url: str, model: str, prompt: str) -> float:
    t0 = time.monotonic()
    r = await client.post(url + "/v1/completions", json={
        "model": model, "prompt": prompt, "max_tokens": 4, "ignore_eos": True})
    r.raise_for_status()
    return time.monotonic() - t0


async def one_pass(url: str, model: str, prompts: Prompts, order: list[int]) -> None:
    queue = list(order)
    async with httpx.AsyncClient(timeout=120) as client:
        async def loop() -> None:
            while queue:
                await send(client, url, model, prompts.request(queue.pop()))
        await asyncio.gather(*(loop() for _ in range(CLIENTS)))


async def window(url: str, model: str, prompts: Prompts, seed: int) -> int:
    """Closed loop over the prefixes (a new order each cycle) for WINDOW_S from now; returns
    how many requests were sent (each sent within the window runs to its end)."""
    rng = random.Random(seed)
    order: list[int] = []
    sent = 0
    deadline = time.monotonic() + WINDOW_S
    async with httpx.AsyncClient(timeout=120) as client:
        async def loop() -> None:
            nonlocal sent
            while time.monotonic() < deadline:
                if not order:
                    order.extend(rng.sample(range(PREFIXES), PREFIXES))
                sent += 1
                await send(client, url, model, prompts.request(order.pop()))
        await asyncio.gather(*(loop() for _ in range(CLIENTS)))
    return sent


def measure(procs: ProcessSet, ports: Ports, workers: Workers, name: str,
            args: argparse.Namespace) -> dict[str, Any]:
    for u in workers.urls:
        httpx.post(u + "/reset_prefix_cache", timeout=10).raise_for_status()
    peer = None
    if name == SNAPSHOT:  # the passes go through the peer, the restarted one learns by routes
        peer = start(procs, ports, workers, f"{name}_peer", args)
    contender = start(procs, ports, workers, name, args)
    front = peer or contender
    prompts = Prompts(secrets.token_hex(3))
    order = list(range(PREFIXES))
    for seed in (1, 2):
        random.Random(seed).shuffle(order)
        asyncio.run(one_pass(front.url, workers.model, prompts, order))
    h0, q0 = counts(workers.urls)
    random.Random(3).shuffle(order)
    asyncio.run(one_pass(front.url, workers.model, prompts, order))
    h1, q1 = counts(workers.urls)
    steady = (h1 - h0) / (q1 - q0) if q1 > q0 else None

    procs.stop(name)
    started = time.monotonic()
    contender = start(procs, ports, workers, name, args)
    ready_s = time.monotonic() - started
    h2, q2 = counts(workers.urls)
    sent = asyncio.run(window(contender.url, workers.model, prompts, seed=4))
    h3, q3 = counts(workers.urls)
    after = (h3 - h2) / (q3 - q2) if q3 > q2 else None
    procs.stop(name)
    if peer is not None:
        procs.stop(peer.name)
    row = {"description": contender.description, "command": contender.command,
           "steady_hit_rate": steady, "after_restart_hit_rate": after,
           "ratio": None if not steady or after is None else after / steady,
           "restart_to_ready_s": ready_s, "requests_after_restart": sent}
    print(f"routers: restart: {name}: steady {_pct(steady)}, first {WINDOW_S:g} s after restart "
          f"{_pct(after)} ({sent} requests; ready {ready_s:.1f} s after the restart)", flush=True)
    return row


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def table(rows: dict[str, dict[str, Any]]) -> str:
    head = ["contender", "steady hit rate", f"first {WINDOW_S:g} s after restart", "ratio",
            "requests", "restart to ready s"]
    cells = [[n, _pct(r["steady_hit_rate"]), _pct(r["after_restart_hit_rate"]),
              "-" if r["ratio"] is None else f"{r['ratio']:.2f}",
              str(r["requests_after_restart"]), f"{r['restart_to_ready_s']:.1f}"]
             for n, r in rows.items()]
    widths = [max(len(head[i]), *(len(c[i]) for c in cells)) + 2 for i in range(len(head))]
    lines = ["".join(h.ljust(w) if i == 0 else h.rjust(w)
                     for i, (h, w) in enumerate(zip(head, widths, strict=True)))]
    lines += ["".join(x.ljust(w) if i == 0 else x.rjust(w)
                      for i, (x, w) in enumerate(zip(c, widths, strict=True))) for c in cells]
    return "\n".join(lines)


def plot(rows: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.6))
    names = list(rows)
    xs = list(range(len(names)))
    ax.bar([x - 0.2 for x in xs], [(rows[n]["steady_hit_rate"] or 0) * 100 for n in names], 0.4,
           label="steady")
    ax.bar([x + 0.2 for x in xs], [(rows[n]["after_restart_hit_rate"] or 0) * 100 for n in names],
           0.4, label=f"first {WINDOW_S:g} s after restart")
    ax.set_xticks(xs, names, rotation=15, fontsize=8)
    ax.set_ylabel("prefix-cache hit rate (%, tokens)")
    ax.set_ylim(0, 100)
    ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def scenario_restart(procs: ProcessSet, ports: Ports, args: argparse.Namespace
                     ) -> ScenarioResult:
    ts = args.time_scale if args.time_scale is not None else 4.0
    workers = start_sim_workers(procs, ports, WORKERS, profile=PROFILE, time_scale=ts,
                                num_gpu_blocks=None,
                                processes=max(1, min(args.sim_processes, WORKERS // 2)))
    # --contenders picks kvgate_kv (with its no-replay variant) and kvgate_approx (with its
    # snapshot variant); the Rust routers when named
    names = [*(("kvgate_kv", "kvgate_kv_no_replay") if "kvgate_kv" in args.contenders else ()),
             *(("kvgate_approx", SNAPSHOT) if "kvgate_approx" in args.contenders else ()),
             *(n for n in args.contenders if n in PEERS)]
    lineup = Lineup()
    rows: dict[str, dict[str, Any]] = {}
    for name in names:
        try:
            rows[name] = measure(procs, ports, workers, name, args)
        except StartError as exc:
            lineup.skipped[name] = str(exc).strip()
            procs.stop(name)
            procs.stop(f"{name}_peer")
            print(f"routers: {name} skipped: {str(exc).splitlines()[0]}", flush=True)
    verdicts: list[tuple[str, Verdict]] = []
    kv = rows.get("kvgate_kv")
    if kv is not None:
        verdicts.append(("restart", at_least(
            f"kvgate_kv: hit rate in the first {WINDOW_S:g} s after restart >= 95% of steady",
            kv["ratio"], 0.95,
            f"{_pct(kv['after_restart_hit_rate'])} vs {_pct(kv['steady_hit_rate'])}: "
            f"{fmt_ratio(kv['after_restart_hit_rate'], kv['steady_hit_rate'])}")))
    snap = rows.get(SNAPSHOT)
    if snap is not None:
        verdicts.append(("restart", at_least(
            f"{SNAPSHOT}: hit rate in the first {WINDOW_S:g} s after restart >= 95% of steady",
            snap["ratio"], 0.95,
            f"{_pct(snap['after_restart_hit_rate'])} vs {_pct(snap['steady_hit_rate'])}: "
            f"{fmt_ratio(snap['after_restart_hit_rate'], snap['steady_hit_rate'])}")))
    print(f"\n--- restart: {PREFIXES} prefixes of ~{2 * PREFIX_WORDS} tokens, {CLIENTS} clients")
    print(table(rows))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "restart.json").write_text(json.dumps({
        "scenario": "restart", "workers": workers.description, "urls": workers.urls,
        "prefixes": PREFIXES, "prefix_tokens_approx": 2 * PREFIX_WORDS, "clients": CLIENTS,
        "window_s": WINDOW_S, "time_scale": ts, "runs": rows}, indent=1, default=str))
    plot(rows, out / "restart.png", f"python -m gateway.bench.routers --scenario restart:"
         f" {workers.description}")
    print(f"wrote {out / 'restart.json'}, {out / 'restart.png'}")
    notes = [f"time scale {ts:g}: wall-clock latencies are {ts:g}x the modelled H100's"]
    return ScenarioResult("restart", workers, lineup, [], verdicts, notes)
