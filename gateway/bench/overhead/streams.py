"""The lean streaming client of the overhead benchmark: ``concurrency`` users post streaming chats
in a loop for a round; each stream is timed from its bytes (TTFT, TPOT, end to end) without
parsing JSON, since wrk cannot see the first token."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp
import orjson

from gateway.bench.overhead.model import STREAM_BODY, Load
from gateway.bench.stats import percentile
from gateway.upstream.sse import SSESplitter


@dataclass(frozen=True)
class StreamTiming:
    """One stream as the client saw it; times in seconds from sending."""

    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float
    ok: bool


CONTENT = b'"content":"'
EMPTY_CONTENT = b'"content":""'


class StreamClock:
    """Times one SSE stream from its bytes: content events are counted with two substring
    searches per block of whole events (the role chunk and the end-of-sequence chunk carry empty
    content and do not count), no JSON is parsed."""

    def __init__(self, sent_s: float) -> None:
        self.sent_s = sent_s
        self._split = SSESplitter()
        self.first_s: float | None = None
        self.last_s: float | None = None
        self.contents = 0
        self.done = False

    def feed(self, data: bytes, now_s: float) -> None:
        block = self._split.feed_block(data)
        if not block:
            return
        n = block.count(CONTENT) - block.count(EMPTY_CONTENT)
        if n > 0:
            if self.first_s is None:
                self.first_s = now_s
            self.last_s = now_s
            self.contents += n
        if b"data: [DONE]" in block:
            self.done = True

    def timing(self, end_s: float) -> StreamTiming:
        ttft = None if self.first_s is None else self.first_s - self.sent_s
        tpot = None
        if self.contents >= 2 and self.first_s is not None and self.last_s is not None:
            tpot = (self.last_s - self.first_s) / (self.contents - 1)
        return StreamTiming(ttft, tpot, end_s - self.sent_s,
                            self.done and self.first_s is not None)


async def _streams(url: str, concurrency: int, duration_s: float) -> tuple[list[StreamTiming],
                                                                          float]:
    body = orjson.dumps(STREAM_BODY)
    timings: list[StreamTiming] = []
    clock = time.perf_counter
    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=concurrency)
    async with aiohttp.ClientSession(
            connector=connector, headers={"Content-Type": "application/json"},
            timeout=aiohttp.ClientTimeout(total=120, sock_connect=10)) as session:
        started = clock()
        deadline = started + duration_s

        async def one() -> None:
            s = StreamClock(clock())
            try:
                async with session.post(url + "/v1/chat/completions", data=body) as resp:
                    if resp.status == 200:
                        async for data in resp.content.iter_any():
                            s.feed(data, clock())
                    else:
                        await resp.read()
            except (aiohttp.ClientError, TimeoutError):
                s.done = False
            timings.append(s.timing(clock()))

        async def user() -> None:
            # at least one stream each: a loop that starts late (a starved machine) still
            # measures something
            await one()
            while clock() < deadline:
                await one()

        await asyncio.gather(*(user() for _ in range(concurrency)))
        return timings, clock() - started


def stream_load(timings: Sequence[StreamTiming], wall_s: float) -> Load:
    """The streams of one round, summed up: every stream started counts, failed ones as errors."""
    ok = [t for t in timings if t.ok]
    ttft = [t.ttft_s * 1000 for t in ok if t.ttft_s is not None]
    tpot = [t.tpot_s * 1000 for t in ok if t.tpot_s is not None]
    e2e = [t.e2e_s * 1000 for t in ok]
    return Load(len(timings), len(timings) - len(ok), len(ok) / wall_s if wall_s > 0 else 0.0,
                percentile(e2e, 0.5), percentile(e2e, 0.99),
                percentile(ttft, 0.5), percentile(ttft, 0.99), percentile(tpot, 0.5))


def run_streams(url: str, concurrency: int, duration_s: float) -> Load:
    import uvloop

    timings, wall_s = uvloop.run(_streams(url, concurrency, duration_s))
    return stream_load(timings, wall_s)
