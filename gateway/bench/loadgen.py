"""The load generator of ``kvgate bench``: streams OpenAI requests at a target and times every one.

Two ways to offer load, both over one aiohttp session per target (keep-alive connections):

* closed loop (``concurrency=C``): C users, each sends its next request when its last one is done.
  The offered load adapts to the server, so it measures latency at a fixed parallelism (the right
  tool for curves such as TTFT vs prompt length, at concurrency 1) but hides queueing: a slow server
  simply receives fewer requests.
* open loop (``rate=R``): requests arrive as a Poisson process of R per second (seeded, so every
  target gets the same schedule) whether or not earlier ones are done, the way independent users
  arrive. An overloaded server then shows its queue in TTFT. ``max_inflight`` caps the open
  requests as a safety net; the client's lateness (sent - scheduled) is recorded as ``send_lag``,
  so a capped or stalled client is visible instead of silently turning into a closed loop.

A multiturn request is sent only after the previous turn of its session has finished (in either
mode), as a chat client would; with ``real_answers`` its history carries the answer the server
actually gave instead of the workload's synthetic one.

What is timed, per request, with ``time.perf_counter`` on the client: ``sent`` just before the
request is handed to aiohttp (a pooled connection is usually already open); TTFT = arrival of the
first network chunk carrying generated text (``delta.content`` / ``text``; vLLM's empty role chunk
does not count) - sent; TPOT = (last text chunk - first text chunk) / (completion tokens - 1), with
the completion tokens from ``usage`` (``stream_options.include_usage``), because a server may pack
several tokens into one chunk (vLLM does when the client reads slowly); e2e = end of stream - sent.

A run stops issuing at ``requests`` (the workload's length) or ``duration_s``, whichever comes
first; requests in flight at the deadline get ``drain_s`` more, then are cancelled and counted as
errors (``cancelled``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import aiohttp
import orjson

from gateway.bench.stats import RequestRecord
from gateway.bench.workloads import BenchRequest, Message, Workload, calibration_text
from gateway.upstream.sse import SSESplitter
from gateway.workers.vllm_metrics import parse_vllm_metrics
from gateway.workers.worker import VllmStats

ERROR_TEXT_CHARS = 300


@dataclass(frozen=True)
class Target:
    name: str
    url: str
    """Base URL (``http://host:port``); ``/v1/...`` is appended."""


@dataclass(frozen=True)
class LoadSpec:
    model: str
    concurrency: int = 8
    rate: float | None = None
    """Requests per second (open loop); None: closed loop with ``concurrency`` users."""
    duration_s: float | None = None
    drain_s: float = 30.0
    timeout_s: float = 600.0
    max_inflight: int = 1024
    api: str = "chat"
    """``chat`` (``/v1/chat/completions``) or ``completions`` (``/v1/completions``)."""
    ignore_eos: bool = False
    real_answers: bool = False
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)
    seed: int = 0
    salt: str | None = None
    """Put in front of every prompt (``[salt] ...``): one value per target run keeps the prefixes a
    run shares among its own requests, and none with an earlier run or target on the same workers
    (whose KV cache would otherwise flatter whoever comes second)."""

    def __post_init__(self) -> None:
        if self.api not in ("chat", "completions"):
            raise ValueError("api must be 'chat' or 'completions'")
        if self.rate is not None and self.rate <= 0:
            raise ValueError("rate must be > 0")
        if self.concurrency < 1 or self.max_inflight < 1:
            raise ValueError("concurrency and max_inflight must be >= 1")


@dataclass(frozen=True)
class TargetRun:
    target: Target
    records: tuple[RequestRecord, ...]
    duration_s: float
    workers_before: dict[str, VllmStats | None]
    workers_after: dict[str, VllmStats | None]
    reset_ok: bool | None
    """None: no reset URL given."""
    salt: str | None = None


# -- streamed responses ----------------------------------------------------------------------------


class StreamParser:
    """Consume an OpenAI SSE stream chunk by chunk, noting when generated text arrived."""

    def __init__(self, keep_text: bool = False) -> None:
        self._split = SSESplitter()
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None
        self.chunks = 0
        self.usage: dict[str, Any] | None = None
        self.error: str | None = None
        self.done = False
        """``data: [DONE]`` seen."""
        self.finished = False
        """A choice carried ``finish_reason``."""
        self._text: list[str] | None = [] if keep_text else None

    def feed(self, data: bytes, now_s: float) -> None:
        for raw in self._split.feed(data):
            self._event(raw, now_s)

    def close(self, now_s: float) -> None:
        """The stream ended: an event without its closing blank line still counts."""
        tail = self._split.tail()
        if tail.strip():
            self._event(tail, now_s)

    @property
    def text(self) -> str:
        return "".join(self._text or ())

    @property
    def completion_tokens(self) -> int:
        """From ``usage`` when the server sent it; else one token per text chunk."""
        n = (self.usage or {}).get("completion_tokens")
        return n if isinstance(n, int) else self.chunks

    def _event(self, raw: bytes, now_s: float) -> None:
        lines = [ln[5:].strip() for ln in raw.split(b"\n") if ln.startswith(b"data:")]
        if not lines:
            return  # a comment or keep-alive
        payload = b"\n".join(lines)
        if payload == b"[DONE]":
            self.done = True
            return
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return
        if not isinstance(obj, dict):
            return
        if "error" in obj:
            err = obj["error"]
            msg = err.get("message") if isinstance(err, dict) else err
            self.error = str(msg)[:ERROR_TEXT_CHARS]
            return
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
        got_text = False
        for choice in obj.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            if isinstance(delta, dict):  # chat
                piece = (delta.get("content") or delta.get("reasoning_content")
                         or delta.get("reasoning"))
            else:  # completions
                piece = choice.get("text")
            if isinstance(piece, str) and piece:
                got_text = True
                if self._text is not None:
                    self._text.append(piece)
            if choice.get("finish_reason"):
                self.finished = True
        if got_text:
            self.chunks += 1
            if self.first_token_s is None:
                self.first_token_s = now_s
            self.last_token_s = now_s


def build_body(request: BenchRequest, messages: Sequence[Message], spec: LoadSpec
               ) -> dict[str, Any]:
    body: dict[str, Any] = {"model": spec.model}
    if spec.salt is not None and messages:
        first = messages[0]
        messages = (Message(first.role, f"[{spec.salt}] {first.content}"), *messages[1:])
    if spec.api == "chat":
        body["messages"] = [{"role": m.role, "content": m.content} for m in messages]
    else:
        body["prompt"] = "\n\n".join(m.content for m in messages)
    body.update(
        max_tokens=request.max_tokens,
        stream=True,
        stream_options={"include_usage": True},
    )
    if spec.ignore_eos:
        body["ignore_eos"] = True
    body.update(spec.extra_body)
    return body


# -- progress --------------------------------------------------------------------------------------


class Progress:
    """One self-overwriting stderr line: done/total, in flight, errors, elapsed. No dependency."""

    def __init__(self, enabled: bool, stream: TextIO | None = None) -> None:
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.label = ""
        self.total = 0
        self.done = 0
        self.errors = 0
        self.inflight = 0
        self._t0 = time.monotonic()
        self._task: asyncio.Task[None] | None = None

    def start(self, label: str, total: int) -> None:
        self.label, self.total = label, total
        self.done = self.errors = self.inflight = 0
        self._t0 = time.monotonic()
        if self.enabled:
            self._task = asyncio.get_running_loop().create_task(self._redraw())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
            self._draw()
            self.stream.write("\n")
            self.stream.flush()

    def line(self) -> str:
        width = 24
        frac = self.done / self.total if self.total else 0.0
        bar = "#" * int(frac * width)
        return (f"\r{self.label:<16} [{bar:<{width}}] {self.done}/{self.total}"
                f"  in flight {self.inflight}  errors {self.errors}"
                f"  {time.monotonic() - self._t0:6.1f} s ")

    def _draw(self) -> None:
        self.stream.write(self.line())
        self.stream.flush()

    async def _redraw(self) -> None:
        while True:
            self._draw()
            await asyncio.sleep(0.25)


# -- one run against one target --------------------------------------------------------------------


class _Run:
    def __init__(self, session: aiohttp.ClientSession, target: Target, spec: LoadSpec,
                 progress: Progress) -> None:
        self.session = session
        self.target = target
        self.spec = spec
        self.progress = progress
        self.url = target.url.rstrip("/") + (
            "/v1/chat/completions" if spec.api == "chat" else "/v1/completions")
        self.records: list[RequestRecord] = []
        self.t0 = time.perf_counter()
        self.deadline_s = spec.duration_s if spec.duration_s is not None else math.inf
        self._finished: dict[int, asyncio.Event] = {}
        self._answers: dict[int, str | None] = {}
        self._sent: dict[int, tuple[Message, ...]] = {}

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def past_deadline(self) -> bool:
        return self.now() >= self.deadline_s

    async def phase(self, requests: Iterator[BenchRequest]) -> None:
        if self.past_deadline():
            return
        tasks: list[asyncio.Task[None]]
        if self.spec.rate is None:
            tasks = [asyncio.create_task(self._user(requests))
                     for _ in range(self.spec.concurrency)]
        else:
            tasks = []
            await self._arrivals(requests, tasks)
        wait_s = self.deadline_s + self.spec.drain_s - self.now()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max(wait_s, 0.0)
                                            if math.isfinite(wait_s) else None)
            for t in pending:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _user(self, requests: Iterator[BenchRequest]) -> None:
        while not self.past_deadline():
            request = next(requests, None)
            if request is None:
                return
            await self._one(request, None)

    async def _arrivals(self, requests: Iterator[BenchRequest],
                        tasks: list[asyncio.Task[None]]) -> None:
        assert self.spec.rate is not None
        rng = random.Random(f"{self.spec.seed}:arrivals")
        slots = asyncio.Semaphore(self.spec.max_inflight)
        start = self.now()
        due = start
        for request in requests:
            due += rng.expovariate(self.spec.rate)
            if due >= self.deadline_s:
                self._skip(request)
                return
            delay = due - self.now()
            if delay > 0:
                await asyncio.sleep(delay)
            await slots.acquire()
            task = asyncio.create_task(self._one(request, due))
            task.add_done_callback(lambda _t: slots.release())
            tasks.append(task)

    def _skip(self, request: BenchRequest) -> None:
        self._answers[request.index] = None
        self._event(request.index).set()

    def _event(self, index: int) -> asyncio.Event:
        ev = self._finished.get(index)
        if ev is None:
            ev = self._finished[index] = asyncio.Event()
        return ev

    def _messages(self, request: BenchRequest) -> tuple[Message, ...]:
        if request.prev is None or not self.spec.real_answers:
            return request.messages
        history = self._sent.pop(request.prev, None)
        answer = self._answers.pop(request.prev, None)
        if history is None:
            return request.messages
        n_new = len(request.new_messages)
        synthetic = request.messages[-n_new - 1]
        said = Message("assistant", answer) if answer else synthetic
        return (*history, said, *request.new_messages)

    async def _one(self, request: BenchRequest, scheduled_s: float | None) -> None:
        if request.prev is not None:
            await self._event(request.prev).wait()
            if self.past_deadline():
                self._skip(request)
                return
        messages = self._messages(request)
        if self.spec.real_answers:
            self._sent[request.index] = messages
        body = orjson.dumps(build_body(request, messages, self.spec))
        headers = dict(self.spec.headers)
        if request.session_id is not None:
            headers["X-Session-ID"] = request.session_id
        parser = StreamParser(keep_text=self.spec.real_answers)
        status, error, message = 0, None, None
        self.progress.inflight += 1
        sent = self.now()
        try:
            async with self.session.post(self.url, data=body, headers=headers) as resp:
                status = resp.status
                if status != 200:
                    error = str(status)
                    message = (await resp.text(errors="replace"))[:ERROR_TEXT_CHARS]
                else:
                    async for chunk in resp.content.iter_any():
                        parser.feed(chunk, self.now())
                    parser.close(self.now())
                    if parser.error is not None:
                        error, message = "stream_error", parser.error
                    elif not (parser.done or parser.finished):
                        error = "incomplete_stream"
        except asyncio.CancelledError:
            self._record(request, scheduled_s, sent, 0, "cancelled", None, parser)
            raise
        except TimeoutError:
            error, message = "timeout", f"no answer within {self.spec.timeout_s} s"
        except aiohttp.ClientError as exc:
            error, message = "connection_error", f"{type(exc).__name__}: {exc}"[:ERROR_TEXT_CHARS]
        except Exception as exc:  # a bug or an odd answer must cost one request, not a user
            error, message = "client_error", f"{type(exc).__name__}: {exc}"[:ERROR_TEXT_CHARS]
        self._record(request, scheduled_s, sent, status, error, message, parser)

    def _record(self, request: BenchRequest, scheduled_s: float | None, sent: float, status: int,
                error: str | None, message: str | None, parser: StreamParser) -> None:
        end = self.now()
        usage = parser.usage or {}
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        prompt_tokens = usage.get("prompt_tokens")
        completion = parser.completion_tokens if (parser.usage or parser.chunks) else None
        ttft = parser.first_token_s - sent if parser.first_token_s is not None else None
        tpot = None
        if completion is not None and completion >= 2 and parser.first_token_s is not None:
            assert parser.last_token_s is not None
            tpot = (parser.last_token_s - parser.first_token_s) / (completion - 1)
        self.records.append(RequestRecord(
            index=request.index,
            group=request.group,
            status=status,
            error=error,
            scheduled_s=scheduled_s if scheduled_s is not None else sent,
            sent_s=sent,
            ttft_s=ttft,
            tpot_s=tpot,
            e2e_s=end - sent,
            prompt_tokens=prompt_tokens if isinstance(prompt_tokens, int) else None,
            completion_tokens=completion,
            cached_tokens=cached if isinstance(cached, int) else None,
            approx_prompt_tokens=request.approx_prompt_tokens,
            chunks=parser.chunks,
            session_id=request.session_id,
            message=message,
        ))
        self._answers[request.index] = parser.text if error is None else None
        self._event(request.index).set()
        self.progress.inflight -= 1
        self.progress.done += 1
        if error is not None:
            self.progress.errors += 1


def _session(spec: LoadSpec, connections: int) -> aiohttp.ClientSession:
    headers = {"Content-Type": "application/json", **spec.headers}
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=connections, limit_per_host=connections),
        timeout=aiohttp.ClientTimeout(total=spec.timeout_s, sock_connect=10),
        headers=headers,
    )


async def run_target(target: Target, workload: Workload, spec: LoadSpec, *,
                     worker_urls: Sequence[str] = (), reset_urls: Sequence[str] = (),
                     progress: Progress | None = None) -> TargetRun:
    """Run every phase of ``workload`` against ``target``; read worker metrics around it."""
    progress = progress or Progress(enabled=False)
    connections = spec.max_inflight if spec.rate is not None else spec.concurrency
    async with _session(spec, connections) as session:
        reset_ok = await reset(session, reset_urls) if reset_urls else None
        before = await scrape_workers(session, worker_urls)
        run = _Run(session, target, spec, progress)
        progress.start(target.name, workload.total)
        try:
            for p in range(len(workload.phases)):
                await run.phase(workload.requests(p))
        finally:
            await progress.stop()
        duration = run.now()
        after = await scrape_workers(session, worker_urls)
    records = tuple(sorted(run.records, key=lambda r: r.index))
    return TargetRun(target, records, duration, before, after, reset_ok, spec.salt)


# -- around the run: worker metrics, cache reset, model name, tokenizer calibration ---------------


def metrics_url(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/metrics") else url + "/metrics"


async def scrape_workers(session: aiohttp.ClientSession, urls: Sequence[str]
                         ) -> dict[str, VllmStats | None]:
    async def one(url: str) -> VllmStats | None:
        try:
            async with session.get(metrics_url(url), timeout=aiohttp.ClientTimeout(total=10)
                                   ) as resp:
                if resp.status != 200:
                    return None
                return parse_vllm_metrics(await resp.text())
        except (aiohttp.ClientError, TimeoutError):
            return None

    results = await asyncio.gather(*(one(u) for u in urls))
    return dict(zip(urls, results, strict=True))


async def reset(session: aiohttp.ClientSession, urls: Sequence[str], attempts: int = 10,
                retry_s: float = 0.5, log: Callable[[str], None] | None = None) -> bool:
    """POST every URL (e.g. vLLM's ``/reset_prefix_cache``); retry while a worker is busy."""
    log = log or (lambda m: print(m, file=sys.stderr))
    ok = True
    for url in urls:
        for attempt in range(attempts):
            try:
                async with session.post(url, timeout=aiohttp.ClientTimeout(total=30)) as resp:
                    if resp.status < 300:
                        break
                    # vLLM refuses while requests still run (the previous target's drain)
                    why = f"HTTP {resp.status}: {(await resp.text())[:200]}"
            except (aiohttp.ClientError, TimeoutError) as exc:
                why = f"{type(exc).__name__}: {exc}"
            if attempt == attempts - 1:
                log(f"kvgate bench: reset {url} failed ({why}); continuing warm")
                ok = False
            else:
                await asyncio.sleep(retry_s)
    return ok


async def discover_model(url: str, headers: Mapping[str, str] | None = None) -> str | None:
    """The first model ``GET /v1/models`` lists, or None."""
    try:
        async with aiohttp.ClientSession(headers=headers) as session, session.get(
            url.rstrip("/") + "/v1/models", timeout=aiohttp.ClientTimeout(total=10)
        ) as resp:
            if resp.status != 200:
                return None
            data = (await resp.json()).get("data") or []
            return str(data[0]["id"]) if data else None
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError):
        return None


async def calibrate_tokens_per_word(urls: Sequence[str], model: str,
                                    headers: Mapping[str, str] | None = None,
                                    n_words: int = 2000, probe_url: str | None = None,
                                    api: str = "chat") -> tuple[float, str] | None:
    """Tokens per word of the workload's text.

    From the first URL whose ``/tokenize`` answers (vLLM, the simulator); else from two requests
    to ``probe_url`` (any OpenAI server: a gateway, a router) for ``n_words`` and ``n_words / 2``
    words with ``max_tokens: 1``: the difference of their ``usage.prompt_tokens`` cancels the chat
    template's own tokens.
    """
    text = calibration_text(n_words)
    async with aiohttp.ClientSession(headers=headers) as session:
        for url in urls:
            try:
                async with session.post(
                    url.rstrip("/") + "/tokenize",
                    json={"model": model, "prompt": text, "add_special_tokens": False},
                    timeout=aiohttp.ClientTimeout(total=30),
                ) as resp:
                    if resp.status != 200:
                        continue
                    count = (await resp.json()).get("count")
            except (aiohttp.ClientError, TimeoutError, ValueError):
                continue
            if isinstance(count, int) and count > 0:
                return count / n_words, f"measured on {url}/tokenize"
        if probe_url is not None:
            half = n_words // 2
            full = await _prompt_tokens(session, probe_url, model, api, text)
            part = await _prompt_tokens(session, probe_url, model, api,
                                        " ".join(text.split()[:half]))
            if full is not None and part is not None and full > part:
                return (full - part) / (n_words - half), f"measured by usage from {probe_url}"
    return None


async def _prompt_tokens(session: aiohttp.ClientSession, url: str, model: str, api: str,
                         text: str) -> int | None:
    body: dict[str, Any] = {"model": model, "max_tokens": 1}
    if api == "chat":
        body["messages"] = [{"role": "user", "content": text}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = text
        path = "/v1/completions"
    try:
        async with session.post(url.rstrip("/") + path, json=body,
                                timeout=aiohttp.ClientTimeout(total=120)) as resp:
            if resp.status != 200:
                return None
            n = ((await resp.json()).get("usage") or {}).get("prompt_tokens")
    except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError):
        return None
    return n if isinstance(n, int) else None
