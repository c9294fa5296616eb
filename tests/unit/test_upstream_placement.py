"""Which upstream failures prove the worker never had the request (``never_reached``): only those
are sent to another worker (issue 12: a retry of a request the worker ran generates it twice)."""

from __future__ import annotations

import errno

import pytest

from gateway.upstream.errors import (
    ConnectError,
    ConnectionLost,
    ConnectTimeout,
    ProtocolError,
    ReadTimeout,
    ResetError,
    ServerDisconnected,
    UpstreamError,
)
from gateway.upstream.placement import never_reached


@pytest.mark.parametrize("exc", [
    ConnectError("cannot connect to 10.0.0.5:8000: [Errno 111] Connection refused"),
    ConnectError("cannot connect to 10.0.0.5:8000: [Errno 113] No route to host"),
    ConnectTimeout("no connection to 10.0.0.5:8000 in 2.0 s"),
    ResetError(errno.ECONNRESET),
    ResetError(errno.EPIPE),
], ids=repr)
def test_connect_failures_and_resets_are_retried(exc: UpstreamError) -> None:
    assert never_reached(exc)


@pytest.mark.parametrize("exc", [
    ServerDisconnected(),  # a FIN: the worker may have read and run the request
    ConnectionLost(errno.ETIMEDOUT, "Connection timed out"),
    ConnectionLost(errno.ECONNRESET, "reset after part of the answer"),
    ConnectionLost(None, "no errno: nothing proves it"),
    ReadTimeout("read timeout"),
    ProtocolError("truncated"),
], ids=repr)
def test_failures_after_the_worker_may_have_the_request_are_not_retried(
    exc: UpstreamError,
) -> None:
    assert not never_reached(exc)
