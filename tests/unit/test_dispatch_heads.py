"""gateway.dispatch: the request's headers read in one pass (``RequestHeads``) and the body read
from ``receive`` directly (``read_body``), each as Starlette's ``Headers.get`` and
``Request.stream`` did it before (the request path's CPU work, issue 11)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st
from starlette.requests import Request
from starlette.types import Message

from gateway.dispatch import RequestHeads, read_body, read_small_body
from gateway.errors import GatewayError

NAMES = st.sampled_from([b"content-length", b"x-session-id", b"x-priority", b"x-slo-ttft-ms",
                         b"x-slo-tpot-ms", b"x-slo", b"host", b"authorization", b"x-session"])
VALUES = st.binary(max_size=12)


def request(headers: Sequence[tuple[bytes, bytes]], messages: Sequence[Message] = ()) -> Request:
    inbox = list(messages)

    async def receive() -> Message:
        return inbox.pop(0)
    return Request({"type": "http", "headers": list(headers)}, receive)


@given(st.lists(st.tuples(NAMES, VALUES), max_size=8))
def test_request_heads_read_what_starlette_headers_get_reads(
        headers: list[tuple[bytes, bytes]]) -> None:
    heads = RequestHeads.of(headers)
    got = request(headers).headers
    assert heads.content_length == got.get("content-length")
    assert heads.session_id == got.get("x-session-id")
    assert heads.priority == got.get("x-priority")
    assert heads.names_slo == any(k.startswith(b"x-slo-") for k, _ in headers)


def test_request_heads_take_the_first_of_repeated_headers_and_decode_latin1() -> None:
    heads = RequestHeads.of([(b"x-session-id", b"caf\xe9"), (b"x-session-id", b"other"),
                             (b"x-priority", b"batch")])
    assert heads == RequestHeads(None, "café", "batch", False)


def test_read_body_joins_the_chunks_of_a_body_sent_in_parts() -> None:
    req = request([], [{"type": "http.request", "body": b"ab", "more_body": True},
                       {"type": "http.request", "body": b"", "more_body": True},
                       {"type": "http.request", "body": b"cd", "more_body": False}])
    assert asyncio.run(read_body(req, 10)) == b"abcd"


def test_read_body_refuses_a_second_read_as_request_stream_does() -> None:
    req = request([], [{"type": "http.request", "body": b"{}", "more_body": False}])

    async def twice() -> None:
        assert await read_body(req, 10) == b"{}"
        with pytest.raises(RuntimeError, match="Stream consumed"):
            await read_body(req, 10)
    asyncio.run(twice())


def test_read_body_is_413_once_the_bytes_that_came_pass_the_limit() -> None:
    req = request([], [{"type": "http.request", "body": b"x" * 6, "more_body": True},
                       {"type": "http.request", "body": b"x" * 6, "more_body": True}])
    with pytest.raises(GatewayError) as err:
        asyncio.run(read_body(req, 10))
    assert (err.value.status, err.value.code) == (413, "request_too_large")


def test_read_body_is_499_when_the_client_leaves_mid_upload() -> None:
    req = request([], [{"type": "http.request", "body": b"{", "more_body": True},
                       {"type": "http.disconnect"}])
    with pytest.raises(GatewayError) as err:
        asyncio.run(read_body(req, 10))
    assert (err.value.status, err.value.code) == (499, "client_closed")


def test_read_small_body_uses_the_declared_length_it_is_given() -> None:
    """The length from ``RequestHeads`` decides, not a second lookup: a body declared larger
    than the early-read bound is left unread (None) whatever the request's own header says."""
    req = request([(b"content-length", b"2")],
                  [{"type": "http.request", "body": b"{}", "more_body": False}])
    assert asyncio.run(read_small_body(req, 1 << 20, str(1 << 19))) is None
    assert asyncio.run(read_small_body(req, 1 << 20, "2")) == b"{}"
