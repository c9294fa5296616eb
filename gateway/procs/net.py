"""Loopback ports and readiness polls: what every start-up of a server waits on.

``free_port`` asks the kernel for a port free now; ``free_ports`` keeps every socket open until all
are picked, so the ports are distinct. ``Ports`` hands out *runs* of consecutive free ports (a
``kvgate sim --workers N --port P`` process listens on P..P+N-1). A port found free can still be
taken by another process before the server binds it; starters that care retry (``vllm``).

``wait_until`` polls a check until it returns something truthy and returns that; errors a server
gives while it comes up (refused connections, half-written answers) count as "not yet".
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable
from typing import TypeVar

import httpx

T = TypeVar("T")
LOOPBACK = "127.0.0.1"
NOT_YET: tuple[type[BaseException], ...] = (httpx.HTTPError, OSError, ValueError, KeyError)
"""What a check may raise while the thing it polls is still coming up."""


def free_port() -> int:
    """A loopback TCP port that is free now."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback TCP ports that are free now."""
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((LOOPBACK, 0))
            ports.append(int(sock.getsockname()[1]))
        return ports


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


class Ports:
    """Hands out loopback ports that are free now, in runs of consecutive ports when asked."""

    def __init__(self, start: int) -> None:
        self._next = start

    def take(self, count: int = 1) -> int:
        """The first port of a free run of ``count``; later calls start after it."""
        base = self._next
        while not all(port_free(base + i) for i in range(count)):
            base += 1
            if base + count > 65000:
                raise RuntimeError("no free run of loopback ports")
        self._next = base + count
        return base


def wait_until(check: Callable[[], T | None], timeout_s: float, what: str, *,
               interval_s: float = 0.05) -> T:
    """Poll ``check`` until it returns something truthy; that value. ``TimeoutError`` naming
    ``what`` (and the last error ``check`` raised) after ``timeout_s``. Exceptions other than
    ``NOT_YET`` propagate at once (a child that exited says so that way)."""
    deadline = time.monotonic() + timeout_s
    last_error: BaseException | None = None
    while True:
        try:
            value = check()
            if value:
                return value
        except NOT_YET as exc:
            last_error = exc
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:g} s"
                               + (f" (last error: {last_error!r})" if last_error else ""))
        time.sleep(interval_s)


def http_status(url: str, timeout_s: float = 1.0) -> int | None:
    """The status of ``GET url``, or None when nothing answers."""
    try:
        return httpx.get(url, timeout=timeout_s).status_code
    except httpx.HTTPError:
        return None


def http_ok(url: str, timeout_s: float = 1.0) -> bool:
    """``GET url`` answers 200."""
    return http_status(url, timeout_s) == 200
