"""The two frozen contexts a forwarded request runs in.

``Upstream`` is how the gateway forwards: the hot path's HTTP/1.1 client (``client``:
``gateway.upstream.client``, which forwards every request), the aiohttp session (``session``: the
calls off the hot path, such as a stored Responses answer), the router to pick another worker
with, metrics, passive health reports and the default timeouts. The dispatcher builds it once and
every request shares it. ``Exchange`` is one request as the upstream side sees it: the parsed body,
the routing request, when it arrived and how to resume it. It is built once per request.

Each part of ``gateway.upstream`` takes the one or two contexts it needs instead of a dozen
loose arguments, and the split shows which values are fixed for the gateway and which belong to one
request.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Protocol

import aiohttp

from gateway.config import PoolSettings, TimeoutSettings
from gateway.metrics import Metrics
from gateway.request import ParsedRequest
from gateway.routing.router import PrefillRoute, Route
from gateway.routing.types import RoutingRequest
from gateway.upstream.client import UpstreamClient
from gateway.upstream.resume import Resumer
from gateway.workers.worker import Worker

Reroute = Callable[[RoutingRequest, Collection[str]], Route]
"""``Router.route``: a route for the request, excluding the workers (urls) that failed it."""
ReroutePrefill = Callable[[RoutingRequest, PoolSettings, Collection[str]], PrefillRoute]
"""``Router.route_prefill``: a disaggregated pool's prefill worker, excluding those that failed."""


class HealthReports(Protocol):
    """Where passive health signals go (``gateway.workers.health.HealthMonitor``)."""

    def report_failure(self, worker: Worker) -> None: ...

    def report_request_ok(self, worker: Worker) -> None: ...


@dataclass(frozen=True, slots=True)
class Upstream:
    session: aiohttp.ClientSession  # off the hot path (Dispatcher.stored_response)
    client: UpstreamClient  # every forwarded request
    reroute: Reroute
    metrics: Metrics
    health: HealthReports
    default_timeouts: TimeoutSettings  # a pool's own ``timeouts`` replace these
    reroute_prefill: ReroutePrefill | None = None  # with a disaggregated pool


@dataclass(frozen=True, slots=True, init=False)
class Exchange:
    parsed: ParsedRequest
    routing_request: RoutingRequest
    started_s: float  # time.perf_counter() when the request arrived: TTFT and duration count from it
    resumer: Resumer | None  # set when this stream may be resumed on another worker
    # A stored Responses answer's id and worker, told before the client can see the id: a client
    # continuing at once (through another process or replica) must find its owner recorded.
    on_response: Callable[[str, str], Awaitable[None]] | None = None
    # A disaggregated pool's request served in two steps: its prefill worker
    # (``gateway.upstream.disagg``).
    prefill: PrefillRoute | None = None

    def __init__(
        self, parsed: ParsedRequest, routing_request: RoutingRequest, started_s: float,
        resumer: Resumer | None, on_response: Callable[[str, str], Awaitable[None]] | None = None,
        prefill: PrefillRoute | None = None,
    ) -> None:
        object.__setattr__(self, "parsed", parsed)
        object.__setattr__(self, "routing_request", routing_request)
        object.__setattr__(self, "started_s", started_s)
        object.__setattr__(self, "resumer", resumer)
        object.__setattr__(self, "on_response", on_response)
        object.__setattr__(self, "prefill", prefill)
