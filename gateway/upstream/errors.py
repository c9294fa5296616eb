"""What an exchange with a worker can fail with (``gateway.upstream.client`` raises them).

Kept apart from the client: ``ConnectTimeout`` and ``ReadTimeout`` are also ``TimeoutError``s,
and a class with two built-in bases cannot be compiled as a native class (mypyc), which the
client's own classes can.
"""

from __future__ import annotations

import errno


class UpstreamError(Exception):
    """Any failure of an exchange with a worker."""


class UpstreamConnectionError(UpstreamError):
    """The connection failed (not the answer's content)."""


class ConnectError(UpstreamConnectionError):
    """No connection: refused, unreachable, name not resolved, TLS handshake refused."""


class ConnectTimeout(UpstreamConnectionError, TimeoutError):
    """No connection within ``connect_timeout_s``."""


class ResetError(UpstreamConnectionError):
    """A TCP reset (ECONNRESET, or EPIPE while writing) before any byte of the answer."""

    def __init__(self, err: int) -> None:
        super().__init__(err, errno.errorcode.get(err, str(err)))
        self.errno = err


class ConnectionLost(UpstreamConnectionError):
    """A socket error after the request may have reached the worker."""

    def __init__(self, err: int | None, message: str) -> None:
        super().__init__(err, message)
        self.errno = err


class ServerDisconnected(UpstreamConnectionError):
    """The worker closed the connection (a FIN) before its answer was whole."""


class ReadTimeout(UpstreamError, TimeoutError):
    """No byte of the answer for ``read_timeout_s``."""


class ProtocolError(UpstreamError):
    """The worker's answer was not HTTP/1.1 as expected."""
