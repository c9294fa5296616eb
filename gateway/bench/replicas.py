"""Benchmark: prefix hit rate with one and with several gateway replicas in front of the same
workers (issue 15 item 3: replicas that agree).

Each replica runs ``kv_aware``; in the *approximate* mode (no KV events) it learns which worker
holds which prefix only from its own routing decisions, so with N replicas behind a round-robin
load balancer each sees 1/N of the traffic and may send a prefix another replica placed to a
worker that does not hold it. In the *events* mode every replica subscribes to every worker's KV
events and shares one truth. The Rust routers (``--peers``: sglang-router and vllm-router with
``cache_aware``, when installed) run as replicas the same way: their trees, like the approximate
mode, are built from their own routing. The load balancer is a kvgate itself (``round_robin``
over the replicas: a gateway is an OpenAI-compatible backend too).

Steps, per configuration (mode x replica count, ``--replicas 1 2 4 8``): start the replicas (and
the balancer), reset every worker's prefix cache, run ``kvgate bench``'s shared-prefix workload
through the balancer, read the workers' prefix-cache hit rate from their ``/metrics``. Workers:
``kvgate sim`` (4 simulated H100s, KV events on). Prints a table and whether the events mode kept
every replica count within 1 point of one replica's hit rate; writes JSON and PNG.

Run: ``python -m gateway.bench.replicas [--replicas 1 2 4 8] [--peers] [--requests 300]
[--out results/replicas]``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from gateway.procs.kvgate import GatewayProcess, SimProcess
from gateway.procs.net import Ports
from gateway.procs.peers import SGLANG_ROUTER, VLLM_ROUTER
from gateway.procs.process import ProcessSet, StartError

MODEL = "sim-llama-3-8b"


MODES = ("approximate", "events")
PEER_MODES = {"sglang_cache_aware": SGLANG_ROUTER, "vllm_router_cache_aware": VLLM_ROUTER}


def start_replica(procs: ProcessSet, ports: Ports, mode: str, i: int,
                  workers: list[dict[str, Any]], tmp: Path) -> str:
    """Start replica ``i`` of ``mode``; its URL."""
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
    pool_workers = workers if mode == "events" else [{"url": w["url"]} for w in workers]
    return procs.start(f"replica{i}", GatewayProcess({
        "models": [{"name": MODEL, "tokenizer": "simple"}],
        "pools": [{"name": "p", "max_context_tokens": 131072, "policy": "kv_aware",
                   "workers": pool_workers}],
    }, tmp / f"replica{i}.yaml")).url


def run_config(workers: list[dict[str, Any]], replicas: int, mode: str, args: argparse.Namespace,
               tmp: Path, ports: Ports) -> dict[str, Any]:
    with ProcessSet(tmp / f"logs-{replicas}-{mode}") as procs:
        replica_urls = [start_replica(procs, ports, mode, i, workers, tmp)
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
    parser.add_argument("--modes", nargs="+", choices=[*MODES, *PEER_MODES],
                        help="run only these modes (default: both kvgate modes, plus the peers"
                             " with --peers)")
    parser.add_argument("--out", default="results/replicas")
    args = parser.parse_args(argv)
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
        for mode in modes:
            for replicas in args.replicas:
                try:
                    results.append(run_config(workers, replicas, mode, args, Path(tmp), ports))
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
    for line in within_one_point(results, "events"):
        print("  " + line)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "replicas.json").write_text(json.dumps(results, indent=2))
    plot(results, out / "replicas.png")
    print(f"wrote {out / 'replicas.json'}, {out / 'replicas.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
