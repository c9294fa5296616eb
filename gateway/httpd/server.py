"""The server side of ``gateway.httpd``: the ``lifespan`` protocol, listening, deadlines and the
graceful shutdown. See the package docstring."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from gateway.httpd.protocol import App, DateHeader, HeadFlusher, HttpConnection, HttpLimits, Message

log = logging.getLogger(__name__)

STARTUP_FAILURE = 3
LISTEN_BACKLOG = 2048
"""Connections the kernel completes and queues before the server accepts them (a socket given
to ``serve`` is listened on with it too: the listen there sets the backlog)."""
"""Exit status of a process whose lifespan startup failed: uvicorn's, which the supervisor reads."""


class StartupFailed(Exception):
    """The app's lifespan startup failed, or the address could not be bound: the process
    should exit with ``STARTUP_FAILURE`` (``gateway.server`` does)."""


class _Lifespan:
    """The ASGI ``lifespan`` protocol, as uvicorn's ``lifespan="on"`` runs it."""

    def __init__(self, app: App, state: dict[str, Any]) -> None:
        self._app = app
        self._state = state
        self._inbox: asyncio.Queue[Message] = asyncio.Queue()
        self._started = asyncio.Event()
        self._stopped = asyncio.Event()
        self._failed = False
        self._task: asyncio.Task[None] | None = None

    async def startup(self) -> bool:
        """Whether the app started."""
        log.info("Waiting for application startup.")
        self._task = asyncio.get_running_loop().create_task(self._main())
        await self._inbox.put({"type": "lifespan.startup"})
        await self._started.wait()
        if self._failed:
            log.error("Application startup failed. Exiting.")
            return False
        log.info("Application startup complete.")
        return True

    async def shutdown(self) -> None:
        if self._failed or self._task is None:
            return
        log.info("Waiting for application shutdown.")
        await self._inbox.put({"type": "lifespan.shutdown"})
        await self._stopped.wait()
        if self._failed:
            log.error("Application shutdown failed.")
        else:
            log.info("Application shutdown complete.")

    async def _main(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"},
                 "state": self._state}
        try:
            await self._app(scope, self._inbox.get, self._send)
        except BaseException as exc:  # reported as a failed startup or shutdown
            if not self._failed:
                log.error("Exception in 'lifespan' protocol", exc_info=exc)
            self._failed = True
        finally:
            self._started.set()
            self._stopped.set()

    async def _send(self, message: Message) -> None:
        kind = message["type"]
        if kind.endswith(".failed"):
            self._failed = True
            if message.get("message"):
                log.error("%s", message["message"])
        if kind.startswith("lifespan.startup."):
            self._started.set()
        elif kind.startswith("lifespan.shutdown."):
            self._stopped.set()


class HttpServer:
    """Serves ``app`` until stopped; see the package docstring."""

    def __init__(self, app: App, limits: HttpLimits | None = None) -> None:
        self.app = app
        self.limits = limits or HttpLimits()
        self.connections: set[HttpConnection] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.state: dict[str, Any] = {}
        self.date = DateHeader()
        self.heads = HeadFlusher()  # every connection's held heads, flushed once an iteration
        self.stopping = False
        self.started = asyncio.Event()
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]
        self._stop = asyncio.Event()
        self._force = asyncio.Event()
        self._listeners: list[asyncio.Server] = []
        self.port = 0

    def request_stop(self) -> None:
        """Stop accepting and let what is in flight finish (``serve``'s ``grace_s``)."""
        self._stop.set()

    def force_stop(self) -> None:
        """Stop now: what is in flight is cancelled without waiting."""
        self._stop.set()
        self._force.set()

    async def serve(self, *, host: str = "127.0.0.1", port: int = 0,
                    sock: socket.socket | None = None, grace_s: float = 30.0,
                    on_started: Callable[[], Awaitable[None]] | None = None,
                    also: Sequence[socket.socket] = ()) -> None:
        """Start the app, listen (on ``sock`` when given, and on every socket of ``also``: more
        listening sockets of the same app, e.g. a unix socket), serve until ``request_stop``,
        then shut down gracefully (see the package docstring)."""
        self.loop = asyncio.get_running_loop()
        lifespan = _Lifespan(self.app, self.state)
        if not await lifespan.startup():
            raise StartupFailed("the application's lifespan startup failed")
        try:
            if sock is not None:
                listener = await self.loop.create_server(lambda: HttpConnection(self), sock=sock,
                                                         backlog=LISTEN_BACKLOG)
            else:
                listener = await self.loop.create_server(
                    lambda: HttpConnection(self), host=host, port=port, backlog=LISTEN_BACKLOG)
            self._listeners.append(listener)
            for extra in also:
                self._listeners.append(await self.loop.create_server(
                    lambda: HttpConnection(self), sock=extra))
        except OSError as exc:
            log.error("%s", exc)
            for opened in self._listeners:
                opened.close()
            await lifespan.shutdown()
            raise StartupFailed(str(exc)) from exc
        self.port = listener.sockets[0].getsockname()[1]
        log.info("kvgate serving on http://%s:%d", host if sock is None else
                 listener.sockets[0].getsockname()[0], self.port)
        sweeper = self.loop.create_task(self._sweep())
        self.started.set()
        try:
            if on_started is not None:
                await on_started()
            await self._stop.wait()
        finally:
            sweeper.cancel()
            await self._shutdown(grace_s)
            if not self._force.is_set():
                await lifespan.shutdown()

    async def _sweep(self) -> None:
        """Close the connections past their deadline (idle keep-alive, unfinished heads, bodies
        that stopped coming) and drop those whose client stopped reading an answer
        (``send_timeout_s``)."""
        while True:
            await asyncio.sleep(self.limits.sweep_interval_s)
            now = self.loop.time()
            for conn in [c for c in self.connections if (c.deadline <= now and c.active is None)
                         or c.body_deadline <= now]:
                conn.close()
            for conn in [c for c in self.connections if c.stalled_past(now)]:
                log.info("a client took no byte of its answer for %.0f s: dropped (%s)",
                         self.limits.send_timeout_s, conn.client)
                conn.abort()

    async def _shutdown(self, grace_s: float) -> None:
        log.info("Shutting down")
        self.stopping = True
        for listener in self._listeners:
            listener.close()
        for conn in list(self.connections):
            conn.shutdown()
        try:
            async with asyncio.timeout(grace_s):
                while (self.connections or self.tasks) and not self._force.is_set():  # noqa: ASYNC110
                    await asyncio.sleep(0.05)  # (rare and short: an event per change costs more)
        except TimeoutError:
            log.warning("grace of %.1f s over: cancelling %d requests", grace_s,
                        len(self.tasks))
        for task in list(self.tasks):
            task.cancel()
        for conn in list(self.connections):
            conn.close()
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=5.0)
        for listener in self._listeners:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(listener.wait_closed(), 1.0)
