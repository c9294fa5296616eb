"""Measure a simulated fleet: CPU cost idle and under load, and TTFT/TPOT against the cost model.

``python -m gateway.sim.measure [--workers 16] [--profile llama-3-8b@h100] [--load-seconds 10]``

The fleet runs as ``kvgate sim`` in a child process, so its CPU time (read from
``/proc/PID/stat``, all threads) is separate from this load generator's. Three parts:

1. idle: the fleet's CPU over a few seconds with no traffic;
2. load: ``--streams-per-worker`` concurrent clients per worker, each sending streaming
   completions back to back; the fleet's CPU, the tokens streamed per second, median TTFT/TPOT;
3. calibration: one request at a time on an idle worker, for several prompt lengths; the
   client-side TTFT and TPOT against ``planner.prefill_time_s`` / ``planner.decode_step_time_s``.

Prints a table; not a test (the numbers depend on the host).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import orjson

from gateway import promtext
from gateway.planner import decode_step_time_s, parse_profile, prefill_time_s

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime


@dataclass
class StreamTiming:
    ttft_s: float
    tpot_s: float | None
    tokens: int


async def stream_once(
    client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int
) -> StreamTiming:
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    t0 = time.monotonic()
    stamps: list[float] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                n = len(orjson.loads(line[6:])["choices"][0]["text"].split())
                stamps.extend([time.monotonic()] * n)
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None
    return StreamTiming(stamps[0] - t0, tpot, len(stamps))


async def measure(args: argparse.Namespace, pid: int, urls: list[str]) -> None:
    model, gpu = parse_profile(args.profile)
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=1000)) as client:
        await asyncio.sleep(1.0)
        c0, w0 = cpu_seconds(pid), time.monotonic()
        await asyncio.sleep(args.idle_seconds)
        idle = (cpu_seconds(pid) - c0) / (time.monotonic() - w0)
        print(f"fleet of {args.workers}: idle CPU {idle * 100:.2f}% of one core")

        results: list[StreamTiming] = []
        stop_at = time.monotonic() + args.load_seconds

        async def client_loop(url: str, k: int) -> None:
            i = 0
            while time.monotonic() < stop_at:
                prompt = [16 + (k * 7919 + i * 104729 + j) % 30000 for j in range(args.load_prompt)]
                results.append(await stream_once(client, url, prompt, args.load_max_tokens))
                i += 1

        c0, w0, own0 = cpu_seconds(pid), time.monotonic(), time.process_time()
        await asyncio.gather(
            *(client_loop(u, k) for k in range(args.streams_per_worker) for u in urls)
        )
        wall = time.monotonic() - w0
        busy = (cpu_seconds(pid) - c0) / wall
        own = (time.process_time() - own0) / wall
        tokens = sum(r.tokens for r in results)
        tpots = [r.tpot_s for r in results if r.tpot_s is not None]
        print(
            f"load: {args.streams_per_worker} stream(s)/worker x {args.workers} workers, prompt "
            f"{args.load_prompt}, {args.load_max_tokens} tokens: {len(results)} requests, "
            f"{tokens / wall:.0f} tokens/s streamed, fleet CPU {busy * 100:.1f}% of one core "
            f"({busy / max(tokens / wall, 1e-9) * 1e6:.0f} us/token), load generator CPU {own * 100:.0f}%, "
            f"median TTFT {statistics.median(r.ttft_s for r in results) * 1e3:.1f} ms, "
            f"median TPOT {statistics.median(tpots) * 1e3:.2f} ms"
        )

        pages = [(await client.get(f"{url}/metrics")).text for url in urls]

        def total(name: str) -> float:
            return sum(promtext.value(page, name) or 0.0 for page in pages)

        ttft_sum = total("vllm:time_to_first_token_seconds_sum")
        ttft_n = total("vllm:time_to_first_token_seconds_count")
        itl_sum = total("vllm:inter_token_latency_seconds_sum")
        itl_n = total("vllm:inter_token_latency_seconds_count")
        print(
            f"server side (vllm:* histograms): mean TTFT {ttft_sum / max(ttft_n, 1) * 1e3:.1f} ms, "
            f"mean ITL {itl_sum / max(itl_n, 1) * 1e3:.2f} ms"
        )

        print(
            f"calibration ({args.profile}, time_scale {args.time_scale}, one request on an idle worker):"
        )
        print(
            f"{'prompt':>7} {'TTFT ms':>9} {'model ms':>9} {'err':>7} {'TPOT ms':>9} {'model ms':>9} {'err':>7}"
        )
        for n in args.calibration_prompts:
            prompt = [16 + (n * 31 + j * 7) % 30000 for j in range(n)]
            runs = [await stream_once(client, urls[0], prompt, 33) for _ in range(3)]
            # Later runs hit the prefix cache; only the first is a cold prefill.
            ttft = runs[0].ttft_s
            tpot = statistics.median(r.tpot_s for r in runs if r.tpot_s is not None)
            want_ttft = prefill_time_s(model, gpu, n) * args.time_scale
            want_tpot = decode_step_time_s(model, gpu, n + 16) * args.time_scale
            print(
                f"{n:>7} {ttft * 1e3:>9.2f} {want_ttft * 1e3:>9.2f} {(ttft / want_ttft - 1) * 100:>6.1f}% "
                f"{tpot * 1e3:>9.3f} {want_tpot * 1e3:>9.3f} {(tpot / want_tpot - 1) * 100:>6.1f}%"
            )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gateway.sim.measure", description=__doc__)
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--profile", default="llama-3-8b@h100")
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--idle-seconds", type=float, default=5.0)
    p.add_argument("--load-seconds", type=float, default=10.0)
    p.add_argument("--streams-per-worker", type=int, default=1)
    p.add_argument("--load-prompt", type=int, default=512)
    p.add_argument("--load-max-tokens", type=int, default=64)
    p.add_argument("--calibration-prompts", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    args = p.parse_args(argv)
    cmd = [
        sys.executable, "-m", "gateway.cli", "sim", "--workers", str(args.workers), "--port", "0",
        "--profile", args.profile, "--time-scale", str(args.time_scale), "--kv-events",
        "--kv-events-base-port", "0",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        urls = [proc.stdout.readline().split()[0] for _ in range(args.workers)]
        asyncio.run(measure(args, proc.pid, urls))
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
