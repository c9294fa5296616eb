"""Real vLLM CPU servers on the tiny test model, as tests and the ``vllm`` router benchmark run them.

Where things are (no machine path is written here):

- the interpreter of vLLM's own virtual environment: ``$KVGATE_VLLM_PYTHON``, else
  ``.venv-vllm/bin/python`` under the repository root (``scripts/setup.sh --test`` makes it);
- the tiny model: ``$KVGATE_TINY_MODEL``, else ``.cache/tiny-llama`` under the repository root,
  built by ``tests/fixtures/build_tiny_model.py`` (with vLLM's interpreter) when missing or built
  by another version of that script.

Each server: ``vllm.entrypoints.openai.api_server`` with prefix caching, ``--enforce-eager`` (no
torch.compile: start-up drops from ~50 s to ~20 s, decode speed is the same for this model, and
servers do not race on the shared compile cache), KV events published over ZMQ (the server
binds; a subscriber connects to ``VllmServer.kv_events_endpoint``), ``PYTHONHASHSEED=0`` (vLLM's
block hashes are then reproducible) and ``VLLM_SERVER_DEV_MODE=1`` (``/reset_prefix_cache``).
Each server's OpenMP threads are pinned to their own share of the CPUs, so several run side by
side on a 2-core machine (vLLM's default would pin every server to the same first core).

Servers start in parallel; one that exits because another process took its port in the meantime
is retried on fresh ports.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import signal
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from gateway.procs.net import LOOPBACK, free_ports, http_ok
from gateway.procs.process import REPO_ROOT, ManagedProcess, ProcessSet, StartError, child_env

VLLM_PYTHON_ENV = "KVGATE_VLLM_PYTHON"
TINY_MODEL_ENV = "KVGATE_TINY_MODEL"
BUILD_SCRIPT = REPO_ROOT / "tests" / "fixtures" / "build_tiny_model.py"
BUILD_STAMP_NAME = ".build-sha256"
"""Written by the build script: the sha256 of the script that built the model."""
BUILD_TIMEOUT_S = 300.0
STARTUP_TIMEOUT_S = 300.0
START_ATTEMPTS = 3
KV_EVENTS_TOPIC = "kv-events"


def vllm_python() -> Path:
    """The Python interpreter of vLLM's virtual environment."""
    return Path(os.environ.get(VLLM_PYTHON_ENV) or REPO_ROOT / ".venv-vllm" / "bin" / "python")


def tiny_model_path() -> Path:
    """Where the tiny test model is (or will be built)."""
    return Path(os.environ.get(TINY_MODEL_ENV) or REPO_ROOT / ".cache" / "tiny-llama")


def require_vllm_python() -> Path:
    python = vllm_python()
    if not python.exists():
        raise StartError(f"{python} is missing: run `scripts/setup.sh --test` to create the vLLM "
                         f"venv, or point ${VLLM_PYTHON_ENV} at vLLM's interpreter")
    return python


def vllm_script(script: str, env: Mapping[str, str]) -> subprocess.Popen[str]:
    """vLLM's interpreter running ``script`` with text pipes, for a line-by-line conversation
    (tests drive vLLM's own classes this way: its KV-event publisher, its block hashing)."""
    return subprocess.Popen([str(require_vllm_python()), "-c", script], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(env))


def build_tiny_model(model_dir: Path | None = None) -> Path:
    """Build the tiny model into ``model_dir`` unless the same build script already built it."""
    model_dir = model_dir or tiny_model_path()
    stamp = model_dir / BUILD_STAMP_NAME
    if stamp.exists() and stamp.read_text().strip() == _sha256(BUILD_SCRIPT):
        return model_dir
    result = subprocess.run(
        [str(require_vllm_python()), str(BUILD_SCRIPT), str(model_dir)], cwd=REPO_ROOT,
        capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
    if result.returncode != 0 or not stamp.exists():
        raise StartError(f"building the tiny model failed (exit {result.returncode}):\n"
                         f"{result.stdout}\n{result.stderr}")
    return model_dir


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass(frozen=True)
class VllmOptions:
    """How the servers are configured (the tests' defaults)."""

    served_model_name: str = "tiny"
    block_size_tokens: int = 32
    max_model_len_tokens: int = 4096
    num_gpu_blocks: int | None = None
    """``--num-gpu-blocks-override``: hold the KV cache to this many blocks."""
    kv_cache_space_gib: int = 1
    dtype: str = "bfloat16"
    """``--dtype``. With bfloat16 and 32-token blocks vLLM-CPU takes its AMX attention kernel
    where the CPU reports AMX; float32 takes its vector kernel."""
    max_omp_threads: int = 2
    """OpenMP threads per server at most: the tiny model gains nothing from more, and fewer
    threads spin-wait less."""
    prompt_tokens_details: bool = False
    """``--enable-prompt-tokens-details``: usage reports ``prompt_tokens_details.cached_tokens``."""
    runner: str | None = None
    """vLLM's ``--runner``: ``pooling`` serves the tiny Llama as an embedding model (vLLM turns
    a causal LM into one); None: vLLM's ``auto`` (generate)."""
    max_loras: int | None = None
    """With a number: ``--enable-lora --max-loras N`` and runtime adapter loading
    (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``); None: no LoRA."""
    kv_roles: tuple[str, ...] = ()
    """Prefill/decode disaggregation: server i's KV-transfer role (``kv_producer``,
    ``kv_consumer``, ``kv_both``), one per server started; empty: no KV connector. The connector
    is NIXL over host (CPU) buffers, the one that runs on the CPU build (``pip install nixl``
    into vLLM's venv: ``scripts/setup.sh --test`` does); each server gets its own NIXL side
    channel port (``VLLM_NIXL_SIDE_CHANNEL_PORT``), where a decode server fetches the prefill
    server's agent metadata before it reads the blocks."""


@dataclass(frozen=True)
class VllmServer:
    """One running vLLM server, as its clients see it."""

    url: str  # http://127.0.0.1:PORT, no trailing slash; the OpenAI API is under /v1
    port: int
    kv_events_endpoint: str  # tcp://127.0.0.1:PORT: connect a ZMQ SUB socket here
    kv_replay_endpoint: str  # tcp://127.0.0.1:PORT: connect a ZMQ DEALER socket here for replay
    block_size_tokens: int
    model_name: str  # the served model name clients send in "model"
    model_dir: Path  # the local model directory (config.json, tokenizer.json ...)
    log_path: Path  # the server's combined stdout and stderr
    kv_events_topic: str = KV_EVENTS_TOPIC
    nixl_side_channel_port: int | None = None  # with a KV-transfer role: where NIXL peers meet


def cpu_sets(num_servers: int, max_per_server: int) -> list[str]:
    """One OpenMP CPU list per server (for ``VLLM_CPU_OMP_THREADS_BIND``), disjoint when there
    are enough CPUs."""
    cpus = sorted(os.sched_getaffinity(0))
    per_server = max(1, min(max_per_server, len(cpus) // num_servers))
    sets: list[str] = []
    for index in range(num_servers):
        start = (index * per_server) % len(cpus)
        chosen = [cpus[(start + offset) % len(cpus)] for offset in range(per_server)]
        sets.append(",".join(str(cpu) for cpu in chosen))
    return sets


def require_nixl(python: Path) -> None:
    """``StartError`` unless vLLM's interpreter can make a NIXL agent (``scripts/setup.sh
    --test`` installs nixl): checked before a server with a KV-transfer role starts, which
    would otherwise die with a longer story."""
    script = ("from nixl._api import nixl_agent, nixl_agent_config\n"
              "nixl_agent('probe', nixl_agent_config(backends=['UCX']))\n")
    result = subprocess.run([str(python), "-c", script], capture_output=True, text=True,
                            timeout=120, check=False)
    if result.returncode != 0:
        raise StartError(f"NIXL is not usable by {python} (`scripts/setup.sh --test` installs"
                         f" it):\n{(result.stderr or result.stdout)[-2000:]}")


def kv_transfer_config(role: str) -> dict[str, str]:
    """vLLM's ``--kv-transfer-config`` for ``role`` on the CPU build: NIXL with host buffers."""
    return {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}


def server_env(cpu_set: str, options: VllmOptions, side_channel_port: int | None = None
               ) -> dict[str, str]:
    return child_env({
        "VLLM_CPU_KVCACHE_SPACE": str(options.kv_cache_space_gib),
        "VLLM_CPU_OMP_THREADS_BIND": cpu_set,
        # Threads of the API server and engine-core processes; the worker's count comes from the
        # bind list above.
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONHASHSEED": "0",
        "VLLM_SERVER_DEV_MODE": "1",
        # /v1/responses keeps what it answered only with this (previous_response_id, retrieve).
        "VLLM_ENABLE_RESPONSES_API_STORE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        **({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"} if options.max_loras else {}),
        **({"VLLM_NIXL_SIDE_CHANNEL_HOST": LOOPBACK,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port)}
           if side_channel_port is not None else {}),
    }, drop=("KVGATE_", "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"))


def server_argv(python: Path, model_dir: Path, port: int, events_port: int, replay_port: int,
                options: VllmOptions, kv_role: str | None = None) -> list[str]:
    kv_events_config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        # With "*" the server's sockets bind and subscribers connect.
        "endpoint": f"tcp://*:{events_port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
        "topic": KV_EVENTS_TOPIC,
    }
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_dir), "--served-model-name", options.served_model_name,
            "--host", LOOPBACK, "--port", str(port),
            "--max-model-len", str(options.max_model_len_tokens),
            "--enable-prefix-caching", "--dtype", options.dtype,
            "--block-size", str(options.block_size_tokens),
            "--enforce-eager", "--kv-events-config", json.dumps(kv_events_config)]
    if options.num_gpu_blocks is not None:
        argv += ["--num-gpu-blocks-override", str(options.num_gpu_blocks)]
    if options.prompt_tokens_details:
        argv.append("--enable-prompt-tokens-details")
    if options.runner is not None:
        argv += ["--runner", options.runner]
    if options.max_loras:
        argv += ["--enable-lora", "--max-loras", str(options.max_loras), "--max-lora-rank", "8"]
    if kv_role is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config(kv_role))]
    return argv


def start_vllm_servers(procs: ProcessSet, count: int, options: VllmOptions = VllmOptions(),
                       model_dir: Path | None = None, name: str = "vllm",
                       timeout_s: float = STARTUP_TIMEOUT_S) -> list[VllmServer]:
    """``count`` servers started in parallel, owned by ``procs`` as NAME-0, NAME-1 ...; ready
    (``/health`` 200) when this returns. ``StartError`` with the server's log otherwise."""
    python = require_vllm_python()
    model_dir = build_tiny_model(model_dir)
    if options.kv_roles:
        if len(options.kv_roles) != count:
            raise ValueError(f"kv_roles names {len(options.kv_roles)} roles for {count} servers")
        require_nixl(python)
    attempt = 0
    while True:
        attempt += 1
        ports = free_ports(4 * count)
        started: list[tuple[str, ManagedProcess, VllmServer]] = []
        for index, cpu_set in enumerate(cpu_sets(count, options.max_omp_threads)):
            port, events_port, replay_port, side_port = ports[4 * index: 4 * index + 4]
            role = options.kv_roles[index] if options.kv_roles else None
            pname = f"{name}-{index}"
            url = f"http://{LOOPBACK}:{port}"
            proc = ManagedProcess(
                server_argv(python, model_dir, port, events_port, replay_port, options, role),
                ready=functools.partial(http_ok, url + "/health", 2.0),
                env=server_env(cpu_set, options, side_port if role else None),
                death_signal=signal.SIGTERM, stop_grace_s=15.0)
            procs.add(pname, proc)
            assert proc.log_path is not None
            server = VllmServer(url, port, f"tcp://{LOOPBACK}:{events_port}",
                                f"tcp://{LOOPBACK}:{replay_port}", options.block_size_tokens,
                                options.served_model_name, model_dir, proc.log_path,
                                nixl_side_channel_port=side_port if role else None)
            started.append((pname, proc, server))
        for _, proc, _ in started:
            proc.start(wait=False)
        try:
            for _, proc, _ in started:
                proc.wait_ready(timeout_s)
        except StartError as exc:
            for pname, _, _ in started:
                procs.stop(pname)
            # A free port picked here can be taken by another process before vLLM binds it.
            if "Address already in use" not in str(exc) or attempt >= START_ATTEMPTS:
                raise
            continue
        return [server for _, _, server in started]
