"""Waves of long-prefix chats through ``kvgate serve --processes 2`` in front of 4 simulated
workers with KV events: how many route messages the processes exchanged and how many a
sibling's full socket queue dropped (``kvgate_sibling_routes_total``).

Run: ``.venv/bin/python scripts/sibling_wave.py [--wave 256] [--waves 3]``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
from pathlib import Path

import aiohttp
import httpx

from gateway.procs.kvgate import GatewayProcess, SimProcess
from gateway.procs.net import free_port
from gateway.procs.process import ProcessSet

MODEL = "sim-llama-3-8b"
PREFIXES = 16


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--wave", type=int, default=256, help="concurrent requests per wave")
    p.add_argument("--waves", type=int, default=3)
    args = p.parse_args()
    words = [f"w{i}" for i in range(5000)]
    prefixes = [" ".join(random.Random(k).choices(words, k=1500)) for k in range(PREFIXES)]
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="kvgate-wave-") as tmp, \
            ProcessSet(Path(tmp)) as procs:
        sim = procs.start("sim", SimProcess(workers=4, kv_events_base_port=free_port() + 100),
                          timeout_s=60)
        config = {"models": [{"name": MODEL, "tokenizer": "simple"}],
                  "pools": [{"name": "p", "max_context_tokens": 32768, "policy": "kv_aware",
                             "workers": [{"url": u, "kv_events_endpoint": e,
                                          "kv_replay_endpoint": r}
                                         for u, (e, r) in zip(sim.urls, sim.events, strict=True)]}]}
        gw = procs.start("gateway", GatewayProcess(config, Path(tmp) / "gateway.yaml",
                                                   processes=2), timeout_s=60)

        async def one(session: aiohttp.ClientSession, i: int) -> int:
            body = {"model": MODEL, "max_tokens": 4, "messages": [
                {"role": "system", "content": prefixes[i % PREFIXES]},
                {"role": "user", "content": f"question {i} " + " ".join(rng.choices(words, k=50))}]}
            async with session.post(gw.url + "/v1/chat/completions", json=body) as r:
                await r.read()
                return r.status

        async def waves() -> None:
            # a connection per request: the kernel spreads them over both processes
            conn = aiohttp.TCPConnector(limit=0, force_close=True)
            async with aiohttp.ClientSession(connector=conn) as session:
                for w in range(args.waves):
                    codes = await asyncio.gather(*(one(session, w * args.wave + i)
                                                   for i in range(args.wave)))
                    print(f"wave {w}: " + ", ".join(f"{codes.count(c)} x {c}"
                                                    for c in sorted(set(codes))))

        asyncio.run(waves())
        text = httpx.get(gw.url + "/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith("kvgate_sibling_routes"):
                print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
