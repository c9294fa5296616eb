"""kvgate's own processes: ``kvgate serve`` with a config, and ``kvgate sim`` workers.

Both run as ``python -m gateway.cli ...`` with this interpreter, so a test or benchmark exercises
the code of the checkout it runs from. ``SimProcess`` serves ``workers`` simulated vLLM workers on
consecutive ports from ``port`` (one event loop for all of them) and comes back on the same
ports when restarted, so a killed worker returns at the same URL; with ``kv_events_base_port``
worker ``i`` publishes KV events on that port + 2i and answers replay on + 2i + 1. Without
``port`` both choose free ports, and a first start that finds one taken by another process in
the meantime moves to others (``ManagedProcess.start``): read ``url``/``urls`` once started.
``GatewayProcess`` runs ``processes`` gateway processes on its port when given (``kvgate serve
--processes N``), else what the config says; ``serve_accepts_processes`` tells whether this
checkout's ``kvgate serve`` knows the flag.
"""

from __future__ import annotations

import functools
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from gateway.procs.net import LOOPBACK, Ports, free_port, http_ok
from gateway.procs.process import ManagedProcess, child_env, python_argv

SIM_MODEL = "sim-llama-3-8b"
"""The simulator's default served model name."""


def _url(port: int) -> str:
    return f"http://{LOOPBACK}:{port}"


class SimProcess(ManagedProcess):
    """``kvgate sim`` serving ``workers`` simulated workers on ports ``port`` .. + workers - 1."""

    def __init__(self, port: int | None = None, *, workers: int = 1, time_scale: float = 1.0,
                 kv_events_base_port: int | None = None, extra_args: Sequence[str] = (),
                 log_path: Path | None = None) -> None:
        self._ports_chosen = port is None
        self.workers = workers
        self.events: list[tuple[str, str]] = []
        self._args = ["--time-scale", f"{time_scale:g}"]
        if kv_events_base_port is not None:
            self._args += ["--kv-events", "--kv-events-base-port", str(kv_events_base_port)]
            self.events = [(f"tcp://{LOOPBACK}:{kv_events_base_port + 2 * i}",
                            f"tcp://{LOOPBACK}:{kv_events_base_port + 2 * i + 1}")
                           for i in range(workers)]
        self._args += list(extra_args)
        super().__init__(self._argv(port if port is not None else self._free_run()),
                         ready=lambda: all(http_ok(u + "/health") for u in self.urls),
                         log_path=log_path)

    def _free_run(self) -> int:
        return Ports(free_port()).take(self.workers)

    def _argv(self, port: int) -> list[str]:
        self.port = port
        self.urls = [_url(port + i) for i in range(self.workers)]
        return python_argv("gateway.cli", "sim", "--workers", str(self.workers), "--host",
                           LOOPBACK, "--port", str(port), *self._args)

    @property
    def url(self) -> str:
        """The first (with one worker, the only) worker's URL."""
        return self.urls[0]

    def chosen_ports(self) -> Sequence[int]:
        return range(self.port, self.port + self.workers) if self._ports_chosen else ()

    def move_ports(self) -> bool:
        if not self._ports_chosen:
            return False
        self.argv = self._argv(self._free_run())
        return True


class GatewayProcess(ManagedProcess):
    """``kvgate serve -c CONFIG`` with ``config`` written to ``config_path`` as YAML; ready when
    ``/ready`` answers 200."""

    def __init__(self, config: Mapping[str, Any], config_path: Path, *, port: int | None = None,
                 log_path: Path | None = None, env: Mapping[str, str] | None = None,
                 log_level: str = "warning", processes: int | None = None) -> None:
        self._port_chosen = port is None
        config_path.parent.mkdir(parents=True, exist_ok=True)
        config_path.write_text(yaml.safe_dump(dict(config), sort_keys=False))
        self._args = ["-c", str(config_path), "--log-level", log_level]
        if processes is not None:
            self._args += ["--processes", str(processes)]
        super().__init__(self._argv(port if port is not None else free_port()),
                         ready=lambda: http_ok(self.url + "/ready"), log_path=log_path,
                         env=child_env(env))

    def _argv(self, port: int) -> list[str]:
        self.port = port
        self.url = _url(port)
        return python_argv("gateway.cli", "serve", "--host", LOOPBACK, "--port", str(port),
                           *self._args)

    def chosen_ports(self) -> Sequence[int]:
        return (self.port,) if self._port_chosen else ()

    def move_ports(self) -> bool:
        if not self._port_chosen:
            return False
        self.argv = self._argv(free_port())
        return True


@functools.cache
def serve_accepts_processes() -> bool:
    """``kvgate serve`` of this checkout takes ``--processes`` (asked of its ``--help``)."""
    out = subprocess.run(python_argv("gateway.cli", "serve", "--help"), capture_output=True,
                         text=True, timeout=60, env=child_env(), check=False)
    return "--processes" in out.stdout


def noop_backend(port: int | None = None, delay_ms: float = 0.0, *, stream_chunks: int = 4,
                 chunk_interval_ms: float = 0.0) -> tuple[ManagedProcess, str]:
    """The no-op OpenAI backend (``gateway.bench.noop``) as a process, and its URL."""
    port = port if port is not None else free_port()
    url = _url(port)
    proc = ManagedProcess(
        python_argv("gateway.bench.noop", "--port", str(port), "--delay-ms", f"{delay_ms:g}",
                    "--stream-chunks", str(stream_chunks),
                    "--chunk-interval-ms", f"{chunk_interval_ms:g}"),
        ready=lambda: http_ok(url + "/health"))
    return proc, url


def floor_proxy(kind: str, port: int, upstream_url: str) -> tuple[ManagedProcess, str]:
    """One of the overhead benchmark's floors (``gateway.bench.floor``, ``kind`` ``bare`` or
    ``plumbing``) in front of ``upstream_url``, as a process, and its URL."""
    url = _url(port)
    proc = ManagedProcess(
        python_argv("gateway.bench.floor", "--kind", kind, "--port", str(port),
                    "--upstream", upstream_url),
        ready=lambda: http_ok(url + "/health"))
    return proc, url
