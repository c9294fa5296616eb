"""Benchmark: prefix hit rate with one and with several gateway replicas in front of the same
workers (issue 15 item 3: replicas that agree).

Each replica runs ``kv_aware``; in the *approximate* mode (no KV events) it learns which worker
holds which prefix only from its own routing decisions, so with N replicas behind a round-robin
load balancer each sees 1/N of the traffic and may send a prefix another replica placed to a
worker that does not hold it. In the *events* mode every replica subscribes to every worker's KV
events and shares one truth. The ``+exchange`` modes add the replica exchange
(``replicas.exchange``, ``gateway.kvindex.exchange``) over a redis-server the benchmark starts:
each replica publishes its routes (with events: only those whose blocks no event confirmed yet)
and its load every 25 ms, and applies the others'. The Rust routers (``--peers``: sglang-router and vllm-router with
``cache_aware``, when installed) run as replicas the same way: their trees, like the approximate
mode, are built from their own routing. The load balancer is a kvgate itself (``round_robin``
over the replicas: a gateway is an OpenAI-compatible backend too).

Steps, per configuration (mode x replica count, ``--replicas 1 2 4 8``): start the replicas (and
the balancer), reset every worker's prefix cache, run ``kvgate bench``'s shared-prefix workload
through the balancer, read the workers' prefix-cache hit rate from their ``/metrics``. Workers:
``kvgate sim`` (4 simulated H100s, KV events on). Prints a table and whether the events mode kept
every replica count within 1 point of one replica's hit rate; writes JSON and PNG.

Run: ``python -m gateway.bench.replicas [--replicas 1 2 4 8] [--modes events events+exchange
approximate approximate+exchange] [--peers] [--requests 300] [--out results/replicas]``.
``--cpu`` prints instead the exchange's CPU cost per request on this machine (no processes):
``on_routed`` (the request path), the publish batch's encoding and a receiver's decoding +
``record_routed`` per route, for the shared-prefix workload's prompts (2K-token prefixes),
and a load read through ``WithPeers``.

A restarted replica's warm-up (the snapshot) is measured by ``python -m gateway.bench.routers
--scenario restart`` (contender ``kvgate_approx_snapshot``).
"""

from __future__ import annotations

import argparse
import json
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from gateway.procs.kvgate import GatewayProcess, SimProcess
from gateway.procs.net import Ports
from gateway.procs.peers import SGLANG_ROUTER, VLLM_ROUTER
from gateway.procs.process import ProcessSet, StartError
from gateway.procs.redis import RedisProcess

MODEL = "sim-llama-3-8b"


MODES = ("approximate", "events")
EXCHANGE_MODES = ("approximate+exchange", "events+exchange")
PEER_MODES = {"sglang_cache_aware": SGLANG_ROUTER, "vllm_router_cache_aware": VLLM_ROUTER}


def start_replica(procs: ProcessSet, ports: Ports, mode: str, i: int,
                  workers: list[dict[str, Any]], tmp: Path,
                  exchange: dict[str, Any] | None = None) -> str:
    """Start replica ``i`` of ``mode``; its URL. ``exchange``: the ``replicas`` settings of the
    ``+exchange`` modes (its Redis, and a key prefix of this configuration's)."""
    if mode in PEER_MODES:
        router = PEER_MODES[mode]
        binary = router.find()
        if binary is None:
            raise router.missing()
        port = ports.take()
        procs.start(f"replica{i}", router.process(binary, port, ports.take(),
                                                  [w["url"] for w in workers], MODEL),
                    timeout_s=90)
        return f"http://127.0.0.1:{port}"
    events = mode.split("+")[0] == "events"
    pool_workers = workers if events else [{"url": w["url"]} for w in workers]
    config: dict[str, Any] = {
        "models": [{"name": MODEL, "tokenizer": "simple"}],
        "pools": [{"name": "p", "max_context_tokens": 131072, "policy": "kv_aware",
                   "workers": pool_workers}],
    }
    if exchange is not None:
        config["replicas"] = exchange
    return procs.start(f"replica{i}", GatewayProcess(config, tmp / f"replica{i}.yaml")).url


def exchange_settings(mode: str, redis_url: str | None) -> dict[str, Any] | None:
    """The ``replicas`` settings of an ``+exchange`` mode, with a key prefix of its own (a
    snapshot left by another configuration must not warm this one's index)."""
    if not mode.endswith("+exchange"):
        return None
    if redis_url is None:
        raise StartError("the +exchange modes need redis-server")
    return {"exchange": True, "redis_url": redis_url,
            "key_prefix": f"bench:replicas:{secrets.token_hex(4)}"}


def run_config(workers: list[dict[str, Any]], replicas: int, mode: str, args: argparse.Namespace,
               tmp: Path, ports: Ports, redis_url: str | None = None) -> dict[str, Any]:
    exchange = exchange_settings(mode, redis_url)
    with ProcessSet(tmp / f"logs-{replicas}-{mode}") as procs:
        replica_urls = [start_replica(procs, ports, mode, i, workers, tmp, exchange)
                        for i in range(replicas)]
        front = procs.start("balancer", GatewayProcess({
            "models": [{"name": MODEL, "tokenizer": "simple"}],
            "pools": [{"name": "lb", "max_context_tokens": 131072, "policy": "round_robin",
                       "workers": replica_urls}],
            "timeouts": {"first_token_s": 600},
        }, tmp / "balancer.yaml")).url
        out = tmp / f"bench-{replicas}-{mode}"
        urls = [w["url"] for w in workers]
        cmd = [sys.executable, "-m", "gateway.bench.cli", "--url", front, "--model", MODEL,
               "--workload", "shared-prefix", "--requests", str(args.requests),
               "--rate", str(args.rate), "--prefixes", "16", "--prefix-tokens", "2048",
               "--max-tokens", "16", "--ignore-eos", "--no-progress", "--no-plots",
               "--out", str(out), "--worker-url", *urls,
               "--reset-url", *[u + "/reset_prefix_cache" for u in urls]]
        out.mkdir(parents=True, exist_ok=True)
        with (out / "bench.log").open("wb") as log:
            done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
        if done.returncode != 0:
            tail = (out / "bench.log").read_text(errors="replace").strip().splitlines()[-3:]
            raise subprocess.CalledProcessError(done.returncode, cmd, "\n".join(tail))
        data = json.loads((out / "bench.json").read_text())
        return {"replicas": replicas, "mode": mode, "bench": _summary(data)}


def _summary(data: dict[str, Any]) -> dict[str, Any]:
    """Hit rate and TTFT of the (single) target of a ``kvgate bench`` run."""
    target = data["targets"][0]
    ttft = target["summary"]["ttft_s"]
    return {"hit_rate": (target.get("prefix_cache") or {}).get("hit_rate"),
            "ttft_p50_ms": 1000 * ttft["p50"], "ttft_p99_ms": 1000 * ttft["p99"]}


def within_one_point(results: list[dict[str, Any]], mode: str) -> list[str]:
    """The verdict lines: each replica count of ``mode`` against one replica's hit rate."""
    rates = {r["replicas"]: r["bench"].get("hit_rate") for r in results if r["mode"] == mode}
    one = rates.get(1)
    lines = []
    for n, rate in sorted(rates.items()):
        if n == 1:
            continue
        if one is None or rate is None:
            lines.append(f"{mode} x{n}: not measured")
            continue
        gap = 100 * (one - rate)
        verdict = "met" if gap <= 1.0 else "missed"
        lines.append(f"[{verdict:>6}] {mode} x{n}: {100 * rate:.1f}% vs {100 * one:.1f}% with one "
                     f"replica ({gap:+.1f} points; target within 1)")
    return lines


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6))
    for mode in dict.fromkeys(r["mode"] for r in results):
        pts = sorted((r["replicas"], 100 * (r["bench"].get("hit_rate") or 0.0))
                     for r in results if r["mode"] == mode)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("replicas behind a round-robin balancer")
    ax.set_ylabel("prefix-cache hit rate (%)")
    ax.legend(fontsize=8)
    fig.suptitle("python -m gateway.bench.replicas: 4 simulated H100s, shared-prefix", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def cpu_cost(rounds: int = 2000) -> list[tuple[str, float]]:
    """(what, microseconds per route or read): the exchange's work per request, measured here
    (best of 5 runs of ``rounds``)."""
    import time

    from gateway.config import ReplicaSettings
    from gateway.kvindex.exchange import ReplicaExchange
    from gateway.kvindex.hashing import block_hashes
    from gateway.kvindex.index import BlockIndex
    from gateway.kvindex.service import PrefixIndex
    from gateway.workers.worker import LocalLoad, Worker

    urls = [f"http://w{i}:8000" for i in range(4)]

    def replica() -> ReplicaExchange:
        index = PrefixIndex(BlockIndex())
        for u in urls:
            index.set_worker(u, 16, 1024, None)
        settings = ReplicaSettings.model_validate({"max_bytes_per_s": 1 << 30})
        return ReplicaExchange(settings, "redis://x:1/0", index)

    prefixes = [[p * 100_000 + i for i in range(2048)] for p in range(16)]
    routes = [block_hashes(prefixes[i % 16] + [900_000 + i * 64 + j for j in range(64)], 16)
              for i in range(rounds)]

    def best(fn: Any) -> float:
        times = []
        for _ in range(5):
            t0 = time.perf_counter_ns()
            fn()
            times.append(time.perf_counter_ns() - t0)
        return min(times) / 1000 / rounds

    sender, receiver = replica(), replica()

    def route_all() -> None:
        for i, r in enumerate(routes):
            sender.on_routed(urls[i % 4], 16, r)
        sender._queue.clear()

    out = [("on_routed (request path)", best(route_all))]
    for batch in (1, 8):
        msgs: list[bytes] = []

        def publish(batch: int = batch, msgs: list[bytes] = msgs) -> None:
            msgs.clear()
            for i in range(0, rounds, batch):
                for j, r in enumerate(routes[i:i + batch]):
                    sender.on_routed(urls[(i + j) % 4], 16, r)
                sender._allowance = 1e12
                data = sender.next_message()
                assert data is not None
                msgs.append(data)

        def receive(msgs: list[bytes] = msgs) -> None:
            for m in msgs:
                receiver.receive(m)

        out.append((f"encode, {batch} route(s) per batch", best(publish)))
        out.append((f"receive + record_routed, {batch} route(s) per message", best(receive)))
    local = Worker(url=urls[0], pool="p", load=LocalLoad())
    peered = Worker(url=urls[1], pool="p", load=LocalLoad())
    sender.attach(peered)

    def read(w: Worker) -> None:
        for _ in routes:
            w.gateway_inflight  # noqa: B018 - the read is what is measured

    out.append(("load read, plain", best(lambda: read(local))))
    out.append(("load read, with peers", best(lambda: read(peered))))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--rate", type=float, default=15.0)
    parser.add_argument("--time-scale", type=float, default=4.0)
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2],
                        help="replica counts to run (default: 1 2)")
    parser.add_argument("--peers", action="store_true",
                        help="also run sglang-router and vllm-router (cache_aware) as replicas")
    parser.add_argument("--modes", nargs="+", choices=[*MODES, *EXCHANGE_MODES, *PEER_MODES],
                        help="run only these modes (default: both kvgate modes, plus the peers"
                             " with --peers)")
    parser.add_argument("--out", default="results/replicas")
    parser.add_argument("--cpu", action="store_true",
                        help="print the exchange's CPU cost per request and exit")
    args = parser.parse_args(argv)
    if args.cpu:
        for what, us in cpu_cost():
            print(f"{what:<48}{us:>8.2f} us")
        return 0
    ports = Ports(24000)
    modes = args.modes or [*MODES, *(PEER_MODES if args.peers else ())]
    results = []
    with tempfile.TemporaryDirectory() as tmp, ProcessSet(Path(tmp)) as procs:
        sim = procs.start("sim", SimProcess(
            ports.take(4), workers=4, time_scale=args.time_scale,
            kv_events_base_port=ports.take(8),
            extra_args=["--profile", "llama-3-8b@h100", "--num-gpu-blocks", "1024"]))
        workers = [{"url": url, "kv_events_endpoint": pub, "kv_replay_endpoint": replay}
                   for url, (pub, replay) in zip(sim.urls, sim.events, strict=True)]
        redis_url = None
        if any(m.endswith("+exchange") for m in modes):
            try:
                redis_url = procs.start("redis", RedisProcess(Path(tmp) / "redis"),
                                        timeout_s=15).url
            except StartError as exc:
                print(f"replicas: no redis-server, the +exchange modes are skipped: {exc}",
                      flush=True)
        for mode in modes:
            for replicas in args.replicas:
                try:
                    results.append(run_config(workers, replicas, mode, args, Path(tmp), ports,
                                              redis_url))
                except StartError as exc:
                    print(f"replicas: {mode} skipped: {str(exc).splitlines()[0]}", flush=True)
                    break
                except subprocess.CalledProcessError as exc:
                    print(f"replicas: {mode} x{replicas}: the load generator failed:\n"
                          f"{exc.output}", flush=True)
                    break
    print(f"{'mode':<25}{'replicas':>9}{'hit rate':>10}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}")
    for r in results:
        b = r["bench"]
        hit = b.get("hit_rate")
        print(f"{r['mode']:<25}{r['replicas']:>9}"
              f"{(f'{100 * hit:.1f}%' if isinstance(hit, float) else '-'):>10}"
              f"{b.get('ttft_p50_ms') or 0:>13.1f}{b.get('ttft_p99_ms') or 0:>13.1f}")
    print("\ntargets:")
    for mode in ("events", *EXCHANGE_MODES):
        for line in within_one_point(results, mode):
            print("  " + line)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "replicas.json").write_text(json.dumps(results, indent=2))
    plot(results, out / "replicas.png")
    print(f"wrote {out / 'replicas.json'}, {out / 'replicas.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
