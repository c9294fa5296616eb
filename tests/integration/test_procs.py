"""gateway.procs.process on real child processes: readiness, failure reports, clean teardown."""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import pytest

from gateway.procs.kvgate import SIM_MODEL, GatewayProcess, SimProcess
from gateway.procs.net import LOOPBACK, http_ok
from gateway.procs.process import ManagedProcess, ProcessSet, StartError, child_env

# A child that starts a grandchild in its own process group, writes the grandchild's pid, and
# waits: stopping the child must end both.
PARENT = """
import subprocess, sys, time
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[1], "w").write(str(grandchild.pid))
time.sleep(600)
"""


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie waiting for its (already ended) parent to be reaped counts as gone.
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def test_child_env_drops_kvgate_variables_and_adds_the_extra_ones(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVGATE_POOLS", "stray")
    env = child_env({"EXTRA": "1"})
    assert "KVGATE_POOLS" not in env and env["EXTRA"] == "1" and env["PYTHONUNBUFFERED"] == "1"


def test_stop_ends_the_child_and_what_it_started(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    proc = ManagedProcess([sys.executable, "-c", PARENT, str(pid_file)],
                          ready=pid_file.exists, log_path=tmp_path / "parent.log")
    proc.start(timeout_s=30)
    grandchild = int(pid_file.read_text())
    proc.stop(timeout_s=5)
    deadline = time.monotonic() + 30
    while not _gone(grandchild):
        assert time.monotonic() < deadline, "the grandchild outlived stop()"
        time.sleep(0.05)
    assert not proc.alive


def test_a_child_that_exits_during_start_up_is_reported_with_its_log(tmp_path: Path) -> None:
    proc = ManagedProcess([sys.executable, "-c", "print('bad config'); raise SystemExit(3)"],
                          ready=lambda: False, log_path=tmp_path / "bad.log")
    with pytest.raises(StartError, match=r"(?s)exited with code 3.*bad config"):
        proc.start(timeout_s=30)


def test_a_child_that_never_gets_ready_is_stopped_again(tmp_path: Path) -> None:
    proc = ManagedProcess([sys.executable, "-c", "import time; time.sleep(600)"],
                          ready=lambda: False, log_path=tmp_path / "slow.log")
    with pytest.raises(StartError, match="not within"):
        proc.start(timeout_s=0.5)
    assert not proc.alive


def test_a_process_set_stops_every_child_and_keeps_their_logs(tmp_path: Path) -> None:
    with ProcessSet(tmp_path / "logs") as procs:
        sim = procs.start("sim", SimProcess(workers=2), timeout_s=60)
        assert all(http_ok(u + "/health") for u in sim.urls)
        sleeper = procs.start("sleeper", ManagedProcess(
            [sys.executable, "-c", "import time; time.sleep(600)"]), wait=False)
    assert not sim.alive and not sleeper.alive
    assert (tmp_path / "logs" / "sim.log").read_text().startswith("$ ")


def _listening_on(port: int) -> socket.socket:
    """Another process's server on ``port`` (a listening socket of this one)."""
    sock = socket.socket()
    sock.bind((LOOPBACK, port))
    sock.listen()
    return sock


def test_a_sim_whose_chosen_port_is_taken_before_it_binds_moves_to_another(
    tmp_path: Path,
) -> None:
    """The port a ``SimProcess`` was given by the kit can be taken by another process (a server,
    a connection's ephemeral port) before the child binds it: its first start moves on."""
    sim = SimProcess(log_path=tmp_path / "sim.log")
    taken = sim.port
    with _listening_on(taken), ProcessSet(tmp_path / "logs") as procs:
        procs.start("sim", sim)
        assert sim.port != taken and sim.url == f"http://{LOOPBACK}:{sim.port}"
        assert http_ok(sim.url + "/health")
        assert "address already in use" in sim.log_tail().lower()  # the first start's


def test_a_gateway_whose_chosen_port_is_taken_before_it_binds_moves_to_another(
    tmp_path: Path,
) -> None:
    config = {"models": [{"name": SIM_MODEL, "tokenizer": "simple"}],
              "pools": [{"name": "p", "max_context_tokens": 4096,
                         "workers": [f"http://{LOOPBACK}:9"]}]}
    gw = GatewayProcess(config, tmp_path / "kvgate.yaml")
    taken = gw.port
    gw.ready = lambda: http_ok(gw.url + "/health")  # its one worker is never up
    with _listening_on(taken), ProcessSet(tmp_path / "logs") as procs:
        procs.start("gateway", gw)
        assert gw.port != taken and http_ok(gw.url + "/health")


def test_a_port_the_caller_chose_is_never_moved(tmp_path: Path) -> None:
    with _listening_on(0) as held:
        port = held.getsockname()[1]
        sim = SimProcess(port, log_path=tmp_path / "sim.log")
        with pytest.raises(StartError, match="exited with code"):
            sim.start()
        assert sim.port == port
