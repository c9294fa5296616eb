"""Which worker serves the request, and moving it when that worker fails: connect and retry.

A ``Placement`` holds the request's current route, its ``WorkerHold`` there and the open upstream
response. The request moves to another worker in two cases only, and each move gives the old
hold back and takes a new one:

* ``open``: a connection failure before any byte (refused, reset, connect timeout) means the
  worker cannot have started the request, so it is sent once to another worker of the same pool.
  A second failure, or no other healthy worker, is a 502. Any other error is not retried, since
  the worker may have started the request: a timeout is a 504, any other client error a 502.
* ``resume_elsewhere``: a stream that broke mid-way is continued on another worker
  (``gateway.upstream.resume``), when the relay asks for it.

``close`` closes, not just releases, an unfinished response. That drops its connection, which is
how vLLM learns the client is gone and aborts the request.
"""

from __future__ import annotations

import logging

import aiohttp

from gateway.config import TimeoutSettings
from gateway.errors import GatewayError
from gateway.routing.router import Route, RoutingError
from gateway.upstream.context import Exchange, Upstream
from gateway.upstream.hold import WorkerHold
from gateway.upstream.resume import Resumer, Splicer, Transcript

log = logging.getLogger(__name__)

# Failures where the worker cannot have started the request: safe to send it elsewhere.
RETRYABLE = (
    aiohttp.ClientOSError,  # refused, reset or broken before any response (incl. connect errors)
    aiohttp.ServerDisconnectedError,
    aiohttp.ConnectionTimeoutError,
)
JSON_HEADERS = {"content-type": "application/json"}


class Placement:
    __slots__ = ("_exchange", "_timeout", "_upstream", "hold", "response", "route")

    def __init__(self, upstream: Upstream, exchange: Exchange, route: Route,
                 timeouts: TimeoutSettings) -> None:
        self._upstream = upstream
        self._exchange = exchange
        # Streams: the first token gets first_token_s (a long prefill may be silent for that
        # long), then each chunk read_s: both are deadlines the relay keeps.
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=timeouts.connect_s,
            sock_read=None if exchange.parsed.stream else timeouts.read_s)
        self.route = route
        self.hold = self._hold_on(route, self._uncached_prompt_tokens(route))
        self.response: aiohttp.ClientResponse | None = None

    async def open(self) -> aiohttp.ClientResponse:
        """The chosen worker's response, or a second worker's (see above); else ``GatewayError``."""
        tried: list[str] = []
        body = self._exchange.parsed.forward_body()
        while True:
            worker = self.route.worker
            try:
                self.response = await self._post(body)
                return self.response
            except RETRYABLE as exc:
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
            except TimeoutError:
                raise GatewayError(
                    504, "the worker did not answer in time", code="upstream_timeout"
                ) from None
            except aiohttp.ClientError as exc:
                raise GatewayError(
                    502, f"worker error: {type(exc).__name__}", code="upstream_error"
                ) from None

    async def resume_elsewhere(
        self, resumer: Resumer, transcript: Transcript
    ) -> tuple[aiohttp.ClientResponse, Splicer] | None:
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
        except (aiohttp.ClientError, TimeoutError):
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

    def close(self) -> None:
        response = self.response
        if response is None:
            return
        if response.content.at_eof():
            response.release()
        else:
            response.close()

    async def _post(self, body: bytes) -> aiohttp.ClientResponse:
        url = f"{self.route.worker.url}/v1/{self._exchange.parsed.endpoint.value}"
        return await self._upstream.client.post(url, data=body, headers=JSON_HEADERS,
                                                timeout=self._timeout)

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
