"""``kvgate demo``: the whole product on one machine with no GPU, no Redis, no model files.

It starts simulated vLLM workers in two pools (short-chat and long-context; Llama-3-8B on H100
cost model by default), and the gateway in front of them with in-memory state, all in one process.
It prints the URL and ready-to-paste curl and openai-client snippets, and stops everything cleanly
on Ctrl-C.

``--disaggregated`` serves one prefill/decode pool instead (``disaggregated``, 128K tokens):
``--prefill-workers`` simulated workers with the NIXL connector's ``kv_producer`` role compute
every prompt, ``--decode-workers`` ``kv_consumer`` workers pull its KV and generate (the gateway
runs vLLM's two steps, see ``gateway.upstream.disagg``); the transfer is priced at the
simulator's link bandwidth (200 Gb/s).
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from gateway import gil
from gateway.config import PolicyName, Settings, build_settings

MODEL_NAME = "sim-llama-3-8b"


def demo_settings(
    short: list[dict[str, Any]], long: list[dict[str, Any]], host: str, port: int, policy: str
) -> Settings:
    return build_settings({
        "listen": {"host": host, "port": port},
        "models": [{"name": MODEL_NAME, "tokenizer": "simple", "architecture": "llama-3-8b"}],
        "pools": [
            {"name": "short-chat", "max_context_tokens": 8192, "policy": policy,
             "workers": short},
            {"name": "long-context", "max_context_tokens": 131072, "policy": policy,
             "workers": long},
        ],
    })


def disaggregated_settings(
    prefill: list[dict[str, Any]], decode: list[dict[str, Any]], host: str, port: int, policy: str
) -> Settings:
    """One disaggregated pool: ``prefill`` workers compute prompts, ``decode`` workers answer."""
    return build_settings({
        "listen": {"host": host, "port": port},
        "models": [{"name": MODEL_NAME, "tokenizer": "simple", "architecture": "llama-3-8b"}],
        "pools": [
            {"name": "disaggregated", "max_context_tokens": 131072, "policy": policy,
             "workers": decode, "prefill_workers": prefill},
        ],
    })


SHARED_POOLS = ("pools: short-chat (<= 8K tokens) and long-context (<= 128K tokens),"
                " simulated Llama-3-8B on H100")


def pd_pools(prefill_workers: int, decode_workers: int) -> str:
    return (f"pool: disaggregated (<= 128K tokens): {prefill_workers} prefill (kv_producer) +"
            f" {decode_workers} decode (kv_consumer) simulated Llama-3-8B on H100;\n"
            "  prompts are computed on a prefill worker, their KV pulled by the decode worker;\n"
            "  see kvgate_prefill_seconds and kvgate_decode_first_token_seconds in /metrics")


def banner(url: str, pools: str = SHARED_POOLS) -> str:
    return f"""
kvgate demo is running: {url}
  {pools}

  curl {url}/v1/chat/completions -H 'content-type: application/json' \\
    -d '{{"model": "{MODEL_NAME}", "messages": [{{"role": "user", "content": "Hello!"}}]}}'

  python -c 'import openai; c = openai.OpenAI(base_url="{url}/v1", api_key="none");
  print(c.chat.completions.create(model="{MODEL_NAME}",
        messages=[{{"role": "user", "content": "Hello!"}}]).choices[0].message.content)'

  metrics: {url}/metrics    readiness: {url}/ready
Ctrl-C stops everything.
"""


async def run_demo(args: argparse.Namespace) -> None:
    from gateway.app import create_app
    from gateway.server import GatewayServer, http_limits, set_log_level
    from gateway.sim.config import KVRole, SimWorkerConfig
    from gateway.sim.fleet import SimFleet
    from gateway.supervisor import bind

    # The gateway's port first: the workers below take ephemeral ports, and one of them could
    # otherwise be the port asked for (free when asked, taken by the time the gateway binds).
    try:
        sock = bind(args.host, args.port)
    except OSError as exc:
        raise SystemExit(f"kvgate demo: cannot listen on {args.host}:{args.port}: {exc}") from None

    # Every simulated worker publishes KV events (vLLM's wire format) on a free loopback port,
    # so kv_aware routing in the demo is the precise, event-driven kind.
    def sim(max_model_len: int, kv_role: KVRole | None = None) -> SimWorkerConfig:
        return SimWorkerConfig(
            model_name=MODEL_NAME, profile=args.profile, time_scale=args.time_scale,
            max_model_len=max_model_len, kv_events=True,
            kv_events_endpoint="tcp://127.0.0.1:*", kv_replay_endpoint="tcp://127.0.0.1:*",
            kv_role=kv_role,
        )

    if args.disaggregated:
        first = args.prefill_workers
        configs = ([sim(131072, "kv_producer")] * first
                   + [sim(131072, "kv_consumer")] * args.decode_workers)
    else:
        first = args.short_workers
        configs = [sim(8192)] * args.short_workers + [sim(131072)] * args.long_workers
    fleet = SimFleet(configs)
    try:
        urls = await fleet.start()
        workers: list[dict[str, Any]] = []
        for url, w in zip(urls, fleet.workers, strict=True):
            assert w.publisher is not None
            workers.append({"url": url, "kv_events_endpoint": w.publisher.endpoint,
                            "kv_replay_endpoint": w.publisher.replay_endpoint})
        if args.disaggregated:
            settings = disaggregated_settings(workers[:first], workers[first:], args.host,
                                              args.port, args.policy)
            pools = pd_pools(args.prefill_workers, args.decode_workers)
        else:
            settings = demo_settings(workers[:first], workers[first:], args.host, args.port,
                                     args.policy)
            pools = SHARED_POOLS
        set_log_level("warning")
        gil.install()
        server = GatewayServer(create_app(settings), sock=sock, grace_s=settings.shutdown.grace_s,
                               limits=http_limits(settings))
        url = f"http://{args.host}:{args.port}"

        async def announce() -> None:
            print(banner(url, pools), flush=True)

        await server.serve(announce)
    finally:
        sock.close()
        await fleet.stop()
        print("kvgate demo stopped", flush=True)


def _demo(args: argparse.Namespace) -> int:
    asyncio.run(run_demo(args))
    return 0


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("demo", help="simulated workers in two pools + the gateway",
                              description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--short-workers", type=int, default=2)
    p.add_argument("--long-workers", type=int, default=2)
    p.add_argument("--disaggregated", action="store_true",
                   help="one prefill/decode pool instead of the two pools")
    p.add_argument("--prefill-workers", type=_positive, default=1,
                   help="with --disaggregated: kv_producer workers (default 1)")
    p.add_argument("--decode-workers", type=_positive, default=2,
                   help="with --disaggregated: kv_consumer workers (default 2)")
    p.add_argument("--profile", default="llama-3-8b@h100", help="model@gpu cost model")
    p.add_argument("--policy", default=PolicyName.KV_AWARE, choices=list(PolicyName))
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiplies simulated delays (0.1 = 10x faster than real time)")
    p.set_defaults(func=_demo)
