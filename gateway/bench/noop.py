"""A no-op OpenAI-style backend: answers at once, no model. The baseline of the overhead benchmark.

A raw ASGI app (no framework) so that the backend costs as little as possible and the measured
difference is the gateway's. It also serves ``/health``, ``/v1/models`` and an empty ``/metrics``
so the gateway's health checks see it as a worker. Streaming requests get ``tokens`` chunks.

Run: ``python -m gateway.bench.noop --port 9001``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Any

import orjson
from starlette.types import Receive, Scope, Send

MODEL = "noop"
DELAY_S = float(os.environ.get("KVGATE_NOOP_DELAY_MS", "0")) / 1000
_CHAT = orjson.dumps({
    "id": "chatcmpl-noop", "object": "chat.completion", "created": 0, "model": MODEL,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                 "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
})
_MODELS = orjson.dumps({"object": "list", "data": [{"id": MODEL, "object": "model",
                                                     "created": 0, "owned_by": "noop"}]})


def _chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    return b"data: " + orjson.dumps({
        "id": "chatcmpl-noop", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }) + b"\n\n"


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    body = b""
    more = True
    while more:
        msg = await receive()
        body += msg.get("body", b"")
        more = msg.get("more_body", False)
    path = scope["path"]
    if path in ("/v1/chat/completions", "/v1/completions"):
        if DELAY_S:
            await asyncio.sleep(DELAY_S)
        stream = b'"stream":true' in body.replace(b" ", b"")
        if not stream:
            await _send(send, 200, _CHAT, b"application/json")
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        parts = [_chunk({"role": "assistant", "content": ""})]
        parts += [_chunk({"content": "ok"}) for _ in range(4)]
        parts.append(_chunk({}, "stop"))
        if b'"include_usage":true' in body.replace(b" ", b""):
            parts.append(b"data: " + orjson.dumps({
                "id": "chatcmpl-noop", "object": "chat.completion.chunk", "created": 0,
                "model": MODEL, "choices": [],
                "usage": {"prompt_tokens": 1, "completion_tokens": 5, "total_tokens": 6}}) + b"\n\n")
        parts.append(b"data: [DONE]\n\n")
        for p in parts:
            await send({"type": "http.response.body", "body": p, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
    elif path == "/health":
        await _send(send, 200, b"", b"text/plain")
    elif path == "/v1/models":
        await _send(send, 200, _MODELS, b"application/json")
    elif path == "/metrics":
        await _send(send, 200, b"", b"text/plain")
    else:
        await _send(send, 404, b'{"error":{"message":"not found"}}', b"application/json")


async def _send(send: Send, status: int, body: bytes, content_type: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type)]})
    await send({"type": "http.response.body", "body": body})


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9001)
    parser.add_argument("--delay-ms", type=float, default=None,
                        help="answer completions after this long (a stand-in for model time)")
    args = parser.parse_args()
    if args.delay_ms is not None:
        global DELAY_S
        DELAY_S = args.delay_ms / 1000
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
