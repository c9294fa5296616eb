"""Which upstream failures prove the worker never had the request (``never_reached``): only those
are sent to another worker (issue 12: a retry of a request the worker ran generates it twice)."""

from __future__ import annotations

import errno

import aiohttp
import pytest
from aiohttp.client_reqrep import ConnectionKey

from gateway.upstream.placement import never_reached

KEY = ConnectionKey("10.0.0.5", 8000, False, True, None, None, None)


@pytest.mark.parametrize("exc", [
    aiohttp.ClientConnectorError(KEY, OSError(errno.ECONNREFUSED, "Connection refused")),
    aiohttp.ClientConnectorError(KEY, OSError(errno.EHOSTUNREACH, "No route to host")),
    aiohttp.ConnectionTimeoutError("connect timeout"),
    aiohttp.ClientOSError(errno.ECONNRESET, "Connection reset by peer"),
    aiohttp.ClientOSError(errno.EPIPE, "Can not write request body"),
], ids=repr)
def test_connect_failures_and_resets_are_retried(exc: aiohttp.ClientError) -> None:
    assert never_reached(exc)


@pytest.mark.parametrize("exc", [
    aiohttp.ServerDisconnectedError(),  # a FIN: the worker may have read and run the request
    aiohttp.ClientOSError(errno.ETIMEDOUT, "Connection timed out"),
    aiohttp.ClientOSError(),  # no errno: nothing proves it
    aiohttp.SocketTimeoutError("read timeout"),
    aiohttp.ClientPayloadError("truncated"),
], ids=repr)
def test_failures_after_the_worker_may_have_the_request_are_not_retried(
    exc: aiohttp.ClientError,
) -> None:
    assert not never_reached(exc)
