"""The worker's answer, passed on to the client: whole, streamed event by event, or as an error.

* ``whole``: a non-streamed answer, read whole (bounded by aiohttp's ``sock_read`` = read_s).
  Its ``usage`` is read only when the bytes contain it.
* ``stream``: events are sent on as soon as their terminating blank line arrives
  (``SSESplitter``), as the bytes that came: plain token chunks are not split or parsed
  (``sse.tokens_prefix``); the first token (TTFT), the usage chunk and anything unusual are
  read event by event. The first token must come by the first-token deadline, then each chunk
  within read_s of the one before. The usage chunk the gateway asked for is dropped when the
  client did not ask for it (per-chunk usage is then never asked for:
  ``request.usage_for_gateway_only``, so token chunks pass untouched). A stream that breaks is continued on another worker when resume is
  on (``Placement.resume_elsewhere``), else it ends with an error event; a stall ends with one too.
* ``pass_through``: a worker error (any non-200) reaches the client with its status and body.
* ``error``: the gateway's own error as an OpenAI error body.

Every response carries the routing headers (pool, worker, route reason, prompt tokens), and the
relay fills the request's ``Outcome`` (status, token event times, usage) as it goes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import aiohttp
import orjson
from starlette.types import Send

from gateway.config import TimeoutSettings
from gateway.errors import GatewayError
from gateway.upstream.context import Exchange, HealthReports
from gateway.upstream.outcome import Outcome
from gateway.upstream.placement import Placement
from gateway.upstream.resume import Splicer, Transcript, event_json
from gateway.upstream.sse import (
    Kind,
    SSESplitter,
    classify,
    error_event,
    split_events,
    tokens_prefix,
)

log = logging.getLogger(__name__)

STREAM_FAILURES = (aiohttp.ClientError, TimeoutError)
STREAM_HEADERS = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]


@dataclass(slots=True)
class Relay:
    send: Send
    exchange: Exchange
    placement: Placement
    outcome: Outcome
    timeouts: TimeoutSettings
    health: HealthReports

    async def error(self, err: GatewayError) -> None:
        self.outcome.status = err.status
        await self.send({"type": "http.response.start", "status": err.status,
                         "headers": self._headers("application/json")})
        await self.send({"type": "http.response.body", "body": orjson.dumps(err.body())})

    async def pass_through(self, response: aiohttp.ClientResponse) -> None:
        try:
            body = await response.read()
        except STREAM_FAILURES:
            body = orjson.dumps(GatewayError(response.status, "worker error").body())
        self.outcome.status = response.status
        content_type = response.headers.get("content-type", "application/json")
        await self.send({"type": "http.response.start", "status": response.status,
                         "headers": self._headers(content_type)})
        await self.send({"type": "http.response.body", "body": body})

    async def whole(self, response: aiohttp.ClientResponse) -> None:
        try:
            body = await response.read()
        except TimeoutError:
            await self.error(GatewayError(
                504, "the worker did not answer in time (timeouts.read_s)",
                code="upstream_timeout"))
            return
        except STREAM_FAILURES as exc:
            await self.error(GatewayError(
                502, f"worker failed mid-response: {type(exc).__name__}", code="upstream_error"))
            return
        self.placement.hold.prefill_done()
        if b'"usage"' in body:
            try:
                usage = orjson.loads(body).get("usage")
                self.outcome.usage = usage if isinstance(usage, dict) else None
            except (orjson.JSONDecodeError, AttributeError):
                pass
        self.outcome.status = 200
        content_type = response.headers.get("content-type", "application/json")
        await self.send({"type": "http.response.start", "status": 200,
                         "headers": self._headers(content_type)})
        await self.send({"type": "http.response.body", "body": body})

    async def stream(self, response: aiohttp.ClientResponse,
                     first_token_deadline: float | None) -> None:
        send, o, placement = self.send, self.outcome, self.placement
        o.status = 200
        headers = self._headers("text/event-stream; charset=utf-8") + STREAM_HEADERS
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        resumer = self.exchange.resumer
        transcript = Transcript() if resumer is not None else None
        splicer: Splicer | None = None
        while True:
            try:
                await self._events(response, first_token_deadline, transcript, splicer)
                break
            except TimeoutError:
                o.status = 504
                log.warning("stream from %s timed out", placement.route.worker.url)
                await send({"type": "http.response.body", "more_body": True, "body": error_event(
                    "the worker did not send the next token in time", "upstream_timeout")})
                break
            except STREAM_FAILURES as exc:
                # A broken stream is a failure of the worker: count it toward marking it down.
                self.health.report_failure(placement.route.worker)
                log.warning("stream from %s broke: %s", placement.route.worker.url,
                            type(exc).__name__)
                resumed = None
                if resumer is not None and transcript is not None and splicer is None:
                    resumed = await placement.resume_elsewhere(resumer, transcript)
                if resumed is None:
                    o.status = 502
                    await send({"type": "http.response.body", "more_body": True,
                                "body": error_event(
                                    f"the worker failed mid-stream ({type(exc).__name__})",
                                    "upstream_error")})
                    break
                response, splicer = resumed
        await send({"type": "http.response.body", "body": b""})

    async def _events(
        self, response: aiohttp.ClientResponse, deadline: float | None,
        transcript: Transcript | None, splicer: Splicer | None,
    ) -> None:
        send, o = self.send, self.outcome
        splitter = SSESplitter()
        each_event = transcript is not None or splicer is not None
        read_s = self.timeouts.read_s
        if o.first_token_s is not None:  # a resumed stream: its continuation prefills anew
            deadline = asyncio.get_running_loop().time() + self.timeouts.first_token_s
        async with asyncio.timeout_at(deadline) as first_token:
            async for chunk in response.content.iter_any():
                block = splitter.feed_block(chunk)
                out = b""
                while block and o.first_token_s is None and not each_event:
                    end = block.find(b"\n\n") + 2  # event by event up to the first token
                    out += self._relayed(block[:end], None, None)
                    block = block[end:]
                if block:
                    plain = 0 if each_event else tokens_prefix(block)
                    if plain:  # token chunks only: passed on as they came
                        o.last_token_s = time.perf_counter()
                        o.token_events += block.count(b"\n\n", 0, plain)
                        out += block[:plain]
                    if plain < len(block):
                        out += self._relayed(block[plain:], transcript, splicer)
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
                if o.first_token_s is not None:
                    # from the first token on, only the silence between chunks is bounded
                    first_token.reschedule(asyncio.get_running_loop().time() + read_s)
        tail = splitter.tail()
        if tail.strip():
            await send({"type": "http.response.body", "body": tail + b"\n\n",
                        "more_body": True})

    def _relayed(self, block: bytes, transcript: Transcript | None,
                 splicer: Splicer | None) -> bytes:
        """What the client gets of ``block``, event by event: the usage chunk the gateway asked
        for dropped, a resumed stream's events spliced; the outcome updated."""
        o = self.outcome
        out: list[bytes] = []
        for raw in split_events(block):
            event = classify(raw)
            if event.kind is Kind.CONTENT:
                now = time.perf_counter()
                if o.first_token_s is None:
                    o.first_token_s = now
                    self.placement.hold.prefill_done()
                o.last_token_s = now
                o.token_events += 1
                if event.usage is not None:
                    o.usage = event.usage
            elif event.kind is Kind.USAGE:
                o.usage = event.usage
                if not self.exchange.parsed.client_wants_usage:
                    continue
            if transcript is not None or splicer is not None:
                data = event_json(raw)
                if splicer is not None:
                    rewritten = splicer.rewrite(raw, data)
                    if rewritten is None:
                        continue
                    raw = rewritten
                elif transcript is not None and data is not None:
                    transcript.feed(data)
            out.append(raw)
        return b"".join(out)

    def _headers(self, content_type: str) -> list[tuple[bytes, bytes]]:
        route = self.placement.route
        return [
            (b"content-type", content_type.encode()),
            (b"x-kvgate-pool", route.pool.name.encode()),
            (b"x-kvgate-worker", route.worker.url.encode()),
            (b"x-kvgate-route-reason", route.decision.reason.encode()),
            (b"x-kvgate-prompt-tokens", str(self.exchange.routing_request.prompt_tokens).encode()),
        ]
