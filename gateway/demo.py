"""``kvgate demo``: the whole product on one machine with no GPU, no Redis, no model files.

It starts simulated vLLM workers in two pools (short-chat and long-context; Llama-3-8B on H100
cost model by default), and the gateway in front of them with in-memory state, all in one process.
It prints the URL and ready-to-paste curl and openai-client snippets, and stops everything cleanly
on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from collections.abc import Generator
from typing import Any

import uvicorn

from gateway.config import Settings, build_settings

MODEL_NAME = "sim-llama-3-8b"


def demo_settings(
    short_urls: list[str], long_urls: list[str], host: str, port: int, policy: str
) -> Settings:
    return build_settings({
        "listen": {"host": host, "port": port},
        "models": [{"name": MODEL_NAME, "tokenizer": "simple", "architecture": "llama-3-8b"}],
        "pools": [
            {"name": "short-chat", "max_context_tokens": 8192, "policy": policy,
             "workers": short_urls},
            {"name": "long-context", "max_context_tokens": 131072, "policy": policy,
             "workers": long_urls},
        ],
    })


def banner(url: str) -> str:
    return f"""
kvgate demo is running: {url}
  pools: short-chat (<= 8K tokens) and long-context (<= 128K tokens), simulated Llama-3-8B on H100

  curl {url}/v1/chat/completions -H 'content-type: application/json' \\
    -d '{{"model": "{MODEL_NAME}", "messages": [{{"role": "user", "content": "Hello!"}}]}}'

  python -c 'import openai; c = openai.OpenAI(base_url="{url}/v1", api_key="none");
  print(c.chat.completions.create(model="{MODEL_NAME}",
        messages=[{{"role": "user", "content": "Hello!"}}]).choices[0].message.content)'

  metrics: {url}/metrics    readiness: {url}/ready
Ctrl-C stops everything.
"""


class _Server(uvicorn.Server):
    """uvicorn re-raises a captured SIGTERM once it has shut down, which would kill the demo
    before it stops its simulated workers; here the demo owns the signals instead."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    def request_exit(self) -> None:
        self.should_exit = True


async def run_demo(args: argparse.Namespace) -> None:
    from gateway.app import create_app
    from gateway.sim.config import SimWorkerConfig
    from gateway.sim.fleet import SimFleet

    short = SimWorkerConfig(model_name=MODEL_NAME, profile=args.profile, max_model_len=8192,
                            time_scale=args.time_scale)
    long = SimWorkerConfig(model_name=MODEL_NAME, profile=args.profile, max_model_len=131072,
                           time_scale=args.time_scale)
    configs = [short] * args.short_workers + [long] * args.long_workers
    fleet = SimFleet(configs)
    urls = await fleet.start()
    try:
        settings = demo_settings(urls[: args.short_workers], urls[args.short_workers :],
                                 args.host, args.port, args.policy)
        config = uvicorn.Config(create_app(settings), host=args.host, port=args.port,
                                log_level="warning", access_log=False)
        server = _Server(config)
        url = f"http://{args.host}:{args.port}"
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, server.request_exit)

        async def announce() -> None:
            while not server.started:  # noqa: ASYNC110 (uvicorn offers no event to wait on)
                await asyncio.sleep(0.05)
            print(banner(url), flush=True)

        announcer = asyncio.create_task(announce())
        await server.serve()
        announcer.cancel()
    finally:
        await fleet.stop()
        print("kvgate demo stopped", flush=True)


def _demo(args: argparse.Namespace) -> int:
    asyncio.run(run_demo(args))
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("demo", help="simulated workers in two pools + the gateway",
                              description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--short-workers", type=int, default=2)
    p.add_argument("--long-workers", type=int, default=2)
    p.add_argument("--profile", default="llama-3-8b@h100", help="model@gpu cost model")
    p.add_argument("--policy", default="least_loaded",
                   choices=["round_robin", "least_loaded", "kv_aware"])
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiplies simulated delays (0.1 = 10x faster than real time)")
    p.set_defaults(func=_demo)
