"""A ``redis-server`` for benchmarks (the replica exchange, budgets): no persistence, loopback
only, ready when it answers ``PING``; the tests' fixture (``tests/integration/redis_fixture``)
starts the same command. ``StartError`` without the binary (``scripts/setup.sh --test``
installs it)."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

from gateway.procs.net import LOOPBACK, free_port
from gateway.procs.process import ManagedProcess, StartError


def _ping(port: int) -> bool:
    try:
        with socket.create_connection((LOOPBACK, port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisProcess(ManagedProcess):
    def __init__(self, workdir: Path, port: int | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise StartError("redis-server not found (scripts/setup.sh --test installs it)")
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = port if port is not None else free_port()
        super().__init__(
            [binary, "--port", str(self.port), "--bind", LOOPBACK, "--save", "",
             "--appendonly", "no", "--dir", str(workdir), "--daemonize", "no"],
            ready=lambda: _ping(self.port), log_path=workdir / "redis.log", cwd=workdir,
            stop_grace_s=5.0)

    @property
    def url(self) -> str:
        return f"redis://{LOOPBACK}:{self.port}/0"
