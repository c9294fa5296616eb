"""A real ``redis-server`` for tests, with a handle to stop and restart it mid-test.

Import the fixtures into a conftest (or a test module)::

    from tests.integration.redis_fixture import redis_process, redis_server, redis_control

* ``redis_process`` (session): one shared server, a ``RedisServer`` handle;
* ``redis_server`` (session): its URL, ``redis://127.0.0.1:<port>/0``; tests sharing it use
  distinct key prefixes instead of flushing;
* ``redis_control`` (function): a private server the test may ``stop()``/``kill()`` and
  ``start()`` again on the same port (outage tests), so the shared one is never disturbed;
* ``redis_cluster`` (session): a real Redis Cluster of three primaries (no replicas: the tests
  prove the slot layout, not failover), its URL ``redis+cluster://127.0.0.1:<port>``; made by
  ``redis-cli --cluster create`` as an operator would, in about a second.

The server runs without persistence (``--save '' --appendonly no``) in a temporary directory:
a restart comes back empty, as a Redis without persistence does in production. Like the vLLM
fixtures, it never skips: without a ``redis-server`` binary (``scripts/setup.sh --test`` installs
it) the tests that need it fail with that message.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.procs.net import free_port, free_ports, wait_until
from gateway.procs.process import ManagedProcess, StartError

STARTUP_TIMEOUT_S = 60.0  # a loaded CI machine stalls for seconds


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One ``redis-server`` process on a fixed port; ``start``/``stop`` may repeat."""

    def __init__(self, binary: str, workdir: Path, port: int | None = None,
                 extra: tuple[str, ...] = ()) -> None:
        self.workdir = workdir
        self._binary, self._extra = binary, extra
        self._port_chosen, self._started = port is None, False
        self.port = port if port is not None else free_port()
        self.proc = ManagedProcess(
            self._argv(), ready=lambda: _ping(self.port), log_path=workdir / "redis.log",
            cwd=workdir, stop_grace_s=5.0)

    def _argv(self) -> list[str]:
        return [self._binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.workdir), "--daemonize", "no",
                *self._extra]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.proc.alive

    def start(self) -> None:
        """Start (again on the same port). The first start of a server whose port was chosen
        here moves to another when a process took it in the meantime."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        for attempt in range(1, 4):
            try:
                self.proc.start(timeout_s=STARTUP_TIMEOUT_S)
                break
            except StartError:
                if (self._started or not self._port_chosen or attempt == 3
                        or "address already in use" not in self.proc.log_tail().lower()):
                    raise
                self.port = free_port()
                self.proc.argv = self._argv()
        self._started = True

    def kill(self) -> None:
        """SIGKILL: the abrupt outage a crashed Redis causes."""
        self.proc.kill()

    def stop(self) -> None:
        """SIGTERM and wait."""
        self.proc.stop()

    def restart(self) -> None:
        self.kill()
        self.start()


class RedisCluster:
    """``primaries`` cluster-enabled ``redis-server``s, their slots split evenly among them."""

    def __init__(self, binary: str, cli: str, workdir: Path, primaries: int = 3) -> None:
        self.cli = cli
        ports = free_ports(2 * primaries)  # a client port and a cluster bus port each
        self.nodes = [
            RedisServer(binary, workdir / f"node-{i}", ports[i], (
                "--cluster-enabled", "yes", "--cluster-port", str(ports[primaries + i]),
                "--cluster-config-file", "nodes.conf",
                # Long enough that a stalled machine does not fail the cluster (nodes that miss
                # each other's pings for this long are marked failing: CLUSTERDOWN).
                "--cluster-node-timeout", "15000"))
            for i in range(primaries)
        ]

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        subprocess.run(
            [self.cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
             "--cluster-replicas", "0", "--cluster-yes"],
            check=True, capture_output=True, timeout=STARTUP_TIMEOUT_S)
        wait_until(lambda: all(self._ready(n.port) for n in self.nodes), STARTUP_TIMEOUT_S,
                   "every cluster node sees all slots served")

    def _ready(self, port: int) -> bool:
        info = subprocess.run([self.cli, "-p", str(port), "cluster", "info"], check=True,
                              capture_output=True, text=True, timeout=60).stdout
        return "cluster_state:ok" in info and "cluster_slots_ok:16384" in info

    def kill(self) -> None:
        for node in self.nodes:
            node.kill()


def _binary(name: str = "redis-server") -> str:
    binary = shutil.which(name)
    if binary is None:
        pytest.fail(f"{name} is not installed: run scripts/setup.sh --test", pytrace=False)
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


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of the test session's Redis Cluster (three primaries)."""
    cluster = RedisCluster(_binary(), _binary("redis-cli"), tmp_path_factory.mktemp("cluster"))
    try:
        cluster.start()
        yield cluster.url
    finally:
        cluster.kill()
