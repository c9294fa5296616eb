"""The request path, steps 1-5 (DESIGN.md); step 6 is ``gateway.upstream.proxy``.

1. read the body (refusing more than ``limits.max_body_bytes``) and parse the fields routing needs;
2. tokenize the prompt exactly as vLLM will and build the frozen ``RoutingRequest``;
3. the pools that fit prompt + max output tokens (none: 400 before anything is reserved);
4. reserve the session's KV budget (``BudgetService.admit``: 400/429/503 with OpenAI shapes);
5. the ``Router`` picks the pool and the worker (a failure here gives the reservation back);
   on a disaggregated pool (``pools[].prefill_workers``) a chat or completions request of one
   prompt and one choice also gets its prefill worker (``Router.route_prefill``), its prompt's
   KV is reserved twice (prefill side and decode side) until the decode worker has pulled it
   (then the reservation shrinks to the decode side's), and ``DisaggResponse`` serves it in
   vLLM's two steps (``gateway.upstream.disagg``). With no such pool, one flag is tested;
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
import itertools
import logging
import os
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, NoReturn, TypeVar
from urllib.parse import quote

import aiohttp
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message

from gateway.auth import ApiKeys
from gateway.budgets.errors import BudgetError
from gateway.budgets.models import Reservation
from gateway.budgets.owners import OwnersUnavailable, ResponseOwner, ResponseOwners
from gateway.budgets.service import BudgetService
from gateway.config import MAX_SLO_MS, Priority, Runner, Settings
from gateway.errors import GatewayError, bad_request, from_domain, json_response
from gateway.metrics import Metrics
from gateway.overload import AdmissionGate, Overloaded, Slot, priority_for
from gateway.prompt.pool import TokenizePool
from gateway.prompt.pooling import ScoreEncoding, pooling_token_ids
from gateway.prompt.render import prompt_token_ids
from gateway.prompt.tokenize import tokenize_answer
from gateway.prompt.tokenizer import PromptTokenizer
from gateway.request import (
    MAX_RESPONSE_ID_CHARS,
    SLO_TPOT_HEADER,
    SLO_TTFT_HEADER,
    Endpoint,
    ParsedRequest,
    parse_body,
    parse_detokenize,
    parse_tokenize,
    salted_for,
    session_id_from,
    slo_seconds_from,
)
from gateway.routing.accounting import OUTCOMES, HitLedger, HitRecord, MismatchDetector
from gateway.routing.router import (
    NoHealthyWorker,
    PrefillRoute,
    Route,
    Router,
    RoutingError,
    SloHold,
    SloUnattainable,
)
from gateway.routing.slo import MET, MISSED, SHED, TPOT, TTFT, SloTarget
from gateway.routing.types import RoutingRequest
from gateway.upstream.background import BackgroundWatchers
from gateway.upstream.client import UpstreamClient
from gateway.upstream.context import Exchange, HealthReports, Upstream
from gateway.upstream.disagg import DisaggResponse, two_step
from gateway.upstream.headers import credential
from gateway.upstream.outcome import Outcome
from gateway.upstream.proxy import ProxyResponse
from gateway.upstream.resume import Resumer, resume_body
from gateway.workers.adapters import AdapterError, AdapterLoader, ModelCatalog, Target

log = logging.getLogger(__name__)

NO_OBJECTIVES: tuple[float | None, float | None] = (None, None)

INLINE_TOKENIZE_BYTES = 16 * 1024
EARLY_BODY_BYTES = 64 * 1024
"""Bodies up to this Content-Length are read before admission, so a queued request notices its
client leaving (ASGI reports a disconnect only after the body). Larger ones, and bodies of
unknown length, are read once admitted: while queued, their bytes wait in the socket (the
server, ``gateway.httpd``, stops reading a connection at its 64 KiB high-water mark, so reading
that much early costs nothing more), and a request refused by the queue is refused unread. Body memory then grows with
the requests admitted (max_inflight_requests x max_body_bytes at worst), not with connections."""


class Dispatcher:
    def __init__(
        self,
        settings: Settings,
        router: Router,
        tokenizers: dict[str, PromptTokenizer],
        session: aiohttp.ClientSession,
        client: UpstreamClient,
        metrics: Metrics,
        health: HealthReports,
        budgets: BudgetService,
        api_keys: ApiKeys,
        kv_bytes_per_token: dict[str, int],
        owners: ResponseOwners,
        background: BackgroundWatchers,
        hash_ahead: Callable[[tuple[int, ...], str | None], None] | None = None,
        score_encodings: Mapping[str, ScoreEncoding] | None = None,
        catalog: ModelCatalog | None = None,
        adapters: AdapterLoader | None = None,
    ) -> None:
        self._settings = settings
        self._aliases = settings.model_aliases
        # which served name is which model (or adapter); the loader of cold adapters
        self._catalog = catalog or ModelCatalog(settings.models, router.registry)
        self._adapters = adapters or AdapterLoader(settings.models, session,
                                                   timeout_s=settings.timeouts.connect_s)
        self._background = background  # background Responses: held until their final status
        self._hash_ahead = hash_ahead
        self._owners = owners  # which worker stores each Responses answer
        self._router = router
        self._tokenizers = tokenizers
        self._metrics = metrics
        self._budgets = budgets
        self._api_keys = api_keys
        # Tenants whose prompts get a prefix cache of their own (a derived cache_salt)
        self._isolated = frozenset(k.name for k in settings.auth.api_keys
                                   if k.isolate_prefix_cache)
        self._kv_bytes_per_token = kv_bytes_per_token
        self._score_encodings = score_encodings or {}  # a model's absence: a bi-encoder
        # Some pool serves in two steps (``gateway.upstream.disagg``); when none does, the
        # request path tests this one flag and nothing else of the feature.
        self._disaggregated = any(p.disaggregated for p in settings.pools)
        self._upstream = Upstream(session, client, self._reroute, metrics, health,
                                  settings.timeouts,
                                  router.route_prefill if self._disaggregated else None)
        # Hit accounting (``gateway.routing.accounting``): request ids unique across processes
        # and replicas (a random prefix per process), the last routed requests, the detector.
        self._id_prefix = f"kvg-{os.urandom(4).hex()}-"
        self._ids = itertools.count(1)
        self._hits = HitLedger(settings.routing.explain_requests,
                              detector=MismatchDetector(on_change=self._mismatch_changed))
        for model in settings.models:
            if model.runner is not Runner.POOLING:
                metrics.prefix_mismatch.labels(model.name).set(0)
        self._tokenize_pool = TokenizePool(max_workers=1)
        self._largest_context_tokens = max(p.max_context_tokens for p in settings.pools)
        lim = settings.limits
        self.gate = AdmissionGate(lim.max_inflight_requests, lim.max_queued_requests,
                                  lim.queue_timeout_s, fair=lim.fair_queuing,
                                  weights=lim.tenant_weights, batch_share=lim.batch_share,
                                  long_prompt_tokens=lim.long_prompt_tokens,
                                  reserve_workers=lim.reserve_workers,
                                  active_window_s=lim.active_window_s,
                                  prefill_queues=self._prefill_queues,
                                  guaranteed_share=lim.guaranteed_share)
        self._priorities = {k.name: k.priority for k in settings.auth.api_keys}
        # a key's default latency objectives, in seconds (``gateway.routing.slo``)
        self._slo_defaults = {
            k.name: (None if k.slo_ttft_ms is None else k.slo_ttft_ms / 1e3,
                     None if k.slo_tpot_ms is None else k.slo_tpot_ms / 1e3)
            for k in settings.auth.api_keys if k.slo_ttft_ms or k.slo_tpot_ms}
        # some pool has a default objective: every request's class and time so far matter
        self._pool_slos = any(p.slo.ttft_ms is not None or p.slo.tpot_ms is not None
                              for p in settings.pools)
        self._runners = {m.name: m.runner for m in settings.models}
        self._pooling_models = frozenset(m.name for m in settings.models
                                         if m.runner is Runner.POOLING)

    @property
    def catalog(self) -> ModelCatalog:
        return self._catalog

    @property
    def tokenize_pool(self) -> TokenizePool:
        """The thread long prompts are tokenized in, every tenant's in turn."""
        return self._tokenize_pool

    @property
    def hits(self) -> HitLedger:
        """The hit ledger with every request ended so far settled (their settlements wait in
        ``Metrics.backlog``, off the request path, until a reader like this one flushes it)."""
        self._metrics.backlog.flush()
        return self._hits

    async def handle(self, request: Request, endpoint: Endpoint) -> Response:
        started = time.perf_counter()
        try:
            tenant = self._api_keys.identify(request)
            heads = RequestHeads.of(request.scope["headers"])
            # A small body is read before admission, a large one after (``EARLY_BODY_BYTES``).
            raw = await read_small_body(request, self._settings.limits.max_body_bytes,
                                        heads.content_length)
            # a bad objective: 400 before queueing
            objectives = self._objectives(request, tenant, heads.names_slo)
            slot = await self._enter(request if raw is not None else unwatched(request),
                                     tenant, heads.priority)
        except Exception as exc:
            self._refuse(exc)
        try:
            if raw is None:
                raw = await read_body(request, self._settings.limits.max_body_bytes)
            parsed = parse_body(raw, endpoint,
                                default_max_tokens=self._settings.routing.default_max_tokens,
                                aliases=self._aliases)
            if parsed.cache_salt is not None or tenant in self._isolated:
                parsed = salted_for(parsed, tenant, tenant in self._isolated)
            # an adapter is served as its base model
            target = self._target(parsed.model, tenant)
            tokenizer = self._tokenizers[target.base]
            if (parsed.pooling is not None) != (target.base in self._pooling_models):
                raise _wrong_runner(parsed, self._runners[target.base])
            # the session the client names (none: its tenant's default one, in admit)
            session = session_id_from(heads.session_id, parsed.user)
            owner = (None if parsed.previous_response_id is None
                     else await self._owner(tenant, parsed.previous_response_id))
            rreq, footprint_tokens = await self._routing_request(tokenizer, parsed, raw,
                                                                 tenant, session)
            if target.adapter is not None:
                rreq = replace(rreq, model=target.base, adapter=target.adapter)
            if owner is not None:
                # vLLM prepends the stored conversation to this turn (gateway.budgets.owners)
                rreq = replace(rreq, prompt_tokens=rreq.prompt_tokens + owner.context_tokens,
                               token_ids=(), owner=owner.worker)
                footprint_tokens += owner.context_tokens
            # too long for every pool: refused before admission
            fit = self._router.pools_that_fit(rreq)
            wait = self.gate.room(slot, rreq.prompt_tokens, fit[0].name)
            if wait is not None:  # a long prompt while its pool keeps room for other tenants
                await _unless_client_leaves(request, wait, "waiting for room")
            two_steps = self._disaggregated and two_step(parsed.endpoint, parsed.n, rreq.token_ids)
            kv_tokens = footprint_tokens
            if two_steps and fit[0].disaggregated:
                # The prompt's KV is held twice: on the prefill worker until the decode worker
                # has pulled it, then on the decode worker alone (``gateway.upstream.disagg``
                # shrinks the reservation to ``footprint_bytes`` at the pull). Only when the
                # pool the request goes to unless it spills (``fit[0]``) is disaggregated: one
                # spilled into a disaggregated pool runs in one step, on its decode worker.
                kv_tokens += rreq.prompt_tokens
            bytes_per_token = self._kv_bytes_per_token.get(target.base, 0)
            footprint_bytes = footprint_tokens * bytes_per_token
            reservation = await self._admit(
                tenant, session, kv_tokens * bytes_per_token, footprint_tokens)
            slot.hold(reservation.kv_bytes)  # the tenant's fair share is charged from now on
            prefill: PrefillRoute | None = None
            try:
                route = await self._route(rreq, self._slo_target(heads, tenant, objectives,
                                                                 started)
                                          if objectives != NO_OBJECTIVES or self._pool_slos
                                          else None, self.gate.avoid(slot, fit[0].name))
                slot.routed(route.worker.url)  # a long prompt is counted on its worker
                routed_s = time.perf_counter()
                if kv_tokens > footprint_tokens and route.pool.disaggregated and (
                        rreq.prompt_tokens - route.decision.predicted_cached_tokens
                        >= route.pool.remote_prefill_min_tokens):
                    prefill = self._router.route_prefill(rreq, route.pool)
            except (RoutingError, GatewayError) as exc:
                await self._budgets.release(reservation)
                if isinstance(exc, SloUnattainable):
                    for objective in exc.objectives:
                        self._metrics.child(self._metrics.slo_requests, exc.pool, objective,
                                            SHED).inc()
                raise
            if prefill is None and reservation.kv_bytes > footprint_bytes:
                # Reserved for two steps, routed to one (a pool without prefill workers, or a
                # remainder the decode worker computes itself): the prompt is held once.
                slot.shrink(footprint_bytes)
                reservation = await self._budgets.shrink(reservation,
                                                         footprint_bytes) or reservation
            if rreq.adapter is not None:
                self._adapters.routed(route.worker.url, rreq.adapter)
        except BaseException as exc:
            slot.release()
            self._refuse(exc)
        # One-step chat and completions of one prompt: where their prompt is computed is known.
        hit = (self._routed_hit(rreq, route) if prefill is None and rreq.token_ids
               and parsed.endpoint in (Endpoint.CHAT, Endpoint.COMPLETIONS) else None)

        backlog = self._metrics.backlog

        # The closures below call no sibling closure: compiled, one that did made the request's
        # state a reference cycle (``_settle``).
        async def release(outcome: Outcome) -> None:
            # Generating on after its answer (or maybe, when the answer never came): the
            # reservation, a worker hold and the admission slot stay until its final status.
            background_id = (parsed.background_id if outcome.usage is None
                             and not 400 <= outcome.status < 500 else None)
            if background_id is None:
                slot.release()
            if route.slo is not None:  # a route scored for latency (streams, objectives)
                # bookkeeping only, off the request path (routing with an objective flushes it
                # before it reads the models): never in the way of the budget's release below
                backlog.defer(self._slo_outcome, route, outcome, started, routed_s,
                              parsed.stream and prefill is None)
            if rreq.adapter is not None:
                self._adapters.finished(route.worker.url, rreq.adapter)
            if background_id is not None:
                # The slot too: the gateway's in-flight count and the tenant's fair-share meter
                # (KV byte-seconds) see the generation as they see a foreground one. Released
                # with the answer, any number of background responses ran past
                # ``limits.max_inflight_requests`` and left their tenant first in the fair queue.
                async def ended(usage: Any, response: tuple[str, str] | None) -> None:
                    slot.release()
                    await self._settle(hit, reservation, parsed, tenant, rreq, usage, response)

                await self._hold_background(tenant, background_id, outcome, route,
                                            rreq.total_tokens, ended)
                return
            await self._settle(hit, reservation, parsed, tenant, rreq, outcome.usage,
                               outcome.response)

        # counted off the wave: only a scrape reads these (``gateway.backlog``)
        backlog.defer(self._count_route, route, rreq.prompt_tokens, prefill)
        record_owner: Callable[[str, str], Awaitable[None]] | None = None
        if parsed.store:  # a stored Responses answer (a closure less per other request)
            async def record_owner(response_id: str, worker: str) -> None:
                # the owner before the client sees the id; its true context size at the finish
                await self._record_owner(tenant, (response_id, worker), rreq.total_tokens)

        exchange = Exchange(parsed, rreq, started, self._resumer(tokenizer, parsed),
                            on_response=record_owner, prefill=prefill)
        if prefill is not None:
            # Once the decode worker has pulled the prompt's KV, the prefill worker's copy is
            # gone: the reservation shrinks to the decode side's footprint.
            async def pulled() -> None:
                slot.shrink(footprint_bytes)  # the tenant's fair-share meter, as the budget
                await self._budgets.shrink(reservation, footprint_bytes)

            return DisaggResponse(self._upstream, exchange, route, on_finish=release,
                                  on_pulled=pulled)
        return ProxyResponse(self._upstream, exchange, route, on_finish=release)

    async def _hold_background(
        self, tenant: str, response_id: str, outcome: Outcome, route: Route, tokens: int,
        settle: Callable[[Any, tuple[str, str] | None], Awaitable[None]],
    ) -> None:
        """Hand a background response's holds to its watcher (``gateway.upstream.background``),
        which ends them with ``settle`` on its final object. Its worker: the one that answered,
        else (no answer reached the gateway) the one it was sent to, recorded as its owner so
        the client can still retrieve or cancel it (an id that never reached a worker is that
        worker's 404)."""
        owner = outcome.response or (response_id, route.worker.url)

        async def ended(final: Mapping[str, Any] | None) -> None:
            await settle(None if final is None else final.get("usage"),
                         None if final is None else owner)

        self._background.watch(tenant, owner[0], owner[1], route.pool,
                               route.pool.timeouts or self._settings.timeouts, ended)
        if outcome.response is None:
            await self._record_owner(tenant, owner, tokens)

    async def _owner(self, tenant: str, response_id: str) -> ResponseOwner:
        """The owner of ``tenant``'s stored response, or vLLM's 404 for an id it does not know
        (another tenant's id is one of those)."""
        owner = (await self._owners.get(tenant, response_id)
                 if len(response_id) <= MAX_RESPONSE_ID_CHARS else None)
        if owner is None:
            raise GatewayError(404, f"Response with id '{response_id}' not found.",
                               param="response_id", type_="invalid_request_error",
                               code="response_not_found")
        return owner

    async def _record_owner(self, tenant: str, response: tuple[str, str],
                            context_tokens: int) -> None:
        response_id, worker = response
        try:
            await self._owners.put(response_id, ResponseOwner(tenant, worker, context_tokens))
        except OwnersUnavailable as exc:  # the answer is out already; its next turn will 404
            log.warning("response %s of %s not recorded: %s", response_id, worker, exc)

    async def stored_response(self, request: Request, response_id: str, *,
                              cancel: bool = False) -> Response:
        """``GET /v1/responses/{id}`` (``cancel``: ``POST .../cancel``): asked of the worker that
        stores the response, as it answers; vLLM's 404 for an id the tenant does not own."""
        tenant = self._api_keys.identify(request)
        owner = await self._owner(tenant, response_id)
        route = self._router.route(RoutingRequest(model="", prompt_tokens=0, max_tokens=0,
                                                  tenant=tenant, owner=owner.worker))
        url = f"{route.worker.url}/v1/responses/{quote(response_id, safe='')}"
        timeouts = route.pool.timeouts or self._settings.timeouts
        try:
            async with self._upstream.session.request(
                "POST" if cancel else "GET", url + ("/cancel" if cancel else ""),
                params=request.query_params.multi_items(),
                headers=credential(route.pool),
                timeout=aiohttp.ClientTimeout(connect=timeouts.connect_s,
                                              sock_read=timeouts.read_s),
            ) as answer:
                body = await answer.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise GatewayError(502, f"the worker that stores this response failed:"
                               f" {type(exc).__name__}", code="upstream_error") from None
        if answer.status == 200:
            await self._background.settle(tenant, response_id, body)  # a final status: held no more
        return Response(body, status_code=answer.status,
                        media_type=answer.headers.get("content-type", "application/json"))

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

    async def _enter(self, request: Request, tenant: str, priority_header: str | None) -> Slot:
        """Take a slot of the admission gate for ``tenant``, in the class of its key (or lower,
        by ``X-Priority``); while queued, give up if the client leaves."""
        gate = self.gate
        try:
            priority = priority_for(priority_header,
                                    self._priorities.get(tenant, Priority.INTERACTIVE))
        except ValueError as exc:
            raise GatewayError(400, str(exc), code="invalid_priority") from None
        slot = gate.try_enter(tenant, priority)
        if slot is not None:
            return slot  # a free slot: no waiting, no tasks
        return await _unless_client_leaves(request, gate.acquire(tenant, priority), "queued")

    def _prefill_queues(self, pool: str) -> dict[str, int]:
        """Prompt tokens queued for prefill on each healthy worker of ``pool`` (by url),
        gateway-wide (the admission gate's room for other tenants, ``gateway.overload``)."""
        return {w.url: w.gateway_inflight_prompt_tokens
                for w in self._router.registry.healthy(pool)}

    async def _routing_request(
        self, tokenizer: PromptTokenizer, parsed: ParsedRequest, raw: bytes, tenant: str,
        session: str | None,
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
                self._off_loop, tokenizer, parsed, max_prompt, tenant=tenant)
        else:
            prompts = self._token_ids(tokenizer, parsed, max_prompt)
            token_ids = routed_ids(prompts)
        if not all(prompts):
            # vLLM refuses it too (400), after the gateway would have reserved and routed it;
            # ``truncate_prompt_tokens: 0`` or an empty prompt without special tokens
            raise bad_request("The decoder prompt cannot be empty", code="empty_prompt")
        longest = max(prompts, key=len)
        rreq = RoutingRequest(
            model=parsed.model,
            prompt_tokens=len(longest),
            max_tokens=parsed.max_tokens,
            token_ids=token_ids,
            session_id=session,
            tenant=tenant,  # sessions (affinity) are scoped by it
            stream=parsed.stream,
            request_id=f"{self._id_prefix}{next(self._ids):x}",
            cache_salt=parsed.cache_salt,
            reads_prefix_cache=parsed.reads_prefix_cache,
        )
        footprint = sum(len(p) for p in prompts) + len(prompts) * parsed.n * parsed.max_tokens
        return rreq, footprint

    def _off_loop(
        self, tokenizer: PromptTokenizer, parsed: ParsedRequest, max_prompt: int
    ) -> tuple[list[list[int]], tuple[int, ...]]:
        """In the tokenizing thread: the prompt's ids, its routing tuple and (through the prefix
        index's ``hash_ahead``) its block hashes, none of which then costs the event loop."""
        prompts = self._token_ids(tokenizer, parsed, max_prompt)
        token_ids = routed_ids(prompts)
        if token_ids and self._hash_ahead is not None:
            self._hash_ahead(token_ids, parsed.cache_salt)
        return prompts, token_ids

    def _token_ids(self, tokenizer: PromptTokenizer, parsed: ParsedRequest,
                   max_prompt: int) -> list[list[int]]:
        """Every sequence the request runs: its prompts, or a pooling request's inputs."""
        timeout_s = self._settings.limits.tokenize_timeout_s
        if parsed.pooling is not None:
            return pooling_token_ids(
                tokenizer, parsed.pooling, parsed.body, max_tokens=max_prompt,
                timeout_s=timeout_s,
                scoring=self._score_encodings.get(parsed.model, ScoreEncoding.BI_ENCODER))
        return prompt_token_ids(tokenizer, parsed, max_tokens=max_prompt, timeout_s=timeout_s)

    async def tokenize(self, request: Request, *, detokenize: bool = False) -> Response:
        """``/tokenize`` (``/detokenize``) answered with the model's tokenizer, no worker asked
        (``gateway.prompt.tokenize``): the key checked, its throttles and requests per minute
        applied (a reservation of nothing, released at once), the body bounded by
        ``limits.max_body_bytes``, a large one read with one of its tenant's permits and
        tokenized in the bounded ``TokenizePool`` (in its tenant's turn, as the request path's
        prompts)."""
        tenant = self._api_keys.identify(request)
        # What a throttle or block refuses on the request path it refuses here (the tokenizer
        # is the gateway's CPU), and each call is one of its key's requests per minute.
        session = session_id_from(RequestHeads.of(request.scope["headers"]).session_id, None)
        await self._budgets.release(await self._admit(tenant, session, 0, 0))
        limit = self._settings.limits.max_body_bytes
        raw = await read_small_body(request, limit)
        if raw is not None:
            return await self._tokenize(raw, tenant, detokenize)
        # A large body is read with one of its tenant's few permits (``TokenizePool.reading``):
        # no tenant's connections can each hold a whole body in memory while they wait.
        async with self._tokenize_pool.reading(tenant):
            return await self._tokenize(await read_body(request, limit), tenant, detokenize)

    async def _tokenize(self, raw: bytes, tenant: str, detokenize: bool) -> Response:
        off_loop = len(raw) > INLINE_TOKENIZE_BYTES
        if detokenize:
            model, tokens = parse_detokenize(raw)
            tokenizer = self._tokenizer_for(model, tenant)
            text = (await self._tokenize_pool.run(tokenizer.decode, tokens, tenant=tenant)
                    if off_loop else tokenizer.decode(tokens))
            return json_response(200, {"prompt": text})
        model, asked = parse_tokenize(raw)
        tokenizer = self._tokenizer_for(model, tenant)
        args = (tokenizer, asked, self._largest_context_tokens,
                self._settings.limits.tokenize_timeout_s)
        answer = (await self._tokenize_pool.run(tokenize_answer, *args, tenant=tenant)
                  if off_loop else tokenize_answer(*args))
        return json_response(200, answer)

    def _target(self, model: str, tenant: str) -> Target:
        """What ``model`` (aliases already resolved) names; vLLM's 404 for a name nobody
        serves, nor may load, and the same for one ``tenant``'s key may not use."""
        target = (self._catalog.resolve(model) if self._api_keys.may_use(tenant, model)
                  else None)
        if target is None:
            raise GatewayError(404, f"The model `{model}` does not exist.", param="model",
                               code="model_not_found")
        return target

    def _routed_hit(self, rreq: RoutingRequest, route: Route) -> HitRecord:
        d = route.decision
        return self._hits.routed(rreq.request_id, rreq.model, route.pool, route.policy, d.reason,
                                route.worker.url, rreq.prompt_tokens, route.fleet_best_tokens,
                                d.predicted_cached_tokens, route.candidates, route.held_back,
                                self._router.eviction_probe(route, rreq))

    def _count_route(self, route: Route, prompt_tokens: int, prefill: PrefillRoute | None) -> None:
        m, pool = self._metrics, route.pool.name
        m.add(m.prompt_tokens, (pool,), prompt_tokens)
        m.add(m.predicted_cached_tokens, (pool,),
              route.decision.predicted_cached_tokens if prefill is None
              else prefill.decision.predicted_cached_tokens)  # where the prompt is computed
        m.add(m.routing_decisions, (pool, route.policy, route.decision.reason))
        if prefill is not None:
            m.child(m.prefill_decisions, pool, prefill.decision.reason).inc()

    async def _settle(self, hit: HitRecord | None, reservation: Reservation,
                      parsed: ParsedRequest, tenant: str, rreq: RoutingRequest, usage: Any,
                      response: tuple[str, str] | None) -> None:
        """A request's end, once its usage is known: its hit settled, its reservation released
        with the tokens it used, a stored response's owner recorded.

        A method, not a closure in ``handle`` beside ``release``: compiled (mypyc), a closure
        that calls a sibling closure keeps both in one environment object that each of them
        references, a reference cycle holding the request's whole state (its parsed body, its
        token ids, its reservation and route). Every request's state then waited for the
        garbage collector, whose collections under a flood of 128K-token prompts took 4-18 ms
        on the event loop, traversing those prompts' ids (issue 11, isolation)."""
        if hit is not None:  # read by the ledger's readers, who flush the backlog first
            self._metrics.backlog.defer(self._settle_hit, hit, usage)
        # parsed JSON: a dict (a check against the ``Mapping`` ABC costs ~8x as much)
        total = usage.get("total_tokens") if isinstance(usage, dict) else None
        await self._budgets.release(
            reservation, actual_tokens=total if isinstance(total, int) else None
        )
        if response is not None and parsed.store:
            await self._record_owner(tenant, response,
                                     total if isinstance(total, int) else rreq.total_tokens)

    def _settle_hit(self, hit: HitRecord, usage: Any) -> None:
        m, pool = self._metrics, hit.pool.name
        # the buckets after prompt_tokens are the outcomes, in OUTCOMES order
        for outcome, tokens in zip(OUTCOMES, self._hits.settle(hit, usage)[1:], strict=True):
            if tokens:
                m.add(m.prefix_tokens, (pool, outcome), tokens)

    def _mismatch_changed(self, model: str, flagged: bool) -> None:
        self._metrics.prefix_mismatch.labels(model).set(1 if flagged else 0)

    def _reroute(self, rreq: RoutingRequest, exclude: Collection[str]) -> Route:
        """``Router.route`` for a request leaving its worker (connect retry, resumed stream):
        its hit record follows it to the worker that answers."""
        route = self._router.route(rreq, exclude)
        hit = self._hits.get(rreq.request_id) if rreq.request_id else None
        if hit is not None and hit.buckets is None:
            self._hits.moved(hit, route.policy, route.decision.reason, route.worker.url,
                            route.fleet_best_tokens, route.decision.predicted_cached_tokens,
                            route.candidates, self._router.eviction_probe(route, rreq))
        return route

    def _objectives(self, request: Request, tenant: str,
                    names_slo: bool) -> tuple[float | None, float | None]:
        """The request's TTFT and TPOT objectives in seconds: its ``x-slo-*`` headers (400
        ``invalid_slo`` for a bad one), else its key's defaults (None: none; the pool's
        default, if any, is applied by the router)."""
        ttft_s = tpot_s = None
        # ``names_slo``: from the one pass over the headers (``RequestHeads``); most requests
        # name no objective (two ``getlist`` calls cost ~4 µs a request).
        if names_slo:
            headers = request.headers
            ttft_s = slo_seconds_from(headers.getlist(SLO_TTFT_HEADER), SLO_TTFT_HEADER,
                                      MAX_SLO_MS)
            tpot_s = slo_seconds_from(headers.getlist(SLO_TPOT_HEADER), SLO_TPOT_HEADER,
                                      MAX_SLO_MS)
        default = self._slo_defaults.get(tenant)
        if default is not None:
            ttft_s = default[0] if ttft_s is None else ttft_s
            tpot_s = default[1] if tpot_s is None else tpot_s
        return ttft_s, tpot_s

    def _slo_target(self, heads: RequestHeads, tenant: str,
                    objectives: tuple[float | None, float | None], started_s: float) -> SloTarget:
        """What routing needs of the objectives: them, the request's class (``X-Priority``,
        validated at admission) and the time it has spent in the gateway so far."""
        priority = priority_for(heads.priority,
                                self._priorities.get(tenant, Priority.INTERACTIVE))
        # routing reads the latency models: every stream ended so far observed in them
        self._metrics.backlog.flush()
        return SloTarget(objectives[0], objectives[1], priority,
                         time.perf_counter() - started_s)

    def _slo_outcome(self, route: Route, outcome: Outcome, started_s: float, routed_s: float,
                     measured: bool) -> None:
        """Feed the worker's latency models what it did (a stream computed on one worker:
        ``measured``) and count the objectives met or missed (``gateway.routing.slo``)."""
        placement = route.slo
        if placement is None or not measured:
            return
        first = outcome.first_token_s
        tpot_s: float | None = None
        if first is not None:
            generated = (outcome.usage or {}).get("completion_tokens") or outcome.token_events
            if outcome.last_token_s is not None and isinstance(generated, int) and generated > 1:
                tpot_s = (outcome.last_token_s - first) / (generated - 1)
        m, pool = self._metrics, route.pool.name
        if first is not None and outcome.status == 200:
            model = self._router.slo_model(pool)
            model.observe(placement.prediction, first - routed_s, tpot_s)
            worker = placement.prediction.worker_id
            for objective in (TTFT, TPOT):
                ratio = model.ratio(worker, objective)
                if ratio is not None:
                    m.child(m.slo_prediction_ratio, pool, worker, objective).set(ratio)
        failed = outcome.status >= 500  # the worker's failure misses the objective too
        if placement.ttft_s is not None and (first is not None or failed):
            met = first is not None and first - started_s <= placement.ttft_s
            m.child(m.slo_requests, pool, TTFT, MET if met else MISSED).inc()
        if placement.tpot_s is not None and (tpot_s is not None or failed):
            met = tpot_s is not None and tpot_s <= placement.tpot_s
            m.child(m.slo_requests, pool, TPOT, MET if met else MISSED).inc()

    async def _route(self, rreq: RoutingRequest, slo: SloTarget | None = None,
                     avoid: Collection[str] = ()) -> Route:
        """Step 5; an adapter no healthy worker has loaded is loaded first, when configured
        (``gateway.workers.adapters``). ``slo``: the request's latency objectives; ``avoid``:
        workers the admission gate keeps for others (``AdmissionGate.avoid``)."""
        try:
            return self._router.route(rreq, slo=slo, avoid=avoid)
        except SloHold as hold:  # waits for the requests ahead it would delay (routing.slo)
            return await self._held(rreq, slo, avoid, hold)
        except NoHealthyWorker:
            if rreq.adapter is None or not self._adapters.configured(rreq.adapter):
                raise
        try:
            await self._adapters.ensure_loaded(Target(rreq.model, rreq.adapter),
                                               functools.partial(self._router.place, rreq))
        except AdapterError as exc:
            raise GatewayError(exc.status, str(exc), param="model", code=exc.code) from None
        try:
            return self._router.route(rreq, slo=slo, avoid=avoid)
        except SloHold as hold:
            return await self._held(rreq, slo, avoid, hold)

    async def _held(self, rreq: RoutingRequest, slo: SloTarget | None,
                    avoid: Collection[str], hold: SloHold) -> Route:
        """Route again after each hold, the time held counted against the objective (the
        router holds only while the request can still meet it, so this ends)."""
        while True:
            held = time.perf_counter()
            await asyncio.sleep(hold.wait_s)
            if slo is not None:
                waited = time.perf_counter() - held
                slo = replace(slo, elapsed_s=slo.elapsed_s + waited, held_s=slo.held_s + waited)
            try:
                return self._router.route(rreq, slo=slo, avoid=avoid)
            except SloHold as again:
                hold = again

    def _tokenizer_for(self, model: str | None, tenant: str) -> PromptTokenizer:
        """The named model's tokenizer; with none named, the only model's (as vLLM serving one
        model answers), else 400."""
        if model is None:
            if len(self._tokenizers) != 1:
                raise bad_request("`model` is required: the gateway serves several models",
                                  param="model")
            model = next(iter(self._tokenizers))
        return self._tokenizers[self._target(self._aliases.get(model, model), tenant).base]

    async def _admit(
        self, tenant: str, session: str | None, kv_bytes: int, tokens: int
    ) -> Reservation:
        try:
            return await self._budgets.admit(tenant, session, kv_bytes, tokens)
        except BudgetError as err:
            self._metrics.child(self._metrics.budget_rejections, err.reason).inc()
            raise


def _wrong_runner(parsed: ParsedRequest, runner: Runner) -> GatewayError:
    """A generation route for a pooling model, or a pooling route for a generating one: vLLM
    has no such route for the model; the gateway says why, before any worker is asked."""
    return bad_request(
        f"The model `{parsed.model}` is a {runner.value} model (models[].runner): it does not"
        f" serve {parsed.endpoint.upstream_path}", param="model", code="unsupported_endpoint")


def routed_ids(prompts: list[list[int]]) -> tuple[int, ...]:
    """The token ids routing matches against the KV index: the prompt's, when there is one;
    none for a batch of prompts (it is placed by load alone)."""
    return tuple(prompts[0]) if len(prompts) == 1 else ()


T = TypeVar("T")

_UNREAD = "\0unread"
"""``read_small_body``'s default: the Content-Length header is looked up in the request."""
_HEADS = {b"content-length": 0, b"x-session-id": 1, b"x-priority": 2}


@dataclass(frozen=True, init=False)
class RequestHeads:
    """What the request path reads of a request's headers, found in one pass over them (three
    ``Headers.get`` calls, two of them for headers most requests lack, cost ~4 µs a request more:
    each lowers and encodes its name, scans the list, and a missing one raises ``KeyError``
    inside ``Mapping.get``). Each value is the first header of its name, as ``Headers.get``
    gives it (latin-1); ``names_slo``: some header starts with ``x-slo-``."""

    content_length: str | None
    session_id: str | None
    priority: str | None
    names_slo: bool

    def __init__(
        self, content_length: str | None, session_id: str | None, priority: str | None,
        names_slo: bool,
    ) -> None:
        object.__setattr__(self, "content_length", content_length)
        object.__setattr__(self, "session_id", session_id)
        object.__setattr__(self, "priority", priority)
        object.__setattr__(self, "names_slo", names_slo)

    @classmethod
    def of(cls, raw: Iterable[tuple[bytes, bytes]]) -> RequestHeads:
        found: list[str | None] = [None, None, None]
        names_slo = False
        for name, value in raw:  # ASGI: names are lower case
            i = _HEADS.get(name)
            if i is not None:
                if found[i] is None:
                    found[i] = value.decode("latin-1")
            elif name[:6] == b"x-slo-":
                names_slo = True
        return cls(found[0], found[1], found[2], names_slo)


async def _client_left(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_client_leaves(request: Request, wait: Awaitable[T], what: str) -> T:
    """``await wait`` (a slot of the admission gate, room for a long prompt), or 499 if the
    client leaves first: ``wait`` is cancelled (the gate passes on what it handed over)."""
    waiting = asyncio.ensure_future(wait)
    left = asyncio.ensure_future(_client_left(request))
    try:
        await asyncio.wait({waiting, left}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        left.cancel()
    if not waiting.done():
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError, Overloaded):
            await waiting
        raise GatewayError(499, f"the client closed the connection while {what}",
                           code="client_closed")
    return waiting.result()


async def read_small_body(request: Request, limit_bytes: int,
                          declared: str | None = _UNREAD) -> bytes | None:
    """The body when its Content-Length says at most ``EARLY_BODY_BYTES``; None for a larger one
    or one of unknown size, left unread. 413 at once when the length is over ``limit_bytes``.
    ``declared``: the Content-Length header when already read (``RequestHeads``)."""
    if declared is _UNREAD:
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
    # ``receive`` itself, as ``Request.stream`` does it, without its async generator (~1.3 µs
    # a request); the request's stream is marked consumed as that would.
    if request._stream_consumed:
        raise RuntimeError("Stream consumed")
    chunks: list[bytes] = []
    size = 0
    receive = request.receive
    while True:
        message = await receive()
        kind = message["type"]
        if kind == "http.request":
            chunk = message.get("body", b"")
            if chunk:
                size += len(chunk)
                if size > limit_bytes:
                    raise _too_large(limit_bytes)
                chunks.append(chunk)
            if not message.get("more_body", False):
                break
        elif kind == "http.disconnect":
            raise GatewayError(499, "the client closed the connection mid-upload",
                               code="client_closed")
    request._stream_consumed = True  # a second read is refused, as Request.stream refuses it
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _too_large(limit_bytes: int) -> GatewayError:
    return GatewayError(
        413, f"request body is larger than the gateway's limit of {limit_bytes} bytes",
        code="request_too_large",
    )
