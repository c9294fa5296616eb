"""Run ASGI apps (the gateway, the no-op backend) on real loopback ports, in a thread each.

Tests then use real HTTP clients (httpx, the openai client) against real sockets, so the whole
stack (uvicorn, disconnects, streaming) is exercised as in production.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import uvicorn
from starlette.types import Receive, Scope, Send


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextmanager
def serve_app(app: Any, port: int | None = None, ready_path: str = "/health") -> Iterator[str]:
    port = port or free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                            access_log=False, lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        if not thread.is_alive():
            raise RuntimeError(f"server on port {port} failed to start")
        try:
            if httpx.get(url + ready_path, timeout=1).status_code < 500:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"server on port {port} did not become ready")
        time.sleep(0.05)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=30)


async def answer_probe(scope: Scope, send: Send) -> None:
    """A fake worker's answer to anything but completions: 200 on /health, 404 otherwise."""
    status = 200 if scope["path"] == "/health" else 404
    await send({"type": "http.response.start", "status": status, "headers": []})
    await send({"type": "http.response.body", "body": b""})


async def read_asgi_body(receive: Receive) -> bytes:
    """The whole request body of an ASGI http request."""
    raw = b""
    while True:
        msg = await receive()
        raw += bytes(msg.get("body", b""))
        if not msg.get("more_body"):
            return raw
