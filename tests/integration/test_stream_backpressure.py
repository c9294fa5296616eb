"""A client that stops reading a stream slows its worker down instead of filling the gateway.

The relay writes a chunk to the client only as fast as the client takes it; while the client's
socket is full, the gateway stops reading from the worker's connection (``gateway.upstream.client``
pauses reading past its high-water mark), so the worker's own writes block, and the gateway holds
at most a few socket buffers of the stream at any time, whatever the worker could produce. When
the client reads again, every chunk arrives, in order, and a pause longer than the pool's
``read_s`` is not taken for a silent worker.

The worker here produces ~1 KB SSE chunks as fast as its transport takes them and counts what it
has handed over; the client reads the first event and then nothing for a while. Loopback sockets
autotune their buffers to a few MB, so "bounded" is measured against the stream's size: the
worker must stall at a small part of it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import orjson
import pytest
from starlette.types import Receive, Scope, Send

from gateway.app import create_app
from gateway.config import build_settings
from tests.harness import answer_probe, read_asgi_body, serve_app

pytestmark = pytest.mark.timeout(120)

CHUNKS = 60_000
CHUNK_TEXT = "x" * 1000  # ~1.1 KB per SSE event: the stream is ~66 MB
PAUSE_S = 3.0
"""How long the client reads nothing: longer than the pool's ``read_s`` below."""
READ_S = 1.0


class FastStreamWorker:
    """Streams ``CHUNKS`` chat chunks as fast as its transport takes them (uvicorn blocks
    ``send`` while the socket is full), then ``[DONE]``; ``sent`` counts chunks handed over."""

    def __init__(self) -> None:
        self.sent = 0
        self.done = threading.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] != "/v1/chat/completions":
            await answer_probe(scope, send)
            return
        await read_asgi_body(receive)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for i in range(CHUNKS):
            await send({"type": "http.response.body", "more_body": True,
                        "body": b"data: " + orjson.dumps({
                            "id": "c", "object": "chat.completion.chunk", "created": 0,
                            "model": "noop", "choices": [{"index": 0, "delta": {
                                "content": f"{i} {CHUNK_TEXT}"}, "finish_reason": None}]})
                        + b"\n\n"})
            self.sent = i + 1
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        self.done.set()


@pytest.fixture
def gateway_and_worker() -> Iterator[tuple[str, FastStreamWorker]]:
    worker = FastStreamWorker()
    with serve_app(worker) as worker_url:
        settings = build_settings({
            "models": [{"name": "noop", "tokenizer": "simple"}],
            "pools": [{"name": "p", "max_context_tokens": 4096, "workers": [worker_url],
                       "timeouts": {"read_s": READ_S, "first_token_s": 10}}],
            "health": {"interval_s": 60},
        })
        with serve_app(create_app(settings), ready_path="/ready") as gw:
            yield gw, worker


def test_a_client_that_stops_reading_stalls_its_worker_and_then_gets_every_chunk(
    gateway_and_worker: tuple[str, FastStreamWorker],
) -> None:
    gw, worker = gateway_and_worker
    body = {"model": "noop", "stream": True, "max_tokens": 100,
            "messages": [{"role": "user", "content": "hi"}]}
    with httpx.stream("POST", gw + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(line for line in lines if line)
        # Read nothing for PAUSE_S: the worker must stall early, and stay stalled.
        time.sleep(PAUSE_S / 2)
        stalled_at = worker.sent
        time.sleep(PAUSE_S / 2)
        assert worker.sent == stalled_at, "the worker kept sending while nobody read"
        assert not worker.done.is_set()
        assert 0 < stalled_at < CHUNKS // 4, stalled_at
        events = [first, *(line for line in lines if line)]
    assert worker.done.is_set(), (len(events), worker.sent, events[-1][:300])
    # Every chunk, in order, then [DONE]: the pause (longer than read_s) was the client's, not a
    # silent worker's, so no read timeout cut the stream.
    assert events[-1] == "data: [DONE]", events[-1][:300]
    contents = [orjson.loads(e.removeprefix("data: "))["choices"][0]["delta"]["content"]
                for e in events[:-1]]
    assert [int(c.split(" ", 1)[0]) for c in contents] == list(range(CHUNKS))
