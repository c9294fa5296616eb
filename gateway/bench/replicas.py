"""Benchmark: prefix hit rate with one and with two gateway replicas in front of the same workers.

Each replica runs ``kv_aware``; in the *approximate* mode (no KV events) it learns which worker
holds which prefix only from its own routing decisions, so with two replicas behind a round-robin
load balancer each sees half the traffic and may send a prefix the other replica placed to a
worker that does not hold it. In the *events* mode both replicas subscribe to every worker's KV
events and share one truth. The load balancer is a kvgate itself (``round_robin`` over the
replicas: a gateway is an OpenAI-compatible backend too).

Steps, per configuration (approx x1, approx x2, events x1, events x2): start the replicas (and
the balancer), reset every worker's prefix cache, run ``kvgate bench``'s shared-prefix workload
through the balancer, read the workers' prefix-cache hit rate from their ``/metrics``. Workers:
``kvgate sim`` (4 simulated H100s, KV events on). Prints a table, writes JSON and PNG.

Run: ``python -m gateway.bench.replicas [--requests 300] [--out results/replicas]``.
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
from gateway.procs.process import ProcessSet

MODEL = "sim-llama-3-8b"


def run_config(workers: list[dict[str, Any]], replicas: int, events: bool, args: argparse.Namespace,
               tmp: Path) -> dict[str, Any]:
    with ProcessSet(tmp / f"logs-{replicas}-{events}") as procs:
        pool_workers = [w if events else {"url": w["url"]} for w in workers]
        replica_urls = []
        for i in range(replicas):
            replica = procs.start(f"replica{i}", GatewayProcess({
                "models": [{"name": MODEL, "tokenizer": "simple"}],
                "pools": [{"name": "p", "max_context_tokens": 131072, "policy": "kv_aware",
                           "workers": pool_workers}],
            }, tmp / f"replica{i}.yaml"))
            replica_urls.append(replica.url)
        front = procs.start("balancer", GatewayProcess({
            "models": [{"name": MODEL, "tokenizer": "simple"}],
            "pools": [{"name": "lb", "max_context_tokens": 131072, "policy": "round_robin",
                       "workers": replica_urls}],
            "timeouts": {"first_token_s": 600},
        }, tmp / "balancer.yaml")).url
        out = tmp / f"bench-{replicas}-{events}"
        urls = [w["url"] for w in workers]
        cmd = [sys.executable, "-m", "gateway.bench.cli", "--url", front, "--model", MODEL,
               "--workload", "shared-prefix", "--requests", str(args.requests),
               "--rate", str(args.rate), "--prefixes", "16", "--prefix-tokens", "2048",
               "--max-tokens", "16", "--ignore-eos", "--no-progress", "--no-plots",
               "--out", str(out), "--worker-url", *urls,
               "--reset-url", *[u + "/reset_prefix_cache" for u in urls]]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        data = json.loads((out / "bench.json").read_text())
        return {"replicas": replicas, "events": events, "bench": _summary(data)}


def _summary(data: dict[str, Any]) -> dict[str, Any]:
    """Hit rate and TTFT of the (single) target of a ``kvgate bench`` run."""
    target = data["targets"][0]
    ttft = target["summary"]["ttft_s"]
    return {"hit_rate": (target.get("prefix_cache") or {}).get("hit_rate"),
            "ttft_p50_ms": 1000 * ttft["p50"], "ttft_p99_ms": 1000 * ttft["p99"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--rate", type=float, default=15.0)
    parser.add_argument("--time-scale", type=float, default=4.0)
    parser.add_argument("--out", default="results/replicas")
    args = parser.parse_args(argv)
    ports = Ports(24000)
    results = []
    with tempfile.TemporaryDirectory() as tmp, ProcessSet(Path(tmp)) as procs:
        sim = procs.start("sim", SimProcess(
            ports.take(4), workers=4, time_scale=args.time_scale,
            kv_events_base_port=ports.take(8),
            extra_args=["--profile", "llama-3-8b@h100", "--num-gpu-blocks", "1024"]))
        workers = [{"url": url, "kv_events_endpoint": pub, "kv_replay_endpoint": replay}
                   for url, (pub, replay) in zip(sim.urls, sim.events, strict=True)]
        for events in (False, True):
            for replicas in (1, 2):
                results.append(run_config(workers, replicas, events, args, Path(tmp)))
    print(f"{'mode':<12}{'replicas':>9}{'hit rate':>10}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}")
    for r in results:
        b = r["bench"]
        hit = b.get("hit_rate")
        print(f"{'events' if r['events'] else 'approximate':<12}{r['replicas']:>9}"
              f"{(f'{100 * hit:.1f}%' if isinstance(hit, float) else '-'):>10}"
              f"{b.get('ttft_p50_ms') or 0:>13.1f}{b.get('ttft_p99_ms') or 0:>13.1f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "replicas.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
