"""The request path, steps 1-5 (DESIGN.md); step 6 is ``gateway.upstream.proxy``.

1. read the body (refusing more than ``limits.max_body_bytes``) and parse the fields routing needs;
2. tokenize the prompt exactly as vLLM will and build the frozen ``RoutingRequest``;
3. the pools that fit prompt + max output tokens (none: 400 before anything is reserved);
4. reserve the session's KV budget (``BudgetService.admit``: 400/429/503 with OpenAI shapes);
5. the ``Router`` picks the pool and the worker (a failure here gives the reservation back);
6. ``ProxyResponse`` forwards, relays, and at the end releases the reservation.

Each step raises its domain's errors (``ContextLengthExceeded``, ``BudgetError``, ``Overloaded`` ...);
``gateway.errors.from_domain`` gives each its status, code and Retry-After in one place.

Tokenizing is CPU work: prompts above ``INLINE_TOKENIZE_BYTES`` are tokenized in the bounded
``TokenizePool`` so one 100K-token prompt does not stall every other request on the event loop,
and a flood of them waits its turn instead of filling the process with threads; small ones
inline, where a thread hop (~0.2 ms here) would cost more than the tokenization. Measured with
the tiny model's tokenizer: a 16 KB chat body costs ~4 ms to encode unseen and ~0.1 ms as turn N
of a conversation (its earlier turns cached); 128 KB ~33 ms and ~0.7 ms. The body's size cannot
tell the two apart, so the threshold stays where an unseen prompt still costs only a few ms.
Either way a prompt certainly too long for the largest pool is refused before it is encoded, and
rendering + encoding stop at ``limits.tokenize_timeout_s`` (``gateway.prompt.limits``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable
from typing import NoReturn

import aiohttp
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Message

from gateway.auth import ApiKeys
from gateway.budgets.errors import BudgetError
from gateway.budgets.models import Reservation
from gateway.budgets.service import BudgetService
from gateway.config import Priority, Settings
from gateway.errors import GatewayError, from_domain
from gateway.metrics import Metrics
from gateway.overload import AdmissionGate, Overloaded, Slot, priority_for
from gateway.prompt.pool import TokenizePool
from gateway.prompt.render import prompt_token_ids
from gateway.prompt.tokenizer import PromptTokenizer
from gateway.request import Endpoint, ParsedRequest, parse_body, session_id_from
from gateway.routing.router import Router, RoutingError
from gateway.routing.types import RoutingRequest
from gateway.upstream.context import Exchange, HealthReports, Upstream
from gateway.upstream.outcome import Outcome
from gateway.upstream.proxy import ProxyResponse
from gateway.upstream.resume import Resumer, resume_body

INLINE_TOKENIZE_BYTES = 16 * 1024
EARLY_BODY_BYTES = 64 * 1024
"""Bodies up to this Content-Length are read before admission, so a queued request notices its
client leaving (ASGI reports a disconnect only after the body). Larger ones, and bodies of
unknown length, are read once admitted: while queued, their bytes wait in the socket (uvicorn
stops reading a connection at its 64 KiB high-water mark, so reading that much early costs
nothing more), and a request refused by the queue is refused unread. Body memory then grows with
the requests admitted (max_inflight_requests x max_body_bytes at worst), not with connections."""


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
        hash_ahead: Callable[[tuple[int, ...]], None] | None = None,
    ) -> None:
        self._settings = settings
        self._hash_ahead = hash_ahead
        self._router = router
        self._tokenizers = tokenizers
        self._metrics = metrics
        self._budgets = budgets
        self._api_keys = api_keys
        self._kv_bytes_per_token = kv_bytes_per_token
        self._upstream = Upstream(client, router.route, metrics, health, settings.timeouts)
        self._tokenize_pool = TokenizePool(max_workers=1)
        self._largest_context_tokens = max(p.max_context_tokens for p in settings.pools)
        lim = settings.limits
        self.gate = AdmissionGate(lim.max_inflight_requests, lim.max_queued_requests,
                                  lim.queue_timeout_s, fair=lim.fair_queuing,
                                  weights=lim.tenant_weights, batch_share=lim.batch_share)
        self._priorities = {k.name: k.priority for k in settings.auth.api_keys}

    async def handle(self, request: Request, endpoint: Endpoint) -> Response:
        started = time.perf_counter()
        try:
            tenant = self._api_keys.identify(request)
            # A small body is read before admission, a large one after (``EARLY_BODY_BYTES``).
            raw = await read_small_body(request, self._settings.limits.max_body_bytes)
            slot = await self._enter(request if raw is not None else unwatched(request),
                                     tenant)
        except Exception as exc:
            self._refuse(exc)
        try:
            if raw is None:
                raw = await read_body(request, self._settings.limits.max_body_bytes)
            parsed = parse_body(raw, endpoint,
                                default_max_tokens=self._settings.routing.default_max_tokens)
            tokenizer = self._tokenizers.get(parsed.model)
            if tokenizer is None:
                raise GatewayError(
                    404, f"The model `{parsed.model}` does not exist.", param="model",
                    code="model_not_found",
                )
            # the session the client names (none: its tenant's default one, in admit)
            session = session_id_from(request.headers.get("x-session-id"), parsed.user)
            rreq, footprint_tokens = await self._routing_request(tokenizer, parsed, raw, session)
            self._router.pools_that_fit(rreq)  # too long for every pool: refused before admission
            reservation = await self._admit(
                tenant, session,
                footprint_tokens * self._kv_bytes_per_token.get(parsed.model, 0),
                footprint_tokens,
            )
            slot.hold(reservation.kv_bytes)  # the tenant's fair share is charged from now on
            try:
                route = self._router.route(rreq)
            except RoutingError:
                await self._budgets.release(reservation)
                raise
        except BaseException as exc:
            slot.release()
            self._refuse(exc)

        async def release(outcome: Outcome) -> None:
            slot.release()
            total = (outcome.usage or {}).get("total_tokens")
            await self._budgets.release(
                reservation, actual_tokens=total if isinstance(total, int) else None
            )

        m, pool = self._metrics, route.pool.name
        m.child(m.prompt_tokens, pool).inc(rreq.prompt_tokens)
        m.child(m.predicted_cached_tokens, pool).inc(route.decision.predicted_cached_tokens)
        m.child(m.routing_decisions, pool, route.policy, route.decision.reason).inc()
        exchange = Exchange(parsed, rreq, started, self._resumer(tokenizer, parsed))
        return ProxyResponse(self._upstream, exchange, route, on_finish=release)

    def _resumer(self, tokenizer: PromptTokenizer, parsed: ParsedRequest) -> Resumer | None:
        if not (self._settings.routing.resume_streams and parsed.stream and parsed.n == 1
                and parsed.is_chat):
            return None
        # The forwarded body: it carries the output limit the gateway wrote and reserved.
        return functools.partial(resume_body, parsed.forward_body(), tokenizer)

    def _refuse(self, exc: BaseException) -> NoReturn:
        """Raise what the client gets for ``exc``: a domain error as its ``GatewayError`` (the one
        error map), counted as a request refused before any worker was chosen."""
        err = from_domain(exc)
        if err is None:
            raise exc
        self._metrics.child(self._metrics.requests, "none", "none", str(err.status)).inc()
        if err is exc:
            raise exc
        raise err from None

    async def _enter(self, request: Request, tenant: str) -> Slot:
        """Take a slot of the admission gate for ``tenant``, in the class of its key (or lower,
        by ``X-Priority``); while queued, give up if the client leaves."""
        gate = self.gate
        try:
            priority = priority_for(request.headers.get("x-priority"),
                                    self._priorities.get(tenant, Priority.INTERACTIVE))
        except ValueError as exc:
            raise GatewayError(400, str(exc), code="invalid_priority") from None
        slot = gate.try_enter(tenant)
        if slot is not None:
            return slot  # a free slot: no waiting, no tasks
        acquire = asyncio.ensure_future(gate.acquire(tenant, priority))
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
        return acquire.result()

    async def _routing_request(
        self, tokenizer: PromptTokenizer, parsed: ParsedRequest, raw: bytes, session: str | None
    ) -> tuple[RoutingRequest, int]:
        """The routing request, and the request's KV footprint in tokens: every prompt once
        (the n choices of a prompt share its cached blocks) plus every sequence's max output,
        the limit vLLM will apply (``gateway.request``: it is written into the body when the
        client gave none)."""
        # A prompt certainly too long for every pool is refused before it is encoded, and the
        # work on one is cut at limits.tokenize_timeout_s (gateway.prompt.limits).
        max_prompt = self._largest_context_tokens - parsed.max_tokens
        if len(raw) > INLINE_TOKENIZE_BYTES:
            prompts, token_ids = await self._tokenize_pool.run(
                self._off_loop, tokenizer, parsed, max_prompt)
        else:
            prompts = prompt_token_ids(tokenizer, parsed, max_tokens=max_prompt,
                                       timeout_s=self._settings.limits.tokenize_timeout_s)
            token_ids = routed_ids(prompts)
        longest = max(prompts, key=len)
        rreq = RoutingRequest(
            model=parsed.model,
            prompt_tokens=len(longest),
            max_tokens=parsed.max_tokens,
            token_ids=token_ids,
            session_id=session,
            stream=parsed.stream,
        )
        footprint = sum(len(p) for p in prompts) + len(prompts) * parsed.n * parsed.max_tokens
        return rreq, footprint

    def _off_loop(
        self, tokenizer: PromptTokenizer, parsed: ParsedRequest, max_prompt: int
    ) -> tuple[list[list[int]], tuple[int, ...]]:
        """In the tokenizing thread: the prompt's ids, its routing tuple and (through the prefix
        index's ``hash_ahead``) its block hashes, none of which then costs the event loop."""
        prompts = prompt_token_ids(tokenizer, parsed, max_tokens=max_prompt,
                                   timeout_s=self._settings.limits.tokenize_timeout_s)
        token_ids = routed_ids(prompts)
        if token_ids and self._hash_ahead is not None:
            self._hash_ahead(token_ids)
        return prompts, token_ids

    async def _admit(
        self, tenant: str, session: str | None, kv_bytes: int, tokens: int
    ) -> Reservation:
        try:
            return await self._budgets.admit(tenant, session, kv_bytes, tokens)
        except BudgetError as err:
            self._metrics.child(self._metrics.budget_rejections, err.reason).inc()
            raise


def routed_ids(prompts: list[list[int]]) -> tuple[int, ...]:
    """The token ids routing matches against the KV index: the prompt's, when there is one;
    none for a batch of prompts (it is placed by load alone)."""
    return tuple(prompts[0]) if len(prompts) == 1 else ()


async def _client_left(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def read_small_body(request: Request, limit_bytes: int) -> bytes | None:
    """The body when its Content-Length says at most ``EARLY_BODY_BYTES``; None for a larger one
    or one of unknown size, left unread. 413 at once when the length is over ``limit_bytes``."""
    declared = request.headers.get("content-length")
    if declared is None or not declared.isdigit():
        return None
    size = int(declared)
    if size > limit_bytes:
        raise _too_large(limit_bytes)
    return await read_body(request, limit_bytes) if size <= EARLY_BODY_BYTES else None


def unwatched(request: Request) -> Request:
    """``request`` as seen while it waits for admission with its body unread: nobody may receive
    from it (a disconnect watch would consume the body), so a client that leaves is noticed when
    the body is read, once admitted (499, and the slot goes to the next)."""
    return Request(request.scope, _never)


async def _never() -> Message:
    never: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
    return await never  # cancelled when the slot comes, or the queue gives up


async def read_body(request: Request, limit_bytes: int) -> bytes:
    """The whole body, 413 past ``limit_bytes`` (its Content-Length was checked by
    ``read_small_body``: this counts what really comes, e.g. a chunked upload)."""
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
