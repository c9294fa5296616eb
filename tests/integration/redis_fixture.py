"""A real ``redis-server`` for tests, with a handle to stop and restart it mid-test.

Import the fixtures into a conftest (or a test module)::

    from tests.integration.redis_fixture import redis_process, redis_server, redis_control

* ``redis_process`` (session): one shared server, a ``RedisServer`` handle;
* ``redis_server`` (session): its URL, ``redis://127.0.0.1:<port>/0``; tests sharing it use
  distinct key prefixes instead of flushing;
* ``redis_control`` (function): a private server the test may ``stop()``/``kill()`` and
  ``start()`` again on the same port (outage tests), so the shared one is never disturbed.

The server runs without persistence (``--save '' --appendonly no``) in a temporary directory:
a restart comes back empty, as a Redis without persistence does in production. Like the vLLM
fixtures, it never skips: without a ``redis-server`` binary (``scripts/setup.sh --test`` installs
it) the tests that need it fail with that message.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

STARTUP_TIMEOUT_S = 10.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One ``redis-server`` process on a fixed port; ``start``/``stop`` may repeat."""

    def __init__(self, binary: str, workdir: Path, port: int | None = None) -> None:
        self.binary = binary
        self.workdir = workdir
        self.port = port if port is not None else free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        if self.running:
            return
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = (self.workdir / "redis.log").open("ab")
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
                "--daemonize",
                "no",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.workdir,
        )
        log.close()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not _ping(self.port):
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"redis-server exited with {self.proc.returncode}; see {self.workdir}/redis.log"
                )
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server did not answer PING on port {self.port}")
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL: the abrupt outage a crashed Redis causes."""
        self._end(graceful=False)

    def stop(self) -> None:
        """SIGTERM and wait."""
        self._end(graceful=True)

    def restart(self) -> None:
        self.kill()
        self.start()

    def _end(self, *, graceful: bool) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        if graceful:
            proc.terminate()
        else:
            proc.kill()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def _binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed: run scripts/setup.sh --test", pytrace=False)
    return binary


@pytest.fixture(scope="session")
def redis_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """The shared redis-server of the test session."""
    server = RedisServer(_binary(), tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="session")
def redis_server(redis_process: RedisServer) -> str:
    """URL of the shared redis-server."""
    return redis_process.url


@pytest.fixture
def redis_control(tmp_path: Path) -> Iterator[RedisServer]:
    """A private redis-server this test may kill and restart."""
    server = RedisServer(_binary(), tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.kill()
