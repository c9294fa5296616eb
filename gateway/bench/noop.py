"""A no-op OpenAI-style backend: answers without a model. The baseline of the overhead benchmark.

A raw ASGI app (no framework) so that the backend costs as little as possible and the measured
difference is the router's. It also serves ``/health``, ``/v1/models`` and an empty ``/metrics``
so health checks (kvgate's, the Rust routers') see it as a worker.

What it answers, shaped as vLLM shapes it:

- non-streaming: one small ``chat.completion`` after ``delay_s`` (a stand-in for model time);
- streaming: the role chunk (``{"role": "assistant", "content": ""}``) at once; after
  ``delay_s`` (the prefill) ``stream_chunks`` content chunks, one per decode step; then the
  end-of-sequence token's chunk (empty content, ``finish_reason: "stop"``), so usage counts
  ``stream_chunks + 1`` completion tokens; then, when the request asked for
  ``stream_options.include_usage``, the usage chunk (``choices: []``); then ``data: [DONE]``.

Decode steps are shared, as in a vLLM engine step that emits one token for every running request:
with ``chunk_interval_s > 0`` every stream waiting for its next chunk is woken by the same tick
(one timer for all streams, not one per stream), so a stream's first step may be shorter than the
interval, exactly as a request joining a running batch sees it. With ``chunk_interval_s == 0`` the
chunks go out back to back.

Run: ``python -m gateway.bench.noop --port 9001 [--delay-ms 20] [--stream-chunks 64
--chunk-interval-ms 10]``.
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

MODEL = "noop"
_CHAT = orjson.dumps({
    "id": "chatcmpl-noop", "object": "chat.completion", "created": 0, "model": MODEL,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                 "logprobs": None, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
})
_MODELS = orjson.dumps({"object": "list", "data": [{"id": MODEL, "object": "model",
                                                     "created": 0, "owned_by": "noop"}]})


@dataclass(frozen=True)
class NoopBehaviour:
    delay_s: float = 0.0
    """Before a non-streamed answer, and before a stream's first content chunk."""
    stream_chunks: int = 4
    """Content chunks of a streamed answer (one token each)."""
    chunk_interval_s: float = 0.0
    """One decode step: the time between two chunks of a stream."""

    def __post_init__(self) -> None:
        if self.delay_s < 0 or self.chunk_interval_s < 0 or self.stream_chunks < 1:
            raise ValueError("delay and interval must be >= 0, stream_chunks >= 1")


def _chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    return b"data: " + orjson.dumps({
        "id": "chatcmpl-noop", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }) + b"\n\n"


_ROLE = _chunk({"role": "assistant", "content": ""})
_TOKEN = _chunk({"content": "ok"})
_EOS = _chunk({"content": ""}, "stop")
_DONE = b"data: [DONE]\n\n"


def _usage(completion_tokens: int) -> bytes:
    return b"data: " + orjson.dumps({
        "id": "chatcmpl-noop", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
        "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": completion_tokens,
                                 "total_tokens": 1 + completion_tokens}}) + b"\n\n"


class DecodeSteps:
    """One timer for every stream: ``wait`` returns at the next tick, ``interval_s`` apart while
    anyone waits. An ``asyncio.Event`` per tick, so a cancelled waiter (a client that went away)
    cancels only itself."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._tick: asyncio.Event | None = None

    async def wait(self) -> None:
        if self.interval_s <= 0:
            return
        tick = self._tick
        if tick is None:
            tick = self._tick = asyncio.Event()
            asyncio.get_running_loop().call_later(self.interval_s, self._fire, tick)
        await tick.wait()

    def _fire(self, tick: asyncio.Event) -> None:
        self._tick = None
        tick.set()


def make_app(behaviour: NoopBehaviour = NoopBehaviour()) -> ASGIApp:
    """The backend as a raw ASGI app."""
    steps = DecodeSteps(behaviour.chunk_interval_s)
    usage = _usage(behaviour.stream_chunks + 1)

    async def stream(send: Send, include_usage: bool) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        await _part(send, _ROLE)
        if behaviour.delay_s:
            await asyncio.sleep(behaviour.delay_s)
        await _part(send, _TOKEN)
        for _ in range(behaviour.stream_chunks - 1):
            await steps.wait()
            await _part(send, _TOKEN)
        await steps.wait()
        await _part(send, _EOS + usage + _DONE if include_usage else _EOS + _DONE)
        await send({"type": "http.response.body", "body": b""})

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        body = b""
        more = True
        while more:
            msg = await receive()
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
        path = scope["path"]
        if path in ("/v1/chat/completions", "/v1/completions"):
            compact = body.replace(b" ", b"")
            if b'"stream":true' in compact:
                await stream(send, b'"include_usage":true' in compact)
                return
            if behaviour.delay_s:
                await asyncio.sleep(behaviour.delay_s)
            await _send(send, 200, _CHAT, b"application/json")
        elif path == "/health":
            await _send(send, 200, b"", b"text/plain")
        elif path == "/v1/models":
            await _send(send, 200, _MODELS, b"application/json")
        elif path == "/metrics":
            await _send(send, 200, b"", b"text/plain")
        else:
            await _send(send, 404, b'{"error":{"message":"not found"}}', b"application/json")

    return app


app = make_app()
"""The backend with the default behaviour: no delay, four chunks per stream, back to back."""


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif msg["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _part(send: Send, body: bytes) -> None:
    await send({"type": "http.response.body", "body": body, "more_body": True})


async def _send(send: Send, status: int, body: bytes, content_type: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type)]})
    await send({"type": "http.response.body", "body": body})


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9001)
    parser.add_argument("--delay-ms", type=float, default=0.0,
                        help="answer (or start streaming tokens) after this long")
    parser.add_argument("--stream-chunks", type=int, default=NoopBehaviour.stream_chunks,
                        help="content chunks of a streamed answer")
    parser.add_argument("--chunk-interval-ms", type=float, default=0.0,
                        help="one decode step: the time between two chunks of a stream")
    args = parser.parse_args()
    behaviour = NoopBehaviour(args.delay_ms / 1000, args.stream_chunks,
                              args.chunk_interval_ms / 1000)
    uvicorn.run(make_app(behaviour), host=args.host, port=args.port, log_level="warning",
                access_log=False, backlog=4096)


if __name__ == "__main__":
    main()
