"""ProcessRole, ``listen.processes`` / ``--processes``, and what a process of N inherits."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway.cli import build_parser
from gateway.config import ListenSettings, usable_cores
from gateway.processes import SINGLE_PROCESS, ProcessRole
from gateway.supervisor import LISTEN_FD_ENV, bind, hold_port, inherited


def test_role_travels_through_the_environment_unchanged(tmp_path: Path) -> None:
    role = ProcessRole(index=1, count=3, runtime_dir=tmp_path)

    assert ProcessRole.from_env({**os.environ, **role.to_env()}) == role
    assert not role.leader and ProcessRole(index=0, count=3, runtime_dir=tmp_path).leader


def test_no_role_in_the_environment_is_a_single_process() -> None:
    assert ProcessRole.from_env({}) == SINGLE_PROCESS == ProcessRole()
    assert SINGLE_PROCESS.leader and SINGLE_PROCESS.runtime_dir is None
    assert "KVGATE_RUNTIME_DIR" not in SINGLE_PROCESS.to_env()


def test_processes_auto_is_the_number_of_usable_cores() -> None:
    default = ListenSettings.model_validate({})
    assert default.processes == "auto"
    assert default.process_count() == usable_cores() <= len(os.sched_getaffinity(0))
    assert ListenSettings.model_validate({"processes": 3}).process_count() == 3


@pytest.mark.parametrize(("cpu_max", "expected"), [
    ("max 100000\n", None), ("150000 100000\n", 2), ("50000 100000\n", 1), (None, None)])
def test_usable_cores_are_capped_by_a_container_cpu_limit(
    tmp_path: Path, cpu_max: str | None, expected: int | None,
) -> None:
    path = tmp_path / "cpu.max"
    if cpu_max is not None:
        path.write_text(cpu_max)
    affinity = len(os.sched_getaffinity(0))
    assert usable_cores(path) == (affinity if expected is None else min(expected, affinity))


@pytest.mark.parametrize("value", [0, -1, "many"])
def test_processes_must_be_a_positive_integer_or_auto(value: object) -> None:
    with pytest.raises(ValidationError):
        ListenSettings.model_validate({"processes": value})


def test_serve_processes_option_accepts_integers_and_auto() -> None:
    parser = build_parser()

    assert parser.parse_args(["serve", "--processes", "4"]).processes == 4
    assert parser.parse_args(["serve", "--processes", "auto"]).processes == usable_cores()
    assert parser.parse_args(["serve"]).processes is None  # listen.processes decides
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--processes", "0"])


def test_a_process_not_started_by_a_supervisor_inherits_nothing() -> None:
    assert inherited({}) is None


def test_a_child_inherits_its_role_and_the_listening_socket(tmp_path: Path) -> None:
    listener = bind("127.0.0.1", 0)
    role = ProcessRole(index=1, count=2, runtime_dir=tmp_path)
    env = {**role.to_env(), LISTEN_FD_ENV: str(os.dup(listener.fileno()))}
    try:
        got = inherited(env)
        assert got is not None
        got_role, sock = got
        with sock:
            sock.settimeout(5)
            assert got_role == role
            assert sock.getsockname() == listener.getsockname()
            with socket.create_connection(listener.getsockname(), timeout=5):
                accepted, _ = sock.accept()  # the same accept queue as the listener's
                accepted.close()
    finally:
        listener.close()


def test_the_supervisors_reserve_holds_the_port_and_takes_no_connection() -> None:
    """The supervisor's socket keeps the port (a plain socket cannot bind it) but never
    listens: a connection goes to a process's socket or is refused, never queued where no one
    accepts."""
    with bind("127.0.0.1", 0, reuse_port=True, listen=False) as reserve:
        address = reserve.getsockname()
        with socket.socket() as plain, pytest.raises(OSError):
            plain.bind(address)  # taken
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(address, timeout=5).close()
        with bind(*address, reuse_port=True, listen=False) as own:  # a process's own socket
            own.listen(8)
            own.settimeout(5)
            with socket.create_connection(address, timeout=5):
                accepted, _ = own.accept()
                accepted.close()


def test_the_port_is_refused_where_a_server_listens_even_one_with_reuse_port() -> None:
    """A second gateway on the port of a running one must fail, not join its sockets and take
    half of its connections (``SO_REUSEPORT`` lets any socket of the same user in)."""
    with bind("127.0.0.1", 0, reuse_port=True) as running, pytest.raises(OSError):
        hold_port(*running.getsockname())  # a running gateway's process holds it
    with bind("127.0.0.1", 0) as plain, pytest.raises(OSError):
        hold_port(*plain.getsockname())
    with hold_port("127.0.0.1", 0) as reserve:  # a free port: held, processes may join
        assert reserve.getsockname()[1] != 0
        with bind(*reserve.getsockname(), reuse_port=True) as own:
            assert own.getsockname() == reserve.getsockname()
