"""The workers a scenario runs the contenders against: simulated H100s or real vLLM CPU servers.

Both are started through the process kit (``gateway/procs``) and described once, as ``Workers``:
URLs, KV event endpoints, the model and the tokenizer the gateway must use for it, the block
size read back from the workers' own ``/metrics`` (``vllm:cache_config_info``), and the exact
commands, for ``routers.json``.
"""

from __future__ import annotations

import contextlib
import shlex
from dataclasses import dataclass, field

import httpx

from gateway.procs.kvgate import SIM_MODEL, SimProcess
from gateway.procs.net import Ports
from gateway.procs.process import ProcessSet
from gateway.procs.vllm import VllmOptions, start_vllm_servers
from gateway.workers.vllm_metrics import parse_vllm_metrics

VLLM_MODEL = "tiny"
SIM_READY_S = 60.0
_VLLM_ENV_SHOWN = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS",
                   "PYTHONHASHSEED", "VLLM_SERVER_DEV_MODE")


@dataclass(frozen=True)
class Workers:
    kind: str
    """``sim`` or ``vllm``."""
    urls: list[str]
    events: list[tuple[str, str]]
    """Per worker: (KV event PUB endpoint, replay endpoint) for a subscriber to connect to."""
    model: str
    tokenizer: str
    """The gateway's tokenizer source for this model (the workers' own)."""
    architecture: str | None
    block_size_tokens: int
    max_model_len: int
    process_names: list[str]
    description: str
    commands: list[str] = field(default_factory=list)


def start_sim_workers(procs: ProcessSet, ports: Ports, n: int, *, profile: str,
                      time_scale: float, num_gpu_blocks: int | None, processes: int,
                      name: str = "sim", cpu_offload_blocks: int | None = None) -> Workers:
    """``n`` simulated workers over ``processes`` ``kvgate sim`` processes (one event loop each);
    ``cpu_offload_blocks``: a CPU tier of that many blocks on each (vLLM's CPU offload)."""
    sizes = [n // processes + (1 if i < n % processes else 0) for i in range(processes)]
    sims: list[SimProcess] = []
    names: list[str] = []
    for i, size in enumerate(s for s in sizes if s > 0):
        extra = ["--profile", profile, "--model-name", SIM_MODEL]
        if num_gpu_blocks is not None:
            extra += ["--num-gpu-blocks", str(num_gpu_blocks)]
        if cpu_offload_blocks is not None:
            extra += ["--cpu-offload-blocks", str(cpu_offload_blocks)]
        sim = SimProcess(ports.take(size), workers=size, time_scale=time_scale,
                         kv_events_base_port=ports.take(2 * size), extra_args=extra)
        names.append(f"{name}-{i}")
        sims.append(sim)
        procs.start(names[-1], sim, wait=False)
    for sim in sims:
        sim.wait_ready(SIM_READY_S)
    urls = [u for sim in sims for u in sim.urls]
    stats = parse_vllm_metrics(httpx.get(urls[0] + "/metrics", timeout=5).text)
    block = stats.block_size_tokens or 16
    blocks = stats.num_gpu_blocks or num_gpu_blocks
    tier = "" if cpu_offload_blocks is None else f" + {cpu_offload_blocks} CPU blocks"
    desc = (f"{n} simulated workers ({profile}, {blocks} GPU blocks{tier} x {block} tokens each, "
            f"time scale {time_scale:g}, {len(sims)} processes)")
    return Workers("sim", urls, [e for sim in sims for e in sim.events], SIM_MODEL, "simple",
                   profile.split("@")[0], block, 131072, names, desc,
                   [shlex.join(["kvgate", *sim.argv[3:]]) for sim in sims])


def start_vllm_workers(procs: ProcessSet, n: int, *, block_size: int,
                       num_gpu_blocks: int | None, max_model_len: int) -> Workers:
    """``n`` real vLLM CPU servers serving the tiny model, as the tests start them."""
    servers = start_vllm_servers(procs, n, VllmOptions(
        served_model_name=VLLM_MODEL, block_size_tokens=block_size,
        max_model_len_tokens=max_model_len, num_gpu_blocks=num_gpu_blocks))
    names = [f"vllm-{i}" for i in range(n)]
    commands = []
    for name in names:
        proc = procs.get(name)
        env_text = " ".join(f"{k}={proc.env[k]}" for k in _VLLM_ENV_SHOWN)
        commands.append(f"{env_text} {proc.command}")
    urls = [s.url for s in servers]
    stats = parse_vllm_metrics(httpx.get(urls[0] + "/metrics", timeout=5).text)
    block = stats.block_size_tokens or block_size
    desc = (f"{n} real vLLM CPU servers (tiny Llama, {stats.num_gpu_blocks} blocks x {block} "
            f"tokens each, one core each)")
    return Workers("vllm", urls, [(s.kv_events_endpoint, s.kv_replay_endpoint) for s in servers],
                   VLLM_MODEL, str(servers[0].model_dir), None, block, max_model_len, names,
                   desc, commands)


def lag_warnings(procs: ProcessSet, workers: Workers) -> int:
    """How many simulated engines logged that they fell behind their model clock (once each)."""
    if workers.kind != "sim":
        return 0
    n = 0
    for name in workers.process_names:
        with contextlib.suppress(OSError):
            n += procs.log_path(name).read_text(errors="replace").count("fell ")
    return n
