"""Running the gateway process: ``gateway.httpd`` with kvgate's own graceful shutdown.

On SIGTERM (or SIGINT) the gateway:
1. starts draining: ``/ready`` answers 503 so load balancers and Kubernetes stop sending traffic,
   while requests that still arrive are served;
2. after ``shutdown.drain_delay_s`` (time for the endpoints to be updated), stops accepting
   connections: idle keep-alive connections are closed at once, a connection answering a
   request is closed after its answer;
3. lets in-flight requests and streams finish for up to ``shutdown.grace_s``, then closes what is
   left (each closed stream aborts its vLLM request), runs the lifespan shutdown and exits 0.

A second signal skips the waiting (and, as uvicorn's forced exit, the lifespan shutdown).

The server is ``gateway.httpd``, not uvicorn: on a trivial ASGI app it costs about a third less
CPU per request (see that module's docstring for the figures and the trade-off). A lifespan
startup that fails exits with ``httpd.STARTUP_FAILURE`` (3, uvicorn's), which the supervisor
reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Awaitable, Callable, Coroutine, Generator, Sequence
from typing import Any

from gateway import gil, native
from gateway.app import create_app
from gateway.config import Settings
from gateway.httpd import STARTUP_FAILURE, App, HttpLimits, HttpServer, StartupFailed
from gateway.processes import SINGLE_PROCESS, ProcessRole

log = logging.getLogger(__name__)


class GatewayServer:
    """``app`` on ``host:port`` (or ``sock``), stopped by SIGTERM/SIGINT after a drain."""

    def __init__(self, app: App, *, host: str = "127.0.0.1", port: int = 0,
                 sock: socket.socket | None = None, drain_delay_s: float = 0.0,
                 grace_s: float = 30.0, on_drain: Callable[[], None] | None = None,
                 also: Sequence[socket.socket] = (), limits: HttpLimits | None = None) -> None:
        self.http = HttpServer(app, limits)
        self._host = host
        self._port = port
        self._sock = sock
        self._also = also
        self.drain_delay_s = drain_delay_s
        self.grace_s = grace_s
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
            self.http.force_stop()
            return
        log.info("draining: /ready now fails; stopping in %.1f s", self.drain_delay_s)
        if self._on_drain is not None:
            self._on_drain()
        self._draining = asyncio.get_running_loop().create_task(self._exit_after_delay())

    async def _exit_after_delay(self) -> None:
        await asyncio.sleep(self.drain_delay_s)
        self.http.request_stop()

    async def serve(self, on_started: Callable[[], Awaitable[None]] | None = None) -> None:
        """Serve until signalled and drained."""
        with self.capture_signals():
            try:
                await self.http.serve(host=self._host, port=self._port, sock=self._sock,
                                      grace_s=self.grace_s, on_started=on_started,
                                      also=self._also)
            except StartupFailed:
                raise SystemExit(STARTUP_FAILURE) from None  # logged already
            finally:
                if self._draining is not None:
                    self._draining.cancel()


def run(main: Coroutine[Any, Any, None]) -> None:
    """Run ``main`` on uvloop when installed (as uvicorn would), else on asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)


def set_log_level(log_level: str) -> None:
    """``--log-level`` for the server's own lines (startup, shutdown, app exceptions)."""
    level = logging.getLevelName(log_level.upper())
    logging.getLogger("gateway.httpd").setLevel(level if isinstance(level, int) else logging.DEBUG)


def serve(settings: Settings, *, host: str, port: int, log_level: str,
          role: ProcessRole = SINGLE_PROCESS, sock: socket.socket | None = None) -> None:
    """Run one gateway process until it is signalled and drained: on ``host:port``, or on
    ``sock``, the accept socket a supervisor (``gateway.supervisor``) shares with its siblings."""
    set_log_level(log_level)
    gil.install()  # the event loop waits less for a tokenizing thread's GIL (``gateway.gil``)
    if role.index == 0:
        log.info("request path: %s", native.status())
    app = create_app(settings, role)
    also = [sibling_listener(role)] if role.count > 1 else []
    server = GatewayServer(app, host=host, port=port, sock=sock,
                           drain_delay_s=settings.shutdown.drain_delay_s,
                           grace_s=settings.shutdown.grace_s, on_drain=app.start_draining,
                           also=also, limits=http_limits(settings))
    run(server.serve())


def http_limits(settings: Settings) -> HttpLimits:
    """The server's connection limits for ``settings`` (the rest at ``HttpLimits``' defaults)."""
    return HttpLimits(keep_alive_s=settings.limits.client_keep_alive_s)


def sibling_listener(role: ProcessRole) -> socket.socket:
    """This process's unix socket for its siblings (``gateway.api.siblings``), in the runtime
    directory only the gateway's user can enter; a restarted process takes over its
    predecessor's path."""
    path = role.sibling_socket(role.index)
    path.unlink(missing_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.listen(64)
    sock.setblocking(False)
    return sock
