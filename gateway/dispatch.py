"""The request path, steps 1-5 (DESIGN.md); step 6 is ``gateway.upstream.proxy``.

1. read the body (refusing more than ``limits.max_body_bytes``) and parse the fields routing needs;
2. tokenize the prompt exactly as vLLM will and build the frozen ``RoutingRequest``;
3. the pools that fit prompt + max output tokens (none: 400 before anything is reserved);
4. reserve the session's KV budget (``BudgetService.admit``: 400/429/503 with OpenAI shapes);
5. the ``Router`` picks the pool and the worker (a failure here gives the reservation back);
6. ``ProxyResponse`` forwards, relays, and at the end releases the reservation.

Tokenizing is CPU work: prompts above ``INLINE_TOKENIZE_BYTES`` are tokenized in a worker thread
so one 100K-token prompt does not stall every other request on the event loop; small ones inline,
where a thread hop would cost more than the tokenization.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time

import aiohttp
import anyio.to_thread
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from gateway.auth import ApiKeys
from gateway.budgets.errors import BudgetError
from gateway.budgets.models import Reservation
from gateway.budgets.service import BudgetService
from gateway.budgets.session_keys import SessionKeys
from gateway.config import Settings
from gateway.errors import GatewayError, bad_request
from gateway.metrics import Metrics
from gateway.overload import AdmissionGate, Overloaded
from gateway.prompt.render import prompt_token_ids
from gateway.prompt.tokenizer import PromptTokenizer, PromptTooComplexError
from gateway.request import Endpoint, ParsedRequest, parse_body, session_id_from
from gateway.routing.router import (
    ContextLengthExceeded,
    NoHealthyWorker,
    PoolSaturated,
    Route,
    Router,
)
from gateway.routing.types import RoutingRequest
from gateway.upstream.proxy import HealthReports, Outcome, ProxyResponse
from gateway.upstream.resume import Resumer, resume_body

INLINE_TOKENIZE_BYTES = 16 * 1024


class Dispatcher:
    def __init__(
        self,
        settings: Settings,
        router: Router,
        tokenizers: dict[str, PromptTokenizer],
        client: aiohttp.ClientSession,
        metrics: Metrics,
        health: HealthReports,
        budgets: BudgetService,
        api_keys: ApiKeys,
        kv_bytes_per_token: dict[str, int],
        session_keys: SessionKeys,
    ) -> None:
        self._settings = settings
        self._router = router
        self._tokenizers = tokenizers
        self._client = client
        self._metrics = metrics
        self._health = health
        self._budgets = budgets
        self._api_keys = api_keys
        self._kv_bytes_per_token = kv_bytes_per_token
        self._session_keys = session_keys
        lim = settings.limits
        self.gate = AdmissionGate(lim.max_inflight_requests, lim.max_queued_requests,
                                  lim.queue_timeout_s)

    async def handle(self, request: Request, endpoint: Endpoint) -> Response:
        started = time.perf_counter()
        try:
            key_name = self._api_keys.identify(request)
            # The body is read before admission so a queued request can notice its client
            # leaving (ASGI reports a disconnect only after the body): at worst
            # (max_inflight + max_queued) bodies of max_body_bytes are held.
            raw = await read_body(request, self._settings.limits.max_body_bytes)
            await self._enter(request)
        except GatewayError as err:
            self._metrics.requests.labels("none", "none", str(err.status)).inc()
            raise
        try:
            parsed = parse_body(raw, endpoint)
            tokenizer = self._tokenizers.get(parsed.model)
            if tokenizer is None:
                raise GatewayError(
                    404, f"The model `{parsed.model}` does not exist.", param="model",
                    code="model_not_found",
                )
            session = session_id_from(request.headers.get("x-session-id"), parsed.user, key_name)
            self._session_keys.note(session, key_name)
            rreq, footprint_tokens = await self._routing_request(tokenizer, parsed, raw, session)
            self._check_fits(rreq)
            reservation = await self._admit(
                session, key_name,
                footprint_tokens * self._kv_bytes_per_token.get(parsed.model, 0),
                footprint_tokens,
            )
            try:
                route = self._route(rreq)
            except GatewayError:
                await self._budgets.release(reservation)
                raise
        except BaseException as err:
            self.gate.release()
            if isinstance(err, GatewayError):
                self._metrics.requests.labels("none", "none", str(err.status)).inc()
            raise

        async def release(_: Route, outcome: Outcome) -> None:
            self.gate.release()
            total = (outcome.usage or {}).get("total_tokens")
            await self._budgets.release(
                reservation, actual_tokens=total if isinstance(total, int) else None
            )

        self._metrics.prompt_tokens.labels(route.pool.name).inc(rreq.prompt_tokens)
        self._metrics.predicted_cached_tokens.labels(route.pool.name).inc(
            route.decision.predicted_cached_tokens
        )
        self._metrics.routing_decisions.labels(
            route.pool.name, route.policy, route.decision.reason
        ).inc()
        return ProxyResponse(
            client=self._client,
            parsed=parsed,
            routing_request=rreq,
            route=route,
            reroute=self._router.route,
            metrics=self._metrics,
            health=self._health,
            on_finish=release,
            started_s=started,
            routing_headers=True,
            default_timeouts=self._settings.timeouts,
            resume=self._resumer(tokenizer, parsed),
        )

    def _resumer(self, tokenizer: PromptTokenizer, parsed: ParsedRequest) -> Resumer | None:
        if not (self._settings.routing.resume_streams and parsed.stream and parsed.n == 1
                and parsed.endpoint is Endpoint.CHAT):
            return None
        return functools.partial(resume_body, parsed.raw, tokenizer)

    async def _enter(self, request: Request) -> None:
        """Take a slot of the admission gate; while queued, give up if the client leaves."""
        gate = self.gate
        try:
            if gate.inflight < gate.max_inflight and not gate.queued:
                await gate.acquire()  # a free slot: no waiting, no tasks
                return
            acquire = asyncio.ensure_future(gate.acquire())
            left = asyncio.ensure_future(_client_left(request))
            try:
                await asyncio.wait({acquire, left}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                left.cancel()
            if not acquire.done():
                acquire.cancel()  # the gate passes a slot it handed us on to the next waiter
                with contextlib.suppress(asyncio.CancelledError, Overloaded):
                    await acquire
                raise GatewayError(499, "the client closed the connection while queued",
                                   code="client_closed")
            acquire.result()
        except Overloaded as exc:
            raise GatewayError(503, str(exc), code="gateway_overloaded",
                               retry_after_s=exc.retry_after_s) from None

    async def _routing_request(
        self, tokenizer: PromptTokenizer, parsed: ParsedRequest, raw: bytes, session: str | None
    ) -> tuple[RoutingRequest, int]:
        """The routing request, and the request's KV footprint in tokens: every prompt once
        (the n choices of a prompt share its cached blocks) plus every sequence's max output."""
        try:
            if len(raw) > INLINE_TOKENIZE_BYTES:
                prompts = await anyio.to_thread.run_sync(prompt_token_ids, tokenizer, parsed)
            else:
                prompts = prompt_token_ids(tokenizer, parsed)
        except PromptTooComplexError as exc:
            raise bad_request(str(exc), param="messages") from None
        longest = max(prompts, key=len)
        max_tokens = parsed.max_tokens or self._settings.routing.default_max_tokens
        rreq = RoutingRequest(
            model=parsed.model,
            prompt_tokens=len(longest),
            max_tokens=max_tokens,
            token_ids=tuple(prompts[0]) if len(prompts) == 1 else (),
            session_id=session,
            stream=parsed.stream,
        )
        footprint = sum(len(p) for p in prompts) + len(prompts) * parsed.n * max_tokens
        return rreq, footprint

    def _check_fits(self, rreq: RoutingRequest) -> None:
        try:
            self._router.pools_that_fit(rreq)
        except ContextLengthExceeded as exc:
            raise GatewayError(
                400, str(exc), param="messages", code="context_length_exceeded"
            ) from None

    async def _admit(
        self, session: str | None, key_name: str | None, kv_bytes: int, tokens: int
    ) -> Reservation:
        try:
            return await self._budgets.admit(session, key_name, kv_bytes, tokens)
        except BudgetError as err:
            self._metrics.budget_rejections.labels(err.reason).inc()
            raise GatewayError(
                err.http_status, err.message, code=err.code, param=err.param, type_=err.type,
                retry_after_s=err.retry_after_s,
            ) from None

    def _route(self, rreq: RoutingRequest) -> Route:
        try:
            return self._router.route(rreq)
        except ContextLengthExceeded as exc:
            raise GatewayError(
                400, str(exc), param="messages", code="context_length_exceeded"
            ) from None
        except NoHealthyWorker as exc:
            raise GatewayError(503, str(exc), code="no_healthy_worker",
                               retry_after_s=2) from None
        except PoolSaturated as exc:
            raise GatewayError(503, str(exc), code="pool_saturated", retry_after_s=1) from None


async def _client_left(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def read_body(request: Request, limit_bytes: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit_bytes:
        raise _too_large(limit_bytes)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit_bytes:
                raise _too_large(limit_bytes)
            chunks.append(chunk)
    except ClientDisconnect:
        raise GatewayError(499, "the client closed the connection mid-upload",
                           code="client_closed") from None
    return b"".join(chunks)


def _too_large(limit_bytes: int) -> GatewayError:
    return GatewayError(
        413, f"request body is larger than the gateway's limit of {limit_bytes} bytes",
        code="request_too_large",
    )
