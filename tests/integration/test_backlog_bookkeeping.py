"""The request path's bookkeeping deferred off the stream wave (``gateway.backlog``) still happens,
once per request: metrics, the in-flight gauge, hit accounting and the latency objectives'
counts come out as if recorded on the request path, also for a client that leaves right after
the gateway wrote its request upstream and for a worker that fails the request.

The gateway runs on its own server over real sockets, in front of a fake worker that streams as
the no-op backend does, holds the request of ``user: hold`` (until its connection closes) and
answers ``user: fail`` with a 500.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.types import Receive, Scope, Send

from gateway import promtext
from gateway.app import create_app
from gateway.bench import noop
from gateway.config import build_settings
from gateway.procs.net import wait_until
from tests.harness import read_asgi_body, serve_app

OK_STREAMS = 5
SLO_HEADERS = {"x-slo-ttft-ms": "60000"}  # always met by a stream that answers


def chat(user: str) -> dict[str, Any]:
    return {"model": "noop", "messages": [{"role": "user", "content": "count this prompt"}],
            "stream": True, "user": user}


class Worker:
    def __init__(self) -> None:
        self.held = threading.Event()  # a held request has reached the worker

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/chat/completions":
            await noop.app(scope, receive, send)
            return
        body = await read_asgi_body(receive)
        user = json.loads(body).get("user")
        if user == "hold":
            self.held.set()
            while (await receive())["type"] != "http.disconnect":
                pass
            return
        if user == "fail":
            await send({"type": "http.response.start", "status": 500,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": b'{"error": "boom"}'})
            return
        sent = False

        async def replay() -> Any:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await noop.app(scope, replay, send)


@pytest.fixture(scope="module")
def worker() -> Iterator[tuple[str, Worker]]:
    fake = Worker()
    with serve_app(fake) as url:
        yield url, fake


@pytest.fixture(scope="module")
def gateway(worker: tuple[str, Worker]) -> Iterator[str]:
    settings = build_settings({
        "models": [{"name": "noop", "tokenizer": "simple"}],
        "pools": [{"name": "p", "max_context_tokens": 4096, "workers": [worker[0]]}],
        "health": {"interval_s": 0.2, "timeout_s": 30.0, "scrape_interval_s": 0.5},
    })
    with serve_app(create_app(settings), ready_path="/ready") as url:
        yield url


def scrape(gateway: str) -> str:
    return httpx.get(gateway + "/metrics").text


def leave_right_after_the_write(gateway: str, worker: Worker) -> None:
    """A streamed chat whose client closes its connection once the worker has the request."""
    body = json.dumps(chat("hold")).encode()
    host, port = gateway.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\n"
                f"content-type: application/json\r\nx-slo-ttft-ms: 60000\r\n"
                f"content-length: {len(body)}\r\n\r\n").encode()
        sock.sendall(head + body)
        assert worker.held.wait(60), "the held request never reached the worker"


def test_deferred_bookkeeping_counts_every_request_once(
        gateway: str, worker: tuple[str, Worker]) -> None:
    prompt_tokens = 0
    for i in range(OK_STREAMS):
        with httpx.stream("POST", gateway + "/v1/chat/completions", json=chat(f"u{i}"),
                          headers=SLO_HEADERS) as r:
            assert r.status_code == 200
            text = r.read().decode()
            prompt_tokens = int(r.headers["x-kvgate-prompt-tokens"])
        assert "data: [DONE]" in text
    failed = httpx.post(gateway + "/v1/chat/completions", json=chat("fail"), headers=SLO_HEADERS)
    assert failed.status_code == 500
    leave_right_after_the_write(gateway, worker[1])

    def every_request_ended() -> str | None:
        text = scrape(gateway)
        left = promtext.value(text, "kvgate_requests_total", code="499")
        inflight = promtext.value(text, "kvgate_worker_inflight", pool="p")
        return text if left == 1 and inflight == 0 else None

    text = wait_until(every_request_ended, 60, "the client that left to be counted")
    requests = OK_STREAMS + 2
    assert promtext.sums_by(text, "kvgate_requests_total", ["code"]) == {
        ("200",): OK_STREAMS, ("500",): 1, ("499",): 1}
    assert promtext.value(text, "kvgate_request_duration_seconds_count", pool="p") == requests
    assert promtext.value(text, "kvgate_ttft_seconds_count", pool="p") == OK_STREAMS
    assert promtext.value(text, "kvgate_routing_decisions_total", pool="p") == requests
    assert promtext.value(text, "kvgate_prompt_tokens_total", pool="p") == (
        requests * prompt_tokens)
    # hit accounting: every prompt token of every request in exactly one outcome
    assert promtext.value(text, "kvgate_prefix_tokens_total", pool="p") == (
        requests * prompt_tokens)
    # latency objectives: the streams met it, the worker's failure missed it, the client that
    # left before any token is neither
    assert promtext.sums_by(text, "kvgate_slo_requests_total", ["slo", "outcome"]) == {
        ("ttft", "met"): OK_STREAMS, ("ttft", "missed"): 1}
