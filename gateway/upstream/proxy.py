"""Step 6 of the request path: forward to the chosen worker and relay its answer.

``ProxyResponse`` is an ASGI response that does the upstream work inside its own ``__call__``, while
it also listens for the client leaving: through the gateway's own server's ``kvgate.on_disconnect``
callback (no timer, no task: ``gateway.httpd``), or under another server a task waiting in
``receive()`` for ``http.disconnect``. When the client goes away, the upstream request is
cancelled and its connection closed, so vLLM aborts the request and frees its KV blocks at once,
not when the next token fails to send. It puts together the parts of this
package, each of which can be read on its own:

* ``context``: ``Upstream`` (shared by every request) and ``Exchange`` (this request);
* ``placement``: which worker serves the request, the one connect retry, the move for a resume;
* ``hold``: the request's in-flight count on its worker, given back exactly once;
* ``relay``: the answer to the client, whole or event by event, filling the ``Outcome``;
* ``resume``: a broken chat stream continued on another worker (``routing.resume_streams``);
* ``outcome``: status, TTFT/TPOT and usage, recorded in the metrics at the end.

A worker's answer reaches the client as it came, with one exception: a worker's 401 is the
gateway's own credential refused (the client's key was checked already, and is never forwarded),
so the client gets a 502 ``upstream_unauthorized`` rather than a 401 that blames its key.

Bookkeeping happens in ``_finish``, in a ``finally``: the worker hold is given back, passive
health and the request's count are recorded, its latencies queued on ``Metrics.backlog``
(``gateway.backlog``: observed a moment later, past the next stream wave), and ``on_finish``
runs (the dispatcher's budget release). Before the upstream write a request does only what
that write and the next request's routing need (the relay is built after it).

The upstream client is the hot path's own (``gateway.upstream.client``: ``asyncio.Protocol`` +
``httptools``, keep-alive pools), not aiohttp (still used off the hot path) nor httpx. Measured
here: aiohttp's client was ~25% of a short request's CPU in the gateway's profile; alone, 32
concurrent short chats to the no-op backend cost 84-120 µs of client-process CPU per request
through aiohttp and 28-30 µs through this client (three alternating runs). httpx 0.28 was out
earlier: 806 req/s (p50 35 ms) against aiohttp's 9,530 (p50 3.2 ms) with the same front; its
connection pool dominated the profile.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import ClassVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.errors import GatewayError
from gateway.httpd import ON_DISCONNECT, SEND_BODY_NOWAIT
from gateway.routing.router import Route
from gateway.upstream.context import Exchange, Upstream
from gateway.upstream.outcome import Outcome
from gateway.upstream.placement import Placement
from gateway.upstream.relay import Relay

log = logging.getLogger(__name__)

WATCH_AFTER_S = 0.05
"""Under a server without ``kvgate.on_disconnect``: a request starts watching its client for a
disconnect once it has run this long; a client that leaves earlier is noticed at most this late
(its upstream request is then aborted)."""


class ProxyResponse(Response):
    # What places the request (``gateway.upstream.disagg`` places it in two steps).
    placement_class: ClassVar[type[Placement]] = Placement

    def __init__(self, upstream: Upstream, exchange: Exchange, route: Route,
                 on_finish: Callable[[Outcome], Awaitable[None]]) -> None:
        # What ``Response.__init__(status_code=200)`` sets (its ``render`` and ``init_headers``
        # are two calls and a list per request for a head this class never sends: ``__call__``
        # writes the worker's), set directly.
        self.status_code = 200
        self.background = None
        self.body = b""
        self.raw_headers = [(b"content-length", b"0")]
        self._upstream = upstream
        self._exchange = exchange
        self._on_finish = on_finish
        self._timeouts = route.pool.timeouts or upstream.default_timeouts
        # The worker is held from now on: the router counts this request on it at once.
        self._placement = self.placement_class(upstream, exchange, route, self._timeouts)
        self._outcome = Outcome()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        serving = asyncio.current_task()
        assert serving is not None
        extensions = scope.get("extensions") or {}
        disconnected = False

        def client_left() -> None:
            nonlocal disconnected
            disconnected = True
            serving.cancel()

        on_disconnect = extensions.get(ON_DISCONNECT)
        if on_disconnect is not None:
            # The gateway's own server calls back when the client leaves: no timer and no
            # task per request (``gateway.httpd``'s ``kvgate.on_disconnect``).
            on_disconnect(client_left)
            stop_watching: Callable[[], None] = functools.partial(on_disconnect, None)
        else:
            stop_watching = self._watch(receive, client_left)
        try:
            await self._serve(send, extensions.get(SEND_BODY_NOWAIT))
        except asyncio.CancelledError:
            if not disconnected:
                raise
            serving.uncancel()
        finally:
            stop_watching()
            await self._finish()

    @staticmethod
    def _watch(receive: Receive, client_left: Callable[[], None]) -> Callable[[], None]:
        """Under another server: a task waiting in ``receive()`` for the disconnect. Plain
        asyncio rather than an anyio task group (anyio's backend detection showed up in the
        profile); the task starts only once the request has run ``WATCH_AFTER_S``: most short
        requests are over by then, and a task per request is CPU the profile shows. Returns
        what stops the watching."""
        watcher: asyncio.Task[None] | None = None

        async def watch_disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            client_left()

        def start_watching() -> None:
            nonlocal watcher
            watcher = asyncio.create_task(watch_disconnect())

        timer = asyncio.get_running_loop().call_later(WATCH_AFTER_S, start_watching)

        def stop() -> None:
            timer.cancel()
            if watcher is not None:
                watcher.cancel()
        return stop

    async def _serve(self, send: Send, send_nowait: Callable[[bytes], bool] | None) -> None:
        # Streams: the first token must come within first_token_s of now, then each chunk within
        # read_s of the one before (both kept by the relay). Non-streamed answers: the client's
        # read_timeout_s (read_s) between bytes.
        stream = self._exchange.parsed.stream
        first_token_deadline = (asyncio.get_running_loop().time() + self._timeouts.first_token_s
                                if stream else None)
        try:
            if first_token_deadline is None:  # no timer to arm: no timeout context (~2 us)
                response = await self._placement.open()
            else:
                async with asyncio.timeout_at(first_token_deadline):
                    response = await self._placement.open()
        except GatewayError as err:
            await self._relay(send, send_nowait).error(err)
            return
        except TimeoutError:
            await self._relay(send, send_nowait).error(GatewayError(
                504, "the worker sent no token in time (timeouts.first_token_s)",
                code="upstream_timeout"))
            return
        # built after the upstream write: nothing before it that need not be (a stream wave)
        relay = self._relay(send, send_nowait)
        try:
            if response.status == 401:
                # The client's key passed the gateway: the worker refused the gateway's own.
                log.warning("worker %s refused the pool's credential (401)",
                            self._placement.route.worker.url)
                await relay.error(GatewayError(
                    502, "the worker refused the gateway's credential"
                    " (pools[].upstream_api_key_env / upstream_api_key_file)",
                    code="upstream_unauthorized"))
            elif response.status != 200:
                await relay.pass_through(response)
            elif stream:
                await relay.stream(response, first_token_deadline)
            else:
                await relay.whole(response)
        finally:
            self._placement.close()

    def _relay(self, send: Send, send_nowait: Callable[[bytes], bool] | None) -> Relay:
        return Relay(send, self._exchange, self._placement, self._outcome, self._timeouts,
                     self._upstream.health, send_nowait)

    async def _finish(self) -> None:
        placement, outcome = self._placement, self._outcome
        placement.hold.release()
        if 0 < outcome.status < 500:
            self._upstream.health.report_request_ok(placement.route.worker)
        outcome.record(self._upstream.metrics, placement.route, self._exchange.started_s)
        await self._on_finish(outcome)
