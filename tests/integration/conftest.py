"""Real vLLM for integration tests: a tiny local model and two CPU servers, started once per session.

Both fixtures are lazy: nothing is built or started unless a test asks for them.

- ``tiny_model_dir``: ``.cache/tiny-llama``, built by ``tests/fixtures/build_tiny_model.py`` with the
  ``.venv-vllm`` interpreter when missing or built by another version of that script.
- ``vllm_servers``: two ``vllm.entrypoints.openai.api_server`` processes started in parallel, each with
  prefix caching, 32-token blocks and KV events published over ZMQ (the server binds; a subscriber
  connects to ``VllmServer.kv_events_endpoint``). Each server's OpenMP threads are pinned to their own
  share of the CPUs so the two can run side by side on a 2-core machine.

There is no skip anywhere: if vLLM cannot be built or started, the fixture fails with the server log.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
BUILD_SCRIPT = REPO_ROOT / "tests" / "fixtures" / "build_tiny_model.py"
TINY_MODEL_DIR = REPO_ROOT / ".cache" / "tiny-llama"
# Written by the build script: the sha256 of the script that built the model.
BUILD_STAMP_NAME = ".build-sha256"

SERVED_MODEL_NAME = "tiny"
NUM_SERVERS = 2
BLOCK_SIZE_TOKENS = 32
MAX_MODEL_LEN_TOKENS = 4096
KV_CACHE_SPACE_GIB = 1
KV_EVENTS_TOPIC = "kv-events"
# At most this many OpenMP threads per server: the tiny model gains nothing from more, and fewer
# threads spin-wait less.
MAX_OMP_THREADS_PER_SERVER = 2

BUILD_TIMEOUT_S = 300.0
STARTUP_TIMEOUT_S = 300.0
HEALTH_POLL_INTERVAL_S = 0.5
STOP_GRACE_S = 15.0
START_ATTEMPTS = 3
LOG_TAIL_LINES = 80


@dataclass(frozen=True)
class VllmServer:
    """One running vLLM server, as the gateway's tests see it."""

    url: str  # http://127.0.0.1:PORT, no trailing slash; the OpenAI API is under /v1
    port: int
    kv_events_endpoint: str  # tcp://127.0.0.1:PORT: connect a ZMQ SUB socket here
    kv_replay_endpoint: str  # tcp://127.0.0.1:PORT: connect a ZMQ DEALER socket here for replay
    block_size_tokens: int
    model_name: str  # the served model name clients send in "model"
    model_dir: Path  # the local model directory (config.json, tokenizer.json ...)
    log_path: Path  # the server's combined stdout and stderr
    kv_events_topic: str = KV_EVENTS_TOPIC


def _file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"(no log at {path}: {exc})"
    return "\n".join(text.splitlines()[-lines:])


def _require_vllm_python() -> None:
    if not VLLM_PYTHON.exists():
        pytest.fail(
            f"{VLLM_PYTHON} is missing: run `scripts/setup.sh --test` to create the vLLM venv",
            pytrace=False,
        )


def _free_ports(count: int) -> list[int]:
    """Ports the kernel reports free now; all sockets stay open until every port is picked, so the
    ports are distinct. Another process could still take one before vLLM binds it (a small race)."""
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind(("127.0.0.1", 0))
            ports.append(int(sock.getsockname()[1]))
        return ports


def _cpu_sets(num_servers: int) -> list[str]:
    """One OpenMP CPU list per server (for VLLM_CPU_OMP_THREADS_BIND), disjoint when there are enough
    CPUs. vLLM's default ("auto") would pin every server to the same first core."""
    cpus = sorted(os.sched_getaffinity(0))
    per_server = max(1, min(MAX_OMP_THREADS_PER_SERVER, len(cpus) // num_servers))
    sets: list[str] = []
    for index in range(num_servers):
        start = (index * per_server) % len(cpus)
        chosen = [cpus[(start + offset) % len(cpus)] for offset in range(per_server)]
        sets.append(",".join(str(cpu) for cpu in chosen))
    return sets


# Resolved here, not in the child: between fork and exec the child should only make the call.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it if pytest dies, so no server outlives the run
    (vLLM's engine and worker processes exit with their API server)."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _server_env(cpu_set: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")
    }
    env.update(
        {
            "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_SPACE_GIB),
            "VLLM_CPU_OMP_THREADS_BIND": cpu_set,
            # Threads of the API server and engine-core processes; the worker's count comes from the
            # bind list above.
            "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PYTHONHASHSEED": "0",  # makes vLLM's NONE_HASH, hence its block hashes, reproducible
            "VLLM_SERVER_DEV_MODE": "1",  # enables /reset_prefix_cache and friends
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def _server_command(model_dir: Path, port: int, events_port: int, replay_port: int) -> list[str]:
    kv_events_config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        # With "*" the server's sockets bind and subscribers connect.
        "endpoint": f"tcp://*:{events_port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
        "topic": KV_EVENTS_TOPIC,
    }
    return [
        str(VLLM_PYTHON),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        SERVED_MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(MAX_MODEL_LEN_TOKENS),
        "--enable-prefix-caching",
        "--dtype",
        "bfloat16",
        "--block-size",
        str(BLOCK_SIZE_TOKENS),
        # No torch.compile: start-up drops from ~50 s to ~20 s per server, decode speed is the same
        # for this model, and two servers do not race on the shared compile cache.
        "--enforce-eager",
        "--kv-events-config",
        json.dumps(kv_events_config),
    ]


@dataclass
class _Process:
    server: VllmServer
    popen: subprocess.Popen[bytes]


def _stop(processes: Sequence[_Process]) -> None:
    """SIGTERM every server's process group, SIGKILL what is left after STOP_GRACE_S."""
    for proc in processes:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.popen.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
    for proc in processes:
        # The group outlives its leader while EngineCore or the worker are still shutting down.
        while time.monotonic() < deadline and _group_alive(proc.popen.pid):
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.popen.pid, signal.SIGKILL)
        proc.popen.wait()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


class _StartFailed(Exception):
    def __init__(self, message: str, *, port_clash: bool) -> None:
        super().__init__(message)
        self.port_clash = port_clash


def _wait_healthy(processes: Sequence[_Process], timeout_s: float) -> None:
    pending = list(processes)
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0) as client:
        while pending:
            for proc in list(pending):
                code = proc.popen.poll()
                if code is not None:
                    tail = _log_tail(proc.server.log_path)
                    raise _StartFailed(
                        f"vLLM server on port {proc.server.port} exited with code {code} during "
                        f"start-up. Last {LOG_TAIL_LINES} lines of {proc.server.log_path}:\n"
                        f"{tail}",
                        port_clash="Address already in use" in tail,
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{proc.server.url}/health").status_code == 200:
                        pending.remove(proc)
            if not pending:
                return
            if time.monotonic() > deadline:
                tails = "\n\n".join(
                    f"== {p.server.log_path} (last {LOG_TAIL_LINES} lines) ==\n"
                    f"{_log_tail(p.server.log_path)}"
                    for p in pending
                )
                pytest.fail(
                    f"vLLM server(s) on port(s) {[p.server.port for p in pending]} not healthy "
                    f"after {timeout_s:.0f} s.\n{tails}",
                    pytrace=False,
                )
            time.sleep(HEALTH_POLL_INTERVAL_S)


def build_tiny_model(model_dir: Path = TINY_MODEL_DIR) -> Path:
    """Build the tiny model into model_dir unless the same build script already built it there."""
    expected = _file_sha256(BUILD_SCRIPT)
    stamp = model_dir / BUILD_STAMP_NAME
    if stamp.exists() and stamp.read_text().strip() == expected:
        return model_dir
    _require_vllm_python()
    result = subprocess.run(
        [str(VLLM_PYTHON), str(BUILD_SCRIPT), str(model_dir)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        check=False,
    )
    if result.returncode != 0 or not stamp.exists():
        pytest.fail(
            f"building the tiny model failed (exit {result.returncode}):\n"
            f"{result.stdout}\n{result.stderr}",
            pytrace=False,
        )
    return model_dir


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny local Llama model (tokenizer + config + bfloat16 weights), built if missing."""
    return build_tiny_model()


@pytest.fixture(scope="session")
def vllm_servers(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[VllmServer]]:
    """Two real vLLM servers serving the tiny model as "tiny", started in parallel, stopped at the end
    of the session (SIGTERM to each process group, SIGKILL after 15 s)."""
    _require_vllm_python()
    for attempt in range(START_ATTEMPTS):
        log_dir = tmp_path_factory.mktemp("vllm-servers")
        processes = _start_servers(tiny_model_dir, log_dir)
        try:
            _wait_healthy(processes, STARTUP_TIMEOUT_S)
        except _StartFailed as exc:
            _stop(processes)
            # A free port picked here can be taken by another process before vLLM binds it.
            if exc.port_clash and attempt + 1 < START_ATTEMPTS:
                continue
            pytest.fail(str(exc), pytrace=False)
        except BaseException:
            _stop(processes)
            raise
        try:
            yield [proc.server for proc in processes]
        finally:
            _stop(processes)
        return


def _start_servers(tiny_model_dir: Path, log_dir: Path) -> list[_Process]:
    ports = _free_ports(3 * NUM_SERVERS)
    processes: list[_Process] = []
    try:
        for index, cpu_set in enumerate(_cpu_sets(NUM_SERVERS)):
            port, events_port, replay_port = ports[3 * index : 3 * index + 3]
            server = VllmServer(
                url=f"http://127.0.0.1:{port}",
                port=port,
                kv_events_endpoint=f"tcp://127.0.0.1:{events_port}",
                kv_replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
                block_size_tokens=BLOCK_SIZE_TOKENS,
                model_name=SERVED_MODEL_NAME,
                model_dir=tiny_model_dir,
                log_path=log_dir / f"vllm-{index}-port{port}.log",
            )
            command = _server_command(tiny_model_dir, port, events_port, replay_port)
            with server.log_path.open("wb") as log:
                log.write(
                    f"$ {' '.join(command)}\n# VLLM_CPU_OMP_THREADS_BIND={cpu_set}\n".encode()
                )
                log.flush()
                popen = subprocess.Popen(
                    command,
                    cwd=REPO_ROOT,
                    env=_server_env(cpu_set),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=_die_with_parent,
                )
            processes.append(_Process(server=server, popen=popen))
    except BaseException:
        _stop(processes)
        raise
    return processes
