"""The contenders: kvgate gateways in three configurations and the two Rust routers.

A kvgate contender is ``kvgate serve`` with a config written from the ``Workers`` (one pool of
them, or the pools given); a Rust router is found and started by ``gateway/procs/peers.py``.
A contender that cannot be found or does not start is recorded in ``Lineup.skipped`` with the
reason and the tail of its log, and the run goes on without it.
"""

from __future__ import annotations

import importlib.metadata
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.bench.routers.workers import Workers
from gateway.procs.kvgate import GatewayProcess
from gateway.procs.net import LOOPBACK, Ports
from gateway.procs.peers import SGLANG_ROUTER, VLLM_ROUTER, PeerRouter
from gateway.procs.process import ProcessSet, StartError

KVGATE_READY_S = 60.0
PEER_READY_S = 90.0


@dataclass(frozen=True)
class PoolSpec:
    name: str
    max_context_tokens: int
    worker_indices: list[int]


@dataclass
class Contender:
    name: str
    url: str
    description: str
    command: str
    metrics_url: str | None = None
    """kvgate's own /metrics (routing decisions); None for the other routers."""
    version: str | None = None


@dataclass
class Lineup:
    contenders: list[Contender] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


def kvgate_config(workers: Workers, port: int, policy: str, events: bool,
                  pools: Sequence[PoolSpec] | None = None) -> dict[str, Any]:
    model: dict[str, Any] = {"name": workers.model, "tokenizer": workers.tokenizer}
    if workers.architecture is not None:
        model["architecture"] = workers.architecture
    pools = pools or [PoolSpec("fleet", workers.max_model_len, list(range(len(workers.urls))))]
    pool_list = []
    for p in pools:
        ws: list[dict[str, str]] = []
        for i in p.worker_indices:
            w = {"url": workers.urls[i]}
            if events:
                w["kv_events_endpoint"], w["kv_replay_endpoint"] = workers.events[i]
            ws.append(w)
        pool_list.append({"name": p.name, "max_context_tokens": p.max_context_tokens,
                          "policy": policy, "workers": ws})
    return {"listen": {"host": "127.0.0.1", "port": port}, "models": [model],
            "pools": pool_list}


def start_kvgate(procs: ProcessSet, ports: Ports, workers: Workers, name: str, policy: str,
                 events: bool, description: str, pools: Sequence[PoolSpec] | None = None
                 ) -> Contender:
    port = ports.take()
    return launch_kvgate(procs, port, name, kvgate_config(workers, port, policy, events, pools),
                         description)


def launch_kvgate(procs: ProcessSet, port: int, name: str, config: dict[str, Any],
                  description: str) -> Contender:
    """Start kvgate with ``config`` (``kvgate_config``'s, edited by a scenario) on ``port``."""
    gateway = GatewayProcess(config, procs.log_dir / f"{name}.yaml", port=port)
    procs.start(name, gateway, timeout_s=KVGATE_READY_S)
    return Contender(name, gateway.url, description,
                     shlex.join(["kvgate", *gateway.argv[3:]]),
                     metrics_url=gateway.url + "/metrics",
                     version=importlib.metadata.version("kvgate"))


def start_peer(procs: ProcessSet, ports: Ports, workers: Workers, name: str, router: PeerRouter,
               explicit: str | None) -> Contender:
    binary = router.find(explicit)
    if binary is None:
        raise router.missing()
    port = ports.take()
    proc = router.process(binary, port, ports.take(), workers.urls, workers.model)
    procs.start(name, proc, timeout_s=PEER_READY_S)
    return Contender(name, f"http://{LOOPBACK}:{port}", router.description, proc.command,
                     version=router.version(binary))


def start_contender(procs: ProcessSet, ports: Ports, workers: Workers, name: str,
                    sglang_router: str | None, vllm_router: str | None) -> Contender:
    kv = "kv_aware"
    if name == "kvgate_kv":
        return start_kvgate(procs, ports, workers, name, kv, True,
                            "kvgate kv_aware, KV events from every worker")
    if name == "kvgate_approx":
        return start_kvgate(procs, ports, workers, name, kv, False,
                            "kvgate kv_aware without KV events (routing history only)")
    if name == "kvgate_rr":
        return start_kvgate(procs, ports, workers, name, "round_robin", False,
                            "kvgate round_robin")
    if name == "sglang_cache_aware":
        return start_peer(procs, ports, workers, name, SGLANG_ROUTER, sglang_router)
    if name == "vllm_router_cache_aware":
        return start_peer(procs, ports, workers, name, VLLM_ROUTER, vllm_router)
    raise StartError(f"unknown contender {name!r}")


def start_lineup(procs: ProcessSet, ports: Ports, workers: Workers, names: Sequence[str],
                 sglang_router: str | None, vllm_router: str | None) -> Lineup:
    lineup = Lineup()
    for name in names:
        try:
            c = start_contender(procs, ports, workers, name, sglang_router, vllm_router)
        except StartError as exc:
            lineup.skipped[name] = str(exc).strip()
            procs.stop(name)
            print(f"routers: {name} skipped: {str(exc).splitlines()[0]}", flush=True)
            continue
        lineup.contenders.append(c)
        print(f"routers: {name} ready at {c.url}", flush=True)
    return lineup
