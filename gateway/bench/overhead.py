"""Benchmark: the gateway's own overhead, gateway vs direct, in one run.

Steps: start the no-op backend (``gateway.bench.noop``) and a gateway in front of it, each in its
own process on loopback; then run the same load generator (wrk, small non-streaming chat bodies,
concurrency 32) against the backend directly and through the gateway, alternating rounds so drift
hits both sides alike. Reported: throughput ratio (gateway / direct) and the p50/p99 latency the
gateway adds. Compared to: the peers measured on these machines (vllm-router round_robin reaches
0.76 of direct, sglang-router 0.57-0.73, LiteLLM 0.006; ``../shared/notes/peers.md``).

On 2 cores the backend, the gateway and wrk share the CPU, so the ratio understates what a gateway
on its own cores achieves; the added latency is the number to read.

Run: ``python -m gateway.bench.overhead [--duration-s 10] [--rounds 2] [--out results/overhead]``.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gateway.procs.kvgate import GatewayProcess, noop_backend
from gateway.procs.process import ProcessSet

LUA = """
wrk.method = "POST"
wrk.body = '{"model":"noop","messages":[{"role":"user","content":"Say hello to the gateway benchmark, please."}],"max_tokens":16}'
wrk.headers["Content-Type"] = "application/json"
"""


@dataclass(frozen=True)
class WrkResult:
    target: str
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    non_2xx: int


def _ms(value: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s)", value)
    if not m:
        raise ValueError(value)
    scale = {"us": 0.001, "ms": 1.0, "s": 1000.0}[m.group(2)]
    return float(m.group(1)) * scale


def parse_wrk(target: str, out: str) -> WrkResult:
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    p50 = _ms(re.search(r"^\s+50%\s+(\S+)", out, re.M).group(1))  # type: ignore[union-attr]
    p99 = _ms(re.search(r"^\s+99%\s+(\S+)", out, re.M).group(1))  # type: ignore[union-attr]
    m = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    return WrkResult(target, rps, p50, p99, int(m.group(1)) if m else 0)


def run_wrk(url: str, target: str, duration_s: int, connections: int, script: Path) -> WrkResult:
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{duration_s}s", "--latency", "-s", str(script),
         f"{url}/v1/chat/completions"],
        check=True, capture_output=True, text=True,
    ).stdout
    return parse_wrk(target, out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--backend-port", type=int, default=18001)
    parser.add_argument("--gateway-port", type=int, default=18000)
    parser.add_argument("--delay-ms", type=float, default=20.0,
                        help="backend delay of the third scenario (a stand-in for model time)")
    parser.add_argument("--out", default="results/overhead")
    args = parser.parse_args(argv)
    if shutil.which("wrk") is None:
        print("wrk is not installed (apt-get install wrk)", file=sys.stderr)
        return 2

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    scenarios = [(0.0, args.connections), (0.0, 1), (args.delay_ms, args.connections)]
    summaries = [
        _scenario(delay_ms, conns, args.duration_s, args.rounds, args.backend_port,
                  args.gateway_port)
        for delay_ms, conns in scenarios
    ]
    print()
    print(f"{'backend':>10}{'conc':>6}{'direct r/s':>12}{'gateway r/s':>13}{'ratio':>8}"
          f"{'p50 direct':>12}{'p50 gw':>9}{'+p50 ms':>9}{'+p99 ms':>9}")
    for s in summaries:
        d, g = s["direct"], s["gateway"]
        print(f"{s['backend_delay_ms']:>8.0f}ms{s['connections']:>6}{d['requests_per_s']:>12.0f}"
              f"{g['requests_per_s']:>13.0f}{s['throughput_ratio']:>8.3f}{d['p50_ms']:>12.2f}"
              f"{g['p50_ms']:>9.2f}{s['added_p50_ms']:>9.2f}{s['added_p99_ms']:>9.2f}")
    (out_dir / "overhead.json").write_text(json.dumps(summaries, indent=2))
    _plot(summaries, out_dir / "overhead.png")
    print(f"wrote {out_dir / 'overhead.json'} and {out_dir / 'overhead.png'}")
    return 0


def _scenario(delay_ms: float, connections: int, duration_s: int, rounds: int,
              backend_port: int, gateway_port: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp, ProcessSet(Path(tmp)) as procs:
        script = Path(tmp) / "post.lua"
        script.write_text(LUA)
        noop, backend = noop_backend(backend_port, delay_ms)
        procs.start("noop", noop, wait=False)
        gw = procs.start("kvgate", GatewayProcess({
            "models": [{"name": "noop", "tokenizer": "simple"}],
            "pools": [{"name": "short-chat", "max_context_tokens": 8192, "workers": [backend]}],
        }, Path(tmp) / "kvgate.yaml", port=gateway_port), wait=False)
        noop.wait_ready(60)
        gw.wait_ready(60)
        run_wrk(gw.url, "warmup", 2, connections, script)
        results: list[WrkResult] = []
        for _ in range(rounds):
            results.append(run_wrk(backend, "direct", duration_s, connections, script))
            results.append(run_wrk(gw.url, "gateway", duration_s, connections, script))

    def best(target: str) -> WrkResult:
        return max((r for r in results if r.target == target), key=lambda r: r.requests_per_s)

    direct, via = best("direct"), best("gateway")
    return {
        "backend_delay_ms": delay_ms,
        "connections": connections,
        "direct": asdict(direct),
        "gateway": asdict(via),
        "throughput_ratio": via.requests_per_s / direct.requests_per_s,
        "added_p50_ms": via.p50_ms - direct.p50_ms,
        "added_p99_ms": via.p99_ms - direct.p99_ms,
        "rounds": [asdict(r) for r in results],
        "duration_s": duration_s,
    }


def _plot(summaries: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(summaries), figsize=(4 * len(summaries), 3.2))
    for ax, s in zip(axes, summaries, strict=True):
        d, g = s["direct"], s["gateway"]
        x = range(2)
        ax.bar([i - 0.2 for i in x], [d["p50_ms"], d["p99_ms"]], 0.4, label="direct",
               color="grey")
        ax.bar([i + 0.2 for i in x], [g["p50_ms"], g["p99_ms"]], 0.4, label="gateway",
               color="C0")
        ax.set_xticks(list(x), ["p50", "p99"])
        ax.set_ylabel("latency ms")
        ax.set_title(f"backend {s['backend_delay_ms']:.0f} ms, c={s['connections']}\n"
                     f"throughput ratio {s['throughput_ratio']:.2f}", fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    raise SystemExit(main())
