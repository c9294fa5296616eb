"""``kvgate sim``: run a fleet of simulated vLLM workers until Ctrl-C / SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import signal
import sys
from typing import Any

from gateway.config import Runner
from gateway.sim.config import KV_LOAD_FAILURE_POLICIES, KV_ROLES, SimWorkerConfig
from gateway.sim.fleet import SimFleet


def register(subparsers: Any) -> None:
    """Add the ``sim`` subcommand to ``kvgate``'s subparsers."""
    d = SimWorkerConfig()
    p: argparse.ArgumentParser = subparsers.add_parser(
        "sim", help="run simulated vLLM workers (OpenAI API, /metrics, KV events)"
    )
    p.add_argument("--workers", type=int, default=1, help="number of workers (default 1)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument(
        "--port",
        type=int,
        default=8100,
        help="first port; workers take consecutive ports (0: free ports)",
    )
    p.add_argument(
        "--profile", default=d.profile, help="cost model MODEL@GPU (default %(default)s)"
    )
    p.add_argument("--model-name", default=d.model_name)
    p.add_argument(
        "--tokenizer", default=d.tokenizer, help="'simple' or a tokenizer directory / model id"
    )
    p.add_argument("--block-size", type=int, default=d.block_size_tokens)
    p.add_argument(
        "--num-gpu-blocks", type=int, default=None, help="default: derived from GPU memory"
    )
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    p.add_argument("--long-prefill-token-threshold", type=int,
                   default=d.long_prefill_token_threshold,
                   help="a prefill's tokens per step while others run or wait (0: no cap)")
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument(
        "--time-scale",
        type=float,
        default=d.time_scale,
        help="wall s per modelled s (0.1 = 10x faster)",
    )
    p.add_argument("--kv-events", action="store_true", help="publish KV events over ZMQ")
    p.add_argument(
        "--kv-events-base-port", type=int, default=5557,
        help="worker i publishes on BASE+2i and answers replay on BASE+2i+1; 0: free ports",
    )  # fmt: skip
    p.add_argument(
        "--kv-events-host",
        default="*",
        help="'*' binds; a host name/IP makes workers connect to it",
    )
    p.add_argument(
        "--kv-events-topic", default=d.kv_events_topic, help="ZMQ topic (vLLM's default: empty)"
    )
    p.add_argument(
        "--eos-probability", type=float, default=d.eos_probability, help="per-token chance of EOS"
    )
    p.add_argument(
        "--default-max-tokens", type=int, default=d.default_max_tokens,
        help="output cap of chat requests without a limit (0: vLLM's rule, the rest of the"
             " context; completions default to 16 either way)",
    )  # fmt: skip
    p.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="report usage.prompt_tokens_details.cached_tokens",
    )
    p.add_argument(
        "--runner", choices=[r.value for r in Runner], default=d.runner.value,
        help="vLLM's --runner: pooling serves the pooling routes instead of generation",
    )
    p.add_argument(
        "--tool-call-parser", default=None,
        help="answer tool choices as vLLM with this --tool-call-parser does (default: refuse)",
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--lora-modules", nargs="*", default=[], metavar="NAME=PATH",
        help="LoRA adapters served from the start, as vLLM's --lora-modules",
    )
    p.add_argument(
        "--allow-runtime-lora-updating", action="store_true",
        default=os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"),
        help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter"
        " (default: VLLM_ALLOW_RUNTIME_LORA_UPDATING)",
    )
    p.add_argument(
        "--kv-role", choices=list(KV_ROLES), default=None,
        help="vLLM's --kv-transfer-config kv_role with the NIXL connector (P/D disaggregation);"
             " default: no connector",
    )  # fmt: skip
    p.add_argument(
        "--kv-transfer-bytes-per-s", type=float, default=d.kv_transfer_bytes_per_s,
        help="link bandwidth that prices a KV pull (default %(default)g)",
    )  # fmt: skip
    p.add_argument(
        "--kv-lease-duration", type=float, default=d.kv_lease_duration_s, metavar="SECONDS",
        help="how long a producer holds unpulled blocks (vLLM's kv_lease_duration,"
             " default %(default)g)",
    )  # fmt: skip
    p.add_argument(
        "--kv-load-failure-policy", choices=list(KV_LOAD_FAILURE_POLICIES),
        default=d.kv_load_failure_policy,
        help="a failed KV pull: fail the request (vLLM's default) or recompute locally",
    )  # fmt: skip
    p.add_argument(
        "--kv-transfer-host", default=None,
        help="host put in remote_host (vLLM's VLLM_NIXL_SIDE_CHANNEL_HOST); default: --host",
    )
    p.add_argument(
        "--kv-offloading-size", type=float, default=None, metavar="GIB",
        help="vLLM's --kv-offloading-size: GiB of host memory for a CPU tier of the KV cache"
             " (native offloading); default: none",
    )  # fmt: skip
    p.add_argument(
        "--cpu-offload-blocks", type=int, default=None, metavar="N",
        help="the CPU tier in blocks, instead of --kv-offloading-size",
    )
    p.add_argument(
        "--cpu-offload-bytes-per-s", type=float, default=d.cpu_offload_bytes_per_s,
        help="host link bandwidth that prices a load from the CPU tier (default %(default)g)",
    )
    p.add_argument(
        "--self-describing-kv-events", action="store_true",
        help="CPU-tier BlockStored events with tokens and parents (vLLM's"
             " kv_connector_extra_config self_describing_kv_events); default: placeholders",
    )  # fmt: skip
    p.set_defaults(func=run)


def _lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise SystemExit(f"--lora-modules: expected NAME=PATH, got {text!r}")
    return name, path


def build_configs(args: argparse.Namespace) -> list[SimWorkerConfig]:
    base = SimWorkerConfig(
        model_name=args.model_name,
        profile=args.profile,
        tokenizer=args.tokenizer,
        block_size_tokens=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_model_len=args.max_model_len,
        time_scale=args.time_scale,
        eos_probability=args.eos_probability,
        kv_events_topic=args.kv_events_topic,
        default_max_tokens=args.default_max_tokens or None,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        tool_call_parser=args.tool_call_parser,
        runner=Runner(args.runner),
        lora_modules=tuple(_lora_module(m) for m in args.lora_modules),
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        kv_role=args.kv_role,
        kv_transfer_bytes_per_s=args.kv_transfer_bytes_per_s,
        kv_lease_duration_s=args.kv_lease_duration,
        kv_load_failure_policy=args.kv_load_failure_policy,
        kv_transfer_host=args.kv_transfer_host,
        kv_offloading_size_gib=args.kv_offloading_size,
        cpu_offload_blocks=args.cpu_offload_blocks,
        cpu_offload_bytes_per_s=args.cpu_offload_bytes_per_s,
        self_describing_kv_events=args.self_describing_kv_events,
    )
    configs = []
    for i in range(args.workers):
        extra: dict[str, Any] = {"seed": args.seed + i}
        if args.kv_events:
            base_port = args.kv_events_base_port
            pub = "*" if base_port == 0 else str(base_port + 2 * i)
            replay = "*" if base_port == 0 else str(base_port + 2 * i + 1)
            pub_host = args.kv_events_host
            if base_port == 0 and pub_host == "*":
                pub_host = args.host  # a free port needs a bind, and a bind needs an address
            extra.update(
                kv_events=True,
                kv_events_endpoint=f"tcp://{pub_host}:{pub}",
                kv_replay_endpoint=f"tcp://{args.host if base_port == 0 else '*'}:{replay}",
            )
        configs.append(dataclasses.replace(base, **extra))
    return configs


def run(args: argparse.Namespace) -> int:
    if args.workers < 1:
        print("kvgate sim: --workers must be >= 1", file=sys.stderr)
        return 2
    configs = build_configs(args)
    ports = None if args.port == 0 else [args.port + i for i in range(args.workers)]
    return asyncio.run(_serve(SimFleet(configs, host=args.host, ports=ports)))


async def _serve(fleet: SimFleet) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        urls = await fleet.start()
    except OSError as exc:
        print(f"kvgate sim: {exc}", file=sys.stderr)
        return 1
    for url, worker in zip(urls, fleet.workers, strict=True):
        line = f"{url}  model={worker.config.model_name} blocks={worker.num_gpu_blocks}x{worker.config.block_size_tokens}"
        if worker.kv_transfer is not None:
            line += f" kv_role={worker.config.kv_role} engine_id={worker.kv_transfer.engine_id}"
        if worker.publisher is not None:
            line += (
                f" kv_events={worker.publisher.endpoint} replay={worker.publisher.replay_endpoint}"
            )
        print(line, flush=True)
    try:
        await stop.wait()
    finally:
        await fleet.stop()
    return 0
