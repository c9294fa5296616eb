"""Prefill/decode disaggregation: one request served by two workers, in vLLM's two steps.

A disaggregated pool (``pools[].prefill_workers``) computes a prompt's KV on a prefill worker and
generates on a decode worker that pulls that KV over its KV connector (vLLM's ``NixlConnector``),
as vLLM's own disaggregated proxies and vllm-router do:

1. **prefill step**: the same path (``/v1/chat/completions`` or ``/v1/completions``) is POSTed to
   the prefill worker with the forwarded body changed (``prefill_body``): ``kv_transfer_params``
   ``{"do_remote_decode": true, "do_remote_prefill": false, remote_*: null}``, ``stream`` false,
   ``max_tokens`` 1 (and ``max_completion_tokens`` 1 when the body has it), ``n`` 1, no
   ``stream_options``, no ``min_tokens`` (it would exceed the limit of 1). The answer is read
   whole; its top-level ``kv_transfer_params`` (vLLM's ``request_finished`` of the connector's
   scheduler, ``nixl/pull_scheduler.py``: ``do_remote_prefill`` true, ``remote_block_ids`` (one
   list per KV-cache group), ``remote_engine_id``, ``remote_host``, ``remote_port`` ...) says
   where the blocks are; it is passed on verbatim. The prefill worker keeps them until the
   decode side has pulled them, or its lease runs out.
2. **decode step**: the original forwarded body (streamed as the client asked) plus
   ``"kv_transfer_params": <what the prefill returned>`` (``decode_body``) goes to the decode
   worker through the ordinary ``Placement.open``, and its answer is relayed as any other.

Failures of the prefill step: a prefill worker that cannot have started the request
(``never_reached``: refused, connect timeout, reset before any byte) is reported to health and
the step retried once on another prefill worker of the pool (``Router.route_prefill``, excluding
it); any other connection failure is a 502 ``upstream_error``, no answer within
``timeouts.first_token_s`` a 504 ``upstream_timeout``; the worker's 4xx reaches the client as the
worker said it (its ``error`` object); its 5xx (and 401: the gateway's credential) a 502; a 200
without usable ``kv_transfer_params`` (a worker without a KV connector, or one that aborted the
request) a 502 ``prefill_no_kv_transfer``. The decode step keeps ``Placement``'s rules (one
retry on another decode worker when never reached; the prefill's ``kv_transfer_params`` stay
valid, since they name the prefill worker, not the decode one).

A client that leaves during the prefill step cancels the request's task (``ProxyResponse``): the
prefill connection is closed, which makes vLLM abort the prefill, and the holds are released in
``finally`` blocks. A client that leaves after the prefill answered but before the decode pulled
leaves the blocks on the prefill worker until its connector's lease expires (vLLM 0.32's NIXL
``kv_lease_duration``, 30 s by default): vLLM has no call to free them, and its own proxies leave
them so too.

Budget: the dispatcher reserves the prompt's KV twice (the prefill worker's copy and the decode
worker's) plus the output limit. When the decode worker has pulled the prompt (``DecodeHold``:
the decode step's first token, or its whole answer when not streamed; vLLM's NIXL read carries
the notification that frees the prefill worker's blocks, ``nixl/pull_worker.py``
``_read_blocks``) the reservation shrinks to the decode side's footprint
(``BudgetService.shrink``, in a task; the bytes shed are charged byte-seconds for the time they
were held), so each side is charged only while it holds the KV. A decode step that fails before
its first token (an error status, a broken stream, a client that left) keeps both charged until
the release at the request's end. The prefill worker may keep its copy longer than that, until its
lease expires (``kv_lease_duration``, 30 s by default; a decode request vLLM aborts before
scheduling it frees them at once): the reservation does not follow it, it ends with the request.

Load: the prefill worker is held (one request, its uncached prompt tokens) from routing to the
prefill step's end; the decode worker from routing to the end, with no prefill tokens (it pulls,
it does not compute). Cost over a plain request: one JSON parse + dump of the body for the prefill,
one JSON parse of the prefill's small answer, one splice of the decode body, one more round trip
(the prefill itself is what the client waits for in either design). A pool without prefill
workers never reaches this module.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

import orjson

from gateway.config import TimeoutSettings
from gateway.errors import GatewayError, bad_request
from gateway.metrics import Metrics
from gateway.request import Endpoint
from gateway.routing.router import PrefillRoute, Route, RoutingError
from gateway.upstream.client import Response
from gateway.upstream.context import Exchange, Upstream
from gateway.upstream.errors import UpstreamConnectionError, UpstreamError
from gateway.upstream.headers import json_headers
from gateway.upstream.hold import WorkerHold
from gateway.upstream.outcome import Outcome
from gateway.upstream.placement import Placement, never_reached
from gateway.upstream.proxy import ProxyResponse
from gateway.workers.worker import Worker

log = logging.getLogger(__name__)

TWO_STEP_ENDPOINTS = frozenset({Endpoint.CHAT, Endpoint.COMPLETIONS})
"""The routes served in two steps on a disaggregated pool. Every other route (Responses, the
pooling routes) goes to the decode worker alone, as vLLM's proxies send them: a decode worker
with a KV connector computes a request without ``kv_transfer_params`` itself."""

PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}
"""What the prefill request carries: compute the prompt, keep its blocks for a remote decode."""

_DROPPED_FOR_PREFILL = ("stream_options", "min_tokens", "best_of")


class PrefillFailed(GatewayError):
    """The prefill step's failure, with the ``code`` label of its outcome metric; ``answer``: the
    worker's own error object, passed to the client as it is (a 4xx)."""

    def __init__(self, status: int, message: str, *, code: str | None = None,
                 param: str | None = None, type_: str | None = None,
                 outcome: str | None = None, answer: dict[str, Any] | None = None) -> None:
        super().__init__(status, message, code=code, param=param, type_=type_)
        self.outcome = outcome or str(status)
        self.answer = answer

    def body(self) -> dict[str, Any]:
        return self.answer if self.answer is not None else super().body()


def two_step(endpoint: Endpoint, n: int, token_ids: tuple[int, ...]) -> bool:
    """Whether a request on a disaggregated pool runs the prefill step: a chat or completions
    request of one prompt (``token_ids`` is empty for a batch of prompts: vLLM's completions
    answer carries one prompt's ``kv_transfer_params``) and one choice (``n`` > 1 would have
    each choice pull the same blocks, which the prefill side frees after the first pull)."""
    return endpoint in TWO_STEP_ENDPOINTS and n == 1 and bool(token_ids)


def prefill_body(forward: bytes) -> bytes:
    """The prefill step's body from the forwarded one (see the module docstring). Parsed and
    written with orjson (measured here, a 1 MB chat body: 0.4 ms against the standard
    library's 4.0 ms; a short one 1 us against 5 us); a body
    orjson refuses (an integer wider than 64 bits) with the standard library, as
    ``gateway.request`` re-encodes, so such integers survive."""
    try:
        body = orjson.loads(forward)
    except orjson.JSONDecodeError:
        body = None
    if isinstance(body, dict):
        _for_prefill(body)
        try:
            return orjson.dumps(body)
        except TypeError:  # nested beyond orjson's limit on the way out
            pass
    try:
        body = json.loads(forward)
    except (ValueError, RecursionError):
        raise bad_request("request body is nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):  # parse_body admitted an object only
        raise bad_request("request body must be a JSON object", code="invalid_json")
    _for_prefill(body)
    try:
        return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    except RecursionError:
        raise bad_request("request body is nested too deeply", code="invalid_json") from None


def _for_prefill(body: dict[str, Any]) -> None:
    for name in _DROPPED_FOR_PREFILL:
        body.pop(name, None)
    body["stream"] = False
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body["n"] = 1
    body["kv_transfer_params"] = PREFILL_KV_TRANSFER_PARAMS


def decode_body(forward: bytes, kv_transfer_params: bytes) -> bytes:
    """The forwarded body with ``"kv_transfer_params": <the prefill's>`` as its last member (the
    last of duplicate keys is the one a JSON parser keeps; clients may not send the field)."""
    end = forward.rstrip()
    if not end.endswith(b"}"):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    return end[:-1] + b',"kv_transfer_params":' + kv_transfer_params + b"}"


def kv_transfer_params(answer: bytes) -> bytes | None:
    """The prefill answer's ``kv_transfer_params``, re-encoded for the decode body, when usable:
    an object saying ``do_remote_prefill`` with the blocks (a list), the engine id and the host
    (strings) and port (an integer) to pull them from. None otherwise."""
    try:
        obj = orjson.loads(answer)
    except orjson.JSONDecodeError:
        return None
    params = obj.get("kv_transfer_params") if isinstance(obj, dict) else None
    if not (isinstance(params, dict) and params.get("do_remote_prefill") is True
            and isinstance(params.get("remote_block_ids"), list)
            and isinstance(params.get("remote_engine_id"), str)
            and isinstance(params.get("remote_host"), str)
            and isinstance(params.get("remote_port"), int)
            and not isinstance(params.get("remote_port"), bool)):
        return None
    return orjson.dumps(params)


def worker_error(status: int, answer: bytes) -> tuple[str, dict[str, Any] | None]:
    """The message of a worker's error answer and the answer itself when it is vLLM's
    ``{"error": {"message": ...}}``; else a generic message and None."""
    try:
        obj = orjson.loads(answer)
    except orjson.JSONDecodeError:
        obj = None
    err = obj.get("error") if isinstance(obj, dict) else None
    if isinstance(obj, dict) and isinstance(err, dict) and isinstance(err.get("message"), str):
        return err["message"], obj
    return f"the prefill worker answered {status}", None


class DecodeHold(WorkerHold):
    """The decode worker's hold. The relay ends its prefill (``prefill_done``) at the decode
    step's first token, or at its whole answer when not streamed: by then the decode worker has
    pulled the prompt's KV, so that call also reports the pull (``on_pulled``). The call
    ``release`` makes (a decode that failed, or a move to another worker) reports nothing."""

    __slots__ = ("_on_pulled", "_releasing")

    def __init__(self, worker: Worker, pool: str, prefill_tokens: int, metrics: Metrics,
                 on_pulled: Callable[[], None]) -> None:
        self._on_pulled = on_pulled
        self._releasing = False
        super().__init__(worker, pool, prefill_tokens, metrics)

    def prefill_done(self) -> None:
        if not self._releasing:
            self._on_pulled()
        super().prefill_done()

    def release(self) -> None:
        self._releasing = True
        super().release()


class DisaggPlacement(Placement):
    """``Placement`` whose ``open`` runs the prefill step first (``exchange.prefill``), and whose
    decode holds report the pull (``DecodeHold``): the first report runs ``on_pulled`` in a task
    of its own (``pulled_task``), since the relay reports from inside its loop, which must not
    wait for a budget store."""

    __slots__ = ("_first_token_s", "_prefill", "_pulled", "decode_started_s", "on_pulled",
                 "prefill_hold", "prefill_s", "pulled_task")

    def __init__(self, upstream: Upstream, exchange: Exchange, route: Route,
                 timeouts: TimeoutSettings) -> None:
        # before the decode hold is taken (in Placement's constructor), which reports to them
        self._pulled = False
        self.on_pulled: Callable[[], Awaitable[object]] | None = None
        self.pulled_task: asyncio.Future[object] | None = None
        super().__init__(upstream, exchange, route, timeouts)
        assert exchange.prefill is not None
        self._prefill: PrefillRoute = exchange.prefill
        # Held from now on, as the decode worker is: a burst routed before any of its requests
        # runs sees the prefill each one adds.
        self.prefill_hold = self._prefill_hold_on(self._prefill)
        self._first_token_s = timeouts.first_token_s
        self.prefill_s: float | None = None  # the prefill step's duration, once it succeeded
        self.decode_started_s: float | None = None  # perf_counter() when the decode step began

    async def open(self, body: bytes | None = None) -> Response:
        forward = self._exchange.parsed.forward_body()
        params = await self._prefill_step(prefill_body(forward))
        self.decode_started_s = time.perf_counter()
        return await super().open(decode_body(forward, params))

    @property
    def predicted_cached_tokens(self) -> int:
        return self._prefill.decision.predicted_cached_tokens  # the prompt is computed there

    def _uncached_prompt_tokens(self, route: Route) -> int:
        return 0  # the decode worker pulls the prompt's KV; the prefill worker computes it

    def _hold_on(self, route: Route, prefill_tokens: int) -> WorkerHold:
        return DecodeHold(route.worker, route.pool.name, prefill_tokens, self._upstream.metrics,
                          self._pulled_now)

    def _pulled_now(self) -> None:
        if not self._pulled:
            self._pulled = True
            if self.on_pulled is not None:
                self.pulled_task = asyncio.ensure_future(self.on_pulled())

    async def _prefill_step(self, body: bytes) -> bytes:
        """The prefill's ``kv_transfer_params``, from the chosen prefill worker or (when it
        cannot have started the request) one other; else ``PrefillFailed``."""
        tried: list[str] = []
        while True:
            prefill = self._prefill
            try:
                return await self._prefill_on(prefill, body)
            except UpstreamError as exc:
                if not never_reached(exc):
                    raise self._prefill_not_retried(prefill, exc) from None
                self._upstream.health.report_failure(prefill.worker)
                self._count(prefill, "502")
                tried.append(prefill.worker.url)
                log.warning("prefill worker %s unreachable: %s", prefill.worker.url,
                            type(exc).__name__)
                if len(tried) > 1:
                    raise PrefillFailed(502, "the prefill workers chosen for this request are"
                                        " unreachable", code="upstream_unreachable") from None
                reroute = self._upstream.reroute_prefill
                try:
                    if reroute is None:
                        raise RoutingError("no prefill router")
                    self._prefill = reroute(self._exchange.routing_request, self.route.pool,
                                            tried)
                except RoutingError:
                    raise PrefillFailed(
                        502, "prefill worker unreachable and no other healthy prefill worker in"
                        f" pool {self.route.pool.name!r}", code="upstream_unreachable",
                    ) from None
                self.prefill_hold = self._prefill_hold_on(self._prefill)
                m = self._upstream.metrics
                m.child(m.upstream_retries, self.route.pool.name).inc()

    def _prefill_hold_on(self, prefill: PrefillRoute) -> WorkerHold:
        uncached = max(self._exchange.routing_request.prompt_tokens
                       - prefill.decision.predicted_cached_tokens, 0)
        return WorkerHold(prefill.worker, self.route.pool.name, uncached, self._upstream.metrics)

    async def _prefill_on(self, prefill: PrefillRoute, body: bytes) -> bytes:
        pool = self.route.pool
        started = time.perf_counter()
        response: Response | None = None
        # Cancelled unless set below: the client left, or a stream's first_token_s ran out.
        outcome = "499"
        try:
            response = await self._upstream.client.post(
                prefill.worker.url, self._exchange.parsed.endpoint.upstream_path, body,
                json_headers(pool),
                connect_timeout_s=self._connect_s, read_timeout_s=self._first_token_s)
            answer = await response.read()
            outcome = str(response.status)
            params = self._prefill_answer(prefill, response.status, answer)
            outcome = "200"
            self.prefill_s = time.perf_counter() - started
            m = self._upstream.metrics
            m.child(m.prefill_seconds, pool.name, prefill.worker.url).observe(self.prefill_s)
            self._upstream.health.report_request_ok(prefill.worker)
            return params
        except PrefillFailed as err:
            outcome = err.outcome
            raise
        except UpstreamError:
            outcome = ""  # counted by the caller, which knows whether it is retried
            raise
        finally:
            if response is not None:
                response.release()  # kept alive when read whole, else closed: vLLM aborts
            self.prefill_hold.release()
            if outcome:
                self._count(prefill, outcome)

    def _prefill_answer(self, prefill: PrefillRoute, status: int, answer: bytes) -> bytes:
        if status == 200:
            params = kv_transfer_params(answer)
            if params is None:
                log.warning("prefill worker %s answered without usable kv_transfer_params",
                            prefill.worker.url)
                raise PrefillFailed(
                    502, "the prefill worker's answer has no usable kv_transfer_params (is it"
                    " started with a KV connector, e.g. --kv-transfer-config NixlConnector?)",
                    code="prefill_no_kv_transfer")
            return params
        message, error = worker_error(status, answer)
        if status == 401:
            log.warning("prefill worker %s refused the pool's credential (401)",
                        prefill.worker.url)
            raise PrefillFailed(502, "the prefill worker refused the gateway's credential"
                                " (pools[].upstream_api_key_env / upstream_api_key_file)",
                                code="upstream_unauthorized", outcome="401")
        if 400 <= status < 500:  # the request's own fault: as the worker said it
            raise PrefillFailed(status, message, answer=error)
        raise PrefillFailed(502, f"the prefill worker answered {status}: {message}",
                            code="upstream_error", outcome=str(status))

    def _prefill_not_retried(self, prefill: PrefillRoute, exc: UpstreamError) -> PrefillFailed:
        if isinstance(exc, TimeoutError):  # ReadTimeout: no answer within first_token_s
            self._count(prefill, "504")
            return PrefillFailed(504, "the prefill worker did not answer in time"
                                 " (timeouts.first_token_s)", code="upstream_timeout")
        self._count(prefill, "502")
        if isinstance(exc, UpstreamConnectionError):
            self._upstream.health.report_failure(prefill.worker)
            log.warning("prefill worker %s failed a request it may have started: %r",
                        prefill.worker.url, exc)
        return PrefillFailed(502, f"the prefill worker failed: {type(exc).__name__}; not"
                             " retried: it may have started the request", code="upstream_error")

    def _count(self, prefill: PrefillRoute, code: str) -> None:
        m = self._upstream.metrics
        m.child(m.prefill_requests, self.route.pool.name, prefill.worker.url, code).inc()


class DisaggResponse(ProxyResponse):
    """``ProxyResponse`` of a request served in two steps; records the TTFT split, and runs
    ``on_pulled`` (the dispatcher's budget shrink) once the decode worker has pulled the prompt's
    KV (``DisaggPlacement``). ``_finish`` waits for it before ``on_finish`` (the release), so a
    release never overtakes its shrink."""

    placement_class: ClassVar[type[Placement]] = DisaggPlacement

    def __init__(self, upstream: Upstream, exchange: Exchange, route: Route,
                 on_finish: Callable[[Outcome], Awaitable[None]],
                 on_pulled: Callable[[], Awaitable[object]] | None = None) -> None:
        super().__init__(upstream, exchange, route, on_finish)
        placement = self._placement
        assert isinstance(placement, DisaggPlacement)
        placement.on_pulled = on_pulled

    async def _finish(self) -> None:
        # ProxyResponse._finish, except that a decode worker never asked (the prefill step
        # failed, or the client left during it) is not credited with a request that went well:
        # that would close a half-open circuit without its trial.
        placement, outcome = self._placement, self._outcome
        assert isinstance(placement, DisaggPlacement)
        # the prefill hold went at the prefill step's end, unless that step never ran
        placement.prefill_hold.release()
        placement.hold.release()
        started_s = placement.decode_started_s
        if started_s is not None:
            if 0 < outcome.status < 500:
                self._upstream.health.report_request_ok(placement.route.worker)
            if outcome.first_token_s is not None:
                m, pool = self._upstream.metrics, placement.route.pool.name
                m.child(m.decode_first_token, pool, placement.route.worker.url).observe(
                    outcome.first_token_s - started_s)
        outcome.record(self._upstream.metrics, placement.route, self._exchange.started_s)
        if placement.pulled_task is not None:
            try:
                await placement.pulled_task
            except Exception:  # the release below must run whatever the shrink did
                log.exception("shrinking the budget reservation after the KV pull failed")
        await self._on_finish(outcome)

