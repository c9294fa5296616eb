"""Graceful shutdown of a real ``kvgate serve`` process (issue 7).

The gateway runs as ``python -m gateway.cli serve -c CONFIG`` in front of a slow streaming
worker (one chunk every 0.1 s). With a stream in flight, SIGTERM must:

1. make ``/ready`` answer 503 (``draining``) at once, while requests are still served, for
   ``shutdown.drain_delay_s``;
2. then stop accepting: new connections are refused;
3. let the stream in flight finish completely (every chunk, then ``data: [DONE]``);
4. exit with status 0 once it has, well within ``shutdown.grace_s``.

A stream longer than the grace is closed when the grace runs out (its worker request is
aborted) and the process still exits 0.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from starlette.types import Receive, Scope, Send

from gateway.procs.kvgate import GatewayProcess
from tests.harness import answer_probe, read_asgi_body, serve_app

pytestmark = pytest.mark.timeout(60)

CHUNK_INTERVAL_S = 0.1
SIGNAL_TAKEN_S = 0.5
"""Longest from SIGTERM to ``/ready`` answering 503 (the supervisor signals every process)."""
EXIT_AFTER_LAST_STREAM_S = 3.0
"""Longest from the last stream's end to the gateway's exit (children stop, then the supervisor)."""


class SlowStreamWorker:
    """Streams ``chunks`` content chunks (from the body's ``chunks``), one every 0.1 s, then
    ``[DONE]``; answers non-streamed requests at once. Notes streams whose client left early."""

    def __init__(self) -> None:
        self.aborted = threading.Event()
        self.completed = threading.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] != "/v1/chat/completions":
            await answer_probe(scope, send)
            return
        raw = await read_asgi_body(receive)
        body = orjson.loads(raw)
        if not body.get("stream"):
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": orjson.dumps({
                "id": "c", "object": "chat.completion", "created": 0, "model": "noop",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                             "finish_reason": "stop"}]})})
            return
        gone = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        watcher = asyncio.create_task(watch())
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for i in range(int(body["chunks"])):
            if gone.is_set():
                self.aborted.set()
                return
            await send({"type": "http.response.body", "more_body": True,
                        "body": b"data: " + orjson.dumps({
                            "id": "c", "object": "chat.completion.chunk", "created": 0,
                            "model": "noop", "choices": [{"index": 0, "delta": {
                                "content": f"{i} "}, "finish_reason": None}]}) + b"\n\n"})
            await asyncio.sleep(CHUNK_INTERVAL_S)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        self.completed.set()
        watcher.cancel()


@pytest.fixture
def worker() -> Iterator[tuple[str, SlowStreamWorker]]:
    app = SlowStreamWorker()
    with serve_app(app) as url:
        yield url, app


def start_gateway(tmp_path: Path, worker_url: str, drain_delay_s: float,
                  grace_s: float) -> GatewayProcess:
    config = {
        "models": [{"name": "noop", "tokenizer": "simple"}],
        "pools": [{"name": "p", "max_context_tokens": 4096, "workers": [worker_url]}],
        "health": {"interval_s": 0.5},
        "shutdown": {"drain_delay_s": drain_delay_s, "grace_s": grace_s},
    }
    gw = GatewayProcess(config, tmp_path / "kvgate.yaml", log_path=tmp_path / "gateway.log",
                        log_level="info")
    gw.start(timeout_s=30)
    return gw


@dataclass
class StreamRecord:
    events: list[str] = field(default_factory=list)
    first: asyncio.Event = field(default_factory=asyncio.Event)
    error: BaseException | None = None
    ended_at: float = 0.0


async def read_stream(gw: str, chunks: int, rec: StreamRecord) -> None:
    body = {"model": "noop", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "chunks": chunks}
    try:
        async with httpx.AsyncClient(timeout=60) as http, http.stream(
                "POST", gw + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    rec.events.append(line[len("data: "):])
                    rec.first.set()
    except Exception as exc:
        rec.error = exc
    finally:
        rec.ended_at = time.monotonic()
        rec.first.set()


async def probe(http: httpx.AsyncClient, url: str) -> httpx.Response | None:
    """GET on a fresh connection; None when the gateway does not take it: refused, or dropped
    before any answer.

    Dropped, because a listener cannot close without a race: a connection the kernel completed
    but the server had not accepted yet is reset (``ReadError``), and one the server had accepted
    but not read a request from yet is closed (``RemoteProtocolError``). Neither ran a request.
    """
    try:
        return await http.get(url)
    except (httpx.NetworkError, httpx.RemoteProtocolError):
        return None


async def draining_until_refused(http: httpx.AsyncClient, url: str, until: float) -> None:
    """Probe ``url`` on fresh connections until one is refused (every process's listener is
    closed), before the loop time ``until``. Meanwhile every answer must be 503 (draining); a
    connection may be dropped unanswered (``probe``'s race, and with several processes one
    listener closes a moment before another, which still answers 503)."""
    while True:
        try:
            ready = await http.get(url)
        except httpx.ConnectError:
            return
        except (httpx.NetworkError, httpx.RemoteProtocolError):
            ready = None
        if ready is not None:
            assert ready.status_code == 503, ready.text
        assert time.monotonic() < until, "still taking connections"
        await asyncio.sleep(0.02)


async def refused_from_now_on(http: httpx.AsyncClient, url: str, tries: int = 5) -> None:
    """Once refused, always refused: the listeners do not come back (no flapping)."""
    for _ in range(tries):
        with pytest.raises(httpx.ConnectError):
            await http.get(url)
        await asyncio.sleep(0.02)


async def draining_within(http: httpx.AsyncClient, url: str, within_s: float) -> None:
    """``/ready`` answers 503 ``draining`` within ``within_s`` of the signal (the supervisor
    passes SIGTERM on to its processes, which a loaded machine may take a moment to run)."""
    deadline = time.monotonic() + within_s
    while True:
        ready = await probe(http, url)
        assert ready is not None, "the listener closed before the drain delay"
        if ready.status_code == 503:
            assert ready.json()["draining"] is True
            return
        assert ready.status_code == 200 and time.monotonic() < deadline, ready
        await asyncio.sleep(0.02)


def fresh_connections() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=5, limits=httpx.Limits(max_keepalive_connections=0))


async def wait_exit(gw: GatewayProcess, timeout_s: float) -> int:
    assert gw.popen is not None
    deadline = time.monotonic() + timeout_s
    while (code := gw.popen.poll()) is None:
        assert time.monotonic() < deadline, f"still running {timeout_s} s after SIGTERM"
        await asyncio.sleep(0.05)
    return code


async def test_sigterm_drains_then_lets_the_stream_finish_and_exits_0(
    tmp_path: Path, worker: tuple[str, SlowStreamWorker],
) -> None:
    drain_delay_s, grace_s, chunks = 2.0, 10.0, 40  # the stream lasts about 4 s
    worker_url, worker_app = worker
    gw = start_gateway(tmp_path, worker_url, drain_delay_s, grace_s)
    try:
        rec = StreamRecord()
        stream = asyncio.create_task(read_stream(gw.url, chunks, rec))
        await asyncio.wait_for(rec.first.wait(), 10)
        assert rec.error is None

        gw.send_signal(signal.SIGTERM)
        sigterm_at = time.monotonic()
        async with fresh_connections() as http:
            await draining_within(http, gw.url + "/ready", SIGNAL_TAKEN_S)
            served: dict[str, Any] = (await http.post(gw.url + "/v1/chat/completions", json={
                "model": "noop", "messages": [{"role": "user", "content": "hi"}]})).json()
            assert served["choices"][0]["message"]["content"] == "ok"
            assert time.monotonic() - sigterm_at < drain_delay_s, "too slow to check the drain"

            # Draining until the listeners close: every answer meanwhile is 503.
            await draining_until_refused(http, gw.url + "/ready", sigterm_at + drain_delay_s + 1.5)
            refused_after_s = time.monotonic() - sigterm_at
            await refused_from_now_on(http, gw.url + "/ready")
        assert refused_after_s >= drain_delay_s * 0.9
        assert not stream.done(), "the stream ended before the drain did"

        code = await wait_exit(gw, timeout_s=grace_s)
        exited_after_s = time.monotonic() - sigterm_at
        await stream
    finally:
        gw.stop()
    assert rec.error is None, repr(rec.error)
    assert rec.events[-1] == "[DONE]"
    assert len(rec.events) == chunks + 1
    assert worker_app.completed.is_set() and not worker_app.aborted.is_set()
    assert code == 0, gw.log_tail()
    # Exit follows the stream's end, not the grace: the stream itself may run late on a loaded
    # machine (its worker shares the test's loop), so the bound is measured from its last byte.
    stream_ended_s = rec.ended_at - sigterm_at
    assert exited_after_s - stream_ended_s < EXIT_AFTER_LAST_STREAM_S, (
        f"exited {exited_after_s:.2f} s after SIGTERM, the stream ended at {stream_ended_s:.2f} s"
        f"\n{gw.log_tail()}")


async def test_stream_longer_than_the_grace_is_closed_and_the_process_exits_0(
    tmp_path: Path, worker: tuple[str, SlowStreamWorker],
) -> None:
    drain_delay_s, grace_s = 0.5, 1.0
    worker_url, worker_app = worker
    gw = start_gateway(tmp_path, worker_url, drain_delay_s, grace_s)
    try:
        rec = StreamRecord()
        stream = asyncio.create_task(read_stream(gw.url, 300, rec))  # 30 s
        await asyncio.wait_for(rec.first.wait(), 10)
        gw.send_signal(signal.SIGTERM)
        sigterm_at = time.monotonic()
        code = await wait_exit(gw, timeout_s=drain_delay_s + grace_s + 5)
        exited_after_s = time.monotonic() - sigterm_at
        await asyncio.wait_for(stream, 5)  # the client is not left hanging
    finally:
        gw.stop()
    assert code == 0, gw.log_tail()
    assert drain_delay_s + grace_s * 0.9 <= exited_after_s < drain_delay_s + grace_s + 3
    assert "[DONE]" not in rec.events
    deadline = time.monotonic() + 2
    while not worker_app.aborted.is_set():  # the worker's request was closed, not left running
        assert time.monotonic() < deadline, "the worker's stream was not aborted"
        await asyncio.sleep(0.05)
