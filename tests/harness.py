"""Run ASGI apps (the gateway, the no-op backend) on real loopback ports, in a thread each.

Tests then use real HTTP clients (httpx, the openai client) against real sockets, so the whole
stack (uvicorn, disconnects, streaming) is exercised as in production. Ports and readiness come
from the process kit (``gateway.procs.net``); apps that must run as processes of their own are
started with ``gateway.procs`` too.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn
from starlette.types import Receive, Scope, Send

from gateway.procs.net import free_port, http_status, wait_until


@contextmanager
def serve_app(app: Any, port: int | None = None, ready_path: str = "/health") -> Iterator[str]:
    port = port or free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                            access_log=False, lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if not thread.is_alive():
            raise RuntimeError(f"server on port {port} failed to start")
        status = http_status(url + ready_path)
        return status is not None and status < 500

    wait_until(ready, 60, f"server on port {port}")
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
