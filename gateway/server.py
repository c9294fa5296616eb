"""Running the gateway process: uvicorn with kvgate's own graceful shutdown.

On SIGTERM (or SIGINT) the gateway:
1. starts draining: ``/ready`` answers 503 so load balancers and Kubernetes stop sending traffic,
   while requests that still arrive are served;
2. after ``shutdown.drain_delay_s`` (time for the endpoints to be updated), stops accepting
   connections;
3. lets in-flight requests and streams finish for up to ``shutdown.grace_s``, then closes what is
   left (each closed stream aborts its vLLM request), runs the lifespan shutdown and exits 0.

A second signal skips the waiting. uvicorn's own handling re-raises SIGTERM after shutting down
(exit status 143) and has no drain phase, so kvgate owns the signals instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
import socket
from collections.abc import Awaitable, Callable, Generator

import uvicorn

from gateway.app import create_app
from gateway.config import Settings
from gateway.processes import SINGLE_PROCESS, ProcessRole

log = logging.getLogger(__name__)


class GatewayServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, *, drain_delay_s: float = 0.0,
                 on_drain: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self.drain_delay_s = drain_delay_s
        self._on_drain = on_drain
        self._draining: asyncio.Task[None] | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.request_exit)
        try:
            yield
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    def request_exit(self) -> None:
        if self._draining is not None:  # second signal: stop now
            self.force_exit = True
            self.should_exit = True
            return
        log.info("draining: /ready now fails; stopping in %.1f s", self.drain_delay_s)
        if self._on_drain is not None:
            self._on_drain()
        self._draining = asyncio.get_running_loop().create_task(self._exit_after_delay())

    async def _exit_after_delay(self) -> None:
        await asyncio.sleep(self.drain_delay_s)
        self.should_exit = True


def run(main: Awaitable[None], config: uvicorn.Config) -> None:
    """Run ``main`` on the event loop ``uvicorn.run`` would pick (uvloop when installed)."""
    with asyncio.Runner(loop_factory=config.get_loop_factory()) as runner:
        runner.run(main)  # type: ignore[arg-type]


async def serve_until_signalled(
    server: GatewayServer, on_started: Callable[[], Awaitable[None]] | None = None,
    sockets: list[socket.socket] | None = None,
) -> None:
    async def announce() -> None:
        while not server.started:  # noqa: ASYNC110 (uvicorn offers no event to wait on)
            await asyncio.sleep(0.05)
        if on_started is not None:
            await on_started()

    announcer = asyncio.create_task(announce())
    try:
        await server.serve(sockets)
    finally:
        announcer.cancel()


def serve(settings: Settings, *, host: str, port: int, log_level: str,
          role: ProcessRole = SINGLE_PROCESS, sock: socket.socket | None = None) -> None:
    """Run one gateway process until it is signalled and drained: on ``host:port``, or on
    ``sock``, the accept socket a supervisor (``gateway.supervisor``) shares with its siblings."""
    app = create_app(settings, role)
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, access_log=False,
        # Nothing reads the client address; uvicorn's X-Forwarded-For middleware cost ~2 % of a
        # short request's CPU in the profile (docs/results/profile_short_chat_after.svg).
        proxy_headers=False,
        timeout_graceful_shutdown=max(math.ceil(settings.shutdown.grace_s), 1),
    )
    server = GatewayServer(config, drain_delay_s=settings.shutdown.drain_delay_s,
                           on_drain=app.start_draining)
    run(serve_until_signalled(server, sockets=None if sock is None else [sock]), config)
