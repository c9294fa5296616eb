"""What one forwarded request came to, and the metrics it is counted in.

The relay fills an ``Outcome`` as the answer passes through: the status the client got, when the
first and last token events were relayed, how many there were, and vLLM's ``usage``. When the
request ends, the proxy records it (``record``: counted at once, its latencies observed a moment
later, ``gateway.backlog``) and hands it to the dispatcher, which settles the budget reservation on
``usage``.

TTFT is request arrival -> first token event. TPOT is (last - first token event) / (completion
tokens - 1). The completion tokens come from vLLM's usage, or else from the count of token events
(one token per event unless vLLM coalesced several).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.metrics import Metrics
from gateway.routing.router import Route


@dataclass(slots=True, init=False)
class Outcome:
    status: int = 0  # 0: the client went away before an answer started
    first_token_s: float | None = None
    last_token_s: float | None = None
    token_events: int = 0
    usage: dict[str, Any] | None = None
    # A Responses answer: its id, and the worker (url) that sent it and stores it.
    response: tuple[str, str] | None = None

    def __init__(
        self, status: int = 0, first_token_s: float | None = None,
        last_token_s: float | None = None, token_events: int = 0,
        usage: dict[str, Any] | None = None, response: tuple[str, str] | None = None,
    ) -> None:
        self.status = status
        self.first_token_s = first_token_s
        self.last_token_s = last_token_s
        self.token_events = token_events
        self.usage = usage
        self.response = response

    def record(self, metrics: Metrics, route: Route, started_s: float) -> None:
        """Count the request (``kvgate_requests_total``: at once, as every process's count of
        the requests it answered is read from its files) and queue its latencies, whose duration
        ends now, on ``Metrics.backlog`` (only a scrape reads them)."""
        m, pool, worker = metrics, route.pool.name, route.worker.url
        m.add(m.requests, (pool, worker, str(self.status or 499)))  # 499: client left
        m.backlog.defer(self.observe, metrics, route, started_s, time.perf_counter())

    def observe(self, metrics: Metrics, route: Route, started_s: float, ended_s: float) -> None:
        m, pool, worker = metrics, route.pool.name, route.worker.url
        m.observe(m.duration, (pool, worker), ended_s - started_s)
        if self.first_token_s is None:
            return
        m.observe(m.ttft, (pool, worker), self.first_token_s - started_s)
        generated = (self.usage or {}).get("completion_tokens") or self.token_events
        if self.last_token_s is not None and isinstance(generated, int) and generated > 1:
            tpot = (self.last_token_s - self.first_token_s) / (generated - 1)
            m.observe(m.tpot, (pool, worker), tpot)


_LEADING_ID = re.compile(rb'\s*\{\s*"id"\s*:\s*"([^"\\]{1,256})"')


def answer_id(body: bytes) -> str | None:
    """The ``id`` of a JSON answer: read from its first member, where vLLM writes it (no parse
    of the whole answer), else from the parsed object."""
    match = _LEADING_ID.match(body)
    if match is not None:
        return match.group(1).decode()
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    rid = obj.get("id") if isinstance(obj, dict) else None
    return rid if isinstance(rid, str) else None
