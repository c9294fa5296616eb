"""gateway.procs.net: free ports, runs of consecutive ports, and the readiness poll."""

from __future__ import annotations

import socket

import httpx
import pytest

from gateway.procs.net import Ports, free_ports, port_free, wait_until


def test_free_ports_are_distinct_and_free() -> None:
    ports = free_ports(8)
    assert len(set(ports)) == 8
    assert all(port_free(p) for p in ports)


def test_ports_come_in_free_consecutive_runs() -> None:
    ports = Ports(41000)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        taken = busy.getsockname()[1]
        base = Ports(taken).take(3)
        assert base > taken
    first = ports.take(4)
    assert ports.take() >= first + 4


def test_wait_until_returns_the_first_truthy_value() -> None:
    answers = iter([None, 0, "ready"])
    assert wait_until(lambda: next(answers), 5, "the answer", interval_s=0) == "ready"


def test_wait_until_counts_connection_errors_as_not_yet_and_names_the_last_on_timeout() -> None:
    def refused() -> bool:
        raise httpx.ConnectError("connection refused")

    with pytest.raises(TimeoutError, match=r"the server: not within.*connection refused"):
        wait_until(refused, 0.05, "the server", interval_s=0.01)


def test_wait_until_lets_other_errors_through_at_once() -> None:
    def exited() -> bool:
        raise RuntimeError("the child exited")

    with pytest.raises(RuntimeError, match="exited"):
        wait_until(exited, 60, "the child")
