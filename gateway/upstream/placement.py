"""Which worker serves the request, and moving it when that worker fails: connect and retry.

A ``Placement`` holds the request's current route, its ``WorkerHold`` there and the open upstream
response. The request moves to another worker in two cases only, and each move gives the old
hold back and takes a new one:

* ``open``: a failure that proves the worker never had the whole request (``never_reached``)
  sends it once to another worker of the same pool; a second such failure, or no other healthy
  worker, is a 502. Any other failure is not retried, since the worker may have started the
  request: retrying a request that ran would generate it twice (a long answer costs its worker
  twice), and a request that crashes a worker would crash a second one. A timeout is then a 504,
  a connection the worker closed or any other client error a 502; a connection failure still
  counts against the worker's circuit breaker.
* ``resume_elsewhere``: a stream that broke mid-way is continued on another worker
  (``gateway.upstream.resume``), when the relay asks for it.

``close`` closes, not just releases, an unfinished response. That drops its connection, which is
how vLLM learns the client is gone and aborts the request.

The request goes out through ``gateway.upstream.client`` (the hot path's own HTTP/1.1 client):
only the headers below, plus ``host`` and ``content-length``.
"""

from __future__ import annotations

import logging

from gateway.config import TimeoutSettings
from gateway.errors import GatewayError
from gateway.routing.router import Route, RoutingError
from gateway.upstream.client import Response
from gateway.upstream.context import Exchange, Upstream
from gateway.upstream.errors import (
    ConnectError,
    ConnectTimeout,
    ResetError,
    UpstreamConnectionError,
    UpstreamError,
)
from gateway.upstream.headers import json_headers
from gateway.upstream.hold import WorkerHold
from gateway.upstream.resume import Resumer, Splicer, Transcript

log = logging.getLogger(__name__)

def never_reached(exc: UpstreamError) -> bool:
    """True when ``exc``, raised before any byte of the answer, proves the worker cannot have
    started the request, so sending it to another worker cannot run it twice.

    * No connection: refused, unreachable, name not resolved, TLS refused (``ConnectError``), or
      the connect timeout (``ConnectTimeout``).
    * A TCP reset (ECONNRESET, or EPIPE while writing) before any byte of the answer
      (``ResetError``): a socket is reset when its process closes it with received bytes it
      never read, or when bytes reach a socket already closed (a keep-alive connection the
      worker dropped as we wrote: the client retries that one itself, on a new connection to the
      same worker). Either way the worker did not read the whole request, and vLLM starts
      nothing before it has the whole body. A server that read the request and then died or
      closed the connection closes with a FIN (``ServerDisconnected``): that one may have run,
      and is not retried.

    Anything else (``ServerDisconnected``, ``ConnectionLost``: other socket errors, or a reset
    after part of the answer; ``ReadTimeout``) may come from a worker that has the request, and
    is never retried.
    """
    return isinstance(exc, ConnectError | ConnectTimeout | ResetError)


class Placement:
    __slots__ = ("_connect_s", "_exchange", "_read_s", "_upstream", "hold", "response", "route")

    def __init__(self, upstream: Upstream, exchange: Exchange, route: Route,
                 timeouts: TimeoutSettings) -> None:
        self._upstream = upstream
        self._exchange = exchange
        # Streams: the first token gets first_token_s (a long prefill may be silent for that
        # long), then each chunk read_s: both are deadlines the relay keeps.
        self._connect_s = timeouts.connect_s
        self._read_s = None if exchange.parsed.stream else timeouts.read_s
        self.route = route
        self.hold = self._hold_on(route, self._uncached_prompt_tokens(route))
        self.response: Response | None = None

    async def open(self, body: bytes | None = None) -> Response:
        """The chosen worker's response, or a second worker's (see above); else ``GatewayError``.
        ``body``: what to send instead of the forwarded body (a decode step's)."""
        tried: list[str] = []
        if body is None:
            body = self._exchange.parsed.forward_body()
        while True:
            worker = self.route.worker
            try:
                self.response = await self._post(body)
                return self.response
            except (UpstreamError, TimeoutError) as exc:
                if not (isinstance(exc, UpstreamError) and never_reached(exc)):
                    raise self._not_retried(exc) from None
                self._upstream.health.report_failure(worker)
                tried.append(worker.url)
                log.warning("worker %s unreachable: %s", worker.url, type(exc).__name__)
                if len(tried) > 1:
                    raise GatewayError(
                        502, "the workers chosen for this request are unreachable",
                        code="upstream_unreachable",
                    ) from None
                try:
                    route = self._upstream.reroute(self._exchange.routing_request, tried)
                except RoutingError:
                    raise GatewayError(
                        502, f"worker unreachable and no other healthy worker in pool "
                        f"{self.route.pool.name!r}", code="upstream_unreachable",
                    ) from None
                m = self._upstream.metrics
                m.child(m.upstream_retries, route.pool.name).inc()
                self._move_to(route, self._uncached_prompt_tokens(route))

    def _not_retried(self, exc: UpstreamError | TimeoutError) -> GatewayError:
        """What the client gets for a failure the worker may have started the request before."""
        if isinstance(exc, TimeoutError):  # ReadTimeout: a non-streamed answer, read_s
            return GatewayError(504, "the worker did not answer in time", code="upstream_timeout")
        if isinstance(exc, UpstreamConnectionError):
            worker = self.route.worker
            self._upstream.health.report_failure(worker)  # a broken worker, all the same
            log.warning("worker %s failed a request it may have started: %r", worker.url, exc)
            return GatewayError(
                502, f"the worker closed the connection before answering ({type(exc).__name__});"
                " not retried: it may have started the request", code="upstream_error")
        return GatewayError(502, f"worker error: {type(exc).__name__}", code="upstream_error")

    async def resume_elsewhere(
        self, resumer: Resumer, transcript: Transcript
    ) -> tuple[Response, Splicer] | None:
        """Continue a broken stream on another worker of the pool; None when none can take it.

        On success: the continuation's response (now ``response``), and the ``Splicer`` that
        makes its events read as the original stream's.
        """
        try:
            route = self._upstream.reroute(self._exchange.routing_request, [self.route.worker.url])
        except RoutingError:
            return None
        body, generated = resumer(transcript.text)
        # No prefill counted: the relay ends prefill at the stream's first token, long past.
        self._move_to(route, 0)
        try:
            response = await self._post(body)
        except (UpstreamError, TimeoutError):
            self._upstream.health.report_failure(route.worker)
            return None
        if response.status != 200:
            response.close()
            return None
        if self.response is not None:
            self.response.close()
        self.response = response
        m = self._upstream.metrics
        m.child(m.resumed_streams, route.pool.name).inc()
        log.info("stream resumed on %s after %d tokens", route.worker.url, generated)
        return response, Splicer(transcript, self._exchange.routing_request.prompt_tokens,
                                 generated)

    @property
    def predicted_cached_tokens(self) -> int:
        """The prompt tokens predicted cached where the prompt is computed."""
        return self.route.decision.predicted_cached_tokens

    def close(self) -> None:
        response = self.response
        if response is None:
            return
        if response.at_eof:
            response.release()
        else:
            response.close()

    async def _post(self, body: bytes) -> Response:
        # Only these headers go upstream: never the client's (its Authorization is the
        # gateway's key, not the worker's); the pool's own credential when it has one. (A
        # large body goes out in pieces that wait for the socket: the client's flow control.)
        headers = json_headers(self.route.pool)
        return await self._upstream.client.post(
            self.route.worker.url, self._exchange.parsed.endpoint.upstream_path, body, headers,
            connect_timeout_s=self._connect_s, read_timeout_s=self._read_s)

    def _move_to(self, route: Route, prefill_tokens: int) -> None:
        self.hold.release()
        self.route = route
        self.hold = self._hold_on(route, prefill_tokens)

    def _hold_on(self, route: Route, prefill_tokens: int) -> WorkerHold:
        return WorkerHold(route.worker, route.pool.name, prefill_tokens, self._upstream.metrics)

    def _uncached_prompt_tokens(self, route: Route) -> int:
        # The prefill this request adds to the worker: its prompt less what is predicted cached.
        uncached = (self._exchange.routing_request.prompt_tokens
                    - route.decision.predicted_cached_tokens)
        return max(uncached, 0)
